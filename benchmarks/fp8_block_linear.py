"""Block-wise FP8 projections (128 x 128 weight tiles, activations per token per 128 features: DeepSeek-V3's and
Qwen3's FP8 releases) beside the per-channel W8A8 path and bf16, at Llama-3-8B's four projections.

    python benchmarks/fp8_block_linear.py --json OUT.json        # on a GPU of capability >= 8.9

Per (projection, rows): bf16 (cuBLAS), per-channel W8A8 (Fp8Linear: per-token quantizer + row-wise
`torch._scaled_mm`), block-wise W8A8 (Fp8Linear in block mode: the per-group quantizer +
splitserve.kernels.fp8_block_linear up to 16 rows, `torch._scaled_mm`'s block scaling from 17:
splitserve.engine.worker.fp8.BLOCK_SCALED_MM_MIN_ROWS), and the kernel alone on each tile of a small sweep (its
default first). Times as fp8_linear.py (beside this script) takes them: calls captured back to back in one CUDA
graph over weight copies whose bytes are 3x the L2, replayed, per call.
`rel err` = |y - y_bf16| / |y_bf16| of the layer; `kernel ok` = every tile within 2e-3 (relative norm) of the
kernel's torch reference on the same operands (Hopper's e4m3 tensor-core sums keep fewer bits than fp32: cuBLASLt's
block-scaled product is 6.9e-4 from it too), `worst` its largest element error in units of two bf16 steps.
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from fp8_linear import FP8_LINEARS, copies_for, graph_ms

ROWS = (1, 16, 64, 256, 2048)
BLOCK = (128, 128)
SWEEP = {  # the kernel's tiles tried at each size of M (block_config's choice is timed first)
    "small": [
        dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=1, num_warps=4, num_stages=4),
        dict(BLOCK_M=16, BLOCK_N=128, GROUP_M=1, num_warps=4, num_stages=3),
        dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=2, num_stages=5),
    ],
    "mid": [
        dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4),
        dict(BLOCK_M=32, BLOCK_N=64, GROUP_M=8, num_warps=4, num_stages=4),
    ],
    "large": [
        dict(BLOCK_M=128, BLOCK_N=64, GROUP_M=8, num_warps=4, num_stages=4),
        dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4),
        dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, num_warps=8, num_stages=3),
    ],
}


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) -> (e4m3 (N, K), fp32 scales (ceil(N / 128), K / 128)): amax / 448 per BLOCK tile, as the
    block-wise releases are written (a last, partial row of tiles scaled over its own rows)."""
    from splitserve.engine.worker.fp8 import FP8_MAX, to_fp8

    n, k = weight.shape
    bn, bk = BLOCK
    rows = -(-n // bn)
    padded = torch.zeros(rows * bn, k, device=weight.device, dtype=torch.float32)
    padded[:n] = weight.float()
    tiles = padded.view(rows, bn, k // bk, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # (rows, K / bk)
    return to_fp8(tiles / scale[:, None, :, None]).view(rows * bn, k)[:n], scale


def block_layer(weight: torch.Tensor):
    """An Fp8Linear in block mode holding `weight` (N, K) quantized in BLOCK tiles."""
    from splitserve.engine.worker.fp8 import Fp8Linear

    n, k = weight.shape
    layer = Fp8Linear(k, [n], False, weight.dtype, weight.device, block=BLOCK, scale_name="weight_scale_inv")
    w_q, scale = quantize_blocks(weight)
    layer.weight.data.copy_(w_q)
    layer.weight_scale_inv.data.copy_(scale)
    layer.finalize(0)
    return layer


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_block_checkpoint(config_path: str, out_dir: str, device: str, seed: int = 0) -> str:
    """A block-wise fp8 checkpoint of `config_path`'s model in `out_dir` (as DeepSeek-V3's and Qwen3's FP8 releases
    are written: every projection in e4m3 with `weight_scale_inv` per 128 x 128 tile, `weight_block_size`
    [128, 128], dynamic activations), from the random weights of a dummy load (splitserve.engine.worker.loader);
    returns the path."""
    from safetensors.torch import save_file

    from splitserve.engine.worker.loader import load_model

    net, _ = load_model(config_path, dtype=torch.bfloat16, device=device, load_format="dummy", seed=seed)
    tensors = {}
    for name, view in net.checkpoint_targets().items():
        module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if module not in PROJECTIONS:
            tensors[name] = view.contiguous().cpu()
            continue
        w_q, scale = quantize_blocks(view)
        tensors[name] = w_q.contiguous().cpu()
        tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale.cpu()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(Path(config_path).read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK),
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def channel_layer(weight: torch.Tensor):
    from splitserve.engine.worker.fp8 import Fp8Linear

    lin = torch.nn.Module()
    lin.weight, lin.bias, lin.output_sizes = weight, None, (weight.shape[0],)
    return Fp8Linear.from_linear(lin)


def sweep_for(m: int) -> list[dict]:
    return SWEEP["small" if m <= 16 else "mid" if m <= 64 else "large"]


def bench(device: str) -> list[dict]:
    from splitserve.engine.worker.fp8 import quantize_per_token_group
    from splitserve.kernels.fp8_block_linear import block_config, fp8_block_linear, fp8_block_linear_ref

    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for name, n, k in FP8_LINEARS:
        copies = copies_for(n * k, device)  # the e4m3 weights' bytes; bf16 reads twice that
        weights = [(torch.randn(n, k, generator=gen) * 0.02).to(device, torch.bfloat16) for _ in range(copies)]
        blocks = [block_layer(w) for w in weights]
        channels = [channel_layer(w) for w in weights]
        for m in ROWS:
            x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
            ref = F.linear(x.float(), weights[0].float())
            row = dict(proj=name, n=n, k=k, m=m)
            row["bf16_ms"] = graph_ms([lambda w=w: F.linear(x, w) for w in weights], device)
            row["channel_ms"] = graph_ms([lambda lay=lay: lay(x) for lay in channels], device)
            row["block_ms"] = graph_ms([lambda lay=lay: lay(x) for lay in blocks], device)
            y = blocks[0](x).float()
            row["block_rel_err"] = float((y - ref).norm() / ref.norm())
            row["channel_rel_err"] = float((channels[0](x).float() - ref).norm() / ref.norm())
            x_q, x_scale = quantize_per_token_group(x, BLOCK[1])
            row["quantize_ms"] = graph_ms([lambda: quantize_per_token_group(x, BLOCK[1])], device)
            want = fp8_block_linear_ref(x_q, x_scale, blocks[0].weight, blocks[0].row_scale).float()
            tiles = []
            for cfg in [block_config(m, n)] + sweep_for(m):
                got = fp8_block_linear(x_q, x_scale, blocks[0].weight, blocks[0].row_scale, config=cfg).float()
                worst = float(((got - want).abs() / (1e-3 + 8e-3 * want.abs())).max())  # > 1: past two bf16 steps
                rel = float((got - want).norm() / want.norm())
                ok = rel < 2e-3  # Hopper's e4m3 tensor-core sums keep fewer bits than fp32 (cuBLASLt's: 6.9e-4)
                ms = graph_ms(
                    [lambda lay=lay, c=cfg: fp8_block_linear(x_q, x_scale, lay.weight, lay.row_scale, config=c)
                     for lay in blocks], device,
                )  # fmt: skip
                tiles.append(dict(cfg, ms=ms, ok=ok, worst=worst, rel=rel))
            row["kernel_tiles"] = tiles
            row["kernel_default_ms"] = tiles[0]["ms"]
            best = min((t for t in tiles if t["ok"]), key=lambda t: t["ms"], default=None)
            row["kernel_best_ms"] = best["ms"] if best else float("nan")
            row["kernel_best"] = {k_: v for k_, v in (best or {}).items() if k_ not in ("ms", "ok")}
            row["kernel_ok"] = all(t["ok"] for t in tiles)
            row["kernel_worst"] = max(t["worst"] for t in tiles)
            rows_out.append(row)
            print(
                f"{name:8s} M {m:5d}: bf16 {row['bf16_ms']:.4f}  channel {row['channel_ms']:.4f}  block "
                f"{row['block_ms']:.4f} (quantize {row['quantize_ms']:.4f}, kernel {row['kernel_default_ms']:.4f}, "
                f"best {row['kernel_best_ms']:.4f} {row['kernel_best']})  err {row['block_rel_err']:.4f} / "
                f"{row['channel_rel_err']:.4f}  ok {row['kernel_ok']} (tiles' worst / rel err: "
                f"{[(t['BLOCK_M'], t['BLOCK_N'], round(t['worst'], 2), format(t['rel'], '.1e')) for t in tiles]})",
                flush=True,
            )
    return rows_out


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| projection (N, K) | M | bf16 ms | per-channel W8A8 ms | block W8A8 ms | of which quantize "
        "| kernel (best tile) | block / per-channel | rel err block / per-channel | kernel ok |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['proj']} ({r['n']}, {r['k']}) | {r['m']} | {r['bf16_ms']:.4f} | {r['channel_ms']:.4f} | "
            f"{r['block_ms']:.4f} | {r['quantize_ms']:.4f} | {r['kernel_default_ms']:.4f} ({r['kernel_best_ms']:.4f}) "
            f"| {r['block_ms'] / r['channel_ms']:.2f}x | {r['block_rel_err']:.4f} / {r['channel_rel_err']:.4f} "
            f"| {r['kernel_ok']} |"
        )
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "fp8_block_linear.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("needs a CUDA GPU of capability >= 8.9 (e4m3 tensor cores)")
    rows = bench("cuda")
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, rows=rows), f, indent=1)
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
