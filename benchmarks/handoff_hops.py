"""Where a hand-off's time goes, hop by hop: `disagg_handoff.py` run with the hop probe (`hop_probe/`) in its
services and cores, then each request's hops from the probe's timestamps, medians over the requests (the first
left out: it maps the pool and warms up).

    python benchmarks/handoff_hops.py -- --config benchmarks/configs/llama-tiny-cpu.json --dtype float32 \
        --prefill-device cpu --decode-device cpu --transports shm --prompt-len 2048 --num-prompts 12 \
        --max-tokens 4 --max-model-len 2304 --num-kv-blocks 1024

Everything after `--` goes to disagg_handoff.py (one mapped-pool transport: shm or cuda_ipc; sequential pacing).
The hops, each from the one before: the decode service admits the request; sends the ImportKv down its pipe; the
core takes it in; queues the pull on a transfer lane; the lane's worker starts the copy and ends it; the core
hears of the end and commits the import; the first step after the commit starts and ends (with asynchronous
scheduling the request's token comes out of the step after); the core writes its outputs to the pipe; the service
reads the first token. `client` is the rest of the hand-off the benchmark measured: the client's Decode call reaching
the service, and the first delta going back. The probe adds about 2 us per hop.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
HOPS = (
    "service_admit",
    "service_import_sent",
    "core_import_received",
    "core_pull_queued",
    "pull_start",
    "pull_end",
    "core_pull_reported",
    "core_committed",
    "step_start",
    "step_end",
    "step_with_token_end",
    "core_flush",
    "service_first_output",
)


def read_logs(probe_dir: Path) -> list[tuple[int, str, str, str]]:
    """(ns, event, argument, process log) of every probe line, in time order."""
    events = []
    for path in probe_dir.glob("*.log"):
        for line in path.read_text().splitlines():
            ns, event, arg = (line.split(" ", 2) + [""])[:3]
            events.append((int(ns), event, arg, path.name))
    return sorted(events)


def request_hops(events, request_id: str) -> dict[str, int] | None:
    """The time of each hop of one request (None: the probe missed it, e.g. a pull that never ran)."""
    times: dict[str, int] = {}
    for ns, event, arg, _ in events:
        if arg == request_id and event not in times:
            times[event] = ns
    if "service_admit" not in times or "core_committed" not in times:
        return None
    core = next(log for _, event, arg, log in events if event == "core_committed" and arg == request_id)
    after = [(ns, event, arg) for ns, event, arg, log in events if log == core and ns >= times["core_committed"]]
    times["step_start"] = next((ns for ns, event, _ in after if event == "step_start"), None)
    times["step_end"] = next((ns for ns, event, _ in after if event == "step_end"), None)
    times["step_with_token_end"] = next(
        (ns for ns, event, arg in after if event == "step_end" and request_id in arg.split(",")), None
    )
    token_end = times["step_with_token_end"]
    if token_end is not None:
        times["core_flush"] = next((ns for ns, event, _ in after if event == "core_flush" and ns >= token_end), None)
    return times if all(times.get(hop) is not None for hop in HOPS) else None


def summarize(events, handoffs: dict[str, float]) -> dict:
    rows = {rid: hops for rid in list(handoffs)[1:] if (hops := request_hops(events, rid)) is not None}
    if not rows:
        raise SystemExit("the probe recorded no complete hand-off (is the transport shm or cuda_ipc?)")
    out = {"requests": len(rows), "hops_ms": {}}
    for before, hop in zip(HOPS, HOPS[1:]):
        out["hops_ms"][hop] = statistics.median((r[hop] - r[before]) / 1e6 for r in rows.values())
    inside = [(r["service_first_output"] - r["service_admit"]) / 1e6 for r in rows.values()]
    out["service_to_service_ms"] = statistics.median(inside)
    out["handoff_ms"] = statistics.median(handoffs[rid] for rid in rows)
    out["hops_ms"]["client"] = statistics.median(handoffs[rid] - s for rid, s in zip(rows, inside))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="", help="write the hops here")
    ap.add_argument("handoff_args", nargs=argparse.REMAINDER, help="-- then disagg_handoff.py's arguments")
    args = ap.parse_args()
    passed = args.handoff_args[1:] if args.handoff_args[:1] == ["--"] else args.handoff_args
    with tempfile.TemporaryDirectory(prefix="hops-") as tmp:
        probe_dir, result = Path(tmp) / "probe", Path(tmp) / "handoff.json"
        probe_dir.mkdir()
        env = dict(os.environ, HOP_PROBE_DIR=str(probe_dir))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE / "hop_probe"), env.get("PYTHONPATH")) if p)
        command = [sys.executable, str(HERE / "disagg_handoff.py"), *passed, "--json", str(result)]
        subprocess.run(command, env=env, check=True)
        runs = json.loads(result.read_text())["transports"]
        if len(runs) != 1:
            raise SystemExit("run one transport and one variant: the hops of several would mix")
        handoffs = {r["request_id"]: r["handoff_ms"] for r in runs[0]["requests"]}
        out = summarize(read_logs(probe_dir), handoffs)
    print(f"\n{runs[0]['transport']}: {out['requests']} requests, hand-off median {out['handoff_ms']:.2f} ms")
    print(f"{'hop (from the one before)':<28}{'median ms':>10}")
    for hop, ms in out["hops_ms"].items():
        print(f"{hop:<28}{ms:>10.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
