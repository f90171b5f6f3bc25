"""Whether this torch's `torch._scaled_mm` multiplies block-scaled e4m3 operands (activations per token per 128
features, weights per 128 x 128 tile) on this GPU, in which scale layouts, and how fast beside
kernels.fp8_block_linear (one H200: docs/perf.md, fifteenth session). Prints what each attempt gave.

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
    for m, n, k in ((1, 6144, 4096), (256, 28672, 4096), (2048, 28672, 4096)):
        x = torch.randn(m, k, generator=gen).cuda().bfloat16()
        w_q = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn).cuda()
        tiles = torch.rand(n // 128, k // 128, generator=gen).cuda() * 1e-3 + 1e-4  # (N / 128, K / 128)
        x_q, x_scale = quantize_per_token_group(x, 128)  # (M, K), (M, K / 128)
        row_scale = tiles.repeat_interleave(128, 0)
        want = fp8_block_linear_ref(x_q, x_scale, w_q, row_scale).float()
        ms_kernel = graph_ms([lambda: fp8_block_linear(x_q, x_scale, w_q, row_scale)], "cuda")
        print(f"M {m} N {n} K {k}: kernels.fp8_block_linear {ms_kernel:.4f} ms")
        attempts = {
            "a (M,K/128) row-major, b (N/128,K/128)": (x_scale, tiles),
            "a (M,K/128) col-major, b (N/128,K/128)": (x_scale.t().contiguous().t(), tiles),
            "a (M,K/128) col-major, b (K/128,N/128)": (x_scale.t().contiguous().t(), tiles.t()),
            "a (M,K/128) col-major, b (K/128,N/128) contiguous": (x_scale.t().contiguous().t(), tiles.t().contiguous()),
        }
        for name, (sa, sb) in attempts.items():
            try:
                got = torch._scaled_mm(x_q, w_q.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16).float()
            except Exception as exc:  # what this torch says it cannot do
                print(f"  {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                continue
            err = float((got - want).norm() / want.norm())
            ms = graph_ms([lambda sa=sa, sb=sb: torch._scaled_mm(x_q, w_q.t(), scale_a=sa, scale_b=sb,
                                                                 out_dtype=torch.bfloat16)], "cuda")  # fmt: skip
            print(f"  {name}: rel err vs reference {err:.2e}, {ms:.4f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
