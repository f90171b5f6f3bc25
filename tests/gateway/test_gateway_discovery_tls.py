"""Internal mTLS with pools: one certificate per role from deploy/internal-certs.sh (POOL_NAMESPACE), and a
gateway that dials members found through dns:///<pool name> by IP and checks them against the pool's name."""

import os
import subprocess
from pathlib import Path

import grpc
import pytest

from splitserve.protos import common_pb2, generation_pb2, generation_pb2_grpc
from splitserve.runtime.grpc_server import InternalTls
from tests.gateway_fakes import FakeDecode, FakePrefill, FakeResolver, Stack, make_tokenizer_dir

pytestmark = pytest.mark.slow  # runs bash and openssl

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "internal-certs.sh"
PREFILL_POOL, DECODE_POOL = "prefill.ns.svc.cluster.local", "decode.ns.svc.cluster.local"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("pki")
    env = {**os.environ, "POOL_NAMESPACE": "ns", "DAYS": "2"}
    made = subprocess.run(
        ["bash", str(SCRIPT), str(directory), "gateway", "prefill", "decode:decode.example.org"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert made.returncode == 0, made.stderr
    return directory


def sans(certificate: Path) -> str:
    out = subprocess.run(
        ["openssl", "x509", "-in", str(certificate), "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.splitlines()[1].strip()


def test_one_certificate_per_role_names_its_pool_and_the_shared_name(pki):
    assert sans(pki / "prefill.pem") == (
        "DNS:prefill, DNS:prefill.ns, DNS:prefill.ns.svc, DNS:prefill.ns.svc.cluster.local, "
        "DNS:*.prefill.ns.svc.cluster.local, DNS:splitserve-internal"
    )
    assert sans(pki / "decode.pem") == (
        "DNS:decode, DNS:decode.ns, DNS:decode.ns.svc, DNS:decode.ns.svc.cluster.local, "
        "DNS:*.decode.ns.svc.cluster.local, DNS:decode.example.org, DNS:splitserve-internal"
    )
    refused = subprocess.run(
        ["bash", str(SCRIPT), str(pki), "decode:bad*.name"], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2 and "'bad*.name' is not a DNS name" in refused.stderr


def test_pool_members_dialed_by_ip_are_checked_against_the_pools_name(pki, tmp_path):
    """Members served with their role's certificate pass under their pool's name; a member holding another
    role's certificate (it names no decode pool) stays down, and gets no request."""

    def served(role: str) -> grpc.ServerCredentials:
        return InternalTls.from_files(
            str(pki / f"{role}.pem"), str(pki / f"{role}.key"), str(pki / "ca.pem")
        ).server_credentials()

    p, d0, impostor = FakePrefill(), FakeDecode("decode-0"), FakeDecode("decode-9")
    resolver = FakeResolver({PREFILL_POOL: [p], DECODE_POOL: [d0, impostor]})
    overrides = {
        "prefill": f"dns:///{PREFILL_POOL}:50061",
        "decode": f"dns:///{DECODE_POOL}:50071",
        "discovery_interval_s": 0.05,
        "health_interval_s": 0.1,
        "internal_tls_cert": str(pki / "gateway.pem"),
        "internal_tls_key": str(pki / "gateway.key"),
        "internal_tls_ca": str(pki / "ca.pem"),
    }
    credentials = {"prefill-0": served("prefill"), "decode-0": served("decode"), "decode-9": served("prefill")}
    stack = Stack(
        make_tokenizer_dir(str(tmp_path)),
        [p],
        [d0, impostor],
        overrides,
        rest=False,
        resolver=resolver,
        credentials=credentials,
    )
    stack.start()
    try:
        registry = stack.gateway.registry
        stack.wait_for(lambda: registry.ready(), 10.0, "a prefill/decode pair up over mTLS")
        by_address = {i.address: i for i in stack.loop.call(registry.decodes)}
        assert stack.loop.call(lambda: (by_address[d0.address].up, by_address[impostor.address].up)) == (True, False)
        assert stack.loop.call(lambda: by_address[impostor.address].error).startswith("Describe failed: UNAVAILABLE")
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target))
        for text, first in (("w20", 21), ("w40", 41)):
            request = generation_pb2.GenerateRequest(text=text, sampling=common_pb2.SamplingParams(max_tokens=3))
            assert [t for m in stub.Generate(request, timeout=30) for t in m.token_ids] == [first, first + 1, first + 2]
        assert (len(d0.requests), len(impostor.requests), impostor.describes) == (2, 0, 0)
    finally:
        stack.stop()


def test_the_shared_server_name_wins_over_the_pools_name():
    tls = InternalTls(b"", b"", b"", server_name="splitserve-internal")
    assert tls.channel_options(PREFILL_POOL) == [("grpc.ssl_target_name_override", "splitserve-internal")]
    assert InternalTls(b"", b"", b"").channel_options(PREFILL_POOL) == [("grpc.ssl_target_name_override", PREFILL_POOL)]
    assert InternalTls(b"", b"", b"").channel_options() == []
