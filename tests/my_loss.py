"""A policy loss defined outside the package, selected by `algo.loss=tests.my_loss:loss`.

On-policy REINFORCE (Williams 1992): ``l_t = -A_t log pi(y_t)``, no importance ratio and no clip.
It ignores the off-policy gap that ``ppo_clip``'s ratio corrects, so it is only sound when the
data is (nearly) on-policy; it is here to show the contract of a loss function
(:mod:`rlcore.algo.surrogates`), not as a recommendation.
"""

import torch


def loss(log_ratio, adv, cfg, ctx):
    """``(-A_t log pi(y_t), nothing clipped, ratio 1)``, all ``[T]``: the loss uses no ratio, so
    the ratio it reports is 1 on every token."""
    return -adv * ctx.logprobs, torch.zeros_like(ctx.mask), torch.ones_like(log_ratio)


def scaled(log_ratio, adv, cfg, ctx, scale: float = 1.0, floor: float | None = None):
    """REINFORCE with options (`algo.loss=tests.my_loss:scaled algo.loss_options={scale: 2.0}`):
    ``-scale * max(A_t, floor) * log pi(y_t)``; ``floor=None`` keeps A as it is."""
    if floor is not None:
        adv = adv.clamp(min=floor)
    return -scale * adv * ctx.logprobs, torch.zeros_like(ctx.mask), torch.ones_like(log_ratio)
