"""How a benchmark states its result: facts about the machine and the tree, then the same
result as JSON (every raw figure), Markdown (the table the docs quote) and, where a
picture helps, a PNG, all under one stem in one folder (``bench/results/`` for the
committed result of each question)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.lib.fronts import ROOT

RESULTS = ROOT / "bench" / "results"


def git(*args: str) -> str:
    """``git ARGS`` in the repository, stripped ('' when git is missing or fails)."""
    try:
        out = subprocess.run(["git", *args], capture_output=True, cwd=ROOT, check=False)
    except OSError:
        return ""
    return out.stdout.decode().strip()


def loadavg() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def fmt_load(value: object) -> str:
    if not value:
        return "n/a"
    return "/".join(f"{v:.2f}" for v in value)  # type: ignore[attr-defined]


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_info(packages: Sequence[str] = (), **extra: object) -> dict[str, Any]:
    """The machine, the Python and the gateway tree a result was measured on."""
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "affinity_available": sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
        "loadavg_at_start": loadavg(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "git_head": git("rev-parse", "--short", "HEAD"),
        "gateway_tree_dirty": bool(git("status", "--porcelain", "--", "gateway")),
    }
    if packages:
        info["packages"] = {d: version(d) for d in packages}
    return {**info, **extra}


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only), or None if not installed."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no PNG", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write(
    out_dir: Path,
    stem: str,
    data: dict[str, Any],
    markdown: str,
    plot: Callable[[dict[str, Any], Path], object] | None = None,
) -> list[Path]:
    """``STEM.json``, ``STEM.md`` and (with ``plot``) ``STEM.png`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    paths[0].write_text(json.dumps(data, indent=1, default=str) + "\n")
    paths[1].write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    if plot is not None:
        png = out_dir / f"{stem}.png"
        if plot(data, png) is not False and png.exists():
            paths.append(png)
    return paths
