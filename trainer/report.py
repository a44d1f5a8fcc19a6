"""End-of-run outputs: the reward/staleness PNG and the summary table.

The summary includes the server's own counters: through the gateway, its routing
decisions, per-replica request counts and adapter load/unload/eviction counters (from
``/metrics``); straight against one vLLM, its prefix-cache counters.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.metrics import parse_prometheus

__all__ = ["first_last_mean", "gateway_counters", "plot_curves", "read_jsonl", "summary_table"]


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def _series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, int | float) and math.isfinite(v):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def first_last_mean(
    rows: Sequence[dict[str, Any]], key: str = "reward", n: int = 10
) -> tuple[float, float]:
    _, ys = _series(rows, key)
    if not ys:
        return math.nan, math.nan
    return sum(ys[:n]) / len(ys[:n]), sum(ys[-n:]) / len(ys[-n:])


def plot_curves(
    rows: Sequence[dict[str, Any]], path: str | Path, *, title: str, max_staleness: int
) -> Path | None:
    """Reward (per step and a 10-step moving mean) over staleness mean/max; None if no
    matplotlib (the ``[train]`` extra installs it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    xs, reward = _series(rows, "reward")
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                   gridspec_kw={"height_ratios": [2, 1]})  # fmt: skip
    ax1.plot(xs, reward, color="tab:blue", alpha=0.35, lw=1, label="reward (step)")
    if reward:
        win = 10
        windows = [reward[max(0, i - win + 1) : i + 1] for i in range(len(reward))]
        smooth = [sum(w) / len(w) for w in windows]
        ax1.plot(xs, smooth, color="tab:blue", lw=2, label=f"reward ({win}-step mean)")
    ax1.set_ylabel("reward")
    ax1.set_title(title)
    ax1.grid(alpha=0.3)
    ax1.legend(loc="lower right")
    sx, smean = _series(rows, "sample/staleness_mean")
    mx, smax = _series(rows, "sample/staleness_max")
    ax2.plot(sx, smean, color="tab:orange", lw=1.5, label="staleness mean")
    ax2.step(mx, smax, color="tab:red", lw=1, where="mid", label="staleness max")
    ax2.axhline(max_staleness, color="k", ls="--", lw=1, label=f"max_staleness={max_staleness}")
    ax2.set_ylim(-0.2, max_staleness + 0.8)
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("versions behind")
    ax2.grid(alpha=0.3)
    ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _sum(metrics: dict[str, list[tuple[dict[str, str], float]]], name: str,
         by: str | None = None) -> dict[str, float]:  # fmt: skip
    out: dict[str, float] = {}
    for labels, value in metrics.get(name, []):
        key = labels.get(by, "") if by else ""
        out[key] = out.get(key, 0.0) + value
    return out


def _happened(counts: dict[str, float]) -> dict[str, float]:
    """A counter's non-zero label values: the gateway exports every failure series at 0
    from the start (so that alerts see the first one); a summary line names what happened."""
    return {key: value for key, value in counts.items() if value}


def gateway_counters(metrics_text: str | None) -> dict[str, Any]:
    """The counters worth a line in the summary, from the server's ``/metrics`` text."""
    if not metrics_text:
        return {}
    m = parse_prometheus(metrics_text)
    out: dict[str, Any] = {}
    if "gateway_routing_decisions_total" in m:
        out["routing decisions"] = _happened(_sum(m, "gateway_routing_decisions_total", "reason"))
        out["requests per replica"] = _happened(
            _sum(m, "gateway_replica_routed_requests_total", "replica")
        )
        out["adapter loads"] = _happened(_sum(m, "gateway_adapter_loads_total", "outcome"))
        out["adapter unloads"] = _happened(_sum(m, "gateway_adapter_unloads_total", "outcome"))
        ev = _sum(m, "gateway_adapter_evictions_total") or _sum(m, "gateway_adapter_evictions")
        out["adapter evictions"] = ev.get("", 0.0)
        out["live versions"] = _sum(m, "gateway_adapter_live_versions", "family")
        out["replicas synced"] = _sum(m, "gateway_adapter_replica_synced", "replica")
        out["load retries"] = _sum(m, "gateway_adapter_load_retries_total").get("", 0.0)
        count = _sum(m, "gateway_adapter_load_seconds_count").get("", 0.0)
        total = _sum(m, "gateway_adapter_load_seconds_sum").get("", 0.0)
        if count:
            out["adapter load mean s"] = total / count
        out["upstream retries"] = _sum(m, "gateway_upstream_retries_total").get("", 0.0)
    hits = _sum(m, "vllm:prefix_cache_hits_total").get("", None)
    queries = _sum(m, "vllm:prefix_cache_queries_total").get("", None)
    if hits is not None and queries:
        out["vllm prefix-cache hit rate"] = hits / queries
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in sorted(v.items())) or "-"
    return str(v)


def summary_table(rows: Sequence[tuple[str, Any]]) -> str:
    width = max((len(k) for k, _ in rows), default=0)
    line = "-" * (width + 50)
    body = "\n".join(f"{k:<{width}}  {_fmt(v)}" for k, v in rows)
    return f"{line}\n{body}\n{line}"
