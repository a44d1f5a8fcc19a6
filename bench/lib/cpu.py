"""The one reader of process CPU time, from ``/proc`` (Linux only).

Why not psutil: its CPU times are ``/proc/PID/stat`` clock ticks (10 ms), too coarse for
the short runs of ``overhead.py`` (1,000 requests at 1 in flight take well under a second
of a front's CPU). ``/proc/PID/task/TID/schedstat`` counts on-CPU nanoseconds, so
``oncpu_ns`` is what per-request CPU is taken from. ``/proc/PID/stat`` is still read for
what only it has: the user/kernel split, the parent PID, and the time of threads that
have exited (``stat``), which a long run (the soak) must not lose.
"""

from __future__ import annotations

import contextlib
import os

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def stat(pid: int) -> tuple[int, float, float] | None:
    """(parent PID, user s, system s) of ``pid``, every thread it ever had; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[11]) / _TICK, int(fields[12]) / _TICK


def cpu_s(pid: int) -> float:
    """user + system seconds of ``pid`` (all its threads, exited ones included); 0 if gone."""
    st = stat(pid)
    return st[1] + st[2] if st else 0.0


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (of any of its threads)."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    return out


def tree(root: int) -> list[int]:
    """``root`` and every live descendant (``serve --workers N`` is a tree of processes)."""
    out: list[int] = []
    todo = [root]
    while todo and len(out) < 10_000:
        pid = todo.pop()
        if pid not in out:
            out.append(pid)
            todo += children(pid)
    return out


def oncpu_ns(pid: int) -> int:
    """On-CPU nanoseconds of every live thread of ``pid`` (``schedstat``); 0 if gone."""
    total = 0
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
    return total


def tree_ns(root: int) -> dict[int, int]:
    """``oncpu_ns`` of ``root`` and of each live descendant, by PID. A difference of two
    readings should be taken over the PIDs in both (a process may come or go between)."""
    return {pid: oncpu_ns(pid) for pid in tree(root)}


def tree_oncpu_ns(root: int) -> int:
    """On-CPU nanoseconds of ``root``'s whole live process tree."""
    return sum(tree_ns(root).values())
