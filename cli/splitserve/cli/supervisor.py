"""`splitserve up`: N prefills (--num-prefill), M decodes (--num-decode) and the gateway on loopback, until Ctrl-C.

Placement (placement.py `place`): the devices of the prefills and the decodes and the KV transport, from the
visible GPUs and the flags; a transport the placement cannot run is refused before anything starts.

Children are `python -m splitserve.cli <subcommand>` processes of the installed package (nothing of
ours on their path: local_stack.py `LocalStack`) in sessions of their own (so a terminal's Ctrl-C reaches only this
process, which then stops them in order) that also die with this process (PR_SET_PDEATHSIG on Linux).
Their output goes to a log file each; until the stack is ready only a child that dies is shown, as
one block of its last lines, and after that their lines pass through prefixed with their names.
A child that exits by itself once the stack is up is restarted after a back-off (`RestartPolicy`), up to
--max-restarts times within a sliding --restart-window-s (each logged); one more exit there stops the
stack with that child's last lines. On Ctrl-C / SIGTERM the drain goes in order: the gateway first (it
stops admitting and lets its in-flight requests finish, which needs the engines), then the prefill
and decodes; each stage gets stop_grace_s before SIGKILL; nothing is left running.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import signal
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from splitserve.cli.local_stack import LocalStack, RestartPolicy
from splitserve.cli.placement import Placement, cpu_threads_per_engine, place, usable_cpus, visible_gpus
from splitserve.common.config_fields import flag_name
from splitserve.gateway.config import UpConfig

HOST = "127.0.0.1"
TRACES_HOW = "--otlp-traces-endpoint or OTEL_EXPORTER_OTLP_ENDPOINT turns them on"
# EngineConfig fields not forwarded as they are: each subcommand decides its own role; the placement
# gives each child its device and its share of the GPU's memory.
_NOT_FORWARDED = {"role", "device", "kv_cache_memory_fraction"}


def config_flags(config: Any, skip: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """A config's values that differ from the defaults, as CLI flags for a child."""
    flags: list[str] = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name in skip or value == field.default:
            continue
        flag = flag_name(field.name)
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, "none" if value is None else str(value)]
    return flags


def check_ports(up: UpConfig) -> str | None:
    """An error naming two roles that would share a port, or None."""
    ports = {"gateway --grpc-port": up.grpc_port, "gateway --http-port": up.http_port}
    ports.update({f"prefill-{i} (--prefill-port + {i})": up.prefill_port + i for i in range(up.num_prefill)})
    ports.update({f"decode-{i} (--decode-port + {i})": up.decode_port + i for i in range(up.num_decode)})
    if up.metrics_ports:
        ports.update(
            {f"prefill-{i} metrics (--metrics-ports + {i})": up.metrics_ports + i for i in range(up.num_prefill)}
        )
        first = up.metrics_ports + up.num_prefill
        ports.update(
            {f"decode-{i} metrics (--metrics-ports + {up.num_prefill + i})": first + i for i in range(up.num_decode)}
        )
    seen: dict[int, str] = {}
    for name, port in ports.items():
        if port > 65535:
            return f"{name} would be port {port}, above 65535; lower its base port"
        if port in seen:
            return f"{seen[port]} and {name} would both use port {port}; choose distinct ports"
        seen[port] = name
    return None


def stack_commands(
    engine: Any,
    up: UpConfig,
    gateway_options: Any = None,
    placement: Placement | None = None,
    num_cpus: int | None = None,
) -> list[tuple[str, list[str]]]:
    """(name, argv) of every child, in start order: prefills, decodes, gateway (with the non-default
    UpGatewayConfig options: API keys, TLS, limits). Without a placement: as on a machine without GPUs.
    Engines on the CPU without --num-threads get cpu_threads_per_engine of `num_cpus` (default: usable_cpus())."""
    if placement is None:
        placement = place(engine.device, engine.kv_cache_memory_fraction, up, num_gpus=0)
    cpu_threads = 0 if engine.num_threads else cpu_threads_per_engine(placement, num_cpus or usable_cpus())
    cli = [sys.executable, "-m", "splitserve.cli"]
    eflags = config_flags(engine, _NOT_FORWARDED)
    prefills = ",".join(f"{HOST}:{up.prefill_port + i}" for i in range(up.num_prefill))
    decodes = ",".join(f"{HOST}:{up.decode_port + i}" for i in range(up.num_decode))

    def service(role: str, name: str, port: int, device: str, metrics_port: int = 0) -> list[str]:
        argv = cli + [
            role,
            "--host",
            HOST,
            "--port",
            str(port),
            "--instance-name",
            name,
            "--kv-transport",
            placement.kv_transport,
        ]
        if role == "decode":
            argv += ["--prefill-peers", prefills]
        else:  # a prefill pairs (nccl) only with the decodes `up` starts, each confirming its own pairing
            argv += ["--decode-peers", decodes]
        argv += ["--device", device]
        if metrics_port:
            argv += ["--metrics-port", str(metrics_port)]
        share = placement.fraction_of(device)
        if share is not None:
            argv += ["--kv-cache-memory-fraction", f"{share:g}"]
        if device == "cpu" and cpu_threads:
            argv += ["--num-threads", str(cpu_threads)]
        if gateway_options is not None and gateway_options.served_model_name:  # their metrics' model_name label
            argv += ["--served-model-name", gateway_options.served_model_name]
        return argv + eflags

    metrics, num_prefill = up.metrics_ports, up.num_prefill
    commands = [
        (
            f"prefill-{i}",
            service("prefill", f"prefill-{i}", up.prefill_port + i, placement.prefill_device, metrics and metrics + i),
        )
        for i in range(num_prefill)
    ]
    commands += [
        (
            f"decode-{i}",
            service("decode", f"decode-{i}", up.decode_port + i, device, metrics and metrics + num_prefill + i),
        )
        for i, device in enumerate(placement.decode_devices)
    ]
    gateway = cli + [
        "gateway",
        "--host",
        up.host,
        "--grpc-port",
        str(up.grpc_port),
        "--http-port",
        str(up.http_port),
        "--prefill",
        prefills,
        "--decode",
        decodes,
    ]
    if engine.model:
        gateway += ["--model", engine.model]  # a config.json (dummy weights): the gateway uses its directory
    if engine.model_id:
        gateway += ["--model-id", engine.model_id]
    if gateway_options is not None:
        gateway += config_flags(gateway_options)
    return commands + [("gateway", gateway)]


def _loopback_tls() -> ssl.SSLContext:
    """For polling our own gateway child on loopback over TLS: its certificate need not name 127.0.0.1."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def _get(url: str, timeout: float, headers: dict[str, str] | None = None):
    context = _loopback_tls() if url.startswith("https:") else None
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout, context=context)


def wait_ready(
    base_url: str, stack: LocalStack, timeout_s: float, should_stop: Callable[[], bool] = lambda: False
) -> str | None:
    """Poll GET /ready until 200; None when ready, else why not (naming what is not up)."""
    deadline = time.monotonic() + timeout_s
    last = "the gateway's REST port did not answer"
    while time.monotonic() < deadline and not should_stop():
        exited = stack.first_exit()
        if exited is not None:
            return f"{exited[0]} exited with code {exited[1]} before the stack was ready"
        try:
            with _get(base_url + "/ready", timeout=2):
                return None
        except urllib.error.HTTPError as exc:
            last = json.loads(exc.read() or b"{}").get("reason", f"HTTP {exc.code}")
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    return None if should_stop() else f"not ready after {timeout_s:g} s: {last}"


def public_host(up: UpConfig) -> str:
    """Where a client on this machine reaches the gateway: its --host, or loopback when that is every interface."""
    return HOST if up.host in ("", "0.0.0.0", "::") else up.host


def base_url(up: UpConfig, gateway_options: Any = None) -> str:
    scheme = "https" if gateway_options is not None and gateway_options.tls_cert else "http"
    host = public_host(up)
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{up.http_port}"


def banner(
    up: UpConfig,
    model_id: str,
    gateway_options: Any = None,
    keys_required: bool = False,
    placement: Placement | None = None,
    traces: str = "off",
) -> str:
    """URLs, where each process runs, where traces go (tracing.destination), and a ready-to-paste request (with
    the CA and API key options it needs)."""
    placement = placement or Placement("cpu", ("cpu",) * up.num_decode, "shm", {}, up.num_prefill)
    base = base_url(up, gateway_options)
    body = json.dumps({"model": model_id, "prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0})
    curl = f"curl -s {base}/v1/completions"
    if base.startswith("https:"):
        curl = f"curl -s --cacert {gateway_options.tls_cert} {base}/v1/completions"
    if keys_required:
        curl += ' -H "Authorization: Bearer $SPLITSERVE_API_KEY"'
    lines = [
        f"splitserve is up: model {model_id!r}, {up.num_prefill} prefill + {up.num_decode} decode, "
        f"KV over {placement.kv_transport}",
        *placement.describe(),
        f"  OpenAI REST  {base}/v1",
        f"  gRPC         {public_host(up)}:{up.grpc_port}  "
        f"(splitserve.v1.Generation, reflection on{', TLS' if base.startswith('https:') else ''})",
        f"  readiness    {base}/ready",
        *(
            [
                f"  metrics      {base}/metrics (gateway), http://{HOST}:{up.metrics_ports}/metrics (prefill-0), "
                f"ports {up.metrics_ports + up.num_prefill}.. (decodes)"
            ]
            if up.metrics_ports
            else []
        ),
        f"  traces       {traces}" if traces != "off" else f"  traces       off ({TRACES_HOW})",
        "Try:" if not keys_required else "Try (SPLITSERVE_API_KEY: one of the configured API keys):",
        f"  {curl} -H 'Content-Type: application/json' -d '{body}'",
        "Press Ctrl-C to stop.",
    ]
    return "\n".join(lines)


def configured_key(gateway_options: Any, env: dict[str, str]) -> str:
    """One configured API key (to ask the gateway for its model id), or "" when none is."""
    from splitserve.gateway.auth import load_api_keys

    keys = load_api_keys(gateway_options.api_keys_file if gateway_options is not None else "", env)
    return keys[0] if keys else ""


def _model_id(base: str, key: str = "") -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with _get(base + "/v1/models", timeout=5, headers=headers) as r:
            data = json.loads(r.read()).get("data", [])
    except (urllib.error.URLError, OSError, ValueError):
        return ""
    return data[0]["id"] if data else ""


def run_up(ns: Any, configs: dict[str, Any]) -> int:
    """Entry point of `splitserve up` (see splitserve.cli): 0 after Ctrl-C, 1 when a child failed."""
    engine, up = configs["EngineConfig"], configs["UpConfig"]
    gateway_options = configs.get("UpGatewayConfig")
    problem = check_ports(up)
    if problem:
        print(f"splitserve up: error: {problem}", file=sys.stderr)
        return 2
    try:
        num_gpus = visible_gpus() if engine.device != "cpu" else 0
        placement = place(engine.device, engine.kv_cache_memory_fraction, up, num_gpus)
    except ValueError as exc:
        print(f"splitserve up: error: {exc}", file=sys.stderr)
        return 2
    stopping: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda sig, frame: stopping.append(sig))
    stack = LocalStack()
    # the children prove themselves to each other with a secret of this run unless one is given
    stack.env.setdefault("SPLITSERVE_INTERNAL_TOKEN", secrets.token_hex(16))
    from splitserve.runtime.tracing import destination

    base = base_url(up, gateway_options)
    endpoint = gateway_options.otlp_traces_endpoint if gateway_options is not None else ""
    if endpoint:  # the engines trace to the same collector as the gateway
        stack.env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = endpoint
    try:
        key = configured_key(gateway_options, dict(os.environ))
        traces = destination(stack.env, endpoint)
    except ValueError as exc:  # an unreadable keys file, an unknown OTEL_* value: say so before starting anything
        print(f"splitserve up: error: {exc}", file=sys.stderr)
        return 2
    try:
        started = time.monotonic()
        commands = stack_commands(engine, up, gateway_options, placement)
        for name, argv in commands:
            stack.add(name, argv)
        names = ", ".join(name for name, _ in commands)
        print(f"splitserve up: started {names} (logs in {stack.log_dir}); waiting for ready", file=sys.stderr)
        error = wait_ready(base, stack, up.ready_timeout_s, should_stop=lambda: bool(stopping))
        if error:
            exited = stack.first_exit()
            print(f"splitserve up: {error}", file=sys.stderr)
            if exited is not None:
                print(stack.failure_report(*exited), file=sys.stderr)
            return 1
        if stopping:
            return 0
        print(f"splitserve up: ready in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
        stack.echo()
        print(banner(up, _model_id(base, key), gateway_options, bool(key), placement, traces), flush=True)
        restarts = RestartPolicy(up.max_restarts, up.restart_window_s, up.restart_backoff_s)
        due: dict[str, float] = {}  # child -> when it starts again
        while not stopping:
            now = time.monotonic()
            for name in [n for n, at in due.items() if at <= now]:
                del due[name]
                stack.restart(name)
            for name, code in stack.exited(skip=due):
                delay = restarts.delay(name, now)
                if delay is None:
                    print(
                        f"splitserve up: {name} exited with code {code} after {up.max_restarts} restarts within "
                        f"--restart-window-s {up.restart_window_s:g} (--max-restarts {up.max_restarts}); "
                        "stopping the stack",
                        file=sys.stderr,
                    )
                    print(stack.failure_report(name, code), file=sys.stderr)
                    return 1
                due[name] = now + delay
                print(
                    f"splitserve up: {name} exited with code {code}; restarting it in {delay:g} s (restart "
                    f"{restarts.count(name)} of --max-restarts {up.max_restarts} within --restart-window-s "
                    f"{up.restart_window_s:g})",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(0.25)
        return 0
    finally:
        print("splitserve up: stopping (the gateway drains first, then the engines)", file=sys.stderr, flush=True)
        stack.stop(up.stop_grace_s, first=["gateway"])
