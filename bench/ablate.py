"""Copies of the gateway with one piece of its per-request work switched off, so that
``bench/instructions.py`` can say what each piece costs per rollout.

Why: CPU per request is flat over ~60 functions in profiles, so "what would the gateway
have to give up to be as cheap as X" is answered by switching whole features off and
counting instructions (valgrind: ~1 % run to run at worst, where CPU time moves 10-20 %).
Each ablation makes named functions return a stub at once; nothing else changes, and the
stubs are ones the request path survives (an admission that always admits, a router that
takes the first candidate). The trees are throwaway and never served to anyone.

    python bench/ablate.py OUT_DIR       # writes OUT_DIR/NAME/gateway, prints NAME=TREE

``make bench-instructions-ablations`` builds them in ``.run/ablations`` and measures them
against this tree (``bench/results/instructions.ablations.{json,md}``).
"""

from __future__ import annotations

import argparse
import ast
import shutil
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Stub:
    """``function`` in ``gateway/<module>`` returns ``returns`` before its first statement
    (``nth``: which definition of that name, in source order, nested ones included)."""

    module: str
    function: str
    returns: str
    nth: int = 0


ABLATIONS: dict[str, tuple[Stub, ...]] = {
    # the routing decision: loads, prompt key, prefix index, ring, decision metric
    "first-candidate": (Stub("fleet/selection.py", "_choose", "remaining[0]"),),
    "no-metrics": tuple(
        Stub("metrics.py", name, "None")
        for name in ("record_decision", "record_request", "record_routed")
    ),
    # the JSON depth bound, generation parameter checks, header count and size limits
    "no-validation": (
        Stub("api/requests.py", "check_generation", "None"),
        Stub("api/requests.py", "_openers_exceed", "False"),
        Stub("api/requests.py", "check_headers", "None"),
    ),
    # breakers, the retry budget, the abort registry, outcome bookkeeping
    "no-failover-books": (
        Stub("fleet/outliers.py", "dispatched", "True"),
        Stub("fleet/retry_budget.py", "record_request", "None"),
        Stub("fleet/aborts.py", "enter", "None"),
        Stub("fleet/aborts.py", "leave", "None"),
        Stub("fleet/rotation.py", "record_status", "None"),
    ),
    # per-client and gateway-wide in-flight limits
    "no-limits": (
        Stub("fleet/admission.py", "enter", "None"),
        Stub("fleet/admission.py", "leave", "None"),
    ),
}
ALL_OFF = "all-off"
ABLATIONS[ALL_OFF] = tuple(s for stubs in list(ABLATIONS.values()) for s in stubs)


def stub_source(source: str, stub: Stub) -> str:
    """``source`` with ``return <stub.returns>`` as the first statement of the function."""
    defs = sorted(
        (
            node
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.name == stub.function
        ),
        key=lambda node: node.lineno,
    )
    if len(defs) <= stub.nth:
        raise LookupError(f"{stub.module}: no definition #{stub.nth} of {stub.function}()")
    first = defs[stub.nth].body[0]
    lines = source.splitlines(keepends=True)
    indent = " " * first.col_offset
    lines.insert(first.lineno - 1, f"{indent}return {stub.returns}  # ablation\n")
    return "".join(lines)


def build(name: str, out: Path, src: Path = ROOT / "gateway") -> Path:
    """``out/name``: a copy of ``src`` (a ``gateway`` package) with ``name``'s stubs."""
    tree = out / name
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(src, tree / "gateway", ignore=shutil.ignore_patterns("__pycache__"))
    for stub in ABLATIONS[name]:
        path = tree / "gateway" / stub.module
        path.write_text(stub_source(path.read_text(), stub))
    return tree


def legend() -> str:
    """One Markdown line per ablation: what it switches off."""
    lines = [
        f"- `{name}`: "
        + ", ".join(f"`{s.module}:{s.function}` returns `{s.returns}`" for s in stubs)
        for name, stubs in ABLATIONS.items()
        if name != ALL_OFF
    ]
    return "\n".join([*lines, f"- `{ALL_OFF}`: all of the above at once"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?", help="directory for the trees")
    parser.add_argument("--only", nargs="+", choices=sorted(ABLATIONS), help="default: all")
    parser.add_argument("--legend", action="store_true", help="print the Markdown legend")
    args = parser.parse_args(argv)
    if args.legend:
        print(legend())
        return 0
    if args.out is None:
        parser.error("OUT_DIR is required")
    for name in args.only or ABLATIONS:
        print(f"{name}={build(name, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
