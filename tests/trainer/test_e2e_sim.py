"""The driver end to end against 2 sim replicas behind the gateway (real sockets and
processes): plumbing, staleness accounting, no rollout lost to a sync, TRL's sequence."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from tests.trainer.helpers import (
    FAST,
    TRACE_SEQUENCE_S,
    expected_sync_sequence,
    read_jsonl,
    run_in_process,
    wire_calls,
)
from trainer.metrics import parse_prometheus
from trainer.stack import sim_gateway

pytestmark = pytest.mark.timeout(180)


def test_trace_pattern_matches_recorded_trl() -> None:
    """Sanity-check the expected-sequence helper against TRL's own recording (S=2)."""
    trace = Path(__file__).resolve().parents[1] / "data" / "trl-1.16-lora-sync-wire-trace.jsonl"
    calls = []
    for line in trace.read_text().splitlines():
        rec = json.loads(line)
        if rec["method"] == "POST" and rec["path"] != "/v1/completions":
            body = rec["body"] or {}
            calls.append((rec["path"], body.get("lora_name", rec["query"])))
    n = sum(1 for p, _ in calls if p == "/v1/load_lora_adapter")
    assert calls == expected_sync_sequence(range(1, n + 1), TRACE_SEQUENCE_S)


def test_driver_through_gateway_on_sims(tmp_path: Path) -> None:
    steps, S = 8, 1
    out = tmp_path / "run"
    with sim_gateway(2, S, tmp_path / "logs") as stack:
        rc = run_in_process(
            [*FAST, "--gateway", stack.url, "--output-dir", str(out), "--max-steps", str(steps),
             "--max-staleness", str(S), "--save-steps", "4"]
        )  # fmt: skip
        assert rc == 0
        with urllib.request.urlopen(stack.url + "/metrics", timeout=10) as r:
            gw = parse_prometheus(r.read().decode())
        with urllib.request.urlopen(stack.url + "/v1/models", timeout=10) as r:
            live = [m["id"] for m in json.loads(r.read())["data"][1:]]

    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # staleness: never above the bound in trained samples, and the pipeline did overlap
    assert max(r["sample/staleness_max"] for r in rows) <= S
    assert any(r["sample/staleness_max"] > 0 for r in rows)
    for key in ("reward", "reward_std", "ratio", "kl", "perf/rollout_wait_s",
                "perf/weight_sync_s", "sample/staleness_mean", "sample/dropped_stale_total",
                "clip_ratio/region_mean", "completions/mean_length"):  # fmt: skip
        assert key in rows[-1], key
    summary = json.loads((out / "summary.json").read_text())
    # zero rollouts failed or even retried, syncs included
    assert summary["failed_groups"] == 0 and summary["http_errors"] == {}
    assert not any(r.get("rollout/vllm_retry_total") for r in rows)
    assert summary["staleness_max"] <= S
    assert summary["dropped_stale_total"] == rows[-1]["sample/dropped_stale_cumulative"]
    # the control sequence is TRL's: v1 cold, then one sync per step
    assert wire_calls(out / "control-wire.jsonl") == expected_sync_sequence(range(1, steps + 2), S)
    # the gateway published every version everywhere, and keeps the newest S+1
    loads = {lab["outcome"]: v for lab, v in gw["gateway_adapter_loads_total"]}
    assert loads["ok"] == steps + 1 and not any(v for k, v in loads.items() if k != "ok")
    assert sorted(live) == [f"trl-policy-v{v}" for v in range(steps + 1 - S, steps + 2)]
    routed = sum(v for _, v in gw["gateway_routing_decisions_total"])
    assert routed >= steps * 8
    # adapter files: only the last few versions remain, no half-written .tmp
    names = sorted(p.name for p in (out / ".vllm_lora").iterdir())
    assert all(re.fullmatch(r"trl-policy-v\d+", n) for n in names), names
    assert set(live) <= set(names) and len(names) <= S + 2, (live, names)  # the live ones stay
    assert (out / "curves.png").stat().st_size > 1000
