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
over the global batch; :func:`loss_normalizer` gives it for ``cfg.loss``:

- ``ppo_clip``, ``dapo``, ``cispo``: the number of loss tokens in the global batch (token mean);
- ``dr_grpo``: ``num_samples * max_tokens``, a constant that does not depend on the lengths;
- ``gspo``: the number of samples in the global batch (sequence mean).

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
from rlcore.algo.tokens import masked_max, masked_min, masked_sum, per_sample_count, per_sample_mean
from rlcore.config import AlgoConfig

from rlcore.algo.names import LOSSES  # noqa: F401  (re-exported)


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


# ---- per-token surrogates ------------------------------------------------------------------------

_Surrogate = tuple[Tensor, Tensor, Tensor]
"""(loss_t, clipped_t, ratio_t), all ``[T]``: per-token loss, bool 'the clip acted', policy ratio."""


@dataclass
class _Context:
    """What some surrogates need besides the log-ratio and advantages."""

    mask: Tensor
    """Bool loss mask."""
    sample_index: Tensor | None
    """Token -> sample of the micro-batch (gspo)."""
    logprobs: Tensor
    """Current logprobs with grad, zero off the mask (cispo)."""


def clipped_surrogate(log_ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> _Surrogate:
    """PPO's clipped surrogate, per token: ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``.

    ``clipped`` marks tokens where the clipped branch is the larger one, i.e. whose gradient the
    clip removes (``r > 1 + eps_high`` with ``A > 0``, or ``r < 1 - eps_low`` with ``A < 0``).
    """
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    unclipped_loss = -adv * ratio
    clipped_loss = -adv * clipped_ratio
    return torch.maximum(unclipped_loss, clipped_loss), clipped_loss > unclipped_loss, ratio


def ppo_clip_surrogate(log_ratio: Tensor, adv: Tensor, cfg: AlgoConfig, ctx: _Context) -> _Surrogate:
    """Token-level clipped policy gradient (PPO, Schulman et al. 2017, arXiv:1707.06347; GRPO,
    Shao et al. 2024, arXiv:2402.03300, applies it per token). With ``r_t = exp(logp_t - logp_anchor_t)``::

        l_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_eps_low, 1 + clip_eps_high))

    normalised by the global loss-token count (a token mean over the batch, as DAPO recommends,
    rather than GRPO's original mean of per-sample means, which under-weights long samples).
    The anchor is the behaviour logprobs, so the ratio also corrects the off-policy gap of
    asynchronous generation; with truncated IS on it is the trainer's old logprobs.
    """
    return clipped_surrogate(log_ratio, adv, cfg.clip_eps_low, cfg.clip_eps_high)


def dr_grpo_surrogate(log_ratio: Tensor, adv: Tensor, cfg: AlgoConfig, ctx: _Context) -> _Surrogate:
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783).

    Same per-token clipped surrogate as ``ppo_clip`` (``clip_eps_low/high``), but GRPO's two
    length- and difficulty-dependent normalisations are removed: no ``1/|y_i|`` (the loss is a
    plain token *sum*) and no reward std (set ``algo.std_normalize=false``)::

        loss = sum_i sum_t l_it / (num_samples * L)

    ``L`` is a constant (the generation budget, ``dr_grpo_max_tokens`` or ``max_new_tokens``,
    as in the paper's code) that only fixes the scale; :func:`loss_normalizer` returns
    ``num_samples * L`` as the ``normalizer``. A token's weight then depends neither on its own
    sample's length (GRPO's per-sample mean favours short correct and long wrong answers) nor on
    the lengths of the rest of the batch (as a token mean's would).
    """
    return clipped_surrogate(log_ratio, adv, cfg.clip_eps_low, cfg.clip_eps_high)


def dapo_surrogate(log_ratio: Tensor, adv: Tensor, cfg: AlgoConfig, ctx: _Context) -> _Surrogate:
    """DAPO's clip-higher token-level loss (Yu et al. 2025, arXiv:2503.14476)::

        l_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_eps_low, 1 + dapo_clip_eps_high))

    with a larger upper clip (0.28 vs 0.2) so that low-probability tokens with positive
    advantage can grow, which keeps entropy from collapsing; normalised by the global
    loss-token count. DAPO's other parts live elsewhere: dynamic sampling is
    ``algo.filter_zero_adv_groups`` and the overlong penalty ``algo.length_penalty=overlong``.
    """
    return clipped_surrogate(log_ratio, adv, cfg.clip_eps_low, cfg.dapo_clip_eps_high)


def gspo_surrogate(log_ratio: Tensor, adv: Tensor, cfg: AlgoConfig, ctx: _Context) -> _Surrogate:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071).

    The importance ratio is per *sequence*: the geometric mean of its token ratios, and the clip
    acts on it, so a sample is kept or clipped as a whole::

        s_i = exp( (1/|y_i|) sum_t log r_it )
        J_i = min(s_i A_i, clip(s_i, 1 - gspo_clip_eps_low, 1 + gspo_clip_eps_high) A_i)
        loss = -(1/N) sum_i J_i

    Here ``l_t = -J_i`` on every token of sample i and the aggregation weight ``1/|y_i|`` makes the
    sample's tokens add up to ``-J_i``; :func:`loss_normalizer` gives ``N`` (samples). The
    gradient, ``s_i A_i (1/|y_i|) sum_t grad log pi(y_it)``, equals that of the paper's
    GSPO-token form when the advantage is constant over the sample.
    """
    if ctx.sample_index is None:
        raise ValueError("algo.loss=gspo needs LossInputs.sample_index (token -> sample of the micro-batch)")
    seq_log_ratio = per_sample_mean(log_ratio, ctx.sample_index, ctx.mask)
    return clipped_surrogate(seq_log_ratio, adv, cfg.gspo_clip_eps_low, cfg.gspo_clip_eps_high)


def cispo_surrogate(log_ratio: Tensor, adv: Tensor, cfg: AlgoConfig, ctx: _Context) -> _Surrogate:
    """CISPO (MiniMax-M1, MiniMax 2025, arXiv:2506.13585, eq. 4).

    Clip the importance *weight* and stop its gradient, instead of clipping the update::

        l_t = -sg(clip(r_t, 1 - cispo_eps_low, 1 + cispo_eps_high)) * A_t * log pi(y_t)

    so ``grad l_t = -clip(r_t) A_t grad log pi(y_t)``: every token keeps a gradient (PPO drops the
    clipped ones, often the rare "reflective" tokens), with a bounded weight. Normalised by the
    global loss-token count, as in the paper. ``clipped`` marks tokens whose weight was clipped.
    """
    ratio = torch.exp(log_ratio).detach()
    low, high = 1.0 - cfg.cispo_eps_low, 1.0 + cfg.cispo_eps_high
    weight = ratio.clamp(low, high)
    return -weight * adv * ctx.logprobs, (ratio < low) | (ratio > high), ratio


_SURROGATES = {
    "ppo_clip": ppo_clip_surrogate,
    "dr_grpo": dr_grpo_surrogate,
    "dapo": dapo_surrogate,
    "gspo": gspo_surrogate,
    "cispo": cispo_surrogate,
}


def loss_normalizer(cfg: AlgoConfig, num_tokens: int, num_samples: int, max_new_tokens: int = 0) -> float:
    """The ``normalizer`` to pass to :func:`policy_loss` for ``cfg.loss``, from global-batch counts.

    ``num_tokens``: loss tokens in the global batch (all ranks, all micro-batches);
    ``num_samples``: samples in it; ``max_new_tokens``: the generation budget, used by
    ``dr_grpo`` when ``cfg.dr_grpo_max_tokens`` is 0. At least 1, so an empty batch gives loss 0.
    """
    if cfg.loss == "dr_grpo":
        per_sample = cfg.dr_grpo_max_tokens or max_new_tokens
        if per_sample <= 0:
            raise ValueError("algo.loss=dr_grpo needs algo.dr_grpo_max_tokens or max_new_tokens > 0")
        value = num_samples * per_sample
    elif cfg.loss == "gspo":
        value = num_samples
    elif cfg.loss in LOSSES:
        value = num_tokens
    else:
        raise ValueError(f"algo.loss: unknown policy loss {cfg.loss!r}; choose one of {', '.join(LOSSES)}")
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
    :func:`~rlcore.algo.corrections.mismatch_correction` (``mismatch_kl_sum`` always),
    ``kl_ref_sum`` and ``entropy_sum`` when those terms are on.
    """
    return _policy_loss(inp, cfg, normalizer, cfg.loss)


def ppo_clip_loss(inp: LossInputs, cfg: AlgoConfig, normalizer: float) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`policy_loss` with the ``ppo_clip`` surrogate whatever ``cfg.loss`` says."""
    return _policy_loss(inp, cfg, normalizer, "ppo_clip")


def _policy_loss(
    inp: LossInputs, cfg: AlgoConfig, normalizer: float, loss_name: str
) -> tuple[Tensor, dict[str, Tensor]]:
    if loss_name not in _SURROGATES:
        raise ValueError(f"algo.loss: unknown policy loss {loss_name!r}; choose one of {', '.join(LOSSES)}")
    if isinstance(normalizer, (int, float)):
        if normalizer < 0:
            raise ValueError(f"normalizer must be >= 0, got {normalizer}")
        # A step without loss tokens has a zero sum; dividing by 1 keeps it finite.
        normalizer = normalizer or 1.0
    mask = inp.loss_mask > 0
    logprobs = inp.logprobs.float()
    behaviour = inp.behaviour_logprobs.float()
    old = (inp.old_logprobs if inp.old_logprobs is not None else inp.logprobs.detach()).float()

    corr = mismatch_correction(old, behaviour, mask, cfg, inp.sample_index)
    anchor = old if uses_old_ratio(cfg) else behaviour
    # Zero everything off the loss mask: prompt/env positions may hold any logprob, and an inf
    # there would turn 0 * inf into nan in the forward or the backward pass.
    log_ratio = torch.where(mask, logprobs - anchor, 0.0)
    ctx = _Context(mask=mask, sample_index=inp.sample_index, logprobs=torch.where(mask, logprobs, 0.0))
    adv = torch.where(mask, inp.advantages.float(), 0.0)

    per_token, clipped, ratio = _SURROGATES[loss_name](log_ratio, adv, cfg, ctx)
    # Aggregation weight: gspo averages over each sample's tokens, the others sum over tokens.
    if loss_name == "gspo":
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
