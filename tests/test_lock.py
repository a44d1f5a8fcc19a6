"""``requirements/dev.lock`` is the dev venv, exactly (``make venv`` syncs it): every package
the gateway and the testbed declare for the dev, test and bench environments is pinned
there, at a version their own specifiers accept. A dependency added to a pyproject.toml
without ``make lock`` would otherwise be missing from a fresh machine's venv while the
author's old venv still had it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
LOCKED = re.compile(r"^([A-Za-z0-9_.\-]+)==(\S+)", re.MULTILINE)
LOCAL = {"rollout-gateway", "rollout-testbed"}  # the lock installs these editable


def declared() -> list[Requirement]:
    gateway = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    testbed = tomllib.loads((REPO / "testbed" / "pyproject.toml").read_text())["project"]
    extras = gateway["optional-dependencies"]
    texts = [*gateway["dependencies"], *testbed["dependencies"]]
    for extra in ("test", "dev", "bench"):
        texts += extras[extra]
    reqs = [Requirement(t) for t in texts]
    return [r for r in reqs if canonicalize_name(r.name) not in LOCAL]


def locked() -> dict[str, str]:
    text = (REPO / "requirements" / "dev.lock").read_text()
    return {canonicalize_name(name): version for name, version in LOCKED.findall(text)}


def test_every_declared_requirement_is_locked_at_a_version_it_accepts() -> None:
    pins = locked()
    reqs = declared()
    assert len(reqs) > 20  # the reading found the declarations
    for req in reqs:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is declared but not in requirements/dev.lock: make lock"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"requirements/dev.lock pins {req.name}=={pins[name]}, outside {req}: make lock"
        )


def test_the_lock_installs_both_distributions_editable() -> None:
    lines = (REPO / "requirements" / "dev.lock").read_text().splitlines()
    assert "-e ." in lines and "-e ./testbed" in lines
