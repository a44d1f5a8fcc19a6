"""Pipeline pieces without a server: admission bound, payload, scoring, metrics, config."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest

from trainer.config import TrainConfig, parse_config
from trainer.metrics import MetricSink, parse_prometheus, reduce_metric
from trainer.rollout import Admission, build_payload
from trainer.scoring import score_group
from trainer.tasks import arith_reward, digit_reward, get_task

TRACE = Path(__file__).resolve().parents[1] / "data" / "trl-1.16-lora-sync-wire-trace.jsonl"


def test_payload_matches_recorded_trl_request() -> None:
    recorded = next(
        json.loads(line)["body"]
        for line in TRACE.read_text().splitlines()
        if json.loads(line)["path"] == "/v1/completions"
    )
    ours = build_payload(
        recorded["model"], recorded["prompt"], max_tokens=recorded["max_tokens"],
        temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0, seed=recorded["seed"],
    )  # fmt: skip
    assert list(ours) == list(recorded)  # same keys, same order
    assert ours == recorded
    assert "min_p" in build_payload("m", [1], max_tokens=1, temperature=1.0, top_p=1.0,
                                    top_k=0, repetition_penalty=1.0, seed=1, min_p=0.1)  # fmt: skip


def test_admission_bounds_outstanding_groups() -> None:
    # P=2 groups per step, sync every k=1 step, S=1: at most (1 + 1) * 2 = 4 outstanding
    adm = Admission(prompts_per_step=2, sync_steps=1, max_staleness=1)
    adm.set_version(1)
    assert [adm.try_start() for _ in range(5)] == [1, 1, 1, 1, None]
    adm.retire()  # learner pulls one group of the current step
    assert adm.try_start() is None  # budget shrank with the pull: 4 - 1 = 3 outstanding ok
    adm.retire()
    adm.step_done()
    adm.set_version(2)  # sync: a whole new step of budget opens
    assert [adm.try_start() for _ in range(3)] == [2, 2, None]


def test_admission_with_sync_every_k_steps() -> None:
    adm = Admission(prompts_per_step=1, sync_steps=2, max_staleness=0)
    adm.set_version(1)
    # S=0: only the rest of the current version, k=2 steps -> 2 groups
    assert [adm.try_start() for _ in range(3)] == [1, 1, None]
    adm.retire()
    adm.step_done()  # one step into v1: 1 step left, 1 outstanding already
    assert adm.try_start() is None


def test_staleness_bound_holds_in_order() -> None:
    """Simulate in-order consumption: no admitted group is ever consumed too stale."""
    P, k, S = 3, 2, 1
    adm = Admission(P, k, S)
    version, queue, worst = 1, [], 0
    adm.set_version(version)
    for _ in range(40):  # 40 steps
        while (v := adm.try_start()) is not None:
            queue.append(v)
        for _ in range(P):
            worst = max(worst, version - queue.pop(0))
            adm.retire()
        adm.step_done()
        if adm.steps_in_version == k:
            version += 1
            adm.set_version(version)
    assert worst == S  # the bound is reached (full overlap) and never exceeded


def test_score_group_sums_and_handles_none() -> None:
    def half(completions: list[str], **_: object) -> list[float | None]:
        return [0.5 if c else None for c in completions]

    totals, per = score_group([digit_reward, half], ["12ab", ""], [None, None], [[], []], {})
    assert totals == pytest.approx([1.0, 0.0])
    assert per["rewards/digit_reward"] == pytest.approx(0.25)
    assert per["rewards/half"] == pytest.approx(0.5)
    totals, _ = score_group([half], [""], [None], [[]], {})
    assert math.isnan(totals[0])


def test_rewards_and_tasks() -> None:
    assert digit_reward(["a1 b2", "", "xyz", "123"]) == pytest.approx([0.5, 0.0, 0.0, 1.0])
    assert arith_reward(["it is 12", "12.0", "13", "none"], answer=["12"] * 4) == [1, 1, 0, 0]
    task = get_task("arith")
    first = [row for _, row in zip(range(3), task.rows(7), strict=False)]
    again = [row for _, row in zip(range(3), task.rows(7), strict=False)]
    assert first == again  # deterministic
    assert next(task.rows(7, start=2)) == first[2]  # the cursor resumes exactly
    with pytest.raises(ValueError):
        get_task("nope")


def test_reward_funcs_must_be_picklable() -> None:
    import pickle

    pickle.dumps(functools.partial(digit_reward))
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pickle.dumps(lambda completions, **_: [0.0])


def test_reduce_metric_follows_trl() -> None:
    assert reduce_metric("sample/dropped_stale_total", [1.0, 1.0, 8.0]) == 10.0
    assert reduce_metric("sample/staleness_max", [0.0, 2.0, 1.0]) == 2.0
    assert reduce_metric("completions/min_length", [3.0, 2.0]) == 2.0
    assert reduce_metric("reward", [0.0, 1.0]) == 0.5
    assert reduce_metric("rollout/generated_tok_s", [(10.0, 1.0), (30.0, 3.0)]) == 10.0
    sink = MetricSink()
    sink.update({"a_total": 1.0, "b": math.nan})
    sink.add("a_total", 2.0)
    assert sink.drain() == {"a_total": 3.0}
    assert sink.drain() == {}


def test_parse_prometheus() -> None:
    text = (
        "# HELP x\n"
        'gateway_routing_decisions_total{reason="affinity"} 12.0\n'
        'gateway_routing_decisions_total{reason="ring"} 3\n'
        "vllm:prefix_cache_hits_total 5\n"
    )
    m = parse_prometheus(text)
    assert m["gateway_routing_decisions_total"] == [({"reason": "affinity"}, 12.0),
                                                    ({"reason": "ring"}, 3.0)]  # fmt: skip
    assert m["vllm:prefix_cache_hits_total"] == [({}, 5.0)]


def test_config_file_and_flags(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("max_staleness: 3\nlearning_rate: 0.01\nlora_r: 1\n")
    cfg = parse_config(["--config", str(cfg_file), "--gateway", "http://127.0.0.1:9",
                        "--learning-rate", "0.02"])  # fmt: skip
    assert cfg.max_staleness == 3 and cfg.lora_r == 1
    assert cfg.learning_rate == 0.02  # flags beat the file
    assert cfg.vllm_server_base_url == "http://127.0.0.1:9"
    assert cfg.inflight_limit == 3 * cfg.per_device_train_batch_size  # TRL's auto value
    (tmp_path / "bad.json").write_text('{"nope": 1}')
    with pytest.raises(ValueError, match="unknown keys"):
        parse_config(["--config", str(tmp_path / "bad.json")])
    with pytest.raises(ValueError):
        TrainConfig(per_device_train_batch_size=10, num_generations=8)


def test_admission_tracks_groups_still_generating() -> None:
    adm = Admission(prompts_per_step=2, sync_steps=1, max_staleness=1)
    adm.set_version(3)
    assert adm.try_start() == 3 and adm.try_start() == 3
    adm.set_version(4)
    assert adm.try_start() == 4
    assert adm.generating_at_or_below(3) == 2 and adm.generating_at_or_below(4) == 3
    adm.generated(3)
    adm.generated(4)
    assert adm.generating_at_or_below(3) == 1 and adm.generating_at_or_below(9) == 1


def test_learner_waits_for_older_groups_before_younger_ones() -> None:
    import queue
    import threading
    import time

    from trainer.loop import _next_oldest
    from trainer.rollout import Group

    adm = Admission(prompts_per_step=1, sync_steps=1, max_staleness=1)
    adm.set_version(1)
    assert adm.try_start() == 1  # group 0 (v1) is generating, slowly
    adm.set_version(2)
    assert adm.try_start() == 2  # group 1 (v2) finishes first
    q: queue.Queue[Group] = queue.Queue()
    q.put(Group(1, 1, 2, [], 0.0, 0.0))
    adm.generated(2)

    def finish_old() -> None:
        time.sleep(0.3)
        q.put(Group(0, 0, 1, [], 0.0, 0.0))
        adm.generated(1)

    threading.Thread(target=finish_old).start()
    pending: list[Group] = []
    # learner at v2 with S=1: v1 groups are at risk, so it waits for group 0
    assert _next_oldest(q, pending, adm, at_risk=1).group_id == 0
    assert _next_oldest(q, pending, adm, at_risk=1).group_id == 1
