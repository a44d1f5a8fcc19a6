"""tests/trainer runs with the vLLM venv's python (torch, transformers, peft):

    $ROLLOUT_TESTBED_VLLM_PYTHON -m pytest tests/trainer

In the gateway venv (no torch) the whole folder is skipped at collection, so the fast
gateway suite stays torch-free. Third-party deprecation warnings raised inside torch,
transformers and peft are not ours to fix; they are ignored here rather than globally.
"""

from __future__ import annotations

import importlib.util

import pytest

collect_ignore_glob = [] if importlib.util.find_spec("torch") else ["test_*.py"]

_IGNORED = (
    "ignore::DeprecationWarning",
    "ignore::FutureWarning",
    "ignore::UserWarning:torch.*",
    "ignore::UserWarning:transformers.*",
    "ignore::UserWarning:peft.*",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/trainer" in str(item.path):
            for spec in _IGNORED:
                item.add_marker(pytest.mark.filterwarnings(spec))


@pytest.fixture(scope="session", autouse=True)
def _tiny_model() -> None:
    """The driver loads ``.run/tiny-model`` (tests/trainer/helpers.py): build it on a fresh
    clone, where nothing has made it yet (about 5 s, deterministic)."""
    from pathlib import Path

    from rollout_testbed.local.tiny_model import build

    model = Path(__file__).resolve().parents[2] / ".run" / "tiny-model"
    if not (model / "tiny-model.json").exists():
        build(model, force=model.exists())
