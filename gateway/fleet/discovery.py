"""Replica discovery: static list, DNS name (Kubernetes headless Service), watched file.

The desired replica set is the union of three sources:

* static: ``--replica`` / ``GATEWAY_REPLICAS`` (always members);
* DNS: ``discovery_dns = "[scheme://]name:port"``, re-resolved every
  ``discovery_interval_s``; every A and AAAA record becomes ``scheme://address:port``.
  The system resolver (``getaddrinfo``: ``/etc/resolv.conf`` search domains, ``/etc/hosts``)
  is used unless ``discovery_nameserver = "host:port"`` names a DNS server to query directly;
* file: ``replicas_file``, re-read when its modification time or size changes (checked every
  interval) or at once on SIGHUP. It holds a YAML/JSON list like the ``replicas:`` setting
  (strings or ``{url, token | token_file}``), or one URL per line (``#`` comments).

A source that fails (resolver error or timeout, NXDOMAIN, an empty or truncated answer, a
missing or unparsable file) keeps its last good answer: a DNS hiccup must never empty the
pool. Replicas that really die are taken out of rotation by health checks anyway.

The parsing and the diff are pure functions (DNS queries go through dnspython);
``Discovery`` is the thin async shell that resolves, reads and calls back with the desired
set. ``app.py`` applies it through the pool (stable indices), the ring (``set_members``:
only the keys of the replica that joined or left move) and the adapter manager (a new
replica is reconciled before it gets adapter traffic).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import dns.asyncresolver
import dns.exception
import dns.resolver
import yaml

from gateway.config import ReplicaSpec, Settings

__all__ = [
    "Discovery",
    "DnsError",
    "DnsTarget",
    "MembershipChange",
    "diff_membership",
    "parse_dns_target",
    "parse_hostport",
    "parse_replicas_file",
    "query_nameserver",
    "urls_for",
]

log = logging.getLogger("gateway.discovery")


class DnsError(Exception):
    """The answer cannot be used: keep the last good one."""


# ------------------------------------------------------------------ pure: specs


@dataclass(frozen=True, slots=True)
class DnsTarget:
    scheme: str
    host: str
    port: int


def parse_hostport(spec: str, *, what: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``."""
    host, sep, port = spec.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be host:port, got {spec!r}")
    return host.strip("[]"), int(port)


def parse_dns_target(spec: str) -> DnsTarget:
    """``name:port`` or ``http(s)://name:port`` (a headless Service name and its port)."""
    scheme = "http"
    rest = spec.strip()
    if "://" in rest:
        scheme, rest = rest.split("://", 1)
        if scheme not in ("http", "https"):
            raise ValueError(f"discovery_dns scheme must be http or https, got {scheme!r}")
    host, port = parse_hostport(rest.rstrip("/"), what="discovery_dns")
    return DnsTarget(scheme, host.rstrip("."), port)


def urls_for(target: DnsTarget, addresses: Sequence[str]) -> list[str]:
    """One URL per distinct address, sorted (IPv6 bracketed)."""
    urls = set()
    for addr in addresses:
        ip = ipaddress.ip_address(addr)
        host = f"[{ip}]" if ip.version == 6 else str(ip)
        urls.add(f"{target.scheme}://{host}:{target.port}")
    return sorted(urls)


def parse_replicas_file(text: str) -> list[ReplicaSpec]:
    """A YAML/JSON list (strings or ``{url, token | token_file}``) or one URL per line."""
    stripped = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
    lines = [ln for ln in stripped if ln]
    if not lines:
        return []
    if lines[0].startswith(("-", "[")):
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"replicas file: {exc}") from None
        if not isinstance(data, list):
            raise ValueError("replicas file: expected a list")
        return [ReplicaSpec.model_validate(item) for item in data]
    return [ReplicaSpec.model_validate(line) for line in lines]


@dataclass(frozen=True, slots=True)
class MembershipChange:
    added: tuple[ReplicaSpec, ...] = ()
    removed: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


def diff_membership(current: Mapping[str, int], desired: Sequence[ReplicaSpec]) -> MembershipChange:
    """What to add and remove so the members (URL -> index) become ``desired``."""
    wanted: dict[str, ReplicaSpec] = {}
    for spec in desired:
        wanted.setdefault(spec.url, spec)
    added = tuple(spec for url, spec in wanted.items() if url not in current)
    removed = tuple(sorted(i for url, i in current.items() if url not in wanted))
    return MembershipChange(added, removed)


# --------------------------------------------------------------- async shell


async def query_nameserver(
    server: tuple[str, int], name: str, rdtype: str, timeout: float
) -> list[str]:
    """``name``'s ``rdtype`` (A or AAAA) records from one DNS server (dnspython: EDNS0,
    TCP fallback for truncated answers). NOERROR without such records is an empty list
    (a name with only A records has no AAAA); every other outcome raises DnsError."""
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [server[0]]
    resolver.port = server[1]
    resolver.timeout = resolver.lifetime = timeout
    try:
        answer = await resolver.resolve(name, rdtype, raise_on_no_answer=False, search=False)
    except dns.resolver.NXDOMAIN:
        raise DnsError(f"{name}: NXDOMAIN") from None
    except dns.exception.DNSException as exc:
        raise DnsError(f"no answer from {server[0]}:{server[1]} for {name}: {exc}") from None
    return [rdata.address for rdata in answer]


class Discovery:
    """Resolves the configured sources and hands the desired replica set to ``apply``."""

    def __init__(
        self,
        settings: Settings,
        apply: Callable[[list[ReplicaSpec]], Awaitable[None]],
    ) -> None:
        self.static = list(settings.replicas)
        self.dns = parse_dns_target(settings.discovery_dns) if settings.discovery_dns else None
        self.nameserver = (
            parse_hostport(settings.discovery_nameserver, what="discovery_nameserver")
            if settings.discovery_nameserver
            else None
        )
        self.file = Path(settings.replicas_file) if settings.replicas_file else None
        self.interval = settings.discovery_interval_s
        self.timeout = min(settings.discovery_interval_s, 5.0)
        self._apply = apply
        self._dns_urls: list[str] = []
        self._file_specs: list[ReplicaSpec] = []
        self._file_stamp: tuple[float, int] | None = None

    @property
    def dynamic(self) -> bool:
        return self.dns is not None or self.file is not None

    async def reread(self) -> None:
        """Re-read every source now, the file even if it looks unchanged, and apply the
        result (SIGHUP: the caller reports what the pool holds afterwards)."""
        self._file_stamp = None
        await self.refresh()

    async def resolve(self, target: DnsTarget) -> list[str]:
        if self.nameserver is not None:
            answers = await asyncio.gather(
                *(
                    query_nameserver(self.nameserver, target.host, rdtype, self.timeout)
                    for rdtype in ("A", "AAAA")
                )
            )
            addresses = [a for found in answers for a in found]
        else:
            try:
                async with asyncio.timeout(self.timeout):
                    infos = await asyncio.get_running_loop().getaddrinfo(
                        target.host, target.port, type=socket.SOCK_STREAM
                    )
            except (TimeoutError, OSError) as exc:
                raise DnsError(f"cannot resolve {target.host}: {exc}") from None
            addresses = [str(info[4][0]).split("%", 1)[0] for info in infos]
        if not addresses:
            raise DnsError(f"{target.host}: no A/AAAA records")
        return urls_for(target, addresses)

    async def _refresh_dns(self) -> None:
        if self.dns is None:
            return
        try:
            urls = await self.resolve(self.dns)
        except DnsError as exc:
            log.warning("discovery: %s; keeping %d replicas from DNS", exc, len(self._dns_urls))
            return
        if urls != self._dns_urls:
            log.info("discovery: %s resolves to %d replicas", self.dns.host, len(urls))
        self._dns_urls = urls

    def _refresh_file(self) -> None:
        if self.file is None:
            return
        try:
            stat = self.file.stat()
            stamp = (stat.st_mtime, stat.st_size)
            if stamp == self._file_stamp:
                return
            specs = parse_replicas_file(self.file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            log.warning("discovery: cannot read replicas file %s: %s; keeping %d replicas",
                        self.file, exc, len(self._file_specs))  # fmt: skip
            return
        self._file_stamp = stamp
        self._file_specs = specs
        log.info("discovery: replicas file %s lists %d replicas", self.file, len(specs))

    async def desired(self) -> list[ReplicaSpec]:
        """Static, then DNS, then file replicas (duplicates dropped by the diff)."""
        await self._refresh_dns()
        await asyncio.to_thread(self._refresh_file)
        dns = [ReplicaSpec(url=u) for u in self._dns_urls]
        return [*self.static, *dns, *self._file_specs]

    async def refresh(self) -> None:
        await self._apply(await self.desired())

    async def run(self) -> None:
        """Refresh every interval until cancelled (SIGHUP's re-read is ``reread``)."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except Exception:  # the loop must outlive any one bad round
                log.exception("discovery round failed")
