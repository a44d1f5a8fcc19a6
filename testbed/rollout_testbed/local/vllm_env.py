"""Locate the separate vLLM venv (stdlib only; the gateway venv has no torch/vllm)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

VLLM_PYTHON_ENV = "ROLLOUT_TESTBED_VLLM_PYTHON"
INSTALL_COMMAND = "make vllm  (or: bash scripts/install-vllm.sh)"


class VllmNotInstalledError(RuntimeError):
    """vLLM cannot be imported with the chosen python."""


def package_root() -> Path:
    """The directory that holds the ``rollout_testbed`` package (``testbed/`` in a checkout):
    what a child python needs on PYTHONPATH to import it."""
    return Path(__file__).resolve().parents[2]


def checkout_root() -> Path | None:
    """The repository, when this runs from a checkout: it holds ``gateway``, ``trainer`` (the
    demo's driver) and ``.venv-vllm``. None for an installed ``rollout-testbed``."""
    root = package_root().parent
    return root if (root / "gateway").is_dir() and (root / "trainer").is_dir() else None


def default_vllm_python() -> Path:
    return (checkout_root() or Path.cwd()) / ".venv-vllm" / "bin" / "python"


def find_vllm_python(explicit: str | os.PathLike[str] | None) -> Path | None:
    """--vllm-python, else $ROLLOUT_TESTBED_VLLM_PYTHON, else <checkout>/.venv-vllm, else
    ./.venv-vllm."""
    if explicit:
        return Path(explicit)
    env = os.environ.get(VLLM_PYTHON_ENV)
    if env:
        return Path(env)
    for cand in (default_vllm_python(), Path.cwd() / ".venv-vllm" / "bin" / "python"):
        if cand.exists():
            return cand
    return None


def install_message(python: Path | None, detail: str = "") -> str:
    where = f"with {python}" if python else "(no vLLM venv found)"
    lines = [
        f"vLLM is not importable {where}.{(' ' + detail) if detail else ''}",
        f"Install it into a separate venv with: {INSTALL_COMMAND}",
        f"then pass --vllm-python .venv-vllm/bin/python or set {VLLM_PYTHON_ENV}.",
        "The gateway's own venv must not get vllm or torch.",
    ]
    return "\n".join(lines)


def check_vllm_python(explicit: str | os.PathLike[str] | None, timeout: float = 60.0) -> Path:
    """Return a python that can import vllm and peft, or raise VllmNotInstalledError."""
    python = find_vllm_python(explicit)
    if python is None or not python.exists():
        raise VllmNotInstalledError(install_message(python))
    probe = (
        "import importlib.util as u, sys; "
        "m = [n for n in ('vllm', 'torch', 'transformers', 'peft') if u.find_spec(n) is None]; "
        "print(','.join(m)); sys.exit(3 if m else 0)"
    )
    try:
        res = subprocess.run(
            [str(python), "-c", probe],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VllmNotInstalledError(install_message(python, f"({exc})")) from exc
    if res.returncode != 0:
        missing = res.stdout.strip() or res.stderr.strip()[-300:]
        raise VllmNotInstalledError(install_message(python, f"Missing: {missing}."))
    return python
