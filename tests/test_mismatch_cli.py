"""`python -m rlcore.mismatch`: the figures by hand, and the contract on CPU (trainer vs hf engine)."""

from __future__ import annotations

import json
import math

import pytest

from rlcore.mismatch import main, mismatch_figures


def test_figures_by_hand():
    # diffs trainer - engine: [0.1, -0.2, 0.0]
    fig = mismatch_figures([[-1.0, -2.0], [-3.0]], [[-0.9, -2.2], [-3.0]])
    assert fig["token_mult_prob_error"] == pytest.approx((math.exp(0.1) + math.exp(0.2) + 1) / 3)
    assert fig["kl"] == pytest.approx(((math.exp(0.1) - 1 - 0.1) + (math.exp(-0.2) - 1 + 0.2)) / 3)
    assert fig["max_abs_diff"] == pytest.approx(0.2) and fig["tokens"] == 3
    with pytest.raises(ValueError):
        mismatch_figures([[-1.0]], [[-1.0, -2.0]])


def test_the_contract_on_cpu_and_the_bound_that_refuses(capsys):
    # the hf engine and the trainer both run fp32 on CPU: the figure is 1 up to rounding, so a
    # bound of exactly 1 is passed (exit 1, one line why) and a bound of 1.001 holds
    assert main(["rollout.canary_tokens=32", "rollout.max_mismatch=1.0"]) == 1
    out, err = capsys.readouterr()
    fig = json.loads(out.strip().splitlines()[-1])
    assert 1.0 < fig["token_mult_prob_error"] < 1.0001 and 0 <= fig["kl"] < 1e-6 and fig["tokens"] >= 32
    assert "token_mult_prob_error" in out.splitlines()[0]
    (line,) = err.strip().splitlines()
    assert line.startswith("rlcore: mismatch:") and "rollout.max_mismatch=1.0" in line
    assert main(["rollout.max_mismatch=0.5"]) == 2  # an exp of a gap is >= 1: a config error
    assert "rlcore: config error: rollout.max_mismatch" in capsys.readouterr().err
