"""A request's grammar never stalls other streams: the first structured output spec an engine sees (xgrammar and
the model's tokenizer loaded for it) and a spec that leads to a dead end are handled off the services' event loops
and the engine cores' step loops, so a caller decoding meanwhile keeps its pace."""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest

from tests.service_harness import Stack, wait_until

pytestmark = pytest.mark.slow


class Caller:
    """Another caller: streamed 64-token completions one after another, on a thread of its own. Each request's
    token arrival times (time.monotonic())."""

    def __init__(self, url: str) -> None:
        self.url, self.requests, self.statuses = url, [], []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        body = {"prompt": "the other caller", "max_tokens": 64, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                arrivals = []
                self.requests.append(arrivals)
                with client.stream("POST", self.url, json=body) as r:
                    self.statuses.append(r.status_code)
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            arrivals.append(time.monotonic())

    def decode_gaps(self, start: float, end: float) -> list[float]:
        """Gaps between a request's consecutive tokens from its second on (the decode's steps; the first token
        comes from the prefill, the second after the KV moved), those ending in [start, end]."""
        return [
            b - a for arrivals in self.requests for a, b in zip(arrivals[1:], arrivals[2:]) if start <= b and a <= end
        ]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(120)


@pytest.fixture
def stack(tmp_path):
    # the prefill compiles on a thread of its core, with no trial in a worker process to wait for (a worker
    # imports torch: seconds): the test's time goes to the decode, where the other caller's tokens come from
    stack = Stack("shm", tmp_path, num_decode=1, prefill_args=["--structured-output-compile-workers", "0"])
    yield stack
    stack.stop()


def test_the_first_dead_end_grammar_does_not_stall_another_callers_stream(stack):
    url = f"http://127.0.0.1:{stack.http_port}/v1/completions"
    caller = Caller(url)
    try:
        wait_until(lambda: len(caller.requests) >= 2, 60, "the other caller's first request did not end")
        # the engines' first spec: the regex admits "a", then no token at all (an empty class), so its request
        # ends with an error at the decode, after the first token the prefill sampled
        start = time.monotonic()
        r = httpx.post(url, json={"prompt": "x", "max_tokens": 8, "guided_regex": "a[^\\s\\S]"}, timeout=120)
        end = time.monotonic()
        assert r.status_code == 500, r.text
        assert "the grammar allows no token after 1 output tokens" in r.json()["error"]["message"], r.text
    finally:
        caller.close()
    assert set(caller.statuses) == {200}
    before = caller.decode_gaps(0, start)
    during = caller.decode_gaps(start, end)
    # the bound derives from this run's own pace: a step at 20 times the median before is a stall
    bound = max(20 * statistics.median(before), 0.5)
    print(
        f"grammar request {end - start:.1f} s; median gap before {statistics.median(before):.3f} s; "
        f"max during {max(during):.2f} s over {len(during)} gaps; bound {bound:.2f} s"
    )
    assert max(during) <= bound, (max(during), bound, sorted(during)[-5:])
