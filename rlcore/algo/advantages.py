"""Advantage estimators: pure functions of a batch of groups' rewards.

All take ``rewards`` of shape ``[G, n]`` (G groups of n samples of the same task) and return
per-sample advantages of the same shape; the trainer broadcasts them over the sample's tokens.

The contract of an estimator that ``algo.name`` selects (:mod:`rlcore.algo.registry`: a built-in
name or ``algo.name=pkg.mod:fn``) is::

    advantages = estimate(rewards, cfg)

``rewards`` ``[G, n]`` float (already shaped by the length penalty), ``cfg`` the run's
``AlgoConfig``; it returns float advantages ``[G, n]``, one per sample. It runs on the driver,
on CPU tensors, once per step over the whole batch when its groups have equal sizes, else once
per group (``G = 1``), so a batch-level statistic must not assume a fixed ``G``.

Optional reward shaping by completion length (``cfg.length_penalty``) is applied to the rewards
before any baseline, so the penalty is itself made group-relative, as in DAPO.
"""

from __future__ import annotations

import torch

from rlcore.algo.registry import estimator_spec, function
from rlcore.config import AlgoConfig

_EPS = 1e-6


def group_mean(rewards: torch.Tensor) -> torch.Tensor:
    """Mean of each group ``[G, 1]``, computed about the group's first reward so that a group of
    equal rewards has *exactly* its reward as mean (and so exactly zero advantages)."""
    first = rewards[:, :1]
    return first + (rewards - first).mean(dim=1, keepdim=True)


def grpo_advantages(rewards: torch.Tensor, std_normalize: bool = True, eps: float = _EPS) -> torch.Tensor:
    """Group-relative advantages (GRPO, Shao et al. 2024, arXiv:2402.03300).

    ``A_ij = (r_ij - mean_j r_ij) / (std_j r_ij + eps)``; without ``std_normalize`` only the mean
    baseline is subtracted (Dr.GRPO, Liu et al. 2025, arXiv:2503.20783). ``std`` is the
    population std of the group, so a group whose rewards are all equal gets zero advantage.
    """
    centred = rewards - group_mean(rewards)
    if not std_normalize:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740).

    Each sample's baseline is the mean reward of the *other* samples of its group::

        A_ij = r_ij - (sum_k r_ik - r_ij) / (n - 1)  =  n / (n - 1) * (r_ij - mean_k r_ik)

    The baseline does not depend on the sample itself, so the estimator is unbiased. Needs n >= 2.
    """
    n = rewards.shape[1]
    if n < 2:
        raise ValueError(f"rloo needs at least 2 samples per group, got {n}")
    # the right-hand form: exact zeros for a group of equal rewards
    return n / (n - 1) * (rewards - group_mean(rewards))


def reinforce_pp_baseline_advantages(rewards: torch.Tensor, eps: float = _EPS) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025, arXiv:2501.03262).

    Subtract the group mean (the baseline), then normalise over the whole batch::

        A'_ij = r_ij - mean_j r_ij
        A_ij  = (A'_ij - mean_batch A') / (std_batch A' + eps)

    Normalising by the *batch* std rather than each group's keeps the scale of a low-variance
    group's advantages small (GRPO's per-group std inflates them). Here every sample counts once
    in the batch statistics (OpenRLHF whitens over tokens instead, weighting long samples more).
    """
    centred = rewards - group_mean(rewards)
    return (centred - centred.mean()) / (centred.std(unbiased=False) + eps)


def grpo_estimator(rewards: torch.Tensor, cfg: AlgoConfig) -> torch.Tensor:
    """``algo.name=grpo``: :func:`grpo_advantages` with ``algo.std_normalize``."""
    return grpo_advantages(rewards, std_normalize=cfg.std_normalize)


def rloo_estimator(rewards: torch.Tensor, cfg: AlgoConfig) -> torch.Tensor:
    """``algo.name=rloo``: :func:`rloo_advantages`."""
    return rloo_advantages(rewards)


def reinforce_pp_baseline_estimator(rewards: torch.Tensor, cfg: AlgoConfig) -> torch.Tensor:
    """``algo.name=reinforce_pp_baseline``: :func:`reinforce_pp_baseline_advantages`."""
    return reinforce_pp_baseline_advantages(rewards)


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer_tokens: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), scaled by ``penalty``.

    With ``L_max = max_tokens`` and ``L_cache = buffer_tokens``::

        R(|y|) = 0                                  if |y| <= L_max - L_cache
               = ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
               = -1                                 if |y| > L_max

    i.e. a linear ramp from 0 to -penalty over the last ``L_cache`` tokens before ``L_max``.
    """
    if buffer_tokens <= 0:
        raise ValueError(f"overlong penalty needs buffer_tokens > 0, got {buffer_tokens}")
    ramp = ((max_tokens - buffer_tokens) - lengths.to(torch.float32)) / buffer_tokens
    return penalty * ramp.clamp(min=-1.0, max=0.0)


def linear_length_penalty(lengths: torch.Tensor, per_token: float) -> torch.Tensor:
    """``R(|y|) = -per_token * |y|``: a constant cost per completion token."""
    return -per_token * lengths.to(torch.float32)


def length_penalty(lengths: torch.Tensor, cfg: AlgoConfig) -> torch.Tensor:
    """The reward shaping term selected by ``cfg.length_penalty`` (zeros for `none`)."""
    if cfg.length_penalty == "none":
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    if cfg.length_penalty == "overlong":
        return overlong_penalty(lengths, cfg.overlong_max_tokens, cfg.overlong_buffer_tokens, cfg.overlong_penalty)
    if cfg.length_penalty == "linear":
        return linear_length_penalty(lengths, cfg.length_penalty_per_token)
    raise ValueError(f"algo.length_penalty: unknown length penalty {cfg.length_penalty!r}")


def shaped_rewards(rewards: torch.Tensor, cfg: AlgoConfig, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """``rewards + length_penalty(lengths)``; ``rewards`` unchanged when no penalty is configured.

    ``lengths`` ``[G, n]``: each sample's completion length in tokens (its policy tokens).
    """
    if cfg.length_penalty == "none":
        return rewards
    if lengths is None:
        raise ValueError(f"algo.length_penalty={cfg.length_penalty!r} needs the completion lengths")
    if lengths.shape != rewards.shape:
        raise ValueError(f"lengths {tuple(lengths.shape)} must match rewards {tuple(rewards.shape)}")
    return rewards + length_penalty(lengths, cfg).to(rewards.dtype)


def nonzero_advantage_groups(rewards: torch.Tensor, atol: float = 0.0) -> torch.Tensor:
    """Bool mask ``[G]``: True where a group's rewards are not all equal (DAPO dynamic sampling).

    A group whose rewards are all equal has zero advantage under every estimator here, so it
    contributes no policy gradient; DAPO (arXiv:2503.14476) drops such groups and samples more.
    Two rewards within ``atol`` count as equal.
    """
    spread = rewards.max(dim=1).values - rewards.min(dim=1).values
    return spread > atol


def compute_advantages(rewards: torch.Tensor, cfg: AlgoConfig, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The estimator ``cfg.name`` selects, on the rewards shaped by ``cfg.length_penalty``.

    ``rewards`` ``[G, n]``; ``lengths`` ``[G, n]`` completion lengths, needed only when a length
    penalty is configured. Returns float advantages ``[G, n]``.
    """
    spec = estimator_spec(cfg.name)
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    rewards = shaped_rewards(rewards, cfg, lengths)
    advantages = function(spec.estimate, "algo.name")(rewards, cfg)
    if not isinstance(advantages, torch.Tensor) or advantages.shape != rewards.shape:
        got = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
        raise ValueError(
            f"algo.name={spec.name}: the estimator returned {got}, expected a tensor of the "
            f"rewards' shape {tuple(rewards.shape)}"
        )
    return advantages
