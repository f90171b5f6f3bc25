"""Each pool's instances: one `Instance` per member address, and the members that left and are drained.

    pool flag entries ──discovery.py──▶ Member(address, server_name) ──Members.apply──▶ Instance
                                                                      (new, rejoining, or moved to leaving)

A member the DNS no longer lists moves to `leaving`: the router no longer sees it, its running requests (this
gateway's, on its Decode.Generate stream or in a Prefill call) finish there, and `retire_idle` hands it back for
closing once none runs. Listed again before that, the same instance rejoins with its link and its running
streams, so a flapping member never loses or repeats a request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from splitserve.gateway.decode_link import DecodeLink
from splitserve.gateway.discovery import Member
from splitserve.protos import common_pb2, prefill_pb2_grpc

log = logging.getLogger("splitserve.gateway")

POOL_ROLES = {"prefill": ("prefill", "both"), "decode": ("decode", "both")}  # pool -> roles it may hold
MEMBER_STATES = ("up", "draining", "down")


@dataclass(eq=False)
class Instance:
    """One member's address and what its last Describe said.

    `pool` is the flag that listed it ("prefill" or "decode"); `server_name`, the DNS name it was found
    under ("" for a fixed address), is what its certificate is checked against. `in_flight` counts this
    gateway's requests on it; `pending_*` count work assigned since its last Describe
    (which that Describe could not reflect yet) so a burst spreads before the next one.
    """

    address: str
    pool: str
    channel: grpc.aio.Channel
    health_channel: grpc.aio.Channel | None = None  # Describe only; None: `channel`
    health_address: str = ""  # where health_channel goes when not `address`: the instance's health server
    server_name: str = ""
    describe: common_pb2.DescribeResponse | None = None
    reachable: bool = False
    error: str = "not contacted yet"
    num_describe_failures: int = 0
    num_slow_describes: int = 0
    link: DecodeLink | None = None
    in_flight: int = 0
    pending_requests: int = 0
    pending_tokens: int = 0
    pending_blocks: int = 0
    num_describes: int = 0  # Describe answers so far: pending_* count what was assigned since the last one
    leaving: bool = False  # left its pool: drained, no new link or request
    closed: bool = False  # drained and closed: a Describe still in flight is ignored
    prefill_stub: prefill_pb2_grpc.PrefillStub | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.describe.instance_id if self.describe and self.describe.instance_id else self.address

    @property
    def role(self) -> str:
        return self.describe.role if self.describe else ""

    @property
    def up(self) -> bool:
        """Describe answers, the role fits the pool, and (decode) the stream is open."""
        if not self.reachable or self.describe is None or self.role not in POOL_ROLES[self.pool]:
            return False
        return self.pool == "prefill" or (self.link is not None and self.link.alive)

    @property
    def affinity_key(self) -> tuple[str, int]:
        """Identity of this process's cache: a restart (new start time) starts cold."""
        return (self.address, self.describe.start_unix_ns if self.describe else 0)


class Members:
    """Owns the instances of every pool (`instances`, routed to once up) and those leaving (`leaving`).

    `factory(address, extra_options, server_name)` makes a channel; each instance gets one for requests and one
    with `health_options` for Describe."""

    def __init__(self, factory: Callable[[str, tuple, str], grpc.aio.Channel], health_options: tuple) -> None:
        self._factory = factory
        self._health_options = health_options
        self.instances: list[Instance] = []
        self.leaving: list[Instance] = []

    def add(self, pool: str, member: Member) -> Instance:
        """A new instance for `member`, listed last in its pool (ties in routing go to the first listed)."""
        inst = Instance(
            member.address,
            pool,
            self._factory(member.address, (), member.server_name),
            self._factory(member.address, self._health_options, member.server_name),
            server_name=member.server_name,
        )
        if pool == "prefill":
            inst.prefill_stub = prefill_pb2_grpc.PrefillStub(inst.channel)
        self.instances.append(inst)
        return inst

    def health_channel(self, inst: Instance, address: str) -> grpc.aio.Channel:
        """A Describe channel of its own to `address` (the instance's health server), checked as `inst` is."""
        return self._factory(address, self._health_options, inst.server_name)

    def apply(self, pool: str, members: Sequence[Member]) -> list[Instance]:
        """Make `pool`'s instances the `members`: new addresses are joined (or rejoin from `leaving`), absent
        ones move to `leaving`. Returns the instances that joined or rejoined (to be Described at once)."""
        wanted = {m.address: m for m in members}
        current = {i.address: i for i in self.instances if i.pool == pool}
        joined = []
        for address, member in wanted.items():
            if address in current:
                continue
            back = next((i for i in self.leaving if i.pool == pool and i.address == address), None)
            if back is not None:
                self.leaving.remove(back)
                self.instances.append(back)
                back.leaving = False
                joined.append(back)
                log.info("%s instance %s at %s is listed again: routed to again", pool, back.name, address)
            else:
                joined.append(self.add(pool, member))
                log.info("%s pool: %s joined (%s)", pool, address, member.server_name or "fixed")
        for address, inst in current.items():
            if address not in wanted:
                self.instances.remove(inst)
                self.leaving.append(inst)
                inst.leaving = True
                log.info(
                    "%s instance %s at %s left the pool: no new requests; %d running finish there",
                    pool,
                    inst.name,
                    address,
                    num_running(inst),
                )
        return joined

    def retire_idle(self) -> list[Instance]:
        """Take out of `leaving` the instances no request of this gateway uses any more (for the caller to
        close: `close_instance`)."""
        idle = [i for i in self.leaving if num_running(i) == 0]
        for inst in idle:
            self.leaving.remove(inst)
            inst.closed = True
            log.info("%s instance %s at %s drained and closed", inst.pool, inst.name, inst.address)
        return idle

    def counts(self) -> dict[tuple[str, str], int]:
        """(pool, state) -> members: "up" (routed to), "draining" (left the pool, or draining itself: requests
        still finish there), "down" (listed, not up: not ready yet, or failing)."""
        counts = {(pool, state): 0 for pool in POOL_ROLES for state in MEMBER_STATES}
        for inst in self.instances:
            state = "down" if not inst.up else "draining" if inst.describe.draining else "up"
            counts[(inst.pool, state)] += 1
        for inst in self.leaving:
            counts[(inst.pool, "draining")] += 1
        return counts


def num_running(inst: Instance) -> int:
    """Requests of this gateway on `inst`: assigned and not released, or (decode) still on its stream."""
    return max(inst.in_flight, inst.link.num_requests if inst.link is not None else 0)


async def close_instance(inst: Instance) -> None:
    """Close the instance's decode link (if any) and its channels."""
    if inst.link is not None:
        await inst.link.close()
    channels = [c for c in (inst.channel, inst.health_channel) if c is not None]
    await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
