"""The gateway's CPU and memory over a whole run, from ``/proc`` of every process of it.

Why a thread that walks the process tree each time: with ``--workers N`` the gateway is a
supervisor, an owner and N workers, and a worker may be replaced mid-run; the tree is
read afresh at every sample, and a process's CPU is kept after it exits (its last
reading), so the cumulative CPU never goes down. Memory is reported as both RSS (summed,
which counts pages the forked processes share once per process) and PSS (shared pages
split between their users, so the sum is the tree's real footprint), from
``/proc/PID/smaps_rollup``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from bench.lib import cpu


def memory_kb(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of ``pid`` in kB; (0, 0) if it is gone."""
    rss = pss = 0
    with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif line.startswith("Pss:"):
                pss = int(line.split()[1])
    return rss, pss


@dataclass(frozen=True, slots=True)
class Sample:
    t: float  # seconds since the sampler started
    cpu_s: float  # the gateway's CPU seconds so far, every process it ever had
    rss_mb: float
    pss_mb: float
    procs: int
    hosts_cpu_s: float  # the sim hosts' CPU seconds so far (what shares the 2 cores)


class Sampler:
    """Samples ``root``'s tree (and the hosts' CPU) every ``interval`` s in a thread."""

    def __init__(self, root: int, hosts: Callable[[], list[int]], interval: float = 0.5) -> None:
        self.root, self.hosts, self.interval = root, hosts, interval
        self.samples: list[Sample] = []
        self.marks: list[tuple[float, str]] = []
        self._cpu: dict[int, float] = {}
        self._host_cpu: dict[int, float] = {}
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cp-sampler", daemon=True)

    def now(self) -> float:
        return time.monotonic() - self._t0

    def mark(self, label: str) -> None:
        self.marks.append((round(self.now(), 3), label))

    def sample(self) -> Sample:
        rss = pss = 0
        pids = cpu.tree(self.root)
        for pid in pids:
            self._cpu[pid] = max(self._cpu.get(pid, 0.0), cpu.cpu_s(pid))
            r, p = memory_kb(pid)
            rss, pss = rss + r, pss + p
        for pid in self.hosts():
            self._host_cpu[pid] = max(self._host_cpu.get(pid, 0.0), cpu.cpu_s(pid))
        s = Sample(round(self.now(), 3), round(sum(self._cpu.values()), 3),
                   round(rss / 1024, 2), round(pss / 1024, 2), len(pids),
                   round(sum(self._host_cpu.values()), 3))  # fmt: skip
        self.samples.append(s)
        return s

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sample()

    def series(self) -> list[dict[str, Any]]:
        """Samples with the CPU share since the previous one (``cpu_pct``, 100 = one core)."""
        out: list[dict[str, Any]] = []
        prev: Sample | None = None
        for s in self.samples:
            row = asdict(s)
            dt = s.t - prev.t if prev else 0.0
            row["cpu_pct"] = round(100 * (s.cpu_s - prev.cpu_s) / dt, 1) if prev and dt else 0.0
            hosts = (s.hosts_cpu_s - prev.hosts_cpu_s) / dt if prev and dt else 0.0
            row["hosts_cpu_pct"] = round(100 * hosts, 1)
            out.append(row)
            prev = s
        return out

    def peaks(self, window_s: float = 1.0) -> dict[str, float]:
        """Highest CPU share over any ``window_s`` (from samples), highest RSS and PSS."""
        best = 0.0
        j = 0
        for i, s in enumerate(self.samples):
            while self.samples[j].t < s.t - window_s and j < i:
                j += 1
            first = self.samples[j - 1] if j else self.samples[0]
            dt = s.t - first.t
            if dt >= window_s * 0.8:
                best = max(best, 100 * (s.cpu_s - first.cpu_s) / dt)
        return {
            "cpu_pct_max_1s": round(best, 1),
            "rss_mb_max": max((s.rss_mb for s in self.samples), default=0.0),
            "pss_mb_max": max((s.pss_mb for s in self.samples), default=0.0),
            "procs_max": max((s.procs for s in self.samples), default=0),
        }
