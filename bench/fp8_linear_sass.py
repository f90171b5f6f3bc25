"""Compile-only check of kernels.fp8_skinny_linear for a GPU this machine does not have: every launch the
engine, the benchmarks and the GPU tests would make goes through the kernel's own wrapper (its config,
split count and Triton's argument specialization), is compiled by the Triton on sys.path for the target
(the H200 image runs Triton 3.6: sm_90) and not run; then, per distinct compiled kernel, the registers, the
local-memory (spill) instructions, the shared memory and the K loop's SASS (instructions a warp issues per
iteration, and per KiB of weight streamed by all the program's warps). Static evidence only: no timing.

    pip install --no-deps --target /tmp/t36 triton==3.6.0                # once; the wheel ships ptxas, cuobjdump
    PYTHONPATH=/tmp/t36 .venv-test/bin/python -m bench.fp8_linear_sass --json /tmp/fp8_sass.json

Budget for a streaming loop on an H200 (132 SMs x 4 schedulers x 1.98 GHz = 1.05e12 warp instructions/s
against 4.8e12 bytes/s): about 220 warp instructions per KiB at a perfect issue rate; a loop well under
that leaves the HBM as the bound.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import subprocess
from pathlib import Path

import torch

H200_SMS = 132
ISSUE_BUDGET_PER_KIB = 220
# (name, N, K) beside the 8B projections: Qwen3-0.6B (the nano-vllm workload, step 4 of bench/fp8_gpu.sh)
# and the embedded default model (step 5's quality run; its down projection's K = 640 is no tile multiple)
ENGINE_SHAPES = [
    ("0.6b qkv", 4096, 1024),
    ("0.6b o", 1024, 2048),
    ("0.6b gate_up", 6144, 1024),
    ("0.6b down", 1024, 3072),
    ("default qkv", 384, 256),
    ("default o", 256, 256),
    ("default gate_up", 1280, 256),
    ("default down", 256, 640),
]
TEST_SHAPES = [(1, 48, 64), (1, 37, 100), (3, 40, 96), (5, 33, 70), (16, 16, 32), (16, 50, 129), (7, 96, 64)]


class CompileOnlyDriver:
    """What JITFunction.run asks of a driver when it only compiles (warmup): the target, device 0, stream 0."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


class CompileOnlyKernel:
    """Stands in for the module's @triton.jit kernel: `kernel[grid](...)` compiles (warmup) and records."""

    def __init__(self, jit_fn):
        self.jit_fn = jit_fn
        self.compiled = {}  # hash -> (CompiledKernel, the launch's constexprs, [(M, N, K) launched])

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            kernel = self.jit_fn.run(*args, grid=grid, warmup=True, **kwargs)
            consts = {k: v for k, v in kwargs.items() if k.isupper() or k == "num_warps"}
            shapes = self.compiled.setdefault(kernel.hash, (kernel, consts, []))[2]
            if tuple(args[7:10]) not in shapes:  # M, N, K
                shapes.append(tuple(args[7:10]))

        return launch


@contextlib.contextmanager
def compile_only(module, arch: int):
    """The kernel module's launches compile for sm_`arch` (not run), with a GPU's config (not the
    interpreter's) and H200's SM count; yields the recorder."""
    import triton
    from triton.backends.compiler import GPUTarget

    saved = module.interpreting, module.num_sms, module._fp8_skinny_kernel, torch.cuda.current_device
    saved_driver = triton.runtime.driver._active  # None on a machine without a GPU (no driver to reset to)
    recorder = CompileOnlyKernel(module._fp8_skinny_kernel)
    triton.runtime.driver.set_active(CompileOnlyDriver(GPUTarget("cuda", arch, 32)))
    module.interpreting, module.num_sms, module._fp8_skinny_kernel = (lambda t: False), (lambda i: H200_SMS), recorder
    torch.cuda.current_device = lambda: 0
    try:
        yield recorder
    finally:
        module.interpreting, module.num_sms, module._fp8_skinny_kernel, torch.cuda.current_device = saved
        triton.runtime.driver.set_active(saved_driver)


def launch_all(module) -> int:
    """Every launch: the engine's (default tiles, M = 1, 2, 16, bf16 + fp16/fp32 + bias on one shape; the down
    projections also with the SiLU-mul in their loads, as Fp8Linear.forward_silu runs them), the projection
    bench's sweep (bench.fp8_linear.w8a16_configs at M = 1, 16), the GPU tests'. Returns the count."""
    from bench.fp8_linear import FP8_LINEARS, w8a16_configs

    def call(m, n, k, dtype=torch.bfloat16, bias=False, config=None, silu=False):
        x = torch.zeros(m, 2 * k if silu else k, dtype=dtype)
        w = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
        b = torch.zeros(n, dtype=dtype) if bias else None
        counters = torch.zeros(-(-n // module.MIN_BLOCK_N), dtype=torch.int32)
        module.fp8_skinny_linear_triton(x, w, torch.ones(n), b, counters, config, silu)

    launches = 0
    for name, n, k in FP8_LINEARS + ENGINE_SHAPES:
        for m in (1, 2, 16):
            call(m, n, k)
            launches += 1
            if name.endswith("down"):
                call(m, n, k, silu=True)
                launches += 1
            if (n, k) == (4096, 4096):
                for dtype in (torch.float16, torch.float32):
                    call(m, n, k, dtype)
                call(m, n, k, bias=True)
                launches += 3
    for _, n, k in FP8_LINEARS:
        for m in (1, 16):
            for cfg in w8a16_configs(m, n, k, H200_SMS, on_cpu=False):
                call(m, n, k, config=cfg)
                launches += 1
    for m, n, k in TEST_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            for split in (1, 3):
                call(m, n, k, dtype, bias=split == 1, config=dict(SPLIT_K=split))
                launches += 1
    call(1, 96, 64, bias=True, config=dict(DOT=True, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2, SPLIT_K=2))
    return launches + 1


def sass_of(cubin: bytes, tool: str) -> list[tuple[int, str]]:
    """(address, instruction) of a cubin's SASS."""
    path = Path("/tmp/fp8_linear_sass.cubin")
    path.write_bytes(cubin)
    text = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    found = (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in text.splitlines())
    return [(int(m.group(1), 16), m.group(2).strip()) for m in found if m]


def loop_stats(ins: list[tuple[int, str]]) -> dict:
    """Every backward branch's loop size; the largest loop (the K loop) by instruction class."""
    loops = []
    for addr, text in ins:
        target = re.search(r"BRA (?:`\(\.L_x_\d+\) )?(0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    if not loops:
        return dict(loops=[], loop_sass=0, mix={})
    start, end = max(loops, key=lambda lo: lo[1] - lo[0])
    mix = collections.Counter()
    for addr, text in ins:
        if start <= addr <= end:
            op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
            mix[_op_class(op)] += 1
    return dict(loops=[(b - a) // 16 + 1 for a, b in loops], loop_sass=(end - start) // 16 + 1, mix=dict(mix))


def _op_class(op: str) -> str:
    classes = [
        ("global ld", ("LDG", "LDGSTS")),
        ("shared ld", ("LDS", "LDSM")),
        ("shared st", ("STS",)),
        ("convert", ("F2FP", "F2F", "I2F", "PRMT", "HADD2.F32")),
        ("ffma", ("FFMA", "FADD", "FMUL")),
        ("mma", ("HMMA", "HGMMA", "WARPGROUP")),
        ("barrier", ("BAR", "DEPBAR", "LDGDEPBAR")),
        ("local", ("LDL", "STL")),
    ]
    return next((name for name, prefixes in classes if op.startswith(prefixes)), "other")


def analyse(recorder, tools) -> list[dict]:
    """One row per compiled kernel: its constexprs, registers, spills, shared memory and K loop."""
    rows = []
    for kernel, consts, shapes in recorder.compiled.values():
        ins = sass_of(kernel.asm["cubin"], tools["cuobjdump"])
        usage = subprocess.run(
            [tools["cuobjdump"], "--dump-resource-usage", "/tmp/fp8_linear_sass.cubin"], capture_output=True, text=True
        ).stdout
        regs = re.search(r"REG:(\d+)", usage)
        stats = loop_stats(ins)
        weight_kib = consts["BLOCK_N"] * consts["BLOCK_K"] / 1024
        rows.append(
            dict(
                consts,
                signature={k: v for k, v in kernel.src.signature.items() if v != "constexpr"},
                constants={str(k): v for k, v in kernel.src.constants.items()},
                shapes=shapes,
                registers=int(regs.group(1)) if regs else None,
                local_ops=sum(1 for _, t in ins if re.search(r"\b(LDL|STL)\b", t)),
                shared_bytes=kernel.metadata.shared,
                sass=len(ins),
                **stats,
                sass_per_kib=stats["loop_sass"] * consts["num_warps"] / weight_kib,
            )
        )
    return rows


COLUMNS = (
    *("x", "M", "DOT", "BLOCK_N x K", "warps", "stages", "split", "EVEN_K", "bias", "silu", "regs", "spill ops"),
    *("shared B", "K loop SASS", "warp SASS / KiB", "loop mix", "launched for (M N K)"),
)


def table(rows: list[dict]) -> list[str]:
    """One markdown line per compiled kernel, by tile; M shows 1 where Triton specialized it to a constant."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    key = lambda r: (r["DOT"], r["BLOCK_N"], r["BLOCK_K"], r["num_warps"], r["NUM_STAGES"], r["SPLIT"], r["SILU"])  # noqa: E731
    for r in sorted(rows, key=key):
        mix = ", ".join(f"{k} {v}" for k, v in sorted(r["mix"].items(), key=lambda kv: -kv[1]))
        cells = [
            r["signature"]["x_ptr"][1:],
            r["constants"].get("(7,)", "M"),
            r["DOT"],
            f"{r['BLOCK_N']} x {r['BLOCK_K']}",
            *(
                r[c]
                for c in ("num_warps", "NUM_STAGES", "SPLIT", "EVEN_K", "HAS_BIAS", "SILU", "registers", "local_ops")
            ),
            *(r[c] for c in ("shared_bytes", "loop_sass")),
            f"{r['sass_per_kib']:.0f}",
            mix,
            _shapes(r["shapes"]),
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def _shapes(shapes: list[tuple]) -> str:
    listed = " ".join(f"({m} {n} {k})" for m, n, k in shapes[:3])
    return listed + (f" +{len(shapes) - 3}" if len(shapes) > 3 else "")


def main(argv: list[str] | None = None) -> int:
    import triton

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    from splitserve.kernels import fp8_skinny_linear as module

    with compile_only(module, args.arch) as recorder:
        launches = launch_all(module)
    tools = {"cuobjdump": triton.knobs.nvidia.cuobjdump.path}
    rows = analyse(recorder, tools)
    print(f"triton {triton.__version__}, sm_{args.arch}: {launches} launches, {len(rows)} distinct kernels compiled")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(triton=triton.__version__, arch=args.arch, kernels=rows), indent=1))
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
