"""Traces over real OTLP/gRPC from the prefill and decode processes, parented across processes."""

import asyncio
import os

import pytest

from splitserve.protos import common_pb2, prefill_pb2
from tests.model_factory import make_tiny_model_dir
from tests.otlp_receiver import Receiver
from tests.service_client import DecodeSession, decode_request, prefill_stub
from tests.service_harness import start_service, wait_until

pytestmark = pytest.mark.slow
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT}-01"


@pytest.mark.parametrize("transport", ["shm", "nccl"])
def test_one_trace_per_request_across_prefill_transfer_and_decode(transport, tmp_path):
    receiver = Receiver()
    model = make_tiny_model_dir(tmp_path, "llama", name="traced")
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true"}
    os.environ.update(env)
    try:
        prefill, p_addr = start_service(
            "prefill", model, tmp_path, "p-traced", service_args=["--kv-transport", transport]
        )
        decode, d_addr = start_service(
            "decode", model, tmp_path, "d-traced", service_args=["--kv-transport", transport, "--prefill-peers", p_addr]
        )
    finally:
        for key in env:
            os.environ.pop(key)
    try:
        prefill.wait_ready()
        decode.wait_ready()

        async def main():
            sampling = common_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            prompt = list(range(10, 31))
            first = await prefill_stub(p_addr).Prefill(
                prefill_pb2.PrefillRequest(request_id="t1", prompt_token_ids=prompt, sampling=sampling),
                metadata=(("traceparent", TRACEPARENT),),
            )
            session = DecodeSession(d_addr)
            session.submit(decode_request(first, "t1", prompt, sampling, trace_context={"traceparent": TRACEPARENT}))
            await session.collect("t1")
            await session.close()

        asyncio.run(main())
        wanted = {"prefill", "prefill.queue", "prefill.compute", "decode", "kv.transfer"}
        if transport == "nccl":
            wanted.add("kv.send")
        wait_until(
            lambda: wanted <= {s["name"] for s in receiver.spans},
            10,
            lambda: f"spans {sorted(wanted)} exported; got {sorted({s['name'] for s in receiver.spans})}",
            poll_s=0.1,
        )
        spans = {s["name"]: s for s in receiver.spans}
        assert {s["trace_id"] for s in receiver.spans} == {TRACE_ID}  # one trace
        assert spans["prefill"]["parent"] == PARENT and spans["decode"]["parent"] == PARENT
        assert spans["prefill.queue"]["parent"] == spans["prefill"]["span_id"]
        assert spans["prefill.compute"]["parent"] == spans["prefill"]["span_id"]
        assert spans["kv.transfer"]["parent"] == spans["decode"]["span_id"]
        assert spans["kv.transfer"]["attributes"]["kv.blocks"] == 6  # 21 tokens in blocks of 4
        assert spans["kv.transfer"]["attributes"]["kv.transport"] == transport
        assert spans["prefill"]["service"] == "splitserve-prefill" and spans["decode"]["service"] == "splitserve-decode"
        if transport == "nccl":
            assert spans["kv.send"]["parent"] == spans["decode"]["span_id"]
    finally:
        prefill.stop()
        decode.stop()
        receiver.stop()


def test_rest_request_is_one_trace_from_gateway_to_decode(tmp_path):
    """traceparent from a REST caller → the call's one SERVER span → request span → prefill, kv.transfer,
    decode, stream."""
    import httpx

    from tests.service_harness import Stack

    receiver = Receiver()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true"}
    os.environ.update(env)
    try:
        stack = Stack("shm", tmp_path, num_decode=1)
    finally:
        for key in env:
            os.environ.pop(key)
    try:
        r = httpx.post(
            f"http://127.0.0.1:{stack.http_port}/v1/completions",
            headers={"traceparent": TRACEPARENT},
            json={"prompt": "def fibonacci(n):", "max_tokens": 5, "temperature": 0},
            timeout=30,
        )
        assert r.status_code == 200
        wanted = {
            "POST /v1/completions",
            "request",
            "gateway.prefill",
            "gateway.stream",
            "prefill",
            "prefill.queue",
            "prefill.compute",
            "decode",
            "kv.transfer",
        }
        wait_until(
            lambda: wanted <= {s["name"] for s in receiver.spans},
            10,
            lambda: f"spans {sorted(wanted)} exported; got {sorted({s['name'] for s in receiver.spans})}",
            poll_s=0.1,
        )
        spans = {s["name"]: s for s in receiver.spans if s["trace_id"] == TRACE_ID}
        assert wanted <= set(spans), sorted(spans)
        call = spans["POST /v1/completions"]
        assert call["parent"] == PARENT and call["service"] == "splitserve-gateway" and call["kind"] == 2  # SERVER
        assert [s["name"] for s in receiver.spans if s["service"] == "splitserve-gateway" and s["kind"] == 2] == [
            "POST /v1/completions"
        ]  # one SERVER span at the gateway per call
        assert spans["request"]["parent"] == call["span_id"] and spans["request"]["kind"] == 1  # INTERNAL
        assert spans["gateway.prefill"]["parent"] == spans["request"]["span_id"]
        assert spans["prefill"]["parent"] == spans["gateway.prefill"]["span_id"]
        assert spans["decode"]["parent"] == spans["request"]["span_id"]
        assert spans["gateway.stream"]["parent"] == spans["request"]["span_id"]
        assert spans["kv.transfer"]["parent"] == spans["decode"]["span_id"]
        assert len([s for s in receiver.spans if s["name"] == "request"]) == 1  # one trace per request
    finally:
        stack.stop()
        receiver.stop()
