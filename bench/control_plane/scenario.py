"""One configuration of the control-plane benchmark, phase by phase, on one fleet.

N simulated replicas in H host processes, one real gateway (``--workers W``), then:

1. **idle**: the gateway's CPU with nothing to do but probe N replicas, and the size and
   time of one ``/gateway/status``;
2. **loads**: ``loads`` adapter loads ``trl-policy-v1..`` through the gateway, one after
   another (the staleness window evicts from the S+2nd on); each is timed to its 200 and
   then checked on the replicas themselves (every one holds it); at the end every replica
   holds exactly the newest S+1;
3. **pause/resume**: ``pauses`` pairs of TRL's ``/pause?mode=keep`` and ``/resume``;
4. **pause, a quarter vanishes**: the last host holds ``/pause`` (``/fleet/hold``); once
   all its replicas received it, the host is SIGSTOPped (a hang);
5. **rejoin (SIGCONT)**: the host is continued; time until ``/gateway/status`` has all N
   healthy and every replica's adapter state ``up``; then ``/resume``;
6. **load, a quarter vanishes**: the same with a load, the host SIGKILLed (a crash);
7. **rejoin (restart)**: the host is started again on the same ports, empty (no adapters,
   running): time until all N are healthy and ``up``, and every replica holds exactly the
   live window and is not paused.

The control-call rule (``gateway/fleet/quorum.py``, ``docs/operations.md``, "Control
calls") is checked at 4 and 6: a replica that gives no answer is *lost*: ejected and left
out; the call is 200 when nothing was refused and at least ``health_min_replicas``
(default 1) applied it, and it is answered within ``broadcast_timeout_s``.
Every check is recorded (``checks``), never asserted here: the benchmark reports, the test
(``tests/bench/test_control_plane.py``) asserts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.control_plane import harness
from bench.control_plane.harness import Fleet, Host
from bench.control_plane.sampler import Sampler
from bench.lib import cpu

HOLD_S = 10.0
"""How long the vanishing host holds the call: far longer than the harness needs to see
that every replica of it received the call and to stop the host."""
LORA_ROOT = "/tmp/control-plane-adapters"  # the sims do not check paths


@dataclass(frozen=True)
class Config:
    n: int
    hosts: int = 4
    workers: int = 1
    loads: int = 24
    pauses: int = 5
    idle_s: float = 10.0
    max_staleness: int = 4
    broadcast_timeout_s: float = 30.0
    settle_timeout_s: float = 120.0
    gateway_flags: tuple[str, ...] = ()
    host_flags: tuple[str, ...] = ()


@dataclass
class Checks:
    items: list[dict[str, Any]] = field(default_factory=list)

    def add(self, name: str, ok: bool, detail: object = "") -> bool:
        self.items.append({"check": name, "ok": bool(ok), "detail": str(detail)[:400]})
        return bool(ok)

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [c for c in self.items if not c["ok"]]


def adapter(k: int) -> dict[str, str]:
    return {"lora_name": f"trl-policy-v{k}", "lora_path": f"{LORA_ROOT}/trl-policy-v{k}"}


def window(newest: int, max_staleness: int) -> set[str]:
    return {adapter(k)["lora_name"] for k in range(max(1, newest - max_staleness), newest + 1)}


def wait_for(check: Callable[[], bool], *, timeout: float, interval: float = 0.2) -> float | None:
    """Seconds until ``check()`` held, or None if it did not within ``timeout``; exceptions
    count as "not yet" (a status read while the gateway is busy may time out)."""
    t0 = time.perf_counter()
    try:
        harness.poll(lambda: _safe(check), "condition", timeout=timeout, interval=interval)
    except TimeoutError:
        return None
    return round(time.perf_counter() - t0, 3)


def _safe(check: Callable[[], bool]) -> bool:
    try:
        return check()
    except (OSError, RuntimeError, ValueError):
        return False


def settled(status: dict[str, Any], n: int) -> bool:
    """All N in rotation and reconciled: healthy, and the adapter registry has them ``up``."""
    replicas, registry = status["replicas"], status["adapters"]["replicas"]
    return (
        len(replicas) == n
        and all(r["healthy"] for r in replicas)
        and len(registry) == n
        and all(r["state"] == "up" for r in registry)
    )


def indices_of(status: dict[str, Any], host: Host) -> set[int]:
    ports = set(host.ports)
    return {r["index"] for r in status["replicas"] if int(r["address"].rsplit(":", 1)[1]) in ports}


def gateway_ns(fl: Fleet) -> dict[int, int]:
    return cpu.tree_ns(fl.gateway.pid)


def cpu_ms(before: dict[int, int], after: dict[int, int]) -> float:
    return sum(after[p] - before[p] for p in after if p in before) / 1e6


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"p50": round(statistics.median(ordered), 2), "max": round(ordered[-1], 2),
            "min": round(ordered[0], 2), "count": len(ordered)}  # fmt: skip


def vanish_during(
    fl: Fleet, victim: Host, path: str, call: Callable[[], tuple[int, bytes, float]], how: str
) -> dict[str, Any]:
    """Make ``call`` stay in flight on ``victim`` (``/fleet/hold``), wait until every
    replica of it received the call, then SIGSTOP (``how="stop"``) or SIGKILL it."""
    victim.hold(path, HOLD_S)
    with ThreadPoolExecutor(1) as pool:
        t_send = time.perf_counter()
        future = pool.submit(call)
        arrived = wait_for(lambda: victim.received(path) >= len(victim.ports),
                           timeout=min(HOLD_S, 60.0), interval=0.02)  # fmt: skip
        t_vanish = time.perf_counter()
        if how == "stop":
            victim.proc.freeze()
        else:
            victim.proc.kill()
        status, body, seconds = future.result(timeout=fl.broadcast_timeout_s + 120)
    return {
        "how": "SIGSTOP" if how == "stop" else "SIGKILL",
        "replicas_vanished": len(victim.ports),
        "in_flight_on_all_of_them": arrived is not None,
        "status": status,
        "body": body[:300].decode("utf-8", "replace"),
        "seconds": round(seconds, 3),
        "seconds_after_vanish": round(t_send + seconds - t_vanish, 3),
    }


def run(cfg: Config, log_dir: Path) -> dict[str, Any]:
    """Start the fleet, run every phase, stop everything; the figures and the checks."""
    checks = Checks()
    t0 = time.perf_counter()
    with harness.fleet(cfg.n, cfg.hosts, cfg.workers, log_dir, max_staleness=cfg.max_staleness,
                       broadcast_timeout_s=cfg.broadcast_timeout_s,
                       gateway_flags=cfg.gateway_flags, host_flags=cfg.host_flags,
                       timeout=cfg.settle_timeout_s) as fl:  # fmt: skip
        started_s = round(time.perf_counter() - t0, 2)
        sampler = Sampler(
            fl.gateway.pid, lambda: [h.proc.pid for h in fl.hosts if h.proc.alive]
        ).start()
        try:
            phases = _phases(fl, cfg, sampler, checks)
        finally:
            sampler.stop()
        checks.add("the gateway is still running at the end", fl.gateway.alive,
                   f"exit {fl.gateway.returncode}")  # fmt: skip
        log = fl.gateway.output()
        checks.add("no traceback in the gateway's log", "Traceback" not in log,
                   log[log.find("Traceback") :][:400] if "Traceback" in log else "")  # fmt: skip
    return {
        "config": asdict(cfg),
        "started_s": started_s,
        **phases,
        "peaks": sampler.peaks(),
        "marks": sampler.marks,
        "series": sampler.series(),
        "checks": checks.items,
        "ok": not checks.failed,
    }


def _phases(fl: Fleet, cfg: Config, sampler: Sampler, checks: Checks) -> dict[str, Any]:
    out: dict[str, Any] = {}
    n, s = cfg.n, cfg.max_staleness

    sampler.mark("idle")
    before = gateway_ns(fl)
    time.sleep(cfg.idle_s)
    idle_ms = cpu_ms(before, gateway_ns(fl))
    t = time.perf_counter()
    status_code, body = harness.http("GET", fl.url + "/gateway/status", timeout=30)
    out["idle"] = {"seconds": cfg.idle_s, "cpu_pct": round(100 * idle_ms / 1000 / cfg.idle_s, 2),
                   "status_ms": round(1000 * (time.perf_counter() - t), 1),
                   "status_kb": round(len(body) / 1024, 1)}  # fmt: skip
    checks.add("/gateway/status answers", status_code == 200, status_code)

    sampler.mark("loads")
    lat, spent, bad, not_live = [], [], [], []
    for k in range(1, cfg.loads + 1):
        before = gateway_ns(fl)
        code, body, seconds = fl.call("/v1/load_lora_adapter", adapter(k))
        spent.append(cpu_ms(before, gateway_ns(fl)))
        lat.append(1000 * seconds)
        if code != 200:
            bad.append((k, code, body[:200]))
            continue
        name = adapter(k)["lora_name"]
        missing = [p for p, st in fl.replica_states().items() if name not in st["adapters"]]
        if missing:
            not_live.append((name, len(missing)))
    checks.add(f"every one of {cfg.loads} loads answered 200", not bad, bad)
    checks.add(f"every load held by all {n} replicas at its 200", not not_live, not_live)
    expected = window(cfg.loads, s)
    settle = wait_for(lambda: all(set(st["adapters"]) == expected
                                  for st in fl.replica_states().values()),
                      timeout=60)  # fmt: skip
    checks.add(f"staleness window: every replica holds exactly the newest {s + 1}",
               settle is not None, sorted(expected))  # fmt: skip
    out["loads"] = {"latency_ms": summary(lat), "latencies_ms": [round(x, 2) for x in lat],
                    "gateway_cpu_ms": summary(spent),
                    "window_settled_s_after_last": settle}  # fmt: skip

    sampler.mark("pause/resume")
    pauses, resumes = [], []
    for _ in range(cfg.pauses):
        p = fl.call("/pause?mode=keep")
        r = fl.call("/resume")
        pauses.append(1000 * p[2])
        resumes.append(1000 * r[2])
        checks.add("pause and resume answer 200", p[0] == r[0] == 200, (p[0], r[0]))
    out["pause_resume"] = {"pause_ms": summary(pauses), "resume_ms": summary(resumes)}

    victim = fl.hosts[-1]
    sampler.mark("pause: 1/4 SIGSTOP")
    res = vanish_during(fl, victim, "/pause", lambda: fl.call("/pause?mode=keep"), "stop")
    _check_vanish(fl, victim, res, "pause", checks)
    others = [st for st in fl.replica_states().values()]
    checks.add("pause: every replica left in rotation is paused",
               len(others) == n - len(victim.ports) and all(st["paused"] for st in others),
               sum(1 for st in others if not st["paused"]))  # fmt: skip
    out["pause_vanish"] = res

    sampler.mark("rejoin: SIGCONT")
    t = time.perf_counter()
    victim.proc.thaw()
    victim.hold("/pause", 0)
    rejoin = wait_for(lambda: settled(fl.status(), n), timeout=cfg.settle_timeout_s)
    checks.add(f"SIGCONT: all {n} healthy and up again", rejoin is not None)
    paused = wait_for(lambda: all(st["paused"] for st in fl.replica_states().values()),
                      timeout=30)  # fmt: skip
    checks.add("SIGCONT: the returning replicas are in the fleet's pause state", paused is not None)
    out["rejoin_thaw"] = {"replicas": len(victim.ports), "seconds": rejoin,
                          "since_signal_s": round(time.perf_counter() - t, 3)}  # fmt: skip
    code, _, seconds = fl.call("/resume")
    resumed = wait_for(lambda: not any(st["paused"] for st in fl.replica_states().values()),
                       timeout=30)  # fmt: skip
    checks.add(f"resume after the rejoin: 200 and all {n} running",
               code == 200 and resumed is not None, code)  # fmt: skip

    k = cfg.loads + 1
    sampler.mark("load: 1/4 SIGKILL")
    res = vanish_during(fl, victim, "/v1/load_lora_adapter",
                        lambda: fl.call("/v1/load_lora_adapter", adapter(k)), "kill")  # fmt: skip
    status = _check_vanish(fl, victim, res, "load", checks)
    name = adapter(k)["lora_name"]
    live = {a["name"]: a for a in status["adapters"]["adapters"]}.get(name, {})
    survivors = set(range(n)) - indices_of(status, victim)
    checks.add("load: live on exactly the replicas left", live.get("state") == "live"
               and set(live.get("replicas", [])) == survivors,
               (live.get("state"), len(live.get("replicas", []))))  # fmt: skip
    out["load_vanish"] = res

    sampler.mark("rejoin: restart")
    t = time.perf_counter()
    victim.proc.start()
    victim.wait_ready(cfg.settle_timeout_s)
    listening = round(time.perf_counter() - t, 3)
    rejoin = wait_for(lambda: settled(fl.status(), n), timeout=cfg.settle_timeout_s)
    expected = window(k, s)
    checks.add(f"restart: all {n} healthy and up again", rejoin is not None)
    exact = wait_for(lambda: all(set(st["adapters"]) == expected and not st["paused"]
                                 for st in fl.replica_states().values()),
                     timeout=30)  # fmt: skip
    checks.add(f"restart: every replica holds exactly the newest {s + 1} and runs",
               exact is not None, sorted(expected))  # fmt: skip
    out["rejoin_restart"] = {"replicas": len(victim.ports), "listening_s": listening,
                             "seconds_after_listening": rejoin,
                             "since_start_s": round(time.perf_counter() - t, 3)}  # fmt: skip
    sampler.mark("end")
    out["adapter_counts"] = fl.status()["adapters"]["counts"]
    return out


def _check_vanish(
    fl: Fleet, victim: Host, res: dict[str, Any], call: str, checks: Checks
) -> dict[str, Any]:
    """The rule, for a call during which ``victim``'s replicas vanished: 200 (nothing was
    refused, the rest applied it), within the broadcast timeout, the lost ones ejected."""
    checks.add(f"{call}: in flight on every vanishing replica when it vanished",
               res["in_flight_on_all_of_them"])  # fmt: skip
    checks.add(f"{call}: 200 although {res['replicas_vanished']} replicas vanished mid-call",
               res["status"] == 200, f"{res['status']} {res['body']}")  # fmt: skip
    checks.add(f"{call}: answered within broadcast_timeout_s ({fl.broadcast_timeout_s:g} s)",
               res["seconds"] < fl.broadcast_timeout_s, res["seconds"])  # fmt: skip
    status = fl.status()
    lost = indices_of(status, victim)
    by_index = {r["index"]: r for r in status["replicas"]}
    checks.add(f"{call}: the vanished replicas are ejected, the others in rotation",
               all(not by_index[i]["healthy"] for i in lost)
               and all(r["healthy"] for i, r in by_index.items() if i not in lost),
               [i for i, r in by_index.items() if r["healthy"] == (i in lost)][:10])  # fmt: skip
    return status
