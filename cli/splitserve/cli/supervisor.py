"""`splitserve up`: N prefills (--num-prefill), M decodes (--num-decode) and the gateway on loopback, until Ctrl-C.

Placement (`place`): no GPU (or --device cpu) -> every process on the CPU, KV over shm; one GPU ->
the prefills and the decodes share cuda:0, each allowed an equal part of --kv-cache-memory-fraction,
KV over cuda_ipc; several GPUs -> the prefills on cuda:0, the decodes on the others, cuda_ipc.
--prefill-device / --decode-device and --kv-transport override it; a transport the placement
cannot run is refused before anything starts.

Children are `python -m splitserve.cli <subcommand>` processes of the installed package (nothing of
ours on their path: `LocalStack`) in sessions of their own (so a terminal's Ctrl-C reaches only this
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

import collections
import ctypes
import dataclasses
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.common.config_fields import flag_name
from splitserve.common.nixl_package import nixl_missing
from splitserve.gateway.config import UpConfig

HOST = "127.0.0.1"
TRACES_HOW = "--otlp-traces-endpoint or OTEL_EXPORTER_OTLP_ENDPOINT turns them on"
# EngineConfig fields not forwarded as they are: each subcommand decides its own role; the placement
# gives each child its device and its share of the GPU's memory.
_NOT_FORWARDED = {"role", "device", "kv_cache_memory_fraction"}
_PR_SET_PDEATHSIG = 1


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


@dataclass(frozen=True)
class Placement:
    """Where each engine process runs and how KV moves between them."""

    prefill_device: str
    decode_devices: tuple[str, ...]
    kv_transport: str
    memory_fraction: dict[str, float]  # CUDA device -> each of its processes' --kv-cache-memory-fraction
    num_prefill: int = 1  # prefill instances, all on prefill_device

    def fraction_of(self, device: str) -> float | None:
        return self.memory_fraction.get(device)

    @property
    def engine_devices(self) -> list[str]:
        """The device of every engine process: the prefills', then the decodes'."""
        return [self.prefill_device] * self.num_prefill + list(self.decode_devices)

    def describe(self) -> list[str]:
        """One line per engine process, for the banner."""
        lines = []
        for name, device in [(f"prefill-{i}", self.prefill_device) for i in range(self.num_prefill)] + [
            (f"decode-{i}", d) for i, d in enumerate(self.decode_devices)
        ]:
            share = self.fraction_of(device)
            lines.append(f"  {name:<12} {device}" + (f" (memory fraction {share:g})" if share is not None else ""))
        return lines


def visible_gpus() -> int:
    """CUDA devices this machine offers, asked of torch in a child process (this one never imports torch);
    0 when torch sees none or cannot say."""
    if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidiactl"):
        return 0  # no NVIDIA driver: skip starting torch
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
        return int(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return 0


def _is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def place(device: str, fraction: float, up: UpConfig, num_gpus: int) -> Placement:
    """The placement for EngineConfig.device `device` on a machine with `num_gpus` GPUs (module docstring).
    Raises ValueError naming the flag when a choice cannot run."""
    if _is_cuda(device) and num_gpus == 0:
        raise ValueError(f"--device {device}, but no CUDA device is visible; use --device cpu (or auto)")
    if device.startswith("cuda:") and int(device.split(":")[1]) >= num_gpus:
        raise ValueError(f"--device {device}, but {num_gpus} CUDA device(s) are visible")
    if device == "cpu" or num_gpus == 0:
        prefill, decodes = "cpu", ["cpu"] * up.num_decode
    elif device.startswith("cuda:"):
        prefill, decodes = device, [device] * up.num_decode
    elif num_gpus == 1:
        prefill, decodes = "cuda:0", ["cuda:0"] * up.num_decode
    else:
        prefill, decodes = "cuda:0", [f"cuda:{1 + i % (num_gpus - 1)}" for i in range(up.num_decode)]
    prefill = up.prefill_device or prefill
    if up.decode_device:
        listed = [d.strip() for d in up.decode_device.split(",")]
        if len(listed) not in (1, up.num_decode):
            raise ValueError(
                f"--decode-device lists {len(listed)} devices for {up.num_decode} decodes: give one, or one per decode"
            )
        decodes = listed * up.num_decode if len(listed) == 1 else listed
    for flag, d in [("--prefill-device", prefill)] + [("--decode-device", d) for d in decodes]:
        if d != "cpu" and not (d.startswith("cuda:") and d[5:].isdigit() and int(d[5:]) < num_gpus):
            raise ValueError(f"{flag} {d}: choose cpu or cuda:N with N < {num_gpus} (the CUDA devices visible)")
    transport = up.kv_transport if up.kv_transport != "auto" else ("cuda_ipc" if _is_cuda(prefill) else "shm")
    if transport == "shm" and _is_cuda(prefill):
        raise ValueError(f"--kv-transport shm needs the prefill's pool in host memory; the prefill runs on {prefill}")
    if transport == "cuda_ipc" and not all(_is_cuda(d) for d in [prefill, *decodes]):
        raise ValueError("--kv-transport cuda_ipc needs the prefill and every decode on CUDA devices")
    if transport == "nccl" and len({_is_cuda(d) for d in [prefill, *decodes]}) > 1:
        raise ValueError("--kv-transport nccl needs the prefill and the decodes all on CUDA or all on the CPU")
    if transport == "nixl" and (missing := nixl_missing()):
        raise ValueError(missing)
    counts = Counter(d for d in [prefill] * up.num_prefill + decodes if _is_cuda(d))
    shares = {d: round(fraction / n, 4) for d, n in counts.items()}
    return Placement(prefill, tuple(decodes), transport, shares, up.num_prefill)


def usable_cpus() -> int:
    """Cores this process (and so its children) may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_threads_per_engine(placement: Placement, num_cpus: int) -> int:
    """Torch threads for each engine process on the CPU: an equal share of the cores, at least one; 0 when none
    runs on the CPU. Why not torch's default (every core in each process): the prefill's and the decodes' OpenMP
    pools then outnumber the cores, and a pool waits for a thread the kernel has given to the other process
    (spinning meanwhile; docs/performance.md, "Findings that set defaults": CPU engine threads)."""
    num_cpu_engines = placement.engine_devices.count("cpu")
    return max(1, num_cpus // num_cpu_engines) if num_cpu_engines else 0


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


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: children are still stopped by LocalStack.stop


MAX_RESTART_BACKOFF_S = 30.0


class RestartPolicy:
    """When up starts a child that exited by itself again: after `backoff_s`, doubled for each of its restarts
    still inside the sliding window (at most MAX_RESTART_BACKOFF_S), and only while fewer than `max_restarts`
    of them are: a crash loop stops the stack (and is reported) within a window, while a child that fails once
    in a while is restarted every time, however long up runs."""

    def __init__(self, max_restarts: int, window_s: float, backoff_s: float) -> None:
        self.max_restarts, self.window_s, self.backoff_s = max_restarts, window_s, backoff_s
        self._times: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)

    def delay(self, name: str, now: float) -> float | None:
        """Seconds to wait before restarting `name`, whose exit was seen at `now`; None: its budget is spent."""
        recent = self._times[name]
        while recent and recent[0] <= now - self.window_s:
            recent.popleft()
        if len(recent) >= self.max_restarts:
            return None
        delay = min(self.backoff_s * 2 ** len(recent), MAX_RESTART_BACKOFF_S)
        recent.append(now)
        return delay

    def count(self, name: str) -> int:
        """The restarts of `name` in the window, the one just granted included."""
        return len(self._times[name])


class LocalStack:
    """Child processes started together and always stopped together.

    Each child runs the installed splitserve with the same interpreter, with `PYTHONSAFEPATH=1` and no folder
    of ours added to its path: `python -m` and `python -c` would otherwise put the working directory first on
    `sys.path`, where a checkout's top-level folders shadow libraries of the same name (`kernels`). A child's
    stdout and stderr go to `log_dir/<name>.log`; its last `tail_lines` lines are kept for `failure_report`,
    and once `echo()` is called each new line is also written to `out`, prefixed with the child's name.
    """

    def __init__(
        self,
        env: dict[str, str] | None = None,
        die_with_parent: bool = True,
        log_dir: str | None = None,
        out: Any = None,
        tail_lines: int = 40,
    ) -> None:
        self._preexec = _die_with_parent if die_with_parent else None  # unsafe in threaded parents
        self.env = dict(os.environ if env is None else env)
        self.env["PYTHONSAFEPATH"] = "1"
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="splitserve-up-")
        self.procs: dict[str, subprocess.Popen] = {}
        self.argvs: dict[str, list[str]] = {}
        self._out = out if out is not None else sys.stderr
        self._tail_lines = tail_lines
        self._tails: dict[str, collections.deque[str]] = {}
        self._readers: list[threading.Thread] = []
        self._echo = threading.Event()
        self._write_lock = threading.Lock()

    def add(self, name: str, argv: Sequence[str]) -> None:
        self.argvs[name] = list(argv)
        proc = subprocess.Popen(
            list(argv),
            env=self.env,
            start_new_session=True,
            preexec_fn=self._preexec,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.procs[name] = proc
        self._tails[name] = collections.deque(maxlen=self._tail_lines)
        reader = threading.Thread(target=self._read, args=(name, proc), name=f"up-log-{name}", daemon=True)
        reader.start()
        self._readers.append(reader)

    def log_path(self, name: str) -> str:
        return os.path.join(self.log_dir, f"{name}.log")

    def _read(self, name: str, proc: subprocess.Popen) -> None:
        """Copy one child's output to its log (appended across restarts) and, once echoing, to `out`."""
        with open(self.log_path(name), "ab") as log:
            for raw in iter(proc.stdout.readline, b""):
                log.write(raw)
                log.flush()
                line = raw.decode(errors="replace").rstrip("\n")
                self._tails[name].append(line)
                if self._echo.is_set():
                    with self._write_lock:
                        print(f"{name:<9} | {line}", file=self._out, flush=True)
        proc.stdout.close()

    def echo(self) -> None:
        """From now on every child's new lines are also written to `out`, prefixed with its name."""
        self._echo.set()

    def failure_report(self, name: str, code: int) -> str:
        """One block for a child that exited: its name and code, then its last lines, each prefixed."""
        proc = self.procs[name]
        for reader in self._readers:
            if reader.name == f"up-log-{name}" and proc.poll() is not None:
                reader.join(timeout=2.0)  # the pipe closes with the process: its last lines are in
        tail = list(self._tails[name])
        head = f"{name} exited with code {code}; its last {len(tail)} lines (all of them: {self.log_path(name)}):"
        return "\n".join([head, *(f"{name:<9} | {line}" for line in tail)])

    def restart(self, name: str) -> None:
        """Start child `name` again with the command it had."""
        self.add(name, self.argvs[name])

    def exited(self, skip: Container[str] = ()) -> list[tuple[str, int]]:
        """(name, exit code) of every child that has exited, less those in `skip`."""
        return [(n, p.returncode) for n, p in self.procs.items() if n not in skip and p.poll() is not None]

    def first_exit(self) -> tuple[str, int] | None:
        """(name, exit code) of a child that has exited, if any."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                return name, proc.returncode
        return None

    def stop(self, grace_s: float, first: Sequence[str] = ()) -> dict[str, int]:
        """Stop the children named in `first`, then the rest: each stage gets SIGTERM, and SIGKILL
        for those still running after grace_s; name -> exit code."""
        stages = [[n for n in first if n in self.procs], [n for n in self.procs if n not in first]]
        for stage in stages:
            procs = [self.procs[n] for n in stage]
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            deadline = time.monotonic() + grace_s
            for proc in procs:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for reader in self._readers:
            reader.join(timeout=2.0)
        return {name: proc.returncode for name, proc in self.procs.items()}


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
