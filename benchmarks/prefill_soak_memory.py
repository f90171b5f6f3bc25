"""Where a prefill engine's memory goes over a long soak of mixed requests.

Runs an `EngineCore` with role prefill in this process (the default model on CPU, as `splitserve up` runs it)
and feeds it mixed requests one wave at a time: random prompt lengths, sampling settings, logprobs and
prompt_logprobs, some structured outputs, some aborted before their first token; every held request is
released as a decode's pull would. Every `--every` requests it records the process's RSS, the Python heap
(tracemalloc), the live objects by type (gc) and the engine's own tables, then prints a table, the top
tracemalloc growth between the second record and the last (the first covers warm-up), and writes JSON.

    python benchmarks/prefill_soak_memory.py [--requests 6600] [--every 600] [--json out.json] [--no-trace] [--malloc]

Python objects that keep growing point at a table that is never pruned; RSS growing while the Python heap
stays flat points at native memory (the allocator's arenas, torch's caches). --malloc tells those apart: glibc's
bytes in use, the freed bytes it keeps, and RssAnon after malloc_trim(0). A CPU engine keeps freed tensor memory
on purpose (worker/device_setup.keep_freed_memory: the next step reuses it instead of faulting pages in again), so the
kept bytes grow to the largest steps' activations and stop there; in use and RssAnon after a trim stay flat.
(tracemalloc's own tables grow with the run: read RSS from a --no-trace run.)
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import json
import random
import time
import tracemalloc
from pathlib import Path


def rss_mib() -> dict[str, float]:
    """VmRSS and its parts (anonymous: heaps and tensors; shmem: a shared-memory KV pool), MiB."""
    wanted = ("VmRSS", "RssAnon", "RssShmem")
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {name: round(int(fields[name].split()[0]) / 1024, 1) for name in wanted}


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def malloc_mib() -> dict[str, float]:
    """glibc's heap (every arena): bytes in use, bytes free but kept, bytes in mmapped chunks; then RssAnon after
    malloc_trim(0) hands the free pages back. Free-but-kept memory is the allocator's, not a leak."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    out = {
        "in_use": info.uordblks / 2**20,
        "free_kept": info.fordblks / 2**20,
        "mmapped": info.hblkhd / 2**20,
    }
    libc.malloc_trim(0)
    out["anon_after_trim"] = rss_mib()["RssAnon"]
    return {name: round(value, 1) for name, value in out.items()}


def engine_tables(engine) -> dict[str, int]:
    """Sizes of the engine's per-request tables (each should return to 0 between waves)."""
    kv, scheduler = engine.kv, engine.scheduler
    return {
        "held": len(engine.held),
        "requests": len(scheduler.requests),
        "req_blocks": len(kv.req_blocks),
        **{name: len(value) for name, value in vars(kv).items() if isinstance(value, dict) and name != "req_blocks"},
        "grammar_cache": len(getattr(engine.grammars, "_cache", ()) or ()),
    }


def mixed_params(rng: random.Random, index: int):
    from splitserve.common.sampling_params import SamplingParams
    from splitserve.common.structured_output import StructuredOutput

    values = dict(max_tokens=rng.randint(1, 64), temperature=rng.choice([0.0, 0.7, 1.0]), seed=index)
    if rng.random() < 0.3:
        values["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.15:
        values["prompt_logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.2:
        values["top_k"] = rng.randint(1, 50)
    if rng.random() < 0.1:
        values["structured_output"] = StructuredOutput(choice=[f"choice {rng.randint(0, 5)}", "other"])
    return SamplingParams(**values)


def run_wave(engine, rng: random.Random, start: int, size: int) -> None:
    """`size` requests at once; 5% aborted after the first step; every held one released."""
    ids = []
    for index in range(start, start + size):
        prompt = [rng.randrange(3, 8000) for _ in range(rng.randint(4, 900))]
        rid = f"soak-{index}"
        engine.add_request(rid, prompt, mixed_params(rng, index), seed=index)
        ids.append(rid)
    aborted = {rid for rid in ids if rng.random() < 0.05}
    first = True
    while engine.has_unfinished():
        engine.step()
        if first:
            for rid in aborted:
                engine.abort(rid)
            first = False
        for rid in list(engine.held):
            engine.release_kv(rid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=6600)
    parser.add_argument("--every", type=int, default=600)
    parser.add_argument("--wave", type=int, default=12, help="requests added at once")
    parser.add_argument("--json", default="prefill_soak_memory.json")
    parser.add_argument("--shm", action="store_true", help="the KV pool in shared memory, as the prefill's")
    parser.add_argument(
        "--malloc", action="store_true", help="at each record, glibc's heap in use / free, then RSS after a trim"
    )
    parser.add_argument("--no-trace", action="store_true", help="skip tracemalloc (it slows the run ~2x)")
    args = parser.parse_args()

    from splitserve.common.config import EngineConfig
    from splitserve.common.default_model_path import default_model_path
    from splitserve.engine.engine_core import EngineCore

    config = EngineConfig(model=str(default_model_path()), role="prefill", device="cpu", num_threads=1)
    factory = None
    if args.shm:  # the pool in shared memory, as the prefill service exports it for shm pulls
        from splitserve.engine.kv_connectors.shm_pool import SharedKvPool

        def factory(layout, num_blocks, device):
            pools.append(SharedKvPool.create(f"soak-{time.time_ns()}", layout, num_blocks))
            return pools[-1].tensor

    pools: list = []
    engine = EngineCore(config, kv_cache_factory=factory)
    rng = random.Random(0)
    rows, snapshots = [], []
    if not args.no_trace:
        tracemalloc.start(12)
    started = time.monotonic()
    done = 0
    while done < args.requests:
        run_wave(engine, rng, done, args.wave)
        done += args.wave
        if done % args.every < args.wave:
            gc.collect()
            types = collections.Counter(type(o).__name__ for o in gc.get_objects())
            row = {
                "requests": done,
                "s": round(time.monotonic() - started, 1),
                "rss_mib": rss_mib(),
                "malloc_mib": malloc_mib() if args.malloc else None,
                "py_heap_mib": round(tracemalloc.get_traced_memory()[0] / 2**20, 1) if not args.no_trace else None,
                "objects": sum(types.values()),
                "top_types": dict(types.most_common(8)),
                "tables": engine_tables(engine),
            }
            rows.append(row)
            print(
                f"{row['requests']:>7} {row['s']:>7} s  rss {row['rss_mib']} MiB  malloc {row['malloc_mib']} MiB  "
                f"py {row['py_heap_mib']} MiB  "
                f"objects {row['objects']:>8}  {row['tables']}",
                flush=True,
            )
            if not args.no_trace:
                snapshots.append(tracemalloc.take_snapshot())
    growth = []
    if len(snapshots) >= 3:
        for stat in snapshots[-1].compare_to(snapshots[1], "traceback")[:10]:
            growth.append(
                {
                    "size_diff_kib": round(stat.size_diff / 1024, 1),
                    "count_diff": stat.count_diff,
                    "where": stat.traceback.format()[-6:],
                }
            )
        print("\ntop Python heap growth since the second record:")
        for item in growth:
            print(f"  {item['size_diff_kib']:>9} KiB  {item['count_diff']:>7} blocks")
            for line in item["where"]:
                print("     ", line)
    for pool in pools:
        pool.close()
    Path(args.json).write_text(json.dumps({"rows": rows, "growth": growth}, indent=1))


if __name__ == "__main__":
    main()
