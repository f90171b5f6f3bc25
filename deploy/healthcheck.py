#!/usr/bin/env python3
"""Container health check for the splitserve image (installed as `splitserve-healthcheck`).

    splitserve-healthcheck grpc HOST:PORT [SERVICE]   grpc.health.v1 Check; SERVING -> exit 0
    splitserve-healthcheck http URL                   HTTP GET; 2xx -> exit 0

Any other answer, a timeout (--timeout, seconds, default 3) or a refused connection exits 1
with one line naming the target and what came back, which `docker inspect` shows as the
health log. Compose and the Kubernetes exec probes call it; kubelet's own gRPC probe does the
same check without it.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request


def check_grpc(target: str, service: str, timeout_s: float) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return False, f"grpc {target} service={service!r}: {exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"grpc {target} service={service!r}: {status}"


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
        ok, line = check_grpc(args.target, args.service, args.timeout)
    else:
        ok, line = check_http(args.url, args.timeout)
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
