"""Instances the gateway routes to: registration by Describe, health, layout compatibility.

Every configured address is asked `Describe` at start and every `health_interval_s`, on a
channel of its own (health checks never queue behind request traffic), and then at the health server
its Describe advertises (`health_address`: a server that answers only Describe, so the check never
waits behind the request calls the instance has queued; back to the main address when that one fails).
An instance is up while Describe answers (a decode also needs its Decode.Generate stream open: the link is opened when
it first answers and reopened after it broke). Only a transport failure marks it down: a connection
refused or reset (a dead process), or a health-connection ping left unanswered `ping_timeout_s` (a
stopped or wedged one: runtime.grpc_server.health_channel_options), or an error status (a service that
is starting, draining or lost its engine core says so). A Describe that times out does not, however
many in a row: under overload (3,000 streams) an instance's event loop answers late while its gRPC core
still answers pings. The last DescribeResponse is kept (layout, load, role, instance_id, max_model_len).

Pools (`--prefill`, `--decode`) hold fixed addresses and DNS names (discovery.py), re-resolved every
`discovery_interval_s` off the event loop. A new member is Described at once and routed to once that
answers (as any instance: `up`). A member the DNS no longer lists leaves routing at once and is drained: it
moves to `leaving`, still Described (a leaving decode that dies fails its streams as any other), and is
closed once no request of this gateway runs there; if the name lists it again first, the same instance
(its link and its running streams) rejoins, so a flapping member never loses or repeats a request.

A prefill and a decode may be paired only when their KvLayouts are equal (and they share
a KV transport); a mismatched pair is refused and logged once with both layouts. The
gateway is ready when a full path exists: a compatible up prefill/decode pair, or an up
colocated worker (role "both").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import grpc

from splitserve.common.kv_layout import describe_layout_fields, transfer_plan
from splitserve.common.wire import layout_from_proto
from splitserve.gateway.decode_link import DecodeLink
from splitserve.gateway.discovery import Member, PoolDiscovery, Resolver, SystemResolver, parse_pool
from splitserve.gateway.members import POOL_ROLES, Instance, Members, close_instance, num_running
from splitserve.protos import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from splitserve.runtime.grpc_server import OWN_CONNECTION, health_channel_options

log = logging.getLogger("splitserve.gateway")

# Channel options: reconnect quickly after an instance restarts (gRPC's default backoff
# grows to 120 s), and allow large prompts / logprob batches.
MESSAGE_SIZE_OPTIONS = (
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
)
CHANNEL_OPTIONS = MESSAGE_SIZE_OPTIONS + (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
# Consecutive failed Describes after which a decode's open stream is declared broken
# (covers a peer that vanished without resetting the connection).
MAX_DESCRIBE_FAILURES = 3
# Slow Describes in a row between two log lines about them (the first is logged too).
SLOW_DESCRIBES_PER_LOG = 10
_LAYOUT_FIELDS = (
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "block_size",
    "dtype",
    "model_id",
    "layout",
    "k_scales",
    "v_scales",
    "tensor_parallel_size",
    "rank_kv_heads",
)
TP_TRANSPORTS = {"shm", "cuda_ipc", "nccl"}  # the transports that move KV between tensor-parallel instances


def describe_layout(layout: common_pb2.KvLayout) -> str:
    """One line naming every KvLayout field, in common.kv_layout.KvLayout.describe()'s format."""
    fields = {name: getattr(layout, name) for name in _LAYOUT_FIELDS}
    fields["k_scales"], fields["v_scales"] = tuple(layout.k_scales), tuple(layout.v_scales)  # repeated fields
    fields["rank_kv_heads"] = tuple(tuple(rank.heads) for rank in layout.rank_kv_heads)
    return describe_layout_fields(fields)


def layout_mismatch(a: common_pb2.KvLayout, b: common_pb2.KvLayout) -> str | None:
    """None when the layouts are equal, else "KV layouts differ: [a] vs [b]"."""
    if a == b:
        return None
    return f"KV layouts differ: [{describe_layout(a)}] vs [{describe_layout(b)}]"


def tp_layout_problem(prefill: common_pb2.KvLayout, decode: common_pb2.KvLayout, transports: set[str]) -> str | None:
    """Where either side is tensor parallel: None when shm, cuda_ipc or nccl can move the prefill's heads to every
    decode rank (a transfer plan maps the layouts), else why not (naming both); "" when neither is (compare them
    whole)."""
    if max(prefill.tensor_parallel_size, decode.tensor_parallel_size) <= 1:
        return ""
    if not transports & TP_TRANSPORTS:
        return (
            f"KV of tensor-parallel instances moves over shm, cuda_ipc or nccl only (common transports: "
            f"{sorted(transports) or 'none'}): [{describe_layout(prefill)}] vs [{describe_layout(decode)}]"
        )
    try:
        transfer_plan(layout_from_proto(prefill), layout_from_proto(decode))
    except ValueError as exc:
        return str(exc)
    return None


class Registry:
    """Owns the instances, their channels and decode links, and the health loop."""

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        *,
        health_interval_s: float = 0.5,
        health_timeout_s: float = 0.0,
        ping_timeout_s: float = 10.0,
        model_id: str = "",
        channel_factory: Callable[[str, tuple, str], grpc.aio.Channel] | None = None,
        discovery_interval_s: float = 5.0,
        resolver: Resolver | None = None,
    ) -> None:
        """`prefill` / `decode`: each pool's entries (host:port or dns:///host:port; ConfigError when one is
        malformed). `channel_factory(address, extra_options, server_name)` makes a channel (`server_name`: what
        the peer's certificate is checked against, "" = the dialed host); the health channel asks for a
        connection of its own (OWN_CONNECTION) that pings (health_channel_options(ping_timeout_s)).
        `health_timeout_s` bounds one Describe (0: max(2, 4 x health_interval_s)). `resolver` answers the DNS
        names (default: getaddrinfo), every `discovery_interval_s`."""
        factory = channel_factory or (
            lambda addr, extra, server_name: grpc.aio.insecure_channel(addr, options=CHANNEL_OPTIONS + tuple(extra))
        )
        self.members = Members(factory, OWN_CONNECTION + health_channel_options(ping_timeout_s))
        specs = [parse_pool("prefill", prefill), parse_pool("decode", decode)]
        self._discovery = PoolDiscovery(specs, resolver or SystemResolver())
        self._discovery_interval_s = discovery_interval_s
        for spec in specs:
            for address in spec.fixed:
                self.members.add(spec.pool, Member(address))
        self._health_interval_s = health_interval_s
        self._describe_timeout_s = health_timeout_s or max(2.0, 4 * health_interval_s)
        self._configured_model_id = model_id
        self._mismatches: dict[tuple[str, str], str] = {}
        self._task: asyncio.Task | None = None
        self._discovery_task: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()
        self.listeners: list[Callable[[bool], None]] = []  # called with ready() after each refresh

    @property
    def instances(self) -> list[Instance]:
        """Every pool's members (members.py): routed to once up."""
        return self.members.instances

    @instances.setter
    def instances(self, instances: list[Instance]) -> None:
        self.members.instances = instances

    @property
    def leaving(self) -> list[Instance]:
        """Members that left their pool, drained: still Described, never routed to."""
        return self.members.leaving

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Resolve the pools' names, Describe every instance once, then keep doing both in the background."""
        if self._discovery.has_names:
            await self.discover()
        await self.refresh()
        self._task = asyncio.create_task(self._health_loop(), name="gateway-health")
        if self._discovery.has_names:
            self._discovery_task = asyncio.create_task(self._discovery_loop(), name="gateway-discovery")

    async def close(self) -> None:
        tasks = [t for t in (self._task, self._discovery_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *self._closing, return_exceptions=True)
        await asyncio.gather(*(close_instance(inst) for inst in self.instances + self.leaving), return_exceptions=True)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self._health_interval_s)
            try:
                await self.refresh()
            except Exception:  # never let one bad round stop health checking
                log.exception("health round failed")

    async def _discovery_loop(self) -> None:
        while True:
            await asyncio.sleep(self._discovery_interval_s)
            try:
                await self.discover()
            except Exception:  # never let one bad round stop discovery
                log.exception("discovery round failed")

    async def refresh(self) -> None:
        """One health round: Describe all instances (leaving ones too) concurrently, update links and pairs,
        close the leaving instances nothing runs on any more."""
        await asyncio.gather(*(self._describe(inst) for inst in self.instances + self.leaving))
        self._changed()

    def _changed(self) -> None:
        """After a health or discovery round: close what drained, recompute pairs, tell the listeners."""
        for inst in self.members.retire_idle():
            task = asyncio.get_running_loop().create_task(close_instance(inst))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        self.update_pairs()
        ready = self.ready()
        for listener in self.listeners:
            listener(ready)

    # -- membership -----------------------------------------------------------------------

    async def discover(self) -> None:
        """One discovery round: resolve the names, apply each pool's members, Describe the ones that joined or
        rejoined at once (so a ready member is routed to within this round)."""
        joined = []
        for pool, members in (await self._discovery.members()).items():
            joined += self.members.apply(pool, members)
        await asyncio.gather(*(self._describe(inst) for inst in joined))
        self._changed()

    async def _describe(self, inst: Instance) -> None:
        channel = inst.health_channel or inst.channel
        stub = (prefill_pb2_grpc.PrefillStub if inst.pool == "prefill" else decode_pb2_grpc.DecodeStub)(channel)
        try:
            resp = await stub.Describe(common_pb2.DescribeRequest(), timeout=self._describe_timeout_s)
        except grpc.aio.UsageError:  # closed meanwhile: it drained after leaving its pool
            return
        except grpc.aio.AioRpcError as exc:
            if inst.closed:
                return
            reason = f"Describe failed: {exc.code().name}: {exc.details()}"
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and inst.reachable:
                state = channel.get_state()
                if state == grpc.ChannelConnectivity.READY:
                    self._describe_late(inst)  # busy, not down: its connection still answers pings
                    return
                # no connection to be slow on: the last one failed (a ping unanswered) and no new one
                # has come up within the deadline
                reason += f"; no live connection ({state.name})"
            if inst.health_address and exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                self._use_health_server(inst, "")  # gone (a restart moves it): ask the main address again
            self._describe_failed(inst, reason)
            return
        if inst.closed:
            return
        inst.num_slow_describes = 0
        if resp.health_address != inst.health_address:
            self._use_health_server(inst, resp.health_address)
        if not inst.reachable:
            log.info("%s instance %s at %s is up (role %s)", inst.pool, resp.instance_id, inst.address, resp.role)
        inst.describe, inst.reachable, inst.error = resp, True, ""
        inst.num_describe_failures = 0
        inst.pending_requests = inst.pending_tokens = inst.pending_blocks = 0
        inst.num_describes += 1
        if resp.role not in POOL_ROLES[inst.pool]:
            inst.error = (
                f"listed under --{inst.pool} but its role is {resp.role!r} "
                f"(expected one of {', '.join(POOL_ROLES[inst.pool])})"
            )
        elif inst.pool == "decode" and not inst.leaving and (inst.link is None or not inst.link.alive):
            inst.link = DecodeLink(
                inst.name, inst.channel, on_broken=lambda link, why, i=inst: self._link_broken(i, link, why)
            )
            inst.link.open()

    def _describe_late(self, inst: Instance) -> None:
        """A Describe past its deadline: the instance keeps its requests and its place in routing (its
        last load figures stand, plus what was sent there since)."""
        inst.num_slow_describes += 1
        if inst.num_slow_describes % SLOW_DESCRIBES_PER_LOG == 1:
            log.info(
                "%s instance %s answers Describe later than %g s (%d in a row); still up: its connection answers",
                inst.pool,
                inst.name,
                self._describe_timeout_s,
                inst.num_slow_describes,
            )

    def _use_health_server(self, inst: Instance, address: str) -> None:
        """Send the next Describes to `address`, the server the instance advertises for them ("": its
        main address), on a connection of its own."""
        old = inst.health_channel
        inst.health_address = address
        inst.health_channel = self.members.health_channel(inst, address or inst.address)
        if old is not None:
            task = asyncio.get_running_loop().create_task(old.close())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failed close is ignored

    def _describe_failed(self, inst: Instance, reason: str) -> None:
        inst.num_describe_failures += 1
        if inst.reachable:
            log.warning("%s instance %s at %s is down: %s", inst.pool, inst.name, inst.address, reason)
        inst.reachable, inst.error = False, reason
        if inst.link is not None and inst.link.alive and inst.num_describe_failures >= MAX_DESCRIBE_FAILURES:
            inst.link.fail(f"{inst.num_describe_failures} Describe calls in a row failed ({reason})")

    def _link_broken(self, inst: Instance, link: DecodeLink, reason: str) -> None:
        if inst.link is link:
            inst.reachable, inst.error = False, f"decode stream broke: {reason}"

    def mark_down(self, inst: Instance, reason: str) -> None:
        """Stop routing to `inst` until its next successful Describe."""
        if inst.reachable:
            log.warning("%s instance %s at %s marked down: %s", inst.pool, inst.name, inst.address, reason)
        inst.reachable, inst.error = False, reason

    # -- pairing and readiness ------------------------------------------------------------

    def pair_problem(self, prefill: Instance, decode: Instance) -> str | None:
        """Why `prefill` and `decode` may not be paired, or None when they may."""
        if prefill.describe is None or decode.describe is None:
            return "not described yet"
        served, pulled = list(prefill.describe.transports), list(decode.describe.transports)
        problem = tp_layout_problem(prefill.describe.layout, decode.describe.layout, set(served) & set(pulled))
        if problem == "":
            problem = layout_mismatch(prefill.describe.layout, decode.describe.layout)
        if problem is None and served and pulled and not set(served) & set(pulled):
            problem = f"no common KV transport: prefill serves {served}, decode pulls with {pulled}"
        return problem

    def compatible(self, prefill: Instance, decode: Instance) -> bool:
        return self.pair_problem(prefill, decode) is None

    def update_pairs(self) -> None:
        """Recompute the refused prefill/decode pairs; log each new refusal once."""
        current: dict[tuple[str, str], str] = {}
        for p in self.prefills():
            for d in self.decodes():
                if p.describe is None or d.describe is None:
                    continue
                problem = self.pair_problem(p, d)
                if problem is not None:
                    current[(p.address, d.address)] = (
                        f"refusing to pair prefill {p.name} ({p.address}) with decode {d.name} ({d.address}): {problem}"
                    )
        for key, message in current.items():
            if self._mismatches.get(key) != message:
                log.error("%s", message)
        self._mismatches = current

    def describe_mismatches(self) -> list[str]:
        """One message per refused prefill/decode pair, naming both layouts."""
        return [self._mismatches[k] for k in sorted(self._mismatches)]

    def prefills(self) -> list[Instance]:
        return [i for i in self.instances if i.pool == "prefill"]

    def decodes(self) -> list[Instance]:
        return [i for i in self.instances if i.pool == "decode"]

    def ready(self) -> bool:
        """True when a full path exists: a compatible up pair, or an up colocated worker."""
        decodes = [d for d in self.decodes() if d.up]
        if any(d.role == "both" for d in decodes):
            return True
        return any(self.compatible(p, d) for p in self.prefills() if p.up for d in decodes)

    def status(self) -> dict:
        """JSON-able summary for /ready and logs: readiness, instances, refused pairs."""
        return {
            "ready": self.ready(),
            "instances": [
                {
                    "address": i.address,
                    "pool": i.pool,
                    "instance_id": i.describe.instance_id if i.describe else "",
                    "role": i.role,
                    "up": i.up,
                    "error": "" if i.up else i.error,
                }
                for i in self.instances
            ],
            "leaving": [  # left the pool (DNS); drained: requests still running there finish
                {"address": i.address, "pool": i.pool, "running": num_running(i)} for i in self.leaving
            ],
            "refused_pairs": self.describe_mismatches(),
        }

    def not_ready_reason(self) -> str:
        """Why no full path exists (names each instance that is not up)."""
        down = [
            f"{i.pool} {i.describe.instance_id + ' ' if i.describe else ''}at {i.address}: {i.error}"
            for i in self.instances
            if not i.up
        ]
        parts = ["no prefill/decode pair with equal KV layouts and no colocated worker is up"]
        if not self.instances:
            parts.append("no instances are configured (use --prefill and --decode)")
        for spec in self._discovery.specs:
            for name in spec.names:
                if not any(i.server_name == name.host and i.pool == spec.pool for i in self.instances):
                    parts.append(f"{spec.pool} {name.target} lists no address (yet)")
        parts += down + self.describe_mismatches()
        return "; ".join(parts)

    # -- served model ---------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        """The configured model id, else the first described instance's."""
        if self._configured_model_id:
            return self._configured_model_id
        for inst in sorted(self.instances, key=lambda i: not i.up):
            if inst.describe is not None and inst.describe.model_id:
                return inst.describe.model_id
        return ""

    @property
    def max_model_len(self) -> int:
        """Smallest context limit among up instances (0 when none is known)."""
        limits = [i.describe.max_model_len for i in self.instances if i.up and i.describe.max_model_len]
        return min(limits) if limits else 0
