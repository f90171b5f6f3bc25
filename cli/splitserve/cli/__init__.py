"""The `splitserve` command: up, serve, gateway, prefill, decode, worker, generate, bench.

Each subcommand builds its frozen configs from flags and SPLITSERVE_* variables, prints what differs
from the defaults (every field with SPLITSERVE_LOG_LEVEL=DEBUG), and runs. A subcommand's own modules
are imported only when it is chosen (each `_load_*` function below imports them by name), so
`splitserve gateway` never loads torch and `splitserve --help` loads nothing of the stack. An import
that fails is an error, never a silently missing flag.

`--role` is no flag: the subcommand decides it (prefill, decode, worker = both; `up` starts
one of each; `generate` runs both in one process).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.common.config_fields import ConfigError, add_arguments, describe, describe_changes, from_namespace

Runner = Callable[[argparse.Namespace, dict[str, object]], int | None]


@dataclass(frozen=True)
class Loaded:
    """What a subcommand runs: its config classes (flags in this order) and its entry function."""

    config_classes: tuple[type, ...]
    run: Runner
    role: str | None = None  # EngineConfig.role this subcommand fixes (None: it has no EngineConfig)
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None  # flags beyond the configs'
    prepare: Callable[[argparse.Namespace], None] | None = None  # the namespace adjusted before configs are built


def _load_up() -> Loaded:
    from splitserve.cli.supervisor import run_up
    from splitserve.common.config import EngineConfig
    from splitserve.gateway.config import UpConfig, UpGatewayConfig

    return Loaded((EngineConfig, UpConfig, UpGatewayConfig), run_up, role="both")


def _load_serve() -> Loaded:
    from splitserve.cli.serve import add_serve_arguments, prepare_serve, run_serve
    from splitserve.common.config import EngineConfig
    from splitserve.gateway.config import UpConfig, UpGatewayConfig

    return Loaded((EngineConfig, UpConfig, UpGatewayConfig), run_serve, "both", add_serve_arguments, prepare_serve)


def _load_gateway() -> Loaded:
    from splitserve.gateway.config import GatewayConfig
    from splitserve.gateway.server import run

    return Loaded((GatewayConfig,), run)


def _load_service(role: str) -> Callable[[], Loaded]:
    def load() -> Loaded:
        from splitserve.common.config import EngineConfig
        from splitserve.engine_service.config import ServiceConfig

        if role == "prefill":
            from splitserve.prefill_service.server import run
        elif role == "decode":
            from splitserve.decode_service.server import run
        else:
            from splitserve.decode_service.server import run_worker as run
        return Loaded((EngineConfig, ServiceConfig), run, role=role)

    return load


def _load_generate() -> Loaded:
    from splitserve.common.config import EngineConfig
    from splitserve.engine.offline_cli import GenerateConfig, run

    return Loaded((EngineConfig, GenerateConfig), run, role="both")


def _load_bench() -> Loaded:
    from splitserve.bench.cli import run

    return Loaded((), run)


# subcommand -> (help, loader)
SUBCOMMANDS: dict[str, tuple[str, Callable[[], Loaded]]] = {
    "up": ("start gateway + prefill + decode on loopback with the default model", _load_up),
    "serve": ("`up` with vLLM's flag names: splitserve serve MODEL --port 8000 --api-key KEY", _load_serve),
    "gateway": ("run the gateway (gRPC Generation API + REST shim)", _load_gateway),
    "prefill": ("run a prefill service", _load_service("prefill")),
    "decode": ("run a decode service", _load_service("decode")),
    "worker": ("run a colocated worker (prefill and decode in one engine)", _load_service("both")),
    "generate": ("generate offline from prompts, no servers", _load_generate),
    "bench": ("run the serving benchmark (`splitserve bench serve --help`)", _load_bench),
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve", description="LLM serving with disaggregated prefill and decode."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, _) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text, add_help=False)
    return parser


def build_parser(command: str, loaded: Loaded) -> argparse.ArgumentParser:
    """The full parser of one subcommand."""
    help_text = SUBCOMMANDS[command][0]
    parser = argparse.ArgumentParser(prog=f"splitserve {command}", description=help_text)
    if command == "bench":
        parser.add_argument("benchmark", help="benchmark name: serve")
        parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    if loaded.add_arguments is not None:
        loaded.add_arguments(parser)
    for cls in loaded.config_classes:
        add_arguments(parser, cls, exclude=frozenset({"role"}) if cls.__name__ == "EngineConfig" else frozenset())
    return parser


def build_configs(loaded: Loaded, ns: argparse.Namespace) -> dict[str, object]:
    """Build every config class of the subcommand from the namespace; class name -> config."""
    if loaded.prepare is not None:
        loaded.prepare(ns)
    configs = {}
    for cls in loaded.config_classes:
        overrides = {"role": loaded.role} if cls.__name__ == "EngineConfig" else {}
        configs[cls.__name__] = from_namespace(cls, ns, **overrides)
    return configs


def resolve_models(configs: dict[str, object]) -> dict[str, object]:
    """Each config's `--model` given as a Hugging Face id replaced by its snapshot directory in the hub
    cache (an engine's model_id becomes the id), once, before anything starts: the processes a
    subcommand starts (`up`'s children) and the engine core get a directory. ConfigError when it
    cannot be resolved (splitserve.common.model_source)."""
    from splitserve.common.model_source import resolve_model_config

    resolved = {}
    for name, config in configs.items():
        has_model = hasattr(config, "revision")
        resolved[name] = resolve_model_config(config, name_by_hub_id=name == "EngineConfig") if has_model else config
    return resolved


def parse_args(argv: list[str]) -> tuple[str, Loaded, argparse.Namespace]:
    """Parse `COMMAND FLAGS...`: (command, what it runs, its flags). Exits 2 (0 for --help) as argparse does."""
    if not argv or argv[0] not in SUBCOMMANDS:
        _top_parser().parse_args(argv)  # prints usage, or the help, and exits
        raise SystemExit(2)  # only if argparse accepted a subcommand it does not list
    command = argv[0]
    loaded = SUBCOMMANDS[command][1]()
    return command, loaded, build_parser(command, loaded).parse_args(argv[1:])


def main(argv: list[str] | None = None) -> int:
    command, loaded, ns = parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        configs = resolve_models(build_configs(loaded, ns))
    except ConfigError as exc:
        print(f"splitserve {command}: error: {exc}", file=sys.stderr)
        return 2
    full = os.environ.get("SPLITSERVE_LOG_LEVEL", "INFO").upper() == "DEBUG"
    for config in configs.values():  # every field at DEBUG; else what differs from the defaults
        print(describe(config) if full else describe_changes(config), file=sys.stderr)
    from splitserve.runtime.grpc_server import PortInUse

    try:
        return int(loaded.run(ns, configs) or 0)
    except PortInUse as exc:  # a clear line and exit status 1, not a traceback
        print(f"splitserve {command}: error: {exc}", file=sys.stderr)
        return 1
