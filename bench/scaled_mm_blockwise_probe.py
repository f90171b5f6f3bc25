"""Whether this torch's `torch._scaled_mm` multiplies block-scaled e4m3 operands as engine.quant.block_scaled_mm
hands them over (activations per token per 128 features, token-fastest, rows padded to a multiple of 4; weights per
128 x 128 tile, a (K / 128, N / 128) view) on this GPU at each row count, how close to the reference sums (also at
K / 128 = 2 and 3, which the engine keeps off this path) and how fast beside kernels.fp8_block_linear (docs/perf.md,
fifteenth session). Prints what each attempt gave.

    python -m bench.scaled_mm_blockwise_probe
"""

from __future__ import annotations

import torch

from bench.fp8_linear import graph_ms


def main() -> int:
    from splitserve.engine.quant import block_scaled_mm, quantize_per_token_group
    from splitserve.kernels.fp8_block_linear import fp8_block_linear, fp8_block_linear_ref

    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    for n, k, rows in ((6144, 4096, (1, 2, 5, 16, 17, 33, 64, 100, 256, 2048)), (256, 256, (20,)), (256, 384, (20,))):
        w_q = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn).cuda()
        tiles = torch.rand(n // 128, k // 128, generator=gen).cuda() * 1e-3 + 1e-4  # (N / 128, K / 128)
        row_scale = tiles.repeat_interleave(128, 0)
        for m in rows:
            x = torch.randn(m, k, generator=gen).cuda().bfloat16()
            x_q, x_scale = quantize_per_token_group(x, 128)
            want = fp8_block_linear_ref(x_q, x_scale, w_q, row_scale).float()
            kernel = graph_ms([lambda: fp8_block_linear(x_q, x_scale, w_q, row_scale)], "cuda")
            cell = f"M {m:5d} (N {n}, K {k}): kernels.fp8_block_linear {kernel:.4f} ms"
            try:
                got = block_scaled_mm(x, w_q, tiles).float()
            except Exception as exc:  # what this torch says it cannot do
                print(f"{cell} | block_scaled_mm: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}")
                continue
            err = float((got - want).norm() / want.norm())
            ms = graph_ms([lambda: block_scaled_mm(x, w_q, tiles)], "cuda")
            print(f"{cell} | block_scaled_mm (quantizer included) {ms:.4f} ms, rel err {err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
