"""``bench/ablate.py``: every stub still names a function of the gateway (a rename fails
here, not as a silently unablated tree in a benchmark), and a stubbed tree still imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.bench import load_bench


@pytest.fixture(scope="module")
def ablate() -> ModuleType:
    return load_bench("ablate")


SAMPLE = '''
def f(x):
    """Doc."""
    return x


class C:
    async def f(self):
        await something()
        return 2
'''


def _first_statements(source: str, name: str) -> list[str]:
    defs = [
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
    ]
    return [ast.unparse(n.body[0]) for n in sorted(defs, key=lambda n: n.lineno)]


def test_stub_goes_first_in_the_chosen_definition(ablate: ModuleType) -> None:
    first = ablate.stub_source(SAMPLE, ablate.Stub("m.py", "f", "0"))
    assert _first_statements(first, "f") == ["return 0", "await something()"]
    second = ablate.stub_source(SAMPLE, ablate.Stub("m.py", "f", "None", nth=1))
    assert _first_statements(second, "f") == ["'Doc.'", "return None"]


def test_a_missing_function_is_an_error_not_a_silent_copy(ablate: ModuleType) -> None:
    with pytest.raises(LookupError, match="g"):
        ablate.stub_source(SAMPLE, ablate.Stub("m.py", "g", "None"))
    with pytest.raises(LookupError, match="#2"):
        ablate.stub_source(SAMPLE, ablate.Stub("m.py", "f", "None", nth=2))


def test_every_tree_is_stubbed_where_it_says_and_imports(
    ablate: ModuleType, tmp_path: Path
) -> None:
    for name, stubs in ablate.ABLATIONS.items():
        tree = ablate.build(name, tmp_path)
        for stub in stubs:
            source = (tree / "gateway" / stub.module).read_text()
            stated = _first_statements(source, stub.function)[stub.nth]
            assert stated == f"return {stub.returns}", (name, stub)
    modules = sorted({s.module for stubs in ablate.ABLATIONS.values() for s in stubs})
    imports = "; ".join(
        f"import gateway.{m.removesuffix('.py').replace('/', '.')}" for m in modules
    )
    tree = tmp_path / ablate.ALL_OFF
    check = f"{imports}; import gateway; print(gateway.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", check],
        env={"PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"},
        cwd=tree,  # as bench/instructions.py runs it: `-c` puts the cwd first on sys.path
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == str(tree / "gateway" / "__init__.py")


def test_legend_names_every_ablation(ablate: ModuleType) -> None:
    legend = ablate.legend()
    assert all(f"`{name}`" in legend for name in ablate.ABLATIONS)
