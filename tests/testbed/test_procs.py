"""``rollout_testbed.procs``' ports: what the suite's servers bind. A port handed out by
``bind(0)`` comes from the kernel's ephemeral range, where any client connection's source
port can take it before the server binds; these never do, and never repeat."""

from __future__ import annotations

import socket
import subprocess
import sys

from rollout_testbed import procs


def test_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice() -> None:
    low = procs._ephemeral_low()
    ports = procs.free_ports(200) + [procs.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(procs._Ports.LOW <= p < low for p in ports)


def test_a_port_in_use_is_skipped() -> None:
    with socket.socket() as held:
        taken = procs.free_port()
        held.bind((procs.LOCAL, taken))
        held.listen()
        for _ in range(20):
            assert procs.free_port() != taken


def test_two_processes_start_their_walks_apart() -> None:
    """The fast layer runs two pytest processes at once: their first ports differ."""
    code = "from rollout_testbed import procs; print(procs.free_port())"
    firsts = {
        int(
            subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
            ).stdout
        )
        for _ in range(3)
    }
    assert len(firsts) == 3
