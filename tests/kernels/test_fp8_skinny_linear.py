"""The few-row e4m3-weight linear (W8A16) against its torch reference (the e4m3 values times x in fp32,
the row scale after the sum), and that reference against float64; split-K's counters, its fixed summation
order, and (on a GPU) the 8B shapes and a CUDA-graph replay.

Tolerance: kernels.fp8_skinny_linear.fp8_skinny_linear_error_bound, per element: one step of the output dtype
(both round one fp32 sum) plus the fp32 sums' order (4 K 2^-24 of the sum of |x_k w_k| scale). A lost or stale
partial, a wrong row or scale is off by the size of the result itself."""

import pytest
import torch

from splitserve.engine.worker.fp8 import quantize_per_channel
from splitserve.kernels.fp8_skinny_linear import (
    MAX_ROWS,
    MIN_BLOCK_N,
    fp8_skinny_linear,
    fp8_skinny_linear_error_bound,
    fp8_skinny_linear_ref,
    fp8_skinny_linear_triton,
    split_k_for,
)


def assert_within_bound(got, x, w_q, scale, b=None):
    want = fp8_skinny_linear_ref(x, w_q, scale, b)
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.double() - want.double()).abs()
    bound = fp8_skinny_linear_error_bound(x, w_q, scale, b).double()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"|kernel - reference| reaches {worst:.2f}x the bound (max |err| {err.max().item():.3g})"


def _operands(device, dtype, rows, n, k, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n)[:, None]  # rows of different scales
    w_q, scale = quantize_per_channel(w)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    put = lambda t: None if t is None else t.to(device)  # noqa: E731
    return put(x), put(w_q), put(scale), put(b)


# (rows, N, K): tile-aligned; N and K not multiples of the tiles (16, 32 in the interpreter); one row of each
SHAPES = [(1, 48, 64), (1, 37, 100), (3, 40, 96), (5, 33, 70), (16, 16, 32), (16, 50, 129)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n,k", SHAPES)
@pytest.mark.parametrize("split_k", [1, 3])
def test_matches_the_reference(device, dtype, rows, n, k, split_k):
    x, w_q, scale, b = _operands(device, dtype, rows, n, k, bias=split_k == 1)
    got = fp8_skinny_linear_triton(x, w_q, scale, b, config=dict(SPLIT_K=split_k))
    assert got.dtype == dtype and got.shape == (rows, n)
    assert_within_bound(got, x, w_q, scale, b)


def _sixteen_bit(device, dtype, rows, n, k, bias=True, seed=0):
    """x, a 16-bit weight of x's dtype (no scale), bias: the plain GEMV's operands."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n)[:, None]).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    put = lambda t: None if t is None else t.to(device)  # noqa: E731
    return put(x), put(w), None, put(b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n,k", [(1, 48, 64), (1, 37, 100), (5, 33, 70), (16, 50, 129)])
@pytest.mark.parametrize("split_k", [1, 3])
def test_a_sixteen_bit_weight_matches_the_plain_product(device, dtype, rows, n, k, split_k):
    """Weight in x's dtype, no scale: the few-row GEMV (M = 1) and tensor-core path (M > 1), against the
    fp32 product rounded once."""
    x, w, _, b = _sixteen_bit(device, dtype, rows, n, k, bias=split_k == 1)
    got = fp8_skinny_linear_triton(x, w, None, b, config=dict(SPLIT_K=split_k))
    want = (x.double() @ w.double().t() + (b.double() if b is not None else 0)).to(dtype)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert_within_bound(got, x, w, None, b)
    assert (got.double() - want.double()).abs().max() <= 2 * torch.finfo(dtype).eps * want.double().abs().max()


def test_reference_is_the_dequantized_product_in_float64():
    x, w_q, scale, b = _operands("cpu", torch.float64, 4, 24, 40)
    want = x @ (w_q.double() * scale.double()[:, None]).T + b
    torch.testing.assert_close(fp8_skinny_linear_ref(x, w_q, scale, b), want, rtol=1e-12, atol=1e-12)
    # float32 x: the same sums in float32, within float32 rounding of the float64 product
    got32 = fp8_skinny_linear_ref(x.float(), w_q, scale, b.float())
    torch.testing.assert_close(got32.double(), want, rtol=1e-5, atol=1e-5)


def test_split_counters_return_to_zero_and_the_sum_order_is_fixed(device):
    x, w_q, scale, _ = _operands(device, torch.float32, 2, 40, 96)
    counters = torch.zeros(8, dtype=torch.int32, device=device)
    first = fp8_skinny_linear_triton(x, w_q, scale, counters=counters, config=dict(SPLIT_K=3))
    assert counters.tolist() == [0] * 8
    again = fp8_skinny_linear_triton(x, w_q, scale, counters=counters, config=dict(SPLIT_K=3))
    assert torch.equal(first, again)  # the same partials added in the same order: bit for bit
    assert counters.tolist() == [0] * 8


def test_more_splits_than_k_steps_are_trimmed(device):
    x, w_q, scale, b = _operands(device, torch.float32, 1, 16, 40)  # two 32-wide steps in the interpreter
    got = fp8_skinny_linear_triton(x, w_q, scale, b, config=dict(SPLIT_K=8))
    assert_within_bound(got, x, w_q, scale, b)


def test_split_heuristic_fills_the_sms():
    # H200 (132 SMs), GEMV tiles 16 x 512: o_proj 4096 x 4096 has 256 tiles of 8 steps -> 3 splits (3, 3, 2)
    assert split_k_for(4096, 4096, 16, 512, 132) == 3
    assert split_k_for(4096, 14336, 16, 512, 132) == 3  # down_proj: 28 steps -> 10, 10, 8
    assert split_k_for(28672, 4096, 16, 512, 132) == 1  # gate_up: 1792 tiles are enough
    assert split_k_for(64, 512, 16, 512, 132) == 1  # one step: nothing to split


def test_ref_impl_and_errors():
    x, w_q, scale, b = _operands("cpu", torch.float32, 2, 24, 40)
    assert torch.equal(fp8_skinny_linear(x, w_q, scale, b, impl="ref"), fp8_skinny_linear_ref(x, w_q, scale, b))
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows, got 17"):
        fp8_skinny_linear(torch.zeros(17, 40), w_q, scale, impl="ref")
    with pytest.raises(ValueError, match="weight must be float8_e4m3fn"):
        fp8_skinny_linear(x, w_q.float(), scale, impl="ref")
    with pytest.raises(
        ValueError,
        match=r"float8_e4m3fn \(or x's 16-bit dtype\) with contiguous rows, got torch.bfloat16 with strides "
        r"\(40, 1\) and x torch.float32",
    ):
        fp8_skinny_linear(x, w_q.bfloat16(), None, impl="ref")  # float32 x: a 16-bit weight must match it
    with pytest.raises(ValueError, match="an e4m3 weight needs weight_scale, a 16-bit one takes none"):
        fp8_skinny_linear(x, w_q, None, impl="ref")
    with pytest.raises(ValueError, match="an e4m3 weight needs weight_scale, a 16-bit one takes none"):
        fp8_skinny_linear(x.bfloat16(), w_q.bfloat16(), scale, impl="ref")
    with pytest.raises(ValueError, match=r"weight_scale must be \(24,\) float32"):
        fp8_skinny_linear(x, w_q, scale[:5], impl="ref")
    with pytest.raises(ValueError, match="counters must be int32 with at least 2 entries"):
        fp8_skinny_linear(x, w_q, scale, counters=torch.zeros(1, dtype=torch.int32), impl="ref")
    with pytest.raises(ValueError, match=f"needs BLOCK_N >= {MIN_BLOCK_N} and DOT for M > 1"):
        fp8_skinny_linear_triton(x, w_q, scale, config=dict(DOT=False))


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Llama-3-8B's projections (N, K)
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@gpu
@pytest.mark.parametrize("rows", [1, 2, 16])
@pytest.mark.parametrize("n,k", SHAPES_8B)
def test_8b_shapes_on_gpu_default_tiles(rows, n, k):
    x, w_q, scale, _ = _operands("cuda", torch.bfloat16, rows, n, k, bias=False)
    counters = torch.zeros(-(-n // MIN_BLOCK_N), dtype=torch.int32, device="cuda")
    first = fp8_skinny_linear(x, w_q, scale, counters=counters)
    assert_within_bound(first, x, w_q, scale)
    for _ in range(20):  # a stale partial read by the reducing program would change bits
        assert torch.equal(fp8_skinny_linear(x, w_q, scale, counters=counters), first)
    assert int(counters.abs().sum()) == 0


@gpu
def test_cuda_graph_replays_equal_eager():
    x, w_q, scale, b = _operands("cuda", torch.bfloat16, 1, 4096, 14336)
    counters = torch.zeros(4096 // MIN_BLOCK_N, dtype=torch.int32, device="cuda")
    eager = fp8_skinny_linear(x, w_q, scale, b, counters=counters)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_skinny_linear(x, w_q, scale, b, counters=counters)  # warm up (compile) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_skinny_linear(x, w_q, scale, b, counters=counters)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert int(counters.abs().sum()) == 0
