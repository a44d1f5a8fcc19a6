"""``WorkerRuns``: a data-plane worker adopting the run sets its owner sends (the owner's
side and real processes: ``tests/runs/test_reload.py``)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from gateway.app import build_gateway
from gateway.config import load_settings
from gateway.core import Gateway
from gateway.runs.mode import WorkerRuns
from gateway.runs.table import Run, RunTable
from gateway.workers.snapshot import SnapshotFeed
from tests.eventually import STALL_S, eventually


def worker(tmp_path: Path) -> Gateway:
    runs = []
    for name in ("run-a", "run-b"):
        (tmp_path / name).mkdir(exist_ok=True)
        runs.append({"name": name, "key": f"key-{name}", "adapter_root": str(tmp_path / name),
                     "max_staleness": 1, "remove_grace_s": 30, "key_overlap_s": 0.2})  # fmt: skip
    settings: dict[str, Any] = {"replicas": ["http://127.0.0.1:9000"], "runs": runs}
    return build_gateway(load_settings(settings, environ={}), routes=SnapshotFeed())


def as_sent(table: RunTable) -> RunTable:
    """The table as the owner's channel carries it."""
    return RunTable(Run.from_wire(r.to_wire()) for r in table.runs)


def named(gw: Gateway, key: str) -> str | None:
    run = gw.tenancy.table.identify(f"Bearer {key}".encode())
    return None if run is None else run.name


async def test_a_worker_adopts_removals_rotations_and_a_quick_return(tmp_path: Path) -> None:
    gw = worker(tmp_path)
    runs = WorkerRuns(gw.tenancy, drain_s=1.0)
    try:
        a, b = gw.tenancy.table["run-a"], gw.tenancy.table["run-b"]
        # The overlap outlasts any stall between the adoption and the checks inside it.
        rotated = Run("run-a", b"key-run-a-2", 1, a.roots, key_overlap_s=2 * STALL_S)
        runs.adopt(as_sent(RunTable([rotated])))  # run-a's key rotated, run-b removed
        assert named(gw, "key-run-a-2") == named(gw, "key-run-a") == "run-a"  # the overlap
        assert named(gw, "key-run-b") is None and "run-b" in gw.tenancy.leaving
        assert [r["state"] for r in gw.tenancy.status()] == ["serving", "leaving"]
        # run-b back before this worker noticed it drained (its grace is 30 s): the owner
        # saw it gone, so the worker takes it back rather than refuse the set
        runs.adopt(as_sent(RunTable([rotated, b])))
        assert named(gw, "key-run-b") == "run-b" and not gw.tenancy.leaving

        async def old_key_gone() -> bool:  # the overlap's end is a real timer
            return named(gw, "key-run-a") is None

        await eventually(old_key_gone, "the rotated key's overlap to end")
        assert named(gw, "key-run-a-2") == "run-a"
    finally:
        await runs.aclose()


async def test_a_removed_run_with_nothing_in_flight_is_gone_at_once(tmp_path: Path) -> None:
    gw = worker(tmp_path)
    runs = WorkerRuns(gw.tenancy, drain_s=1.0)
    try:
        runs.adopt(as_sent(RunTable([gw.tenancy.table["run-a"]])))
        for _ in range(100):  # its departure is a task: it ends at the next turns
            if not gw.tenancy.leaving:
                break
            await asyncio.sleep(0.01)
        assert not gw.tenancy.leaving and list(gw.tenancy.tenants) == ["run-a"]
    finally:
        await runs.aclose()
