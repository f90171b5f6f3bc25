"""How much of a run's wall time the GPU works: two measures of one engine run.

device_activity the union of every device activity's [start, end) in a torch profiler trace (kernels,
                copies, memsets; graph replays are seen kernel by kernel), read straight from kineto's
                events (building FunctionEvents for ~10^6 kernels would take minutes). The profiler slows
                the host, so divide by the wall time of an unprofiled run of the same variant. Also each
                activity name's device seconds.
step_span_s     the sum, over launched steps, of the time between a CUDA event recorded before the step's
                first device work and one after its last: the device had the step's work in hand (idle
                gaps inside a step, when the host launches eager kernels slower than they run, count in).
HostSplit       where the host's time goes, phase by phase (see the class).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def device_activity(fn: Callable[[], object]) -> tuple[float, dict[str, float]]:
    """Seconds in which the device ran anything while `fn` ran (the union of activity intervals), and the device
    seconds of each activity's name (kernels, copies, memsets)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA]
    by_name: dict[str, float] = {}
    for e in events:
        by_name[e.name()] = by_name.get(e.name(), 0.0) + (e.end_ns() - e.start_ns()) / 1e9
    busy = 0
    run_start, run_end = None, None
    for start, end in sorted((e.start_ns(), e.end_ns()) for e in events):
        if run_end is None or start > run_end:
            if run_end is not None:
                busy += run_end - run_start
            run_start, run_end = start, end
        else:
            run_end = max(run_end, end)
    if run_end is not None:
        busy += run_end - run_start
    return busy / 1e9, by_name


class StepSpans:
    """Wraps `runner.launch` to record a CUDA event before and after each step's device work."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.events: list[tuple] = []
        self._launch = runner.launch

    def __enter__(self) -> StepSpans:
        import torch

        def launch(out, tables):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            launched = self._launch(out, tables)
            end.record()
            self.events.append((start, end))
            return launched

        self.runner.launch = launch
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.launch  # the instance attribute goes; the class's method shows again

    def total_s(self) -> float:
        import torch

        torch.cuda.synchronize()
        return sum(start.elapsed_time(end) for start, end in self.events) / 1e3


class HostSplit:
    """Where the host's wall time goes in an engine run: wall-clock sums of the step's phases (schedule, launch,
    waiting for the device, reading a step, building outputs), the garbage collector's pauses, and the rest
    (the caller's loop). Wraps the methods for the duration of a `with` block."""

    PHASES = ("schedule", "launch", "device_wait", "read", "outputs", "gc")

    def __init__(self, engine) -> None:
        self.engine = engine
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self._gc_start = 0.0

    def _timed(self, name: str, fn):
        seconds = self.seconds

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start

        return timed

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.seconds["gc"] += time.perf_counter() - self._gc_start

    def __enter__(self) -> HostSplit:
        import gc

        from splitserve.engine.worker.model_runner import LaunchedStep

        engine, seconds = self.engine, self.seconds
        engine.scheduler.schedule = self._timed("schedule", engine.scheduler.schedule)
        engine.runner.launch = self._timed("launch", engine.runner.launch)
        engine.scheduler.update_from_output = self._timed("read", engine.scheduler.update_from_output)
        engine._outputs = self._timed("outputs", engine._outputs)
        self._read = LaunchedStep.read

        def read(launched):
            if launched.done is not None:
                start = time.perf_counter()
                launched.done.synchronize()
                seconds["device_wait"] += time.perf_counter() - start
            return self._read(launched)

        LaunchedStep.read = read
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc) -> None:
        import gc

        from splitserve.engine.worker.model_runner import LaunchedStep

        for owner, name in (
            (self.engine.scheduler, "schedule"),
            (self.engine.runner, "launch"),
            (self.engine.scheduler, "update_from_output"),
            (self.engine, "_outputs"),
        ):
            delattr(owner, name)
        LaunchedStep.read = self._read
        gc.callbacks.remove(self._on_gc)
