"""The decode service's admission on its own (no core process): a request whose admission fails with an
unexpected error ends alone, with an error naming the cause; the gateway's stream and its other requests
go on (a fault in one request must never close a stream shared by every request of that gateway)."""

from types import SimpleNamespace

from splitserve.common.config import EngineConfig
from splitserve.common.default_model_path import default_model_path
from splitserve.decode_service import server
from splitserve.engine.core_process import messages as m
from splitserve.engine_service.config import ServiceConfig
from splitserve.protos import common_pb2, decode_pb2


def service(monkeypatch) -> tuple[server.DecodeService, list]:
    svc = server.DecodeService(EngineConfig(model=str(default_model_path()), role="both"), ServiceConfig())
    svc.starting = False
    svc.client.info = SimpleNamespace(vocab_size=512)
    sent: list = []
    monkeypatch.setattr(svc.client, "send", sent.append)
    return svc, sent


def structured(rid: str) -> decode_pb2.DecodeRequest:
    params = common_pb2.SamplingParams(max_tokens=4)
    params.structured_output.regex = "[ab]+"
    return decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=[1, 2, 3], sampling=params)


def test_an_unexpected_admission_error_ends_that_request_alone(monkeypatch):
    svc, sent = service(monkeypatch)

    def broken(spec, max_spec_bytes):  # what a missing or broken grammar library raises
        raise ImportError("No module named 'xgrammar'")

    monkeypatch.setattr(server, "check_spec", broken)
    stream = server.GatewayStream()
    svc._admit(structured("bad"), stream)
    svc._admit(decode_pb2.DecodeRequest(request_id="good", prompt_token_ids=[1, 2, 3]), stream)

    out = stream.out.get_nowait()
    assert [(d.request_id, d.finish_reason, d.error, d.refused) for d in out.deltas] == [
        (
            "bad",
            common_pb2.FINISH_REASON_ERROR,
            "the decode could not admit the request: ImportError: No module named 'xgrammar'",
            False,
        )
    ]
    assert stream.out.empty()
    assert stream.request_ids == {"good"} and set(svc.owner) == {"good"} and svc.inflight == 1
    assert [(type(c), c.request_id, c.prompt_token_ids) for c in sent] == [(m.AddRequest, "good", [1, 2, 3])]


def test_fork_ids_are_bounded_by_the_public_sequence_limit(monkeypatch):
    """n <= 16 at the gateway, so a request has at most 15 forks; a forged DecodeRequest with 5,000 is refused
    alone, every sequence id it names ended with the reason, nothing sent to the core."""
    svc, sent = service(monkeypatch)
    stream = server.GatewayStream()
    forks = [f"f{i}" for i in range(5000)]
    svc._admit(decode_pb2.DecodeRequest(request_id="big", prompt_token_ids=[1, 2], fork_ids=forks), stream)
    out = stream.out.get_nowait()
    assert {(d.finish_reason, d.error) for d in out.deltas} == {
        (common_pb2.FINISH_REASON_ERROR, "fork_ids: at most 15 (n <= 16), got 5000")
    }
    assert [d.request_id for d in out.deltas] == ["big", *forks] and sent == [] and svc.owner == {}
    most = [f"g{i}" for i in range(15)]
    svc._admit(decode_pb2.DecodeRequest(request_id="ok", prompt_token_ids=[1, 2], fork_ids=most), stream)
    assert stream.out.empty() and [(type(c), c.request_id) for c in sent] == [(m.AddRequest, "ok")]


def test_a_draining_decode_answers_unavailable_not_an_error_of_the_request(monkeypatch):
    svc, sent = service(monkeypatch)
    svc.draining = True
    stream = server.GatewayStream()
    svc._admit(decode_pb2.DecodeRequest(request_id="late", prompt_token_ids=[1, 2]), stream)
    (delta,) = stream.out.get_nowait().deltas
    assert (delta.finish_reason, delta.error, delta.unavailable, delta.refused) == (
        common_pb2.FINISH_REASON_ERROR,
        f"{svc.name} is draining",
        True,
        False,
    )
    assert sent == [] and svc.owner == {}
