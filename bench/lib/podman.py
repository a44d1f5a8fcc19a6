"""podman for the image benchmark (``bench/image.py``): build the sidecar image, run it
locked down, read what it holds.

Why not the container tests' helpers: bench/ does not import tests/. The flags are the
ones scripts/build-image.sh and the container tests use on these machines: the runc
runtime, and rlimits no higher than the shell's (podman refuses more). Every container is
started under a unique name and removed by that name; every call is bounded.
"""

from __future__ import annotations

import contextlib
import json
import resource
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.lib.fronts import ROOT

SECRET_DIR = "/run/secrets/hf"


def _rlimit(which: int, cap: int) -> int:
    soft = resource.getrlimit(which)[0]
    return cap if soft < 0 else min(soft, cap)


_NOFILE = _rlimit(resource.RLIMIT_NOFILE, 1048576)
_NPROC = _rlimit(resource.RLIMIT_NPROC, 32768)
RUN_FLAGS = [
    "--runtime",
    "runc",
    "--ulimit",
    f"nofile={_NOFILE}:{_NOFILE}",
    "--ulimit",
    f"nproc={_NPROC}:{_NPROC}",
]


def podman(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``podman ARGS``; raises RuntimeError with its stderr if it fails."""
    res = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if res.returncode:
        raise RuntimeError(f"podman {' '.join(args)}: exit {res.returncode}\n{res.stderr}")
    return res


def build_image() -> str:
    """The sidecar image's name, built (or reused, cached) by scripts/build-image.sh."""
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build-image.sh")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if res.returncode:
        raise RuntimeError(f"scripts/build-image.sh failed:\n{res.stderr[-6000:]}")
    return res.stdout.strip().splitlines()[-1]


def inspect(name: str) -> dict[str, Any]:
    """``podman inspect`` of one image or container."""
    return dict(json.loads(podman("inspect", name).stdout)[0])


def run_python(image: str, script: str) -> str:
    """The stdout of ``script`` run by the image's own python (isolated, offline)."""
    argv = ["run", "--rm", *RUN_FLAGS, "--network=none", "--entrypoint", "python", image]
    return podman(*argv, "-I", "-c", script).stdout


@contextlib.contextmanager
def container(image: str, run_flags: Sequence[str]) -> Iterator[str]:
    """``podman run -d`` of ``image``; yields the container's name; removed on exit."""
    name = f"rgw-bench-{uuid.uuid4().hex[:10]}"
    podman("run", "-d", "--name", name, *RUN_FLAGS, *run_flags, image, timeout=120)
    try:
        yield name
    finally:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            podman("rm", "--force", "--time", "5", name)


def secret_file(root: Path, token: str) -> Path:
    """A folder holding ``token`` in ``token``, world-readable, as a k8s secret volume."""
    root.mkdir(mode=0o755, parents=True, exist_ok=True)
    (root / "token").write_text(token + "\n")
    for path, mode in ((root, 0o755), (root / "token", 0o644)):
        path.chmod(mode)
    return root


def gateway_flags(port: int, replicas: Sequence[str], secret_dir: Path) -> list[str]:
    """``podman run`` flags of a locked-down sidecar, configured only through GATEWAY_*."""
    env = {
        "GATEWAY_REPLICAS": ",".join(replicas),
        "GATEWAY_HOST": "127.0.0.1",
        "GATEWAY_PORT": str(port),
        "GATEWAY_UPSTREAM_TOKEN_FILE": f"{SECRET_DIR}/token",
        "GATEWAY_SHUTDOWN_TIMEOUT_S": "20",
    }
    locked = "--network=host --read-only --read-only-tmpfs=false --cap-drop=ALL"
    flags = [*locked.split(), "--security-opt=no-new-privileges"]
    flags += ["--volume", f"{secret_dir}:{SECRET_DIR}:ro"]
    return flags + [f"--env={k}={v}" for k, v in env.items()]
