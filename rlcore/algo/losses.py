"""Policy losses: pure functions of per-token tensors of one packed micro-batch.

Every loss has the form::

    loss = sum_t m_t * k_t * c_t * w_t * l_t / normalizer
           + kl_coef * sum_t m_t * w_t * k3_t / normalizer
           - entropy_coef * sum_t m_t * w_t * H_t / normalizer

with ``m`` the loss mask, ``l_t`` the loss's per-token surrogate (below), ``k_t`` / ``c_t`` the
keep mask and weight of the train/inference mismatch corrections (:mod:`rlcore.algo.corrections`)
and ``w_t`` the aggregation weight: 1 for token-level losses, ``1 / |y_i|`` for the
sequence-level ``gspo`` (so a sample's tokens add up to its one sequence term). ``k3_t`` estimates
``KL(pi || pi_ref)`` (:func:`k3_to_reference`) and ``H_t`` is the policy's entropy. The KL and
entropy terms act on every loss token: the correction masks only decide which tokens' policy
gradient is trusted, and the regularisers are valid on any token.

``normalizer`` is the same number on every micro-batch and rank of one optimizer step, so that
gradient accumulation over micro-batches and the FSDP mean over ranks add up to the objective
over the global batch; :func:`loss_normalizer` gives it for ``cfg.loss`` (its spec's
``normalizer``, :mod:`rlcore.algo.registry`):

- ``ppo_clip``, ``dapo``, ``cispo`` and a loss given by path: the number of loss tokens in the
  global batch (token mean);
- ``dr_grpo``: ``num_samples * max_tokens``, a constant that does not depend on the lengths;
- ``gspo``: the number of samples in the global batch (sequence mean).

The surrogates ``l_t`` and the contract of a loss function are in :mod:`rlcore.algo.surrogates`.

Metrics: names ending in ``_frac`` or ``_sum`` are token sums over the micro-batch's loss
tokens (the caller adds them over micro-batches and ranks and divides by the loss-token
count); names ending in ``_max`` / ``_min`` are extrema (reduce with max / min; an empty
micro-batch reports -inf / +inf, the identities).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlcore.algo.corrections import mismatch_correction, uses_old_ratio
from rlcore.algo.registry import (
    LOSSES,  # noqa: F401  (re-exported)
    LossSpec,
    function,
    loss_spec,
)
from rlcore.algo.surrogates import SurrogateContext
from rlcore.algo.tokens import masked_max, masked_min, masked_sum, per_sample_count
from rlcore.config import AlgoConfig


@dataclass
class LossInputs:
    """Per-token tensors, all shaped ``[T]`` (T = tokens of the packed micro-batch)."""

    logprobs: Tensor
    """Logprobs of the taken tokens under the policy being trained (requires grad)."""
    behaviour_logprobs: Tensor
    """Logprobs the rollout engine reported when it sampled the tokens."""
    advantages: Tensor
    """Advantage of the token's sample, broadcast over its tokens."""
    loss_mask: Tensor
    """1.0 on tokens that are trained on (policy tokens), 0.0 elsewhere (bool also accepted)."""
    sample_index: Tensor | None = None
    """Long: which sample of the micro-batch (0..S-1) each token belongs to; needed by `gspo` and
    sequence-level masked IS. Tokens outside the loss mask may carry any value (e.g. -1)."""
    old_logprobs: Tensor | None = None
    """The trainer's logprobs before this optimizer step (no grad), for the mismatch corrections;
    None uses ``logprobs.detach()`` (equal to them when each batch gets one optimizer step)."""
    ref_logprobs: Tensor | None = None
    """Logprobs under the reference policy (no grad); needed when ``algo.kl_coef > 0``."""
    entropy: Tensor | None = None
    """Entropy of the policy's next-token distribution at each token (with grad); needed when
    ``algo.entropy_coef > 0``."""
    top_k_logprobs: Tensor | None = None
    """[T, k]: the policy's logprobs of the teacher's top-k tokens at each position (with grad;
    `teacher.top_k`), for `rlcore.algo.distill.top_k_loss`; None without."""
    teacher_top_k_logprobs: Tensor | None = None
    """[T, k]: the teacher's logprobs of those tokens (no grad); None without."""
    same_version: Tensor | None = None
    """Bool: the token was sampled by the weights being trained (its sample's oldest behaviour
    version is the trainer's version before this step); splits ``mismatch_kl`` into
    ``engine_mismatch_kl`` and ``staleness_kl`` (metrics only). None: no split."""


def loss_normalizer(cfg: AlgoConfig, num_tokens: int, num_samples: int, max_new_tokens: int = 0) -> float:
    """The ``normalizer`` to pass to :func:`policy_loss` for ``cfg.loss``, from global-batch counts.

    ``num_tokens``: loss tokens in the global batch (all ranks, all micro-batches);
    ``num_samples``: samples in it; ``max_new_tokens``: the generation budget, used by
    ``dr_grpo`` when ``cfg.dr_grpo.max_tokens`` is 0. At least 1, so an empty batch gives loss 0.
    """
    value = loss_spec(cfg.loss).normalizer(cfg, num_tokens, num_samples, max_new_tokens)
    return float(max(value, 1))


def k3_to_reference(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of ``KL(pi || pi_ref)`` on tokens sampled from pi (Schulman 2020,
    "Approximating KL divergence"; GRPO's KL term, arXiv:2402.03300, eq. 4)::

        k3_t = pi_ref/pi - log(pi_ref/pi) - 1 = exp(d_t) - d_t - 1,   d_t = logp_ref_t - logp_t

    Non-negative and unbiased; differentiable in ``logprobs``.
    """
    d = ref_logprobs - logprobs
    return torch.expm1(d) - d


def policy_loss(inp: LossInputs, cfg: AlgoConfig, normalizer: float) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss selected by ``cfg.loss`` plus the configured corrections, KL and entropy terms.

    See the module docstring for the formula and :func:`loss_normalizer` for ``normalizer``.
    Returns ``(loss, metrics)``; ``loss`` is a scalar with a graph even when no token is
    trained on (so every rank can run backward). Metrics (token sums unless ``_max/_min``):
    ``clip_frac``, ``ratio_sum/max/min`` (the policy ratio; for ``gspo`` each token carries its
    sequence's ratio), the correction metrics of
    :func:`~rlcore.algo.corrections.mismatch_correction` (``mismatch_kl_sum`` always; its
    engine/staleness split with ``same_version``),
    ``kl_ref_sum`` and ``entropy_sum`` when those terms are on.
    """
    options = dict(cfg.loss_options or {}) if ":" in cfg.loss else {}  # a loss by path takes its options
    return _policy_loss(inp, cfg, normalizer, loss_spec(cfg.loss), options)


def ppo_clip_loss(inp: LossInputs, cfg: AlgoConfig, normalizer: float) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`policy_loss` with the ``ppo_clip`` surrogate whatever ``cfg.loss`` says."""
    return _policy_loss(inp, cfg, normalizer, loss_spec("ppo_clip"), {})


def _policy_loss(
    inp: LossInputs, cfg: AlgoConfig, normalizer: float, spec: LossSpec, options: dict
) -> tuple[Tensor, dict[str, Tensor]]:
    surrogate = function(spec.surrogate, "algo.loss")
    if spec.per_sequence and inp.sample_index is None:
        raise ValueError(f"algo.loss={spec.name} needs LossInputs.sample_index (token -> sample of the micro-batch)")
    if isinstance(normalizer, (int, float)):
        if normalizer < 0:
            raise ValueError(f"normalizer must be >= 0, got {normalizer}")
        # A step without loss tokens has a zero sum; dividing by 1 keeps it finite.
        normalizer = normalizer or 1.0
    mask = inp.loss_mask > 0
    logprobs = inp.logprobs.float()
    behaviour = inp.behaviour_logprobs.float()
    old = (inp.old_logprobs if inp.old_logprobs is not None else inp.logprobs.detach()).float()

    corr = mismatch_correction(old, behaviour, mask, cfg, inp.sample_index, inp.same_version)
    anchor = old if uses_old_ratio(cfg) else behaviour
    # Zero everything off the loss mask: prompt/env positions may hold any logprob, and an inf
    # there would turn 0 * inf into nan in the forward or the backward pass.
    log_ratio = torch.where(mask, logprobs - anchor, 0.0)
    ctx = SurrogateContext(mask=mask, sample_index=inp.sample_index, logprobs=torch.where(mask, logprobs, 0.0))
    adv = torch.where(mask, inp.advantages.float(), 0.0)

    per_token, clipped, ratio = surrogate(log_ratio, adv, cfg, ctx, **options)
    shapes = [tuple(t.shape) for t in (per_token, clipped, ratio)]
    if any(shape != tuple(log_ratio.shape) for shape in shapes):
        raise ValueError(
            f"algo.loss={spec.name}: the surrogate returned shapes {shapes}, "
            f"expected three of [T] = {tuple(log_ratio.shape)}"
        )
    # Aggregation weight: a sequence-level loss averages over each sample's tokens, the others sum.
    if spec.per_sequence:
        agg = 1.0 / per_sample_count(inp.sample_index, mask)
    else:
        agg = torch.ones_like(per_token)
    total = masked_sum(per_token * agg * corr.weight * corr.keep.float(), mask)

    metrics = {
        "clip_frac": masked_sum(clipped.float(), mask).detach(),
        "ratio_sum": masked_sum(ratio.detach(), mask),
        "ratio_max": masked_max(ratio.detach(), mask),
        "ratio_min": masked_min(ratio.detach(), mask),
        **corr.metrics,
    }

    if cfg.kl_coef > 0:
        if inp.ref_logprobs is None:
            raise ValueError("algo.kl_coef > 0 needs LossInputs.ref_logprobs")
        ref = torch.where(mask, inp.ref_logprobs.float(), 0.0)
        k3 = k3_to_reference(ctx.logprobs, ref)
        total = total + cfg.kl_coef * masked_sum(k3 * agg, mask)
        metrics["kl_ref_sum"] = masked_sum(k3.detach(), mask)

    if cfg.entropy_coef > 0:
        if inp.entropy is None:
            raise ValueError("algo.entropy_coef > 0 needs LossInputs.entropy")
        entropy = torch.where(mask, inp.entropy.float(), 0.0)
        total = total - cfg.entropy_coef * masked_sum(entropy * agg, mask)
        metrics["entropy_sum"] = masked_sum(entropy.detach(), mask)

    return total / normalizer, metrics
