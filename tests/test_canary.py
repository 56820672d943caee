"""The self-calibrating canary (rlcore/weights/canary.py) on CPU: bounds from the first sync, the policy's
own greedy and sampled tokens, healthy syncs pass, stale / partial / mis-mapped syncs fail."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rlcore.engine.base import SamplingParams
from rlcore.engine.registry import make_engine
from rlcore.envs import build_env
from rlcore.models.build import build_model, build_tokenizer
from rlcore.models.render import render_prompt
from rlcore.plan.compose import compose
from rlcore.weights.canary import (
    CanaryError,
    calibrate,
    compare_logprobs,
    own_completion_pairs,
    teacher_forced_logprobs,
)


def test_calibrate_is_a_multiple_of_the_first_sync_plus_a_floor():
    first = [
        compare_logprobs([[-1.0, -2.0, -3.0, -4.0]], [[-1.01, -2.0, -3.03, -4.0]]),
        compare_logprobs([[-1.0, -2.0, -3.0, -4.0]], [[-1.0, -2.02, -3.0, -4.0]]),
    ]
    b = calibrate(first, multiple=4.0, floor=0.05, max_floor=0.5, calibration_limit=1.0)
    assert b.baseline_mean == pytest.approx(0.01) and b.baseline_max == pytest.approx(0.03)  # the worst engine
    assert b.mean_gap == pytest.approx(4 * 0.01 + 0.05) and b.max_gap == pytest.approx(4 * 0.03 + 0.5)
    assert b.num_tokens == 4 and set(b.metrics()) == {
        "canary_mean_limit",
        "canary_max_limit",
        "canary_baseline_mean",
        "canary_baseline_max",
        "token_mult_prob_error",
    }
    assert b.check([[-1.0]], [[-1.08]]).passed
    with pytest.raises(CanaryError, match="mean gap 0.1000"):
        b.check([[-1.0]], [[-1.1]])
    # a first sync that already disagrees (or gives NaN) calibrates nothing: the run stops
    with pytest.raises(CanaryError, match="first sync"):
        calibrate([compare_logprobs([[-1.0]], [[-3.5]])], 4.0, 0.05, 0.5, 1.0)
    with pytest.raises(CanaryError, match="first sync"):
        calibrate([compare_logprobs([[float("nan")]], [[-1.0]], raise_on_fail=False)], 4.0, 0.05, 0.5, 1.0)


def test_own_completions_are_greedy_then_sampled_until_the_token_budget():
    calls = []

    def generate(prompts, temperature, max_new_tokens, seed):
        calls.append((temperature, max_new_tokens, seed))
        # the second prompt's policy stops at once in every round
        return [[seed] * max_new_tokens, []][: len(prompts)]

    pairs = own_completion_pairs([[1, 2], [3]], generate, tokens=40, temperature=0.7, seed=5)
    # 10 new tokens a request (40 / (2 prompts x 2)); only the first prompt completes: 4 rounds
    assert calls == [(0.0, 10, 5), (0.7, 10, 6), (0.7, 10, 7), (0.7, 10, 8)]
    assert pairs == [([1, 2], [s] * 10) for s in (5, 6, 7, 8)]
    assert own_completion_pairs([], generate, 40, 1.0) == []
    short = own_completion_pairs([[1]], lambda p, t, n, s: [[1]], tokens=1000, temperature=1.0, max_rounds=3)
    assert len(short) == 3  # a policy that stops early: what it gave after max_rounds


def _gate_up_swapped(state: dict) -> dict:
    """Every layer's gate and up projections exchanged: a fused gate_up split the wrong way round."""
    out = dict(state)
    for n in state:
        if n.endswith("mlp.gate_proj.weight"):
            up = n.replace("gate_proj", "up_proj")
            out[n], out[up] = state[up], state[n]
    return out


def test_calibrated_canary_passes_healthy_syncs_and_fails_broken_ones():
    """The run's flow on the hf engine: sync, the canary's own tokens from the engine, calibrate;
    then a trained-and-synced policy passes and each kind of broken sync fails at once."""
    cfg = compose([])
    r = cfg.rollout
    tok = build_tokenizer(cfg.model)
    engine = make_engine(cfg, tok, seed=0)
    trainer = build_model(dataclasses.replace(cfg.model, seed=cfg.model.seed + 1), tok).eval()
    start = {n: p.detach().clone() for n, p in engine.state_dict().items()}  # the engine's own start weights
    with torch.no_grad():  # a peaked policy, as a trained one is (the random init is near uniform)
        for p in trainer.parameters():
            if p.dim() == 2:
                p.mul_(8.0)

    def sync(state: dict, version: int) -> None:
        engine.apply_weights(state.items(), version)

    weights = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    sync(weights, 1)  # the first sync: same weights on both sides by construction
    env = build_env(cfg.env)
    prompts = [render_prompt(tok, env.make_task(i, "eval").messages) for i in range(r.canary_prompts)]

    def generate(batch, temperature, max_new_tokens, seed):
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        return [g.token_ids for g in engine.generate(batch, params)]

    pairs = own_completion_pairs(prompts, generate, r.canary_tokens, r.sampling.temperature, seed=1)
    assert sum(len(c) for _, c in pairs) >= r.canary_tokens
    want = teacher_forced_logprobs(trainer, pairs)
    bounds = calibrate(
        [compare_logprobs(engine.score_batch(pairs), want)],
        r.canary_multiple,
        r.canary_floor,
        r.canary_max_floor,
        r.canary_calibration_limit,
    )
    assert bounds.baseline_mean < 1e-3 and bounds.mean_gap < 0.1, bounds.describe()

    # a healthy sync after a few optimizer-sized updates passes
    torch.manual_seed(0)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    weights = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    want = teacher_forced_logprobs(trainer, pairs)
    sync(weights, 2)
    ok = bounds.check(engine.score_batch(pairs), want)
    assert ok.passed and ok.mean_gap < 1e-3, ok.describe()

    layer_names = [n for n in weights if ".layers." in n]
    broken = {
        "stale (the engine kept its own weights)": start,
        "partial (the decoder layers never arrived)": {
            n: (start[n] if n in layer_names else t) for n, t in weights.items()
        },
        "mis-mapped (gate and up projections exchanged)": _gate_up_swapped(weights),
    }
    for what, state in broken.items():
        sync(state, 3)
        result = bounds.check(engine.score_batch(pairs), want, raise_on_fail=False)
        print(f"{what}: {result.describe()}")
        assert not result.passed, what
        assert result.mean_gap > 2 * bounds.mean_gap, what  # not a near miss, on a near-uniform random model
    assert math.isfinite(bounds.max_gap)
