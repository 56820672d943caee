"""SFT data: reading (JSONL, env demonstrations), assistant-only masks, data order, bad input."""

import json

import pytest

from rlcore.envs import make_env
from rlcore.models.build import build_tokenizer
from rlcore.plan.compose import compose
from rlcore.run import main
from rlcore.sft.dataset import SFTData, batch_indices, build_dataset, read_jsonl, tokenize_conversation


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(compose([]).model)


def test_mask_covers_assistant_turns_and_their_eos_only(tok):
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "abc"},
        {"role": "assistant", "content": "cba"},
        {"role": "user", "content": "de"},
        {"role": "assistant", "content": "ed"},
    ]
    ids, mask = tokenize_conversation(tok, msgs)
    assert len(ids) == len(mask)
    trained = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(trained) == "cba<|im_end|>ed<|im_end|>"
    # the whole sequence is exactly the template rendering (nothing dropped or duplicated)
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False)


def test_sft_tokens_match_what_rl_sees(tok):
    """A demonstration = the RL prompt ids + the answer's ids + eos: warm start lines up."""
    env = make_env("reverse_text", {}, 0)
    task = env.make_task(3, "train")
    ids, mask = tokenize_conversation(tok, [*task.messages, {"role": "assistant", "content": task.answer}])
    prompt = env.render(task, tok)
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
    assert ids[len(prompt) :] == tok(task.answer, add_special_tokens=False).input_ids + [tok.eos_token_id]


def test_malformed_jsonl_rows_are_skipped_counted_and_named(tmp_path, caplog):
    path = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}]}
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({"text": "no messages"}),
        "",
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
        json.dumps({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}),
        json.dumps(good),
    ]
    path.write_text("\n".join(lines) + "\n")
    data = SFTData(samples=[])
    with caplog.at_level("WARNING", logger="rlcore"):
        convs = read_jsonl(path, "messages", data)
    assert len(convs) == 2 and data.skipped == {"malformed": 4} and data.rows == 6
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert str(path) in msg and all(f"line {n}:" in msg for n in (2, 3, 5, 6))

    cfg = compose(["mode=sft", f"sft.dataset={path}", "sft.max_seq_len=64"])
    built = build_dataset(cfg, build_tokenizer(cfg.model))
    assert len(built.samples) == 2 and built.skipped == {"malformed": 4}


def test_too_long_examples_are_dropped(tmp_path, tok):
    path = tmp_path / "chat.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "a" * n}, {"role": "assistant", "content": "b"}]} for n in (3, 90)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = build_dataset(compose(["mode=sft", f"sft.dataset={path}", "sft.max_seq_len=64"]), tok)
    assert len(data.samples) == 1 and data.skipped == {"too_long": 1}


def test_env_demonstrations(tok):
    data = build_dataset(compose(["mode=sft", "sft.num_examples=5"]), tok)
    assert len(data.samples) == 5
    s = data.samples[0]
    assert tok.decode(s.completion_ids).endswith("<|im_end|>") and all(s.loss_mask)


def test_data_order_is_a_function_of_the_step():
    n, b = 10, 4
    steps = [batch_indices(s, b, n, seed=7, shuffle=True) for s in range(5)]
    flat = [i for idx, _ in steps for i in idx]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))  # epochs
    assert [e for _, e in steps] == [0, 0, 1, 1, 1]
    assert batch_indices(3, b, n, 7, True) == steps[3]  # resume needs only the step
    assert batch_indices(0, b, n, 8, True)[0] != steps[0][0]
    assert batch_indices(0, 3, 5, 0, False)[0] == [0, 1, 2]


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["mode=sft", "sft.dataset=/nonexistent/chat.jsonl"], "sft.dataset"),
        (["mode=sft", "sft.num_examples=0"], "sft.num_examples"),
        (["mode=sft", "sft.num_examples=4", "sft.batch_examples=0"], "sft.batch_examples"),
        (["resume=/nonexistent/ckpt"], "checkpoint.resume"),
        (["mode=eval", "eval.k=[1,99]"], "eval.k"),
        (["mode=nope"], "mode"),
        (["trainer.lr_schedule=step"], "trainer.lr_schedule"),
        (["mode=sft", "sft.num_examples=4", "sft.lr=0"], "sft.lr"),
    ],
)
def test_bad_input_is_one_line_exit_2(overrides, key, capsys):
    assert main(overrides) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rlcore: config error: {key}"), err


def test_dataset_with_no_usable_row_exits_2_before_ray(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text("{oops\n" + json.dumps({"messages": []}) + "\n")
    assert main(["mode=sft", f"sft.dataset={path}", f"output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rlcore: config error: sft.dataset: no usable example"), err
    assert not (tmp_path / "out").exists()  # nothing started


def test_datasets_source_reads_records_and_skips_bad_ones(monkeypatch, tok):
    """A `datasets` name goes through `datasets.load_dataset` (faked: not a dependency)."""
    import sys
    import types

    good = {"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}]}
    calls = []
    fake = types.SimpleNamespace(
        load_dataset=lambda name, split: calls.append((name, split)) or [good, {"messages": None}, good],
        load_from_disk=None,
        DatasetDict=dict,
    )
    monkeypatch.setitem(sys.modules, "datasets", fake)
    data = build_dataset(compose(["mode=sft", "sft.dataset=org/chat", "sft.split=train_sft"]), tok)
    assert calls == [("org/chat", "train_sft")] and len(data.samples) == 2 and data.skipped == {"malformed": 1}


def test_sft_steps_run_at_sft_lr_and_rl_steps_at_trainer_lr(monkeypatch):
    """`sft.lr` sets the rate of SFT steps only: the warm-up learns fast, the RL steps after it
    keep `trainer.lr`."""
    import socket

    from rlcore.batch.packing import make_micro_batch
    from rlcore.trainer.core import TrainerCore
    from rlcore.types import Sample

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    core = TrainerCore(compose(["trainer.lr=0.0003", "sft.lr=0.003"]), 0, 1)
    try:
        seen = []
        core.optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(opt.param_groups[0]["lr"]))
        mb = make_micro_batch([Sample([1, 10, 11], [20, 21, 2], [0.0] * 3, [0] * 3, [1] * 3)], [0.5])
        core.sft_step([mb], 3)
        core.train_step([mb], 3.0)
        core.sft_step([mb], 3)
        assert seen == [0.003, 0.0003, 0.003]
    finally:
        core.shutdown()
