"""The KV connectors by transport name: the one place a transport is chosen (`make_connector`)."""

from __future__ import annotations

from splitserve.engine.kv_transfer.collective import CollectiveConnector
from splitserve.engine.kv_transfer.connector import KvConnector
from splitserve.engine.kv_transfer.mapped import CudaIpcConnector, ShmConnector

CONNECTORS: dict[str, type[KvConnector]] = {
    cls.transport: cls for cls in (ShmConnector, CudaIpcConnector, CollectiveConnector)
}
TRANSPORTS = tuple(CONNECTORS)


def make_connector(options: dict) -> KvConnector:
    """The connector of `options["transport"]` (default shm); see KvConnector for the other options."""
    transport = options.get("transport", "shm")
    cls = CONNECTORS.get(transport)
    if cls is None:
        raise ValueError(f"unknown KV transport {transport!r}; known: {', '.join(TRANSPORTS)}")
    return cls(options)
