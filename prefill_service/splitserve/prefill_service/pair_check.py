"""Which decodes a prefill pairs with (the nccl transport's communicators).

With --decode-peers, a PairKv is accepted only when one of those decodes, asked at the address the
operator listed, confirms it (Decode.ConfirmPair): it is the instance the PairKv names and is pairing with
this prefill through the store the PairKv names, now. A forged PairKv (an unknown decode, another
decode's name, a store elsewhere) is refused before the engine core hears of it, so the communicator of
a real pair stays, and no lease's KV is ever sent to a store a caller chose.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from splitserve.protos import decode_pb2, decode_pb2_grpc
from splitserve.runtime.grpc_server import InternalAuth, internal_channel

log = logging.getLogger("splitserve.prefill")

CONFIRM_TIMEOUT_S = 5.0


class PairRefused(Exception):
    """No listed decode confirms a PairKv."""


class DecodePeers:
    """The decodes of --decode-peers (addresses) and their stubs; empty = every caller may pair."""

    def __init__(self, addresses: str, prefill_instance: str, auth: InternalAuth | None) -> None:
        self.addresses = tuple(a.strip() for a in addresses.split(",") if a.strip())
        self.prefill_instance = prefill_instance
        self.auth = auth
        self._stubs: dict[str, decode_pb2_grpc.DecodeStub] = {}

    def _stub(self, address: str) -> decode_pb2_grpc.DecodeStub:
        if address not in self._stubs:
            self._stubs[address] = decode_pb2_grpc.DecodeStub(internal_channel(address, self.auth))
        return self._stubs[address]

    async def check(self, decode_instance: str, store_host: str, store_port: int) -> None:
        """Return when a listed decode confirms this pairing (or none are listed); raise PairRefused otherwise.
        The decodes are asked at once; the first yes ends the wait."""
        if not self.addresses:
            return
        question = decode_pb2.ConfirmPairRequest(
            prefill_instance=self.prefill_instance,
            decode_instance=decode_instance,
            store_host=store_host,
            store_port=store_port,
        )
        asks = [asyncio.create_task(self._ask(address, question)) for address in self.addresses]
        try:
            for answer in asyncio.as_completed(asks):
                if await answer:
                    return
        finally:
            for ask in asks:
                ask.cancel()
        raise PairRefused(
            f"PairKv as decode {decode_instance[:128]!r} with store {store_host[:128]}:{store_port} refused: "
            f"no decode of this prefill's --decode-peers ({', '.join(self.addresses)}) confirms that pairing"
        )

    async def _ask(self, address: str, question: decode_pb2.ConfirmPairRequest) -> bool:
        try:
            reply = await self._stub(address).ConfirmPair(question, timeout=CONFIRM_TIMEOUT_S)
        except grpc.RpcError as exc:
            log.warning("asking decode %s to confirm a pairing failed: %s", address, exc.details() or exc.code())
            return False
        return reply.confirmed
