"""tests/trainer runs with the vLLM venv's python (torch, transformers, peft):

    $GATEWAY_VLLM_PYTHON -m pytest tests/trainer

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
