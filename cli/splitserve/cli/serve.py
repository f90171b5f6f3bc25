"""`splitserve serve MODEL`: `splitserve up` under vLLM's flag names, for users of `vllm serve`.

The same local disaggregated stack as `up` (supervisor.py: one prefill, decodes, a gateway), with the model
as the first argument and vLLM's names where the meaning is the same: `--host`, `--port`, `--api-key`,
`--chat-template`, `--served-model-name`, `--gpu-memory-utilization`, `--max-model-len`,
`--enable-log-requests` / `--disable-log-requests` (most are config flags of their own or aliases, see
gateway/config.py and common/config.py). `--api-key` is repeatable and takes several keys, space- or
comma-separated, as vLLM's does; the keys reach the gateway through SPLITSERVE_API_KEYS, never a
command line that `ps` shows.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from splitserve.common.config_fields import ConfigError
from splitserve.gateway.auth import API_KEYS_ENV


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `serve` beyond its config classes': the positional model and --api-key."""
    parser.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="model directory or Hugging Face id (as --model)"
    )
    parser.add_argument(
        "--api-key",
        dest="api_key",
        action="extend",
        nargs="+",
        default=None,
        metavar="KEY",
        help="API key every public call must carry as 'Authorization: Bearer KEY'; repeat it or give several "
        "(space- or comma-separated) for several keys (vLLM's --api-key)",
    )


def prepare_serve(ns: argparse.Namespace) -> None:
    """The positional model is --model; both given and different is an error."""
    if ns.model_tag is not None:
        if ns.model not in (None, ns.model_tag):
            raise ConfigError(f"the model is given twice: {ns.model_tag!r} and --model {ns.model!r}")
        ns.model = ns.model_tag


def api_keys(ns: argparse.Namespace) -> list[str]:
    """The --api-key values, split at commas, in order, repeats dropped."""
    keys = [part.strip() for value in ns.api_key or () for part in value.split(",")]
    return list(dict.fromkeys(k for k in keys if k))


def run_serve(ns: argparse.Namespace, configs: dict[str, Any]) -> int:
    """Entry point of `splitserve serve` (see splitserve.cli): `up`, the --api-key keys added to the others."""
    from splitserve.cli.supervisor import run_up

    keys = api_keys(ns)
    if keys:
        present = [k for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
        os.environ[API_KEYS_ENV] = ",".join([*present, *keys])  # the children inherit it (LocalStack)
    return run_up(ns, configs)
