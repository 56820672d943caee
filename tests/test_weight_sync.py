"""The weight-sync plan (buckets, packing) and the transports built on it (`rlcore.transfer`):
the table of sender / receiver pairs, the group's rank arithmetic, and the `broadcast` pair
over gloo moving a real model into a real engine."""

import ast
import dataclasses
import inspect
import threading
from pathlib import Path

import pytest
import torch

from rlcore.engine.base import RolloutEngine
from rlcore.engine.registry import (
    engine_class,
    engine_names,
    engine_spec,
    make_engine,
    tensor_parallel_size,
    weight_transport,
)
from rlcore.engine.vllm.vllm_engine import VLLMEngine
from rlcore.models.build import build_model, build_tokenizer
from rlcore.plan.compose import compose
from rlcore.trainer.core import free_port
from rlcore.trainer.export import parameter_metas
from rlcore.transfer import (
    PAIRS,
    base,
    first_rank,
    make_receiver,
    make_sender,
    own_receiver,
    ranks_per_actor,
    sender_for,
    transfer_options,
    world_size,
)
from rlcore.transfer.plan import (
    TensorMeta,
    iter_buckets,
    plan_buckets,
    unpack_bucket,
    vllm_update_info,
)
from rlcore.weights import protocol as weights_protocol


def metas():
    return [
        TensorMeta("a", (4, 4), "float32"),
        TensorMeta("b", (10,), "float32"),
        TensorMeta("c", (3,), "bfloat16"),
        TensorMeta("d", (100,), "float32"),
    ]


def test_buckets_split_by_size_and_dtype_in_order():
    plan = plan_buckets(metas(), bucket_bytes=26 * 4)
    assert [[m.name for m in b.metas] for b in plan.buckets] == [["a", "b"], ["c"], ["d"]]
    assert plan.names == ["a", "b", "c", "d"]
    assert plan.nbytes == (16 + 10 + 100) * 4 + 3 * 2


def test_pack_unpack_roundtrip():
    plan = plan_buckets(metas(), bucket_bytes=1 << 20)
    tensors = {m.name: torch.randn(m.shape).to(getattr(torch, m.dtype)) for m in metas()}
    out = {}
    for bucket, flat in iter_buckets(plan, iter(tensors.items())):
        out.update(dict(unpack_bucket(bucket, flat.clone())))
    for name, t in tensors.items():
        assert torch.equal(out[name], t)


def test_wrong_order_is_an_error():
    plan = plan_buckets(metas(), bucket_bytes=1 << 20)
    tensors = [(m.name, torch.zeros(m.shape)) for m in reversed(metas())]
    try:
        list(iter_buckets(plan, iter(tensors)))
    except ValueError as exc:
        assert "expected 'a'" in str(exc)
    else:
        raise AssertionError("mismatched order accepted")


def test_every_engines_transport_has_a_sender_and_a_receiver_with_the_common_interface():
    assert {t for e in engine_names() for t in engine_spec(e).transports} <= set(PAIRS)
    assert {"broadcast", "nccl", "ipc"} <= set(PAIRS)
    for name in PAIRS:
        sender = sender_for(name)
        assert issubclass(sender, base.Sender) and not inspect.isabstract(sender), name
        got, want = inspect.signature(sender.__init__), inspect.signature(base.Sender.__init__)
        assert list(got.parameters) == list(want.parameters), name
        receiver = own_receiver(name)
        if receiver is not None:  # the transport's own, for any engine
            assert issubclass(receiver, weights_protocol.Receiver) and not inspect.isabstract(receiver), name
            assert list(inspect.signature(receiver.__init__).parameters) == ["self", "seat", "engine"], name
    # a transport without a receiver of its own is received by every engine that lists it through its hook
    for e in engine_names():
        for t in engine_spec(e).transports:
            if own_receiver(t) is None:
                assert engine_class(e).receiver is not RolloutEngine.receiver, (e, t)
    with pytest.raises(KeyError, match="unknown weight transport 'smoke'"):
        sender_for("smoke")
    # a buffered sender (written before the engines read) is the one each trainer rank holds
    assert [n for n in PAIRS if sender_for(n).buffered] == [n for n in PAIRS if sender_for(n).every_rank]


def test_group_ranks_follow_the_transport():
    cfg = compose(["rollout.num_actors=3"])
    name, workers, n = weight_transport(cfg), tensor_parallel_size(cfg.rollout), cfg.rollout.num_actors
    assert name == "broadcast"
    assert (
        ranks_per_actor(name, workers),
        first_rank(name, 2, workers),
        world_size(name, n, workers),
        world_size(name, 2, workers),
    ) == (1, 3, 4, 3)
    cfg.rollout.engine, cfg.rollout.vllm.tensor_parallel_size = "vllm", 2  # vLLM's workers join one rank each
    name, workers = weight_transport(cfg), tensor_parallel_size(cfg.rollout)
    assert name == "nccl"
    assert (
        ranks_per_actor(name, workers),
        first_rank(name, 2, workers),
        world_size(name, n, workers),
        world_size(name, 2, workers),
    ) == (2, 5, 7, 5)


def test_broadcast_pair_over_gloo_lands_a_model_in_an_engine():
    """Trainer rank 0 and one rollout actor, each in its own thread, over a real gloo group."""
    cfg = compose(["rollout.sync_bucket_mb=0.01"])  # several buckets
    tokenizer = build_tokenizer(cfg.model)
    engine = make_engine(cfg, tokenizer, seed=0)
    trainer = build_model(dataclasses.replace(cfg.model, seed=cfg.model.seed + 1), tokenizer)
    plan = plan_buckets(
        [TensorMeta(n, s, d) for n, s, d in parameter_metas(trainer)], int(cfg.rollout.sync_bucket_mb * 2**20)
    )
    assert len(plan.buckets) > 1
    assert not all(torch.equal(engine.state_dict()[n], p) for n, p in trainer.named_parameters())
    name, options = weight_transport(cfg), transfer_options(cfg)
    port, out = free_port(), {}

    def side(name, work):
        try:
            out[name] = work()
        except BaseException as exc:  # noqa: BLE001 - reported below
            out[name] = exc

    def send():
        sender = make_sender(name, options, plan, "cpu", "127.0.0.1", port, world_size(name, 1))
        return sender.send((n, p.detach()) for n, p in trainer.named_parameters())

    def receive():
        receiver = make_receiver(
            name, options, plan, engine, "127.0.0.1", port, first_rank(name, 0), world_size(name, 1)
        )
        assert type(receiver) is own_receiver(name)  # the transformers engine has no receiver of its own
        return receiver.receive(version=1)

    threads = [threading.Thread(target=side, args=("sent", send)), threading.Thread(target=side, args=("got", receive))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert out.keys() == {"sent", "got"}, out
    assert not any(isinstance(v, BaseException) for v in out.values()), out
    assert out["sent"] == plan.nbytes
    assert set(out["got"]) == {"sync_recv_s", "sync_apply_s"}
    assert engine.policy_version == 1
    state = engine.state_dict()
    assert all(torch.equal(state[n], p) for n, p in trainer.named_parameters())


class EngineCalls:
    """Records what the vLLM engine's own receivers ask of it (vLLM's side runs on GPUs only)."""

    receiver = VLLMEngine.receiver  # the engine's hook itself, over this recorder

    def __init__(self):
        self.calls = []

    def init_weight_transfer(self, *args, **kwargs):
        self.calls.append(("join", args, kwargs))

    def receive_weights(self, update_info, version, timeout_s=None):
        self.calls.append(("nccl", update_info, version, timeout_s))
        return {"worker_s": 0.5}

    def receive_ipc(self, update_info, handle, version, timeout_s=None):
        self.calls.append(("ipc", update_info, handle, version, timeout_s))
        return {"worker_s": 0.25}


class NoReceiverOfItsOwn:
    receiver = RolloutEngine.receiver


def test_vllm_receivers_hand_their_engine_the_plans_update_info():
    cfg = compose(["rollout.sync_bucket_mb=1", "rollout.weight_sync_timeout_s=7"])
    options = transfer_options(cfg)
    plan = plan_buckets(metas(), bucket_bytes=26 * 4)
    info = vllm_update_info(plan, options.bucket_bytes)
    assert info["names"] == plan.names and set(info["dtype_names"]) == {"bfloat16"}
    assert info["shapes"] == [list(m.shape) for b in plan.buckets for m in b.metas]
    assert info["packed_buffer_size_bytes"] == 2**20

    engine = EngineCalls()
    receiver = make_receiver("nccl", options, plan, engine, "10.0.0.1", 4242, 3, 9)
    assert engine.calls == [("join", ("10.0.0.1", 4242, 3, 9), {"timeout_s": 7.0})]
    times = receiver.receive(4)
    assert engine.calls[1] == ("nccl", info, 4, 7.0)
    assert set(times) == {"sync_engine_s", "sync_worker_s"} and times["sync_worker_s"] == 0.5

    with pytest.raises(ValueError, match="IPC handle"):
        make_receiver("ipc", options, plan, engine, "", 0, 1, 2)
    handle = {"uuid": "GPU-0", "args": b""}
    times = make_receiver("ipc", options, plan, engine, "", 0, 1, 2, handle).receive(5)
    assert engine.calls[2] == ("ipc", info, handle, 5, 7.0) and times["sync_worker_s"] == 0.25

    # an engine without a receiver of its own cannot take a transport that has none either
    with pytest.raises(ValueError, match="'nccl' has no receiver of its own and NoReceiverOfItsOwn"):
        make_receiver("nccl", options, plan, NoReceiverOfItsOwn(), "10.0.0.1", 4242, 1, 2)


def imports_of(package_dir: Path, forbidden: str) -> list[str]:
    """`file:line` of every import of `forbidden` (or a module under it) in `package_dir`'s
    Python files, TYPE_CHECKING blocks included."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            if any(n == forbidden or n.startswith(forbidden + ".") for n in names):
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_engines_and_transports_do_not_import_each_other(tmp_path):
    root = Path(__file__).resolve().parents[1] / "rlcore"
    assert imports_of(root / "engine", "rlcore.transfer") == []
    assert imports_of(root / "transfer", "rlcore.engine") == []
    # the check sees a planted violation, also one hidden under TYPE_CHECKING
    (tmp_path / "planted.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlcore.transfer.plan import SyncPlan\n"
    )
    assert imports_of(tmp_path, "rlcore.transfer") == ["planted.py:3"]
    (tmp_path / "planted.py").write_text("import rlcore.engine.registry\n")
    assert imports_of(tmp_path, "rlcore.engine") == ["planted.py:1"]
