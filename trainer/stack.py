"""A sim stack for the driver's tests (standard library only): sim replicas and a gateway
as subprocesses on 127.0.0.1, run by the gateway venv's python (``rollout_testbed.procs``
starts, waits for and stops them, by PID)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rollout_testbed.procs import SimFleet, sim_fleet

__all__ = ["gateway_python", "sim_gateway"]

REPO = Path(__file__).resolve().parents[1]


def gateway_python() -> str:
    """The gateway venv's python (``$GATEWAY_PYTHON``, ``<repo>/.venv``), else this one."""
    env = os.environ.get("GATEWAY_PYTHON")
    cand = Path(env) if env else REPO / ".venv" / "bin" / "python"
    return str(cand) if cand.exists() else sys.executable


def _env() -> dict[str, str]:
    """This environment with the repository first on ``PYTHONPATH``, outside any venv."""
    env = dict(os.environ)
    extra = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + extra if extra else "")
    env.pop("VIRTUAL_ENV", None)
    return env


@contextmanager
def sim_gateway(
    n: int, max_staleness: int, log_dir: Path, latency: str = "prefill=1e-5,decode=5e-4"
) -> Iterator[SimFleet]:
    """``n`` sim replicas (``max_loras = max_staleness + 2``) behind one gateway."""
    sim_args = ["--max-loras", str(max_staleness + 2), "--latency-model", latency]
    gateway_args = ["--max-staleness", str(max_staleness), "--health-interval-s", "0.5"]
    with sim_fleet(
        n, log_dir, python=gateway_python(), sim_args=sim_args, gateway_args=gateway_args,
        env=_env(), cwd=REPO,
    ) as fleet:  # fmt: skip
        yield fleet
