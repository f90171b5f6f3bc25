"""mTLS between internal services: prefill, decode and gateway talk only with certificates signed by
the shared CA; a plaintext client or one without a client certificate is refused."""

import asyncio
import subprocess

import grpc
import httpx
import pytest

from splitserve.protos import common_pb2, prefill_pb2_grpc
from splitserve.runtime.grpc_server import InternalTls
from tests.service_harness import ENGINE, Proc, free_port, start_service, stop_all, wait_until

pytestmark = pytest.mark.slow


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA and one certificate (server and client use, SAN 127.0.0.1/localhost) signed by it."""
    d = tmp_path_factory.mktemp("pki")
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=splitserve-test-ca",
        cwd=d,
    )
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "svc.key", "-out", "svc.csr", "-subj", "/CN=svc", cwd=d)
    openssl(
        "x509",
        "-req",
        "-in",
        "svc.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "svc.pem",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
        cwd=d,
    )
    return d


def test_partial_mtls_flags_are_refused_naming_the_missing_ones():
    with pytest.raises(
        ValueError,
        match=r"^internal mTLS needs all of --internal-tls-cert, --internal-tls-key "
        r"and --internal-tls-ca; missing --internal-tls-key, --internal-tls-ca$",
    ):
        InternalTls.from_files("cert.pem", "", "")
    assert InternalTls.from_files("", "", "") is None


def test_stack_over_mtls_serves_and_refuses_plaintext(certs, tmp_path):
    from splitserve.common.default_model_path import default_model_path

    tls = [
        "--internal-tls-cert",
        str(certs / "svc.pem"),
        "--internal-tls-key",
        str(certs / "svc.key"),
        "--internal-tls-ca",
        str(certs / "ca.pem"),
    ]
    model = default_model_path()
    prefill, p_addr = start_service("prefill", model, tmp_path, "prefill", service_args=tls, **ENGINE)
    decode, d_addr = start_service("decode", model, tmp_path, "decode", service_args=tls, **ENGINE)
    http = free_port()
    gateway = Proc(
        "gateway",
        [
            "--grpc-port",
            "0",
            "--http-port",
            str(http),
            "--prefill",
            p_addr,
            "--decode",
            d_addr,
            "--health-interval-s",
            "0.2",
            *tls,
        ],
        tmp_path,
        "gateway",
    )
    try:
        prefill.wait_ready()
        decode.wait_ready()

        def ready() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{http}/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(
            ready,
            30,
            lambda: "the gateway's /ready answering 200; its log:\n" + gateway.log_path.read_text()[-3000:],
            poll_s=0.2,
        )
        out = httpx.post(
            f"http://127.0.0.1:{http}/v1/completions",
            timeout=30,
            json={"prompt": "def fibonacci(n):", "max_tokens": 6, "temperature": 0},
        )
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 6

        async def plaintext_and_anonymous():
            codes = []
            async with grpc.aio.insecure_channel(p_addr) as channel:
                try:
                    await prefill_pb2_grpc.PrefillStub(channel).Describe(common_pb2.DescribeRequest(), timeout=3)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
            no_client_cert = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
            async with grpc.aio.secure_channel(p_addr, no_client_cert) as channel:
                try:
                    await prefill_pb2_grpc.PrefillStub(channel).Describe(common_pb2.DescribeRequest(), timeout=3)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
            return codes

        assert asyncio.run(plaintext_and_anonymous()) == [grpc.StatusCode.UNAVAILABLE] * 2
    finally:
        stop_all([gateway, prefill, decode])


def test_the_internal_token_is_required_on_every_call_but_health(tmp_path):
    """With SPLITSERVE_INTERNAL_TOKEN set, an internal call without it is UNAUTHENTICATED
    (unary and streaming), one with it is served, health stays open for probes; the token is never printed."""
    import asyncio

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from splitserve.common.config_fields import describe
    from splitserve.engine_service.config import ServiceConfig
    from splitserve.runtime.grpc_server import InternalAuth, build_server, internal_channel, set_serving

    def echo(request, context):
        return request

    async def chat(request_iterator, context):
        async for item in request_iterator:
            yield item

    def add(server):
        server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    "t.T",
                    {
                        "Echo": grpc.unary_unary_rpc_method_handler(echo),
                        "Chat": grpc.stream_stream_rpc_method_handler(chat),
                    },
                )
            ]
        )

    auth = InternalAuth(token="s3cret")

    async def main():
        server, health, port = build_server("127.0.0.1", 0, add, ["t.T"], auth)
        await server.start()
        set_serving(health, ["t.T"], True)
        outcomes = {}
        try:
            for label, channel_auth in (("none", None), ("wrong", InternalAuth(token="nope")), ("right", auth)):
                async with internal_channel(f"127.0.0.1:{port}", channel_auth) as channel:
                    unary = channel.unary_unary("/t.T/Echo")
                    stream = channel.stream_stream("/t.T/Chat")
                    try:
                        outcomes[(label, "unary")] = await unary(b"hi", timeout=5)
                    except grpc.aio.AioRpcError as exc:
                        outcomes[(label, "unary")] = (exc.code(), exc.details())
                    try:
                        outcomes[(label, "stream")] = [m async for m in stream(iter([b"a", b"b"]), timeout=5)]
                    except grpc.aio.AioRpcError as exc:
                        outcomes[(label, "stream")] = (exc.code(), exc.details())
                    check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
                    outcomes[(label, "health")] = (await check).status
        finally:
            await server.stop(0)
        return outcomes

    outcomes = asyncio.run(main())
    denied = (grpc.StatusCode.UNAUTHENTICATED, "internal call without a valid x-splitserve-internal-token")
    serving = health_pb2.HealthCheckResponse.SERVING
    assert outcomes == {
        ("none", "unary"): denied,
        ("none", "stream"): denied,
        ("none", "health"): serving,
        ("wrong", "unary"): denied,
        ("wrong", "stream"): denied,
        ("wrong", "health"): serving,
        ("right", "unary"): b"hi",
        ("right", "stream"): [b"a", b"b"],
        ("right", "health"): serving,
    }
    printed = describe(ServiceConfig(internal_token="s3cret"))
    assert "internal_token = '<set>'" in printed and "s3cret" not in printed
