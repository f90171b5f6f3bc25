"""Fused RMSNorm (Triton and reference) against HF Llama RMSNorm numerics."""

import pytest
import torch

from splitserve.kernels import rms_norm

ON_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
EPS = 1e-6


def hf_rms_norm(x, weight, eps):
    """HF LlamaRMSNorm.forward, written out."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def one_ulp(dtype):
    return {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]


def inputs(device, rows, hidden, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype).to(device)
    res = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    return x, res, w


@pytest.mark.parametrize("impl", ["triton", "ref"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(5, 64), (3, 100)])
def test_norm_matches_hf(device, impl, dtype, rows, hidden):
    x, _, w = inputs(device, rows, hidden, dtype)
    out = rms_norm(x, w, EPS, impl=impl)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, hf_rms_norm(x, w, EPS), atol=one_ulp(dtype) * 4, rtol=one_ulp(dtype))


@pytest.mark.parametrize("impl", ["triton", "ref"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_residual_add_then_norm(device, impl, dtype):
    x, res, w = inputs(device, 4, 48, dtype)
    out, new_res = rms_norm(x.view(2, 2, 48), w, EPS, residual=res.view(2, 2, 48), impl=impl)
    assert out.shape == (2, 2, 48) and new_res.shape == (2, 2, 48)
    assert torch.equal(new_res.view(4, 48), x + res)  # the eager add, bit for bit
    torch.testing.assert_close(
        out.view(4, 48), hf_rms_norm(x + res, w, EPS), atol=one_ulp(dtype) * 4, rtol=one_ulp(dtype)
    )


def test_weight_shape_error(device):
    x = torch.zeros(2, 8, device=device)
    with pytest.raises(ValueError, match=r"^rms_norm: weight must be \(8,\), got \(4,\)$"):
        rms_norm(x, torch.ones(4, device=device), EPS)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [4096, 5120])
def test_gpu_large(dtype, hidden):
    x, res, w = inputs("cuda", 777, hidden, dtype)
    out, new_res = rms_norm(x, w, EPS, residual=res)
    assert torch.equal(new_res, x + res)
    torch.testing.assert_close(out, hf_rms_norm(x + res, w, EPS), atol=one_ulp(dtype) * 4, rtol=one_ulp(dtype))
