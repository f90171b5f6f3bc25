"""What else runs on this (shared) machine while a benchmark does, from /proc (Linux only).

`OthersLoad` samples, on a thread, the machine's busy CPU seconds less those of this process and its
descendants (a vLLM subprocess and its engine process included); `share(t0, t1)` is the fraction of
the machine's cores the other processes kept busy between two `time.time()` stamps. `wait_for_quiet`
blocks (bounded) until the others have used less than a given share for a few seconds in a row.

Why: on a shared 2-core machine other jobs can take most of the cores, and an engine whose
threads meet at a barrier per op loses far more than the stolen share (a run took 5 s alone and 98 s
beside 76% of other load). A ratio between two engines means little unless both ran on a quiet machine,
so the benchmark tables report this share beside each run.
"""

from __future__ import annotations

import os
import threading
import time

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds all cores have spent busy since boot (everything but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) * _TICK_S


def _proc_stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds used) of a live process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
    return int(fields[1]), (int(fields[11]) + int(fields[12])) * _TICK_S


def process_tree(root: int) -> tuple[set[int], dict[int, tuple[int, float]]]:
    """`root` and its live descendants' pids, and every live process's (parent pid, CPU seconds)."""
    stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _proc_stat(int(p))) is not None}
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (ppid, _) in stats.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    return tree, stats


def tree_cpu_s(root: int, seen: dict[int, float]) -> float:
    """CPU seconds of `root` and its live descendants, added to `seen` (pid -> last reading) so that a
    process that exits keeps counting with its last reading."""
    tree, stats = process_tree(root)
    for pid in tree:
        if pid in stats:
            seen[pid] = stats[pid][1]
    return sum(seen.values())


class OthersLoad:
    """Background sampler: (time.time(), the others' busy CPU seconds so far) every `interval_s`."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self._seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="others-load", daemon=True)

    def _sample(self) -> tuple[float, float]:
        return time.time(), machine_busy_s() - tree_cpu_s(os.getpid(), self._seen)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self._sample())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> OthersLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def share(self, t0: float, t1: float) -> float:
        """Mean share of the machine's cores the others used from t0 to t1 (NaN without two samples)."""
        inside = [s for s in self.samples if t0 - self.interval_s <= s[0] <= t1 + self.interval_s]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return float("nan")
        (a_t, a_cpu), (b_t, b_cpu) = inside[0], inside[-1]
        return max(0.0, b_cpu - a_cpu) / ((b_t - a_t) * os.cpu_count())


def wait_for_quiet(max_share: float, hold_s: float = 5.0, timeout_s: float = 600.0) -> float:
    """Wait until the other processes used under `max_share` of the machine for `hold_s` seconds in a row,
    at most `timeout_s`; returns the seconds waited (the caller reports a run that started anyway)."""
    seen: dict[int, float] = {}
    start = time.monotonic()
    quiet_since = None
    t_prev, cpu_prev = time.time(), machine_busy_s() - tree_cpu_s(os.getpid(), seen)
    while time.monotonic() - start < timeout_s:
        time.sleep(1.0)
        t, cpu = time.time(), machine_busy_s() - tree_cpu_s(os.getpid(), seen)
        share = (cpu - cpu_prev) / ((t - t_prev) * os.cpu_count())
        t_prev, cpu_prev = t, cpu
        quiet_since = (quiet_since or t) if share < max_share else None
        if quiet_since is not None and t - quiet_since >= hold_s:
            break
    return time.monotonic() - start
