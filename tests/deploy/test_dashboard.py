"""deploy/grafana/dashboard.json: valid JSON with the structure Grafana's dashboard schema
(schemaVersion 39) requires, the panels issue 7 asks for, and only metric names that
exist: the gateway's from its /metrics, ``vllm:*`` from the sim replica's /metrics (or, for
the two histograms the sim does not model, from the installed vLLM's own definitions); the
"Runs" row (issue 18) from a multi-run gateway's /metrics; the "Control plane" row
(issue 26) with the failed control calls as docs/alerts.md defines them."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.deploy._proc import REPO
from tests.deploy.metrics_sample import metrics_sample

DASHBOARD = REPO / "deploy" / "grafana" / "dashboard.json"
PANEL_TYPES = {
    "row", "timeseries", "stat", "gauge", "bargauge", "table", "state-timeline",
    "status-history", "heatmap", "histogram", "text", "piechart",
}  # fmt: skip
BUILTIN_VARS = {"__rate_interval", "__interval", "__range", "__interval_ms", "__range_s"}
# Real-vLLM histograms the sim does not export (checked against vLLM's source if installed).
REAL_VLLM_ONLY = {"vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"}
METRIC = re.compile(r"\b(gateway_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


def load() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def flat_panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for p in panels:
        out.append(p)
        out.extend(flat_panels(p.get("panels", [])))
    return out


def expressions(dash: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in flat_panels(dash["panels"]) for t in p.get("targets", [])]


def substitute(expr: str) -> str:
    """Grafana's variable interpolation, for running the queries against Prometheus."""
    return (
        expr.replace("$__rate_interval", "10s")
        .replace("$instance", ".*")
        .replace("$vllm_job", "vllm")
    )


def _strip(name: str) -> str:
    return re.sub(r"_(bucket|sum|count|total)$", "", name)


def test_top_level_schema() -> None:
    dash = load()
    assert isinstance(dash["uid"], str) and 0 < len(dash["uid"]) <= 40
    assert isinstance(dash["title"], str) and dash["title"]
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    assert isinstance(dash["panels"], list) and dash["panels"]
    assert isinstance(dash["templating"]["list"], list)
    assert {"from", "to"} <= set(dash["time"])
    assert all(isinstance(t, str) for t in dash["tags"])
    assert "id" not in dash or dash["id"] is None, "exported dashboards carry no numeric id"


def test_panels_schema_and_layout() -> None:
    dash = load()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    panels = flat_panels(dash["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    boxes = []
    for p in panels:
        assert p["type"] in PANEL_TYPES, p["type"]
        assert p["title"]
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "xywh")
        assert g["x"] >= 0 and g["y"] >= 0 and g["w"] >= 1 and g["h"] >= 1
        assert g["x"] + g["w"] <= 24, p["title"]
        boxes.append((p["title"], g))
        if p["type"] == "row":
            assert isinstance(p["panels"], list)
            continue
        assert p["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip()
            for var in re.findall(r"\$(\w+)", t["expr"]):
                assert var in variables or var in BUILTIN_VARS, (p["title"], var)
    for (ta, a), (tb, b) in itertools.combinations(boxes, 2):
        overlap = (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
                   and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])  # fmt: skip
        assert not overlap, (ta, tb)


@pytest.mark.parametrize(
    "needle",
    [
        "gateway_requests_total",  # request rate
        "gateway_request_duration_seconds_bucket",  # latency
        "vllm:time_to_first_token_seconds_bucket",  # TTFT per replica
        "gateway_replica_routed_requests_total",  # per replica
        "gateway_replica_in_flight_requests",  # in-flight and imbalance
        "gateway_routing_decisions_total",  # routing reasons and affinity
        "gateway_adapter_live_versions",  # adapter versions live
        "gateway_adapter_load_seconds_bucket",  # sync latency
        "gateway_adapter_evictions_total",  # evictions
        "gateway_replica_healthy",  # replica health
        "vllm:prefix_cache_hits_total",  # prefix-cache hit rate
        "vllm:kv_cache_usage_perc",  # KV usage
        "gateway_run_requests_total",  # rollouts/s per run (multi-run mode)
        "gateway_run_in_flight",  # in flight per run
        "gateway_run_paused",  # paused per run
        "gateway_run_home_replicas",  # home replicas per run
        "gateway_run_live_adapters",  # live adapters per run
        "gateway_fleet_paused",  # fleet paused (issue 26)
        "gateway_fleet_paused_since_seconds",  # how long the pause has been held
        "gateway_broadcasts_total",  # failed control calls
        "gateway_replica_info",  # replica index -> address
        "process_cpu_seconds_total",  # the gateway's own CPU
    ],
)
def test_required_panels_present(needle: str) -> None:
    assert any(needle in e for e in expressions(load())), needle


def test_runs_row_groups_by_run() -> None:
    """Every panel of the "Runs" row draws one series per run, of the per-run families
    (the fair share's too), but the reloads of the run set, by outcome."""
    panels = load()["panels"]
    start = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == "Runs")
    row = list(itertools.takewhile(lambda p: p["type"] != "row", panels[start + 1 :]))
    assert len(row) == 8, [p["title"] for p in row]
    (reloads,) = [p for p in row if p["title"] == "Run set reloads"]
    assert reloads["targets"][0]["expr"].startswith("sum by (outcome) (increase(gateway_run_")
    exprs = " ".join(t["expr"] for p in row for t in p["targets"])
    for family in ("gateway_run_fair_slots", "gateway_run_fair_waiting",
                   "gateway_run_fair_overflows_total"):  # fmt: skip
        assert family in exprs, family
    for p in row:
        if p is reloads:
            continue
        for t in p["targets"]:
            assert "by (run)" in t["expr"] and "gateway_run_" in t["expr"], p["title"]
            assert "{{run}}" in t["legendFormat"], p["title"]


def real_vllm_names() -> set[str] | None:
    """Metric names vLLM itself defines, if the vLLM venv (make vllm) is installed."""
    for loggers in sorted(
        REPO.glob(".venv-vllm/lib/python3*/site-packages/vllm/v1/metrics/loggers.py")
    ):
        return set(re.findall(r'"(vllm:[a-z0-9_]+)"', loggers.read_text()))
    return None


def test_every_metric_exists() -> None:
    sample = metrics_sample()
    gateway = sample.gateway_names  # single-run and multi-run mode
    sim = sample.names(sample.replica)
    used = {m for e in expressions(load()) for m in METRIC.findall(e)}
    assert used
    missing_gw = {m for m in used if m.startswith("gateway_") and m not in gateway}
    assert not missing_gw, f"not in the gateway's /metrics: {sorted(missing_gw)}"
    vllm = {m for m in used if m.startswith("vllm:")}
    not_in_sim = {m for m in vllm if m not in sim}
    assert {_strip(m) for m in not_in_sim} <= REAL_VLLM_ONLY, sorted(not_in_sim)
    real = real_vllm_names()
    if real is not None:
        assert {_strip(m) for m in vllm} <= real, sorted({_strip(m) for m in vllm} - real)


def test_file_is_canonical_json(tmp_path: Path) -> None:
    text = DASHBOARD.read_text()
    assert text == json.dumps(json.loads(text), indent=2) + "\n"


def _panel(title: str) -> dict[str, Any]:
    return next(p for p in flat_panels(load()["panels"]) if p["title"] == title)


def test_failed_control_calls_panel_counts_every_kind_of_failed_call() -> None:
    """Broadcasts that failed, loads that did not go live, unloads a replica did not do
    (404 "already gone" is not a failure): the union docs/alerts.md calls failed control
    calls, each kind in its own series."""
    exprs = [t["expr"] for t in _panel("Failed control calls")["targets"]]
    assert any("gateway_broadcasts_total{" in e and 'outcome="failed"' in e for e in exprs)
    assert any("gateway_adapter_loads_total{" in e and 'outcome!="ok"' in e for e in exprs)
    assert any(
        "gateway_adapter_unloads_total{" in e and 'outcome!~"ok|not_found"' in e for e in exprs
    )


def test_replica_addresses_join_health_on_the_replica_index() -> None:
    (target,) = _panel("Replica addresses")["targets"]
    assert "gateway_replica_info" in target["expr"] and "group_left (url)" in target["expr"]
    assert target["format"] == "table" and target["instant"] is True


def test_gateway_process_panel_leaves_the_replicas_out() -> None:
    """vLLM exports process_* too: the panel keeps the targets that are gateways."""
    for t in _panel("Gateway CPU and memory")["targets"]:
        assert "process_" in t["expr"] and "and on (instance, job) gateway_build_info" in t["expr"]
