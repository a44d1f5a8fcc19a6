"""``python -m bench.control_plane`` (``make bench-control-plane``): the control plane at
scale, simulated. Every (replica count, workers) configuration runs ``scenario.run`` on a
fresh fleet; the results are rewritten after each one, so a run cut short keeps what it
measured.

    .venv/bin/python -m bench.control_plane                      # 16, 64, 256 x workers 1, 4
    .venv/bin/python -m bench.control_plane --sizes 16 --workers 1 --no-write
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.control_plane import registry, report
from bench.control_plane.scenario import Config, run
from bench.lib.fronts import ROOT
from bench.lib.report import RESULTS, machine_info

STEM = "control_plane"


def _ints(spec: str) -> list[int]:
    return [int(x) for x in spec.split(",") if x.strip()]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.control_plane", description=__doc__)
    p.add_argument("--sizes", type=_ints, default=[16, 64, 256], help="replica counts")
    p.add_argument("--workers", type=_ints, default=[1, 4], help="gateway --workers values")
    p.add_argument(
        "--wall-size",
        type=int,
        default=1024,
        help="one more run, one process only, past the sizes asked for (0: none)",
    )
    p.add_argument("--hosts", type=int, default=4, help="sim host processes (a quarter each)")
    p.add_argument("--loads", type=int, default=24)
    p.add_argument("--pauses", type=int, default=5)
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--broadcast-timeout-s", type=float, default=30.0)
    p.add_argument(
        "--host-flag",
        action="append",
        default=[],
        help="extra fleet_host flag, e.g. --host-flag=--keep-alive-s=30",
    )
    p.add_argument(
        "--registry-sizes",
        type=_ints,
        default=[16, 64, 256, 512, 1024],
        help="replica counts for the pure registry measurement (no processes)",
    )
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--log-dir", type=Path, default=ROOT / ".run" / "control_plane")
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite the .md and .png from the existing .json (after findings.md "
        "changed), run nothing",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    data: dict[str, Any]
    args = parse(argv)
    if args.render_only:
        data = json.loads((args.out_dir / f"{STEM}.json").read_text())
        report.write(args.out_dir, STEM, data)
        return 0
    data = {
        "machine": machine_info(["uvicorn", "uvloop", "aiohttp"]),
        "command": "python -m bench.control_plane " + " ".join(sys.argv[1:]),
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "runs": [],
    }
    print(f"== the adapter registry alone, {args.registry_sizes} replicas", flush=True)
    data["registry"] = registry.table(args.registry_sizes)
    print("\n".join(registry.markdown(data["registry"])), flush=True)
    plan = [(n, w) for n in args.sizes for w in args.workers]
    if args.wall_size:
        plan.append((args.wall_size, 1))
    for n, workers in plan:
        cfg = Config(n=n, hosts=args.hosts, workers=workers, loads=args.loads,
                     pauses=args.pauses, idle_s=args.idle_s,
                     broadcast_timeout_s=args.broadcast_timeout_s,
                     host_flags=tuple(args.host_flag))  # fmt: skip
        print(f"== {n} replicas, --workers {workers}", flush=True)
        t0 = time.monotonic()
        res = run(cfg, args.log_dir / f"n{n}-w{workers}")
        res["wall_s"] = round(time.monotonic() - t0, 1)
        data["runs"].append(res)
        print(report.one_line(res), flush=True)
        for failed in (c for c in res["checks"] if not c["ok"]):
            print(f"   FAILED: {failed['check']}: {failed['detail']}", flush=True)
        data["finished_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        if not args.no_write:
            report.write(args.out_dir, STEM, data)
    if args.no_write:
        print(json.dumps([{k: v for k, v in r.items() if k != "series"} for r in data["runs"]],
                         indent=1))  # fmt: skip
    else:
        print(report.markdown(data))
    asked = [r for r in data["runs"] if r["config"]["n"] in args.sizes]
    return 0 if all(r["ok"] for r in asked) else 1


if __name__ == "__main__":
    raise SystemExit(main())
