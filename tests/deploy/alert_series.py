"""What the recommended alerts select, and what a gateway exports the moment it starts.

Prometheus' ``increase()`` and ``rate()`` see a counter rise only from a sample already
scraped, so an alert on "any failure" can fire for the first failure only if the failure's
series was exported at 0 before it (``gateway.metrics``, "Born at zero"). The checks in
``test_prometheus.py`` hold three things to that:

* every series an alert's expression selects, for every value of its labels (the closed
  sets below, taken from the code's enums), is in the first scrape of a started gateway
  (the real CLI over sim replicas), at 0 if it is a counter;
* every input series of ``alerts_test.yml`` is one the started gateway exports, and a
  counter's starts at the 0 the gateway exports, not at a value it never shows;
* every alert has a promtool case in which it fires, and an alert on any increase
  (``increase(...) > 0``) one in which a single failure, 0 then 1, makes it fire.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any

import httpx
import yaml
from rollout_testbed.procs import sim_fleet

from gateway.adapters.state import Failure, Outcome
from gateway.fleet.admission import Refusal
from gateway.fleet.control import PAUSE, RESET, RESUME
from gateway.metrics import STATUS_CLASSES, UPSTREAM_ERROR_KINDS, RouteKind

REPLICAS = ("0", "1", "2")
RUNS = ("run-a", "run-b", "run-c")
ADMIN = "admin-TESTSECRET-alerts"

# Every value a label of an alert-selected family can take (the alert's matchers pick from
# them). ``outcome`` differs by family; ``le`` (histogram buckets) is any.
LABELS: dict[str, frozenset[str]] = {
    "replica": frozenset(REPLICAS),
    "run": frozenset(RUNS),
    "route": frozenset(RouteKind),
    "status_class": frozenset(STATUS_CLASSES),
    "endpoint": frozenset(path.rsplit("/", 1)[-1] for path in (PAUSE, RESUME, RESET)),
    "kind": frozenset(UPSTREAM_ERROR_KINDS),
    "reason": frozenset(Refusal),
}
OUTCOMES: dict[str, frozenset[str]] = {
    "gateway_adapter_loads": frozenset({"ok", *Failure}),
    "gateway_adapter_load_seconds": frozenset({"ok", *Failure}),
    "gateway_adapter_unloads": frozenset(Outcome),
    "gateway_broadcasts": frozenset({"ok", "failed"}),
    "gateway_run_reloads": frozenset({"applied", "unchanged", "refused"}),
}
ANY = frozenset({"le"})
MULTI_RUN_ONLY = "gateway_run_"

_SELECTOR = re.compile(r"\b(gateway_[a-z_]+)\b(?:\{([^}]*)\})?")
_MATCHER = re.compile(r'([a-zA-Z_]+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_]+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Selector:
    """One vector selector of an alert expression: a series name and its matchers."""

    name: str
    matchers: tuple[tuple[str, str, str], ...]

    def accepts(self, label: str, value: str) -> bool:
        for name, op, pattern in self.matchers:
            if name != label:
                continue
            hit = re.fullmatch(pattern, value) is not None if "~" in op else value == pattern
            if hit == op.startswith("!"):
                return False
        return True

    def labels(self) -> set[str]:
        return {name for name, _, _ in self.matchers}


def selectors(expr: str) -> list[Selector]:
    """The gateway's series an expression selects (``up`` and functions are not)."""
    return [
        Selector(name, tuple(_MATCHER.findall(body or "")))
        for name, body in _SELECTOR.findall(expr)
    ]


def alerts(path: Path) -> list[dict[str, Any]]:
    groups = yaml.safe_load(path.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def counts_any_increase(expr: str) -> bool:
    """An alert on any increase at all (one failure is worth a look): ``increase(...) > 0``."""
    return "increase(" in expr and re.search(r">\s*0\s*$", expr.strip()) is not None


@dataclass(frozen=True)
class Scrape:
    """One /metrics text: each sample's name, labels and value, and each family's type."""

    text: str

    def types(self) -> dict[str, str]:
        found = re.findall(r"^# TYPE (\S+) (\S+)$", self.text, re.MULTILINE)
        return dict(found)

    def samples(self) -> Iterator[tuple[str, dict[str, str], float]]:
        for line in self.text.splitlines():
            if line and not line.startswith("#") and (m := _SAMPLE.match(line)):
                yield m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))

    def family(self, sample: str) -> tuple[str, str]:
        """``(family, type)`` of a sample name, the family without ``_total`` (the text
        format names a counter's family either way)."""
        types = self.types()
        for suffix in ("", "_total", "_bucket", "_count", "_sum"):
            base = sample.removesuffix(suffix) if suffix else sample
            if (suffix == "" or sample.endswith(suffix)) and base in types:
                return base.removesuffix("_total"), types[base]
        return sample.removesuffix("_total"), "absent"

    def find(self, name: str, labels: dict[str, str]) -> list[float]:
        """Values of the samples called ``name`` whose labels include ``labels``."""
        return [
            value
            for sample, have, value in self.samples()
            if sample == name and labels.items() <= have.items()
        ]

    def exact(self, name: str, labels: dict[str, str]) -> float | None:
        for sample, have, value in self.samples():
            if sample == name and have == labels:
                return value
        return None


def expected(selector: Selector, scrape: Scrape) -> Iterator[dict[str, str]]:
    """Every label combination of the selected family that must be exported: each label
    the family has, over all its values (``LABELS``, ``OUTCOMES``) that the matchers
    accept. Raises for a label with no known values: add it above."""
    family, _ = scrape.family(selector.name)
    names = sorted({k for s, have, _ in scrape.samples() if s == selector.name for k in have})
    names = sorted((set(names) | selector.labels()) - ANY)
    values = []
    for label in names:
        domain = OUTCOMES.get(family) if label == "outcome" else LABELS.get(label)
        if domain is None:
            raise AssertionError(f"{family}: no known values for label {label!r}")
        values.append(sorted(v for v in domain if selector.accepts(label, v)))
    for combo in product(*values):
        yield dict(zip(names, combo, strict=True))


# --- promtool's input series ----------------------------------------------------------


def expand(values: str) -> list[float | None]:
    """promtool's expanding notation (``1 0x3 0+5x2 _ stale``); None: no sample."""
    out: list[float | None] = []
    for token in values.split():
        if token in ("_", "stale"):
            out.append(None)
            continue
        m = re.fullmatch(r"(_|-?[\d.e+]+?)(?:([+-][\d.e]+)?x(\d+))?", token)
        assert m, token
        start, step, times = m.group(1), m.group(2), m.group(3)
        if times is None:
            out.append(float(start))
        elif start == "_":
            out.extend([None] * int(times))
        else:
            delta = float(step or 0)
            out.extend(float(start) + delta * i for i in range(int(times) + 1))
    return out


def parse_series(series: str) -> tuple[str, dict[str, str]]:
    m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?", series.strip())
    assert m, series
    return m.group(1), dict(re.findall(r'([a-zA-Z_]+)\s*=\s*"([^"]*)"', m.group(2) or ""))


# --- a gateway as started -------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    """The first /metrics of real ``rollout-gateway serve`` processes over 3 sim replicas,
    taken before any traffic: single-run, ``--workers 2``, multi-run (runs ``RUNS``), and
    the multi-run gateway after a reload added ``run-d`` (a run is born at 0 too)."""

    single: Scrape
    workers: Scrape
    multi: Scrape
    reloaded: Scrape

    def modes(self) -> dict[str, Scrape]:
        return {"single-run": self.single, "--workers 2": self.workers, "multi-run": self.multi}


def _first_scrape(url: str) -> Scrape:
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200, r.text
    return Scrape(r.text)


def _runs_config(root: Path, names: tuple[str, ...]) -> str:
    runs = []
    for name in names:
        (root / name).mkdir(exist_ok=True)
        runs.append({"name": name, "key": f"key-TESTSECRET-{name}",
                     "adapter_root": str(root / name), "max_staleness": 1})  # fmt: skip
    return yaml.safe_dump({"admin_key": ADMIN, "runs": runs})


def start_scrapes() -> Started:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with sim_fleet(len(REPLICAS), root) as f:
            single = _first_scrape(f.url)
        with sim_fleet(len(REPLICAS), root, gateway_args=["--workers", "2"]) as f:
            workers = _first_scrape(f.url)
        config = root / "runs.yaml"
        config.write_text(_runs_config(root, RUNS))
        with sim_fleet(len(REPLICAS), root, gateway_args=["--config", str(config)]) as f:
            multi = _first_scrape(f.url)
            config.write_text(_runs_config(root, (*RUNS, "run-d")))
            headers = {"Authorization": f"Bearer {ADMIN}"}
            r = httpx.post(f.url + "/gateway/runs/reload", headers=headers, timeout=30)
            assert r.status_code == 200, r.text
            reloaded = _first_scrape(f.url)
    return Started(single, workers, multi, reloaded)
