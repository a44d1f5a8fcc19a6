"""The sidecar package stands alone: ``gateway`` imports neither the testbed (sim, local
replicas, demo), nor the trainer, nor the libraries only those use."""

from __future__ import annotations

import ast
from pathlib import Path

import gateway

FORBIDDEN = ("rollout_testbed", "trainer", "fastapi", "httpx", "torch", "tests", "bench")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_gateway_imports_nothing_the_sidecar_does_not_run() -> None:
    root = Path(gateway.__file__).parent
    found = {
        f"{path.relative_to(root)}: {name}"
        for path in root.rglob("*.py")
        for name in _imports(path)
        if name.split(".")[0] in FORBIDDEN
    }
    assert not found, sorted(found)
    assert not (root / "sim").exists() and not (root / "local").exists()


def test_the_check_would_catch_an_import(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text("import httpx\nfrom rollout_testbed.sim import app\nfrom . import x\n")
    assert _imports(sample) == {"httpx", "rollout_testbed.sim"}


# The direction of imports between layers: tests/test_layers.py (it replaced a line cap).


def test_the_sidecar_is_in_folders_by_layer() -> None:
    """Top level: the wiring (app, core, supervisor, cli) and what every folder uses
    (config, errors, logs, metrics, the role parts). Each folder then sits in one band of
    the layers, so that folder to folder, too, imports only go down: the folders' order is
    ``test_folders_import_downward`` below."""
    root = Path(gateway.__file__).parent
    top = {p.stem for p in root.glob("*.py")} - {"__init__", "__main__"}
    assert top == {"app", "core", "supervisor", "cli", "config", "errors", "logs", "metrics",
                   "roles"}  # fmt: skip
    folders = {p.name for p in root.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == {"adapters", "api", "fleet", "http", "routing", "runs", "workers"}
