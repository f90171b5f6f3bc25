"""SiLU-and-mul (Triton and reference) against the eager torch expression."""

import pytest
import torch
import torch.nn.functional as F

from splitserve.kernels import silu_and_mul

ON_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("impl", ["triton", "ref"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 2 * 40), (2, 3, 2 * 16)])
def test_matches_eager(device, impl, dtype, shape):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 4).to(dtype).to(device)
    out = silu_and_mul(x, impl=impl)
    feat = shape[-1] // 2
    assert out.shape == (*shape[:-1], feat) and out.dtype == dtype
    torch.testing.assert_close(out, F.silu(x[..., :feat]) * x[..., feat:], atol=TOL[dtype], rtol=TOL[dtype])


def test_known_values(device):
    x = torch.tensor([[0.0, 2.0, 3.0, -1.0]], device=device)  # gate [0, 2], up [3, -1]
    out = silu_and_mul(x, impl="triton")
    expected = torch.tensor([[0.0, -2.0 / (1.0 + torch.exp(torch.tensor(-2.0)).item())]])
    torch.testing.assert_close(out.cpu(), expected, atol=1e-6, rtol=1e-6)


def test_odd_width_error(device):
    with pytest.raises(ValueError, match=r"^silu_and_mul: last dim must be even \(2F\), got 5$"):
        silu_and_mul(torch.zeros(2, 5, device=device))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_large(dtype):
    x = torch.randn(513, 2 * 14336, device="cuda").to(dtype)
    out = silu_and_mul(x)
    torch.testing.assert_close(out, F.silu(x[:, :14336]) * x[:, 14336:], atol=TOL[dtype], rtol=TOL[dtype])
