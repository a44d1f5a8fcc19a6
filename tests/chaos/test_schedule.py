"""The chaos run's fault schedule (``rollout_testbed.chaos.schedule``): pure, so tested
here in the fast layer; the runs that carry it out are ``tests/trl/test_trl_chaos.py``
(CI) and ``bench/chaos.py`` (``make bench-chaos``)."""

from __future__ import annotations

import itertools

import pytest
from rollout_testbed.chaos.schedule import (
    GAP_S,
    KILL,
    KINDS,
    NET,
    NET_MODES,
    PHASES,
    REPLICA_KINDS,
    STALL,
    STALL_DEADLINE_FRACTION,
    STOP,
    Fault,
    make_schedule,
    summary,
)


def test_same_seed_same_schedule_and_other_seed_another() -> None:
    a = make_schedule(7, 1800)
    assert a == make_schedule(7, 1800)
    assert a != make_schedule(8, 1800)


def test_gaps_are_within_bounds_and_times_within_duration() -> None:
    for seed in range(20):
        faults = make_schedule(seed, 1800)
        times = [0.0] + [f.t for f in faults]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert all(GAP_S[0] - 0.01 <= g <= GAP_S[1] + 0.01 for g in gaps), gaps
        assert faults and faults[-1].t <= 1800
        # The schedule runs to the end: the next gap would have passed the duration.
        assert 1800 - faults[-1].t < GAP_S[1]


def test_a_long_run_meets_every_kind_and_every_phase_of_a_sync() -> None:
    faults = make_schedule(0, 1800)
    counts = summary(faults)
    assert all(counts.get(k, 0) >= 3 for k in KINDS), counts
    replica_phases = {f.params["phase"] for f in faults if f.kind in REPLICA_KINDS}
    assert replica_phases == set(PHASES)
    assert {f.params["mode"] for f in faults if f.kind == NET} == set(NET_MODES)
    # Network cuts land in every phase of a sync too, not only kills and stops.
    assert {f.params["phase"] for f in faults if f.kind == NET} == set(PHASES)


def test_a_short_run_meets_every_kind_once() -> None:
    """The CI test's shape: a handful of faults, one block of every kind once."""
    faults = make_schedule(3, 80, gap_s=(12, 15), block=KINDS)
    assert len(faults) >= len(KINDS)
    assert {f.kind for f in faults[: len(KINDS)]} == set(KINDS), [f.describe() for f in faults]


def test_params_are_in_range() -> None:
    for seed in range(20):
        for f in make_schedule(seed, 1800, replicas=2, load_deadline_s=60):
            p = f.params
            if f.kind in REPLICA_KINDS:
                assert p["replica"] in (0, 1) and p["phase"] in PHASES
            if f.kind == KILL:
                assert 2 <= p["restart_delay_s"] <= 30
            if f.kind in (STOP, NET):
                assert 1 <= p["hold_s"] <= 30
            if f.kind == NET:
                assert p["mode"] in NET_MODES
            if f.kind == STALL:
                assert 1 <= p["hold_s"] <= 60 * STALL_DEADLINE_FRACTION
                assert p["phase"] == "load"


def test_bounds_and_bad_arguments() -> None:
    assert make_schedule(1, 10) == []  # shorter than the first gap
    assert len(make_schedule(1, 10**6, max_faults=5)) == 5
    with pytest.raises(ValueError):
        make_schedule(1, 100, gap_s=(5, 1))
    with pytest.raises(ValueError):
        make_schedule(1, 100, block=("nope",))
    assert "kill(" in Fault(1.0, KILL, {"replica": 0}).describe()
    assert summary([Fault(1.0, STOP, {"phase": "load"})]) == {STOP: 1, "stop/load": 1}
