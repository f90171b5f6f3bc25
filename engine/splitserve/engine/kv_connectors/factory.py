"""The KV connectors by transport name: the one place a transport is chosen (`make_connector`).

`TRANSPORTS` names them without importing any (no torch: configs and the gateway validate against it); a
connector's module is imported when it is made.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.engine.kv_connectors.base import KvConnector

# transport -> (module, class)
CONNECTORS: dict[str, tuple[str, str]] = {
    "shm": ("splitserve.engine.kv_connectors.shm", "ShmConnector"),
    "cuda_ipc": ("splitserve.engine.kv_connectors.cuda_ipc", "CudaIpcConnector"),
    "nccl": ("splitserve.engine.kv_connectors.nccl", "NcclConnector"),
    "nixl": ("splitserve.engine.kv_connectors.nixl", "NixlConnector"),
}
TRANSPORTS = tuple(CONNECTORS)
# transports whose decode reads the prefill's pool itself, on the same host (the others: the prefill sends)
MAPPED_TRANSPORTS = ("shm", "cuda_ipc")


def connector_class(transport: str) -> type[KvConnector]:
    """The connector class of `transport`, its module imported now."""
    if transport not in CONNECTORS:
        raise ValueError(f"unknown KV transport {transport!r}; known: {', '.join(TRANSPORTS)}")
    module, name = CONNECTORS[transport]
    return getattr(importlib.import_module(module), name)


def make_connector(options: dict) -> KvConnector:
    """The connector of `options["transport"]` (default shm); see KvConnector for the other options."""
    return connector_class(options.get("transport", "shm"))(options)
