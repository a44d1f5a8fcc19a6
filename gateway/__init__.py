"""rollout-gateway: N vLLM replicas behind one TRL-compatible vLLM URL.

Its modules and folders, bottom to top (``docs/architecture.md``, "Layout"):

* ``errors``      OpenAI-style errors, each with its HTTP status
* ``logs``        logging setup: human-readable or one JSON object per line
* ``routing``     the pure routing cores: prompt keys, the ring, the policies
* ``config``      ``Settings``: flags, environment and file, validated once at start
* ``roles``       what a process's role changes: the role parts, as Protocols
* ``http``        the socket layer: the server, the upstream clients, the relay
* ``adapters``    the adapters' state machine and the calls that carry it out
* ``runs``        several runs sharing one fleet: keys, homes, fair share, usage
* ``metrics``     every Prometheus metric, defined once
* ``fleet``       the replicas: health, rotation, a request's selection and ledger
* ``core``        ``Gateway``: the parts of one process, held together
* ``api``         the HTTP surface: what each path does
* ``workers``     ``serve --workers N``: the owner, the workers, their messages
* ``app``         the ASGI app factory and its lifespan
* ``supervisor``  ``serve --workers N``: forks the owner and the workers, restarts them
* ``cli``         ``rollout-gateway``: one subcommand per job
* ``__main__``    ``python -m gateway``, as the console script
"""

from __future__ import annotations

import functools
from pathlib import Path

__version__ = "0.1.0"


@functools.cache
def build_commit() -> str:
    """The commit this code was built from, for ``--version`` and ``gateway_build_info``:
    what the wheel's build wrote (``gateway/_build.py``, by ``hatch_build.py``: the image,
    ``pip install .``), else ``git`` when running from a checkout (an editable install,
    ``python -m gateway``), else ``unknown``. Asked once per process."""
    import importlib

    try:  # only in a built wheel: no module to type-check here
        return str(importlib.import_module("gateway._build").COMMIT)
    except ImportError:
        pass
    return git_commit(Path(__file__).resolve().parent.parent) or "unknown"


def git_commit(root: Path) -> str | None:
    """``<12 hex>`` of ``HEAD`` when ``root`` is the top of a checkout, ``-dirty``
    appended when tracked files differ from it; None otherwise (an installed copy inside
    some other repository must not report that one's commit). ``hatch_build.py`` has the
    same rule for the wheel (it cannot import the package it builds)."""
    import subprocess

    try:
        found = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"],
                               capture_output=True, text=True, timeout=10)  # fmt: skip
        lines = found.stdout.split()
        if found.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != root:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD", "--"],
                               capture_output=True, timeout=30).returncode  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return lines[1][:12] + ("-dirty" if dirty == 1 else "")
