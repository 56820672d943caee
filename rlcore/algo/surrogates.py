"""Per-token surrogates of the built-in policy losses, and the contract a loss function keeps.

A *surrogate* (what ``algo.loss`` names, built in or ``algo.loss=pkg.mod:fn``) is called as::

    loss_t, clipped_t, ratio_t = surrogate(log_ratio, adv, cfg, ctx)

with, for the ``T`` tokens of one packed micro-batch:

- ``log_ratio`` ``[T]`` float: ``log pi(y_t) - log pi_anchor(y_t)``, with gradient through the
  policy's logprobs; the anchor is the behaviour logprobs (the old logprobs with truncated IS);
  zero off the loss mask;
- ``adv`` ``[T]`` float: the advantage of the token's sample, zero off the loss mask;
- ``cfg``: the run's ``AlgoConfig`` (a loss's own options are its section, ``cfg.<name>``);
- ``ctx``: :class:`SurrogateContext` (bool mask, sample index, logprobs with gradient).

It returns three ``[T]`` tensors: ``loss_t`` (the per-token loss ``l_t``, differentiable),
``clipped_t`` (bool: the clip, or whatever the loss bounds, acted on the token; reported as
``clip_frac``) and ``ratio_t`` (the policy ratio the loss used, reported as ``ratio_*``). Values off
the mask are ignored. :func:`rlcore.algo.losses.policy_loss` then forms
``sum_t m_t k_t c_t w_t l_t / normalizer`` plus the KL and entropy terms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlcore.algo.tokens import per_sample_mean
from rlcore.config import AlgoConfig

Surrogate = tuple[Tensor, Tensor, Tensor]
"""(loss_t, clipped_t, ratio_t), all ``[T]``: per-token loss, bool 'the clip acted', policy ratio."""


@dataclass
class SurrogateContext:
    """What some surrogates need besides the log-ratio and advantages (all ``[T]``)."""

    mask: Tensor
    """Bool loss mask."""
    sample_index: Tensor | None
    """Long: token -> sample of the micro-batch (sequence-level losses such as gspo); None when
    the caller gave none."""
    logprobs: Tensor
    """Current logprobs with grad, zero off the mask (cispo)."""


def clipped_surrogate(log_ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> Surrogate:
    """PPO's clipped surrogate, per token: ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``.

    ``clipped`` marks tokens where the clipped branch is the larger one, i.e. whose gradient the
    clip removes (``r > 1 + eps_high`` with ``A > 0``, or ``r < 1 - eps_low`` with ``A < 0``).
    """
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    unclipped_loss = -adv * ratio
    clipped_loss = -adv * clipped_ratio
    return torch.maximum(unclipped_loss, clipped_loss), clipped_loss > unclipped_loss, ratio


def ppo_clip_surrogate(log_ratio: Tensor, adv: Tensor, cfg: AlgoConfig, ctx: SurrogateContext) -> Surrogate:
    """Token-level clipped policy gradient (PPO, Schulman et al. 2017, arXiv:1707.06347; GRPO,
    Shao et al. 2024, arXiv:2402.03300, applies it per token). With ``r_t = exp(logp_t - logp_anchor_t)``::

        l_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_eps_low, 1 + clip_eps_high))

    normalised by the global loss-token count (a token mean over the batch, as DAPO recommends,
    rather than GRPO's original mean of per-sample means, which under-weights long samples).
    The anchor is the behaviour logprobs, so the ratio also corrects the off-policy gap of
    asynchronous generation; with truncated IS on it is the trainer's old logprobs.
    """
    return clipped_surrogate(log_ratio, adv, cfg.clip_eps_low, cfg.clip_eps_high)


def dr_grpo_surrogate(log_ratio: Tensor, adv: Tensor, cfg: AlgoConfig, ctx: SurrogateContext) -> Surrogate:
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783).

    Same per-token clipped surrogate as ``ppo_clip`` (``clip_eps_low/high``), but GRPO's two
    length- and difficulty-dependent normalisations are removed: no ``1/|y_i|`` (the loss is a
    plain token *sum*) and no reward std (set ``algo.std_normalize=false``)::

        loss = sum_i sum_t l_it / (num_samples * L)

    ``L`` is a constant (the generation budget, ``algo.dr_grpo.max_tokens`` or ``max_new_tokens``,
    as in the paper's code) that only fixes the scale; its normaliser
    (:func:`rlcore.algo.registry.dr_grpo_constant`) is ``num_samples * L``. A token's weight then
    depends neither on its own sample's length (GRPO's per-sample mean favours short correct and
    long wrong answers) nor on the lengths of the rest of the batch (as a token mean's would).
    """
    return clipped_surrogate(log_ratio, adv, cfg.clip_eps_low, cfg.clip_eps_high)


def dapo_surrogate(log_ratio: Tensor, adv: Tensor, cfg: AlgoConfig, ctx: SurrogateContext) -> Surrogate:
    """DAPO's clip-higher token-level loss (Yu et al. 2025, arXiv:2503.14476)::

        l_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_eps_low, 1 + dapo.clip_eps_high))

    with a larger upper clip (0.28 vs 0.2) so that low-probability tokens with positive
    advantage can grow, which keeps entropy from collapsing; normalised by the global
    loss-token count. DAPO's other parts live elsewhere: dynamic sampling is
    ``algo.filter_zero_adv_groups`` and the overlong penalty ``algo.length_penalty=overlong``.
    """
    return clipped_surrogate(log_ratio, adv, cfg.clip_eps_low, cfg.dapo.clip_eps_high)


def gspo_surrogate(log_ratio: Tensor, adv: Tensor, cfg: AlgoConfig, ctx: SurrogateContext) -> Surrogate:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071).

    The importance ratio is per *sequence*: the geometric mean of its token ratios, and the clip
    acts on it, so a sample is kept or clipped as a whole::

        s_i = exp( (1/|y_i|) sum_t log r_it )
        J_i = min(s_i A_i, clip(s_i, 1 - gspo.clip_eps_low, 1 + gspo.clip_eps_high) A_i)
        loss = -(1/N) sum_i J_i

    Here ``l_t = -J_i`` on every token of sample i and the aggregation weight ``1/|y_i|`` (its
    spec's ``per_sequence``) makes the sample's tokens add up to ``-J_i``; its normaliser is
    ``N`` (samples). The gradient, ``s_i A_i (1/|y_i|) sum_t grad log pi(y_it)``, equals that of
    the paper's GSPO-token form when the advantage is constant over the sample.
    """
    if ctx.sample_index is None:
        raise ValueError("algo.loss=gspo needs LossInputs.sample_index (token -> sample of the micro-batch)")
    seq_log_ratio = per_sample_mean(log_ratio, ctx.sample_index, ctx.mask)
    return clipped_surrogate(seq_log_ratio, adv, cfg.gspo.clip_eps_low, cfg.gspo.clip_eps_high)


def cispo_surrogate(log_ratio: Tensor, adv: Tensor, cfg: AlgoConfig, ctx: SurrogateContext) -> Surrogate:
    """CISPO (MiniMax-M1, MiniMax 2025, arXiv:2506.13585, eq. 4).

    Clip the importance *weight* and stop its gradient, instead of clipping the update::

        l_t = -sg(clip(r_t, 1 - cispo.eps_low, 1 + cispo.eps_high)) * A_t * log pi(y_t)

    so ``grad l_t = -clip(r_t) A_t grad log pi(y_t)``: every token keeps a gradient (PPO drops the
    clipped ones, often the rare "reflective" tokens), with a bounded weight. Normalised by the
    global loss-token count, as in the paper. ``clipped`` marks tokens whose weight was clipped.
    """
    ratio = torch.exp(log_ratio).detach()
    low, high = 1.0 - cfg.cispo.eps_low, 1.0 + cfg.cispo.eps_high
    weight = ratio.clamp(low, high)
    return -weight * adv * ctx.logprobs, (ratio < low) | (ratio > high), ratio
