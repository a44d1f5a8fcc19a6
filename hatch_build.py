"""Hatch build hook: the wheel carries the commit it was built from, as
``gateway/_build.py`` (``COMMIT = "..."``), read by ``gateway.build_commit()`` for
``rollout-gateway --version`` and ``gateway_build_info``.

Where the commit comes from, first found: ``GATEWAY_BUILD_COMMIT`` (the image's build
argument: its build context has no ``.git``), then ``git`` in the source tree (``pip install
.`` from a checkout; ``-dirty`` when tracked files differ from it), else ``unknown``. An
editable install gets no file: it runs from the checkout, where ``git`` answers at run
time and stays true after the next commit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


def git_commit(root: str) -> str | None:
    """``gateway.git_commit``'s rule (this hook cannot import the package it builds):
    ``<12 hex>`` of ``HEAD`` when ``root`` is the top of a checkout, ``-dirty`` when
    tracked files differ; None otherwise."""
    try:
        found = subprocess.run(["git", "-C", root, "rev-parse", "--show-toplevel", "HEAD"],
                               capture_output=True, text=True, timeout=10)  # fmt: skip
        lines = found.stdout.split()
        if found.returncode != 0 or len(lines) != 2:
            return None
        if Path(lines[0]).resolve() != Path(root).resolve():
            return None
        dirty = subprocess.run(["git", "-C", root, "diff", "--quiet", "HEAD", "--"],
                               capture_output=True, timeout=30).returncode  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return lines[1][:12] + ("-dirty" if dirty == 1 else "")


class CommitHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if version == "editable":
            return
        commit = os.environ.get("GATEWAY_BUILD_COMMIT") or git_commit(self.root) or "unknown"
        self._tmp = tempfile.mkdtemp(prefix="gateway-build-")
        path = Path(self._tmp) / "_build.py"
        path.write_text(f'"""Written by hatch_build.py at build time."""\n\nCOMMIT = {commit!r}\n')
        build_data["force_include"][str(path)] = "gateway/_build.py"

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        if tmp := getattr(self, "_tmp", None):
            shutil.rmtree(tmp, ignore_errors=True)
