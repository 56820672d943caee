"""The MoE block's gathers and activations (rlcore.trainer.moe_kernels) against the index_add
formulation they replace, eager and through torch.compile (aot_eager on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlcore.trainer import moe_kernels as mk


@pytest.fixture
def aot_eager(monkeypatch):
    from rlcore.trainer import compile as rc

    monkeypatch.setattr(rc, "BACKEND", "aot_eager")  # dynamo and autograd, no code generation
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _routing(n=23, k=3, e=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])  # k distinct experts a token
    order = torch.argsort(experts.reshape(-1), stable=True)
    return order // k, mk.inverse_permutation(order), order, k


def test_inverse_permutation():
    perm = torch.randperm(41, generator=torch.Generator().manual_seed(1))
    inv = mk.inverse_permutation(perm)
    assert torch.equal(inv[perm], torch.arange(41)) and torch.equal(perm[inv], torch.arange(41))


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("n", [23, 17])  # compiled: a second row count, the sizes seen to change
def test_gather_and_sum_rows_equal_index_select_and_index_add(compiled, n, aot_eager):
    token, inverse, _, k = _routing(n=n)
    ks = mk.kernels(compiled)
    assert (ks is mk.EAGER) != compiled
    x = torch.randn(n, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(n * k, 8, dtype=torch.float64)  # a per-row map between gather and sum
    seed = torch.randn(n, 8, dtype=torch.float64)

    ref_rows = x.index_select(0, token)
    ref = torch.zeros_like(x).index_add(0, token, ref_rows * w)
    (ref * seed).sum().backward()
    ref_grad, x.grad = x.grad.clone(), None

    rows = mk.gather_rows(x, token, inverse, k, ks)
    torch.testing.assert_close(rows, ref_rows, rtol=0, atol=0)
    y = mk.sum_rows(rows * w, token, inverse, k, ks)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    (y * seed).sum().backward()
    torch.testing.assert_close(x.grad, ref_grad, rtol=1e-12, atol=1e-12)


def test_the_unrolled_sum_adds_in_float32_and_rounds_once():
    token, inverse, _, k = _routing(n=31, k=8, e=12, seed=6)
    rows = (torch.randn(31 * 8, 16) * torch.logspace(-3, 3, 16)).to(torch.bfloat16)
    exact = rows.double().index_select(0, inverse).view(-1, 8, 16).sum(1)
    got = mk.gather_sum_unrolled(rows, inverse, k)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, exact.to(torch.bfloat16), rtol=0, atol=0)  # the exact sum, rounded once
    torch.testing.assert_close(got, mk.gather_sum(rows, inverse, k), rtol=0, atol=0)


def test_the_gathers_pass_gradcheck():
    token, inverse, _, k = _routing(n=7, k=2, e=4, seed=3)
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    rows = torch.randn(14, 3, dtype=torch.float64, requires_grad=True)
    perm = torch.randperm(14, generator=torch.Generator().manual_seed(4))
    assert torch.autograd.gradcheck(lambda t: mk.gather_rows(t, token, inverse, k), (x,))
    assert torch.autograd.gradcheck(lambda t: mk.sum_rows(t, token, inverse, k), (rows,))
    assert torch.autograd.gradcheck(lambda t: mk.permute(t, perm, mk.inverse_permutation(perm)), (rows,))


@pytest.mark.parametrize("compiled", [False, True])
def test_activations_equal_their_definitions(compiled, aot_eager):
    ks = mk.kernels(compiled)
    g = torch.Generator().manual_seed(5)
    gu = torch.randn(9, 12, generator=g, dtype=torch.float64, requires_grad=True)
    s = torch.rand(9, generator=g, dtype=torch.float64, requires_grad=True)
    for scale in (None, s):
        got = ks.swiglu(gu, scale)
        ref = F.silu(gu[:, :6]) * gu[:, 6:] * (1 if scale is None else scale[:, None])
        torch.testing.assert_close(got, ref)
        a, b = (
            torch.autograd.grad(got.sum(), (gu, s), allow_unused=True),
            torch.autograd.grad(ref.sum(), (gu, s), allow_unused=True),
        )
        torch.testing.assert_close(a[0], b[0])
        alpha, limit = 1.702, 0.5
        got = ks.clamped_swiglu(gu, scale, alpha, limit)
        gate, up = gu[:, ::2].clamp(max=limit), gu[:, 1::2].clamp(-limit, limit)
        ref = (up + 1) * gate * torch.sigmoid(alpha * gate) * (1 if scale is None else scale[:, None])
        torch.testing.assert_close(got, ref)
