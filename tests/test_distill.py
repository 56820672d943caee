"""On-policy distillation, Ray-free: the per-token reverse-KL advantage (hand-computed), its path
through packing into the policy loss, the teacher's config checks (same tokenizer), and the
teacher stage's pure helpers.

Every expected number is worked out by hand in the comments from the formula in
`rlcore/algo/distill.py`'s docstring:  A_t = reward_coef * A + kl_coef * (q_t - s_t).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from actors.teacher import attach, score_pairs, scored
from rlcore.algo.distill import batch_token_advantages, reverse_kl_sum, token_advantages
from rlcore.algo.losses import LossInputs, policy_loss
from rlcore.batch.meta import group_meta
from rlcore.batch.packing import make_micro_batch
from rlcore.config import AlgoConfig
from rlcore.config.bounds import field_problems
from rlcore.models.tokenizer import char_tokenizer
from rlcore.plan.compose import compose
from rlcore.plan.teacher import config_problems, teacher_model_config, teacher_run_config
from rlcore.run import main
from rlcore.types import Group, Sample, Task


def sample(prompt, completion, logprobs, teacher=None, mask=None, reward=0.0, failed=False) -> Sample:
    return Sample(
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=logprobs,
        versions=[0] * len(completion),
        loss_mask=mask if mask is not None else [1] * len(completion),
        reward=reward,
        failed=failed,
        teacher_logprobs=teacher,
    )


def test_token_advantages_hand_computed():
    # s = [-1.0, -2.0, -0.5], q = [-0.5, -3.0, -0.5], A = 0.4, kl_coef 2, reward_coef 0.5
    # A_0 = 0.5*0.4 + 2*(-0.5 - -1.0) = 0.2 + 1.0 = 1.2
    # A_1 = 0.2 + 2*(-3.0 - -2.0) = 0.2 - 2.0 = -1.8
    # A_2 = 0.2 + 2*0 = 0.2
    out = token_advantages(0.4, [-1.0, -2.0, -0.5], [-0.5, -3.0, -0.5], [1, 1, 1], kl_coef=2.0, reward_coef=0.5)
    assert out == pytest.approx([1.2, -1.8, 0.2])


def test_environment_tokens_keep_the_reward_advantage_only():
    # token 1 is an environment token (mask 0): A_1 = 1.0 * 0.3, whatever the logprobs say
    # A_0 = 0.3 + 1.0*(-0.1 - -0.7) = 0.9
    out = token_advantages(0.3, [-0.7, 0.0], [-0.1, -5.0], [1, 0], kl_coef=1.0, reward_coef=1.0)
    assert out == pytest.approx([0.9, 0.3])


def test_pure_distillation_ignores_the_reward():
    # reward_coef 0: A_t = q_t - s_t = [-1 - -2, -4 - -1] = [1, -3]
    assert token_advantages(5.0, [-2.0, -1.0], [-1.0, -4.0], [1, 1], 1.0, 0.0) == pytest.approx([1.0, -3.0])


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 behaviour, 1 teacher"):
        token_advantages(0.0, [-1.0, -1.0], [-1.0], [1, 1], 1.0, 1.0)


def test_reverse_kl_and_batch_metrics():
    # sample a: s - q over mask = (-1 - -3) + (-2 - -2) = 2 ; tokens 2 (third is masked)
    # sample b: (-0.5 - -0.25) = -0.25 ; tokens 1
    # teacher_kl = (2 - 0.25) / 3 = 0.583333 ; teacher_logprob_mean = (-3 - 2 - 0.25) / 3 = -1.75
    a = sample([1], [5, 6, 7], [-1.0, -2.0, 0.0], teacher=[-3.0, -2.0, -9.0], mask=[1, 1, 0])
    b = sample([1], [5], [-0.5], teacher=[-0.25])
    assert reverse_kl_sum(a.logprobs, a.teacher_logprobs, a.loss_mask) == (pytest.approx(2.0), 2)
    adv, metrics = batch_token_advantages([a, b], [1.0, -1.0], kl_coef=1.0, reward_coef=1.0)
    # a: [1 + 2*? ...] A_0 = 1 + (-3 - -1) = -1 ; A_1 = 1 + 0 = 1 ; A_2 (env) = 1 ; b: -1 + 0.25 = -0.75
    assert adv[0] == pytest.approx([-1.0, 1.0, 1.0])
    assert adv[1] == pytest.approx([-0.75])
    assert metrics["teacher_kl"] == pytest.approx(1.75 / 3)
    assert metrics["teacher_logprob_mean"] == pytest.approx(-1.75)


def test_centered_distillation_advantage():
    # batch of the previous test: policy tokens' q - s = [-2, 0, 0.25] -> b = -1.75 / 3 = -0.583333
    # a: A_0 = 1 + (-2 + 0.583333) = -0.416667 ; A_1 = 1 + 0.583333 = 1.583333 ; A_2 (env) = 1
    # b: A_0 = -1 + (0.25 + 0.583333) = -0.166667
    a = sample([1], [5, 6, 7], [-1.0, -2.0, 0.0], teacher=[-3.0, -2.0, -9.0], mask=[1, 1, 0])
    b = sample([1], [5], [-0.5], teacher=[-0.25])
    adv, metrics = batch_token_advantages([a, b], [1.0, -1.0], kl_coef=1.0, reward_coef=1.0, center=True)
    assert adv[0] == pytest.approx([-0.416667, 1.583333, 1.0], abs=1e-5)
    assert adv[1] == pytest.approx([-0.166667], abs=1e-5)
    assert metrics["teacher_kl"] == pytest.approx(1.75 / 3)  # the metric is not centered


def test_sample_without_teacher_logprobs_is_refused():
    with pytest.raises(ValueError, match="without teacher logprobs"):
        batch_token_advantages([sample([1], [2], [-1.0])], [0.0], 1.0, 1.0)


def test_per_token_advantages_land_on_prediction_positions():
    # prompt [10, 11], completion [12, 13]: position 1 predicts 12, position 2 predicts 13
    s = sample([10, 11], [12, 13], [-1.0, -2.0])
    mb = make_micro_batch([s, s], [[0.5, -1.5], 2.0])
    assert mb.advantages.tolist() == [0.0, 0.5, -1.5, 0.0, 2.0, 2.0, 2.0, 2.0]
    assert mb.loss_mask.tolist() == [0, 1, 1, 0, 0, 1, 1, 0]
    with pytest.raises(ValueError, match="3 per-token advantages for 2"):
        make_micro_batch([s], [[1.0, 2.0, 3.0]])


def test_policy_gradient_follows_the_teacher():
    # ppo_clip at ratio 1 (logp == behaviour): loss = -sum_t A_t / N, d loss / d logp_t = -A_t / N.
    # s = [-1, -1], q = [-0.5, -2] (kl_coef 1, reward 0): A = [0.5, -1.0]; N = 2
    # grad = [-0.25, 0.5]: descending it raises logp_0 (teacher likes it) and lowers logp_1
    s = sample([3], [4, 5], [-1.0, -1.0], teacher=[-0.5, -2.0])
    adv, _ = batch_token_advantages([s], [0.0], kl_coef=1.0, reward_coef=0.0)
    mb = make_micro_batch([s], adv)
    logp = mb.behaviour_logprobs.clone().requires_grad_(True)
    loss, _ = policy_loss(
        LossInputs(logp, mb.behaviour_logprobs, mb.advantages, mb.loss_mask, sample_index=mb.sample_index),
        AlgoConfig(),
        normalizer=2.0,
    )
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.25)  # -(0.5 - 1.0) / 2
    # one prompt token: positions 0 and 1 predict the two completion tokens, position 2 nothing
    assert logp.grad.tolist() == pytest.approx([-0.25, 0.5, 0.0])


def test_score_pairs_skip_failed_samples_and_attach_in_order():
    ok1 = sample([1, 2], [3], [-1.0])
    bad = sample([], [], [], failed=True)
    ok2 = sample([4], [5, 6], [-1.0, -1.0])
    groups = [[ok1, bad], [ok2]]  # each group's token data, as the teacher actor reads it
    assert score_pairs(groups) == [([1, 2], [3]), ([4], [5, 6])]
    attach(groups, [[-0.1], [-0.2, -0.3]])
    assert ok1.teacher_logprobs == [-0.1] and ok2.teacher_logprobs == [-0.2, -0.3]
    assert bad.teacher_logprobs is None
    with pytest.raises(ValueError, match="1 logprobs for 2 tokens"):
        attach([[sample([1], [2, 3], [0.0, 0.0])]], [[-1.0]])
    with pytest.raises(ValueError, match="1 scored samples for 2"):
        attach([[ok1], [ok2]], [[-0.1]])


def test_scored_group_keeps_its_metadata_with_teacher_sums_and_the_new_data_handle():
    ok = sample([1], [5, 6], [-1.0, -2.0])
    bad = sample([], [], [], failed=True)
    meta = group_meta(Group(Task("a", []), [ok, bad], request_id=3, stream_index=7), data="old")
    out = scored(meta, [(2.0, 2, -5.0), None], data="new")
    assert out.data == "new" and meta.data == "old"  # a new object; the submitted one unchanged
    assert (out.task, out.request_id, out.stream_index) == (meta.task, 3, 7)
    assert [s.teacher_sums for s in out.samples] == [(2.0, 2, -5.0), None]
    assert [dataclasses.replace(s, teacher_sums=None) for s in out.samples] == meta.samples
    with pytest.raises(ValueError, match="1 samples' sums for a group of 2"):
        scored(meta, [None], data="new")


def test_teacher_config_checks():
    cfg = compose(["teacher.enabled=true"])
    assert config_problems(cfg) == []
    assert teacher_model_config(cfg).arch == cfg.model.arch  # a random teacher defaults to the student's shape
    cfg = compose(["teacher.enabled=true", "teacher.num_actors=0"])  # a bound on the field (rlcore.config.bounds)
    assert [k for k, _ in field_problems(cfg.teacher, "teacher.") + config_problems(cfg)] == ["teacher.num_actors"]
    assert (
        field_problems(compose(["teacher.num_actors=0"]).teacher, "teacher.") == []
    )  # a disabled teacher is not checked
    keys = [k for k, _ in config_problems(compose(["teacher.enabled=true", "teacher.engine=sglang"]))]
    assert keys == ["teacher.engine"]
    keys = [k for k, _ in config_problems(compose(["teacher.enabled=true", "mode=sft"]))]
    assert keys == ["teacher.enabled"]
    keys = [
        k for k, _ in config_problems(compose(["teacher.enabled=true", "teacher.kl_coef=0", "teacher.reward_coef=0"]))
    ]
    assert keys == ["teacher.kl_coef"]


def test_different_tokenizer_is_refused_in_one_line(tmp_path, capsys):
    """Student and teacher both load their tokenizer from a local directory; the teacher's has a
    different vocabulary (the char tokenizer plus vision markers): exit 2, one line, before Ray."""
    char_tokenizer().save_pretrained(tmp_path / "student")
    char_tokenizer(vision=True).save_pretrained(tmp_path / "teacher")
    char_tokenizer().save_pretrained(tmp_path / "same")
    base = [
        "model.tokenizer=auto",
        f"model.path={tmp_path / 'student'}",
        "teacher.enabled=true",
        "teacher.tokenizer=auto",
        "dry_run=true",
    ]
    assert config_problems(compose(base + [f"teacher.path={tmp_path / 'same'}"])) == []
    rc = main(base + [f"teacher.path={tmp_path / 'teacher'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("rlcore: config error: teacher.path:"), err
    assert "tokenizer differs" in err[0]


def test_char_teacher_with_another_tokenizer_kind_is_refused(capsys):
    rc = main(["teacher.enabled=true", "teacher.tokenizer=auto", "teacher.path=Qwen/Qwen3-4B", "dry_run=true"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "teacher.tokenizer" in err[0], err


def test_cross_tokenizer_teacher_may_use_another_tokenizer():
    cfg = compose(
        ["teacher.enabled=true", "teacher.tokenizer=auto", "teacher.path=Qwen/Qwen3-4B", "teacher.cross_tokenizer=true"]
    )
    assert not [k for k, _ in config_problems(cfg) if k in ("teacher.tokenizer", "teacher.path")]


def test_teacher_resources_count_against_the_machine():
    from rlcore.plan.validate import resource_problems

    cfg = compose(["teacher.enabled=true", "teacher.cpus_per_actor=2"])
    found = resource_problems(cfg, cpus=3, gpus=0, where="this machine")
    assert found and "teacher 2 CPUs" in found[0][1]
    assert resource_problems(compose([]), cpus=3, gpus=0, where="this machine") == []


def test_distill_metrics_tensor_free():
    # a 1-token batch: teacher_kl = s - q = -0.2 - (-1.2) = 1.0
    _, m = batch_token_advantages([sample([1], [2], [-0.2], teacher=[-1.2])], [0.0], 1.0, 1.0)
    assert m["teacher_kl"] == pytest.approx(1.0)
    assert torch.isfinite(torch.tensor(m["teacher_logprob_mean"]))


def test_cpu_recipe_without_its_teacher_says_what_to_run(tmp_path, capsys):
    rc = main(["+recipe=distill_reverse_text", f"teacher.path={tmp_path}/missing/hf", "dry_run=true"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "teacher.path" in err[0] and "train the teacher first" in err[0], err


def test_gpu_recipe_plans_offline(capsys):
    assert main(["+recipe=distill_qwen3_4b_to_06b", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "placement group 'rlcore-teacher'" in out and "Qwen/Qwen3-4B" in out


def test_shared_gpu_vllm_teacher_needs_a_memory_share():
    base = ["teacher.enabled=true", "teacher.engine=vllm", "teacher.gpus_per_actor=0.5"]
    assert [k for k, _ in config_problems(compose(base))] == ["teacher.vllm.engine_kwargs.gpu_memory_utilization"]
    assert config_problems(compose(base + ["+teacher.vllm.engine_kwargs.gpu_memory_utilization=0.4"])) == []
    keys = [k for k, _ in config_problems(compose(base + ["+teacher.vllm.engine_kwargs.gpu_memory_utilization=0.6"]))]
    assert keys == ["teacher.vllm.engine_kwargs.gpu_memory_utilization"]
    keys = [k for k, _ in config_problems(compose(base + ["teacher.vllm.tensor_parallel_size=2"]))]
    assert keys == ["teacher.gpus_per_actor"]


def test_a_vllm_teacher_reads_its_own_section_and_leaves_the_rollout_only_options_alone():
    base = [
        "teacher.enabled=true",
        "teacher.engine=vllm",
        "teacher.gpus_per_actor=1",
        "+teacher.vllm.engine_kwargs.max_model_len=512",
        "rollout.engine=vllm",
        "rollout.gpus_per_actor=1",
        "rollout.vllm.sleep_level=2",
        "+rollout.vllm.engine_kwargs.max_model_len=2048",
    ]
    cfg = compose(base)
    assert config_problems(cfg) == []
    view = teacher_run_config(cfg).rollout  # what the teacher's engine is built from
    assert view.engine == "vllm" and view.vllm.engine_kwargs == {"max_model_len": 512}
    assert view.vllm.sleep_level == 0  # the teacher's own section, not the student's
    for option in ("sleep_level=1", "quantization=fp8", "weight_reload=layerwise", "kv_on_update=recompute"):
        key = "teacher.vllm." + option.partition("=")[0]
        found = dict(config_problems(compose([*base, "teacher.vllm." + option])))
        assert "never receives weights" in found[key], found


def test_distillation_keeps_groups_with_equal_rewards():
    """Their tokens carry the teacher's advantage: the zero-advantage filter is refused, and such
    groups are not reported as steps without a learning signal."""
    keys = [k for k, _ in config_problems(compose(["teacher.enabled=true", "algo.filter_zero_adv_groups=true"]))]
    assert "algo.filter_zero_adv_groups" in keys
    from rlcore.batch.step import build_step

    g = group_meta(Group(Task("t", []), [sample([1], [2, 3], [-1.0, -1.0], teacher=[-0.5, -2.0]) for _ in range(2)]))
    cfg = compose(["teacher.enabled=true"])
    assert build_step([g], cfg, distill=True).metrics["zero_adv_frac"] == 0.0
    assert build_step([g], cfg).metrics["zero_adv_frac"] == 1.0


ONE_GPU_TEACHER = [
    "model=qwen3_06b_char",
    "rollout.engine=vllm",
    "trainer.gpus_per_rank=1",
    "rollout.gpus_per_actor=1",
    "cluster.num_gpus=1",
    "cluster.num_cpus=16",
    "cluster.gpu_memory_gib=139.8",
    "teacher.enabled=true",
    "teacher.engine=vllm",
    "teacher.gpus_per_actor=0.2",
    "teacher.dtype=bfloat16",
    "+teacher.vllm.engine_kwargs.gpu_memory_utilization=0.15",
]


def test_a_gpu_teacher_shares_the_one_gpu_with_colocated_trainer_and_engine():
    """One GPU: the colocated bundle keeps 1 - 0.2 of it (trainer rank and engine 0.4 each), the
    teacher's own bundle takes 0.2, and the memory plan leaves the engine what the trainer and the
    teacher's 0.15 do not use."""
    from rlcore.plan.layout import make_plan
    from rlcore.plan.memory import GIB

    plan = make_plan(compose(ONE_GPU_TEACHER))
    assert plan.problems == [] and plan.config.placed == "colocated"
    assert [b.gpus for b in plan.trainer] == [0.8] and [b.gpus for b in plan.teacher] == [0.2]
    assert plan.teacher[0].node == 0 and plan.rollout == []
    share = plan.config.rollout.vllm.engine_kwargs["gpu_memory_utilization"]
    assert 0 < share <= 0.6
    big = make_plan(
        compose(
            ONE_GPU_TEACHER + ["teacher.gpus_per_actor=0.5", "teacher.vllm.engine_kwargs.gpu_memory_utilization=0.5"]
        )
    )
    assert big.problems == []  # the teacher's 0.5 leaves the engine less than the cap
    assert big.config.rollout.vllm.engine_kwargs["gpu_memory_utilization"] < share
    assert big.gpu_bytes == int(139.8 * GIB)


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["teacher.engine=hf", "~teacher.vllm.engine_kwargs.gpu_memory_utilization"], "teacher.engine"),
        (["teacher.num_actors=2"], "teacher.num_actors"),
        (["teacher.gpus_per_actor=1", "placement=colocated"], "teacher.gpus_per_actor"),
        (
            [
                "teacher.vllm.engine_kwargs.gpu_memory_utilization=0.03",  # 4B bf16 weights do not fit in 4.2 GiB
                "+teacher.arch={model_type: qwen3, hidden_size: 2560, intermediate_size: 9728, num_hidden_layers: 36, "
                "num_attention_heads: 32, num_key_value_heads: 8}",
            ],
            "teacher.vllm.engine_kwargs.gpu_memory_utilization",
        ),
        (
            [
                "teacher.gpus_per_actor=0.5",
                "teacher.vllm.engine_kwargs.gpu_memory_utilization=0.5",
                "+rollout.vllm.engine_kwargs.gpu_memory_utilization=0.5",
            ],
            "rollout.vllm.engine_kwargs.gpu_memory_utilization",
        ),
    ],
)
def test_impossible_colocated_teachers_refused(overrides, key):
    from rlcore.plan.layout import make_plan

    problems = make_plan(compose(ONE_GPU_TEACHER + overrides)).problems
    assert key in [k for k, _ in problems], problems


def test_deadband_drops_tokens_within_it_and_keeps_the_others():
    # deadband 0.01: token 0 has q - s = 0.005 (within: A = reward part only, 0.5*0.4 = 0.2);
    # token 1 has q - s = -1.0 (outside): A = 0.2 + 2*(-1.0 - 0.1) = -2.0 with baseline 0.1
    out = token_advantages(
        0.4, [-1.0, -2.0], [-0.995, -3.0], [1, 1], kl_coef=2.0, reward_coef=0.5, baseline=0.1, deadband=0.01
    )
    assert out == pytest.approx([0.2, -2.0])
    # deadband 0 is the exact estimator: token 0 gets 0.2 + 2*(0.005 - 0.1) = 0.01, and a token
    # with q = s exactly still gets the baseline: 0.2 + 2*(0 - 0.1) = 0
    assert token_advantages(0.4, [-1.0, -1.0], [-0.995, -1.0], [1, 1], 2.0, 0.5, baseline=0.1) == pytest.approx(
        [0.01, 0.0]
    )


@pytest.mark.parametrize("deadband, drifts", [(0.0, True), (0.01, False)])
def test_a_student_equal_to_its_teacher_drifts_on_noise_unless_the_deadband_drops_it(deadband, drifts):
    # The student is the teacher: the teacher's logprobs are the student's own plus 1e-6 noise
    # (two engines never agree to the last bit). Adam normalises the gradient by its own scale,
    # so without the deadband that noise moves the logits by ~lr per step (KL to the start
    # 4.7e-5 after 10 steps at lr 3e-3); with it the gradient is exactly 0 and nothing moves.
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(8, generator=gen)
    logits = start.clone().requires_grad_(True)
    opt = torch.optim.AdamW([logits], lr=3e-3, weight_decay=0.0)
    for _ in range(10):
        dist = torch.distributions.Categorical(logits=logits.detach())
        tokens = torch.multinomial(dist.probs, 64, True, generator=gen)
        s = dist.log_prob(tokens)
        q = s + 1e-6 * torch.randn(64, generator=gen)
        samples = [sample([0], [int(t)], [float(a)], teacher=[float(b)]) for t, a, b in zip(tokens, s, q)]
        adv, _ = batch_token_advantages(samples, [0.0] * 64, kl_coef=1.0, reward_coef=0.0, deadband=deadband)
        logp = torch.log_softmax(logits, -1)[tokens]
        loss, _ = policy_loss(
            LossInputs(logp, s, torch.tensor([a[0] for a in adv]), torch.ones(64)), AlgoConfig(), normalizer=64.0
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    p0, p1 = torch.log_softmax(start, -1), torch.log_softmax(logits.detach(), -1)
    kl = float((p1.exp() * (p1 - p0)).sum())
    assert (kl > 1e-5) if drifts else (kl == 0.0), kl
