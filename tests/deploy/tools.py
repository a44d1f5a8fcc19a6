"""Run tests/deploy/ensure_tools.sh once per session (promtool, prometheus, hadolint,
kubernetes-validate, dnslib), then find the binaries."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.deploy._proc import REPO, VENV_BIN

SCRIPT = REPO / "tests" / "deploy" / "ensure_tools.sh"


@functools.cache
def ensure_tools() -> None:
    res = subprocess.run(
        ["bash", str(SCRIPT), sys.executable],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"ensure_tools.sh failed:\n{res.stdout}\n{res.stderr}")


def tool(name: str) -> Path:
    ensure_tools()
    found = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if not found:
        raise RuntimeError(f"{name} not found after ensure_tools.sh")
    return Path(found)
