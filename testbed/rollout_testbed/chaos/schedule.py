"""The seeded fault schedule of a chaos run: pure, deterministic, standard library only.

``make_schedule(seed, duration_s)`` is the whole contract: the same seed and duration give
the same list of ``Fault(t, kind, params)``, so a run that broke something can be replayed
fault for fault, and the CI test's handful of faults is fixed by its seed.

Why it looks the way it does:

* **Gaps of 20-60 s** (uniform, seeded): more often and the fleet never settles, so a
  fault's recovery could not be told from the next fault's damage; less often and a
  30-minute run sees too few faults.
* **Kinds drawn in shuffled blocks**, not independently: every block holds each kind of
  ``BLOCK`` once (stops twice: they are cheap), so even a short run meets every kind and
  a long one cannot starve one by bad luck. Replica kills are the expensive fault (a vLLM
  cold start, 40-120 s on this CPU box), hence one per block.
* **Every phase of a sync is hit on purpose.** A replica fault carries a ``phase``:
  ``between`` fires at its time (rollouts in flight), ``pause`` / ``load`` / ``resume``
  are armed at their time and fire right before TRL's next call of that kind (the
  trainer's own control flow, so the fault lands inside that phase of the sync). The
  phases of the replica faults cycle through a shuffled order, so each phase is hit
  about equally often.
* **Gateway restarts happen between two syncs** (at a step's end, in the trainer's
  thread, as ``tests/trl/test_trl_faults.py`` does): TRL's ``VLLMClient`` sends
  ``/pause``, ``/v1/load_lora_adapter`` and ``/resume`` once, with no retry, so a gateway
  that is down while one is sent ends TRL's run whatever the gateway does. Rollouts in
  flight (TRL's worker retries those) do meet the restart.
* **Network cuts** firewall one replica's port inside its own network namespace
  (``rollout_testbed.local.netns``) for ``hold_s``, by one of four ``mode``s drawn in
  turn: a partition (dropped both ways), a reject (TCP resets), requests lost and answers
  lost (one way each; with answers lost the replica still acts on what it receives). They
  are replica faults, so they carry a ``phase`` like kills and stops, and come twice a
  block: one kind of cut per block would take a long run to meet each mode in each phase.
* **Folder stalls** hold a just-published adapter directory back, so the gateway's load
  meets mount lag; the hold is drawn below the gateway's load deadline times
  ``STALL_DEADLINE_FRACTION``: past the deadline the gateway answers 504 (its documented
  answer) and TRL, which does not retry a load, ends the run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

KILL = "kill"  # SIGKILL a replica's process group; a fresh vLLM after restart_delay_s
STOP = "stop"  # SIGSTOP a replica's process group for hold_s, then SIGCONT
GATEWAY = "gateway"  # restart the gateway on its port (SIGTERM or SIGKILL)
STALL = "stall"  # hold a just-published adapter directory back for hold_s
NET = "net"  # cut a replica's network (mode) for hold_s, then mend it
KINDS = (KILL, STOP, GATEWAY, STALL, NET)
REPLICA_KINDS = (KILL, STOP, NET)
BLOCK = (KILL, STOP, STOP, GATEWAY, STALL, NET, NET)
PHASES = ("between", "pause", "load", "resume")
NET_MODES = ("partition", "reject", "requests_lost", "answers_lost")  # local.netns.MODES
GAP_S = (20.0, 60.0)
KILL_RESTART_DELAY_S = (2.0, 30.0)
STOP_HOLD_S = (1.0, 30.0)
NET_HOLD_S = (1.0, 30.0)
STALL_DEADLINE_FRACTION = 0.8


@dataclass(frozen=True)
class Fault:
    """One fault: ``t`` seconds after the chaos clock starts, of ``kind``, with ``params``
    (``replica``, ``phase``, ``restart_delay_s``, ``hold_s``, ``signal``, ``mode``)."""

    t: float
    kind: str
    params: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"t={self.t:.1f}s {self.kind}({args})"


def make_schedule(
    seed: int,
    duration_s: float,
    *,
    gap_s: tuple[float, float] = GAP_S,
    replicas: int = 2,
    load_deadline_s: float = 60.0,
    block: tuple[str, ...] = BLOCK,
    max_faults: int = 10_000,
) -> list[Fault]:
    """Faults at ``t`` in ``(gap_lo, duration_s]``, one every ``gap_s`` seconds, seeded.

    The first fault comes one gap after the start (the trainer's first step), never at 0;
    no fault is scheduled past ``duration_s``. ``max_faults`` bounds the loop.
    """
    lo, hi = gap_s
    if not 0 < lo <= hi:
        raise ValueError(f"gap_s must be 0 < lo <= hi, got {gap_s}")
    if replicas < 1 or load_deadline_s <= 0 or not block:
        raise ValueError("need replicas >= 1, load_deadline_s > 0 and a non-empty block")
    rng = random.Random(seed)
    kinds: list[str] = []
    phases: list[str] = []
    modes: list[str] = []
    out: list[Fault] = []
    t = 0.0
    while len(out) < max_faults:
        t += rng.uniform(lo, hi)
        if t > duration_s:
            break
        if not kinds:
            kinds = list(block)
            rng.shuffle(kinds)
        kind = kinds.pop(0)
        params: dict[str, Any]
        if kind in REPLICA_KINDS:
            if not phases:
                phases = list(PHASES)
                rng.shuffle(phases)
            params = {"replica": rng.randrange(replicas), "phase": phases.pop(0)}
            if kind == KILL:
                params["restart_delay_s"] = round(rng.uniform(*KILL_RESTART_DELAY_S), 1)
            elif kind == STOP:
                params["hold_s"] = round(rng.uniform(*STOP_HOLD_S), 1)
            else:
                if not modes:
                    modes = list(NET_MODES)
                    rng.shuffle(modes)
                params["mode"] = modes.pop(0)
                params["hold_s"] = round(rng.uniform(*NET_HOLD_S), 1)
        elif kind == GATEWAY:
            params = {"signal": rng.choice(("SIGTERM", "SIGKILL")), "phase": "step_end"}
        elif kind == STALL:
            top = max(1.0, load_deadline_s * STALL_DEADLINE_FRACTION)
            params = {"hold_s": round(rng.uniform(1.0, top), 1), "phase": "load"}
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        out.append(Fault(round(t, 2), kind, params))
    return out


def summary(faults: list[Fault]) -> dict[str, int]:
    """How many faults of each kind, and of each phase (``kind/phase``)."""
    out: dict[str, int] = {}
    for f in faults:
        out[f.kind] = out.get(f.kind, 0) + 1
        key = f"{f.kind}/{f.params.get('phase', '')}"
        out[key] = out.get(key, 0) + 1
    return out
