"""The control-plane benchmark, short: 16 sim replicas in 2 host processes, one gateway.

Runs ``bench.control_plane.scenario.run`` end to end (real processes and sockets) and
asserts outcomes only, never a duration: every load answers 200 and is on every replica,
the window evicts, a pause and a load during which half the fleet vanishes (SIGSTOP, then
SIGKILL, while the call is held in flight on it) answer 200 with the vanished replicas
ejected, and both rejoins end with every replica healthy, reconciled and in the fleet's
state. The scenario's waits are its own bounded polls; the probe settings are shortened
so that a hung host is ejected in about two seconds instead of eight.
"""

from __future__ import annotations

from pathlib import Path

from bench.control_plane import report
from bench.control_plane.scenario import Config, run

# A hung host is ejected within about 2 x (0.5 + 1) s; a healthy one only if two probes
# in a row wait more than 1 s (a stall of the whole box longer than tests/eventually's
# STALL_S would be needed).
FAST_PROBES = ("--health-interval-s", "0.5", "--health-timeout-s", "1.0")


def test_the_short_benchmark_runs_and_the_control_call_rule_holds(tmp_path: Path) -> None:
    cfg = Config(n=16, hosts=2, workers=1, loads=7, pauses=2, idle_s=0.5,
                 gateway_flags=FAST_PROBES)  # fmt: skip
    res = run(cfg, tmp_path / "logs")
    failed = [f"{c['check']}: {c['detail']}" for c in res["checks"] if not c["ok"]]
    assert not failed, "\n".join(failed)
    assert res["ok"]
    assert res["loads"]["latency_ms"]["count"] == 7
    for phase in ("pause_vanish", "load_vanish"):
        vanished = res[phase]
        assert vanished["status"] == 200 and vanished["in_flight_on_all_of_them"], vanished
        assert vanished["replicas_vanished"] == 8
    assert res["pause_vanish"]["how"] == "SIGSTOP" and res["load_vanish"]["how"] == "SIGKILL"
    assert res["rejoin_thaw"]["seconds"] is not None
    assert res["rejoin_restart"]["seconds_after_listening"] is not None
    counts = res["adapter_counts"]
    assert counts.get("evict.stale", 0) >= 3  # v1..v3 left the window of 5
    assert counts.get("replay.load", 0) >= 8 * 5  # the restarted host got the whole window
    assert res["series"] and res["peaks"]["pss_mb_max"] > 0
    assert res["marks"][0][1] == "idle"

    data = {"machine": {"git_head": "x", "gateway_tree_dirty": False, "nproc": 2,
                        "loadavg_at_start": None, "python": "3"},
            "command": "test", "started_utc": "now", "runs": [{**res, "wall_s": 1.0}]}  # fmt: skip
    text = report.markdown(data)
    assert "| 16 | 1 |" in text and "Checks that failed: none." in text
    assert report.one_line(data["runs"][0]).count("200") == 2
    paths = report.write(tmp_path / "out", "control_plane", data)
    assert {p.suffix for p in paths} >= {".json", ".md"}
