"""Per-run metrics (multi-run mode): the ``run`` label's values are the configured runs,
so its cardinality is bounded by the configuration, never by traffic."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.runs.fairness import FairGate

if TYPE_CHECKING:
    from gateway.runs.tenancy import Tenancy, Tenant

__all__ = ["RunCollector"]


class RunCollector(Collector):
    """Multi-run mode, per run (the ``run`` label's values are the configured runs)."""

    def __init__(self, tenancy: Tenancy) -> None:
        self._tenancy = tenancy

    def collect(self) -> Iterator[Metric]:
        tenancy = self._tenancy
        runs = tenancy.every()  # a removed run's counts until it is gone: its last ones
        families = (
            ("gateway_run_in_flight", "Rollouts of the run in flight.", GaugeMetricFamily,
             lambda t: t.in_flight),
            ("gateway_run_requests", "Rollouts of the run admitted.", CounterMetricFamily,
             lambda t: t.requests),
            ("gateway_run_paused", "1 while the run's scoped /pause holds its rollouts.",
             GaugeMetricFamily, lambda t: 1.0 if t.paused is not None else 0.0),
            ("gateway_run_leaving",
             "1 while a reload removed the run and it drains, or its adapters are unloaded.",
             GaugeMetricFamily, lambda t: 0.0 if t.name in tenancy.tenants else 1.0),
            ("gateway_run_home_replicas", "Replicas the run is placed on (0: unplaced).",
             GaugeMetricFamily, lambda t: len(t.homes)),
            ("gateway_run_live_adapters", "Adapter versions of the run live on its homes.",
             GaugeMetricFamily, lambda t: len(t.manager.live_adapters())),
            ("gateway_run_prompt_tokens", "Prompt tokens of the run's answers (vLLM's usage).",
             CounterMetricFamily, lambda t: t.usage.prompt_tokens),
            ("gateway_run_completion_tokens",
             "Completion tokens of the run's answers (vLLM's usage).",
             CounterMetricFamily, lambda t: t.usage.completion_tokens),
            ("gateway_run_held_seconds", "Time the run's rollouts waited at the gateway.",
             CounterMetricFamily, lambda t: t.usage.held_s),
            ("gateway_run_weight", "The run's weight in the fair share of saturated replicas.",
             GaugeMetricFamily, lambda t: t.run.weight),
            ("gateway_run_fair_slots", "Replica slots the run's rollouts hold now.",
             GaugeMetricFamily, lambda t: _fair(t, FairGate.slots)),
            ("gateway_run_fair_waiting", "The run's rollouts held now for a free slot.",
             GaugeMetricFamily, lambda t: _fair(t, FairGate.waiting)),
            ("gateway_run_fair_overflows",
             "The run's rollouts sent at fair_wait_s without a free slot.",
             CounterMetricFamily, lambda t: _fair(t, FairGate.overflowed)),
        )  # fmt: skip
        for name, doc, kind, value in families:
            family = kind(name, doc, labels=["run"])
            for tenant in runs:
                family.add_metric([tenant.name], value(tenant))
            yield family
        answered = CounterMetricFamily(
            "gateway_run_rollouts", "The run's answered rollouts, by status class.",
            labels=["run", "status_class"],
        )  # fmt: skip
        for tenant in runs:
            for status_class, count in sorted(tenant.usage.rollouts.items()):
                answered.add_metric([tenant.name, status_class], count)
        yield answered
        reloads = CounterMetricFamily(
            "gateway_run_reloads", "Reloads of the run set (docs/many-runs.md), by outcome: "
            "applied, unchanged, refused.", labels=["outcome"],
        )  # fmt: skip
        for outcome in ("applied", "unchanged", "refused"):
            reloads.add_metric([outcome], self._tenancy.reloads.get(outcome, 0))
        yield reloads


def _fair(tenant: Tenant, read: Callable[[FairGate, str], int]) -> int:
    return 0 if tenant.fair is None else read(tenant.fair, tenant.name)
