"""Parts are passed in, never patched in (``shared/STYLE.md``, "Parts and modes"): no
module of ``gateway`` sets a collaborator on an object it did not build itself.

Two rules, read off the syntax tree of every module:

* no ``x.hook = ...`` for the names that were hooks (``HOOKS``) on any ``x`` but ``self``
  or ``cls``: a worker and an owner differ by what their gateway was given
  (``gateway.roles``), not by what another module assigned afterwards;
* no ``x.attr = <function>`` at all (a lambda, or a method of ``self``) on anything but
  ``self`` or ``cls``, whatever the name: that is a hook by its shape.

Records a module owns and mutates (``rec.state`` in ``adapters/state.py``, a replica's
counts in ``fleet/replicas.py``) are plain data, not collaborators: neither rule sees them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gateway

ROOT = Path(gateway.__file__).parent

HOOKS = frozenset(
    {"report", "before_route", "peers", "on_lost", "quorum", "routes", "before_unload",
     "elsewhere", "homes", "unplaced"}
)  # fmt: skip
ALLOWED = frozenset({"http/h1server.py: Bound.handler"})
"""A protocol *class* made per server with its handler (uvicorn builds the instances)."""


def _stores(tree: ast.AST) -> list[tuple[ast.Attribute, ast.expr | None]]:
    """Every ``x.attr`` assigned to, with the value (None: augmented or unpacked)."""
    found: list[tuple[ast.Attribute, ast.expr | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            pairs = [(t, node.value) for t in node.targets]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            pairs = [(node.target, node.value)]
        else:
            continue
        for target, value in pairs:
            if isinstance(target, ast.Attribute):
                found.append((target, value))
            else:
                found += [(e, None) for e in ast.walk(target) if isinstance(e, ast.Attribute)
                          and isinstance(e.ctx, ast.Store)]  # fmt: skip
    return found


def _is_function(value: ast.expr | None) -> bool:
    if isinstance(value, ast.Lambda):
        return True
    return (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name)
            and value.value.id == "self")  # fmt: skip


def violations(source: str, where: str) -> list[str]:
    found = []
    for target, value in _stores(ast.parse(source)):
        owner = target.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        text = f"{where}: {ast.unparse(target)}"
        if text in ALLOWED:
            continue
        if target.attr in HOOKS or _is_function(value):
            found.append(f"{text} (line {target.lineno})")
    return found


def test_no_module_sets_a_collaborator_on_an_object_it_did_not_build() -> None:
    found = [
        v
        for path in sorted(ROOT.rglob("*.py"))
        for v in violations(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not found, f"pass these in when the object is built: {found}"


def test_the_check_would_catch_a_hook() -> None:
    caught = violations(
        # Written without spaces, so that a grep of the tree for the old hooks finds none.
        "gw.report=link.report\n"
        "manager.on_lost,manager.quorum=lose,q\n"
        "tenant.routes=SnapshotRoutes(view)\n"
        "pool.on_change = lambda: None\n"
        "other.callback = self.handle\n",
        "probe.py",
    )
    assert [c.split(": ")[1].split(" ")[0] for c in caught] == [
        "gw.report", "manager.on_lost", "manager.quorum", "tenant.routes", "pool.on_change",
        "other.callback",
    ]  # fmt: skip
    fine = "self.report = r\nrec.state = s\nreplica.in_flight += 1\ncls.x = lambda: 1\n"
    assert violations(fine, "ok.py") == []
