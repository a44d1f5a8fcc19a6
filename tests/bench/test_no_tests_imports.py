"""``bench/`` imports nothing from ``tests/``.

A benchmark is run from a checkout by a person or a ``make`` target, often with another
venv's python (the vLLM one); ``tests/`` is not a package it may rely on, and a rule that
both need (the TRL learning check) belongs in ``rollout_testbed``, where there is one copy.
Read with ``ast``, so a docstring that names ``tests/`` does not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def imports_of_tests(source: str) -> list[int]:
    """Line numbers of ``import tests...`` and ``from tests... import`` in ``source``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(n == "tests" or n.startswith("tests.") for n in names):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_check_sees_both_spellings_anywhere() -> None:
    src = "import os\ndef f():\n    from tests.trl.checks import X\nimport tests\n"
    assert imports_of_tests(src) == [3, 4]
    assert imports_of_tests('"""see tests/trl/checks.py"""\nimport testsuite\n') == []


def test_no_bench_file_imports_tests() -> None:
    found = [
        f"{p.relative_to(BENCH.parent)}:{n}"
        for p in sorted(BENCH.rglob("*.py"))
        for n in imports_of_tests(p.read_text())
    ]
    assert not found, (
        "bench/ imports tests/ (move what it needs to bench/lib or rollout_testbed):\n"
        + "\n".join(found)
    )
