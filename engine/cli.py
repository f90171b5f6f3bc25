"""The `splitserve` command: up, gateway, prefill, decode, worker, generate, bench.

Each subcommand builds its frozen configs from flags and SPLITSERVE_* variables,
prints them, and runs. Service subcommands import their packages lazily so that
`splitserve --help` and `splitserve generate` never load gRPC servers or FastAPI.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable

from engine.config import EngineConfig
from engine.config_fields import ConfigError, add_arguments, describe, from_namespace

# subcommand -> (help, "module:function" that takes the parsed namespace, config classes to expose)
SUBCOMMANDS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "up": ("start gateway + prefill + decode on loopback with the default model", "gateway.up:run_up", ("engine.config:EngineConfig", "gateway.config:UpConfig", "gateway.config:UpGatewayConfig")),
    "gateway": ("run the gateway (gRPC Generation API + REST shim)", "gateway.server:run", ("gateway.config:GatewayConfig",)),
    "prefill": ("run a prefill service", "prefill_service.server:run", ("engine.config:EngineConfig", "engine.service_config:ServiceConfig")),
    "decode": ("run a decode service", "decode_service.server:run", ("engine.config:EngineConfig", "engine.service_config:ServiceConfig")),
    "worker": ("run a colocated worker (prefill and decode in one engine)", "decode_service.server:run_worker", ("engine.config:EngineConfig", "engine.service_config:ServiceConfig")),
    "generate": ("generate offline from prompts, no servers", "engine.offline_cli:run", ("engine.config:EngineConfig", "engine.offline_cli:GenerateConfig")),
    "bench": ("run a benchmark from bench/ (offline_throughput, kernels, serve)", "bench.cli:run", ()),
}


def _load(ref: str) -> Callable | type:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _config_classes(refs: tuple[str, ...]) -> list[type]:
    classes = []
    for ref in refs:
        try:
            classes.append(_load(ref))
        except (ImportError, AttributeError):
            continue  # the part of the stack that defines it is not installed in this build
    return classes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description="LLM serving with disaggregated prefill and decode.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, _, config_refs) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == "bench":
            p.add_argument("benchmark", help="benchmark name, e.g. offline_throughput")
            p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
            continue
        for cls in _config_classes(config_refs):
            add_arguments(p, cls)
        p.set_defaults(config_classes=config_refs)
    return parser


def build_configs(ns: argparse.Namespace) -> dict[str, object]:
    """Build every config class of the subcommand from the namespace; name -> config."""
    configs = {}
    for cls in _config_classes(getattr(ns, "config_classes", ())):
        configs[cls.__name__] = from_namespace(cls, ns)
    return configs


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    _, target, _ = SUBCOMMANDS[ns.command]
    try:
        configs = build_configs(ns)
    except ConfigError as exc:
        print(f"splitserve {ns.command}: error: {exc}", file=sys.stderr)
        return 2
    for config in configs.values():
        print(describe(config), file=sys.stderr)
    try:
        runner = _load(target)
    except (ImportError, AttributeError) as exc:
        print(f"splitserve {ns.command}: not available in this build yet ({exc})", file=sys.stderr)
        return 2
    return int(runner(ns, configs) or 0)


if __name__ == "__main__":
    sys.exit(main())
