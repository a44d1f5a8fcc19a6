"""The sidecar image: size, what its layers hold, start-up and SIGTERM-drain times.

Builds (or reuses) ``localhost/rollout-gateway:dev`` with scripts/build-image.sh, then, on
podman with ``--network=host --read-only`` against 2 simulated replicas on the host:

* size: the image, its base, and each layer the Dockerfile adds (``podman history``),
  with the largest directories of the gateway's virtualenv;
* start-up: from ``podman run -d`` to ``/metrics`` 200 (the process serves) and to
  ``/health`` 200 (every replica adopted), ``--runs`` times;
* drain: ``podman stop`` with a stream in flight (~2 s of tokens left): until the
  container has exited, whether the stream ended with ``[DONE]``, and the exit code.

    .venv/bin/python bench/image.py [--runs 5] [--out-dir bench/results]

Writes ``image.json`` and ``image.md``. Containers and replicas started here are removed
or stopped by name/PID at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from rollout_testbed.procs import LOCAL, Proc, free_port, free_ports, sim_argv

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run by path: bench.lib

from bench.lib.podman import (  # noqa: E402
    build_image,
    container,
    gateway_flags,
    inspect,
    podman,
    run_python,
    secret_file,
)
from bench.lib.report import git  # noqa: E402

REPLICA_LATENCY = "prefill=0,decode=0.02,concurrency=0"


def _mb(n: float) -> float:
    return round(n / 1e6, 1)


def sizes(image: str) -> dict[str, Any]:
    """Image, base and added layers (bytes -> MB); the venv's largest directories."""
    meta = inspect(image)
    rows = json.loads(podman("history", "--format", "json", image).stdout)
    layers: list[dict[str, Any]] = [
        {
            "mb": _mb(r["size"]),
            "created_by": " ".join(r.get("CreatedBy", r.get("createdBy", "")).split())[:160],
        }
        for r in rows
        if r["size"] > 0
    ]
    base = layers[-1]  # the oldest layer with content is the base's rootfs
    script = (
        "import os, sys\n"
        "site = [p for p in sys.path if p.endswith('site-packages')][0]\n"
        "def du(p):\n"
        "    walk = os.walk(p)\n"
        "    return sum(os.lstat(os.path.join(r, f)).st_size for r, _, fs in walk for f in fs)\n"
        "rows = sorted(((du(os.path.join(site, d)), d) for d in os.listdir(site)), reverse=True)\n"
        "print(du('/opt/gateway'))\n"
        "for size, name in rows[:10]:\n"
        "    print(size, name)\n"
    )
    out = run_python(image, script).split("\n")
    venv_total = int(out[0])
    largest = [{"mb": _mb(int(s)), "dir": d} for s, d in (ln.split() for ln in out[1:] if ln)]
    return {
        "image_mb": _mb(meta["Size"]),
        "base_mb": base["mb"],
        "added_mb": round(sum(layer["mb"] for layer in layers[:-1]), 1),
        "layers": layers,
        "venv_mb": _mb(venv_total),
        "venv_largest": largest,
    }


def _until(url: str, timeout: float = 60) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(0.01)
    raise TimeoutError(url)


def startup_and_drain(image: str, runs: int, tmp: Path) -> dict[str, Any]:
    token = "hf_bench_" + str(time.time_ns())
    secret_dir = secret_file(tmp / "hf", token)
    starts: list[dict[str, float]] = []
    drains: list[dict[str, Any]] = []
    sims = [Proc(f"sim-{i}", sim_argv(port, latency=REPLICA_LATENCY), tmp / f"sim-{i}.log",
                 cwd=REPO, url=f"http://{LOCAL}:{port}", new_session=False)
            for i, port in enumerate(free_ports(2))]  # fmt: skip
    with sims[0], sims[1]:
        for sim in sims:
            sim.wait_http("/health", timeout=60)
        replicas = [sim.url for sim in sims]
        for _ in range(runs):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            t0 = time.monotonic()
            with container(image, run_flags=gateway_flags(port, replicas, secret_dir)) as name:
                t_live = _until(url + "/metrics")
                t_ready = _until(url + "/health")
                starts.append(
                    {"metrics_s": round(t_live - t0, 3), "health_s": round(t_ready - t0, 3)}
                )
                drains.append(_drain(name, url))
    return {"startup": starts, "drain": drains}


def _drain(name: str, url: str) -> dict[str, Any]:
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    first = threading.Event()
    events: list[str] = []

    def stream() -> None:
        body = {"model": model, "prompt": "drain", "max_tokens": 100, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    first.wait(30)
    start = time.monotonic()
    podman("stop", "--time", "30", name, timeout=60)
    stop_s = time.monotonic() - start
    thread.join(30)
    return {
        "stop_s": round(stop_s, 3),
        "stream_done": bool(events) and events[-1] == "[DONE]",
        "events": len(events),
        "exit_code": inspect(name)["State"]["ExitCode"],
    }


def _p50(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def markdown(r: dict[str, Any]) -> str:
    s = r["size"]
    lines = [
        "# Sidecar image: size, start-up, drain",
        "",
        f"`bench/image.py` at {r['commit']} on {r['machine']} ({r['date']}), podman {r['podman']}, "
        f"base `{r['base']}` (a local Debian bookworm stand-in for python:3.11-slim-bookworm).",
        "",
        "| what | value |",
        "|---|---|",
        f"| image | {s['image_mb']} MB |",
        f"| base layer | {s['base_mb']} MB |",
        f"| layers the Dockerfile adds | {s['added_mb']} MB (was 83 MB) |",
        f"| `podman run` to `/metrics` 200, p50 of {len(r['startup'])} | "
        f"{_p50([x['metrics_s'] for x in r['startup']])} s |",
        f"| `podman run` to `/health` 200, p50 of {len(r['startup'])} | "
        f"{_p50([x['health_s'] for x in r['startup']])} s "
        f"(max {max(x['health_s'] for x in r['startup'])} s) |",
        f"| `podman stop` with a stream in flight, p50 of {len(r['drain'])} | "
        f"{_p50([x['stop_s'] for x in r['drain']])} s; streams ended with [DONE]: "
        f"{sum(x['stream_done'] for x in r['drain'])}/{len(r['drain'])}; exit codes "
        f"{sorted({x['exit_code'] for x in r['drain']})} |",
        "",
        "Layers with content (newest first):",
        "",
        "| MB | created by |",
        "|---|---|",
        *[f"| {x['mb']} | `{x['created_by'][:110]}` |" for x in s["layers"]],
        "",
        f"The gateway's virtualenv ({s['venv_mb']} MB), largest directories:",
        "",
        "| MB | site-packages/ |",
        "|---|---|",
        *[f"| {x['mb']} | {x['dir']} |" for x in s["venv_largest"]],
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    t0 = time.monotonic()
    image = build_image()
    build_s = time.monotonic() - t0
    with tempfile.TemporaryDirectory() as tmp:
        timings = startup_and_drain(image, args.runs, Path(tmp))
    config = inspect(image)["Config"]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "podman": podman("--version").stdout.split()[-1],
        "image": image,
        "commit": git("rev-parse", "--short", "HEAD"),
        "base": _base(),
        "build_or_reuse_s": round(build_s, 1),
        "user": config["User"],
        "size": sizes(image),
        **timings,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "image.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / "image.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def _base() -> str:
    """The local base image scripts/build-image.sh made (the newest, if several)."""
    fmt = "{{.Repository}}:{{.Tag}}"
    rows = podman("images", "--sort", "created", "--format", fmt, "localhost/rollout-gateway-base")
    names = rows.stdout.split()
    return names[0] if names else "?"


if __name__ == "__main__":
    sys.exit(main())
