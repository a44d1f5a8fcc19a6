"""Prometheus: promtool on the gateway's /metrics and on the recommended alerts, then a
real Prometheus server (Debian package) on 127.0.0.1 scraping a gateway and its sim
replicas during a short load, queried over its HTTP API."""

from __future__ import annotations

import asyncio
import math
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from rollout_testbed.procs import free_port, sim_fleet

from tests.cluster import cluster
from tests.deploy._proc import REPO, process
from tests.deploy.alert_series import (
    MULTI_RUN_ONLY,
    Scrape,
    Started,
    alerts,
    counts_any_increase,
    expand,
    expected,
    parse_series,
    selectors,
    start_scrapes,
)
from tests.deploy.metrics_sample import RUNS, drive_load, metrics_sample
from tests.deploy.test_dashboard import expressions as dashboard_expressions
from tests.deploy.test_dashboard import load as load_dashboard
from tests.deploy.test_dashboard import substitute
from tests.deploy.tools import tool
from tests.eventually import eventually

# The first test to need promtool/hadolint/... may install them (ensure_tools.sh).
pytestmark = pytest.mark.timeout(600)

PROM_DIR = REPO / "deploy" / "prometheus"


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(tool("promtool")), *args],
        input=stdin, capture_output=True, text=True, timeout=60, check=False, cwd=PROM_DIR,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["gateway", "gateway_paused", "multi_run", "multi_run_paused"])
def test_promtool_check_metrics_on_gateway_output(mode: str) -> None:
    res = promtool("check", "metrics", stdin=getattr(metrics_sample(), mode))
    assert res.returncode == 0, res.stdout + res.stderr


def _samples(text: str, family: str) -> dict[str, float]:
    """``{run: value}`` of one per-run family in a /metrics text."""
    found = re.findall(rf'^{family}{{run="([a-z0-9-]+)"}} (\S+)$', text, re.MULTILINE)
    return {run: float(value) for run, value in found}


def test_multi_run_sample_shows_what_the_run_alerts_match() -> None:
    """The multi-run sample has one series per configured run in each per-run family, and
    the states RolloutGatewayRunUnplaced and RolloutGatewayRunPausedTooLong match (home
    replicas 0, paused 1) appear in the gateway's real output."""
    sample = metrics_sample()
    runs = set(RUNS)
    for family in ("gateway_run_requests_total", "gateway_run_in_flight", "gateway_run_paused",
                   "gateway_run_home_replicas", "gateway_run_live_adapters"):  # fmt: skip
        assert set(_samples(sample.multi_run, family)) == runs, family
        assert family not in sample.gateway, family  # single-run mode: no per-run families
    homes = _samples(sample.multi_run, "gateway_run_home_replicas")
    assert sorted(homes.values()) == [0, 1, 1], homes
    requests = _samples(sample.multi_run, "gateway_run_requests_total")
    (driven,) = (run for run, n in requests.items() if n > 0)
    assert _samples(sample.multi_run, "gateway_run_live_adapters")[driven] == 1
    assert _samples(sample.multi_run, "gateway_run_paused") == dict.fromkeys(runs, 0.0)
    paused = _samples(sample.multi_run_paused, "gateway_run_paused")
    assert paused == {run: float(run == driven) for run in runs}, paused


def _value(text: str, name: str) -> float:
    (value,) = re.findall(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(value)


def test_samples_show_what_the_fleet_pause_alert_matches() -> None:
    """The fleet-pause gauges in the gateway's real output: 0 and 0 while running, 1 and
    a recent unix time while a fleet-wide /pause holds (what
    RolloutGatewayFleetPausedTooLong reads), and untouched by a run's scoped pause."""
    sample = metrics_sample()
    for text in (sample.gateway, sample.multi_run, sample.multi_run_paused):
        assert _value(text, "gateway_fleet_paused") == 0
        assert _value(text, "gateway_fleet_paused_since_seconds") == 0
    assert _value(sample.gateway_paused, "gateway_fleet_paused") == 1
    since = _value(sample.gateway_paused, "gateway_fleet_paused_since_seconds")
    assert 1.7e9 < since <= time.time(), since  # a unix time, not a monotonic clock's


def test_alert_rules_check_and_unit_tests() -> None:
    res = promtool("check", "rules", "alerts.yml")
    assert res.returncode == 0, res.stdout + res.stderr
    res = promtool("test", "rules", "alerts_test.yml")
    assert res.returncode == 0, res.stdout + res.stderr


def test_alert_rules_refer_to_exported_metrics() -> None:
    exported = metrics_sample().gateway_names | {"up"}  # single-run and multi-run mode
    rules = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())

    for group in rules["groups"]:
        for rule in group["rules"]:
            names = set(re.findall(r"\b(gateway_[a-z_]+|up)\b(?=\s*[{\[)=<>!]|\s*$)", rule["expr"]))
            assert names, rule["alert"]
            assert names <= exported, (rule["alert"], names - exported)


@pytest.fixture(scope="module")
def started() -> Started:
    return start_scrapes()


def _counter(scrape: Scrape, name: str) -> bool:
    return scrape.family(name)[1] in ("counter", "histogram")


@pytest.mark.parametrize("mode", ["single-run", "--workers 2", "multi-run"])
def test_every_series_an_alert_selects_is_exported_at_start(started: Started, mode: str) -> None:
    """The first scrape of a started gateway (the real CLI, before any traffic) has every
    series each alert selects, for every value of its labels, counters at 0: so the first
    failure is an increase Prometheus sees (docs/alerts.md, "Born at zero")."""
    scrape = started.modes()[mode]
    missing, nonzero, checked = [], [], 0
    for rule in alerts(PROM_DIR / "alerts.yml"):
        for selector in selectors(rule["expr"]):
            if selector.name.startswith(MULTI_RUN_ONLY) and mode != "multi-run":
                assert not scrape.find(selector.name, {}), (mode, selector.name)
                continue
            for labels in expected(selector, scrape):
                checked += 1
                values = scrape.find(selector.name, labels)
                if not values:
                    missing.append((rule["alert"], selector.name, labels))
                elif _counter(scrape, selector.name) and any(values):
                    nonzero.append((rule["alert"], selector.name, labels, values))
    assert not missing, missing
    assert not nonzero, nonzero
    assert checked >= 80, checked  # label combinations: not a check of nothing


def test_a_run_added_by_a_reload_is_born_at_zero(started: Started) -> None:
    """The per-run series an alert selects exist for a run a reload added, at 0, at the
    first scrape after the reload."""
    scrape, checked = started.reloaded, 0
    for rule in alerts(PROM_DIR / "alerts.yml"):
        for selector in selectors(rule["expr"]):
            if not any("run" in labels for labels in expected(selector, started.multi)):
                continue
            values = scrape.find(selector.name, {"run": "run-d"})
            assert values, (rule["alert"], selector.name)
            if _counter(scrape, selector.name):
                assert not any(values), (rule["alert"], selector.name, values)
            checked += 1
    assert checked >= 3, checked


def _promtool_tests() -> list[dict[str, Any]]:
    tests: list[dict[str, Any]] = yaml.safe_load((PROM_DIR / "alerts_test.yml").read_text())[
        "tests"
    ]
    return tests


def test_promtool_inputs_are_what_a_started_gateway_exports(started: Started) -> None:
    """Every input series of alerts_test.yml (bar ``up``, which Prometheus makes) is a
    series the started gateway exports, with the same labels; a counter's starts at the
    value the gateway starts it at, 0. No hand-written zero the gateway never shows."""
    checked = 0
    for case in _promtool_tests():
        for item in case["input_series"]:
            name, labels = parse_series(item["series"])
            if name == "up":
                continue
            labels = {k: v for k, v in labels.items() if k not in ("instance", "job")}
            scrape = started.multi if name.startswith(MULTI_RUN_ONLY) else started.single
            value = scrape.exact(name, labels)
            assert value is not None, (case["name"], item["series"], "not exported at start")
            if _counter(scrape, name):
                first = expand(str(item["values"]))[0]
                assert first == value == 0, (case["name"], item["series"], first, value)
            checked += 1
    assert checked >= 20, checked


def _minutes(duration: str) -> float:
    value, unit = float(duration[:-1]), duration[-1]
    return value * {"s": 1 / 60, "m": 1.0, "h": 60.0}[unit]


def test_every_alert_fires_in_a_promtool_case(started: Started) -> None:
    """Each alert has a promtool case in which it fires. An alert on any increase (one
    failure is worth a look) has one in which a single failure does it: a counter the
    alert selects goes 0 -> 1 (from the 0 the gateway exports at start) and stays, and the
    alert fires at an evaluation after that."""
    tests = _promtool_tests()
    for rule in alerts(PROM_DIR / "alerts.yml"):
        name = rule["alert"]
        fired = [
            (case, check)
            for case in tests
            for check in case.get("alert_rule_test", [])
            if check["alertname"] == name and check.get("exp_alerts")
        ]
        assert fired, f"{name}: no promtool case in which it fires"
        if not counts_any_increase(rule["expr"]):
            continue
        counters = {s.name for s in selectors(rule["expr"]) if _counter(started.multi, s.name)}
        assert counters, name
        single_failures = []
        for case, check in fired:
            step = _minutes(case["interval"])
            for item in case["input_series"]:
                series, _ = parse_series(item["series"])
                values = [v for v in expand(str(item["values"])) if v is not None]
                if series not in counters or values[0] != 0 or set(values) != {0, 1}:
                    continue
                if values == sorted(values) and values.index(1) * step <= _minutes(
                    check["eval_time"]
                ):
                    single_failures.append((case["name"], item["series"]))
        assert single_failures, f"{name}: no case where one failure (0 -> 1) makes it fire"


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to
    hyphens (enough for the runbook's headings, which are alert names)."""
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", markdown, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_alert_waits_and_links_its_runbook_section() -> None:
    """Each alert has a ``for:`` (no alert fires on one evaluation) and a ``runbook_url``
    naming its own section of docs/alerts.md, which exists; each section is an alert."""
    rules = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())["groups"]
    alerts = [rule for group in rules for rule in group["rules"] if "alert" in rule]
    assert len(alerts) >= 16
    anchors = _anchors((REPO / "docs" / "alerts.md").read_text())
    for rule in alerts:
        name = rule["alert"]
        assert re.fullmatch(r"[1-9][0-9]*[smh]", str(rule.get("for", ""))), name
        url = rule["annotations"]["runbook_url"]
        assert url == f"docs/alerts.md#{name.lower()}", (name, url)
        assert name.lower() in anchors, f"docs/alerts.md has no section for {name}"
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
    sections = {a for a in anchors if a.startswith("rolloutgateway")}
    assert sections == {rule["alert"].lower() for rule in alerts}


def test_shipped_prometheus_configs_are_valid(tmp_path: Path) -> None:
    """deploy/compose/prometheus.yml, laid out as its container mounts it (alerts beside)."""
    configs = sorted(REPO.glob("deploy/**/prometheus*.yml"))
    assert configs, "no deploy/**/prometheus*.yml: the check would pass on nothing"
    for config in configs:
        target = tmp_path / config.parent.name
        target.mkdir()
        shutil.copy(config, target / "prometheus.yml")
        shutil.copy(PROM_DIR / "alerts.yml", target / "alerts.yml")
        res = promtool("check", "config", str(target / "prometheus.yml"))
        assert res.returncode == 0, (config, res.stdout + res.stderr)


async def _query(client: httpx.AsyncClient, expr: str) -> list[dict[str, Any]]:
    r = await client.get("/api/v1/query", params={"query": expr})
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


async def _until(client: httpx.AsyncClient, expr: str) -> float:
    """Poll an instant query until it returns one finite, positive value."""

    async def positive() -> float | None:
        result = await _query(client, expr)
        value = float(result[0]["value"][1]) if result else math.nan
        return value if math.isfinite(value) and value > 0 else None

    value = await eventually(positive, f"a positive value of {expr}", interval=0.5)
    assert value is not None
    return value


async def _ready(api: httpx.AsyncClient) -> bool:
    return (await api.get("/-/ready")).status_code == 200


async def test_real_prometheus_scrapes_gateway_under_load(tmp_path: Path) -> None:
    prometheus = tool("prometheus")
    async with cluster(2, max_staleness=1) as c:
        hostport = c.url.removeprefix("http://")
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(PROM_DIR / "alerts.yml")],
            "scrape_configs": [
                {"job_name": "rollout-gateway", "static_configs": [{"targets": [hostport]}]},
                {
                    "job_name": "vllm",
                    "static_configs": [
                        {"targets": [u.removeprefix("http://") for u in c.replica_urls]}
                    ],
                },
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        cmd = [
            str(prometheus),
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ]
        with process(cmd, log=tmp_path / "prometheus.log"):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as api:
                await eventually(
                    lambda: _ready(api), "Prometheus ready", interval=0.2, ignore=(httpx.HTTPError,)
                )
                await _until(api, 'sum(up{job="rollout-gateway"})')
                await _until(api, 'count(up{job="vllm"} == 1)')
                # Load in a few waves across scrapes so rate() sees increases. The windows
                # are 5 minutes, longer than the whole test: the increases stay in them
                # however slowly the polls below go (with 10 s windows, a slow machine
                # could poll after the load had left the window: never positive again).
                for wave in range(3):
                    await drive_load(c, groups=2, versions=2, base=1 + 2 * wave)
                    await asyncio.sleep(1.2)
                decisions = await _until(api, "sum(rate(gateway_routing_decisions_total[5m]))")
                p90 = await _until(
                    api,
                    "histogram_quantile(0.9, sum by (le) "
                    "(rate(gateway_adapter_load_seconds_bucket[5m])))",
                )
                affinity = await _until(
                    api,
                    'sum(rate(gateway_routing_decisions_total{reason=~"affinity|ring"}[5m]))'
                    " / sum(rate(gateway_routing_decisions_total[5m]))",
                )
                assert 0 < p90 < 5, p90  # sim loads settle in milliseconds
                assert 0.5 <= affinity <= 1.0, affinity
                kv = await _query(api, "vllm:kv_cache_usage_perc")
                assert len(kv) == 2, kv
                # The recommended rules load and evaluate without error on live data.
                rules = (await api.get("/api/v1/rules")).json()["data"]["groups"]
                health = {r["name"]: r["health"] for g in rules for r in g["rules"]}
                assert health and set(health.values()) == {"ok"}, health
                # Every dashboard query parses and runs on live data.
                for expr in dashboard_expressions(load_dashboard()):
                    await _query(api, substitute(expr))
                print(f"routing decisions {decisions:.1f}/s, adapter load p90 {p90 * 1e3:.1f} ms")


def _prometheus_config(tmp_path: Path, target: str) -> Path:
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(PROM_DIR / "alerts.yml")],
        "scrape_configs": [
            {"job_name": "rollout-gateway", "static_configs": [{"targets": [target]}]}
        ],
    }
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


async def test_real_prometheus_alerts_on_the_first_failure(tmp_path: Path) -> None:
    """The real CLI over two sim replicas, scraped every second by a real Prometheus with
    the recommended rules. One failed adapter load and one refused /pause, each the first
    and only failure of its kind (TRL stops at its first), put
    RolloutGatewayAdapterLoadFailing and RolloutGatewayControlCallFailing in pending (they
    fire after their ``for:``, not waited for here): Prometheus saw the series at 0 first."""
    with sim_fleet(2, tmp_path) as f:
        config = _prometheus_config(tmp_path, f.url.removeprefix("http://"))
        port = free_port()
        cmd = [str(tool("prometheus")), f"--config.file={config}",
               f"--storage.tsdb.path={tmp_path / 'data'}",
               f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]  # fmt: skip
        with process(cmd, log=tmp_path / "prometheus.log"):
            async with (
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as api,
                httpx.AsyncClient(base_url=f.url, timeout=30) as gw,
            ):
                await eventually(
                    lambda: _ready(api), "Prometheus ready", interval=0.2, ignore=(httpx.HTTPError,)
                )
                # Two scrapes of the gateway before anything fails.
                await _until(api, 'count_over_time(up{job="rollout-gateway"}[5m]) >= 2')
                faults = {"load_error": 1, "pause_error": 1}
                r = await gw.post(f.sims[0].url + "/sim/faults", json=faults)
                assert r.status_code == 200, r.text
                load = {"lora_name": "trl-policy-v1", "lora_path": str(tmp_path / "v1")}
                assert (await gw.post("/v1/load_lora_adapter", json=load)).status_code == 502
                assert (await gw.post("/pause")).status_code == 502

                async def alerting() -> set[tuple[str, str]] | None:
                    body = (await api.get("/api/v1/alerts")).json()
                    found = {
                        (
                            a["labels"]["alertname"],
                            a["labels"].get("outcome") or a["labels"].get("call", ""),
                        )
                        for a in body["data"]["alerts"]
                        if a["state"] in ("pending", "firing")
                    }
                    wanted = {("RolloutGatewayAdapterLoadFailing", "rejected"),
                              ("RolloutGatewayControlCallFailing", "pause")}  # fmt: skip
                    return found if wanted <= found else None

                found = await eventually(alerting, "both alerts pending after one failure each",
                                         timeout=60, interval=0.5)  # fmt: skip
                print(f"alerts after the first failures: {sorted(found or ())}")
