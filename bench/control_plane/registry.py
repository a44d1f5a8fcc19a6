"""The adapter registry's own CPU per load against the replica count: no sockets, no sims.

Why: at 256 replicas the one-process gateway spent 4x more CPU per replica on a load than
at 16-64, and py-spy put a third of its samples in ``AdapterRegistry._due``
(``gateway/adapters/state.py``). This drives the pure registry the way the gateway's
fan-out does (every replica answers 200 at once, the results fed back one by one) and
times each publish of ``trl-policy-vK`` (its N loads, and from the S+2nd on the N unloads
of the evicted version): if the per-result work scans every copy, the time per load grows
with N squared, and this shows it without the noise of a 2-core VM running 5 processes.

    .venv/bin/python -m bench.control_plane.registry      # prints a table, writes nothing
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque

from gateway.adapters.state import (
    Action,
    AdapterPolicy,
    AdapterRegistry,
    Outcome,
    Result,
)

OK = Result(Outcome.OK, 200)


def drive(core: AdapterRegistry, actions: list[Action], now: float) -> int:
    """Answer every action 200 (FIFO) until none is left; returns how many were answered."""
    queue, answered = deque(actions), 0
    while queue:
        action = queue.popleft()
        if core.is_current(action):
            answered += 1
            queue.extend(core.on_result(action, OK, now))
    return answered


def per_load_ms(n: int, loads: int, max_staleness: int) -> tuple[list[float], int]:
    """Milliseconds of registry CPU per publish (loads + the evictions it triggers)."""
    policy = AdapterPolicy(max_staleness=max_staleness, unload_grace_s=0.0)
    core = AdapterRegistry(policy, range(n))
    core.set_base_models(["base"])
    for r in range(n):
        drive(core, core.observe(r, [], 0.0), 0.0)
    out, answered = [], 0
    for k in range(1, loads + 1):
        now = float(k)
        t0 = time.process_time()
        answered += drive(core, core.request_load(f"p-v{k}", f"/r/p-v{k}", inplace=False,
                                                  now=now), now)  # fmt: skip
        answered += drive(core, core.tick(now + 1.0), now + 1.0)  # due unloads
        out.append(1000 * (time.process_time() - t0))
        assert all(core.is_live(f"p-v{j}") for j in range(max(1, k - max_staleness), k + 1))
    return out, answered


def table(sizes: list[int], loads: int = 12, max_staleness: int = 4) -> list[dict[str, float]]:
    """Per size: the median registry CPU per load once the window evicts, and per replica."""
    rows = []
    for n in sizes:
        ms, answered = per_load_ms(n, loads, max_staleness)
        med = statistics.median(ms[max_staleness + 1 :] or ms)  # steady: with evictions
        rows.append({"replicas": n, "cpu_ms_per_load": round(med, 2),
                     "cpu_us_per_replica": round(1000 * med / n, 1),
                     "results_fed": answered})  # fmt: skip
    return rows


def markdown(rows: list[dict[str, float]]) -> list[str]:
    lines = ["| replicas | registry CPU per load, median (ms) | per replica (µs) |",
             "|---|---|---|"]  # fmt: skip
    lines += [f"| {r['replicas']} | {r['cpu_ms_per_load']:.1f} | {r['cpu_us_per_replica']:.0f} |"
              for r in rows]  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.control_plane.registry")
    p.add_argument("--sizes", default="16,64,256,1024")
    p.add_argument("--loads", type=int, default=12)
    p.add_argument("--max-staleness", type=int, default=4)
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    print("\n".join(markdown(table(sizes, args.loads, args.max_staleness))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
