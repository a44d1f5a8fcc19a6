"""User-space instructions the gateway executes per proxied request: a noise-free A/B.

Why: on this shared 2-core VM, CPU time per request swings by 10-20 % between runs of the
same code (paired rounds cancel only some of it: ``bench/cpu_per_request.py`` at
``d1567bc``, retired for this), and the VM exposes no hardware counters. Valgrind counts
every instruction the process retires (``cachegrind --cache-sim=no``): the same code on
the same input gives the same count to within ~0.01 % back to back on a quiet host, and
within ~1 % when the host is busy (the gateway's periodic timers run more often while
valgrind's wall time stretches: 391,251 to
395,060 per request for one tree, 2026-12-01). It sees user space only -- syscalls and
the kernel's TCP work are not counted -- and not cache misses; it measures how much work
the code asks for, which is what a change to the gateway's Python moves.

For each *variant* (a source tree holding a ``gateway`` package) the gateway runs under
valgrind twice in front of ``bench.lib.upstream``: once serving nothing but its
readiness probes, once serving ``--requests`` rollouts from ``bench.lib.load`` (64 in
flight, and again at 1 in flight); it is stopped with SIGTERM so valgrind prints its
total. Instructions per request = (total with requests - total without) / requests.

    .venv/bin/python bench/instructions.py --variant before=/tmp/base --variant after=.

Each run takes ~20-40 s (valgrind slows Python ~30x). Writes nothing unless ``--json`` /
``--md``. Only processes started here are stopped, by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from rollout_testbed.procs import Proc, free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: bench.lib

from bench.lib import load
from bench.lib.fronts import ROOT

PY = sys.executable
_TOTAL = re.compile(rb"I\s+refs:\s+([\d,]+)")


def count(tree: Path, upstream: str, requests: int, mode: str) -> int:
    """Instructions of one gateway life: start, ``requests`` rollouts (``mode``: 64 in
    flight, ``throughput``, or 1, ``latency``), SIGTERM."""
    concurrency = 1 if mode == "latency" else 64
    port = free_port()
    cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"]
    cmd += [PY, "-m", "gateway", "serve", "--replica", upstream, "--port", str(port)]
    cmd += ["--log-level", "warning"]
    # No bytecode written: a fresh tree would otherwise compile in its first (idle) life
    # only, and the compile cost would be subtracted from the loaded life's count.
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0",
           "PYTHONDONTWRITEBYTECODE": "1"}  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="instructions-") as tmp:
        # valgrind's summary and the gateway's output, both into the log file.
        proc = Proc("gateway", cmd, Path(tmp) / "gateway.log", env=env, cwd=tree, url=url,
                    new_session=False, append=False)  # fmt: skip
        with proc:
            proc.wait_http("/health", timeout=300, interval=0.5)
            if requests:
                result = load.run_client(
                    url, None, concurrency=concurrency, requests=requests, max_seconds=900
                )
                if result["errors"] or result["requests"] != requests:
                    raise RuntimeError(f"load failed: {result}")
            proc.stop(grace=120)
        err = proc.output().encode()
    found = _TOTAL.search(err)
    if not found:
        raise RuntimeError(f"no valgrind total: {err[-2000:].decode(errors='replace')}")
    return int(found.group(1).replace(b",", b""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=TREE")
    parser.add_argument("--requests", type=int, default=4000, help="per run at 64 in flight")
    parser.add_argument(
        "--lat-requests", type=int, default=2000, help="per run at 1 in flight (0: skip)"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--md", type=Path)
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    variants = {n: Path(t).resolve() for n, t in (v.split("=", 1) for v in args.variant)}
    up_port = free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    up = Proc("upstream", [PY, "-m", "bench.lib.upstream", "--port", str(up_port)], cwd=ROOT,
              url=upstream, new_session=False, inherit_output=True).start()  # fmt: skip
    rows: dict[str, dict[str, float]] = {}
    try:
        up.wait_http("/health", timeout=30, interval=0.5)
        for name, tree in variants.items():
            idle = count(tree, upstream, 0, "throughput")
            row: dict[str, float] = {"idle_instructions": idle}
            for mode, n in (("throughput", args.requests), ("latency", args.lat_requests)):
                if not n:
                    continue
                total = count(tree, upstream, n, mode)
                row[f"{mode}_instructions_per_request"] = round((total - idle) / n)
            rows[name] = row
            print(name, row, file=sys.stderr, flush=True)
    finally:
        up.stop(grace=10)

    base = next(iter(rows))
    lines = [
        f"| variant | instructions/req @64 | vs {base} | instructions/req @1 | vs {base} |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        cells = [f"| {name} "]
        for mode in ("throughput", "latency"):
            key = f"{mode}_instructions_per_request"
            if key in row:
                ratio = row[key] / rows[base][key]
                cells.append(f"| {row[key]:,.0f} | {ratio:.3f}x ")
            else:
                cells.append("| - | - ")
        lines.append("".join(cells) + "|")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.json:
        args.json.write_text(json.dumps({"variants": rows}, indent=1) + "\n")
    if args.md:
        args.md.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
