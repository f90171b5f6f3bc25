#!/usr/bin/env python3
"""Container health check for the splitserve image (installed as `splitserve-healthcheck`).

    splitserve-healthcheck grpc HOST:PORT [SERVICE]   grpc.health.v1 Check; SERVING -> exit 0
    splitserve-healthcheck http URL                   HTTP GET; 2xx -> exit 0

Any other answer, a timeout (--timeout, seconds, default 3) or a refused connection exits 1
with one line naming the target and what came back, which `docker inspect` shows as the
health log. Compose and the Kubernetes exec probes call it (kubelet's own gRPC probe speaks no TLS).

With internal mTLS on, the service's own environment says how to reach it, and the check reads the same
variables: SPLITSERVE_INTERNAL_TLS_CERT, _KEY, _CA (a client certificate of the internal CA) and
_SERVER_NAME (the name the server's certificate is checked against). Environment references in HOST:PORT
are expanded (`${POD_IP}:50061`: Kubernetes expands none in an exec probe's command).
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request


def check_grpc(target: str, service: str, timeout_s: float) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with _channel(grpc, target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return False, f"grpc {target} service={service!r}: {exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"grpc {target} service={service!r}: {status}"


def _channel(grpc, target: str):
    """A plaintext channel, or an mTLS one when SPLITSERVE_INTERNAL_TLS_CERT/_KEY/_CA are set."""
    files = [os.environ.get(f"SPLITSERVE_INTERNAL_TLS_{part}", "") for part in ("CERT", "KEY", "CA")]
    if not any(files):
        return grpc.insecure_channel(target)
    cert, key, ca = (open(path, "rb").read() for path in files)
    name = os.environ.get("SPLITSERVE_INTERNAL_TLS_SERVER_NAME", "")
    options = [("grpc.ssl_target_name_override", name)] if name else []
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.secure_channel(target, credentials, options=options)


def check_http(url: str, timeout_s: float) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return 200 <= response.status < 300, f"http {url}: {response.status}"
    except urllib.error.HTTPError as exc:
        return False, f"http {url}: {exc.code} {exc.read(200).decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"http {url}: {getattr(exc, 'reason', exc)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve-healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    sub = parser.add_subparsers(dest="kind", required=True)
    g = sub.add_parser("grpc", help="grpc.health.v1 Check")
    g.add_argument("target", help="HOST:PORT")
    g.add_argument("service", nargs="?", default="", help="service name; empty = the whole server")
    h = sub.add_parser("http", help="HTTP GET, healthy on 2xx")
    h.add_argument("url")
    args = parser.parse_args(argv)
    if args.kind == "grpc":
        try:
            ok, line = check_grpc(os.path.expandvars(args.target), args.service, args.timeout)
        except OSError as exc:  # a TLS file named in the environment cannot be read
            ok, line = False, f"grpc {args.target}: {exc}"
    else:
        ok, line = check_http(args.url, args.timeout)
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
