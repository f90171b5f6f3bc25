"""Pool members from the gateway's --prefill / --decode: fixed addresses, and DNS names re-resolved.

Each comma-separated entry of a pool flag is either

    host:port               a fixed member, always in the pool
    dns:///host:port        gRPC's name syntax: every address the name resolves to is a member (a Kubernetes
                            headless Service answers one record per ready pod), re-resolved every
                            --discovery-interval-s

A member found through a name is dialed by its address (a pod IP) and its certificate is checked against the
name (`Member.server_name`) unless --internal-tls-server-name names one for every peer. The registry turns
each round's members into instances (registry.py): a new one is routed to once its Describe answers, one
that left is drained. Lookups run in a worker thread (`asyncio.to_thread`), never on the event loop; the
resolver is an object with one method (`Resolver`), so tests answer for the DNS themselves.

A lookup that fails (no such name included, as gRPC's resolver treats it) keeps the name's last good answer:
a DNS outage never empties a pool. The first failure of a run of them is logged, and the first success after.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from splitserve.common.config_fields import ConfigError

log = logging.getLogger("splitserve.gateway")

DNS_PREFIX = "dns:///"


@dataclass(frozen=True)
class DnsName:
    """A `dns:///host:port` entry."""

    host: str
    port: int

    @property
    def target(self) -> str:
        return f"{DNS_PREFIX}{self.host}:{self.port}"


@dataclass(frozen=True)
class PoolSpec:
    """What one pool flag lists: fixed addresses and DNS names, each in the order given."""

    pool: str  # "prefill" or "decode"
    fixed: tuple[str, ...] = ()
    names: tuple[DnsName, ...] = ()


@dataclass(frozen=True)
class Member:
    """One address of a pool; `server_name`: the DNS name that listed it ("" for a fixed address)."""

    address: str
    server_name: str = ""


def _split_port(flag: str, entry: str, hostport: str) -> tuple[str, int]:
    host, sep, port = hostport.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{flag} entry {entry!r}: expected {DNS_PREFIX}host:port with a port in [1, 65535]")
    return host, int(port)


def parse_pool(pool: str, entries: Sequence[str]) -> PoolSpec:
    """The entries of --`pool` (already split at commas) as a PoolSpec; ConfigError naming the flag and the entry
    when a name is malformed (a DNS server in the authority, a missing port)."""
    flag, fixed, names = f"--{pool}", [], []
    for entry in entries:
        if not entry.startswith("dns:"):
            fixed.append(entry)
            continue
        if not entry.startswith(DNS_PREFIX):
            raise ConfigError(
                f"{flag} entry {entry!r}: only {DNS_PREFIX}host:port is supported (no DNS server in the authority)"
            )
        name = DnsName(*_split_port(flag, entry, entry[len(DNS_PREFIX) :]))
        if name not in names:
            names.append(name)
    return PoolSpec(pool, tuple(fixed), tuple(names))


class Resolver(Protocol):
    """Answers a name lookup: the "ip:port" addresses of `host` (IPv6 in brackets); raises OSError when the
    lookup fails. Called from a worker thread."""

    def resolve(self, host: str, port: int) -> Sequence[str]: ...


class SystemResolver:
    """The system's resolver (getaddrinfo: /etc/hosts, then DNS as nsswitch says), TCP addresses only."""

    def resolve(self, host: str, port: int) -> Sequence[str]:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        out = []
        for family, _, _, _, sockaddr in infos:
            ip = sockaddr[0]
            address = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
            if address not in out:
                out.append(address)
        return out


class PoolDiscovery:
    """Resolves every pool's DNS names; keeps each name's last good answer through failed lookups."""

    def __init__(self, specs: Sequence[PoolSpec], resolver: Resolver) -> None:
        self.specs = tuple(specs)
        self._resolver = resolver
        self._last: dict[DnsName, tuple[str, ...]] = {}
        self._failing: dict[DnsName, str] = {}  # name -> the error of the failure that began the run

    @property
    def has_names(self) -> bool:
        return any(spec.names for spec in self.specs)

    async def members(self) -> dict[str, list[Member]]:
        """Pool -> its members now: the fixed addresses, then each name's addresses (sorted), each address once
        (a fixed one is never taken as a name's)."""
        names = [name for spec in self.specs for name in spec.names]
        answers = await asyncio.gather(*(self._lookup(name) for name in names))
        found = dict(zip(names, answers))
        out: dict[str, list[Member]] = {}
        for spec in self.specs:
            members = {address: Member(address) for address in spec.fixed}
            for name in spec.names:
                for address in found[name]:
                    members.setdefault(address, Member(address, name.host))
            out[spec.pool] = list(members.values())
        return out

    async def _lookup(self, name: DnsName) -> tuple[str, ...]:
        try:
            answer = tuple(sorted(await asyncio.to_thread(self._resolver.resolve, name.host, name.port)))
        except (OSError, UnicodeError) as exc:  # gaierror is an OSError; an over-long label a UnicodeError
            if name not in self._failing:
                self._failing[name] = str(exc)
                log.warning(
                    "DNS lookup of %s failed (%s); keeping its last %d address(es) until it answers",
                    name.target,
                    exc,
                    len(self._last.get(name, ())),
                )
            return self._last.get(name, ())
        if self._failing.pop(name, None) is not None:
            log.info("DNS lookup of %s answers again: %d address(es)", name.target, len(answer))
        if answer != self._last.get(name):
            log.info("%s resolves to %s", name.target, ", ".join(answer) or "nothing")
        self._last[name] = answer
        return answer
