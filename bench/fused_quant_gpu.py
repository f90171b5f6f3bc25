"""RMSNorm / SiLU-mul fused with the per-token fp8 quantizer against the two launches they replace (issue 19).

    python -m bench.fused_quant_gpu --json $OUT/fused_quant.json        # on the GPU (splitserve installed)
    TRITON_INTERPRET=1 python -m bench.fused_quant_gpu --dry-run         # CPU: tiny shapes, every code path

At Llama-3-8B's decode shapes (hidden 4096, SiLU-mul of 2 x 14336; the norms with their residual add):
1. exactness: kernels.rmsnorm.rms_norm_quant and kernels.activation.silu_and_mul_quant against the op's own
   kernel followed by kernels.fp8_quant's, bf16 and fp16, at 1, 128 and 256 rows: every e4m3 byte, every
   scale and the new residual must be equal (engine.fused_ops swaps one for the other in the decode graph);
2. time: each variant captured in a CUDA graph (enough calls back to back that a replay is ~ms) and replayed,
   ms per call; the inputs stay in L2 between calls, as they do in the step (the op before just wrote them).
   `per step` = 32 layers x (2 norms + 1 SiLU-mul) of the saving: what the 8B step should gain.
Exit status 1 when any output differs. The table is printed last; the JSON holds every number.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from bench.fp8_linear import graph_ms

NUM_LAYERS = 32  # Llama-3-8B: 2 norms and 1 SiLU-mul quantized per layer
# two_pass: the SiLU-mul kernel's other layout (the row read twice, this many features at a time), timed beside
# the default (the row in registers, up to kernels.activation._MAX_ONE_PASS_F); the fastest belongs there
FULL = dict(
    hidden=4096, feat=14336, exact_rows=(1, 128, 256), time_rows=(1, 16, 64, 128, 256), two_pass=(8192, 4096, 2048)
)
DRY = dict(hidden=256, feat=640, exact_rows=(1, 3), time_rows=(3,), two_pass=(256,))


def inputs(rows: int, p: dict, dtype, device: str, seed: int = 0):
    """x, residual, norm weight (rows, hidden) and gate_up (rows, 2 F); one zero row and one large one."""
    gen = torch.Generator().manual_seed(seed + rows)
    x = torch.randn(rows, p["hidden"], generator=gen) * 2
    residual = torch.randn(rows, p["hidden"], generator=gen)
    weight = 1 + 0.1 * torch.randn(p["hidden"], generator=gen)
    gate_up = torch.randn(rows, 2 * p["feat"], generator=gen) * 2
    if rows >= 3:
        x[1] = residual[1] = gate_up[1] = 0.0
        x[2] *= 50.0
        gate_up[2] *= 10.0
    return [t.to(device, dtype) for t in (x, residual, weight, gate_up)]


def variants(x, residual, weight, gate_up, min_scale: float, two_pass=()) -> dict:
    """name -> (op, zero-argument call returning (x_q, scale[, new_residual])); unfused first per op."""
    from splitserve.kernels.activation import silu_and_mul_quant, silu_and_mul_triton
    from splitserve.kernels.fp8_quant import quantize_per_token_triton as quant
    from splitserve.kernels.rmsnorm import rms_norm_quant, rms_norm_triton

    eps = 1e-5

    def norm_then_quant():
        out, new_residual = rms_norm_triton(x, weight, eps, residual)
        return (*quant(out, min_scale), new_residual)

    calls = {
        "norm+res: rms_norm, quantize": ("norm", norm_then_quant),
        "norm+res: rms_norm_quant": (
            "norm",
            lambda: rms_norm_quant(x, weight, eps, min_scale, residual, impl="triton"),
        ),
        "norm: rms_norm, quantize": ("norm0", lambda: quant(rms_norm_triton(x, weight, eps), min_scale)),
        "norm: rms_norm_quant": ("norm0", lambda: rms_norm_quant(x, weight, eps, min_scale, impl="triton")[:2]),
        "silu: silu_and_mul, quantize": ("silu", lambda: quant(silu_and_mul_triton(gate_up), min_scale)),
        "silu: silu_and_mul_quant": ("silu", lambda: silu_and_mul_quant(gate_up, min_scale, impl="triton")),
    }
    for block_f in two_pass:
        calls[f"silu: silu_and_mul_quant {block_f}"] = (
            "silu",
            lambda b=block_f: silu_and_mul_quant(gate_up, min_scale, impl="triton", max_block_f=b),
        )
    return calls


def mismatches(got: tuple, want: tuple) -> int:
    """Elements that differ between two (x_q, scale[, residual]) results (e4m3 compared as bytes)."""
    total = 0
    for a, b in zip(got, want, strict=True):
        if a is None or b is None:
            total += int((a is None) != (b is None))
            continue
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        total += int((a != b).sum().item()) if a.shape == b.shape else a.numel()
    return total


def check_exact(p: dict, device: str, min_scale: float) -> list[dict]:
    rows_out = []
    for dtype in (torch.bfloat16, torch.float16):
        for rows in p["exact_rows"]:
            calls = variants(*inputs(rows, p, dtype, device), min_scale, p["two_pass"])
            unfused = {}
            for name, (op, call) in calls.items():
                result = call()
                if op not in unfused:
                    unfused[op] = result
                    continue
                bad = mismatches(result, unfused[op])
                rows_out.append(dict(dtype=str(dtype).split(".")[-1], rows=rows, variant=name, mismatches=bad))
    return rows_out


def time_variants(p: dict, device: str, min_scale: float) -> list[dict]:
    rows_out = []
    for rows in p["time_rows"]:
        calls = variants(*inputs(rows, p, torch.bfloat16, device), min_scale, p["two_pass"])
        base = {}
        for name, (op, call) in calls.items():
            ms = graph_ms([call] * (64 if device == "cuda" else 1), device)
            base.setdefault(op, ms)
            rows_out.append(dict(rows=rows, variant=name, op=op, ms=ms, saved_ms=base[op] - ms))
    return rows_out


def step_saving_ms(timings: list[dict], rows: int) -> float:
    """32 layers x (two norms with residual + one SiLU-mul) of what the default fused kernels save at `rows`
    (negative: they cost more than the launches they replace)."""
    saved = {t["variant"]: t["saved_ms"] for t in timings if t["rows"] == rows}
    return NUM_LAYERS * (2 * saved["norm+res: rms_norm_quant"] + saved["silu: silu_and_mul_quant"])


def print_table(result: dict) -> None:
    bad = [e for e in result["exact"] if e["mismatches"]]
    print(f"exactness: {len(result['exact']) - len(bad)} of {len(result['exact'])} fused results bit-equal")
    for e in bad:
        print(f"  DIFFERS {e['dtype']} rows {e['rows']} {e['variant']}: {e['mismatches']} elements")
    print(f"\n{'rows':>5}  {'variant':<40} {'us/call':>9} {'saved us':>9}")
    for t in result["timings"]:
        print(f"{t['rows']:>5}  {t['variant']:<40} {1e3 * t['ms']:>9.2f} {1e3 * t['saved_ms']:>9.2f}")
    for rows, ms in result["step_saving_ms"].items():
        print(f"per 8B step at {rows} rows: {ms:.3f} ms saved (32 x (2 norms + 1 SiLU-mul), default fused kernels)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "fused_quant.json"))
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes (CPU: TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("no GPU: run the dry run under the interpreter, TRITON_INTERPRET=1 ... --dry-run")
    from splitserve.engine.quant import MIN_SCALE

    p = DRY if args.dry_run or device == "cpu" else FULL
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
    result = dict(device=name, shapes=p, exact=check_exact(p, device, MIN_SCALE))
    result["timings"] = time_variants(p, device, MIN_SCALE)
    result["step_saving_ms"] = {rows: step_saving_ms(result["timings"], rows) for rows in p["time_rows"]}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"device: {name}; JSON: {args.json}\n")
    print_table(result)
    return 1 if any(e["mismatches"] for e in result["exact"]) else 0


if __name__ == "__main__":
    sys.exit(main())
