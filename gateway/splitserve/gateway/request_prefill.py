"""A request run's calls to a prefill instance: `Prefill.Prefill` for the prompt, `Prefill.ReleaseKv` for a lease
no decode will claim, and which failures mean what.

    call_prefill ──answer (first token + KvHandle)──▶ the run hands the lease to a decode
         └──── AioRpcError: REFUSAL_CODES → the client's error; MARK_DOWN_CODES → the prefill is marked down;
               the run tries another prefill, else a local prefill on a decode (prefill_failed)
    release_kv: best effort (a lease expires anyway)
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc

from splitserve.gateway.errors import GatewayError, invalid
from splitserve.gateway.registry import Instance
from splitserve.protos import common_pb2, prefill_pb2
from splitserve.runtime import tracing

if TYPE_CHECKING:
    from splitserve.gateway.registry import Registry
    from splitserve.gateway.router import Router

log = logging.getLogger("splitserve.gateway")
# Prefill failures that mean "this instance is broken": stop routing to it.
MARK_DOWN_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.DATA_LOSS,
}
# Prefill answers that are about the request itself: the client gets them, no fallback.
REFUSAL_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION}
_RELEASE_TIMEOUT_S = 5.0


async def call_prefill(
    router: Router, prefill: Instance, request: prefill_pb2.PrefillRequest, *, parent_span, timeout_s: float
) -> prefill_pb2.PrefillResponse | grpc.aio.AioRpcError:
    """Call Prefill on `prefill`, counted on it in `router` while it runs and traced as a child of `parent_span`:
    its answer, or the failed call's error. Cancelling it cancels the call."""
    router.assign(prefill, request.prompt_token_ids)
    span = tracing.start_span(
        "gateway.prefill", tracing.context_of(parent_span), {"prefill": prefill.name}, kind="client"
    )
    call = prefill.prefill_stub.Prefill(
        request, timeout=max(0.001, timeout_s), metadata=tuple(tracing.inject(span).items()) or None
    )
    try:
        return await call
    except asyncio.CancelledError:
        call.cancel()
        raise
    except grpc.aio.AioRpcError as exc:
        tracing.end_span(span, f"{exc.code().name}: {exc.details()}")
        span = None
        return exc
    finally:
        tracing.end_span(span)
        router.release(prefill)


def prefill_failed(
    registry: Registry,
    prefill: Instance,
    exc: grpc.aio.AioRpcError,
    *,
    timeout_message: str | None,
    request_id: str,
    internal_id: str,
) -> None:
    """Raise the client's error when a failed Prefill call was about the request (a refusal) or its deadline
    (`timeout_message`: set when the request's time is up); else mark the prefill down if broken."""
    code = exc.code()
    if code in REFUSAL_CODES:
        raise invalid(f"prefill instance {prefill.name} refused the request: {exc.details()}", "prompt")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout_message is not None:
        raise GatewayError("deadline_exceeded", timeout_message)
    reason = f"prefill instance {prefill.name} failed: {code.name}: {exc.details()}"
    if code in MARK_DOWN_CODES:
        registry.mark_down(prefill, reason)
    log.warning(
        "request_id=%s internal_id=%s %s; trying another prefill, else a local prefill on a decode",
        request_id,
        internal_id,
        reason,
    )


async def release_kv(prefill: Instance, kv: common_pb2.KvHandle) -> None:
    """Unpin a lease the gateway will not hand to any decode (best effort; leases expire)."""
    request = prefill_pb2.ReleaseKvRequest(lease_id=kv.lease.lease_id, epoch=kv.lease.epoch)
    try:
        await prefill.prefill_stub.ReleaseKv(request, timeout=_RELEASE_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        log.info(
            "ReleaseKv of lease %s on %s failed (it will expire): %s", kv.lease.lease_id, prefill.name, exc.details()
        )
    except grpc.aio.UsageError:  # the prefill left its pool and its channel is closed (members.py)
        log.info(
            "ReleaseKv of lease %s on %s skipped: it left the pool (the lease expires)", kv.lease.lease_id, prefill.name
        )
