"""Train/inference mismatch corrections: per-token weights and masks, composable with any loss.

The rollout engine samples with a *behaviour* policy ``mu`` whose logprobs differ from the
trainer's own logprobs for the same weights (different kernels, precision, MoE routing) and, in
asynchronous training, from weights one or more versions old. Let ``p_old`` be the trainer's
logprobs of the tokens at the start of the optimizer step (``LossInputs.old_logprobs``; when the
caller did not compute them, the current logprobs detached, which is the same value for the
first, and in single-update training only, micro-batch pass). The mismatch ratio is::

    rho_t = p_old(y_t) / mu(y_t) = exp(logp_old_t - logp_behaviour_t)

``rho`` mixes two things, which the metrics keep apart when the caller says which tokens were
sampled by the very weights being trained (``same_version``): on those tokens ``log rho`` is the
engine/trainer mismatch alone (kernels, precision, routing: ``engine_mismatch_kl``); on tokens of
an older version it is that mismatch plus the policy's drift over the updates since
(``staleness_kl``). ``mismatch_kl`` is the k3 over all loss tokens, the token-weighted mix of both.

Every correction below is a function of ``rho`` only, so it is a constant (no gradient) for the
loss; it yields a per-token ``weight`` that multiplies the token's loss and a ``keep`` mask that
drops tokens or whole samples.

- Truncated IS (TIS): ``weight_t = min(rho_t, C)`` (Yao et al. 2025, "Your Efficient RL Framework
  Secretly Brings You Off-Policy RL Training"; the truncation is IMPALA's, Espeholt et al. 2018,
  arXiv:1802.01561). Truncation bounds the variance at the cost of a small bias.
- Masked IS (MIS), token level: drop token t when ``rho_t`` is outside ``[lo, hi]``; sequence level:
  drop every token of sample i when the geometric mean ``exp(mean_t log rho_t)`` over its loss
  tokens is outside ``[lo, hi]`` (Liu et al. 2025, "When Speed Kills Stability: Demystifying RL
  Collapse from the Training-Inference Mismatch"; the geometric mean keeps the sequence ratio's
  scale independent of length, as GSPO's does). Dropping instead of truncating removes the
  samples the engine got badly wrong rather than down-weighting them.
- Probability-difference masking (as prime-rl's trust-region masks do): drop token t when
  ``|p_old(y_t) - mu(y_t)| > threshold``. Unlike a ratio mask it ignores large ratios between two
  tiny probabilities, which move the policy little.

When TIS is on, the loss's policy ratio is taken against ``p_old`` instead of ``mu`` (the
decoupled objective of Hilton et al. 2021, arXiv:2110.00641, also AReaL, arXiv:2505.24298): the
clip then bounds the update relative to the trainer's policy and ``weight`` carries the whole
off-policy correction; against ``mu`` it would be counted twice. Masks do not change the ratio.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlcore.algo.names import MIS_LEVELS  # noqa: F401  (re-exported)
from rlcore.algo.tokens import masked_max, masked_min, masked_sum, per_sample_mean
from rlcore.config import AlgoConfig


@dataclass
class Correction:
    """Per-token factors a loss applies; both ``[T]``, constants (no gradient)."""

    weight: torch.Tensor
    """Multiplies each token's policy loss (1 where no IS weight is configured)."""
    keep: torch.Tensor
    """Bool: False on tokens a mask dropped (the loss mask is applied separately)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Token sums (``*_frac``, ``*_sum``) and extrema (``*_max``, ``*_min``) over loss tokens."""


def mismatch_k3(log_rho: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of ``KL(mu || p_old)`` from tokens sampled by ``mu`` (Schulman 2020,
    "Approximating KL divergence"): ``rho - 1 - log rho`` with ``rho = p_old / mu``; >= 0, unbiased.

    ``expm1`` keeps the small differences of a nearly matching engine from rounding to zero.
    """
    return torch.expm1(log_rho) - log_rho


def truncated_is_weight(log_rho: torch.Tensor, cap: float) -> torch.Tensor:
    """``min(rho_t, cap)``: the truncated importance weight of each token."""
    return torch.exp(log_rho).clamp(max=cap)


def token_ratio_keep(log_rho: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Bool ``[T]``: ``low <= rho_t <= high`` (token-level masked IS)."""
    rho = torch.exp(log_rho)
    return (rho >= low) & (rho <= high)


def sequence_ratio_keep(
    log_rho: torch.Tensor, mask: torch.Tensor, sample_index: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    """Bool ``[T]``: ``low <= exp(mean_{t in i} log rho_t) <= high`` for each token's sample i
    (sequence-level masked IS with the geometric-mean ratio; the mean runs over loss tokens)."""
    geo = torch.exp(per_sample_mean(log_rho, sample_index, mask))
    return (geo >= low) & (geo <= high)


def prob_diff_keep(logp_old: torch.Tensor, logp_behaviour: torch.Tensor, threshold: float) -> torch.Tensor:
    """Bool ``[T]``: ``|p_old(y_t) - mu(y_t)| <= threshold`` (probability-difference masking)."""
    return (torch.exp(logp_old) - torch.exp(logp_behaviour)).abs() <= threshold


def uses_old_ratio(cfg: AlgoConfig) -> bool:
    """Whether the policy ratio is taken against the trainer's old logprobs (TIS on) rather than
    the behaviour logprobs (see the module docstring)."""
    return cfg.tis_cap > 0


@torch.no_grad()
def mismatch_correction(
    logp_old: torch.Tensor,
    logp_behaviour: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgoConfig,
    sample_index: torch.Tensor | None = None,
    same_version: torch.Tensor | None = None,
) -> Correction:
    """Weights, keep mask and metrics of the corrections ``cfg`` enables (all ``[T]``).

    ``mask`` is the bool loss mask; tokens outside it get weight 1 and keep True (the loss
    mask removes them anyway) and are ignored by the metrics. Metrics: ``mismatch_kl_sum``
    (k3, always), ``mismatch_ratio_max/min`` (of rho, always), ``tis_weight_sum`` and
    ``tis_trunc_frac`` (TIS), ``mis_mask_frac`` (MIS), ``prob_diff_mask_frac`` (probability
    difference), ``correction_mask_frac`` (dropped by any mask). With ``same_version`` (bool
    ``[T]``: the token was sampled by the weights the trainer holds now) also
    ``engine_mismatch_kl_sum`` / ``staleness_kl_sum`` (k3 over loss tokens with / without it) and
    ``same_version_frac`` (its loss-token count).
    """
    # Out-of-mask positions may hold anything (prompt tokens, 0.0 for env tokens): zero the
    # log-ratio there so no inf/nan can appear in the arithmetic below.
    log_rho = torch.where(mask, logp_old.float() - logp_behaviour.float(), 0.0)
    rho = torch.exp(log_rho)
    metrics = {
        "mismatch_kl_sum": masked_sum(mismatch_k3(log_rho), mask),
        "mismatch_ratio_max": masked_max(rho, mask),
        "mismatch_ratio_min": masked_min(rho, mask),
    }
    if same_version is not None:
        k3, same = mismatch_k3(log_rho), same_version.bool()
        metrics["engine_mismatch_kl_sum"] = masked_sum(k3, mask & same)
        metrics["staleness_kl_sum"] = masked_sum(k3, mask & ~same)
        metrics["same_version_frac"] = masked_sum(same.float(), mask)
    weight = torch.ones_like(log_rho)
    keep = torch.ones_like(mask, dtype=torch.bool)

    if cfg.tis_cap > 0:
        weight = torch.where(mask, truncated_is_weight(log_rho, cfg.tis_cap), 1.0)
        metrics["tis_weight_sum"] = masked_sum(weight, mask)
        metrics["tis_trunc_frac"] = masked_sum((rho > cfg.tis_cap).float(), mask)

    if cfg.mis_level != "none":
        if cfg.mis_level == "token":
            mis_keep = token_ratio_keep(log_rho, cfg.mis_low, cfg.mis_high)
        elif cfg.mis_level == "sequence":
            if sample_index is None:
                raise ValueError("algo.mis_level=sequence needs LossInputs.sample_index")
            mis_keep = sequence_ratio_keep(log_rho, mask, sample_index, cfg.mis_low, cfg.mis_high)
        else:
            raise ValueError(f"algo.mis_level: unknown level {cfg.mis_level!r}; choose one of {', '.join(MIS_LEVELS)}")
        metrics["mis_mask_frac"] = masked_sum((~mis_keep).float(), mask)
        keep = keep & mis_keep

    if cfg.prob_diff_threshold > 0:
        pd_keep = prob_diff_keep(logp_old.float(), logp_behaviour.float(), cfg.prob_diff_threshold)
        metrics["prob_diff_mask_frac"] = masked_sum((~pd_keep).float(), mask)
        keep = keep & pd_keep

    if cfg.mis_level != "none" or cfg.prob_diff_threshold > 0:
        metrics["correction_mask_frac"] = masked_sum((~keep).float(), mask)
    keep = keep | ~mask
    return Correction(weight=weight, keep=keep, metrics=metrics)
