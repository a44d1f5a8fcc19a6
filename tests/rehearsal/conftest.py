"""Session fixtures of the rehearsal: the tools (podman-compose, the dnsname CNI plugin)
and the three images (the sidecar, the vLLM CPU replica, Prometheus)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.container._podman import REPO, build_image
from tests.rehearsal.images import build


@pytest.fixture(scope="session")
def tools() -> None:
    res = subprocess.run(
        ["bash", str(REPO / "tests/deploy/ensure_tools.sh"), sys.executable, "rehearsal"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert res.returncode == 0, f"ensure_tools.sh rehearsal failed:\n{res.stdout}\n{res.stderr}"


@pytest.fixture(scope="session")
def gateway_image() -> str:
    return build_image()


@pytest.fixture(scope="session")
def vllm_image(gateway_image: str) -> str:  # after the sidecar's: it makes the base
    return build("vllm-cpu")


@pytest.fixture(scope="session")
def prometheus_image(gateway_image: str) -> str:
    return build("prometheus")
