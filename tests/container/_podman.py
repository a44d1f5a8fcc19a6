"""podman for the container tests: the image builds, and containers that always go away.

Every container is started here under a unique ``rgw-test-*`` name and removed by that
name (never by a pattern); every wait is bounded. The flags in ``RUN_FLAGS`` are what
podman needs on these machines (runc, rlimits no higher than the shell's; see
scripts/build-image.sh, which builds the images the same way).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from tests.eventually import eventually_sync

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "build-image.sh"
SIM_CONTAINERFILE = Path(__file__).with_name("sim.Containerfile")


def _limits() -> list[str]:
    nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 1048576)
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[0], 32768)
    nofile = 1048576 if nofile < 0 else nofile
    nproc = 32768 if nproc < 0 else nproc
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


RUN_FLAGS = ["--runtime", "runc", *_limits()]


def podman(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one podman command; raises with its stderr when ``check`` and it failed."""
    res = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and res.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} -> {res.returncode}\n{res.stderr}")
    return res


def run_python(image: str, script: str) -> str:
    """``script`` run by the image's own python, isolated (``-I``) and offline; its stdout."""
    return podman(
        "run", "--rm", *RUN_FLAGS, "--network=none", "--entrypoint", "python", image,
        "-I", "-c", script,
    ).stdout  # fmt: skip


def build_image() -> str:
    """The sidecar image, via scripts/build-image.sh (installs podman if missing; cached)."""
    res = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=900, check=False
    )
    assert res.returncode == 0, (
        "scripts/build-image.sh failed (the container tests need podman, runc and "
        f"debootstrap, installed by it as root with apt-get):\n{res.stderr[-6000:]}"
    )
    return res.stdout.strip().splitlines()[-1]


def _sim_only_files() -> list[tuple[Path, str]]:
    """(file, path in site-packages) of FastAPI and each of its requirements (closure) that
    the sidecar's lock lacks, from the test venv: what the simulated replica adds."""
    import importlib.metadata as md
    import re

    from packaging.markers import Marker

    locked = {
        line.split("==")[0]
        for line in (REPO / "deploy/image/requirements.txt").read_text().splitlines()
        if "==" in line
    }
    todo, seen = ["fastapi"], set()
    while todo:
        name = todo.pop()
        if name in seen or name in locked:
            continue
        seen.add(name)
        for req in md.distribution(name).requires or []:
            spec, _, marker = req.partition(";")
            if not marker or Marker(marker).evaluate({"extra": ""}):
                todo.append(
                    re.split(r"[\s\[<>=!~(]", spec, maxsplit=1)[0].lower().replace("_", "-")
                )
    out = []
    for name in sorted(seen):
        dist = md.distribution(name)
        for f in dist.files or []:
            path = Path(str(dist.locate_file(f)))
            if path.is_file() and "__pycache__" not in f.parts and not str(f).startswith(".."):
                out.append((path, str(f)))
    src = REPO / "testbed" / "rollout_testbed"
    for path in sorted(src.rglob("*.py")):
        out.append((path, f"rollout_testbed/{path.relative_to(src)}"))
    return out


def build_sim_image(gateway_image: str) -> str:
    """The sidecar image plus the simulated replica (``rollout_testbed``, FastAPI and what it needs,
    copied from the test venv): the replicas of the kube-play pod. Tagged by a hash of
    what it adds, so it is built once per change (offline, in seconds)."""
    files = _sim_only_files()
    gw_id = podman("image", "inspect", "--format", "{{.Id}}", gateway_image).stdout.strip()
    digest = hashlib.sha256(gw_id.encode() + SIM_CONTAINERFILE.read_bytes())
    for src, dest in files:
        digest.update(dest.encode() + src.read_bytes())
    tag = f"localhost/rollout-gateway-sim:{digest.hexdigest()[:16]}"
    if podman("image", "exists", tag, check=False).returncode == 0:
        return tag
    with tempfile.TemporaryDirectory() as ctx:
        for src, dest in files:
            target = Path(ctx) / "site-packages" / dest
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
        podman(
            "build",
            *RUN_FLAGS,
            "--format",
            "docker",
            "--network",
            "none",
            "--build-arg",
            f"GATEWAY_IMAGE={gateway_image}",
            "--file",
            str(SIM_CONTAINERFILE),
            "--tag",
            tag,
            ctx,
            timeout=300,
        )
    old = podman("images", "--format", "{{.Repository}}:{{.Tag}}", tag.split(":")[0]).stdout
    for name in set(old.split()) - {tag}:  # superseded sim images
        podman("rmi", name, check=False)
    return tag


def inspect(name: str) -> dict[str, Any]:
    out = json.loads(podman("inspect", name).stdout)
    assert isinstance(out, list) and out, out
    return dict(out[0])


@contextlib.contextmanager
def container(image: str, *args: str, run_flags: Sequence[str] = ()) -> Iterator[str]:
    """``podman run -d`` this image; yields the container's name; removes it on exit."""
    name = f"rgw-test-{uuid.uuid4().hex[:10]}"
    podman("run", "-d", "--name", name, *RUN_FLAGS, *run_flags, image, *args, timeout=120)
    try:
        yield name
    finally:
        podman("rm", "--force", "--time", "5", name, check=False, timeout=60)


def logs(name: str) -> str:
    res = podman("logs", name, check=False)
    return res.stdout + res.stderr


def wait_http(url: str, *, timeout: float = 60.0, status: int = 200, name: str = "") -> float:
    """Poll ``url`` until it answers ``status``; returns the seconds it took. On a timeout
    the failure names the last answer (or error), and the container's log tail is printed."""
    start = time.monotonic()
    eventually_sync(
        lambda: httpx.get(url, timeout=2.0).status_code == status,
        f"{url} to answer {status}",
        timeout=timeout,
        ignore=(httpx.HTTPError,),
        on_timeout=lambda: print(logs(name)[-3000:] if name else ""),
    )
    return time.monotonic() - start


def replica_cmd(port: int, token_file: Path, *extra: str) -> list[str]:
    """A token-checking sim replica on the host (tests/container/auth_replica.py)."""
    return [
        sys.executable,
        "-m",
        "tests.container.auth_replica",
        "--port",
        str(port),
        "--token-file",
        str(token_file),
        *extra,
    ]


def host_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
