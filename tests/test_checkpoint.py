"""Checkpoints: DCP save/load across trainer world sizes, atomic commits (a save that raises or
is killed mid-write leaves the previous checkpoint loadable), keep_last, resume resolution,
metrics-series truncation. No Ray: trainer ranks are plain processes here."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from rlcore.plan.compose import compose
from rlcore.storage import checkpoint as ckpt
from tests.ranks import leave_rank

REPO = Path(__file__).resolve().parent.parent


def _overrides(extra=()):
    return ["trainer.lr=0.01", "mode=sft", "sft.num_examples=8", *extra]


def _batch(cfg, tok, world):
    """A fixed SFT batch, packed for `world` ranks."""
    from rlcore.batch.packing import pack_for_ranks
    from rlcore.sft.dataset import build_dataset

    data = build_dataset(cfg, tok)
    return pack_for_ranks(data.samples, [0.0] * len(data.samples), world, 4096), data


def _rank(rank, world, port, out, action, ckpt_dir):
    """One trainer rank: `save` trains 2 steps, saves, trains a third; `load` loads and trains
    the third. Rank 0 writes full params, full optimizer state and the third step's loss."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor

    from rlcore.trainer.core import TrainerCore

    cfg = compose(_overrides())
    core = TrainerCore(cfg, rank, world)
    shards, _ = _batch(cfg, core.tokenizer, world)
    tokens = sum(int(mb.loss_mask.sum()) for s in shards for mb in s)
    if action == "save":
        for _ in range(2):
            core.sft_step(shards[rank], tokens)
        ckpt.save_trainer(core, ckpt_dir)
    else:
        assert ckpt.load_trainer(core, ckpt_dir) == 2
    full = {n: t.clone() for n, t in core.full_parameters()}  # world 1: full_tensor() is a view
    osd = core.optimizer.state_dict()["state"]
    moments = [
        (v["exp_avg"].full_tensor() if isinstance(v["exp_avg"], DTensor) else v["exp_avg"]).clone()
        for _, v in sorted(osd.items())
    ]
    lr = core.optimizer.param_groups[0]["lr"]
    third = core.sft_step(shards[rank], tokens).metrics["loss"]
    if rank == 0:
        torch.save(
            {
                "params": full,
                "moments": moments,
                "third_loss": third,
                "lr": lr,
                "sched": core.scheduler.state_dict()["last_epoch"],
            },
            out,
        )
    torch.distributed.barrier()  # no rank tears the group down while another still uses it
    core.shutdown()
    leave_rank()


def _spawn(world, action, ckpt_dir, out):
    from rlcore.trainer.core import free_port

    mp.start_processes(
        _rank, args=(world, free_port(), str(out), action, str(ckpt_dir)), nprocs=world, start_method="spawn", join=True
    )
    return torch.load(out)


def test_trainer_checkpoint_reshards_across_world_sizes(tmp_path):
    """Saved by 2 FSDP ranks, loaded by 1: same parameters and Adam moments, same next loss;
    the checkpoint exports to a HF dir whose logits equal the trainer's weights'."""
    saved = _spawn(2, "save", tmp_path / "c", tmp_path / "saved.pt")
    loaded = _spawn(1, "load", tmp_path / "c", tmp_path / "loaded.pt")
    for name, t in saved["params"].items():
        assert torch.equal(loaded["params"][name], t), name
    assert len(saved["moments"]) == len(loaded["moments"]) == len(saved["params"])
    for a, b in zip(saved["moments"], loaded["moments"]):
        assert torch.equal(a, b)
    assert loaded["sched"] == saved["sched"] == 3 and loaded["lr"] == saved["lr"]
    # the next step: same data, same state, different reduction layout -> equal up to rounding
    assert abs(loaded["third_loss"] - saved["third_loss"]) < 1e-5, (loaded["third_loss"], saved["third_loss"])

    # export of a checkpoint written by FSDP ranks reloads with transformers: exact logits
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcore.models.build import build_model, build_tokenizer
    from rlcore.storage.export import export_checkpoint

    ckpt_dir = tmp_path / "c"
    for f in (ckpt.META, ckpt.DRIVER_STATE):  # a bare trainer save: mark it complete by hand
        (ckpt_dir / f).write_text("{}")
    hf = export_checkpoint(ckpt_dir, tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(hf).eval()
    cfg = compose(_overrides())
    ref = build_model(cfg.model, build_tokenizer(cfg.model)).eval()
    # the exported weights are the trainer's at the save (step 2), gathered from 2 shards
    with torch.no_grad():
        missing, unexpected = ref.load_state_dict(saved["params"], strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
        ids = torch.tensor([[1, 5, 9, 14, 20, 33, 2]])
        assert torch.equal(reloaded(ids).logits, ref(ids).logits)
    assert AutoTokenizer.from_pretrained(hf)("abc").input_ids == build_tokenizer(cfg.model)("abc").input_ids


# -- atomic commits ----------------------------------------------------------------------------
def _fake_core(cfg, seed=0):
    """A single-process stand-in for TrainerCore (plain module, no process group)."""
    from rlcore.models.build import build_model, build_tokenizer
    from rlcore.trainer.schedule import build_scheduler

    tok = build_tokenizer(cfg.model)
    model = build_model(cfg.model, tok)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return SimpleNamespace(
        model=model,
        optimizer=opt,
        scheduler=build_scheduler(opt, cfg.trainer, 10),
        rank=0,
        world_size=1,
        version=seed,
        cfg=cfg,
        tokenizer=tok,
    )


def _save(cfg, writer, step, core):
    tmp = writer.begin(step)
    parts = ckpt.save_trainer(core, tmp)
    return writer.commit(tmp, step, {"kind": "rl", "step": step}, parts)


def test_save_that_raises_midway_leaves_previous_checkpoint(tmp_path, monkeypatch):
    cfg = compose([f"output_dir={tmp_path}", "checkpoint.keep_last=2"])
    writer = ckpt.CheckpointWriter(cfg)
    good = _save(cfg, writer, 1, _fake_core(cfg, 1))

    def boom(*a, **k):
        raise OSError("disk full")

    # DCP serialises non-tensor entries with torch.save: the save fails while writing shards
    monkeypatch.setattr(ckpt.torch, "save", boom)
    tmp = writer.begin(2)
    with pytest.raises(RuntimeError, match="disk full"):
        ckpt.save_trainer(_fake_core(cfg, 2), tmp)
    monkeypatch.undo()
    assert ckpt.latest_checkpoint(writer.root) == good
    m = _fake_core(cfg, 0).model
    ckpt.load_model_weights(m, good)
    assert torch.equal(m.state_dict()["lm_head.weight"], _fake_core(cfg, 1).model.state_dict()["lm_head.weight"])
    writer.clean_stale()
    assert not list(writer.root.glob(".tmp-*"))


def test_keep_last_and_resume_resolution(tmp_path):
    cfg = compose([f"output_dir={tmp_path}", "checkpoint.keep_last=2"])
    writer = ckpt.CheckpointWriter(cfg)
    for step in (1, 2, 3):
        _save(cfg, writer, step, _fake_core(cfg, step))
    assert [s for s, _ in ckpt.list_checkpoints(writer.root)] == [2, 3]
    assert ckpt.resolve_resume(compose([f"output_dir={tmp_path}", "resume=true"])).name == "step_00000003"
    assert ckpt.resolve_resume(compose([f"output_dir={tmp_path}", "resume=false"])) is None
    assert ckpt.resolve_resume(compose([f"output_dir={tmp_path}", f"resume={writer.root}"])).name == "step_00000003"
    assert ckpt.resolve_resume(compose([f"output_dir={tmp_path / 'fresh'}", "resume=true"])) is None
    with pytest.raises(ValueError, match="checkpoint.resume"):
        ckpt.resolve_resume(compose([f"output_dir={tmp_path}", f"resume={tmp_path / 'nope'}"]))
    half = writer.root / "step_00000009"
    half.mkdir()
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        ckpt.resolve_resume(compose([f"output_dir={tmp_path}", f"resume={half}"]))


def test_a_save_whose_rank_part_the_driver_does_not_see_is_not_saved(tmp_path):
    """The node-local output of issue 42: the trainer rank writes its part where the driver's
    storage does not hold it (here: its own folder, as on its own node's disk)."""
    cfg = compose([f"output_dir={tmp_path / 'run'}"])
    writer = ckpt.CheckpointWriter(cfg)
    good = _save(cfg, writer, 1, _fake_core(cfg, 1))
    tmp = writer.begin(2)
    parts = ckpt.save_trainer(_fake_core(cfg, 2), tmp_path / "trainer-node-copy")
    assert any(p.startswith("trainer/__0_") for p in parts) and "trainer/.metadata" in parts
    with pytest.raises(
        ckpt.IncompleteCheckpoint, match=r"files the trainer ranks wrote are not in .* as the driver sees"
    ):
        writer.commit(tmp, 2, {"kind": "rl", "step": 2}, parts)
    writer.abort(tmp)
    assert ckpt.list_checkpoints(writer.root) == [(1, good)]
    assert ckpt.resolve_resume(compose([f"output_dir={tmp_path / 'run'}", "resume=true"])) == good


def test_a_checkpoint_missing_a_rank_part_is_not_complete_and_resume_takes_the_newest_complete(tmp_path):
    cfg = compose([f"output_dir={tmp_path}"])
    writer = ckpt.CheckpointWriter(cfg)
    good = _save(cfg, writer, 1, _fake_core(cfg, 1))
    damaged = _save(cfg, writer, 2, _fake_core(cfg, 2))
    assert json.loads((damaged / "meta.json").read_text())["parts"]["trainer/.metadata"] > 0
    shard = next((damaged / "trainer").glob("__0_*.distcp"))
    shard.unlink()  # rank 0's part never reached the storage (or was lost)
    assert not ckpt.is_complete(damaged)
    assert ckpt.latest_checkpoint(writer.root) == good
    assert ckpt.resolve_resume(compose([f"output_dir={tmp_path}", "resume=true"])) == good
    with pytest.raises(ValueError, match=f"not a complete checkpoint .*parts are missing: trainer/{shard.name}"):
        ckpt.resolve_resume(compose([f"output_dir={tmp_path}", f"resume={damaged}"]))
    shard.write_bytes(b"x")  # a truncated part is missing too
    assert not ckpt.is_complete(damaged)


KILL_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {repo!r})
    from tests.test_checkpoint import _fake_core, _save
    from rlcore.storage import checkpoint as ckpt
    from rlcore.plan.compose import compose
    cfg = compose(["output_dir={out}", "checkpoint.keep_last=0", "model.arch.hidden_size=512",
                   "model.arch.intermediate_size=2048", "model.arch.head_dim=128"])
    writer = ckpt.CheckpointWriter(cfg)
    step = 0
    while True:
        step += 1
        _save(cfg, writer, step, _fake_core(cfg, step))
        print(step, flush=True)
""")


def test_save_killed_mid_write_leaves_previous_checkpoint(tmp_path):
    """SIGKILL a process that saves checkpoints back to back (~50 MB each, so most of its time
    is spent writing): every committed checkpoint still loads, the newest is the one resumed,
    and the interrupted save is only a `.tmp-*` directory."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT.format(repo=str(REPO), out=tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "1"  # one checkpoint committed
        root = tmp_path / "checkpoints"
        deadline = time.time() + 60
        while not list(root.glob(".tmp-*")) and time.time() < deadline:
            time.sleep(0.005)  # kill while the next save is being written
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    cfg = compose(
        [
            f"output_dir={tmp_path}",
            "model.arch.hidden_size=512",
            "model.arch.intermediate_size=2048",
            "model.arch.head_dim=128",
        ]
    )
    committed = ckpt.list_checkpoints(root)
    assert committed, "no checkpoint survived"
    assert ckpt.resolve_resume(compose([f"output_dir={tmp_path}", "resume=true"])) == committed[-1][1]
    for step, path in committed:
        m = _fake_core(cfg, 0).model
        ckpt.load_model_weights(m, path)
        expect = _fake_core(cfg, step).model.state_dict()["model.norm.weight"]
        assert torch.equal(m.state_dict()["model.norm.weight"], expect), step
        assert ckpt.load_driver_state(path)["step"] == step


def test_truncate_series_drops_rows_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [
        {"step": 1, "loss": 1},
        {"step": 2, "loss": 2},
        {"step": 2, "eval/reward_mean": 0.5},
        {"step": 3, "loss": 3},
        {"step": 3, "eval/reward_mean": 0.6},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ckpt.truncate_series(path, 2) == 2
    assert [json.loads(x) for x in path.read_text().splitlines()] == rows[:3]
    assert ckpt.truncate_series(path, 2, drop_eval_at_step=True) == 1
    assert [json.loads(x) for x in path.read_text().splitlines()] == rows[:2]
    assert ckpt.truncate_series(tmp_path / "missing.jsonl", 1) == 0


def test_lr_schedule_shapes():
    from rlcore.trainer.schedule import lr_multiplier

    assert [lr_multiplier(s, "constant", 2, 10, 0.0) for s in range(3)] == [0.5, 1.0, 1.0]
    cos = [lr_multiplier(s, "cosine", 0, 5, 0.1) for s in range(5)]
    assert cos[0] == 1.0 and abs(cos[-1] - 0.1) < 1e-12 and cos == sorted(cos, reverse=True)
    assert abs(lr_multiplier(4, "linear", 0, 5, 0.0)) < 1e-12


def test_task_feed_puts_unfinished_tasks_back_in_stream_order():
    from actors.run_state import TaskFeed
    from rlcore.envs import build_env

    cfg = compose([])
    env = build_env(cfg.env)
    feed = TaskFeed(env, cfg)
    idx, tasks = feed.take(5)
    assert idx == [0, 1, 2, 3, 4] and [t.id for t in tasks] == [env.make_task(i, "train").id for i in idx]
    state = feed.state([(4, tasks[4]), (2, tasks[2])])  # 2 and 4 were still generating
    resumed = TaskFeed(env, cfg)
    resumed.restore(state)
    assert resumed.take(4)[0] == [2, 4, 5, 6]
    # a request's seed is a function of its first task only
    assert feed.seed([7, 8]) == resumed.seed([7]) != feed.seed([8])
    assert TaskFeed(env, compose(["rollout.request_seeds=false"])).seed([7]) is None


def test_engine_rng_state_round_trip():
    from rlcore.engine.base import SamplingParams
    from rlcore.engine.hf_engine import HFEngine
    from rlcore.models.build import build_model, build_tokenizer

    cfg = compose([])
    tok = build_tokenizer(cfg.model)
    eng = HFEngine(build_model(cfg.model, tok), tok.pad_token_id, tok.eos_token_id, seed=3)
    params = SamplingParams(max_new_tokens=6)
    eng.generate([[1, 5, 6]], params)
    state = eng.rng_state()
    first = eng.generate([[1, 5, 6]] * 4, params)
    eng.set_rng_state(state)
    again = eng.generate([[1, 5, 6]] * 4, params)
    assert [g.token_ids for g in first] == [g.token_ids for g in again]


def test_checkpoint_timeout_must_be_positive():
    from rlcore.config.errors import ConfigError
    from rlcore.plan.validate import validate

    with pytest.raises(ConfigError, match="checkpoint.timeout_s"):
        validate(compose(["checkpoint.timeout_s=0"]))
