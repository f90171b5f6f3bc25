"""API keys (file + environment), 401 / UNAUTHENTICATED with exact bodies, open health and
metrics, constant-time comparison over every key, and TLS on the public ports."""

import hashlib
import hmac
import ssl

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.gateway import auth
from splitserve.gateway.auth import ApiKeys, client_id_of, load_api_keys
from splitserve.gateway.config import GatewayConfig
from splitserve.gateway.errors import GatewayError
from splitserve.gateway.server import load_tls
from splitserve.protos import common_pb2, generation_pb2, generation_pb2_grpc
from tests.gateway_fakes import FakeDecode, FakePrefill, Stack, make_tokenizer_dir, parse_metrics
from tests.service_harness import self_signed_cert

MODEL = "tiny-fake"
KEY_A, KEY_B, KEY_ENV = "sk-alpha-1", "sk-beta-2", "sk-env-3"
KEY_HASH = "sk-gamma#4"  # a `#` inside a key is part of it
MISSING = {
    "error": {
        "message": "missing API key: send the header 'Authorization: Bearer <key>'",
        "type": "invalid_request_error",
        "param": None,
        "code": "missing_api_key",
    }
}
WRONG = {
    "error": {"message": "invalid API key", "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
}
BODY = {"model": MODEL, "prompt": "hello world w20", "max_tokens": 2}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(f"# gateway keys\n{KEY_A}\n\n  # the second team\n  {KEY_B}   \n{KEY_A}\n{KEY_HASH}\n")
    return str(path)


@pytest.fixture(scope="module")
def stack(tokenizer_dir, keys_file):
    stack = Stack(
        tokenizer_dir,
        [FakePrefill()],
        [FakeDecode()],
        {"api_keys_file": keys_file},
        env={"SPLITSERVE_API_KEYS": f" {KEY_ENV} ,,"},
    ).start()
    yield stack
    stack.stop()


def test_keys_come_from_the_file_and_the_environment(keys_file, tmp_path):
    assert load_api_keys(keys_file, {"SPLITSERVE_API_KEYS": f"{KEY_ENV},{KEY_B}"}) == (KEY_A, KEY_B, KEY_HASH, KEY_ENV)
    assert load_api_keys("", {}) == ()
    with pytest.raises(ValueError) as info:
        load_api_keys(str(tmp_path / "absent.txt"), {})
    assert str(info.value).startswith(f"--api-keys-file '{tmp_path / 'absent.txt'}' cannot be read: [Errno 2]")
    bad = tmp_path / "bad.txt"
    bad.write_text("ok-key\nsk-key # a comment after a key is not one: the line is the key\n")
    with pytest.raises(ValueError) as info:
        load_api_keys(str(bad), {})
    assert str(info.value) == f"--api-keys-file '{bad}' line 2: a key must not contain whitespace"


def test_authenticate_exact_outcomes():
    keys = ApiKeys([KEY_A, KEY_B])
    assert (
        keys.authenticate(f"Bearer {KEY_B}")
        == client_id_of(KEY_B)
        == "key-" + hashlib.sha256(KEY_B.encode()).hexdigest()[:12]
    )
    assert keys.authenticate(f"bearer   {KEY_A}  ".encode()) == client_id_of(KEY_A)
    for value, code in (
        (None, "missing_api_key"),
        ("", "missing_api_key"),
        (KEY_A, "missing_api_key"),
        (f"Basic {KEY_A}", "missing_api_key"),
        ("Bearer ", "missing_api_key"),
        ("Bearer sk-alpha", "invalid_api_key"),
        (f"Bearer {KEY_A}x", "invalid_api_key"),
    ):
        with pytest.raises(GatewayError) as info:
            keys.authenticate(value)
        assert (info.value.kind, info.value.code, info.value.http_status) == ("unauthenticated", code, 401)
    assert ApiKeys().authenticate(None) == auth.ANONYMOUS  # no keys: authentication is off


def test_every_key_is_compared_even_after_a_match(monkeypatch):
    calls, real = [], hmac.compare_digest

    def counting(a, b):
        calls.append(b)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    keys = ApiKeys([KEY_A, KEY_B, KEY_ENV])
    assert keys.authenticate(f"Bearer {KEY_A}") == client_id_of(KEY_A)
    assert calls == [KEY_A.encode(), KEY_B.encode(), KEY_ENV.encode()]


def test_rest_refuses_missing_and_wrong_keys_with_exact_bodies(stack):
    url = stack.base_url + "/v1/completions"
    for headers, body in (
        ({}, MISSING),
        ({"Authorization": "Bearer sk-nope"}, WRONG),
        ({"Authorization": KEY_A}, MISSING),
        ({"Authorization": "Bearer sk-gamma"}, WRONG),  # KEY_HASH cut at its `#`
    ):
        r = httpx.post(url, json=BODY, headers=headers, timeout=5)
        assert (r.status_code, r.headers["www-authenticate"], r.json()) == (401, "Bearer", body)
    r = httpx.get(stack.base_url + "/v1/models", timeout=5)
    assert (r.status_code, r.json()) == (401, MISSING)
    r = httpx.get(stack.base_url + "/nowhere", timeout=5)  # even unknown paths need a key
    assert (r.status_code, r.json()) == (401, MISSING)


def test_rest_serves_each_configured_key(stack):
    for key in (KEY_A, KEY_B, KEY_HASH, KEY_ENV):
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0)
        r = client.completions.create(**BODY)
        assert r.choices[0].text == " w21 w22"
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=stack.base_url + "/v1", api_key="sk-nope", max_retries=0).completions.create(**BODY)
    assert info.value.body == WRONG["error"]


def test_health_ready_and_metrics_stay_open(stack):
    assert httpx.get(stack.base_url + "/health").json() == {"status": "ok"}
    assert httpx.get(stack.base_url + "/ready").status_code == 200
    # open for probes, but which instances at which addresses only for key holders
    assert httpx.get(stack.base_url + "/ready").json() == {"ready": True}
    detailed = httpx.get(stack.base_url + "/ready", headers={"Authorization": f"Bearer {KEY_A}"}).json()
    assert detailed["ready"] is True and [i["address"] for i in detailed["instances"]] == [
        stack.servers[name].address for name in stack.servers
    ]
    metrics = parse_metrics(httpx.get(stack.base_url + "/metrics").text)
    refused = {
        dict(labels)["route"]: value
        for (name, labels), value in metrics.items()
        if name == "splitserve:gateway_requests_total" and dict(labels)["status"] == "401"
    }
    assert refused["/v1/completions"] >= 3  # every refusal above is counted with its status
    channel = grpc.insecure_channel(stack.grpc_target)
    check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert check.status == health_pb2.HealthCheckResponse.SERVING


def _grpc_call(stack, method, request, metadata):
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target))
    call = getattr(stub, method)(request, metadata=metadata, timeout=5)
    return list(call) if method == "Generate" else call


@pytest.mark.parametrize(
    "method,request_",
    [
        ("Generate", generation_pb2.GenerateRequest(text="w20", sampling=common_pb2.SamplingParams(max_tokens=2))),
        ("Tokenize", generation_pb2.TokenizeRequest(text="w20")),
        ("ListModels", generation_pb2.ListModelsRequest()),
    ],
)
def test_grpc_needs_a_key_in_metadata(stack, method, request_):
    for metadata, details in (
        ((), MISSING["error"]["message"]),
        ((("authorization", "Bearer sk-nope"),), "invalid API key"),
    ):
        with pytest.raises(grpc.RpcError) as info:
            _grpc_call(stack, method, request_, metadata)
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, details)
    answer = _grpc_call(stack, method, request_, (("authorization", f"Bearer {KEY_B}"),))
    expected = {
        "Generate": lambda a: [t for m in a for t in m.token_ids] == [21, 22],
        "Tokenize": lambda a: list(a.token_ids) == [20],
        "ListModels": lambda a: [m.id for m in a.models] == [MODEL],
    }
    assert expected[method](answer)


# -- TLS -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tls_on_grpc_and_rest(tokenizer_dir, tmp_path):
    cert, key = self_signed_cert(tmp_path, "gateway")
    stack = Stack(
        tokenizer_dir,
        [FakePrefill()],
        [FakeDecode()],
        {"tls_cert": cert, "tls_key": key},
        env={"SPLITSERVE_API_KEYS": KEY_A},
    ).start()
    try:
        with open(cert, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        channel = grpc.secure_channel(stack.grpc_target, creds)
        out = list(
            generation_pb2_grpc.GenerationStub(channel).Generate(
                generation_pb2.GenerateRequest(text="w20", sampling=common_pb2.SamplingParams(max_tokens=2)),
                metadata=(("authorization", f"Bearer {KEY_A}"),),
                timeout=5,
            )
        )
        assert [t for m in out for t in m.token_ids] == [21, 22]
        with pytest.raises(grpc.RpcError) as info:  # plaintext to the TLS port
            generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target)).ListModels(
                generation_pb2.ListModelsRequest(), timeout=2
            )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert stack.base_url.startswith("https://")
        verify = ssl.create_default_context(cafile=cert)
        r = httpx.post(
            stack.base_url + "/v1/completions",
            json=BODY,
            headers={"Authorization": f"Bearer {KEY_A}"},
            verify=verify,
            timeout=5,
        )
        assert (r.status_code, r.json()["choices"][0]["text"]) == (200, " w21 w22")
        with pytest.raises(httpx.ConnectError):  # an unknown issuer is refused by a verifying client
            httpx.get(stack.base_url + "/health", timeout=5)
        with pytest.raises(httpx.HTTPError):
            httpx.get(stack.base_url.replace("https://", "http://") + "/health", timeout=5)
    finally:
        stack.stop()


@pytest.mark.slow
def test_tls_flags_are_checked_at_start(tmp_path):
    cert, key = self_signed_cert(tmp_path, "one")
    other_cert, _ = self_signed_cert(tmp_path, "two")
    assert load_tls(GatewayConfig()) is None
    with pytest.raises(ValueError) as info:
        load_tls(GatewayConfig(tls_cert=cert))
    assert str(info.value) == "--tls-cert and --tls-key must be given together (got only --tls-cert)"
    with pytest.raises(ValueError) as info:
        load_tls(GatewayConfig(tls_cert=cert, tls_key=str(tmp_path / "none.key")))
    assert str(info.value).startswith(f"--tls-key '{tmp_path / 'none.key'}' cannot be read: [Errno 2]")
    with pytest.raises(ValueError) as info:
        load_tls(GatewayConfig(tls_cert=other_cert, tls_key=key))
    assert str(info.value).startswith(
        f"--tls-cert '{other_cert}' and --tls-key '{key}' are not a matching PEM certificate and key: "
    )
    pems = load_tls(GatewayConfig(tls_cert=cert, tls_key=key))
    assert pems[0].startswith(b"-----BEGIN CERTIFICATE-----") and b"PRIVATE KEY-----" in pems[1]
