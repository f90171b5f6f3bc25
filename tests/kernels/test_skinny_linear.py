"""The few-row linear with its fused prologue (none, RMSNorm(+residual), SiLU-mul) against the unfused
ops it replaces: rms_norm / silu_and_mul followed by F.linear."""

import pytest
import torch
import torch.nn.functional as F

from splitserve.kernels.activation import silu_and_mul
from splitserve.kernels.rmsnorm import rms_norm
from splitserve.kernels.skinny_linear import MAX_ROWS, skinny_linear

TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}


def _tensors(device, dtype, rows, n, k, x_cols):
    gen = torch.Generator().manual_seed(2)
    make = lambda *s: (torch.randn(*s, generator=gen) * 0.5).to(dtype).to(device)  # noqa: E731
    return make(rows, x_cols), make(rows, x_cols), make(k) + 1.0, make(n, k), make(n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,n,k", [(1, 48, 64), (3, 40, 96), (16, 16, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_plain(device, dtype, rows, n, k, bias):
    x, _, _, w, b = _tensors(device, dtype, rows, n, k, k)
    b = b if bias else None
    got = skinny_linear(x, w, b, impl="triton")
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,n,k", [(1, 48, 64), (5, 40, 96)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_prologue(device, dtype, rows, n, k, with_residual):
    x, res, nw, w, _ = _tensors(device, dtype, rows, n, k, k)
    res = res if with_residual else None
    got = skinny_linear(x, w, prologue="norm", residual=res, norm_weight=nw, eps=1e-5, impl="triton")
    normed = rms_norm(x, nw, 1e-5, res, impl="ref")
    if with_residual:
        normed, new_res = normed
        got, got_res = got
        assert torch.equal(got_res, new_res)  # x + residual, rounded as the eager add is
    torch.testing.assert_close(got.float(), F.linear(normed.float(), w.float()), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,n,k", [(1, 48, 64), (7, 24, 80)])
def test_silu_prologue(device, dtype, rows, n, k):
    x, _, _, w, _ = _tensors(device, dtype, rows, n, k, 2 * k)
    got = skinny_linear(x, w, prologue="silu", impl="triton")
    act = silu_and_mul(x, impl="ref")
    torch.testing.assert_close(got.float(), F.linear(act.float(), w.float()), **TOL[dtype])


def test_ref_impl_matches_the_unfused_ops(device):
    x, res, nw, w, _ = _tensors(device, torch.float32, 2, 8, 16, 16)
    got, new_res = skinny_linear(x, w, prologue="norm", residual=res, norm_weight=nw, eps=1e-6, impl="ref")
    normed, want_res = rms_norm(x, nw, 1e-6, res, impl="ref")
    assert torch.equal(got, F.linear(normed, w)) and torch.equal(new_res, want_res)


def test_errors_name_the_limit(device):
    x, _, _, w, _ = _tensors(device, torch.float32, MAX_ROWS + 1, 8, 16, 16)
    with pytest.raises(ValueError, match=r"skinny_linear: at most 16 rows, got 17; use a GEMM"):
        skinny_linear(x, w)
    with pytest.raises(ValueError, match=r"x must have 32 columns for weight \(N, 16\) with 'silu', got 16"):
        skinny_linear(x[:2], w, prologue="silu")
    with pytest.raises(ValueError, match=r"prologue 'gelu' is not one of"):
        skinny_linear(x[:2], w, prologue="gelu")
