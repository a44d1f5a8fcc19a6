"""A replica in a network namespace of its own, reached over a veth pair, whose network
can be cut with firewall rules: the chaos run's network faults (issue 27).

Why a namespace, and not rules on the host's loopback: each replica gets its own address
and its own firewall, so a rule can only ever touch that replica's traffic, a crashed run
leaves no rule on the host (the rules live and die with the namespace), and the gateway
meets a real network hop (a veth, ARP, its own route) instead of loopback shortcuts.

The kernel here has no ``tc netem``, so faults are ``iptables`` rules inside the replica's
namespace, on the replica's port only (its engine's own loopback traffic is untouched):

* ``partition``: every packet dropped both ways; connections hang, connects time out;
* ``reject``: inbound segments answered with a TCP reset; connects are refused at once
  and open connections are reset on their next segment;
* ``requests_lost``: inbound packets dropped (one way); the replica sees nothing;
* ``answers_lost``: outbound packets dropped (one way); the replica receives and *acts
  on* requests (an adapter load is applied) but no answer ever reaches the gateway.

Needs root and iproute2 + iptables (``available``); every command is bounded in time.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from dataclasses import dataclass

MODES = ("partition", "reject", "requests_lost", "answers_lost")
SUBNET = ipaddress.IPv4Network("10.213.0.0/16")
PREFIX = "rg-"
CMD_TIMEOUT_S = 10.0


class NetnsError(RuntimeError):
    """A namespace could not be made, cut or mended."""


def available() -> str | None:
    """None when namespaces can be made here; else why not (for a clear failure)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [t for t in ("ip", "iptables") if shutil.which(t) is None]
    if missing:
        return f"network namespaces need {' and '.join(missing)} (iproute2, iptables)"
    return None


def _run(*args: str) -> str:
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"{' '.join(args)}: no answer in {CMD_TIMEOUT_S:.0f} s") from exc
    if out.returncode != 0:
        raise NetnsError(f"{' '.join(args)}: {out.stderr.strip() or out.returncode}")
    return out.stdout


@dataclass(frozen=True)
class Netns:
    """One replica's namespace: ``ns_ip`` inside, ``host_ip`` on the host's veth end."""

    name: str
    host_if: str
    host_ip: str
    ns_ip: str

    def prefix(self) -> list[str]:
        """What a command is prefixed with to run inside (``ip netns exec`` execs it, so
        the PID and process group stay the replica's own)."""
        return ["ip", "netns", "exec", self.name]

    def _iptables(self, *args: str) -> None:
        _run(*self.prefix(), "iptables", "-w", "5", *args)

    def cut(self, port: int, mode: str) -> None:
        """Cut the replica's ``port`` by ``mode`` (``MODES``); ``mend`` undoes it."""
        p = str(port)
        if mode == "partition":
            self._iptables("-I", "INPUT", "-p", "tcp", "--dport", p, "-j", "DROP")
            self._iptables("-I", "OUTPUT", "-p", "tcp", "--sport", p, "-j", "DROP")
        elif mode == "reject":
            self._iptables("-I", "INPUT", "-p", "tcp", "--dport", p,
                           "-j", "REJECT", "--reject-with", "tcp-reset")  # fmt: skip
        elif mode == "requests_lost":
            self._iptables("-I", "INPUT", "-p", "tcp", "--dport", p, "-j", "DROP")
        elif mode == "answers_lost":
            self._iptables("-I", "OUTPUT", "-p", "tcp", "--sport", p, "-j", "DROP")
        else:
            raise ValueError(f"unknown network fault mode {mode!r}; one of {MODES}")

    def mend(self) -> None:
        """Every rule gone: the namespace's filter table is only ever ours."""
        self._iptables("-F", "INPUT")
        self._iptables("-F", "OUTPUT")

    def rules(self) -> str:
        return _run(*self.prefix(), "iptables", "-w", "5", "-S")

    def delete(self) -> None:
        """Remove the namespace (its veth end, its rules and the host's end go with it)."""
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True,
                       timeout=CMD_TIMEOUT_S, check=False)  # fmt: skip


def _used_addresses() -> set[ipaddress.IPv4Address]:
    used: set[ipaddress.IPv4Address] = set()
    for line in _run("ip", "-o", "-4", "addr", "show").splitlines():
        parts = line.split()
        if "inet" in parts:
            used.add(ipaddress.IPv4Interface(parts[parts.index("inet") + 1]).ip)
    return used


def _free_block(start: int) -> ipaddress.IPv4Network:
    """A /30 of ``SUBNET`` that no interface uses, searched from ``start``."""
    blocks = list(SUBNET.subnets(new_prefix=30))
    used = _used_addresses()
    for k in range(len(blocks)):
        block = blocks[(start + k) % len(blocks)]
        if not any(a in block for a in used):
            return block
    raise NetnsError(f"no free /30 left in {SUBNET}")


def sweep_stale() -> list[str]:
    """Remove ``rg-<pid>-*`` namespaces whose creating process is gone and that hold no
    process (a run that was killed before it could clean up); returns their names."""
    gone = []
    for line in _run("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if not name.startswith(PREFIX) or len(parts) < 3 or not parts[1].isdigit():
            continue
        if os.path.exists(f"/proc/{parts[1]}") or _run("ip", "netns", "pids", name).strip():
            continue
        Netns(name, "", "", "").delete()
        gone.append(name)
    return gone


def create(index: int, tag: str | None = None) -> Netns:
    """Namespace ``rg-<tag>-r<index>`` (tag: this process's PID) with a veth pair, its
    loopback up and a default route via the host's end, so vLLM's own address lookups
    work inside. Raises ``NetnsError`` (after undoing what it made) on any failure."""
    tag = tag or str(os.getpid())
    name = f"{PREFIX}{tag}-r{index}"
    host_if = f"rg{tag[-6:]}r{index}"[:15]
    peer_if = f"{host_if[:14]}n"
    block = _free_block(os.getpid() * 8 + index)
    host_ip, ns_ip = (str(a) for a in block.hosts())
    ns = Netns(name, host_if, host_ip, ns_ip)
    try:
        _run("ip", "netns", "add", name)
        _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", peer_if)
        _run("ip", "link", "set", peer_if, "netns", name)
        _run("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
        _run("ip", "link", "set", host_if, "up")
        _run("ip", "-n", name, "addr", "add", f"{ns_ip}/30", "dev", peer_if)
        _run("ip", "-n", name, "link", "set", peer_if, "up")
        _run("ip", "-n", name, "link", "set", "lo", "up")
        _run("ip", "-n", name, "route", "add", "default", "via", host_ip)
    except NetnsError:
        ns.delete()
        subprocess.run(["ip", "link", "del", host_if], capture_output=True,
                       timeout=CMD_TIMEOUT_S, check=False)  # fmt: skip
        raise
    return ns
