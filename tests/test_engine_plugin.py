"""Engines and transports are plug-ins: a third engine, defined in this file with its own options
section and added by one `register_engine` call, gets `rollout.recompute.*` (and
`teacher.recompute.*`) in the schema, reads its section, passes validation and runs the real
episode loop, weight update and canary scoring. A fourth transport (`tests/tensorwise_transport.py`,
added by one `register_transport` call) that has no receiver of its own carries a real weight
update into that engine through the receiver the engine returns for it; no package file changes.

The engine is real, not a stand-in: the run's transformers model decoded without a KV cache
(every step recomputes the whole sequence), one prompt at a time.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
import time
from dataclasses import dataclass

import pytest
import tensorwise_transport
import torch
import torch.distributed as dist

from rlcore.config import RolloutConfig
from rlcore.config.errors import ConfigError
from rlcore.engine.base import Generation, RolloutEngine, SamplingParams
from rlcore.engine.hf_engine import sample_with_logprobs
from rlcore.engine.registry import (
    EngineSpec,
    engine_class,
    make_engine,
    register_engine,
    tensor_parallel_size,
    unregister_engine,
    weight_transport,
)
from rlcore.envs import build_env
from rlcore.models.build import build_model, build_tokenizer
from rlcore.plan.compose import compose
from rlcore.plan.placement import placement_problems
from rlcore.plan.teacher import teacher_run_config
from rlcore.plan.validate import problems
from rlcore.trainer.core import free_port
from rlcore.trainer.export import parameter_metas
from rlcore.transfer import (
    TransportSpec,
    first_rank,
    make_receiver,
    make_sender,
    register_transport,
    transfer_options,
    unregister_transport,
    world_size,
)
from rlcore.transfer.plan import TensorMeta, plan_buckets
from rlcore.weights.canary import CanaryError, calibrate, compare_logprobs, teacher_forced_logprobs
from rlcore.weights.protocol import Receiver, Seat


@dataclass
class RecomputeOptions:
    """Options of the recompute engine (`rollout.recompute.*`)."""

    max_tokens: int = 0
    """Tokens a completion may take at most, below `rollout.sampling.max_new_tokens` (0 = no cap)."""


class RecomputeEngine(RolloutEngine):
    """A transformers model sampled without a KV cache."""

    def __init__(self, model: torch.nn.Module, eos_token_id: int, seed: int, max_tokens: int = 0):
        self.model, self.eos_token_id, self.max_tokens = model.eval(), eos_token_id, max_tokens
        self.generator = torch.Generator().manual_seed(seed)
        self.lock = threading.Lock()
        self.policy_version = 0

    @classmethod
    def from_config(cls, options: RecomputeOptions, model, *, seed=0, tokenizer=None, device="cpu"):
        tokenizer = tokenizer if tokenizer is not None else build_tokenizer(model)
        return cls(build_model(model, tokenizer), tokenizer.eos_token_id, seed, options.max_tokens)

    @torch.inference_mode()
    def generate(self, prompts, params: SamplingParams, images=None):
        out = []
        for i, prompt in enumerate(prompts):
            gen = self.generator if params.seed is None else torch.Generator().manual_seed(params.seed + i)
            tokens, logprobs, versions, finish = [], [], [], "length"
            for _ in range(min(params.max_new_tokens, self.max_tokens or params.max_new_tokens)):
                with self.lock:
                    logits = self.model(input_ids=torch.tensor([list(prompt) + tokens])).logits[:, -1]
                    version = self.policy_version
                token, logprob = sample_with_logprobs(logits, params.temperature, params.top_p, gen)
                tokens.append(int(token))
                logprobs.append(float(logprob))
                versions.append(version)
                if tokens[-1] == self.eos_token_id or tokens[-1] in params.stop_token_ids:
                    finish = "stop"
                    break
            out.append(Generation(tokens, logprobs, versions, finish))
        return out

    @torch.inference_mode()
    def score(self, prompt_ids, completion_ids):
        return teacher_forced_logprobs(self.model, [(prompt_ids, completion_ids)])[0]

    def load_weights(self, named_tensors):
        params = dict(self.model.named_parameters())
        with self.lock, torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor)

    def set_version(self, version):
        with self.lock:
            self.policy_version = version

    def state_dict(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def receiver(self, transport: str, seat: Seat) -> Receiver | None:
        """Its own receiver of the `tensorwise` wire; none for another transport (`broadcast`
        then lands weights through `apply_weights`)."""
        return TensorwiseReceiver(seat, self) if transport == "tensorwise" else None


class TensorwiseReceiver(Receiver):
    """The recompute engine's end of the `tensorwise` wire (documented in
    `tests/tensorwise_transport.py`; this code does not import it): each broadcast lands straight
    in its parameter, under the engine's lock, and the version moves with the last one."""

    def __init__(self, seat: Seat, engine: RecomputeEngine):
        self.engine, self.layout = engine, seat.layout
        params = dict(engine.model.named_parameters())
        for name, shape, dtype in self.layout:
            p = params.get(name)
            if p is None or tuple(p.shape) != tuple(shape) or str(p.dtype).removeprefix("torch.") != dtype:
                raise ValueError(f"tensorwise receive: {name} {tuple(shape)} {dtype} does not fit this engine's model")
        self.timeout = datetime.timedelta(seconds=seat.options.timeout_s)
        store = dist.TCPStore(seat.address, seat.port, seat.world_size, is_master=False, timeout=self.timeout)
        self.group = dist.ProcessGroupGloo(store, seat.rank, seat.world_size, self.timeout)

    def receive(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        params = dict(self.engine.model.named_parameters())
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.timeout = 0, self.timeout
        with self.engine.lock, torch.no_grad():
            for name, _, _ in self.layout:
                self.group.broadcast([params[name].data], opts).wait(self.timeout)
            self.engine.policy_version = version
        return {"sync_recv_s": time.perf_counter() - start}


@pytest.fixture(autouse=True, scope="module")
def recompute_engine():
    """The one registry line, for this module's tests only: the section must not outlive them
    (every later config would carry it, and Ray actors cannot import this test module)."""
    register_engine(
        EngineSpec("recompute", f"{__name__}:RecomputeEngine", section="recompute", options=RecomputeOptions)
    )
    yield
    unregister_engine("recompute")
    assert "recompute" not in {f.name for f in dataclasses.fields(RolloutConfig)}


BASE = ["rollout.engine=recompute", "rollout.sampling.max_new_tokens=6"]


def test_validation_knows_the_plugin_and_refuses_other_engines_options():
    assert problems(compose(BASE)) == []
    # another engine's option, typed with this engine selected, changes nothing: refused, that engine named
    with pytest.raises(
        ConfigError,
        match=r"^rollout.vllm.quantization: an option of the vllm engine "
        r"\(rollout.engine=vllm\), not of rollout.engine=recompute",
    ):
        compose([*BASE, "rollout.vllm.quantization=fp8"])
    with pytest.raises(ConfigError, match=r"^rollout.recompute.max_tokens: an option of the recompute engine"):
        compose(["rollout.recompute.max_tokens=2"])  # the default engine is hf
    with pytest.raises(ConfigError, match=r"rollout.recompute.max_tokenz: unknown key in rollout.recompute"):
        compose([*BASE, "rollout.recompute.max_tokenz=2"])
    with pytest.raises(ConfigError, match=r"^rollout.max_tokens: moved to rollout.recompute.max_tokens"):
        compose([*BASE, "rollout.max_tokens=2"])
    unknown = dict(problems(compose(["rollout.engine=nope"])))["rollout.engine"]
    assert "'recompute'" in unknown and "'vllm'" in unknown
    # colocated placement needs the ipc transport, which this engine does not take
    cfg = compose([*BASE, "placement=colocated", "trainer.gpus_per_rank=1", "rollout.gpus_per_actor=1"])
    assert "rollout.engine" in dict(placement_problems(cfg, gpus=1, gpu_bytes=None, where="this machine"))
    # a teacher may use it too
    teacher = compose([*BASE, "teacher.enabled=true", "teacher.engine=recompute", "teacher.recompute.max_tokens=2"])
    assert "teacher.engine" not in dict(problems(teacher))
    assert teacher_run_config(teacher).rollout.recompute.max_tokens == 2  # the teacher's engine gets its section


def test_the_section_reaches_the_engine():
    cfg = compose([*BASE, "rollout.recompute.max_tokens=2"])
    assert problems(cfg) == [] and cfg.rollout.recompute == RecomputeOptions(max_tokens=2)
    tokenizer = build_tokenizer(cfg.model)
    engine = make_engine(cfg, tokenizer, seed=0)
    assert engine.max_tokens == 2
    gens = engine.generate([[5, 6, 7]] * 4, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3))
    assert max(len(g.token_ids) for g in gens) == 2  # capped by the section (sampling allows 6)


def test_plugin_runs_episodes_takes_weights_and_scores_like_the_trainer():
    cfg = compose(BASE)
    assert weight_transport(cfg) == "broadcast" and tensor_parallel_size(cfg.rollout) == 1
    tokenizer = build_tokenizer(cfg.model)
    engine = make_engine(cfg, tokenizer, seed=0)
    assert type(engine) is engine_class("recompute") is RecomputeEngine
    env = build_env(cfg.env)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=7)
    groups = env.run_groups([env.make_task(i, "train") for i in range(2)], 3, engine, tokenizer, params)
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 6 and all(not s.failed for s in samples)
    assert all(len(s.completion_ids) == len(s.logprobs) == len(s.versions) > 0 for s in samples)
    assert all(v == 0 for s in samples for v in s.versions)

    # a weight update: the trainer's model (another seed) lands as version 1
    trainer = build_model(dataclasses.replace(cfg.model, seed=cfg.model.seed + 1), tokenizer)
    engine.apply_weights(trainer.named_parameters(), version=1)
    assert all(torch.equal(engine.state_dict()[n], p) for n, p in trainer.named_parameters())
    (gen,) = engine.generate([samples[0].prompt_ids], params)
    assert set(gen.versions) == {1}

    # the canary's engine side (the contract's default score_batch) against the trainer's logprobs
    pairs = [(s.prompt_ids, s.completion_ids) for s in samples[:2]]
    with torch.no_grad():
        want = teacher_forced_logprobs(trainer, pairs)
    got = engine.score_batch(pairs)
    assert all(g == pytest.approx(w, abs=1e-5) for g, w in zip(got, want))
    assert engine.rng_state() is None and engine.set_rng_state(object()) is False  # no RNG to resume


def test_the_section_leaves_the_schema_classes_unchanged_and_travels_with_the_config():
    import pickle

    from rlcore.config.nodes import config_dict

    assert "recompute" not in {f.name for f in dataclasses.fields(RolloutConfig)}  # registration adds no field
    cfg = compose([*BASE, "rollout.recompute.max_tokens=2"])
    assert config_dict(cfg)["rollout"]["recompute"] == {"max_tokens": 2}  # config.yaml, loggers, checkpoints
    assert pickle.loads(pickle.dumps(cfg)).rollout.recompute == RecomputeOptions(max_tokens=2)  # to the actors
    assert RolloutConfig().recompute == RecomputeOptions()  # a config built in Python reads the defaults
    with pytest.raises(AttributeError, match="no attribute 'recompose'"):
        RolloutConfig().recompose


@pytest.fixture
def tensorwise():
    """The transport and an engine that takes it (the same class, receiving over it), registered
    from outside the package for one test; both leave the tables after it."""
    register_transport(TransportSpec("tensorwise", f"{tensorwise_transport.__name__}:Sender"))
    register_engine(
        EngineSpec(
            "recompute_tw",
            f"{__name__}:RecomputeEngine",
            section="recompute",
            options=RecomputeOptions,
            transports=("tensorwise",),
        )
    )
    yield
    unregister_engine("recompute_tw")
    unregister_transport("tensorwise")


def test_a_transport_from_outside_carries_weights_into_the_engines_own_receiver(tensorwise):
    cfg = compose(["rollout.engine=recompute_tw", "rollout.sampling.max_new_tokens=6", "rollout.num_actors=2"])
    assert problems(cfg) == []
    name = weight_transport(cfg)
    assert name == "tensorwise"
    tokenizer = build_tokenizer(cfg.model)
    engines = [make_engine(cfg, tokenizer, seed=i) for i in range(2)]
    trainer = build_model(dataclasses.replace(cfg.model, seed=cfg.model.seed + 1), tokenizer)
    plan = plan_buckets(
        [TensorMeta(n, s, d) for n, s, d in parameter_metas(trainer)], int(cfg.rollout.sync_bucket_mb * 2**20)
    )
    pairs = [([5, 6, 7, 8], [9, 10, 11]), ([12, 13], [14, 15, 16, 17])]
    with torch.no_grad():
        want = teacher_forced_logprobs(trainer, pairs)
    start_scores = engines[0].score_batch(pairs)  # the engines' start weights: not the trainer's

    # the functions the trainer and rollout actors call (`init_weight_group`), one thread per side
    options, workers, port, out = transfer_options(cfg), tensor_parallel_size(cfg.rollout), free_port(), {}
    size = world_size(name, cfg.rollout.num_actors, workers)
    assert size == 3

    def side(key, work):
        try:
            out[key] = work()
        except BaseException as exc:  # noqa: BLE001 - reported below
            out[key] = exc

    def send():
        sender = make_sender(name, options, plan, "cpu", "127.0.0.1", port, size)
        return sender.send((n, p.detach()) for n, p in trainer.named_parameters())

    def receive(slot):
        receiver = make_receiver(
            name, options, plan, engines[slot], "127.0.0.1", port, first_rank(name, slot, workers), size
        )
        assert type(receiver) is TensorwiseReceiver  # the engine's own, the transport has none
        return receiver.receive(version=1)

    threads = [threading.Thread(target=side, args=("sent", send))] + [
        threading.Thread(target=side, args=(f"got{i}", lambda i=i: receive(i))) for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert out.keys() == {"sent", "got0", "got1"}, out
    assert not any(isinstance(v, BaseException) for v in out.values()), out
    assert out["sent"] == plan.nbytes and set(out["got0"]) == {"sync_recv_s"}
    for engine in engines:
        assert engine.policy_version == 1
        assert all(torch.equal(engine.state_dict()[n], p) for n, p in trainer.named_parameters())
        compare_logprobs(engine.score_batch(pairs), want, max_gap=1e-4, mean_gap=1e-5)  # the canary passes
        (gen,) = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, seed=1))
        assert set(gen.versions) == {1}
    # the canary calibrated on this sync tells the engines' start weights from the trainer's
    bounds = calibrate([compare_logprobs(e.score_batch(pairs), want) for e in engines], 4.0, 0.05, 0.5, 1.0)
    with pytest.raises(CanaryError):
        bounds.check(start_scores, want)


def test_an_engine_listing_an_unregistered_transport_is_refused_in_one_line(tensorwise):
    cfg = compose(["rollout.engine=recompute_tw"])
    unregister_transport("tensorwise")
    assert dict(problems(cfg))["rollout.engine"].startswith(
        "engine 'recompute_tw' receives weights over ['tensorwise'], which no registered transport provides"
    )
