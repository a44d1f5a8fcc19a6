"""The vLLM venv's python for the e2e tests here: one rule, and a failure (never a skip)."""

from __future__ import annotations

import pytest
from rollout_testbed.local.vllm_env import VllmNotInstalledError, check_vllm_python


def vllm_python() -> str:
    """``$ROLLOUT_TESTBED_VLLM_PYTHON``, else the checkout's ``.venv-vllm`` (``find_vllm_python``);
    the test FAILS when it cannot import vLLM: the CI installs it first."""
    try:
        return str(check_vllm_python(None))
    except VllmNotInstalledError as exc:
        pytest.fail(f"the e2e layer cannot start:\n{exc}")
