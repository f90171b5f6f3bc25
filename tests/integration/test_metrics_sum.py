"""Metrics that add up: after N requests through a real disaggregated stack (gateway, prefill, decode as
processes), the sum of every process's /metrics holds exactly N finished requests and exactly the prompt and
generated tokens the clients were told of, in vLLM's families and in the gateway's own; no fact twice."""

import json
import re

import httpx
import pytest

from tests.gateway_fakes import parse_metrics
from tests.service_harness import Stack, free_port, wait_until

pytestmark = pytest.mark.slow
SERVED = "served-first"


@pytest.fixture(scope="module", params=[1, 2], ids=["one-gateway-process", "api-server-count-2"])
def stack(tmp_path_factory, request):
    """With --api-server-count 2 the gateway's /metrics, whichever process answers, holds both processes'."""
    prefill_port, decode_port = free_port(), free_port()
    served = ["--served-model-name", f"{SERVED},default_model"]  # requests name the model by its second name
    count = request.param
    s = Stack(
        "shm",
        tmp_path_factory.mktemp("metrics-sum"),
        num_decode=1,
        prefill_args=["--metrics-port", str(prefill_port), *served],
        decode_args=["--metrics-port", str(decode_port), *served],
        gateway_more=[*served, *(["--api-server-count", str(count)] if count > 1 else [])],
    )
    if count > 1:  # /ready answered by one process: wait until each has found both instances up
        log = s.procs["gateway"].log_path
        wait_until(
            lambda: (
                log.read_text().count("gateway up:") == count and log.read_text().count(" is up (role ") == 2 * count
            ),
            60,
            lambda: f"{count} gateway processes up; log:\n{log.read_text()[-3000:]}",
        )
    s.metrics_urls = [
        f"http://127.0.0.1:{s.http_port}/metrics",
        f"http://127.0.0.1:{prefill_port}/metrics",
        f"http://127.0.0.1:{decode_port}/metrics",
    ]
    yield s
    s.stop()


def summed(urls) -> dict[str, float]:
    """Sample name -> its values summed over every label set of every process."""
    out: dict[str, float] = {}
    for url in urls:
        for (name, _), value in parse_metrics(httpx.get(url, timeout=5).text).items():
            out[name] = out.get(name, 0.0) + value
    return out


def test_every_process_summed_counts_each_request_and_token_once(stack):
    base = f"http://127.0.0.1:{stack.http_port}"
    before = summed(stack.metrics_urls)
    assert before["vllm:request_success_total"] == 0 and before["vllm:prompt_tokens_total"] == 0
    bodies = [
        ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}),
        ("/v1/completions", {"prompt": "one two three", "max_tokens": 1, "temperature": 0}),  # ends at the prefill
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "n": 2}),  # one request, 2 seqs
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
        ("/v1/completions", {"prompt": "a b c d e f", "max_tokens": 3, "stream": True}),
    ]
    prompt_tokens = generated = 0
    for path, body in bodies:
        body = {"model": "default_model", **body}
        if body.get("stream"):
            body["stream_options"] = {"include_usage": True}
            with httpx.stream("POST", base + path, json=body, timeout=60) as r:
                assert r.status_code == 200
                usage = json.loads([line for line in r.iter_lines() if '"usage":{' in line][-1][6:])["usage"]
        else:
            r = httpx.post(base + path, json=body, timeout=60)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
        prompt_tokens += usage["prompt_tokens"]
        generated += usage["completion_tokens"]
    after = summed(stack.metrics_urls)
    n = len(bodies)
    assert after["vllm:request_success_total"] == n
    assert after["vllm:prompt_tokens_total"] == prompt_tokens
    assert after["vllm:generation_tokens_total"] == generated
    assert after["vllm:request_prompt_tokens_count"] == n and after["vllm:request_prompt_tokens_sum"] == prompt_tokens
    assert after["vllm:request_generation_tokens_count"] == n
    assert after["vllm:request_generation_tokens_sum"] == generated
    assert after["vllm:request_params_n_sum"] == n + 1
    assert after["vllm:e2e_request_latency_seconds_count"] == n
    assert after["splitserve:gateway_request_success_total"] == n
    assert after["splitserve:gateway_prompt_tokens_total"] == prompt_tokens
    assert after["splitserve:gateway_generation_tokens_total"] == generated
    assert after["vllm:iteration_tokens_total_sum"] >= prompt_tokens + generated - n  # recomputes only add
    # every process labels its metrics with the first served name, as vLLM does
    texts = [httpx.get(url, timeout=5).text for url in stack.metrics_urls]
    assert [set(re.findall(r'model_name="([^"]*)"', text)) for text in texts] == [{SERVED}] * 3
