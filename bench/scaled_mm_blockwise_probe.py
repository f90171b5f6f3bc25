"""Whether this torch's `torch._scaled_mm` multiplies block-scaled e4m3 operands (activations per token per 128
features, token-fastest, each column padded to 1, 4 or 16 tokens; weights per 128 x 128 tile, a (K / 128, N / 128)
view) on this GPU at each row count, and how fast beside kernels.fp8_block_linear (one H200: docs/perf.md,
fifteenth session). Prints what each attempt gave.

    python -m bench.scaled_mm_blockwise_probe
"""

from __future__ import annotations

import torch

from bench.fp8_linear import graph_ms


def main() -> int:
    from splitserve.engine.quant import quantize_per_token_group
    from splitserve.kernels.fp8_block_linear import fp8_block_linear, fp8_block_linear_ref

    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    n, k = 6144, 4096
    w_q = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn).cuda()
    tiles = torch.rand(n // 128, k // 128, generator=gen).cuda() * 1e-3 + 1e-4  # (N / 128, K / 128)
    row_scale = tiles.repeat_interleave(128, 0)
    for m in (1, 2, 3, 4, 5, 8, 16, 17, 31, 32, 33, 64, 100, 256, 2048):
        x = torch.randn(m, k, generator=gen).cuda().bfloat16()
        x_q, x_scale = quantize_per_token_group(x, 128)
        want = fp8_block_linear_ref(x_q, x_scale, w_q, row_scale).float()
        cells = [f"kernel {graph_ms([lambda: fp8_block_linear(x_q, x_scale, w_q, row_scale)], 'cuda'):.4f} ms"]
        for pad in (1, 4, 16):
            xq, sa = quantize_per_token_group(x, 128, column_major=pad)
            try:
                got = torch._scaled_mm(xq, w_q.t(), scale_a=sa, scale_b=tiles.t(), out_dtype=torch.bfloat16).float()
            except Exception as exc:  # what this torch says it cannot do
                cells.append(f"pad {pad}: {type(exc).__name__}: {str(exc).splitlines()[0][:70]}")
                continue
            err = float((got - want).norm() / want.norm())
            ms = graph_ms([lambda xq=xq, sa=sa: torch._scaled_mm(xq, w_q.t(), scale_a=sa, scale_b=tiles.t(),
                                                                 out_dtype=torch.bfloat16)], "cuda")  # fmt: skip
            cells.append(f"pad {pad}: {ms:.4f} ms, rel err {err:.1e}")
        print(f"M {m:5d} (N {n}, K {k}): " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
