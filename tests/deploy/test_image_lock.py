"""The sidecar image's lock (deploy/image/*.txt, from scripts/lock-image.sh) agrees with
pyproject.toml, so the image installs what the gateway declares and nothing it does not
run. Offline and fast; tests/container builds and runs the image itself."""

from __future__ import annotations

import re
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy._proc import REPO

IMAGE = REPO / "deploy" / "image"
# Declared by pyproject.toml but never imported by `rollout-gateway serve` (none since
# the simulated replica moved to the testbed).
NOT_IN_IMAGE: set[str] = set()


def pins(path: str) -> dict[str, str]:
    text = (IMAGE / path).read_text()
    found = re.findall(r"^([A-Za-z0-9_.\-]+)==([^\s\\]+)", text, flags=re.M)
    return {canonicalize_name(name): version for name, version in found}


def test_every_runtime_dependency_is_locked_at_a_version_it_allows() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    locked = pins("requirements.txt")
    for spec in project["project"]["dependencies"]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        if name in NOT_IN_IMAGE:
            assert name not in locked, f"{name} is not run by the sidecar: keep it out"
            continue
        assert name in locked, f"{name} missing from the lock: run scripts/lock-image.sh"
        assert req.specifier.contains(locked[name], prereleases=True), (name, locked[name])


def test_build_backend_is_locked() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    locked = pins("build-requirements.txt")
    for spec in project["build-system"]["requires"]:
        req = Requirement(spec)
        assert req.specifier.contains(locked[canonicalize_name(req.name)])


def test_every_pin_carries_hashes() -> None:
    """pip --require-hashes in the Dockerfile refuses a pin without one."""
    for lock in ("requirements.txt", "build-requirements.txt"):
        blocks = re.split(r"\n(?=\S)", (IMAGE / lock).read_text())
        for block in blocks:
            if "==" in block:
                assert "--hash=sha256:" in block, block.splitlines()[0]
