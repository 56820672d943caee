"""Top-k distillation (`teacher.top_k`), Ray-free: the trainer head's logprobs of other tokens,
the KL over the teacher's top-k and the rest (`rlcore.algo.distill.top_k_loss`), the packing of
the teacher's top-k onto prediction positions, the hf engine's top-k scores, the config checks,
and one trainer step that follows the teacher."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.teacher import attach
from rlcore.algo.distill import top_k_loss
from rlcore.batch.packing import empty_micro_batch, make_micro_batch
from rlcore.config import ModelConfig
from rlcore.engine.hf_engine import HFEngine
from rlcore.models.tokenizer import char_tokenizer
from rlcore.plan.compose import compose
from rlcore.plan.teacher import config_problems
from rlcore.trainer.logprobs import chunked_logprobs, other_logprobs, plain_logprobs
from rlcore.types import Sample


def sample(prompt, completion, top_ids=None, top_lp=None) -> Sample:
    return Sample(
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=[-1.0] * len(completion),
        versions=[0] * len(completion),
        loss_mask=[1] * len(completion),
        teacher_top_k_ids=top_ids,
        teacher_top_k_logprobs=top_lp,
    )


@pytest.mark.parametrize("temperature, bias", [(1.0, False), (0.7, True)])
def test_other_tokens_logprobs_and_gradients_equal_the_full_log_softmax(temperature, bias):
    gen = torch.Generator().manual_seed(0)
    T, H, V, k = 13, 8, 20, 5
    h = torch.randn(T, H, generator=gen, requires_grad=True)
    w = torch.randn(V, H, generator=gen, requires_grad=True)
    b = torch.randn(V, generator=gen) if bias else None
    targets, others = torch.randint(0, V, (T,), generator=gen), torch.randint(0, V, (T, k), generator=gen)
    logp, _ = chunked_logprobs(h, w, targets, temperature, 4, b)  # chunks of 4: the product path
    got = other_logprobs(h, w, b, targets, logp, others, temperature)
    logits = h @ w.T + (b if bias else 0.0)
    want = torch.log_softmax(logits / temperature, -1).gather(-1, others)
    assert torch.allclose(got, want, atol=1e-5)
    weights = torch.randn(T, k, generator=gen)  # any downstream loss
    g_got = torch.autograd.grad((got * weights).sum(), [h, w])
    g_want = torch.autograd.grad((want * weights).sum(), [h, w])
    for a, c in zip(g_got, g_want):
        assert torch.allclose(a, c, atol=1e-4)
    # the plain head gives the same targets' logprobs the other path starts from
    assert torch.allclose(plain_logprobs(logits, targets, temperature)[0], logp, atol=1e-5)


def test_top_k_kl_is_the_full_kl_at_the_vocabulary_and_a_lower_bound_below_it():
    gen = torch.Generator().manual_seed(1)
    T, V = 6, 10
    teacher = torch.log_softmax(2 * torch.randn(T, V, generator=gen), -1)
    logits = torch.randn(T, V, generator=gen, requires_grad=True)
    student = torch.log_softmax(logits, -1)
    full = (teacher.exp() * (teacher - student)).sum(-1)
    top = teacher.topk(V, -1)
    loss, metrics = top_k_loss(student.gather(-1, top.indices), top.values, torch.ones(T))
    assert loss.item() == pytest.approx(full.sum().item(), rel=1e-5)
    # its gradient in the student's logits is pi - p: the soft cross-entropy gradient
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.allclose(grad, student.exp() - teacher.exp(), atol=1e-5)
    assert float(metrics["teacher_top_k_mass_sum"]) == pytest.approx(T, rel=1e-5)
    for k in (1, 3, 7):
        top = teacher.topk(k, -1)
        part, _ = top_k_loss(student.gather(-1, top.indices), top.values, torch.ones(T))
        assert 0 < part.item() < full.sum().item()


def test_a_student_equal_to_the_teacher_gets_zero_and_no_gradient():
    # renormalising the top-k instead would give -log(mass) > 0 here and sharpen the student
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 12, generator=gen, requires_grad=True)
    student = torch.log_softmax(logits, -1)
    top = student.detach().topk(4, -1)
    loss, _ = top_k_loss(student.gather(-1, top.indices), top.values, torch.ones(5))
    (grad,) = torch.autograd.grad(loss, logits)
    assert abs(loss.item()) < 1e-6 and float(grad.abs().max()) < 1e-6


def test_masked_tokens_and_the_deadband_leave_the_loss():
    teacher = torch.log(torch.tensor([[0.7, 0.2], [0.7, 0.2], [0.5, 0.4]]))
    # token 0 is 0.005 nats off on both: within the deadband; token 1 is 1 nat off; token 2 masked
    student = (teacher + torch.tensor([[0.005, -0.005], [-1.0, 0.0], [-3.0, -3.0]])).requires_grad_(True)
    mask = torch.tensor([1.0, 1.0, 0.0])
    all_tokens, metrics = top_k_loss(student, teacher, mask)
    banded, banded_metrics = top_k_loss(student, teacher, mask, deadband=0.01)
    only_1, _ = top_k_loss(student[1:2], teacher[1:2], mask[1:2])
    assert banded.item() == pytest.approx(only_1.item()) and all_tokens.item() > banded.item()
    # the metrics still count every loss token
    assert float(banded_metrics["teacher_top_k_kl_sum"]) == pytest.approx(float(metrics["teacher_top_k_kl_sum"]))
    assert float(metrics["teacher_top_k_mass_sum"]) == pytest.approx(0.9 + 0.9)


def test_top_k_lands_on_the_prediction_positions():
    ids_a = np.array([[5, 6], [7, 8]], dtype=np.int32)
    lp_a = np.log(np.array([[0.5, 0.25], [0.6, 0.3]], dtype=np.float32))
    ids_b = np.array([[9, 10]], dtype=np.int32)
    lp_b = np.log(np.array([[0.9, 0.05]], dtype=np.float32))
    # sample a: prompt [1, 2, 3], completion [4, 4] -> rows 2 and 3; sample b: prompt [1], completion [3] -> row 5
    mb = make_micro_batch([sample([1, 2, 3], [4, 4], ids_a, lp_a), sample([1], [3], ids_b, lp_b)], [0.0, 0.0])
    assert mb.teacher_top_k_ids.tolist() == [[0, 0], [0, 0], [5, 6], [7, 8], [0, 0], [9, 10], [0, 0]]
    assert torch.allclose(mb.teacher_top_k_logprobs[[2, 3, 5]], torch.from_numpy(np.concatenate([lp_a, lp_b])))
    assert mb.loss_mask.tolist() == [0, 0, 1, 1, 0, 1, 0]
    assert make_micro_batch([sample([1], [2])], [0.0]).teacher_top_k_ids is None
    with pytest.raises(ValueError, match="widths"):
        make_micro_batch([sample([1], [2], ids_b, lp_b), sample([1], [2])], [0.0, 0.0])


def test_attach_gives_each_scored_sample_its_top_k():
    ok, failed = sample([1], [2, 3]), Sample([1], [2], [0.0], [0], [1], failed=True)
    top = (np.zeros((2, 3), np.int32), np.zeros((2, 3), np.float32))
    attach([[ok, failed]], [[-0.1, -0.2]], [top])
    assert ok.teacher_top_k_ids is top[0] and failed.teacher_top_k_ids is None
    with pytest.raises(ValueError, match="top-k of shapes"):
        attach([[sample([1], [2, 3])]], [[-0.1, -0.2]], [(np.zeros((1, 3), np.int32), np.zeros((1, 3), np.float32))])


def test_hf_engine_top_k_is_its_own_log_softmax():
    tok = char_tokenizer()
    model = ModelConfig(tokenizer="char", arch=dict(compose([]).model.arch), seed=3)
    engine = HFEngine.from_config(None, model, tokenizer=tok)
    pairs = [([1, 5, 6], [7, 8, 9]), ([4], [11])]
    scored = engine.score_top_k_batch(pairs, 4)
    for (prompt, completion), (lp, ids, top_lp) in zip(pairs, scored):
        assert lp == pytest.approx(engine.score(prompt, completion), abs=1e-6)
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
        want = torch.log_softmax(logits[len(prompt) - 1 : -1], -1).topk(4, -1)
        assert ids.dtype == np.int32 and ids.shape == (len(completion), 4)
        assert ids.tolist() == want.indices.tolist()
        assert np.allclose(top_lp, want.values.numpy(), atol=1e-6)
    ((_, ids, _),) = engine.score_top_k_batch([([1], [2])], 10_000)  # k past the vocabulary: all of it
    assert ids.shape == (1, len(tok))


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (["teacher.top_k=-1"], "teacher.top_k", "whole number"),
        (["teacher.top_k=4", "teacher.top_k_coef=-1"], "teacher.top_k_coef", ">= 0"),
        (["teacher.top_k=4", "teacher.cross_tokenizer=true"], "teacher.top_k", "cross_tokenizer"),
        (["teacher.top_k=4", "algo.loss=gspo"], "teacher.top_k", "per sequence"),
        (["teacher.top_k=4", "teacher.engine=vllm", "teacher.gpus_per_actor=1"], "teacher.top_k", "['hf']"),
    ],
)
def test_top_k_config_is_refused_in_one_line(overrides, key, words):
    found = [(k, m) for k, m in config_problems(compose(["teacher.enabled=true", *overrides])) if k == key]
    assert len(found) == 1 and words in found[0][1], found


def test_a_bad_top_k_in_pure_distillation_is_one_problem_not_two():
    cfg = compose(["teacher.enabled=true", "teacher.kl_coef=0", "teacher.reward_coef=0", "teacher.top_k=-1"])
    assert [k for k, _ in config_problems(cfg)] == ["teacher.top_k"]


def test_pure_top_k_distillation_needs_no_other_coefficient():
    cfg = compose(["teacher.enabled=true", "teacher.kl_coef=0", "teacher.reward_coef=0", "teacher.top_k=8"])
    assert config_problems(cfg) == []
    cfg = compose(["teacher.enabled=true", "teacher.kl_coef=0", "teacher.reward_coef=0"])
    assert [k for k, _ in config_problems(cfg)] == ["teacher.kl_coef"]


def test_trainer_steps_follow_the_teacher_top_k(tmp_path, monkeypatch):
    """Through the trainer's own forward (chunked head) and step: the teacher puts 0.9 on token 7
    after every prompt; with zero advantages only the top-k term trains, and it moves the
    student there; an SFT step on the same micro-batch ignores the top-k."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    from rlcore.trainer.core import TrainerCore

    cfg = compose(
        [
            f"output_dir={tmp_path / 'run'}",
            "teacher.enabled=true",
            "teacher.kl_coef=0",
            "teacher.reward_coef=0",
            "teacher.top_k=3",
            "trainer.lr=0.01",
        ]
    )
    core = TrainerCore(cfg, 0, 1)
    try:
        ids = np.array([[7, 8, 9]] * 2, dtype=np.int32)
        lps = np.log(np.array([[0.9, 0.05, 0.03]] * 2, dtype=np.float32))
        samples = [sample([1, 10 + i], [20 + i, 2], ids, lps) for i in range(4)]
        mb = make_micro_batch(samples, [0.0] * 4)
        mask = mb.loss_mask.bool()

        def p7() -> float:
            with torch.no_grad():
                logits = core.model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None]).logits[0]
            return float(torch.softmax(logits.float(), -1)[mask, 7].mean())

        before = p7()
        kls = [core.train_step([mb], normalizer=float(mask.sum())).metrics["teacher_top_k_kl"] for _ in range(8)]
        assert kls[-1] < 0.5 * kls[0], kls
        assert p7() > max(0.5, before + 0.3), (before, p7())
        sft = core.sft_step([mb], int(mask.sum())).metrics
        assert "teacher_top_k_kl" not in sft
        # a rank whose share is an empty filler reports the same keys (its sums all-reduce with the others')
        filler = core.train_step([empty_micro_batch()], normalizer=1.0).metrics
        assert filler["teacher_top_k_kl"] == 0.0 and filler["teacher_top_k_mass"] == 0.0
    finally:
        core.shutdown()
