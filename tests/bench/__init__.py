"""Tests of ``bench/`` scripts, and the loader they share."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(script: str) -> ModuleType:
    """``bench/<script>.py`` as module ``bench_<script>`` (``bench/`` is not a package;
    registered in ``sys.modules`` so its dataclasses resolve their own module)."""
    name = f"bench_{script}"
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{script}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
