"""Policy losses, mismatch corrections and algo validation against hand-computed values.

Every expected number below is worked out by hand in the comments from the formula in the
loss's docstring, not by calling the implementation.
"""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from rlcore.algo import validate_algo
from rlcore.algo.losses import LOSSES, LossInputs, loss_normalizer, policy_loss, ppo_clip_loss
from rlcore.config import AlgoConfig, CispoOptions, DapoOptions, DrGrpoOptions, GspoOptions
from rlcore.config.bounds import field_problems

LN = math.log


def close(actual, expected, atol: float = 1e-5) -> None:
    actual = torch.as_tensor(actual, dtype=torch.float32)
    expected = torch.as_tensor(expected, dtype=torch.float32)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def make(logp, ratios, adv, mask=None, **extra) -> LossInputs:
    """Inputs whose ratio exp(logp - behaviour) is `ratios` token by token."""
    logp_t = torch.tensor(logp, dtype=torch.float32, requires_grad=True)
    behaviour = torch.tensor([lp - LN(r) for lp, r in zip(logp, ratios, strict=True)], dtype=torch.float32)
    mask_t = torch.ones(len(logp)) if mask is None else torch.tensor(mask, dtype=torch.float32)
    return LossInputs(logp_t, behaviour, torch.tensor(adv, dtype=torch.float32), mask_t, **extra)


def grad_of(inp: LossInputs, cfg: AlgoConfig, normalizer: float):
    loss, metrics = policy_loss(inp, cfg, normalizer)
    loss.backward()
    return loss.detach(), inp.logprobs.grad, metrics


# ---- ppo_clip (the default) -------------------------------------------------------------------


def test_ppo_clip_values_clipping_and_gradient():
    # r = [1, 1.5, 0.5, 1.1], A = [1, 1, -1, -1], eps 0.2:
    #   t0: max(-1, -1) = -1                        gradient -A r = -1
    #   t1: max(-1.5, -1.2) = -1.2 (clipped)        gradient 0
    #   t2: max(0.5, 0.8) = 0.8 (clipped)           gradient 0
    #   t3: max(1.1, 1.1) = 1.1                     gradient -A r = 1.1
    # sum -0.3 over normalizer 4
    inp = make([-1.0, -0.5, -2.0, -0.3], [1.0, 1.5, 0.5, 1.1], [1.0, 1.0, -1.0, -1.0])
    loss, grad, m = grad_of(inp, AlgoConfig(), 4.0)
    close(loss, -0.075)
    close(grad, [-0.25, 0.0, 0.0, 0.275])
    close(m["clip_frac"], 2.0)
    close(m["ratio_sum"], 4.1)
    close(m["ratio_max"], 1.5)
    close(m["ratio_min"], 0.5)


def test_masked_tokens_contribute_nothing_even_when_non_finite():
    base = make([-1.0, -0.3], [1.0, 1.1], [1.0, -1.0])
    ref_loss, ref_grad, _ = grad_of(base, AlgoConfig(), 4.0)
    # a prompt token (mask 0) with an absurd logprob, -inf behaviour logprob and advantage
    logp = torch.tensor([50.0, -1.0, -0.3], requires_grad=True)
    behaviour = torch.tensor([-math.inf, -1.0, -0.3 - LN(1.1)])
    inp = LossInputs(logp, behaviour, torch.tensor([100.0, 1.0, -1.0]), torch.tensor([0.0, 1.0, 1.0]))
    for loss_name in LOSSES:
        logp.grad = None
        cfg = AlgoConfig(loss=loss_name, tis_cap=2.0, mis_level="token", prob_diff_threshold=0.5, kl_coef=0.1)
        inp.sample_index = torch.tensor([-1, 0, 1])
        inp.ref_logprobs = torch.tensor([math.nan, -1.0, -0.3])
        loss, m = policy_loss(inp, cfg, 4.0)
        loss.backward()
        assert torch.isfinite(loss), loss_name
        assert logp.grad[0] == 0.0 and torch.isfinite(logp.grad).all(), loss_name
        assert all(torch.isfinite(v) for v in m.values()), (loss_name, m)
    logp.grad = None
    loss, m = policy_loss(inp, AlgoConfig(), 4.0)
    loss.backward()
    close(loss, ref_loss)
    close(logp.grad[1:], ref_grad)
    close(m["ratio_max"], 1.1)


def test_empty_mask_gives_zero_loss_with_a_graph():
    inp = make([-1.0, -2.0], [1.3, 0.7], [1.0, -1.0], mask=[0.0, 0.0])
    loss, grad, m = grad_of(inp, AlgoConfig(), 0.0)
    assert loss.item() == 0.0
    close(grad, [0.0, 0.0])
    assert m["clip_frac"].item() == 0.0 and m["ratio_sum"].item() == 0.0
    # extrema of an empty micro-batch are the identities of max / min
    assert m["ratio_max"].item() == -math.inf and m["ratio_min"].item() == math.inf


def test_bool_mask_and_bf16_inputs():
    inp = make([-1.0, -0.3], [1.0, 1.1], [1.0, -1.0], mask=[1.0, 0.0])
    inp.loss_mask = inp.loss_mask.bool()
    inp.logprobs = inp.logprobs.detach().to(torch.bfloat16).requires_grad_(True)
    loss, _ = policy_loss(inp, AlgoConfig(), 1.0)
    # only t0: r = exp(bf16(-1) - (-1)) = 1, A = 1 -> -1
    close(loss, -1.0, atol=1e-2)
    assert loss.dtype == torch.float32


def test_ppo_clip_loss_alias_and_dictconfig():
    inp = make([-1.0, -0.5], [1.0, 1.5], [1.0, 1.0])
    cfg = OmegaConf.structured(AlgoConfig(loss="cispo"))
    loss, _ = ppo_clip_loss(inp, cfg, 2.0)
    close(loss, (-1.0 - 1.2) / 2)


def test_unknown_loss_and_negative_normalizer():
    inp = make([-1.0], [1.0], [1.0])
    with pytest.raises(ValueError, match="algo.loss"):
        policy_loss(inp, AlgoConfig(loss="nope"), 1.0)
    with pytest.raises(ValueError, match="normalizer"):
        policy_loss(inp, AlgoConfig(), -1.0)


def test_metric_names_follow_the_convention():
    cfg = AlgoConfig(tis_cap=2.0, mis_level="token", prob_diff_threshold=0.5, kl_coef=0.1, entropy_coef=0.01)
    inp = make([-1.0, -0.5], [1.0, 1.5], [1.0, 1.0], ref_logprobs=torch.zeros(2), entropy=torch.ones(2))
    _, m = policy_loss(inp, cfg, 2.0)
    assert all(k.endswith(("_frac", "_sum", "_max", "_min")) for k in m), sorted(m)
    assert {
        "clip_frac",
        "ratio_sum",
        "ratio_max",
        "ratio_min",
        "mismatch_kl_sum",
        "tis_weight_sum",
        "tis_trunc_frac",
        "mis_mask_frac",
        "prob_diff_mask_frac",
        "correction_mask_frac",
        "kl_ref_sum",
        "entropy_sum",
    } <= set(m)


# ---- dr_grpo, dapo ---------------------------------------------------------------------------


def test_dr_grpo_sums_tokens_over_a_constant():
    # same per-token terms as the ppo_clip test (sum -0.3); 2 samples x budget 8 tokens
    inp = make([-1.0, -0.5, -2.0, -0.3], [1.0, 1.5, 0.5, 1.1], [1.0, 1.0, -1.0, -1.0])
    cfg = AlgoConfig(loss="dr_grpo", std_normalize=False)
    normalizer = loss_normalizer(cfg, num_tokens=4, num_samples=2, max_new_tokens=8)
    assert normalizer == 16.0
    loss, grad, _ = grad_of(inp, cfg, normalizer)
    close(loss, -0.3 / 16)
    close(grad, [-1 / 16, 0.0, 0.0, 1.1 / 16])
    # an explicit constant wins over the generation budget
    assert loss_normalizer(AlgoConfig(loss="dr_grpo", dr_grpo=DrGrpoOptions(max_tokens=100)), 4, 2, 8) == 200.0


def test_loss_normalizer_per_loss():
    assert loss_normalizer(AlgoConfig(loss="ppo_clip"), 37, 4) == 37.0
    assert loss_normalizer(AlgoConfig(loss="dapo"), 37, 4) == 37.0
    assert loss_normalizer(AlgoConfig(loss="cispo"), 37, 4) == 37.0
    assert loss_normalizer(AlgoConfig(loss="gspo"), 37, 4) == 4.0
    assert loss_normalizer(AlgoConfig(), 0, 0) == 1.0
    with pytest.raises(ValueError, match="dr_grpo"):
        loss_normalizer(AlgoConfig(loss="dr_grpo"), 37, 4)


def test_dapo_clips_higher_than_ppo():
    # r = 1.25, A = 1: ppo_clip caps at 1.2 (no gradient), dapo's 1.28 lets it through
    inp = make([-1.0], [1.25], [1.0])
    loss, grad, m = grad_of(inp, AlgoConfig(), 1.0)
    close(loss, -1.2), close(grad, [0.0]), close(m["clip_frac"], 1.0)
    inp = make([-1.0], [1.25], [1.0])
    loss, grad, m = grad_of(inp, AlgoConfig(loss="dapo"), 1.0)
    close(loss, -1.25), close(grad, [-1.25]), close(m["clip_frac"], 0.0)
    # the lower clip is still clip_eps_low: r = 0.5, A = -1 -> max(0.5, 0.8) = 0.8
    inp = make([-1.0], [0.5], [-1.0])
    loss, _, m = grad_of(inp, AlgoConfig(loss="dapo"), 1.0)
    close(loss, 0.8), close(m["clip_frac"], 1.0)


# ---- gspo ------------------------------------------------------------------------------------


def gspo_inputs():
    # token 0 is a prompt token (mask 0, index -1); sample 0 has 3 tokens with log-ratios
    # [0.2, -0.1, 0.5] (mean 0.2), sample 1 has 2 with [0.1, -0.3] (mean -0.1)
    log_r = [0.0, 0.2, -0.1, 0.5, 0.1, -0.3]
    inp = make(
        [-1.0] * 6,
        [math.exp(x) for x in log_r],
        [0.0, 1.0, 1.0, 1.0, -1.0, -1.0],
        mask=[0.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    )
    inp.sample_index = torch.tensor([-1, 0, 0, 0, 1, 1])
    return inp


def test_gspo_sequence_ratio_clip_and_gradient():
    cfg = AlgoConfig(loss="gspo", gspo=GspoOptions(clip_eps_low=0.2, clip_eps_high=0.2))
    # s0 = e^0.2 = 1.221403 > 1.2 with A = +1: clipped, J0 = 1.2, no gradient
    # s1 = e^-0.1 = 0.904837 in [0.8, 1.2] with A = -1: J1 = -0.904837
    # loss = -(J0 + J1) / N, N = 2 samples
    s0, s1 = math.exp(0.2), math.exp(-0.1)
    loss, grad, m = grad_of(gspo_inputs(), cfg, loss_normalizer(cfg, 5, 2))
    close(loss, -(1.2 - s1) / 2)
    # d(-J1)/dlogp_t = -A s1 / |y_1| / N = s1 / 4 on both of sample 1's tokens
    close(grad, [0.0, 0.0, 0.0, 0.0, s1 / 4, s1 / 4])
    close(m["clip_frac"], 3.0)  # all of sample 0's tokens
    close(m["ratio_sum"], 3 * s0 + 2 * s1)
    close(m["ratio_max"], s0)
    close(m["ratio_min"], s1)


def test_gspo_defaults_use_the_papers_tiny_clip():
    # s0 = e^0.2 is far outside [1 - 3e-4, 1 + 4e-4]: clipped to 1.0004 with A = +1
    # s1 = e^-0.1 below 0.9997 with A = -1: clipped too, -A clip = 0.9997
    loss, grad, m = grad_of(gspo_inputs(), AlgoConfig(loss="gspo"), 2.0)
    close(loss, (-1.0004 + 0.9997) / 2)
    close(grad, [0.0] * 6)
    close(m["clip_frac"], 5.0)


def test_gspo_needs_sample_index():
    with pytest.raises(ValueError, match="sample_index"):
        policy_loss(make([-1.0], [1.0], [1.0]), AlgoConfig(loss="gspo"), 1.0)


# ---- cispo -----------------------------------------------------------------------------------


def test_cispo_stop_gradient_weight():
    # r = [2, 5, 0.5], A = [1, 1, -1], eps_low 1 (no lower bound), eps_high 3 (cap 4):
    # weights [2, 4, 0.5]; l = -w A logp with logp = [-1, -2, -0.5] -> [2, 8, -0.25], sum 9.75
    inp = make([-1.0, -2.0, -0.5], [2.0, 5.0, 0.5], [1.0, 1.0, -1.0])
    loss, grad, m = grad_of(inp, AlgoConfig(loss="cispo"), 3.0)
    close(loss, 9.75 / 3)
    # the weight is a constant: grad = -w * A * grad(logp) / N, also for the clipped token
    close(grad, [-2 / 3, -4 / 3, 0.5 / 3])
    close(m["clip_frac"], 1.0)
    close(m["ratio_max"], 5.0)


def test_cispo_lower_bound_when_set():
    # eps_low 0.5 -> weight >= 0.5: r = 0.2 with A = 1 gets weight 0.5, grad -0.5
    inp = make([-1.0], [0.2], [1.0])
    _, grad, m = grad_of(inp, AlgoConfig(loss="cispo", cispo=CispoOptions(eps_low=0.5)), 1.0)
    close(grad, [-0.5])
    close(m["clip_frac"], 1.0)


# ---- mismatch corrections --------------------------------------------------------------------


def test_truncated_is_weight_and_old_anchor():
    # old - behaviour = [log 3, log 0.5] -> TIS weights [min(3, 2), 0.5] = [2, 0.5]
    # current logprobs = old (no old_logprobs given: logprobs.detach()), so the ratio vs old is 1
    inp = make([-1.0, -2.0], [3.0, 0.5], [1.0, 1.0])
    loss, grad, m = grad_of(inp, AlgoConfig(tis_cap=2.0), 2.0)
    close(loss, -(2.0 + 0.5) / 2)
    close(grad, [-1.0, -0.25])
    close(m["tis_weight_sum"], 2.5)
    close(m["tis_trunc_frac"], 1.0)
    close(m["ratio_sum"], 2.0)  # the policy ratio is now against old: 1 and 1
    # k3: (3 - 1 - ln 3) + (0.5 - 1 - ln 0.5)
    close(m["mismatch_kl_sum"], (2 - LN(3)) + (-0.5 + LN(2)))
    close(m["mismatch_ratio_max"], 3.0)
    close(m["mismatch_ratio_min"], 0.5)


def test_truncated_is_with_explicit_old_logprobs_clips_against_old():
    # old = [-1, -2]; current = old + 0.5 -> ratio vs old e^0.5 = 1.6487 > 1.2, A = 1: clipped
    # old - behaviour = [log 3, log 0.5]: weights [2, 0.5] -> loss -(2 * 1.2 + 0.5 * 1.2) / 2
    old = torch.tensor([-1.0, -2.0])
    inp = make([-0.5, -1.5], [3 * math.exp(0.5), 0.5 * math.exp(0.5)], [1.0, 1.0], old_logprobs=old)
    loss, grad, m = grad_of(inp, AlgoConfig(tis_cap=2.0), 2.0)
    close(loss, -1.5)
    close(grad, [0.0, 0.0])
    close(m["tis_weight_sum"], 2.5)
    close(m["clip_frac"], 2.0)


def test_no_correction_keeps_the_behaviour_anchor_even_with_old_logprobs():
    # default config: ratio exp(logp - behaviour) = 1.1 whatever old_logprobs says
    inp = make([-1.0], [1.1], [-1.0], old_logprobs=torch.tensor([-3.0]))
    loss, _, m = grad_of(inp, AlgoConfig(), 1.0)
    close(loss, 1.1)
    # mismatch metrics compare old with behaviour: rho = e^-2 * 1.1... = exp(-3 - (-1 - ln 1.1))
    rho = math.exp(-2.0) * 1.1
    close(m["mismatch_kl_sum"], rho - 1 - LN(rho))


def test_token_masked_is():
    # rho = [3, 1.5, 0.3] with [0.5, 2]: only token 1 is kept; ratio vs behaviour = rho (no TIS)
    # token 1: r = 1.5, A = 1, eps_high 1 -> -1.5; normalizer 3
    inp = make([-1.0, -1.0, -1.0], [3.0, 1.5, 0.3], [1.0, 1.0, 1.0])
    cfg = AlgoConfig(mis_level="token", clip_eps_high=1.0)
    loss, grad, m = grad_of(inp, cfg, 3.0)
    close(loss, -0.5)
    close(grad, [0.0, -0.5, 0.0])
    close(m["mis_mask_frac"], 2.0)
    close(m["correction_mask_frac"], 2.0)


def test_sequence_masked_is_uses_the_geometric_mean():
    # sample 0: rho [2, 2] -> geometric mean 2 > 1.5: dropped
    # sample 1: rho [2, 0.5] -> geometric mean 1: kept, though its token 2 alone would be dropped
    # kept tokens, A = 1, eps 0.2: r = 2 -> -1.2 (clipped); r = 0.5 -> max(-0.5, -0.8) = -0.5
    inp = make([-1.0] * 4, [2.0, 2.0, 2.0, 0.5], [1.0] * 4, sample_index=torch.tensor([0, 0, 1, 1]))
    cfg = AlgoConfig(mis_level="sequence", mis_low=0.5, mis_high=1.5)
    loss, grad, m = grad_of(inp, cfg, 4.0)
    close(loss, -1.7 / 4)
    close(grad, [0.0, 0.0, 0.0, -0.5 / 4])
    close(m["mis_mask_frac"], 2.0)
    token_level = AlgoConfig(mis_level="token", mis_low=0.5, mis_high=1.5)
    _, m = policy_loss(make([-1.0] * 4, [2.0, 2.0, 2.0, 0.5], [1.0] * 4), token_level, 4.0)
    close(m["mis_mask_frac"], 3.0)


def test_sequence_masked_is_needs_sample_index():
    with pytest.raises(ValueError, match="sample_index"):
        policy_loss(make([-1.0], [1.0], [1.0]), AlgoConfig(mis_level="sequence"), 1.0)


def test_probability_difference_masking():
    # token 0: p_old 0.9 vs mu 0.5 -> |diff| 0.4 > 0.3: dropped
    # token 1: p_old 0.02 vs mu 0.001 -> ratio 20 but |diff| 0.019: kept
    # kept token: r = 20, A = -1, eps_low 0.2 -> max(20, 0.8) = 20 (unclipped), grad -A r = 20
    logp = [LN(0.9), LN(0.02)]
    inp = make(logp, [0.9 / 0.5, 0.02 / 0.001], [-1.0, -1.0])
    loss, grad, m = grad_of(inp, AlgoConfig(prob_diff_threshold=0.3), 2.0)
    close(loss, 10.0, atol=1e-4)
    close(grad, [0.0, 10.0], atol=1e-4)
    close(m["prob_diff_mask_frac"], 1.0)


def test_corrections_compose_with_gspo():
    # TIS (cap 2) + gspo: weights [2, 0.5] on sample 0's two tokens, ratio vs old = 1 (unclipped)
    # per token -J/|y| = -A * 1 / 2 = -0.5 -> -(0.5 * 2 + 0.5 * 0.5) over N = 1 sample
    inp = make([-1.0, -1.0], [3.0, 0.5], [1.0, 1.0], sample_index=torch.tensor([0, 0]))
    loss, _, _ = grad_of(inp, AlgoConfig(loss="gspo", tis_cap=2.0), 1.0)
    close(loss, -1.25)


# ---- KL and entropy --------------------------------------------------------------------------


def test_k3_kl_to_reference():
    # logp = ln 0.5, ref = ln 0.25 -> d = ln 0.5: k3 = 0.5 - 1 - ln 0.5 = 0.193147
    # d k3 / d logp = -(e^d - 1) = 0.5; A = 0 so only the KL term moves
    inp = make([LN(0.5)], [1.0], [0.0], ref_logprobs=torch.tensor([LN(0.25)]))
    loss, grad, m = grad_of(inp, AlgoConfig(kl_coef=0.1), 1.0)
    close(loss, 0.1 * (0.5 - 1 - LN(0.5)))
    close(grad, [0.05])
    close(m["kl_ref_sum"], 0.5 - 1 - LN(0.5))
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(make([-1.0], [1.0], [0.0]), AlgoConfig(kl_coef=0.1), 1.0)


def test_entropy_bonus():
    entropy = torch.tensor([1.0, 2.0, 5.0], requires_grad=True)
    inp = make([-1.0, -1.0, -1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], mask=[1.0, 1.0, 0.0], entropy=entropy)
    loss, m = policy_loss(inp, AlgoConfig(entropy_coef=0.01), 2.0)
    loss.backward()
    close(loss, -0.01 * 3 / 2)
    close(entropy.grad, [-0.005, -0.005, 0.0])
    close(m["entropy_sum"], 3.0)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(make([-1.0], [1.0], [0.0]), AlgoConfig(entropy_coef=0.01), 1.0)


# ---- validate_algo ---------------------------------------------------------------------------


def test_defaults_are_valid():
    assert validate_algo(AlgoConfig()) == []
    assert validate_algo(OmegaConf.structured(AlgoConfig)) == []
    for loss in LOSSES:
        std = loss != "dr_grpo"
        assert validate_algo(AlgoConfig(loss=loss, std_normalize=std)) == [], loss


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        ({"loss": "x"}, "algo.loss", "unknown loss 'x'; choose one of ppo_clip"),
        ({"name": "ppo"}, "algo.name", "unknown advantage estimator"),
        ({"group_size": 1}, "algo.group_size", ">= 2"),
        ({"name": "rloo", "group_size": 1}, "algo.group_size", ">= 2"),
        ({"batch_groups": 0}, "algo.batch_groups", ">= 1"),
        ({"clip_eps_low": -0.1}, "algo.clip_eps_low", "[0.0, 1.0]"),
        ({"clip_eps_high": -0.1}, "algo.clip_eps_high", ">= 0"),
        ({"clip_eps_high": math.nan}, "algo.clip_eps_high", ">= 0"),
        ({"dapo": DapoOptions(clip_eps_high=-1.0)}, "algo.dapo.clip_eps_high", ">= 0"),
        ({"gspo": GspoOptions(clip_eps_low=2.0)}, "algo.gspo.clip_eps_low", "[0.0, 1.0]"),
        ({"cispo": CispoOptions(eps_high=-1.0)}, "algo.cispo.eps_high", ">= 0"),
        ({"loss": "dr_grpo"}, "algo.std_normalize", "std_normalize=false"),
        ({"dr_grpo": DrGrpoOptions(max_tokens=-1)}, "algo.dr_grpo.max_tokens", ">= 0"),
        ({"tis_cap": 0.5}, "algo.tis_cap", ">= 1"),
        ({"mis_level": "batch"}, "algo.mis_level", "token, sequence"),
        ({"mis_low": 1.5}, "algo.mis_low", "[0.0, 1.0]"),
        ({"mis_high": 0.9}, "algo.mis_high", ">= 1"),
        ({"prob_diff_threshold": 2.0}, "algo.prob_diff_threshold", "[0.0, 1.0]"),
        ({"kl_coef": -0.1}, "algo.kl_coef", ">= 0"),
        ({"entropy_coef": -0.1}, "algo.entropy_coef", ">= 0"),
        ({"length_penalty": "quadratic"}, "algo.length_penalty", "overlong, linear"),
        ({"length_penalty": "overlong"}, "algo.overlong_max_tokens", "> 0"),
        ({"length_penalty": "overlong", "overlong_max_tokens": 10}, "algo.overlong_buffer_tokens", "(0,"),
        (
            {"length_penalty": "overlong", "overlong_max_tokens": 10, "overlong_buffer_tokens": 11},
            "algo.overlong_buffer_tokens",
            "(0,",
        ),
        ({"length_penalty": "linear"}, "algo.length_penalty_per_token", "> 0"),
    ],
)
def test_validate_names_the_key(overrides, key, words):
    cfg = AlgoConfig(**overrides)  # each field's own bound (on the schema), then the section's rules
    problems = field_problems(cfg, "algo.") + validate_algo(cfg)
    assert any(k == key and words in msg for k, msg in problems), problems


def test_valid_non_defaults():
    cfg = AlgoConfig(
        name="reinforce_pp_baseline",
        loss="gspo",
        tis_cap=2.0,
        mis_level="sequence",
        mis_low=0.999,
        mis_high=1.001,
        prob_diff_threshold=0.2,
        kl_coef=0.001,
        entropy_coef=0.001,
        length_penalty="overlong",
        overlong_max_tokens=1024,
        overlong_buffer_tokens=256,
        filter_zero_adv_groups=True,
    )
    assert validate_algo(cfg) == []
    # std_normalize does not matter for rloo, so dr_grpo with it is fine
    assert validate_algo(AlgoConfig(name="rloo", loss="dr_grpo")) == []
