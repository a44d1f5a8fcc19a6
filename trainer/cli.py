"""``python -m trainer`` / ``python -m trainer``: parse flags, run, print the summary.

Standard library only at import time. Run from an interpreter without torch (the
gateway's own venv), it re-runs itself with the vLLM venv's python (``$ROLLOUT_TESTBED_VLLM_PYTHON``
or ``<repo>/.venv-vllm/bin/python``) with the repository on ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

HEAVY = ("torch", "transformers", "peft", "aiohttp")
NO_DELEGATE_ENV = "ROLLOUT_GATEWAY_TRAIN_NO_DELEGATE"
REPO = Path(__file__).resolve().parents[1]


def _find_python() -> Path | None:
    env = os.environ.get("ROLLOUT_TESTBED_VLLM_PYTHON")
    for cand in (Path(env) if env else None, REPO / ".venv-vllm" / "bin" / "python"):
        if cand is not None and cand.exists():
            return cand
    return None


def _delegate(argv: Sequence[str]) -> int | None:
    if os.environ.get(NO_DELEGATE_ENV):
        return None
    python = _find_python()
    # Compare environments, not interpreters: two venvs usually share one base binary.
    if python is None or python.absolute().parent.parent.resolve() == Path(sys.prefix).resolve():
        return None
    env = dict(os.environ, **{NO_DELEGATE_ENV: "1"})
    env.pop("VIRTUAL_ENV", None)
    extra = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + extra if extra else "")
    print(f"train: using {python} (torch lives in the vLLM venv)", file=sys.stderr)
    return subprocess.call([str(python), "-m", "trainer", *argv], env=env)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    missing = [m for m in HEAVY if importlib.util.find_spec(m) is None]
    if missing and "-h" not in args and "--help" not in args:
        rc = _delegate(args)
        if rc is not None:
            return rc
        print(f"train: {', '.join(missing)} not importable with {sys.executable}; install the "
              "[train] extra or `make vllm`", file=sys.stderr)  # fmt: skip
        return 2
    from trainer.config import build_parser, parse_config

    if missing:  # --help only
        build_parser().print_help()
        return 0
    try:
        cfg = parse_config(args)
    except (ValueError, OSError) as exc:
        print(f"train: invalid configuration: {exc}", file=sys.stderr)
        return 2
    return run(cfg)


def run(cfg: Any) -> int:
    """Train, print the summary table, write ``<output_dir>/summary.json``; exit status."""
    from trainer.loop import render_summary, train

    result = train(cfg)
    print(render_summary(result), flush=True)
    summary_path = Path(cfg.output_dir) / "summary.json"
    summary_path.write_text(json.dumps(result.as_dict(), indent=2, default=str) + "\n")
    bad = result.failed_groups > 0 or result.staleness_max > cfg.max_staleness
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
