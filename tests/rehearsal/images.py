"""The images of the rehearsal, built once per change of their inputs (each build script
tags its image by a hash of them, so an unchanged tree costs no build)."""

from __future__ import annotations

import subprocess

from tests.container._podman import REPO

SCRIPT = REPO / "scripts" / "build-rehearsal-image.sh"


def build(kind: str) -> str:
    """``vllm-cpu`` or ``prometheus`` (scripts/build-rehearsal-image.sh); the image name."""
    res = subprocess.run(
        ["bash", str(SCRIPT), kind], capture_output=True, text=True, timeout=1200, check=False
    )
    assert res.returncode == 0, f"{SCRIPT.name} {kind} failed:\n{res.stderr[-6000:]}"
    return res.stdout.strip().splitlines()[-1]
