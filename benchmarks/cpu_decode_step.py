"""One decode step's time against its rows on CPU, the sampler's draws in C++ (the engine's) or in torch ops.

    python benchmarks/cpu_decode_step.py [--batches 1,64,128,256] [--steps 30] [--json out.json]

An engine of the default model (one torch thread, as `splitserve up` gives each engine on 2 cores) runs B sampled
sequences (temperature 1, 8-token prompts, ignore_eos) with --max-num-seqs B; after 3 steps, each of --steps
steps is timed: wall and the process's CPU time (on a shared machine CPU time is the step's cost, wall is what a
request waits). `torch` rows run the sampler's counter-based draws through its torch path
(`sampler.random_uniform_torch`, the reference the C++ op equals bit for bit), as before the op. Both variants
alternate per batch size, so the machine's load hits them alike. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from splitserve.common.config import EngineConfig
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.worker import sampler

VARIANTS = ("c++", "torch")


def time_steps(batch: int, num_steps: int, variant: str) -> dict:
    lookup = sampler.cpu_ops_for
    if variant == "torch":
        sampler.cpu_ops_for = lambda *args, **kwargs: None  # the torch draws: what the engine ran before the op
    core = EngineCore(EngineConfig(device="cpu", num_threads=1, max_num_seqs=batch))
    try:
        rng = random.Random(1)
        params = SamplingParams(max_tokens=num_steps + 8, ignore_eos=True)
        for i in range(batch):
            core.add_request(f"r{i}", [rng.randrange(3, 8192) for _ in range(8)], params)
        for _ in range(3):  # the prompts, then decode steps
            core.step()
        wall, cpu = [], []
        for _ in range(num_steps):
            start, start_cpu = time.perf_counter(), time.process_time()
            core.step()
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    finally:
        core.close()
        sampler.cpu_ops_for = lookup
    cpu_ms = statistics.median(cpu) * 1e3
    return {
        "batch": batch,
        "variant": variant,
        "wall_ms_median": round(statistics.median(wall) * 1e3, 1),
        "cpu_ms_median": round(cpu_ms, 1),
        "tok_s_by_cpu": round(batch / cpu_ms * 1e3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64,128,256")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", default="cpu_decode_step.json")
    args = ap.parse_args()
    load = [round(os.getloadavg()[0], 2)]
    rows = [time_steps(int(b), args.steps, v) for b in args.batches.split(",") for v in VARIANTS]
    load.append(round(os.getloadavg()[0], 2))
    print(f"load average (1 min) before / after: {load}")
    print(f"{'rows':>5} {'draws':<6} {'wall ms':>8} {'CPU ms':>7} {'tok/s by CPU':>13}")
    for r in rows:
        cells = f"{r['wall_ms_median']:>8} {r['cpu_ms_median']:>7} {r['tok_s_by_cpu']:>13}"
        print(f"{r['batch']:>5} {r['variant']:<6} {cells}")
    Path(args.json).write_text(json.dumps({"load": load, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
