"""The commit a gateway was built from (issue 34, item 9): ``gateway_build_info{commit}`` on
``/metrics`` and ``rollout-gateway --version``, from a checkout, from a wheel (what
``hatch_build.py`` writes: the image's build argument, or ``git``), and ``unknown``
anywhere else, never the commit of some other repository around an installed copy."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
from rollout_testbed.procs import free_port, wait_http

from tests.deploy._proc import REPO, base_env, process

_COMMIT = re.compile(r"[0-9a-f]{12}(-dirty)?")


def _head() -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip


def _version(python: str, *, cwd: Path, env: dict[str, str]) -> str:
    out = subprocess.run([python, "-m", "gateway", "--version"], cwd=cwd, env=env,
                         capture_output=True, text=True, check=True, timeout=60).stdout  # fmt: skip
    found = re.fullmatch(r"rollout-gateway \S+ \(commit (\S+)\)\n", out)
    assert found, out
    return found[1]


def _commit_of(python: str, *, cwd: Path, env: dict[str, str]) -> str:
    code = "import gateway; print(gateway.build_commit())"
    return subprocess.run([python, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, check=True, timeout=60).stdout.strip()  # fmt: skip


def test_a_checkout_reports_its_head_on_metrics_and_version(tmp_path: Path) -> None:
    before = _head()
    version = _version(sys.executable, cwd=REPO, env=base_env())
    port = free_port()
    cmd = [sys.executable, "-m", "gateway", "serve", "--replica", f"http://127.0.0.1:{free_port()}",
           "--port", str(port)]  # fmt: skip
    with process(cmd, env=base_env(), log=tmp_path / "gw.log"):
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/metrics", timeout=30)
        text = httpx.get(url + "/metrics", timeout=5).text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("gateway_build_info{")]
    found = re.search(r'commit="([^"]*)"', line)
    assert found, line
    after = _head()  # another commit may land meanwhile: either HEAD is the truth
    for commit in (version, found[1]):
        assert _COMMIT.fullmatch(commit) and commit[:12] in {before, after}, (commit, line)


def _wheel(out: Path, commit: str | None) -> Path:
    env = base_env()
    env.pop("GATEWAY_BUILD_COMMIT", None)
    if commit is not None:
        env["GATEWAY_BUILD_COMMIT"] = commit
    uv = shutil.which("uv", path=env["PATH"]) or "uv"  # `make venv` installs it
    subprocess.run([uv, "build", "--wheel", "--offline", "-q", "-o", str(out), str(REPO)],
                   env=env, check=True, timeout=300, capture_output=True)  # fmt: skip
    (wheel,) = out.glob("*.whl")
    site = out / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    return site


def test_a_wheel_carries_the_commit_it_was_built_from(tmp_path: Path) -> None:
    """The image's way (``--build-arg GATEWAY_BUILD_COMMIT``, no ``.git`` in its context)
    and ``pip install .``'s (``git`` in the source tree)."""
    site = _wheel(tmp_path / "arg", "feedc0ffee12")
    assert "COMMIT = 'feedc0ffee12'" in (site / "gateway" / "_build.py").read_text()
    env = base_env({"PYTHONPATH": str(site)})  # the unpacked wheel before the checkout
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    assert _version(sys.executable, cwd=elsewhere, env=env) == "feedc0ffee12"
    assert _commit_of(sys.executable, cwd=elsewhere, env=env) == "feedc0ffee12"

    before = _head()
    site = _wheel(tmp_path / "git", None)
    commit = _commit_of(sys.executable, cwd=elsewhere, env=base_env({"PYTHONPATH": str(site)}))
    assert _COMMIT.fullmatch(commit) and commit[:12] in {before, _head()}, commit


def test_a_copy_outside_its_checkout_says_unknown(tmp_path: Path) -> None:
    """No ``_build.py`` and no checkout of its own: ``unknown``, also inside another
    repository (a venv in some project's tree must not report that project's commit)."""
    plain = tmp_path / "plain"
    shutil.copytree(REPO / "gateway", plain / "gateway")
    other = tmp_path / "other"
    shutil.copytree(REPO / "gateway", other / "lib" / "gateway")
    git = ["git", "-C", str(other), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "other"], check=True)
    for root in (plain, other / "lib"):
        env = base_env({"PYTHONPATH": str(root)})
        assert not (root / "gateway" / "_build.py").exists()
        assert _commit_of(sys.executable, cwd=root, env=env) == "unknown", root
    assert os.path.isdir(other / ".git")
