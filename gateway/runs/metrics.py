"""Per-run metrics (multi-run mode): the ``run`` label's values are the configured runs,
so its cardinality is bounded by the configuration, never by traffic."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.runs.fairness import FairGate
from gateway.runs.lifecycle import Final

if TYPE_CHECKING:
    from gateway.runs.tenancy import Tenancy, Tenant

__all__ = ["RunCollector"]


class RunCollector(Collector):
    """Multi-run mode, per run (the ``run`` label's values are the configured runs, and
    for ``DEPARTED_KEEP_S`` after one is gone, its counters' last values)."""

    def __init__(self, tenancy: Tenancy) -> None:
        self._tenancy = tenancy

    def collect(self) -> Iterator[Metric]:
        tenancy = self._tenancy
        runs = tenancy.every()  # a removed run's counts until it is gone: its last ones
        gauges = (
            ("gateway_run_in_flight", "Rollouts of the run in flight.", lambda t: t.in_flight),
            ("gateway_run_paused", "1 while the run's scoped /pause holds its rollouts.",
             lambda t: 1.0 if t.paused is not None else 0.0),
            ("gateway_run_leaving",
             "1 while a reload removed the run and it drains, or its adapters are unloaded.",
             lambda t: 0.0 if t.name in tenancy.tenants else 1.0),
            ("gateway_run_home_replicas", "Replicas the run is placed on (0: unplaced).",
             lambda t: len(t.homes)),
            ("gateway_run_live_adapters", "Adapter versions of the run live on its homes.",
             lambda t: len(t.manager.live_adapters())),
            ("gateway_run_weight", "The run's weight in the fair share of saturated replicas.",
             lambda t: t.run.weight),
            ("gateway_run_fair_slots", "Replica slots the run's rollouts hold now.",
             lambda t: _fair(t, FairGate.slots)),
            ("gateway_run_fair_waiting", "The run's rollouts held now for a free slot.",
             lambda t: _fair(t, FairGate.waiting)),
        )  # fmt: skip
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=["run"])
            for tenant in runs:
                gauge.add_metric([tenant.name], value(tenant))
            yield gauge
        # Counters: the runs here, then the gone ones' last counts, kept DEPARTED_KEEP_S
        # (``gateway.runs.lifecycle``) so that the next scrapes still read them.
        finals = [Final(t.name, t.requests, t.usage, _fair(t, FairGate.overflowed)) for t in runs]
        finals += tenancy.departed.finals()
        counters: tuple[tuple[str, str, Callable[[Final], float]], ...] = (
            ("gateway_run_requests", "Rollouts of the run admitted.", lambda f: f.requests),
            ("gateway_run_prompt_tokens", "Prompt tokens of the run's answers (vLLM's usage).",
             lambda f: f.usage.prompt_tokens),
            ("gateway_run_completion_tokens",
             "Completion tokens of the run's answers (vLLM's usage).",
             lambda f: f.usage.completion_tokens),
            ("gateway_run_held_seconds", "Time the run's rollouts waited at the gateway.",
             lambda f: f.usage.held_s),
            ("gateway_run_fair_overflows",
             "The run's rollouts sent at fair_wait_s without a free slot.",
             lambda f: f.fair_overflows),
        )  # fmt: skip
        for name, doc, read in counters:
            counter = CounterMetricFamily(name, doc, labels=["run"])
            for final in finals:
                counter.add_metric([final.name], read(final))
            yield counter
        answered = CounterMetricFamily(
            "gateway_run_rollouts", "The run's answered rollouts, by status class.",
            labels=["run", "status_class"],
        )  # fmt: skip
        unread = CounterMetricFamily(
            "gateway_run_answers_unread", "The run's success answers the gateway could not "
            "read as JSON, by what it looked for: usage (tokens not counted) or model (its "
            "run's prefix cut out as text).", labels=["run", "part"],
        )  # fmt: skip
        for final in finals:
            for status_class, count in sorted(final.usage.rollouts.items()):
                answered.add_metric([final.name, status_class], count)
            for part in _UNREAD:
                unread.add_metric([final.name, part], final.usage.unread.get(part, 0))
        yield answered
        yield unread
        reloads = CounterMetricFamily(
            "gateway_run_reloads", "Reloads of the run set (docs/many-runs.md), by outcome: "
            "applied, unchanged, refused.", labels=["outcome"],
        )  # fmt: skip
        for outcome in ("applied", "unchanged", "refused"):
            reloads.add_metric([outcome], self._tenancy.reloads.get(outcome, 0))
        yield reloads


_UNREAD = ("model", "usage")  # every part, at 0 from the start: an alert sees the first


def _fair(tenant: Tenant, read: Callable[[FairGate, str], int]) -> int:
    return 0 if tenant.fair is None else read(tenant.fair, tenant.name)
