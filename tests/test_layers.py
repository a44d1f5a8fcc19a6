"""The direction of imports inside ``gateway``: each module imports only from its own
layer or the ones below, and no import cycle exists.

This replaced a cap on module length: a long module is a smell, an import that goes
up is a design error (a lower part that knows the wiring above it cannot be tested,
reused or replaced alone). Imports under ``TYPE_CHECKING`` count too: a type that names
the layer above is the same knowledge. ``docs/architecture.md`` ("Layers") explains each
layer; a new module must be placed in one here, or the test fails.

    .venv/bin/python -m tests.test_layers     # print the layers and each module's imports
"""

from __future__ import annotations

import ast
import fnmatch
from collections.abc import Iterable
from pathlib import Path

import gateway

ROOT = Path(gateway.__file__).parent

# Bottom to top. A pattern names modules by dotted path under ``gateway``.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "the ground: settings, the pure cores and the leaves that import only them; pure "
        "(no I/O, no event loop) but for the modules in LAYER_0_IO",
        ("gateway", "adapters", "fleet", "http", "http.server", "routing", "runs",  # faces
         "workers", "errors", "logs", "config", "routing.policy", "routing.decision",
         "routing.prefix", "routing.ring", "routing.index", "routing.fleet", "routing.config",
         "adapters.naming",
         "adapters.state", "adapters.placement", "adapters.checks", "fleet.quorum",
         "fleet.outliers", "fleet.retry_budget", "fleet.admission", "fleet.aborts",
         "fleet.replicas", "fleet.discovery", "runs.table", "runs.scope", "runs.usage",
         "runs.lifecycle", "runs.fairshare", "workers.merge",
         "workers.channel", "adapters.cache_salt", "runs.aborts", "roles"),
    ),
    (
        "parts: HTTP in and out, the fleet's shared state and control calls, each run's "
        "adapters, metrics",
        ("http.*", "fleet.shared", "fleet.control", "fleet.metrics", "adapters.fanout",
         "adapters.manager", "runs.tenancy", "runs.metrics", "runs.placing", "runs.mode",
         "metrics", "fleet.rotation", "fleet.fanout", "fleet.health",
         "fleet.ledger", "fleet.selection", "runs.credentials", "runs.fairness"),
    ),
    ("the gateway: the parts of one process held together", ("core",)),
    ("the API: handlers, the rollout path", ("api", "api.*")),
    (
        "wiring: the app, start-up checks, the processes of --workers N",
        ("app", "fleet.preflight", "workers.owner", "workers.worker", "workers.snapshot",
         "supervisor"),
    ),
    ("entry points", ("cli", "__main__")),
)  # fmt: skip


# The layer-0 modules that touch I/O or the event loop, and what they touch. Layer 0 is
# defined by its imports (nothing above it), not by purity; this list is what keeps its
# label honest: ``test_layer_0_touches_io_only_where_it_says`` holds it to the code.
LAYER_0_IO: dict[str, str] = {
    "gateway": "runs ``git`` for the build commit when no wheel recorded one",
    "config": "reads the config file, secret files and the environment",
    "adapters.checks": "lists an adapter's folder (``check_path``)",
    "fleet.discovery": "resolves DNS and re-reads the replicas file (``Discovery``, async)",
    "fleet.aborts": "cancels the asyncio tasks waiting on an ejected replica",
    "runs.aborts": "keeps asyncio tasks, weakly, with the answer each is owed",
    "workers.channel": "reads and writes the owner's Unix socket (asyncio streams)",
}
# What counts as touching I/O or the event loop: importing one of these modules, calling
# a function or method named in IO_CALLS, or reading ``environ``.
IO_MODULES = frozenset({
    "aiohttp", "asyncio", "dns", "fcntl", "mmap", "multiprocessing", "select", "selectors",
    "signal", "socket", "ssl", "subprocess", "threading",
})  # fmt: skip
IO_CALLS = frozenset({
    "getaddrinfo", "getenv", "iterdir", "listdir", "open", "read_bytes", "read_text",
    "scandir", "stat", "write_bytes", "write_text",
})  # fmt: skip


# The folders (and the top-level modules, each a room of its own), bottom to top. Layers
# cut across folders; this order makes the folders honest too: a folder imports only
# from the ones before it, so reading the tree folder by folder never meets an import
# that runs back up. ``gateway`` is the package's face (its version).
FOLDERS: tuple[str, ...] = (
    "gateway", "errors", "logs", "routing", "config", "roles", "http", "adapters", "runs",
    "metrics", "fleet", "core", "api", "workers", "app", "supervisor", "cli", "__main__",
)  # fmt: skip


def folder_of(module: str) -> str:
    return module.split(".", 1)[0]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "gateway"


def layer_of(module: str) -> int | None:
    for index, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return index
    return None


def imports(path: Path, modules: Iterable[str]) -> set[str]:
    """The ``gateway`` modules ``path`` imports, relative to ``gateway`` ("" is the
    package itself), ``TYPE_CHECKING`` blocks included."""
    known = set(modules)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module != "gateway" and not node.module.startswith("gateway."):
                continue
            base = node.module.removeprefix("gateway").removeprefix(".") or "gateway"
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base != "gateway" else alias.name
                found.add(sub if sub in known else base)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("gateway."):
                    found.add(alias.name.removeprefix("gateway."))
    return found


def graph() -> dict[str, set[str]]:
    paths = sorted(ROOT.rglob("*.py"))
    modules = [module_name(p) for p in paths]
    return {module_name(p): imports(p, modules) - {module_name(p)} for p in paths}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(m for m in graph() if layer_of(m) is None)
    assert not unplaced, f"place these in tests/test_layers.py LAYERS: {unplaced}"


def test_no_import_goes_up_a_layer() -> None:
    upward = []
    for module, targets in graph().items():
        mine = layer_of(module)
        for target in sorted(targets):
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                upward.append(f"{module} (layer {mine}) imports {target} (layer {theirs})")
    assert not upward, upward


def test_folders_import_downward() -> None:
    """Folder to folder, imports follow ``FOLDERS``: a part sits in the folder of its
    band (``fleet/selection``, which reads the fleet's rotation, is not in ``routing/``,
    whose pure cores it uses), and a lower folder names what it needs of a higher one as
    a ``Protocol`` (``http/upstream.Addresses``, ``runs/placing.Members``)."""
    order = {name: rank for rank, name in enumerate(FOLDERS)}
    edges = graph()
    unplaced = sorted({folder_of(m) for m in edges} - set(order))
    assert not unplaced, f"place these folders in tests/test_layers.py FOLDERS: {unplaced}"
    upward = [
        f"{module} imports {target}"
        for module, targets in sorted(edges.items())
        for target in sorted(targets)
        if order[folder_of(target)] > order[folder_of(module)]
    ]
    assert not upward, upward


def test_no_import_cycle() -> None:
    assert cycles(graph()) == []


def touches_io(path: Path) -> set[str]:
    """What of IO_MODULES ``path`` imports, what of IO_CALLS it calls, and ``environ``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call):
            func = node.func
            found.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
        elif isinstance(node, ast.Attribute) and node.attr == "environ":
            found.add("environ")
    return found & (IO_MODULES | IO_CALLS | {"environ"})


def test_layer_0_touches_io_only_where_it_says() -> None:
    """Layer 0's label says pure but for LAYER_0_IO: a module that touches I/O or the event
    loop is listed there with what it touches, and a listed one still does."""
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    touching = {
        module: sorted(found)
        for module, path in sorted(paths.items())
        if layer_of(module) == 0 and (found := touches_io(path))
    }
    unlisted = {m: touching[m] for m in touching.keys() - LAYER_0_IO.keys()}
    assert not unlisted, f"layer 0 but not pure: list them in LAYER_0_IO: {unlisted}"
    stale = sorted(LAYER_0_IO.keys() - touching.keys())
    assert not stale, f"in LAYER_0_IO but touch no I/O (or left layer 0): {stale}"


def test_the_checks_would_catch_a_violation(tmp_path: Path) -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    sample = ROOT / "routing" / "ring.py"
    assert layer_of(module_name(sample)) == 0 and layer_of("core") == 2
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\nfrom gateway.core import Gateway\n"
        "import gateway.fleet.quorum\nfrom gateway import errors\n"
        "if TYPE_CHECKING:\n    from gateway.api.rollout import dispatch\n"
    )
    modules = ["core", "fleet.quorum", "errors", "api.rollout"]
    assert imports(probe, modules) == {"core", "fleet.quorum", "errors", "api.rollout"}
    io = tmp_path / "io.py"
    io.write_text("import os, dns.resolver\nfrom asyncio import sleep\nos.environ\nopen('x')\n"
                  "store.open = 1\nPath('y').read_text()\n")  # fmt: skip
    assert touches_io(io) == {"dns", "asyncio", "environ", "open", "read_text"}


if __name__ == "__main__":
    edges = graph()
    for index, (what, _) in enumerate(LAYERS):
        print(f"layer {index}: {what}")
        for module in sorted(m for m in edges if layer_of(m) == index):
            print(f"  {module:24} -> {', '.join(sorted(edges[module])) or '-'}")


def test_only_gateway_runs_asks_which_run_mode_it_is() -> None:
    """Single-run and multi-run differ in one place: ``gateway/runs/`` (``mode.py``, the
    run's scope in ``tenancy.py``). Elsewhere a test of the mode is a branch that the
    mode object should have taken."""
    asks = ("tenancy.multi", "run.prefix", "table.multi")
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in ROOT.rglob("*.py")
        if path.parent.name != "runs"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if any(a in line for a in asks)
    ]
    assert not found, found
