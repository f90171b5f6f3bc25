"""Where `splitserve up` runs each engine process and how KV moves between them (`place`), and how many torch
threads each engine on the CPU gets.

No GPU (or --device cpu) -> every process on the CPU, KV over shm; one GPU -> the prefills and the decodes share
cuda:0, each allowed an equal part of --kv-cache-memory-fraction, KV over cuda_ipc; several GPUs -> the prefills
on cuda:0, the decodes on the others, cuda_ipc. --prefill-device / --decode-device and --kv-transport override it;
a transport the placement cannot run is refused before anything starts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass

from splitserve.common.nixl_package import nixl_missing
from splitserve.gateway.config import UpConfig


@dataclass(frozen=True)
class Placement:
    """Where each engine process runs and how KV moves between them."""

    prefill_device: str
    decode_devices: tuple[str, ...]
    kv_transport: str
    memory_fraction: dict[str, float]  # CUDA device -> each of its processes' --kv-cache-memory-fraction
    num_prefill: int = 1  # prefill instances, all on prefill_device

    def fraction_of(self, device: str) -> float | None:
        return self.memory_fraction.get(device)

    @property
    def engine_devices(self) -> list[str]:
        """The device of every engine process: the prefills', then the decodes'."""
        return [self.prefill_device] * self.num_prefill + list(self.decode_devices)

    def describe(self) -> list[str]:
        """One line per engine process, for the banner."""
        lines = []
        for name, device in [(f"prefill-{i}", self.prefill_device) for i in range(self.num_prefill)] + [
            (f"decode-{i}", d) for i, d in enumerate(self.decode_devices)
        ]:
            share = self.fraction_of(device)
            lines.append(f"  {name:<12} {device}" + (f" (memory fraction {share:g})" if share is not None else ""))
        return lines


def visible_gpus() -> int:
    """CUDA devices this machine offers, asked of torch in a child process (this one never imports torch);
    0 when torch sees none or cannot say."""
    if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidiactl"):
        return 0  # no NVIDIA driver: skip starting torch
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
        return int(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return 0


def _is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def place(device: str, fraction: float, up: UpConfig, num_gpus: int) -> Placement:
    """The placement for EngineConfig.device `device` on a machine with `num_gpus` GPUs (this module's docstring).
    Raises ValueError naming the flag when a choice cannot run."""
    if _is_cuda(device) and num_gpus == 0:
        raise ValueError(f"--device {device}, but no CUDA device is visible; use --device cpu (or auto)")
    if device.startswith("cuda:") and int(device.split(":")[1]) >= num_gpus:
        raise ValueError(f"--device {device}, but {num_gpus} CUDA device(s) are visible")
    if device == "cpu" or num_gpus == 0:
        prefill, decodes = "cpu", ["cpu"] * up.num_decode
    elif device.startswith("cuda:"):
        prefill, decodes = device, [device] * up.num_decode
    elif num_gpus == 1:
        prefill, decodes = "cuda:0", ["cuda:0"] * up.num_decode
    else:
        prefill, decodes = "cuda:0", [f"cuda:{1 + i % (num_gpus - 1)}" for i in range(up.num_decode)]
    prefill = up.prefill_device or prefill
    if up.decode_device:
        listed = [d.strip() for d in up.decode_device.split(",")]
        if len(listed) not in (1, up.num_decode):
            raise ValueError(
                f"--decode-device lists {len(listed)} devices for {up.num_decode} decodes: give one, or one per decode"
            )
        decodes = listed * up.num_decode if len(listed) == 1 else listed
    for flag, d in [("--prefill-device", prefill)] + [("--decode-device", d) for d in decodes]:
        if d != "cpu" and not (d.startswith("cuda:") and d[5:].isdigit() and int(d[5:]) < num_gpus):
            raise ValueError(f"{flag} {d}: choose cpu or cuda:N with N < {num_gpus} (the CUDA devices visible)")
    transport = up.kv_transport if up.kv_transport != "auto" else ("cuda_ipc" if _is_cuda(prefill) else "shm")
    if transport == "shm" and _is_cuda(prefill):
        raise ValueError(f"--kv-transport shm needs the prefill's pool in host memory; the prefill runs on {prefill}")
    if transport == "cuda_ipc" and not all(_is_cuda(d) for d in [prefill, *decodes]):
        raise ValueError("--kv-transport cuda_ipc needs the prefill and every decode on CUDA devices")
    if transport == "nccl" and len({_is_cuda(d) for d in [prefill, *decodes]}) > 1:
        raise ValueError("--kv-transport nccl needs the prefill and the decodes all on CUDA or all on the CPU")
    if transport == "nixl" and (missing := nixl_missing()):
        raise ValueError(missing)
    counts = Counter(d for d in [prefill] * up.num_prefill + decodes if _is_cuda(d))
    shares = {d: round(fraction / n, 4) for d, n in counts.items()}
    return Placement(prefill, tuple(decodes), transport, shares, up.num_prefill)


def usable_cpus() -> int:
    """Cores this process (and so its children) may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_threads_per_engine(placement: Placement, num_cpus: int) -> int:
    """Torch threads for each engine process on the CPU: an equal share of the cores, at least one; 0 when none
    runs on the CPU. Why not torch's default (every core in each process): the prefill's and the decodes' OpenMP
    pools then outnumber the cores, and a pool waits for a thread the kernel has given to the other process
    (spinning meanwhile; docs/performance.md, "Findings that set defaults": CPU engine threads)."""
    num_cpu_engines = placement.engine_devices.count("cpu")
    return max(1, num_cpus // num_cpu_engines) if num_cpu_engines else 0
