"""How the control-plane benchmark states its result: ``control_plane.json`` (every figure,
the CPU/memory series), ``.md`` (the tables ``docs/performance.md`` quotes) and ``.png``
(load latency and CPU per load against the replica count; CPU and memory over time at the
largest fleet).

The reading of the figures (what grows with N, where the first wall is, anything found)
is written by hand in ``findings.md`` next to this file and appended to the Markdown, so a
rerun keeps it; its figures must be updated by hand when they change.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from bench.control_plane import registry
from bench.lib import report as lib_report

FINDINGS = Path(__file__).with_name("findings.md")


def _label(run: dict[str, Any]) -> str:
    return f"{run['config']['n']} replicas, --workers {run['config']['workers']}"


def one_line(run: dict[str, Any]) -> str:
    lat = run["loads"]["latency_ms"]
    ok = sum(c["ok"] for c in run["checks"])
    return (f"   load p50 {lat['p50']:.1f} ms, max {lat['max']:.1f} ms; pause+SIGSTOP "
            f"{run['pause_vanish']['status']} in {run['pause_vanish']['seconds']:.2f} s; "
            f"load+SIGKILL {run['load_vanish']['status']} in "
            f"{run['load_vanish']['seconds']:.2f} s; rejoin {run['rejoin_thaw']['seconds']} s "
            f"(SIGCONT) / {run['rejoin_restart']['seconds_after_listening']} s (restart); "
            f"checks {ok}/{len(run['checks'])}; {run['wall_s']} s")  # fmt: skip


def phases(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per phase (between two marks): its length, the gateway's mean CPU share and PSS peak."""
    series, marks = run["series"], run["marks"]
    out = []
    for (t0, label), (t1, _) in itertools.pairwise(marks):
        rows = [s for s in series if t0 <= s["t"] <= t1]
        inside = [s for s in series if t0 < s["t"] <= t1]
        before = [s for s in series if s["t"] <= t0]
        first = before[-1] if before else (rows[0] if rows else None)
        last = rows[-1] if rows else None
        cpu = None
        if first and last and last["t"] > first["t"]:
            cpu = 100 * (last["cpu_s"] - first["cpu_s"]) / (last["t"] - first["t"])
        out.append({"phase": label, "seconds": round(t1 - t0, 2),
                    "cpu_pct": None if cpu is None else round(cpu, 1),
                    "cpu_pct_max": max((s["cpu_pct"] for s in inside), default=None),
                    "pss_mb_max": max((s["pss_mb"] for s in rows), default=None)})  # fmt: skip
    return out


def focus(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs whose CPU and memory are shown over time: 256 replicas (the size the
    issue asks about), else the largest."""
    sizes = {r["config"]["n"] for r in runs}
    n = 256 if 256 in sizes else max(sizes, default=0)
    return [r for r in runs if r["config"]["n"] == n]


def _f(value: object, fmt: str = ".1f") -> str:
    return "n/a" if value is None else format(value, fmt)


def markdown(data: dict[str, Any]) -> str:
    m = data["machine"]
    runs = data["runs"]
    bt = format(runs[0]["config"]["broadcast_timeout_s"], "g") if runs else "?"
    lines = [
        "# The control plane at scale, simulated (`make bench-control-plane`)",
        "",
        f"Run {data['started_utc']} - {data.get('finished_utc', '?')} UTC at "
        f"`{m['git_head']}`{' (gateway/ had uncommitted changes of others)' if m['gateway_tree_dirty'] else ''}, "  # noqa: E501
        f"`{data['command']}`. Machine: {m['nproc']} CPUs (a shared, noisy VM: other "
        f"engineers' tests ran beside it), load average at start "
        f"{lib_report.fmt_load(m['loadavg_at_start'])}, Python {m['python']}. Nothing "
        "pinned: the gateway, its workers and the 4 sim host processes share the 2 cores, "
        "so every latency here includes the simulated replicas' own time to answer.",
        "",
        "**Setup.** N simulated vLLM replicas served by 4 `rollout_testbed.sim.fleet_host` "
        "processes (N/4 replicas each, one port per replica, one event loop per process); "
        "the gateway is a real `python -m gateway serve --replica URL` x N, once as one "
        "process and once with `--workers 4` (on 2 cores: more workers than cores, which "
        "`docs/workers.md` advises against; measured because the control plane lives in "
        "the owner either way), `--max-staleness 4`, `--broadcast-timeout-s "
        f"{bt}`, health probes at "
        "their defaults (every 2 s, 2 s timeout, 2 failures eject). Loads are "
        "`trl-policy-v1..v24` one after another, each timed to its 200 and then checked on "
        "every replica itself (`/fleet/state`); from v6 on each evicts the oldest. Pauses "
        "are TRL's `/pause?mode=keep`.",
        "",
        "**The control-call rule** (`gateway/fleet/quorum.py`; `docs/operations.md`, "
        '"Control calls"): each replica\'s answer is *applied* (2xx), *refused* (an HTTP '
        "error) or *lost* (no answer: refused connection, reset, nothing within "
        "`broadcast_timeout_s`, or ejected by the health checker while the call waited). "
        "A lost replica is ejected and left out; the call is 200 when nothing was refused "
        "and at least `health_min_replicas` (default 1) applied it, 502 if one refused, "
        "503 below the quorum. Lost replicas are reconciled (pause state, live adapters) "
        "before they serve again. Checked below: the last host (a quarter of the fleet) "
        "holds the call (`/fleet/hold`) until every one of its replicas has received it, "
        "then is SIGSTOPped (pause) or SIGKILLed (load).",
        "",
        "## Load latency and cost against the replica count",
        "",
        "| replicas | workers | load to 200, p50 / max (ms) | gateway CPU per load, p50 (ms) "
        "| pause / resume p50 (ms) | idle CPU (% of a core) | `/gateway/status` (KB, ms) "
        "| CPU peak, 1 s (%) | RSS / PSS peak (MB) | start to /health 200 (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lat, cpu, pr = r["loads"]["latency_ms"], r["loads"]["gateway_cpu_ms"], r["pause_resume"]
        pk, idle = r["peaks"], r["idle"]
        lines.append(
            f"| {r['config']['n']} | {r['config']['workers']} | {lat['p50']:.1f} / "
            f"{lat['max']:.1f} | {cpu['p50']:.1f} | {pr['pause_ms']['p50']:.1f} / "
            f"{pr['resume_ms']['p50']:.1f} | {idle['cpu_pct']:.1f} | {idle['status_kb']:.0f}, "
            f"{idle['status_ms']:.0f} | {pk['cpu_pct_max_1s']:.0f} | {pk['rss_mb_max']:.0f} / "
            f"{pk['pss_mb_max']:.0f} | {r['started_s']:.1f} |"
        )
    lines += [
        "",
        "## A quarter of the fleet vanishes mid-call, then rejoins",
        "",
        "| replicas | workers | pause, SIGSTOP of N/4: answer, s (after the stop) "
        "| load, SIGKILL of N/4: answer, s (after the kill) | rejoin after SIGCONT (s) "
        "| rejoin after restart: listening + reconciled (s) | checks |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        pv, lv, rt, rr = r["pause_vanish"], r["load_vanish"], r["rejoin_thaw"], r["rejoin_restart"]
        ok = sum(c["ok"] for c in r["checks"])
        lines.append(
            f"| {r['config']['n']} | {r['config']['workers']} | {pv['status']}, "
            f"{pv['seconds']:.2f} ({pv['seconds_after_vanish']:.2f}) | {lv['status']}, "
            f"{lv['seconds']:.2f} ({lv['seconds_after_vanish']:.2f}) | {_f(rt['seconds'], '.2f')} "
            f"| {rr['listening_s']:.2f} + {_f(rr['seconds_after_listening'], '.2f')} "
            f"| {ok}/{len(r['checks'])} |"
        )
    failed = [(r, c) for r in runs for c in r["checks"] if not c["ok"]]
    lines += ["", "Checks that failed: " + ("none." if not failed else "")]
    for r, c in failed:
        lines.append(f"- {_label(r)}: {c['check']} ({c['detail']})")
    if data.get("registry"):
        lines += ["", "## The adapter registry alone: CPU per load against the replica count",
                  "", "`bench/control_plane/registry.py`: the pure `AdapterRegistry` "
                  "(`gateway/adapters/state.py`, no I/O) driven as the fan-out drives it, "
                  "every replica answering 200, 12 loads with `max_staleness` 4; the median "
                  "over the loads that evict. Process CPU time, so the VM's noise barely "
                  "touches it.", "", *registry.markdown(data["registry"])]  # fmt: skip
    for r in focus(runs):
        lines += ["", f"## Phases at {_label(r)}: the gateway's CPU and memory", "",
                  "| phase | s | gateway CPU, mean / max sample (% of a core) | PSS max (MB) |",
                  "|---|---|---|---|"]  # fmt: skip
        for p in phases(r):
            lines.append(f"| {p['phase']} | {p['seconds']:.1f} | {_f(p['cpu_pct'])} / "
                         f"{_f(p['cpu_pct_max'])} | {_f(p['pss_mb_max'])} |")  # fmt: skip
    lines += ["", "Every check, per run, and the CPU/memory series (every 0.5 s, every "
              "process of the gateway, from `/proc`): `control_plane.json`. The picture: "
              "`control_plane.png`."]  # fmt: skip
    if FINDINGS.exists():
        lines += ["", FINDINGS.read_text().strip()]
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], png: Path) -> bool:
    plt = lib_report.pyplot()
    if plt is None:
        return False
    runs = data["runs"]
    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    for workers, style in ((1, "o-"), (4, "s--")):
        rs = sorted((r for r in runs if r["config"]["workers"] == workers),
                    key=lambda r: r["config"]["n"])  # fmt: skip
        if not rs:
            continue
        ns = [r["config"]["n"] for r in rs]
        ax[0][0].plot(ns, [r["loads"]["latency_ms"]["p50"] for r in rs], style,
                      label=f"p50, --workers {workers}")  # fmt: skip
        ax[0][0].plot(ns, [r["loads"]["latency_ms"]["max"] for r in rs], style, alpha=0.4,
                      label=f"max, --workers {workers}")  # fmt: skip
        ax[0][1].plot(ns, [r["loads"]["gateway_cpu_ms"]["p50"] for r in rs], style,
                      label=f"CPU per load (ms), --workers {workers}")  # fmt: skip
        ax[0][1].plot(ns, [r["idle"]["cpu_pct"] for r in rs], style, alpha=0.5,
                      label=f"idle CPU (% of a core), --workers {workers}")  # fmt: skip
    ax[0][0].set(xlabel="replicas", ylabel="ms", title="adapter load, POST to 200 (live on all)")
    ax[0][1].set(xlabel="replicas", title="the gateway's CPU (all its processes)")
    for a in ax[0]:
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    largest = focus(runs)
    for r in largest:
        t = [s["t"] for s in r["series"]]
        lbl = f"--workers {r['config']['workers']}"
        ax[1][0].plot(t, [s["cpu_pct"] for s in r["series"]], lw=0.8, label=lbl)
        ax[1][1].plot(t, [s["pss_mb"] for s in r["series"]], lw=0.8, label=f"PSS, {lbl}")
        ax[1][1].plot(t, [s["rss_mb"] for s in r["series"]], lw=0.6, ls=":",
                      label=f"RSS summed, {lbl}")  # fmt: skip
        if r["config"]["workers"] == 1:
            for when, label in r["marks"][:-1]:
                for a in ax[1]:
                    a.axvline(when, color="grey", lw=0.5)
                ax[1][0].text(when, 1, label, rotation=90, fontsize=7, va="bottom")
    n = largest[0]["config"]["n"] if largest else 0
    ax[1][0].set(xlabel="s (phase marks: the one-process run)", ylabel="% of one core",
                 title=f"the gateway's CPU over time, {n} replicas")  # fmt: skip
    ax[1][1].set(xlabel="s", ylabel="MB", title=f"the gateway's memory over time, {n} replicas")
    for a in ax[1]:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def write(out_dir: Path, stem: str, data: dict[str, Any]) -> list[Path]:
    return lib_report.write(out_dir, stem, data, markdown(data), plot)
