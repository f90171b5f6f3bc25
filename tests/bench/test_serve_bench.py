"""splitserve bench serve: exact statistics, loopback-only targets, accounting of every request, and a
real stack per mode (--launch) whose numbers must agree with each other exactly."""

import asyncio
import json
import math
import socket
import struct
import sys

import pytest

from splitserve.bench import serve
from splitserve.bench.serve_launch import LaunchPlan, launch_commands
from splitserve.bench.serve_load import (
    LengthDist,
    Progress,
    RequestSpec,
    arrival_times,
    check_loopback,
    make_workload,
    run_load,
)
from splitserve.bench.serve_stats import COMPLETED, RequestRecord, Slo, describe, percentile, summarize, token_gaps
from tests.service_harness import free_port

# -- statistics ---------------------------------------------------------------------------------


def test_percentile_interpolates_between_closest_ranks():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([10, 20], 75) == 17.5
    hundred = list(range(101))
    assert [percentile(hundred, q) for q in (0, 50, 90, 99, 100)] == [0, 50, 90, 99, 100]
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match=r"^percentile q must be in \[0, 100\], got 101$"):
        percentile([1], 101)


def test_describe_reports_milliseconds():
    d = describe([0.25, 0.5, 0.75, 1.0])
    assert (d["count"], d["mean"], d["p50"], d["max"]) == (4, 625.0, 625.0, 1000.0)
    assert d["p99"] == pytest.approx(992.5, abs=1e-9)
    empty = describe([])
    assert empty["count"] == 0 and all(math.isnan(empty[k]) for k in ("mean", "p50", "p90", "p99", "max"))


def test_token_gaps_spread_a_merged_message_over_its_tokens():
    ttft, itls = token_gaps(0.5, [(1.0, 1), (1.5, 1), (2.25, 3), (2.5, 0)])
    assert (ttft, itls) == (0.5, [0.5, 0.25, 0.25, 0.25])
    assert token_gaps(0.0, [(1.0, 2), (2.0, 1)]) == (1.0, [0.0, 1.0])  # 2nd token came with the first
    assert token_gaps(0.0, [(1.0, 0)]) == (None, [])


def _request_counts(summary: dict) -> tuple[int, ...]:
    """A summary's (planned, sent, completed, failed, cancelled, not sent) request counts."""
    keys = ("num_planned", "num_sent", "num_completed", "num_failed", "num_cancelled", "num_not_sent")
    return tuple(summary[k] for k in keys)


def _record(index, ttft, itls, received=4, asked=4, status=COMPLETED, prompt=10, error=""):
    r = RequestRecord(index, prompt, asked, 0.0, status=status, sent_s=0.0, error=error)
    if status == COMPLETED:
        r.ttft_s, r.itl_s, r.num_received = ttft, list(itls), received
        r.e2e_s = ttft + sum(itls)
    return r


def test_summarize_accounts_for_every_request_and_goodput():
    records = [
        _record(0, 0.125, [0.25, 0.25, 0.25]),  # TTFT ok, ITL p99 250 ms: misses ITL 200
        _record(1, 0.125, [0.125, 0.125, 0.125]),  # meets both
        _record(2, 0.5, [0.125, 0.125, 0.125]),  # TTFT 500 ms: misses
        _record(3, 0.125, [0.125], received=2),  # short: 2 of 4 tokens
        _record(4, 0, [], status="failed", error="gRPC UNAVAILABLE: down"),
        _record(5, 0, [], status="failed", error="gRPC UNAVAILABLE: down"),
        _record(6, 0, [], status="cancelled", error="cancelled at --max-seconds=5"),
        RequestRecord(7, 10, 4, 9.0),  # never sent
    ]
    records[1].resent_after = ["RemoteProtocolError"]
    records[4].resent_after = ["ReadError", "RemoteProtocolError"]
    s = summarize(records, 4.0, Slo(ttft_ms=200, itl_ms=200))
    assert [r.meets_slo for r in records] == [False, True, False, False, False, False, False, False]
    assert s["resent"] == {"ReadError": 1, "RemoteProtocolError": 2}
    assert _request_counts(s) == (8, 7, 4, 2, 1, 1)
    assert s["errors"] == {"gRPC UNAVAILABLE: down": 2, "cancelled at --max-seconds=5": 1}
    assert (s["output_tokens_asked"], s["output_tokens_received"], s["num_token_mismatch"]) == (28, 14, 1)
    assert (s["completed_prompt_tokens"], s["completed_output_tokens"]) == (40, 14)
    assert (s["request_throughput"], s["output_token_throughput"], s["total_token_throughput"]) == (1.0, 3.5, 13.5)
    assert s["goodput"] == {
        "slo_ttft_ms": 200,
        "slo_itl_ms": 200,
        "slo_tpot_ms": None,
        "num_met": 1,
        "share": 1 / 7,
        "rate": 0.25,
    }
    assert s["ttft_ms"]["count"] == 4 and s["itl_ms"]["count"] == 10 and s["tpot_ms"]["count"] == 4
    assert records[0].tpot_s == 0.25 and records[3].tpot_s == 0.125


def test_tpot_slo_replaces_the_itl_check():
    records = [_record(0, 0.125, [0.0, 0.0, 0.75]), _record(1, 0.125, [0.25, 0.25, 0.25])]
    s = summarize(records, 2.0, Slo(tpot_ms=250))  # TPOT 250 ms for both; ITL p99 of #0 is 735 ms
    assert [r.meets_slo for r in records] == [True, True] and s["goodput"]["share"] == 1.0
    with pytest.raises(ValueError, match=r"^duration_s must be > 0, got 0$"):
        summarize(records, 0, Slo())


# -- workload, targets, launch commands ------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "localhost", "::1", "[::1]"])
def test_loopback_hosts_are_accepted(host):
    assert check_loopback(host) == host


@pytest.mark.parametrize("host", ["10.0.0.1", "0.0.0.0", "::", "example.com", "192.168.1.20", "128.0.0.1"])
def test_other_hosts_are_refused(host):
    with pytest.raises(ValueError) as info:
        check_loopback(host)
    assert str(info.value) == (
        f"--host {host!r} is not a loopback address; splitserve bench serve only sends load to "
        "127.0.0.0/8, localhost or ::1"
    )


def test_cli_refuses_a_remote_host(capsys):
    assert serve.main(["--host", "10.1.2.3", "--num-requests", "1"]) == 2
    assert capsys.readouterr().err == (
        "splitserve bench serve: error: --host '10.1.2.3' is not a loopback address; "
        "splitserve bench serve only sends load to 127.0.0.0/8, localhost or ::1\n"
    )


def test_cli_names_an_unreachable_gateway(capsys):
    port = free_port()  # nothing listens there
    assert serve.main(["--api", "rest", "--http-port", str(port), "--num-requests", "1"]) == 1
    assert capsys.readouterr().err == (
        f"splitserve bench serve: cannot reach the gateway's REST API at http://127.0.0.1:{port}: "
        "ConnectError: All connection attempts failed\n"
    )


def test_workload_is_seeded_and_fits_the_context():
    prompts, outputs = LengthDist("longtail", 64, 1.5), LengthDist("uniform", 20, 0.5)
    a = make_workload(200, prompts, outputs, vocab_size=100, max_model_len=256, seed=3)
    assert a == make_workload(200, prompts, outputs, vocab_size=100, max_model_len=256, seed=3)
    assert a != make_workload(200, prompts, outputs, vocab_size=100, max_model_len=256, seed=4)
    assert all(10 <= s.output_len <= 30 and 1 <= len(s.prompt) <= 256 - s.output_len for s in a)
    assert max(len(s.prompt) + s.output_len for s in a) == 256  # the long tail reached the clip
    assert all(1 <= t < 100 for s in a for t in s.prompt)
    salted = make_workload(200, prompts, outputs, vocab_size=100, max_model_len=256, seed=3, salt=1)
    assert [(len(s.prompt), s.output_len) for s in salted] == [(len(s.prompt), s.output_len) for s in a]
    assert all(x.prompt != y.prompt for x, y in zip(a, salted))  # a sweep's runs never share a prompt
    fixed = make_workload(3, LengthDist("fixed", 16), LengthDist("fixed", 4), 50, None, 0)
    assert [(len(s.prompt), s.output_len) for s in fixed] == [(16, 4)] * 3
    with pytest.raises(ValueError, match=r"^a fixed length of 300 tokens exceeds the 252 allowed"):
        make_workload(1, LengthDist("fixed", 300), LengthDist("fixed", 4), 50, 256, 0)
    with pytest.raises(ValueError, match=r"^length distribution must be one of fixed, uniform, longtail"):
        LengthDist("zipf", 4)


def test_poisson_arrivals():
    times = arrival_times(2000, 4.0, seed=1)
    assert times[0] == 0.0 and times == sorted(times) and times == arrival_times(2000, 4.0, seed=1)
    assert 3.6 < (len(times) - 1) / times[-1] < 4.4  # mean rate within 10% over 2000 draws
    assert arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"^--request-rate must be > 0 \(or inf\), got 0.0$"):
        arrival_times(3, 0.0, 0)


def test_launch_commands_per_mode():
    plan = LaunchPlan(
        "disaggregated",
        ("--num-threads", "1", "--model", "/m"),
        ("--health-interval-s", "0.2"),
        ("cuda:0", "cuda:1"),
        kv_transport="nccl",
    )
    cmds = launch_commands(plan, 7000, 7001, [7010, 7011])
    cli = [sys.executable, "-m", "splitserve.cli"]
    expected = {
        "prefill-0": "prefill --host 127.0.0.1 --port 7010 --instance-name prefill-0 --num-threads 1 --model /m"
        " --kv-transport nccl --device cuda:0",
        "decode-0": "decode --host 127.0.0.1 --port 7011 --instance-name decode-0 --num-threads 1 --model /m"
        " --kv-transport nccl --prefill-peers 127.0.0.1:7010 --device cuda:1",
        "gateway": "gateway --host 127.0.0.1 --grpc-port 7000 --http-port 7001 --prefill 127.0.0.1:7010"
        " --decode 127.0.0.1:7011 --model /m --health-interval-s 0.2",
    }
    assert cmds == [(name, cli + command.split()) for name, command in expected.items()]
    colo = launch_commands(LaunchPlan("colocated", num_workers=2), 7000, 7001, [7010, 7011])
    assert [name for name, _ in colo] == ["worker-0", "worker-1", "gateway"]
    assert colo[1][1] == cli + ["worker", "--host", "127.0.0.1", "--port", "7011", "--instance-name", "worker-1"]
    assert colo[2][1][-4:] == ["--prefill", "", "--decode", "127.0.0.1:7010,127.0.0.1:7011"]
    with pytest.raises(ValueError, match=r"^--devices lists 1 devices but colocated starts 2 engine processes"):
        LaunchPlan("colocated", devices=("cuda:0",))


# -- the runner's accounting, with a fake sender ----------------------------------------------------


def test_run_load_counts_failed_cancelled_and_unsent(capsys):
    async def send(spec, record, clock):
        record.sent_s = clock()
        if spec.index == 1:
            raise ConnectionError("refused")
        await asyncio.sleep(10 if spec.index == 2 else 0.01)
        record.ttft_s, record.e2e_s, record.num_received, record.status = 0.01, 0.01, 1, COMPLETED

    specs = [RequestSpec(i, (1, 2), 1) for i in range(4)]
    records, duration = asyncio.run(
        run_load(
            specs,
            [0.0, 0.0, 0.0, 5.0],
            send,
            concurrency=None,
            max_seconds=0.3,
            progress=Progress(4, "t", interval_s=0),
        )
    )
    assert [r.status for r in records] == ["completed", "failed", "cancelled", "not_sent"]
    assert [r.error for r in records] == ["", "ConnectionError: refused", "cancelled at --max-seconds=0.3", ""]
    # the deadline is kept by the event loop's clock and the duration read from perf_counter: allow 1 ms
    assert 0.299 <= duration < 0.5
    assert "3/4 done, 0 in flight, 2 failed" in capsys.readouterr().err.splitlines()[-1]


# -- the REST client and a server's idle close ------------------------------------------------------

SSE = b'data: {"choices": [{"text": " w9"}], "usage": {"prompt_tokens": 2, "completion_tokens": 1}}\n\n'
SSE += b'data: {"choices": [{"text": " w10", "finish_reason": "length"}], "usage": {"prompt_tokens": 2, '
SSE += b'"completion_tokens": 2}}\n\ndata: [DONE]\n\n'


async def _one_server(closes: set[tuple[int, int]], resets: frozenset[tuple[int, int]] = frozenset()):
    """An HTTP/1.1 server on loopback answering GET /v1/models with one model and every POST with the same
    two-token SSE stream, keeping the connection, except the (connection, request) pairs in `closes`: those it
    reads, then closes the connection with no answer (a FIN), as a server does whose idle timeout fired just as
    the request came; and those in `resets`, whose connection it resets on the request's head (a server that
    closed a socket holding the request unread). Returns the server and the (connection, request, method) of
    each request it answered."""
    answered, num_connections = [], 0
    models = json.dumps({"object": "list", "data": [{"id": "m", "max_model_len": 64}]}).encode()

    async def serve_connection(reader, writer):
        nonlocal num_connections
        connection, num_connections = num_connections, num_connections + 1
        for request in range(100):
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:  # the client closed the connection
                return
            if (connection, request) in resets:
                writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()  # closed at once with linger 0: a reset
                return
            lines = head.lower().split(b"\r\n")
            length = next((int(h.split(b":")[1]) for h in lines if h.startswith(b"content-length")), 0)
            await reader.readexactly(length)
            if (connection, request) in closes:
                writer.close()
                return
            method, body = head.split(b" ")[0].decode(), SSE if head.startswith(b"POST") else models
            kind = b"text/event-stream" if method == "POST" else b"application/json"
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (kind, len(body), body)
            )
            await writer.drain()
            answered.append((connection, request, method))

    return await asyncio.start_server(serve_connection, "127.0.0.1", 0), answered


def _rest_records(
    closes: set[tuple[int, int]], num_requests: int, resets: frozenset[tuple[int, int]] = frozenset()
) -> tuple[list, list]:
    import httpx

    from splitserve.bench.serve_load import rest_sender

    async def main():
        server, answered = await _one_server(closes, resets)
        port = server.sockets[0].getsockname()[1]
        records = [RequestRecord(i, 2, 2, 0.0) for i in range(num_requests)]
        async with server, httpx.AsyncClient(timeout=10) as client:
            send = rest_sender(client, f"http://127.0.0.1:{port}", "m", 0.0)
            for record in records:  # one after the other: each reuses the connection the one before used
                try:
                    await send(RequestSpec(record.index, (5, 8), 2), record, lambda: 0.0)
                except Exception as exc:  # noqa: BLE001 - the test reads the error
                    record.error = f"{type(exc).__name__}: {exc}"
        return records, answered

    return asyncio.run(main())


def test_a_request_on_a_reused_connection_the_server_closed_unanswered_is_sent_again():
    records, answered = _rest_records({(0, 1)}, 3)
    assert [(r.status, r.num_received, r.error) for r in records] == [(COMPLETED, 2, "")] * 3
    assert [r.resent_after for r in records] == [[], ["RemoteProtocolError"], []]
    # the second request went again, on a new connection
    assert answered == [(0, 0, "POST"), (1, 0, "POST"), (1, 1, "POST")]


def test_a_new_connection_closed_unanswered_is_a_failure_not_sent_again():
    records, answered = _rest_records({(0, 0)}, 1)
    assert records[0].error == "RemoteProtocolError: Server disconnected without sending a response."
    assert answered == []


def test_a_request_on_a_reused_connection_reset_unanswered_is_sent_again():
    records, answered = _rest_records(set(), 3, resets=frozenset({(0, 1)}))
    assert [(r.status, r.num_received, r.error) for r in records] == [(COMPLETED, 2, "")] * 3
    assert [r.resent_after for r in records] == [[], ["ReadError (ConnectionResetError)"], []]
    assert answered == [(0, 0, "POST"), (1, 0, "POST"), (1, 1, "POST")]


def test_a_new_connection_reset_unanswered_is_a_failure_not_sent_again():
    records, answered = _rest_records(set(), 1, resets=frozenset({(0, 0)}))
    assert records[0].error == "ReadError: "  # httpcore reads the answer after a failed send: a reset is a ReadError
    assert answered == []


def test_a_burst_of_rest_requests_finds_no_idle_connection_to_crowd_onto():
    """The model list is asked on a connection that closes after it, so each request of a burst opens its own
    connection at once rather than all being handed the one idle connection and waiting on it in turn."""
    import argparse

    async def main():
        server, answered = await _one_server(set())
        ns = argparse.Namespace(api="rest", request_timeout_s=10.0, temperature=0.0)
        records = [RequestRecord(i, 2, 2, 0.0) for i in range(8)]
        async with server, serve.Target(ns, "127.0.0.1", 0, server.sockets[0].getsockname()[1]) as target:
            await asyncio.gather(*(target.send(RequestSpec(r.index, (5, 8), 2), r, lambda: 0.0) for r in records))
        return records, answered

    records, answered = asyncio.run(main())
    assert [(r.status, r.num_received) for r in records] == [(COMPLETED, 2)] * 8
    assert sorted(answered) == [(0, 0, "GET")] + [(c, 0, "POST") for c in range(1, 9)]


# -- a real stack per mode --------------------------------------------------------------------------

ENGINE_ARGS = "--num-threads 1 --block-size 16 --num-kv-blocks 512"
SLO_TTFT_MS, SLO_ITL_MS = 60.0, 40.0


def _check_run(run, asked_lengths, finish):
    s, reqs = run["summary"], run["requests"]
    n = len(asked_lengths)
    assert (*_request_counts(s), s["errors"]) == (n, n, n, 0, 0, 0, {})
    assert [r["output_len"] for r in reqs] == asked_lengths
    assert [r["num_received"] for r in reqs] == asked_lengths  # every token asked for came back
    assert all(r["prompt_tokens_reported"] == r["prompt_len"] and r["finish_reason"] == finish for r in reqs)
    assert s["cached_prompt_tokens"] == 0  # fresh prompts: nothing came from a prefix cache, not even in run 2
    assert [r["num_itl"] for r in reqs] == [k - 1 for k in asked_lengths]
    assert s["output_tokens_asked"] == s["output_tokens_received"] == s["completed_output_tokens"] == sum(asked_lengths)
    assert s["completed_prompt_tokens"] == sum(r["prompt_len"] for r in reqs)
    d = s["duration_s"]
    assert s["request_throughput"] == n / d
    assert s["output_token_throughput"] == s["completed_output_tokens"] / d
    assert s["total_token_throughput"] == (s["completed_prompt_tokens"] + s["completed_output_tokens"]) / d
    for r in reqs:
        assert r["tpot_s"] == (r["e2e_s"] - r["ttft_s"]) / (r["num_received"] - 1)
        assert r["meets_slo"] == (1000 * r["ttft_s"] <= SLO_TTFT_MS and 1000 * r["itl_p99_s"] <= SLO_ITL_MS)
    g = s["goodput"]
    assert g["num_met"] == sum(r["meets_slo"] for r in reqs)
    assert (g["share"], g["rate"]) == (g["num_met"] / n, g["num_met"] / d)
    assert s["ttft_ms"]["count"] == s["e2e_ms"]["count"] == s["tpot_ms"]["count"] == n
    assert s["itl_ms"]["count"] == sum(asked_lengths) - n
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        m = s[key]
        assert 0 <= m["p50"] <= m["p90"] <= m["p99"] <= m["max"], (key, m)


def _strict_json(path):
    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    with open(path) as f:
        return json.load(f, parse_constant=refuse)


@pytest.mark.slow
@pytest.mark.parametrize("mode,api,rates", [("disaggregated", "grpc", "6,12"), ("colocated", "rest", "")])
def test_launch_measures_a_real_stack_consistently(mode, api, rates, tmp_path, capsys):
    out = tmp_path / "result.json"
    argv = [
        "--launch",
        mode,
        "--engine-args",
        ENGINE_ARGS,
        "--api",
        api,
        "--num-requests",
        "12",
        "--input-dist",
        "uniform",
        "--input-len",
        "24",
        "--output-dist",
        "uniform",
        "--output-len",
        "6",
        "--num-warmup",
        "1",
        "--seed",
        "5",
        "--max-seconds",
        "60",
        "--slo-ttft-ms",
        str(SLO_TTFT_MS),
        "--slo-itl-ms",
        str(SLO_ITL_MS),
        "--json",
        str(out),
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    argv += ["--sweep", rates, "--plot-prefix", str(tmp_path / "sweep")] if rates else ["--request-rate", "8"]
    assert serve.main(argv) == 0
    result = _strict_json(out)
    expected = make_workload(
        12, LengthDist("uniform", 24, 0.5), LengthDist("uniform", 6, 0.5), 8192, result["max_model_len"], seed=5
    )
    assert (result["mode"], result["api"], result["model_id"], result["max_model_len"]) == (
        mode,
        api,
        "default_model",
        1024,
    )
    assert [r["request_rate"] for r in result["runs"]] == ([6.0, 12.0] if rates else [8.0])
    finish = "FINISH_REASON_LENGTH" if api == "grpc" else "length"
    for salt, run in enumerate(result["runs"]):
        assert run["workload_salt"] == salt
        assert [r["prompt_len"] for r in run["requests"]] == [len(s.prompt) for s in expected]
        _check_run(run, [s.output_len for s in expected], finish)
    captured = capsys.readouterr()
    assert captured.out.count(f"== mode {mode}, api {api}") == len(result["runs"])
    assert "12/12 done, 0 in flight, 0 failed" in captured.err
    if rates:
        assert "| 6 | 12/12 |" in captured.out and "| 12 | 12/12 |" in captured.out
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            assert result["plots"] == []
        else:
            assert result["plots"] == [str(tmp_path / "sweep_latency.png"), str(tmp_path / "sweep_goodput.png")]
            for path in result["plots"]:
                with open(path, "rb") as f:
                    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# -- the gRPC client's connections ----------------------------------------------------------------


def test_grpc_requests_take_the_connections_in_turn():
    """--grpc-connections 3: six requests arrive over three distinct client connections, two each (a gateway
    with several API-server processes balances connections, so one connection would load one process)."""
    import grpc

    from splitserve.protos import common_pb2, generation_pb2, generation_pb2_grpc

    peers: list[str] = []

    class Generation(generation_pb2_grpc.GenerationServicer):
        async def ListModels(self, request, context):
            return generation_pb2.ListModelsResponse(models=[generation_pb2.ModelInfo(id="m", max_model_len=64)])

        async def Generate(self, request, context):
            peers.append(context.peer())
            yield generation_pb2.GenerateResponse(
                token_ids=list(range(request.sampling.max_tokens)),
                finish_reason=common_pb2.FINISH_REASON_LENGTH,
                usage=common_pb2.Usage(prompt_tokens=len(request.token_ids.ids)),
            )

    async def run() -> dict:
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(Generation(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            ns = serve.build_parser().parse_args(
                ["--grpc-port", str(port), "--grpc-connections", "3", "--num-requests", "6", "--num-warmup", "0"]
                + ["--concurrency", "1", "--input-len", "4", "--output-len", "2", "--no-progress"]
            )
            return await serve.measure(ns, "127.0.0.1", port, free_port(), serve.check_args(ns))
        finally:
            await server.stop(None)

    result = asyncio.run(run())
    assert result["runs"][0]["summary"]["num_completed"] == 6
    assert sorted(peers.count(p) for p in set(peers)) == [2, 2, 2]
    assert peers[:3] == peers[3:]  # in turn: the fourth request takes the first connection again


def test_grpc_connections_must_be_positive():
    ns = serve.build_parser().parse_args(["--grpc-connections", "0"])
    with pytest.raises(ValueError, match=r"^--grpc-connections must be >= 1, got 0$"):
        serve.check_args(ns)
