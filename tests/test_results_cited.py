"""The benchmark results the README and the docs cite exist, and nothing else is kept.

``bench/results/`` holds one current result per question, the one the docs cite; the
history stays in git. A figure from an older run is cited with its commit,
"`bench/results/ceiling.md` at `1a01d31`" (``git show 1a01d31:bench/results/ceiling.md``;
not checked here, since a clone may lack the history).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PREFIX = "bench/results/"
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "deploy").rglob("*.md")),
]
# A bare name counts as a result when it starts with what a bench script writes:
# `ceiling.md`, `overhead.lean.md`, `train-seed1.md`, `ceiling-round-robin/`.
STEMS = sorted({p.stem for p in (ROOT / "bench").glob("*.py")} | {"trl-side-by-side"})
BARE = re.compile(
    r"^(?:" + "|".join(map(re.escape, STEMS)) + r")(?:[.-][\w.{},*-]*)?"
    r"(?:\.(?:md|json|jsonl|png|svg|txt|\{[\w,]+\})|/)$"
)
CITE = re.compile(r"`(?P<tok>[^`\s]+)`(?:\s+at\s+`(?P<commit>[0-9a-f]{7,40})`)?")
PLAIN = re.compile(r"bench/results/[\w./{},*-]*")


def expand(path: str) -> list[str]:
    """`a.{json,md}` -> `a.json`, `a.md`; `a-{x,y}.{json,md}` -> four names."""
    m = re.search(r"\{([^}]*)\}", path)
    if not m:
        return [path]
    head, tail = path[: m.start()], path[m.end() :]
    return [q for alt in m.group(1).split(",") for q in expand(head + alt + tail)]


def cited_in(doc: Path) -> list[tuple[str, str, str | None]]:
    """(where, path relative to the repo, commit or None) for each result `doc` cites."""
    text = doc.read_text()
    out: list[tuple[str, str, str | None]] = []

    def where(m: re.Match[str]) -> str:
        return f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"

    for m in CITE.finditer(text):  # "at `<commit>`" may follow on the next line
        tok, commit = m.group("tok").rstrip(".,;:"), m.group("commit")
        if PREFIX in tok:
            path = tok[tok.index(PREFIX) :]
        elif "/" not in tok.rstrip("/") and BARE.match(tok):
            path = tok
        else:
            continue
        out += [(where(m), p, commit) for p in expand(path)]
    # a path outside backticks (a link, prose, a code block) counts too
    blanked = CITE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    for m in PLAIN.finditer(blanked):
        out += [(where(m), p, None) for p in expand(m.group(0).rstrip(".,;:"))]
    return out


def citations() -> list[tuple[str, str, str | None]]:
    return [c for doc in DOCS for c in cited_in(doc)]


def resolves(path: str) -> bool:
    if path.startswith(PREFIX):
        return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()
    # a bare name: a result anywhere in bench/results/ (or a doc of the same name)
    if path.endswith("/"):
        return any(p.is_dir() for p in RESULTS.rglob(path.rstrip("/")))
    return any(RESULTS.rglob(path)) or (ROOT / "docs" / path).exists()


def test_the_scan_finds_the_readme_citations() -> None:
    cited = {p for _, p, _ in citations()}
    assert "bench/results/routing.md" in cited
    assert "bench/results/soak.md" in cited


def test_every_cited_result_exists() -> None:
    missing = [f"{w}: {p}" for w, p, c in citations() if c is None and not resolves(p)]
    assert not missing, (
        "cited but not in bench/results/ (cite the current result, or the commit whose "
        "tree has it: `bench/results/X` at `<commit>`):\n" + "\n".join(missing)
    )


def test_every_kept_result_is_cited() -> None:
    """A file in bench/results/ is current only if the docs cite it, a sibling of the
    same name (`routing.md` for `routing.json`) or its folder (`bench/results/ceiling/`)."""
    cited: set[Path] = set()
    for _, path, commit in citations():
        if commit is not None:
            continue
        if not path.startswith(PREFIX):
            cited.update(RESULTS.rglob(path.rstrip("/")))
        elif "*" in path:
            cited.update(ROOT.glob(path))
        else:
            cited.add(ROOT / path)

    def name(p: Path) -> Path:
        return p.parent / p.name.rsplit(".", 1)[0]

    names = {name(p) for p in cited if p.is_file()}
    folders = {p for p in cited if p.is_dir() and p != RESULTS}  # "bench/results/" is no citation
    uncited = [
        str(p.relative_to(ROOT))
        for p in sorted(RESULTS.rglob("*"))
        if p.is_file() and name(p) not in names and not any(f in p.parents for f in folders)
    ]
    assert not uncited, "kept in bench/results/ but cited nowhere:\n" + "\n".join(uncited)
