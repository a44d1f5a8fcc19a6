"""The README's way to get the test replicas works in a fresh venv, and the demo outside
the checkout says in one line what it needs (issue 34, item 9).

The fresh venv is made and filled with ``uv`` offline (``make venv`` puts every package
in its cache), the same resolution as the README's ``pip install . ./testbed``: the
testbed's ``rollout-gateway`` is the directory given beside it, never a package index.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.deploy._proc import REPO, base_env

README = REPO / "README.md"


def _uv() -> str:
    return shutil.which("uv", path=base_env()["PATH"]) or "uv"  # `make venv` installs it


def _install(venv: Path, *targets: str) -> subprocess.CompletedProcess[str]:
    subprocess.run([_uv(), "venv", "-q", "--python", sys.executable, str(venv)],
                   check=True, timeout=120, capture_output=True)  # fmt: skip
    return subprocess.run(
        [_uv(), "pip", "install", "--offline", "-q", "--python", str(venv / "bin" / "python"),
         *targets], cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_the_readme_installs_the_testbed_with_the_gateway() -> None:
    text = README.read_text()
    assert "pip install . ./testbed" in text
    alone = [m for m in re.findall(r"`pip install ([^`]*)`", text) if m.strip() == "./testbed"]
    assert alone == ["./testbed"], alone  # named once: as the way that fails, and why
    assert "No matching distribution found for rollout-gateway" in text


def test_a_fresh_venv_runs_the_sim_demo_from_the_checkout(tmp_path: Path) -> None:
    venv = tmp_path / "fresh"
    done = _install(venv, ".", "./testbed")
    assert done.returncode == 0, done.stderr
    bin_ = venv / "bin"
    env = base_env()
    env["PATH"] = f"{bin_}:{env['PATH']}"
    demo = [str(bin_ / "rollout-testbed"), "demo", "--sim", "--steps", "1"]
    ran = subprocess.run(demo, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0 and "demo OK" in ran.stdout, (ran.stdout[-2000:], ran.stderr)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ran = subprocess.run(demo, cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert ran.returncode == 2, (ran.stdout, ran.stderr)
    assert ran.stdout == "" and ran.stderr.count("\n") == 1, ran.stderr
    assert ran.stderr.startswith("rollout-testbed demo: needs a checkout of rollout-gateway")


def test_the_testbed_alone_does_not_resolve(tmp_path: Path) -> None:
    """Why the README names both: the testbed's dependency is on no package index."""
    done = _install(tmp_path / "alone", "./testbed")
    assert done.returncode != 0 and "rollout-gateway" in done.stderr, done.stderr
