"""The words that describe the tree are held to it: each package's module list, and
``core.py``'s parts table.

The convention the package check parses: in a package's ``__init__`` docstring, every
module of that package (a ``*.py`` file but ``__init__``) and every subpackage is named
on a line of its own that starts, after any indentation, with ``* `` and the name in
double backticks, then says what it is for::

    * ``ledger``  one request's books, opened and closed in one place

No other line starts so, and no name has two. Every ``*.py`` path in double backticks
anywhere in the docstring exists, relative to the package (``server/uvicorn_private.py``)
or to the repository (``tests/test_parts.py``).

``gateway/core.py``'s parts table (the RST simple table in its docstring) names, in field
order, every field of the ``Gateway`` dataclass, and in its "module" column the module,
relative to ``gateway``, that defines the field's type: ``fleet.rotation`` is
``gateway/fleet/rotation.py``, where ``Rotation`` is defined. A row whose first column is
empty continues the row above.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from pathlib import Path

import pytest

import gateway
from gateway.core import Gateway

ROOT = Path(gateway.__file__).parent
REPO = ROOT.parent
BULLET = re.compile(r"^\s*\*\s+``(\w+)``")
PY_PATH = re.compile(r"``([\w./-]+\.py)``")
PACKAGES = sorted(p.parent for p in ROOT.rglob("__init__.py"))


def docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""


def listed(doc: str) -> list[str]:
    """The names the docstring's bullets give, in order."""
    return [m.group(1) for line in doc.splitlines() if (m := BULLET.match(line))]


def members(package: Path) -> set[str]:
    """The package's modules (``__init__`` aside) and subpackages, as the tree has them."""
    modules = {p.stem for p in package.glob("*.py")} - {"__init__"}
    return modules | {p.parent.name for p in package.glob("*/__init__.py")}


def table_rows(doc: str) -> list[tuple[str, str]]:
    """(first column, second column) of each row of the first RST simple table in
    ``doc``, backticks stripped; a row with an empty first column is a continuation."""
    lines = doc.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("=") and set(line) <= {"=", " "}]
    assert len(rules) >= 3, "no RST simple table (three rules of '=')"
    starts = [m.start() for m in re.finditer(r"=+", lines[rules[0]])]
    rows: list[tuple[str, str]] = []
    for line in lines[rules[1] + 1 : rules[2]]:
        first, second = line[: starts[1]].strip(), line[starts[1] : starts[2]].strip()
        if first:
            rows.append((first.strip("`"), second.strip("`")))
    return rows


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_package_docstring_lists_each_module_once(package: Path) -> None:
    names = listed(docstring(package / "__init__.py"))
    twice = sorted({n for n in names if names.count(n) > 1})
    missing = sorted(members(package) - set(names))
    stale = sorted(set(names) - members(package))
    assert not (twice or missing or stale), (
        f"named twice {twice}; not listed {missing}; listed, not in the tree {stale}"
    )


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_file_the_package_docstring_names_exists(package: Path) -> None:
    named = PY_PATH.findall(docstring(package / "__init__.py"))
    gone = [p for p in named if not (package / p).is_file() and not (REPO / p).is_file()]
    assert not gone, gone


def test_the_parts_table_is_the_gateway_fields_and_their_modules() -> None:
    rows = table_rows(docstring(ROOT / "core.py"))
    assert [part for part, _ in rows] == [f.name for f in dataclasses.fields(Gateway)]
    types = typing.get_type_hints(Gateway)
    absent = [m for _, m in rows if not ROOT.joinpath(*m.split(".")).with_suffix(".py").is_file()]
    assert not absent, f"no such module under gateway/: {absent}"
    elsewhere = {
        part: types[part].__module__ for part, module in rows
        if types[part].__module__ != f"gateway.{module}"
    }  # fmt: skip
    assert not elsewhere, f"the type of these parts is defined in another module: {elsewhere}"


def test_the_parsers_read_the_convention() -> None:
    doc = "Intro with ``x.py``.\n\n* ``alpha``  one\n  * ``beta``  two\n*``not``\n- ``nor``\n"
    assert listed(doc) == ["alpha", "beta"] and PY_PATH.findall(doc) == ["x.py"]
    rule = "=====  =======  ===="
    table = f"{rule}\npart   module   job\n{rule}\n``p``  ``m.n``  one\n{16 * ' '}two\n{rule}\n"
    assert table_rows(table) == [("p", "m.n")]
