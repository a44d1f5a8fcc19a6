"""The image's HEALTHCHECK: is the gateway's event loop answering on the address it
*actually* listens on?

``python -I -m gateway.http.liveness [--pid N]``: exit 0 when every TCP address that
process N (default 1: the container's ENTRYPOINT) or one of its descendants listens on
answers ``GET /livez`` with 200 within 2 s; 1 otherwise.

Why read the kernel's socket table instead of ``GATEWAY_PORT``: the port may come from a
flag (extra container arguments, which a ``docker exec``'d check never sees), from the
environment, from the YAML file, or be 0; only the listening socket knows. It also works
on a read-only root (nothing is written anywhere) and under ``serve --workers N``, whose
workers are children of PID 1. ``/livez``, not ``/readyz`` or ``/health``: this is
liveness of the process (``gateway.api.probes``); those are 503 while a replica is down or
the gateway drains, and restarting the sidecar for that would fix nothing.

Standard library only and nothing else of the gateway: it runs every few seconds.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["PATH", "listening_urls", "main", "process_tree"]

PATH = "/livez"
"""What it asks: ``gateway.api.probes``' liveness (this module imports nothing of it)."""

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column
_TIMEOUT_S = 2.0


def process_tree(root: int, proc: Path = Path("/proc")) -> list[int]:
    """``root`` and every descendant visible in ``proc`` (parents from ``/proc/N/stat``)."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # comm may hold spaces and ')'
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _socket_inodes(pids: Iterable[int], proc: Path) -> set[int]:
    inodes = set()
    for pid in pids:
        try:
            fds = list((proc / str(pid) / "fd").iterdir())
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def _address(hex_addr: str) -> str:
    """``/proc/net/tcp{,6}``'s address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _url(host: str, port: int) -> str:
    """A wildcard address answers on loopback; anything else on itself."""
    ip = ipaddress.ip_address(host)
    if ip.is_unspecified:
        ip = ipaddress.ip_address("::1" if ip.version == 6 else "127.0.0.1")
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    shown = f"[{ip}]" if ip.version == 6 else str(ip)
    return f"http://{shown}:{port}"


def listening_urls(root: int = 1, proc: Path = Path("/proc")) -> list[str]:
    """The base URLs of every TCP socket that ``root``'s process tree listens on."""
    pids = process_tree(root, proc)
    inodes = _socket_inodes(pids, proc)
    urls: list[str] = []
    for table in ("tcp", "tcp6"):
        try:  # the gateway's own network namespace, whatever this process is in
            lines = (proc / str(root) / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN or int(fields[9]) not in inodes:
                continue
            host, port = fields[1].split(":")
            url = _url(_address(host), int(port, 16))
            if url not in urls:
                urls.append(url)
    return urls


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + PATH, timeout=_TIMEOUT_S) as response:
            return bool(response.status == 200)
    except (OSError, ValueError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gateway.http.liveness",
        description="Exit 0 if the gateway under PID answers GET /livez on every TCP "
        "address it listens on (the image's HEALTHCHECK).",
    )
    parser.add_argument("--pid", type=int, default=1, help="root of the process tree (1)")
    args = parser.parse_args(argv)
    urls = listening_urls(args.pid)
    if not urls:
        print(f"liveness: process {args.pid} and its children listen on no TCP port",
              file=sys.stderr)  # fmt: skip
        return 1
    failed = [u for u in urls if not _answers(u)]
    for url in failed:
        print(f"liveness: {url}{PATH} does not answer 200", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
