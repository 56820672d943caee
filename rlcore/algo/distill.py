"""On-policy distillation: a teacher's per-token logprobs on the student's own samples become a
per-token advantage (reverse KL, as in Thinking Machines' "On-Policy Distillation", 2025, and
prime-rl's `opd`), optionally added to the environment reward's advantage.

For sample ``i`` and its policy token ``t`` (loss mask 1), with ``s_t`` the student's behaviour
logprob (what the engine reported when it sampled ``y_t``) and ``q_t`` the teacher's
teacher-forced logprob of the same token at temperature 1::

    k_t   = s_t - q_t                          per-token reverse KL estimate, KL(student || teacher)
    A_it  = reward_coef * A_i - kl_coef * k_t  the token's advantage
          = reward_coef * A_i + kl_coef * (q_t - s_t)

``A_i`` is the sample's reward advantage (GRPO and friends, after their normalisation). The
policy loss (``algo.loss``) then treats ``A_it`` like any advantage: with the importance ratio
``r_t = pi(y_t) / pi_behaviour(y_t)`` the gradient of ``-A_it r_t`` at ``r_t = 1`` is
``A_it grad log pi(y_t)``, a single-sample (discount 0) policy-gradient estimate of
``-grad KL(pi || pi_teacher)``: tokens the teacher finds likelier than the student are pushed up,
the others down. The sample mean of ``k_t`` over sampled tokens estimates the reverse KL itself
(reported as ``teacher_kl``). With ``rollout.sampling.temperature != 1`` or ``top_p < 1`` the
student logprob is of the tempered/truncated sampling distribution (the one the tokens came from).
Environment tokens (loss mask 0) keep ``reward_coef * A_i``; the loss ignores them anyway.

With ``center`` (``teacher.kl_baseline=true``) the batch mean ``b = mean_t (q_t - s_t)`` over all
policy tokens of the batch is subtracted first::

    A_it = reward_coef * A_i + kl_coef * (q_t - s_t - b)

A constant baseline leaves the expected policy gradient unchanged (``E[grad log pi] = 0``) but
removes its large common part: a sharp teacher makes nearly every ``q_t - s_t`` negative, so
without it every sampled token is pushed down and the gradient norm (clipped by
``trainer.max_grad_norm``) is spent on that shared push.

With a deadband ``d`` (``teacher.kl_deadband``) a token whose per-token estimate is within it,
``|q_t - s_t| <= d``, gets no distillation advantage at all (baseline included)::

    A_it = reward_coef * A_i + kl_coef * [|q_t - s_t| > d] * (q_t - s_t - b)

Why: a student that already matches the teacher has ``q_t - s_t`` of numerical noise only
(~1e-6: two engines, two kernels). Its gradient is then noise too, and Adam divides the update
by the gradient's own running scale, so noise of any size becomes an ``lr``-sized step: a
converged student drifts away from the teacher (measured in ``recipes/distill_reverse_text.yaml``).
The deadband zeroes those tokens, so the step has no gradient and Adam's update stays
(its moments decay) near 0; tokens the student still gets wrong (``|q_t - s_t|`` of nats) keep
their full advantage. ``d = 0`` keeps the exact estimator.

**Top-k distillation** (``teacher.top_k = k > 0``). The sampled token's ``q_t - s_t`` says how
wrong the one drawn token was; the teacher knows more: its whole next-token distribution at the
student's position. The teacher returns its k likeliest tokens ``J_t`` and their logprobs
``q_tj``, and the loss adds, per policy token (normalised like the policy loss, weighted by
``teacher.top_k_coef``), the KL between teacher and student over k + 1 outcomes, the k tokens and
"any other token" (``p_t* = 1 - sum_j exp(q_tj)``, ``pi_t* = 1 - sum_j pi_t(j)``)::

    L_t = sum_{j in J_t} exp(q_tj) (q_tj - log pi_t(j))  +  p_t* (log p_t* - log pi_t*)

It is 0 exactly when the student gives each of the k tokens the teacher's probability (so a
student that matches the teacher gets no gradient: renormalising the top-k instead would push
every student to put all its mass on them), it never exceeds the full KL(teacher || student)
(merging outcomes loses information) and equals it when k is the vocabulary. Its gradient is the
forward-KL (soft cross-entropy) gradient at every position the student visited: no sampling
variance, and a signal on the token the teacher wanted even where the student drew another (GKD,
Agarwal et al. 2024, at beta 0 on the student's own samples; NeMo-RL's top-k distillation).
``pi_t`` is the student's tempered sampling distribution, like ``s_t``. ``teacher_top_k_mass``
(mean ``sum_j exp(q_tj)``) says how much of the teacher's distribution k covers. The deadband
applies here too: a token whose k student logprobs are all within ``d`` of the teacher's
(``max_j |q_tj - log pi_t(j)| <= d``) gets no top-k term, so a student that matches the teacher
up to two engines' rounding does not drift on it.
"""

from __future__ import annotations

from typing import Sequence

import torch


def token_advantages(
    reward_advantage: float,
    behaviour_logprobs: Sequence[float],
    teacher_logprobs: Sequence[float],
    loss_mask: Sequence[int],
    kl_coef: float,
    reward_coef: float,
    baseline: float = 0.0,
    deadband: float = 0.0,
) -> list[float]:
    """``A_t = reward_coef * A + kl_coef * [|q_t - s_t| > deadband] * (q_t - s_t - baseline)`` on
    policy tokens, ``reward_coef * A`` elsewhere; one value per completion token (see the module
    docstring)."""
    if not len(behaviour_logprobs) == len(teacher_logprobs) == len(loss_mask):
        raise ValueError(
            f"distill: {len(behaviour_logprobs)} behaviour, {len(teacher_logprobs)} teacher "
            f"logprobs and {len(loss_mask)} mask entries for one completion"
        )
    base = reward_coef * float(reward_advantage)
    return [
        base + kl_coef * (q - s - baseline) if m and (not deadband or abs(q - s) > deadband) else base
        for s, q, m in zip(behaviour_logprobs, teacher_logprobs, loss_mask)
    ]


def reverse_kl_sum(
    behaviour_logprobs: Sequence[float], teacher_logprobs: Sequence[float], loss_mask: Sequence[int]
) -> tuple[float, int]:
    """``(sum_t m_t (s_t - q_t), sum_t m_t)``: the reverse-KL estimate summed over policy tokens,
    and their count (their ratio over a batch is ``teacher_kl``)."""
    total, count = 0.0, 0
    for s, q, m in zip(behaviour_logprobs, teacher_logprobs, loss_mask):
        if m:
            total += s - q
            count += 1
    return total, count


def teacher_sums(
    behaviour_logprobs: Sequence[float], teacher_logprobs: Sequence[float], loss_mask: Sequence[int]
) -> tuple[float, int, float]:
    """One sample's ``(sum_t m_t (s_t - q_t), sum_t m_t, sum_t m_t q_t)`` (what
    :func:`batch_baseline` needs of it: the driver keeps these three numbers, not the tokens)."""
    kl, count = reverse_kl_sum(behaviour_logprobs, teacher_logprobs, loss_mask)
    return kl, count, sum(q for q, m in zip(teacher_logprobs, loss_mask) if m)


def batch_baseline(sums: Sequence[tuple[float, int, float]], center: bool) -> tuple[float, dict[str, float]]:
    """From each sample's ``(sum_t m_t (s_t - q_t), sum_t m_t, sum_t m_t q_t)``: the baseline ``b``
    (``-sum kl / tokens`` with ``center``, else 0) and the metrics ``teacher_kl`` (mean
    ``s_t - q_t`` over the batch's policy tokens) and ``teacher_logprob_mean`` (mean ``q_t``)."""
    kl_total, tokens, q_total = 0.0, 0, 0.0
    for kl, n, q in sums:
        kl_total += kl
        tokens += n
        q_total += q
    n = max(tokens, 1)
    return (-kl_total / n if center else 0.0), {"teacher_kl": kl_total / n, "teacher_logprob_mean": q_total / n}


def batch_token_advantages(
    samples: Sequence,
    reward_advantages: Sequence[float],
    kl_coef: float,
    reward_coef: float,
    center: bool = False,
    deadband: float = 0.0,
) -> tuple[list[list[float]], dict[str, float]]:
    """Per-token advantages of a batch of :class:`rlcore.types.Sample` that carry
    ``teacher_logprobs`` (``center``: minus the batch-mean baseline; ``deadband``: tokens with
    ``|q_t - s_t| <= deadband`` get none; see the module docstring),
    and the metrics ``teacher_kl`` (mean of ``s_t - q_t`` over all policy tokens of the batch) and
    ``teacher_logprob_mean`` (mean ``q_t``)."""
    sums = []
    for sample in samples:
        if sample.teacher_logprobs is None:
            raise ValueError("distill: a sample reached the trainer without teacher logprobs")
        sums.append(teacher_sums(sample.logprobs, sample.teacher_logprobs, sample.loss_mask))
    baseline, metrics = batch_baseline(sums, center)
    out = [
        token_advantages(adv, s.logprobs, s.teacher_logprobs, s.loss_mask, kl_coef, reward_coef, baseline, deadband)
        for s, adv in zip(samples, reward_advantages)
    ]
    return out, metrics


def top_k_loss(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, loss_mask: torch.Tensor, deadband: float = 0.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(sum_t m_t L_t, metrics)``, ``L_t`` the KL from teacher to student over the teacher's
    top-k tokens and the rest (module docstring); tokens whose k logprobs all lie within
    ``deadband`` of the teacher's are left out of the sum. ``student_logprobs`` [T, k]: the
    student's logprobs of the teacher's top-k tokens (with grad); ``teacher_logprobs`` [T, k]:
    the teacher's; ``loss_mask`` [T]. Metrics (token sums over the mask, all tokens counted):
    ``teacher_top_k_kl_sum``, ``teacher_top_k_mass_sum`` and ``student_top_k_mass_sum`` (each
    side's mass on the k tokens)."""
    q, s = teacher_logprobs.float(), student_logprobs.float()
    mask = loss_mask > 0
    trained = mask & ((q - s.detach()).abs().amax(-1) > deadband) if deadband else mask
    p = q.exp()
    p_mass, s_mass = p.sum(-1), s.exp().sum(-1)
    p_rest = (1.0 - p_mass).clamp(min=0.0)
    # the student's rest can round to 0 where it is certain of a top-k token: floor it
    s_rest = (1.0 - s_mass).clamp(min=1e-12)
    rest = torch.where(p_rest > 0, p_rest * (torch.log(p_rest.clamp(min=1e-30)) - torch.log(s_rest)), 0.0)
    per_token = torch.where(mask, (p * (q - s)).sum(-1) + rest, 0.0)
    with torch.no_grad():
        metrics = {
            "teacher_top_k_kl_sum": per_token.sum(),
            "teacher_top_k_mass_sum": torch.where(mask, p_mass, 0.0).sum(),
            "student_top_k_mass_sum": torch.where(mask, s_mass, 0.0).sum(),
        }
    return torch.where(trained, per_token, 0.0).sum(), metrics
