"""The logprob head's Triton kernels (`rlcore.trainer.logprob_kernels`), run on CPU by Triton's
interpreter in a subprocess (the interpreter is chosen when the kernels are defined), against a
float64 computation of logprobs, entropies and their gradients."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = r"""
import json, torch
from rlcore.trainer import logprob_kernels as lk
from rlcore.trainer.logprobs import chunked_logprobs, plain_logprobs

calls = {"fwd": 0, "bwd": 0}
fwd, bwd = lk.logprob_entropy, lk.logprob_entropy_grad_
def count_fwd(*a, **k):
    calls["fwd"] += 1
    return fwd(*a, **k)
def count_bwd(*a, **k):
    calls["bwd"] += 1
    return bwd(*a, **k)
lk.logprob_entropy, lk.logprob_entropy_grad_ = count_fwd, count_bwd

torch.manual_seed(0)
T, H, V = 37, 16, 5000  # V spans two forward blocks and a partial one; T three partial chunks
out = {}
for keep in (0, 1 << 30):
    for bias in (False, True):
        h = torch.randn(T, H, requires_grad=True)
        W = (torch.randn(V, H) * 0.5).requires_grad_()
        b = torch.randn(V).requires_grad_() if bias else None
        y = torch.randint(0, V, (T,))
        y[0], y[1] = 0, V - 1  # the first and last columns
        g, e = torch.randn(T), torch.randn(T)
        lp, ent = chunked_logprobs(h, W, y, 0.7, chunk_tokens=16, bias=b, keep_logits_bytes=keep)
        (lp * g + ent * e).sum().backward()
        got = [lp.detach(), ent.detach(), h.grad, W.grad] + ([b.grad] if bias else [])
        h64, W64 = h.detach().double().requires_grad_(), W.detach().double().requires_grad_()
        b64 = b.detach().double().requires_grad_() if bias else None
        lp2, ent2 = plain_logprobs(torch.nn.functional.linear(h64, W64, b64), y, 0.7)
        (lp2 * g.double() + ent2 * e.double()).sum().backward()
        ref = [lp2.detach(), ent2.detach(), h64.grad, W64.grad] + ([b64.grad] if bias else [])
        out[f"keep={keep > 0} bias={bias}"] = [float((a.double() - r).abs().max() / r.abs().max()) for a, r in zip(got, ref)]
        with torch.no_grad():  # no backward to come: nothing kept, same values
            lp3, ent3 = chunked_logprobs(h, W, y, 0.7, chunk_tokens=16, bias=b, keep_logits_bytes=keep)
        out[f"no_grad keep={keep > 0} bias={bias}"] = [float((lp3 - lp.detach()).abs().max()),
                                                      float((ent3 - ent.detach()).abs().max())]
print("RESULT " + json.dumps({"errors": out, "calls": calls}))
"""


def test_logprob_kernels_match_float64_in_triton_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.split("RESULT ", 1)[1])
    # 4 runs x 3 chunks each way (+ 4 no-grad forwards): the kernels ran, not the torch fallback
    assert res["calls"] == {"fwd": 24, "bwd": 12}, res
    for case, errs in res["errors"].items():
        assert max(errs) < 1e-5, (case, errs)  # float32 inputs and math against float64
