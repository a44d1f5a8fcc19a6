"""Process helpers for the deploy tests, on ``rollout_testbed.procs``: the test's
environment without ``GATEWAY_*``, a command as a context manager, a sim replica.

Every process is started by these helpers and stopped by its own PID (never by name);
every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from rollout_testbed.procs import Proc, free_port, sim_argv

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every process a test starts: the test's own without any
    ``GATEWAY_*`` leaking in, the venv's bin first on PATH, unbuffered output, plus
    ``extra``.

    ``PYTHONDONTWRITEBYTECODE`` is dropped: with it, every one of the suite's ~50 process
    starts recompiles FastAPI, pydantic and uvicorn from source (~1.4 s of CPU each on this
    2-core machine, against ~0.6 s with cached bytecode). The caches are git-ignored."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


@contextlib.contextmanager
def process(
    cmd: Sequence[str], *, env: Mapping[str, str] | None = None, log: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """``cmd`` running (output to ``log`` or discarded) for the block; SIGTERM, SIGKILL
    after 15 s, on exit. Yields the ``Popen``: tests send their own signals to it."""
    proc = Proc(Path(cmd[0]).name, list(cmd), log, env=env or base_env(), cwd=REPO,
                new_session=False, append=False)  # fmt: skip
    proc.start()
    assert proc.popen is not None
    try:
        yield proc.popen
    finally:
        proc.stop(grace=15, kill_wait=5)


@contextlib.contextmanager
def sim_replica(*args: str, port: int | None = None) -> Iterator[str]:
    """A ``rollout-testbed sim-replica`` process; yields its base URL once it answers."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    with Proc("sim-replica", sim_argv(port, extra=args), env=base_env(), cwd=REPO, url=url,
              new_session=False) as proc:  # fmt: skip
        proc.wait_http("/health")
        yield url
