"""The learner: pull version-tagged groups, drop the too-stale, step, sync every k steps.

Order of a run (TRL 1.16's ``on_train_begin`` then its step loop):

1. wait for ``/health``; check ``/server_info`` (DP=1, LoRA on, rank and ``max_loras``);
2. resume from a checkpoint if asked (adapter, optimizer, version, prompt cursor);
3. unload leftover ``<name>-v*`` adapters the server still lists;
4. cold sync: publish ``v(version+1)`` before any rollout exists;
5. start the rollout worker; then per step: pull ``P`` groups (dropping any whose
   staleness exceeds ``max_staleness``), one clipped-PG optimizer step, and every
   ``weight_sync_steps`` steps a sync; metrics to JSONL each step, checkpoints every
   ``save_steps``;
6. stop the worker, final checkpoint, plot, summary with the server's counters.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import TrainState, find_checkpoint, load_checkpoint, save_checkpoint
from trainer.client import ControlClient
from trainer.config import TrainConfig
from trainer.grpo import LossStats, clipped_pg_loss
from trainer.metrics import JsonlWriter, MetricSink
from trainer.policy import Policy
from trainer.report import first_last_mean, gateway_counters, plot_curves, summary_table
from trainer.rollout import Admission, Group, RolloutWorker
from trainer.sync import AdapterSync, SyncTiming, check_server
from trainer.tasks import get_task

__all__ = ["RunResult", "train"]

log = logging.getLogger("trainer")


@dataclass
class RunResult:
    steps: int
    first_version: int
    last_version: int
    reward_first10: float
    reward_last10: float
    staleness_mean: float
    staleness_max: int
    dropped_stale_total: int
    failed_groups: int
    http_errors: dict[str, int]
    sync_s: list[float]
    wall_s: float
    metrics_file: str
    plot_file: str | None
    server: dict[str, Any] = field(default_factory=dict)
    leftovers_unloaded: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _sync_metrics(t: SyncTiming) -> dict[str, float]:
    return {
        "perf/weight_sync_s": t.total_s,
        "perf/weight_sync_save_s": t.save_s,
        "perf/weight_sync_pause_s": t.pause_s,
        "perf/weight_sync_transfer_s": t.load_s,
        "perf/weight_sync_resume_s": t.resume_s,
    }


def _old_logprobs(
    groups: Sequence[tuple[list[int], list[float]]], shape: torch.Size
) -> torch.Tensor:
    old = torch.zeros(shape, dtype=torch.float32)
    for b, (prompt, lps) in enumerate(groups):
        start = len(prompt) - 1
        old[b, start : start + len(lps)] = torch.tensor(lps, dtype=torch.float32)
    return old


def train(
    cfg: TrainConfig,
    *,
    reward_funcs: Sequence[Callable[..., list[float | None]]] | None = None,
    stop: threading.Event | None = None,
) -> RunResult:
    """Run the driver to ``max_steps`` / ``max_duration_s``; returns the headline numbers."""
    t_wall = time.monotonic()
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper(), logging.WARNING),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")  # fmt: skip
    torch.set_num_threads(max(cfg.torch_threads, 1))
    random.seed(cfg.seed)
    out = Path(cfg.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    task = get_task(cfg.task)
    funcs = list(reward_funcs or task.reward_funcs)
    P, G, k, S = cfg.prompts_per_step, cfg.num_generations, cfg.weight_sync_steps, cfg.max_staleness

    policy = Policy(cfg.model, lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                    target_modules=cfg.lora_target_modules, seed=cfg.seed)  # fmt: skip
    optimizer = torch.optim.AdamW(
        policy.trainable_parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay
    )
    client = ControlClient(cfg.vllm_server_base_url, cfg.vllm_server_timeout)
    wire = JsonlWriter(out / "control-wire.jsonl", append=True)
    client.on_call = wire.write
    client.wait_for_server_ready()
    check_server(client.server_info(), lora_r=cfg.lora_r, max_staleness=S)

    state = TrainState()
    ckpt = find_checkpoint(out, cfg.resume_from_checkpoint)
    if ckpt is not None:
        state = load_checkpoint(ckpt, policy, optimizer)
        log.warning("resumed from %s: step %d, version %d, prompt %d", ckpt,
                    state.global_step, state.model_version, state.prompt_index)  # fmt: skip
    metrics_path = Path(cfg.metrics_file) if cfg.metrics_file else out / "metrics.jsonl"
    if ckpt is not None:
        _truncate_history(metrics_path, state.global_step)
    jsonl = JsonlWriter(metrics_path, append=ckpt is not None)

    sync = AdapterSync(client, policy, out / ".vllm_lora", cfg.lora_name, S,
                       version=state.model_version)  # fmt: skip
    leftovers = sync.cleanup_leftovers()
    sink = MetricSink()
    sync_s: list[float] = []
    first = sync.sync()  # the cold sync: v1 (or v(saved+1)) before any rollout
    sync_s.append(first.total_s)
    sink.update(_sync_metrics(first))
    first_version = sync.version

    admission = Admission(P, k, S)
    admission.set_version(sync.version)
    worker = RolloutWorker(
        base_url=cfg.vllm_server_base_url, lora_name=cfg.lora_name, tokenizer=policy.tokenizer,
        rows=task.rows(cfg.seed, start=state.prompt_index), reward_funcs=funcs,
        admission=admission, metrics=sink, num_generations=G,
        max_inflight_tasks=cfg.inflight_limit,
        queue_maxsize_groups=max(cfg.queue_maxsize // G, 1),
        max_tokens=cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
        top_k=cfg.top_k, min_p=cfg.min_p, repetition_penalty=cfg.repetition_penalty,
        request_timeout=cfg.request_timeout, seed=cfg.seed * 1_000_003 + state.global_step,
    )  # fmt: skip
    worker.start()

    done_indices: set[int] = set()
    pending: list[Group] = []  # drained from the queue, not yet pulled (oldest first)
    staleness_sum = 0.0
    staleness_n = 0
    staleness_max = 0
    dropped_total = 0
    last_saved = state.global_step
    t_prev = time.monotonic()
    t_run = time.monotonic()
    pbar: Any = None
    if cfg.progress:
        from tqdm import tqdm

        pbar = tqdm(total=cfg.max_steps or None, initial=state.global_step, unit="step",
                    dynamic_ncols=True, file=sys.stderr)  # fmt: skip

    def advance_cursor(index: int) -> None:
        done_indices.add(index)
        while state.prompt_index in done_indices:
            done_indices.discard(state.prompt_index)
            state.prompt_index += 1

    try:
        while True:
            elapsed = time.monotonic() - t_run
            if cfg.max_steps and state.global_step >= cfg.max_steps:
                break
            if cfg.max_duration_s and elapsed >= cfg.max_duration_s:
                break
            if stop is not None and stop.is_set():
                break
            # ---- pull P groups, dropping the too-stale (TRL's RolloutQueueDataset)
            t_wait = time.monotonic()
            groups: list[Group] = []
            while len(groups) < P:
                try:
                    g = _next_oldest(worker.queue, pending, admission, sync.version - S)
                except queue.Empty:
                    worker.check_health(cfg.heartbeat_stale_after_s)
                    for idx in worker.failed_indices():
                        advance_cursor(idx)
                    if stop is not None and stop.is_set():
                        break
                    continue
                admission.retire(pulled=True)
                staleness = sync.version - g.version
                if staleness > S:
                    dropped_total += len(g.samples)
                    sink.add("sample/dropped_stale_total", float(len(g.samples)))
                    advance_cursor(g.prompt_index)
                    continue
                sink.update(
                    {
                        "sample/staleness_mean": float(staleness),
                        "sample/staleness_max": float(staleness),
                        "sample/time_in_queue_s": time.time() - g.enqueued_at,
                        "sample/rollout_queue_size": float(worker.queue.qsize() + len(pending)),
                    }
                )
                staleness_sum += staleness * len(g.samples)
                staleness_n += len(g.samples)
                staleness_max = max(staleness_max, staleness)
                groups.append(g)
            if len(groups) < P:
                break
            wait_s = time.monotonic() - t_wait
            # ---- one optimizer step over the P*G samples (token mean over the step)
            t_fb = time.monotonic()
            samples = [s for g in groups for s in g.samples]
            n_tokens = float(sum(len(s.completion_ids) for s in samples))
            optimizer.zero_grad(set_to_none=True)
            sums = {"tokens": 0.0, "ratio": 0.0, "kl": 0.0, "low": 0.0, "high": 0.0,
                    "region": 0.0, "ref_kl": 0.0, "loss": 0.0}  # fmt: skip
            mb = max(cfg.micro_batch_size, 1)
            for i in range(0, len(samples), mb):
                chunk = samples[i : i + mb]
                ids, attn, mask = policy.batch([(s.prompt_ids, s.completion_ids) for s in chunk])
                old = _old_logprobs([(s.prompt_ids, s.old_logprobs) for s in chunk], mask.shape)
                adv = torch.tensor([s.advantage for s in chunk], dtype=torch.float32)
                ref = (policy.logprobs(ids, attn, cfg.temperature, reference=True)
                       if cfg.beta > 0 else None)  # fmt: skip
                logp = policy.logprobs(ids, attn, cfg.temperature)
                loss, st = clipped_pg_loss(
                    logp, old, adv, mask, epsilon_low=cfg.epsilon,
                    epsilon_high=cfg.epsilon_high_value, normalizer=max(n_tokens, 1.0),
                    ref_logp=ref, beta=cfg.beta,
                )  # fmt: skip
                loss.backward()
                _accumulate(sums, st, float(loss.detach()))
            grad_norm = float(
                torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), cfg.max_grad_norm)
            )
            optimizer.step()
            fwd_bwd_s = time.monotonic() - t_fb
            admission.step_done()
            state.global_step += 1
            state.trained_groups += len(groups)
            for g in groups:
                advance_cursor(g.prompt_index)
            # ---- weight sync every k steps
            if state.global_step % k == 0:
                timing = sync.sync()
                admission.set_version(sync.version)
                sync_s.append(timing.total_s)
                sink.update(_sync_metrics(timing))
            state.model_version = sync.version
            state.dropped_stale_total = dropped_total
            now = time.monotonic()
            step_s = now - t_prev
            t_prev = now
            tok = max(sums["tokens"], 1.0)
            rewards = [s.reward for s in samples if not math.isnan(s.reward)]
            record: dict[str, Any] = {
                "step": state.global_step,
                "model_version": sync.version,
                "elapsed_s": round(state.elapsed_s + (now - t_run), 3),
                "reward": sum(rewards) / len(rewards) if rewards else math.nan,
                "reward_std": sum(g.reward_std * len(g.samples) for g in groups) / len(samples),
                "loss": sums["loss"],
                "ratio": sums["ratio"] / tok,
                "kl": sums["kl"] / tok,
                "clip_ratio/low_mean": sums["low"] / tok,
                "clip_ratio/high_mean": sums["high"] / tok,
                "clip_ratio/region_mean": sums["region"] / tok,
                "grad_norm": grad_norm,
                "learning_rate": cfg.learning_rate,
                "perf/rollout_wait_s": wait_s,
                "perf/fwd_bwd_s": fwd_bwd_s,
                "perf/step_s": step_s,
                "perf/trained_tok_s_wall_clock": n_tokens / step_s if step_s > 0 else math.nan,
                "batch/trained_tokens_per_step": n_tokens,
                "batch/samples_per_step": float(len(samples)),
                "sample/dropped_stale_cumulative": float(dropped_total),
            }
            if cfg.beta > 0:
                record["kl_ref"] = sums["ref_kl"] / tok
            for name in groups[0].rewards_by_func:
                vals = [g.rewards_by_func[name] for g in groups
                        if not math.isnan(g.rewards_by_func.get(name, math.nan))]  # fmt: skip
                if vals:
                    record[name] = sum(vals) / len(vals)
            drained = sink.drain()
            drained.setdefault("sample/dropped_stale_total", 0.0)
            record.update(drained)
            gen = drained.get("rollout/generated_tokens_total", 0.0)
            record["rollout/generated_tok_s"] = gen / step_s if step_s > 0 else math.nan
            jsonl.write(record)
            if pbar is not None:
                pbar.update(1)
                pbar.set_postfix(v=sync.version, reward=f"{record['reward']:.3f}",
                                 stale=f"{record.get('sample/staleness_mean', 0):.2f}",
                                 tok_s=f"{record['rollout/generated_tok_s']:.0f}")  # fmt: skip
            if cfg.save_steps and state.global_step % cfg.save_steps == 0:
                state.elapsed_s += time.monotonic() - t_run
                t_run = time.monotonic()
                save_checkpoint(out, state, policy, optimizer, keep=cfg.save_total_limit)
                last_saved = state.global_step
    finally:
        if pbar is not None:
            pbar.close()
        worker.stop()
        jsonl.close()
    state.elapsed_s += time.monotonic() - t_run
    if state.global_step != last_saved:
        save_checkpoint(out, state, policy, optimizer, keep=cfg.save_total_limit)

    from trainer.report import read_jsonl

    rows = read_jsonl(metrics_path)
    plot_path = Path(cfg.plot_file) if cfg.plot_file else out / "curves.png"
    title = f"{cfg.task}: async LoRA GRPO via {cfg.vllm_server_base_url}"
    plotted = plot_curves(rows, plot_path, max_staleness=S, title=title)
    server = gateway_counters(client.metrics_text())
    wire.close()
    client.close()
    r_first, r_last = first_last_mean(rows)
    return RunResult(
        steps=state.global_step, first_version=first_version, last_version=sync.version,
        reward_first10=r_first, reward_last10=r_last,
        staleness_mean=staleness_sum / staleness_n if staleness_n else math.nan,
        staleness_max=staleness_max, dropped_stale_total=dropped_total,
        failed_groups=worker.failed_groups, http_errors=dict(worker.http_errors),
        sync_s=sync_s, wall_s=time.monotonic() - t_wall, metrics_file=str(metrics_path),
        plot_file=str(plotted) if plotted else None, server=server,
        leftovers_unloaded=leftovers,
    )  # fmt: skip


def _next_oldest(
    q: queue.Queue[Group],
    pending: list[Group],
    admission: Admission,
    at_risk: int,
    max_wait_s: float = 5.0,
) -> Group:
    """The oldest-version group available, waiting up to 1 s for one.

    Groups finish out of order (replicas and batches differ in speed). Taking the oldest
    first, and waiting (up to ``max_wait_s``) for groups tagged ``<= at_risk`` that are
    still generating before training a younger one, is the in-order consumption the
    admission bound assumes: those groups would otherwise age past the bound and be
    dropped after the next sync.
    """
    deadline = time.monotonic() + max_wait_s
    while True:
        while True:
            try:
                pending.append(q.get_nowait())
            except queue.Empty:
                break
        if not pending:
            pending.append(q.get(timeout=1.0))
            continue
        oldest = min(g.version for g in pending)
        if (
            oldest <= at_risk
            or time.monotonic() >= deadline
            or not admission.generating_at_or_below(min(oldest - 1, at_risk))
        ):
            break
        with contextlib.suppress(queue.Empty):
            pending.append(q.get(timeout=0.05))
    best = min(range(len(pending)), key=lambda i: (pending[i].version, pending[i].group_id))
    return pending.pop(best)


def _truncate_history(path: Path, last_step: int) -> None:
    """Keep the JSONL history up to the checkpoint: steps a killed run logged after its
    last checkpoint are redone by the resumed run (TRL truncates its log history too)."""
    if not path.exists():
        return
    import json

    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= last_step]  # fmt: skip
    path.write_text("".join(line + "\n" for line in keep))


def _accumulate(sums: dict[str, float], st: LossStats, loss: float) -> None:
    sums["tokens"] += st.tokens
    sums["ratio"] += st.ratio_sum
    sums["kl"] += st.kl_sum
    sums["low"] += st.low_clip_sum
    sums["high"] += st.high_clip_sum
    sums["region"] += st.region_clip_sum
    sums["ref_kl"] += st.ref_kl_sum
    sums["loss"] += loss


def render_summary(result: RunResult) -> str:
    sync = sorted(result.sync_s) or [math.nan]
    rows: list[tuple[str, Any]] = [
        ("steps", result.steps),
        ("adapter versions", f"v{result.first_version} .. v{result.last_version}"),
        ("reward, first 10 steps", result.reward_first10),
        ("reward, last 10 steps", result.reward_last10),
        ("staleness mean / max", f"{result.staleness_mean:.3f} / {result.staleness_max}"),
        ("dropped stale samples", result.dropped_stale_total),
        ("failed rollout groups", result.failed_groups),
        ("rollout HTTP errors", result.http_errors or 0),
        ("weight sync s (p50 / max)", f"{sync[len(sync) // 2]:.3f} / {sync[-1]:.3f}"),
        ("wall time s", result.wall_s),
        ("metrics", result.metrics_file),
        ("plot", result.plot_file or "(no matplotlib in this python)"),
    ]
    if result.leftovers_unloaded:
        rows.append(("leftover adapters unloaded", ", ".join(result.leftovers_unloaded)))
    rows += [(f"server: {k}", v) for k, v in result.server.items()]
    return summary_table(rows)
