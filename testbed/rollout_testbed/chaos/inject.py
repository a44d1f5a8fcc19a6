"""Carry out a chaos schedule against the TRL layer (``rollout_testbed.trl.harness``).

Runs in the trainer's process, next to TRL's real ``AsyncGRPOTrainer``: a scheduler
thread walks the seeded ``schedule.Fault`` list on the chaos clock (zero at the
trainer's first finished step, when TRL's rollout worker is up). A fault whose phase is
``between`` fires at its time; one tied to a phase of a sync (``pause``, ``load``,
``resume``, ``step_end``) is armed at its time and fired by the harness hooks right
before TRL's next call of that kind, in the trainer's thread, so the call meets it.

Faults, on processes this run started (by PID / process group, never by name):

* ``kill``: SIGKILL of a replica's process group; after ``restart_delay_s`` a fresh
  vLLM on the same port and the same core (``restart_on_core``);
* ``stop``: SIGSTOP of a replica's group for ``hold_s``, then SIGCONT;
* ``gateway``: the gateway process stopped (SIGTERM with its drain, or SIGKILL) and
  started again on its port; its ``/metrics`` is scraped right before, since a restart
  zeroes every counter;
* ``stall``: the adapter directory TRL is about to load is renamed away and moved back
  after ``hold_s``: the gateway's load meets "No adapter found" (mount lag);
* ``net``: the replica's port firewalled inside its own network namespace by ``mode``
  (``rollout_testbed.local.netns``: partition, reject, requests or answers lost) for
  ``hold_s``, then mended.

A replica fault never takes down the last replica that is up: one whose target or
other replica is already down is recorded as skipped (TRL's rollouts would otherwise
only wait for a restart). Every fault's end and recovery are recorded (see
``RECOVERY``); every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollout_testbed.chaos.schedule import GATEWAY, KILL, NET, REPLICA_KINDS, STALL, STOP, Fault
from rollout_testbed.trl import harness as H

# What "recovered" means per kind; written into the report.
RECOVERY = {
    KILL: "from the restarted replica answering its own /health (after warm-up) until the "
    "gateway reports it healthy with every adapter synced (gateway_replica_healthy and "
    "gateway_adapter_replica_synced = 1) and a trainer step has completed",
    STOP: "from SIGCONT until the gateway reports the replica healthy with every adapter "
    "synced and a trainer step has completed",
    GATEWAY: "from the new gateway process answering /health (any status) until it "
    "reports every replica not under another fault healthy and a trainer step has completed",
    STALL: "from the adapter directory moved back into place until a trainer step has "
    "completed (TRL's load returned and the next step trained)",
    NET: "from the firewall rules removed until the gateway reports the replica healthy "
    "with every adapter synced and a trainer step has completed",
}
# Gateway counters summed across restarts (each scrape: name, label substring).
GATEWAY_COUNTERS: dict[str, tuple[str, str]] = {
    "http_5xx": ("gateway_requests_total", 'status_class="5xx"'),
    "http_4xx": ("gateway_requests_total", 'status_class="4xx"'),
    "broadcasts_failed": ("gateway_broadcasts_total", 'outcome="failed"'),
    "broadcasts_total": ("gateway_broadcasts_total", ""),
    "adapter_loads_total": ("gateway_adapter_loads_total", ""),
    "adapter_loads_ok": ("gateway_adapter_loads_total", 'outcome="ok"'),
    "adapter_load_retries": ("gateway_adapter_load_retries_total", ""),
    "upstream_errors": ("gateway_upstream_errors_total", ""),
    "upstream_retries": ("gateway_upstream_retries_total", ""),
    "ejections": ("gateway_replica_ejections_total", ""),
    "retired_version_rollouts": ("gateway_retired_version_rollouts_total", ""),
}
PHASE_OF_CALL = {"pause": "pause", "load_lora_adapter": "load", "resume": "resume"}
RECOVERY_BOUND_S = 300.0
RESTART_BOUND_S = 600.0


def scrape(url: str) -> dict[str, float]:
    """The ``GATEWAY_COUNTERS`` of one gateway process now ({} if it does not answer)."""
    try:
        samples = H.metric_samples(url, timeout=5)
    except OSError:
        return {}
    return {
        key: sum(v for n, lab, v in samples if n == name and want in lab)
        for key, (name, want) in GATEWAY_COUNTERS.items()
    }


def restart_on_core(layer: H.Layer, index: int, timeout: float = RESTART_BOUND_S) -> float:
    """A fresh vLLM for replica ``index`` on its port and its own core; seconds to healthy
    and warmed up. (``Layer.restart_replica`` pins every restart to core 0.)"""
    from rollout_testbed.local import replicas as R

    port = int(layer.urls[index].rsplit(":", 1)[1])
    ns = layer.netns[index] if layer.netns else None
    host = ns.ns_ip if ns else "127.0.0.1"
    run_id = uuid.uuid4().hex
    rdir = H.TRL_DIR / "chaos-replicas" / f"r{index}-{run_id[:8]}"
    rdir.mkdir(parents=True, exist_ok=True)
    core = index % (os.cpu_count() or 1)
    tmpdir = R._private_tmpdir(rdir, index, run_id)
    env = R._replica_env("vllm", run_id, core=core, tmpdir=tmpdir,
                         cache_dir=H.TRL_DIR / "vllm-cache" / f"r{index}")  # fmt: skip
    max_loras = H.MAX_STALENESS + 2
    cmd = R.vllm_command(
        layer.python, str(layer.model_dir), port=port, host=host, max_loras=max_loras,
        max_cpu_loras=max_loras + 2, served_model_name=str(layer.model_dir),
        extra_args=list(H.VLLM_EXTRA_ARGS),
    )  # fmt: skip
    taskset = shutil.which("taskset")
    if taskset:
        cmd = [taskset, "-c", str(core), *cmd]
    if ns:
        cmd = [*ns.prefix(), *cmd]
    rs = R.ReplicaSet(
        kind="vllm", run_id=run_id, run_dir=str(rdir), state_file=str(rdir / "state.json"),
        host=host, served_model_name=str(layer.model_dir), model_dir=str(layer.model_dir),
        max_staleness=H.MAX_STALENESS, max_loras=max_loras, python=layer.python,
        started_at=time.time(),
    )  # fmt: skip
    t0 = time.monotonic()
    log_path = rdir / f"replica-{index}.log"
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf,
                                stderr=subprocess.STDOUT, env=env, cwd=str(rdir),
                                start_new_session=True)  # fmt: skip
    rs._procs[proc.pid] = proc
    rs.replicas.append(
        R.Replica(
            index=index,
            port=port,
            url=layer.urls[index],
            pid=proc.pid,
            pgid=proc.pid,
            core=core if taskset else None,
            log=str(log_path),
            tmpdir=str(tmpdir),
            cmd=cmd,
        )
    )
    layer.sets.append(rs)  # Layer.close() stops it, whatever happens below
    rs.save()
    R._wait_healthy(rs, timeout)
    R.warm_up(rs)
    return time.monotonic() - t0


@dataclass
class FaultRecord:
    """What happened to one scheduled fault (times: wall clock, ``time.time()``)."""

    index: int
    kind: str
    params: dict[str, Any]
    t: float  # scheduled, on the chaos clock
    armed_at: float | None = None
    fired_at: float | None = None
    fired_in: str = ""  # "between", or the TRL call / step end it fired before
    ended_at: float | None = None
    recovered_at: float | None = None
    recovery_s: float | None = None
    skipped: str | None = None
    notes: list[str] = field(default_factory=list)


class Chaos:
    """The injectors and their record for one TRL run over ``layer``."""

    def __init__(self, layer: H.Layer, faults: list[Fault], *, lora_dir: Path,
                 events: Path | None = None) -> None:  # fmt: skip
        self.layer = layer
        self.faults = faults
        self.lora_dir = lora_dir
        self.events = events
        self.records = [FaultRecord(i, f.kind, dict(f.params), f.t) for i, f in enumerate(faults)]
        self.t0: float | None = None
        self.step_times: list[tuple[int, float]] = []
        self.worker_pids: list[list[int]] = []
        self.gateway_scrapes: list[dict[str, float]] = []
        self.gateway_restarts = 0
        self.down: set[int] = set()  # replicas under a fault right now
        self._armed: dict[str, list[FaultRecord]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()  # no new fault
        self._over = threading.Event()  # training is over: no step will come
        self._threads: list[threading.Thread] = []
        self._held: dict[Path, Path] = {}  # stalled adapter dirs: held name -> real name
        self._scheduler = threading.Thread(target=self._run, name="chaos-scheduler", daemon=True)

    # ------------------------------------------------------------------ hooks (trainer)

    def on_step_end(self, step: int) -> None:
        now = time.time()
        self.step_times.append((step, now))
        self.worker_pids.append(sorted(p.pid or 0 for p in multiprocessing.active_children()))
        if self.t0 is None:
            self.t0 = now
            self._emit("chaos clock started", step=step)
            self._scheduler.start()
        for rec in self._take("step_end"):
            self._fire(rec, f"step_end {step}")

    def before_call(self, method: str, arg: str) -> None:
        phase = PHASE_OF_CALL.get(method)
        if phase is None:
            return
        for rec in self._take(phase):
            self._fire(rec, f"{method}({arg})", arg=arg)

    # ------------------------------------------------------------------ scheduler

    def _run(self) -> None:
        assert self.t0 is not None
        for rec in self.records:
            delay = self.t0 + rec.t - time.time()
            if delay > 0 and self._stop.wait(delay):
                return
            phase = str(rec.params.get("phase", "between"))
            if phase == "between":
                self._fire(rec, "between")
            else:
                rec.armed_at = time.time()
                with self._lock:
                    self._armed.setdefault(phase, []).append(rec)
                self._emit("armed", fault=rec.index, kind=rec.kind, phase=phase)

    def _take(self, phase: str) -> list[FaultRecord]:
        with self._lock:
            return self._armed.pop(phase, [])

    def _spawn(self, name: str, target: Any, *args: Any) -> None:
        th = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(th)
        th.start()

    def _emit(self, what: str, **kw: Any) -> None:
        line = {"t": round(time.time(), 3), "what": what, **kw}
        print(f"[chaos] {json.dumps(line, default=str)}", flush=True)
        if self.events is not None:
            with open(self.events, "a") as fh:
                fh.write(json.dumps(line, default=str) + "\n")

    # ------------------------------------------------------------------ faults

    def _fire(self, rec: FaultRecord, where: str, arg: str = "") -> None:
        try:
            if rec.kind in REPLICA_KINDS:
                self._replica_fault(rec, where)
            elif rec.kind == GATEWAY:
                self._gateway_restart(rec, where)
            elif rec.kind == STALL:
                self._stall(rec, where, arg)
        except Exception as exc:  # recorded; the run goes on
            rec.notes.append(f"injector error: {exc!r}")
            self._emit("injector error", fault=rec.index, error=repr(exc))

    def _replica_fault(self, rec: FaultRecord, where: str) -> None:
        i = int(rec.params["replica"])
        with self._lock:
            busy = sorted(self.down)
            if busy:
                rec.skipped = f"replica(s) {busy} already down: never take the last one"
            else:
                self.down.add(i)
        if rec.skipped:
            self._emit("skipped", fault=rec.index, kind=rec.kind, why=rec.skipped)
            return
        rec.fired_at, rec.fired_in = time.time(), where
        if rec.kind == KILL:
            self.layer.kill_replica(i, wait=False)
            self._emit("SIGKILL replica", fault=rec.index, replica=i, where=where)
            self._spawn(f"chaos-restart-{rec.index}", self._restart_after, rec, i)
        elif rec.kind == STOP:
            self.layer.signal_replica(i, signal.SIGSTOP)
            self._emit("SIGSTOP replica", fault=rec.index, replica=i, where=where)
            self._spawn(f"chaos-cont-{rec.index}", self._cont_after, rec, i)
        else:
            mode = str(rec.params["mode"])
            try:
                self.layer.cut_network(i, mode)
            except BaseException:
                with self._lock:
                    self.down.discard(i)
                raise
            self._emit("network cut", fault=rec.index, replica=i, mode=mode, where=where)
            self._spawn(f"chaos-mend-{rec.index}", self._mend_after, rec, i)

    def _restart_after(self, rec: FaultRecord, i: int) -> None:
        try:
            self.layer.wait_dead(i, 30)
            time.sleep(float(rec.params["restart_delay_s"]))
            seconds = restart_on_core(self.layer, i)
            rec.ended_at = time.time()
            rec.notes.append(f"restart took {seconds:.1f} s")
            self._emit("replica restarted", fault=rec.index, replica=i, seconds=round(seconds, 1))
            self._await_recovery(rec, lambda: self._replica_back(i))
        except Exception as exc:
            rec.notes.append(f"restart failed: {exc!r}"[:2000])
            self._emit("restart failed", fault=rec.index, error=repr(exc)[:500])
        finally:
            with self._lock:
                self.down.discard(i)

    def _cont_after(self, rec: FaultRecord, i: int) -> None:
        def cont() -> None:
            with contextlib.suppress(AssertionError, KeyError, ProcessLookupError):
                self.layer.signal_replica(i, signal.SIGCONT)

        self._undo_after(rec, i, cont, "SIGCONT replica")

    def _mend_after(self, rec: FaultRecord, i: int) -> None:
        self._undo_after(rec, i, lambda: self.layer.mend_network(i), "network mended")

    def _undo_after(self, rec: FaultRecord, i: int, undo: Any, what: str) -> None:
        """A held replica fault (stop, net): after ``hold_s`` undo it, then wait for the
        replica's recovery; the replica counts as down until then."""
        try:
            time.sleep(float(rec.params["hold_s"]))
        finally:
            try:
                undo()
            except Exception as exc:  # finish() undoes every fault again
                rec.notes.append(f"undo failed: {exc!r}")
            rec.ended_at = time.time()
            self._emit(what, fault=rec.index, replica=i)
        try:
            self._await_recovery(rec, lambda: self._replica_back(i))
        finally:
            with self._lock:
                self.down.discard(i)

    def _gateway_restart(self, rec: FaultRecord, where: str) -> None:
        gw = self.layer.gateway
        rec.fired_at, rec.fired_in = time.time(), where
        self.gateway_scrapes.append(scrape(gw.url))
        sig = str(rec.params.get("signal", "SIGTERM"))
        if sig == "SIGKILL" and gw.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(gw.proc.pid, signal.SIGKILL)
            gw.proc.wait(30)
            gw.proc = None
        else:
            gw.stop()
        self.gateway_restarts += 1
        gw.start(timeout=90, require_healthy=False)
        rec.ended_at = time.time()
        self._emit("gateway restarted", fault=rec.index, signal=sig, where=where,
                   down_s=round(rec.ended_at - rec.fired_at, 2))  # fmt: skip
        self._spawn(f"chaos-recover-{rec.index}", self._await_recovery, rec, self._gateway_back)

    def _stall(self, rec: FaultRecord, where: str, name: str) -> None:
        path = self.lora_dir / name
        if not name or not path.is_dir():
            rec.skipped = f"no adapter directory {path} to hold back"
            return
        held = path.with_name(f".chaos-held-{name}")
        os.rename(path, held)
        with self._lock:
            self._held[held] = path
        rec.fired_at, rec.fired_in = time.time(), where
        self._emit("adapter directory held back", fault=rec.index, name=name,
                   hold_s=rec.params["hold_s"])  # fmt: skip
        self._spawn(f"chaos-stall-{rec.index}", self._unstall_after, rec, held)

    def _unstall_after(self, rec: FaultRecord, held: Path) -> None:
        time.sleep(float(rec.params["hold_s"]))
        self._unstall(held)
        rec.ended_at = time.time()
        self._emit("adapter directory moved back", fault=rec.index)
        self._await_recovery(rec, lambda: True)

    def _unstall(self, held: Path) -> None:
        with self._lock:
            path = self._held.pop(held, None)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.rename(held, path)

    # ------------------------------------------------------------------ recovery

    def _replica_back(self, i: int) -> bool:
        lab = f'replica="{i}"'
        return (
            self.layer.gateway_metric("gateway_replica_healthy", lab) == 1.0
            and self.layer.gateway_metric("gateway_adapter_replica_synced", lab) == 1.0
        )

    def _gateway_back(self) -> bool:
        with self._lock:
            down = set(self.down)
        return all(
            self.layer.gateway_metric("gateway_replica_healthy", f'replica="{i}"') == 1.0
            for i in range(len(self.layer.urls))
            if i not in down
        )

    def _await_recovery(self, rec: FaultRecord, check: Any) -> None:
        assert rec.ended_at is not None
        end = rec.ended_at
        deadline = time.monotonic() + RECOVERY_BOUND_S
        back_at: float | None = None
        while time.monotonic() < deadline:
            over = self._over.is_set()  # read before the steps: a last step is not missed
            if back_at is None:
                with contextlib.suppress(OSError, ValueError, H.LayerError):
                    if check():
                        back_at = time.time()
            stepped = [t for _, t in self.step_times if t > end]
            if back_at is not None and (stepped or over):
                # After training ended no step can come: the gateway's side alone counts.
                rec.recovered_at = max(back_at, stepped[0]) if stepped else back_at
                rec.recovery_s = round(rec.recovered_at - end, 2)
                if not stepped:
                    rec.notes.append("recovered after the last step (gateway side only)")
                self._emit("recovered", fault=rec.index, kind=rec.kind, seconds=rec.recovery_s)
                return
            time.sleep(0.25)
        rec.notes.append(f"not recovered within {RECOVERY_BOUND_S:.0f} s of the fault's end")

    # ------------------------------------------------------------------ end

    def stop_scheduling(self) -> None:
        """No new fault: armed ones that never met their call are recorded as not fired."""
        self._stop.set()
        with self._lock:
            left = [r for rs in self._armed.values() for r in rs]
            self._armed.clear()
        for rec in left:
            rec.skipped = "armed, but the run ended before its phase came"

    def finish(self, timeout: float = RESTART_BOUND_S + 60) -> list[str]:
        """Stop scheduling, let every fault end (restarts included, bounded), undo what is
        left (SIGCONT every replica, stalled directories back) and take the last scrape."""
        self.stop_scheduling()
        self._over.set()
        deadline = time.monotonic() + timeout
        for th in self._threads:
            th.join(max(0.0, deadline - time.monotonic()))
        notes = [f"{th.name} still running after {timeout:.0f} s" for th in self._threads
                 if th.is_alive()]  # fmt: skip
        for i in range(len(self.layer.urls)):
            with contextlib.suppress(AssertionError, KeyError, ProcessLookupError):
                self.layer.signal_replica(i, signal.SIGCONT)
            self.layer.mend_network(i)
        for held in list(self._held):
            self._unstall(held)
        for rec in self.records:
            if rec.fired_at is None and rec.skipped is None:
                rec.skipped = "not reached: the run ended first"
        self.gateway_scrapes.append(scrape(self.layer.gateway.url))
        return notes

    def gateway_totals(self) -> dict[str, float]:
        """Each counter summed over every gateway process of the run."""
        return {k: sum(s.get(k, 0.0) for s in self.gateway_scrapes) for k in GATEWAY_COUNTERS}

    def to_json(self) -> dict[str, Any]:
        return {
            "t0": self.t0,
            "faults": [asdict(r) for r in self.records],
            "steps": self.step_times,
            "worker_pids_first_last": [self.worker_pids[:1], self.worker_pids[-1:]],
            "worker_pids_distinct": sorted({p for ps in self.worker_pids for p in ps}),
            "gateway_restarts": self.gateway_restarts,
            "gateway_scrapes": self.gateway_scrapes,
            "gateway_totals": self.gateway_totals(),
        }


def fleet_state(layer: H.Layer, owned: dict[str, str], wait_s: float = 60.0) -> dict[str, Any]:
    """Every adapter on every replica against what the run owns, and whether any replica
    (or the gateway) is left paused; waits (bounded) for drained unloads to land."""

    def exact() -> bool:
        return all(set(H.replica_adapters(u)) == set(owned) for u in layer.urls)

    with contextlib.suppress(AssertionError):
        H.wait_for(exact, wait_s, "replicas to hold exactly the run's adapters")
    held: dict[str, list[str]] = {}
    paused: dict[str, bool | None] = {}
    for i, u in enumerate(layer.urls):
        try:
            held[str(i)] = sorted(H.replica_adapters(u))
        except (OSError, H.LayerError) as exc:
            held[str(i)] = [f"<unreachable: {exc!r}>"]
        try:
            paused[str(i)] = bool(H.get_json(u + "/is_paused", timeout=5)["is_paused"])
        except (OSError, ValueError, KeyError, H.LayerError):
            paused[str(i)] = None
    strays = {i: sorted(set(h) - set(owned)) for i, h in held.items() if set(h) - set(owned)}
    missing = {i: sorted(set(owned) - set(h)) for i, h in held.items() if set(owned) - set(h)}
    try:
        gw_live = layer.gateway.live_adapters()
        gw_paused = layer.gateway_metric("gateway_fleet_paused")
    except (OSError, H.LayerError) as exc:
        gw_live, gw_paused = [f"<unreachable: {exc!r}>"], -1.0
    return {
        "owned": sorted(owned),
        "held": held,
        "strays": strays,
        "missing": missing,
        "gateway_live": gw_live,
        "replica_paused": paused,
        "gateway_fleet_paused": gw_paused,
    }
