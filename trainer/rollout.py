"""Asynchronous rollout worker: asyncio + aiohttp in a background thread, rewards in a
separate process, version-tagged groups into a bounded queue.

Why a thread and not TRL's spawned child process: the requests are pure I/O, so one event
loop in a thread keeps the GIL mostly free for the learner, and it shares the policy
version and the admission counters without IPC. Rewards, which may be arbitrary user code
(CPU-heavy, or crashing), run in a spawned process pool, as in TRL.

Per prompt the worker sends ``num_generations`` *separate* ``n=1`` requests back to back
with TRL 1.16's exact payload (``_generate_one_turn``) and retry policy, all naming the
adapter of the version the group was admitted under (``<lora_name>-v<N>``), so the
group's version tag is exactly the policy that produced it.

Admission (AReaL/SkyRL style): a group is started only if it could still be trained within
the staleness bound when consumed in order — see :class:`Admission`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing
import pickle
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from trainer.grpo import group_advantages
from trainer.metrics import MetricSink
from trainer.payload import build_payload
from trainer.scoring import ping, score_group

__all__ = ["Admission", "Group", "RolloutWorker", "Sample", "build_payload"]

log = logging.getLogger("trainer.rollout")

_RETRYABLE = (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, ConnectionResetError)


@dataclass(slots=True)
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]
    advantage: float
    reward: float
    completion: str


@dataclass(slots=True)
class Group:
    group_id: int
    prompt_index: int
    version: int
    samples: list[Sample]
    reward_mean: float
    reward_std: float
    rewards_by_func: dict[str, float] = field(default_factory=dict)
    enqueued_at: float = 0.0


class Admission:
    """How many groups may be in flight without breaking the staleness bound.

    The learner consumes ``P`` groups per step and publishes a new version every ``k``
    steps. While the learner is at version ``V``, ``j`` steps into it, with ``c`` groups of
    the current step already pulled, the groups it will still consume before its version
    exceeds ``V + S`` number ``((k - j) + S*k) * P - c``. A new group (tagged ``V``) is
    admitted only if the groups already outstanding (started, not yet pulled) plus it fit
    in that budget: then, consumed in order, its staleness is at most ``S``. Out-of-order
    completion can still produce a rare stale group; the learner drops and counts it.
    """

    def __init__(self, prompts_per_step: int, sync_steps: int, max_staleness: int):
        self.P, self.k, self.S = prompts_per_step, sync_steps, max_staleness
        self._lock = threading.Lock()
        self.version = 0
        self.steps_in_version = 0
        self.groups_in_step = 0
        self.started = 0
        self.retired = 0  # pulled by the learner (trained or dropped) or failed
        self._generating: dict[int, int] = {}  # version -> groups started, not yet queued

    def budget(self) -> int:
        with self._lock:
            steps_left = (self.k - self.steps_in_version) + self.S * self.k
            return steps_left * self.P - self.groups_in_step

    def outstanding(self) -> int:
        with self._lock:
            return self.started - self.retired

    def try_start(self) -> int | None:
        """Reserve a slot; returns the version to tag the group with, or None."""
        with self._lock:
            steps_left = (self.k - self.steps_in_version) + self.S * self.k
            budget = steps_left * self.P - self.groups_in_step
            if self.started - self.retired + 1 > budget:
                return None
            self.started += 1
            self._generating[self.version] = self._generating.get(self.version, 0) + 1
            return self.version

    def generated(self, version: int) -> None:
        """A group of ``version`` left generation (queued, or failed)."""
        with self._lock:
            left = self._generating.get(version, 0) - 1
            if left > 0:
                self._generating[version] = left
            else:
                self._generating.pop(version, None)

    def generating_at_or_below(self, version: int) -> int:
        """Groups tagged ``<= version`` still generating: the learner waits for these
        before it trains younger ones, so they are not pushed past the bound."""
        with self._lock:
            return sum(n for v, n in self._generating.items() if v <= version)

    def retire(self, pulled: bool = True) -> None:
        with self._lock:
            self.retired += 1
            if pulled:
                self.groups_in_step += 1

    def step_done(self) -> None:
        with self._lock:
            self.steps_in_version += 1
            self.groups_in_step = 0

    def set_version(self, version: int) -> None:
        with self._lock:
            self.version = version
            self.steps_in_version = 0


class RolloutWorker:
    """Produces scored, version-tagged :class:`Group` objects into ``self.queue``."""

    def __init__(
        self,
        *,
        base_url: str,
        lora_name: str,
        tokenizer: Any,
        rows: Iterator[dict[str, Any]],
        reward_funcs: Sequence[Callable[..., list[float | None]]],
        admission: Admission,
        metrics: MetricSink,
        num_generations: int,
        max_inflight_tasks: int,
        queue_maxsize_groups: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        min_p: float | None,
        repetition_penalty: float,
        request_timeout: float,
        seed: int,
        first_group_id: int = 0,
    ):
        try:
            pickle.dumps(list(reward_funcs))
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise TypeError(
                "reward functions run in a worker process and must be picklable: use "
                "module-level functions, functools.partial or callable instances"
            ) from exc
        self.base_url = base_url.rstrip("/")
        self.lora_name = lora_name
        self.tokenizer = tokenizer
        self.rows = rows
        self.reward_funcs = list(reward_funcs)
        self.admission = admission
        self.metrics = metrics
        self.G = num_generations
        self.max_inflight = max_inflight_tasks
        self.queue: queue.Queue[Group] = queue.Queue(maxsize=max(queue_maxsize_groups, 1))
        self.sampling = {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "repetition_penalty": repetition_penalty,
            "min_p": min_p,
        }
        self.request_timeout = request_timeout
        self._rng = random.Random(seed)
        self._next_group = first_group_id
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self.heartbeat = time.time()
        self.error: BaseException | None = None
        self.failed_groups = 0
        self.http_errors: dict[str, int] = {}
        self._failed_idx: list[int] = []
        self._failed_lock = threading.Lock()

    def failed_indices(self) -> list[int]:
        """Prompt indices of groups that failed for good since the last call."""
        with self._failed_lock:
            out, self._failed_idx = self._failed_idx, []
        return out

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._pool = concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx)
        # Fail fast (and pay the spawn cost now, not inside the first group).
        self._pool.submit(ping).result(timeout=120)
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="rollout-worker", daemon=True
        )
        self._thread.start()
        ready.wait(timeout=30)

    def stop(self, timeout: float = 30.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def check_health(self, stale_after_s: float) -> None:
        if self.error is not None:
            raise RuntimeError("rollout worker failed") from self.error
        age = time.time() - self.heartbeat
        if age > stale_after_s:
            raise RuntimeError(f"rollout worker heartbeat stale: {age:.0f} s > {stale_after_s} s")

    # ------------------------------------------------------------------ event loop

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        self._stop = asyncio.Event()
        ready.set()
        try:
            loop.run_until_complete(self._main())
        except BaseException as exc:  # surfaced to the learner by check_health
            self.error = exc
            log.exception("rollout worker failed")
        finally:
            loop.close()

    async def _main(self) -> None:
        assert self._stop is not None
        connector = aiohttp.TCPConnector(limit=self.max_inflight)
        sem = asyncio.Semaphore(self.max_inflight)
        tasks: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession(connector=connector) as session:
            try:
                while not self._stop.is_set():
                    self.heartbeat = time.time()
                    version = self.admission.try_start()
                    if version is None:
                        await self._sleep(0.01)
                        continue
                    row = next(self.rows)
                    group_id = self._next_group
                    self._next_group += 1
                    task = asyncio.create_task(self._group(session, sem, row, group_id, version))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    await asyncio.sleep(0)
            finally:
                for task in list(tasks):
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _sleep(self, seconds: float) -> None:
        assert self._stop is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)

    def _prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids

    async def _group(
        self,
        session: aiohttp.ClientSession,
        sem: asyncio.Semaphore,
        row: dict[str, Any],
        group_id: int,
        version: int,
    ) -> None:
        try:
            group = await self._produce(session, sem, row, group_id, version)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # retries exhausted, or a reward function raised
            self.failed_groups += 1
            with self._failed_lock:
                self._failed_idx.append(int(row.get("index", group_id)))
            self.admission.generated(version)
            self.admission.retire(pulled=False)
            self.metrics.add("rollout/failed_total", 1.0)
            log.warning("group %d failed: %s", group_id, exc)
            return
        t_blocked: float | None = None
        assert self._stop is not None
        while not self._stop.is_set():
            try:
                group.enqueued_at = time.time()
                self.queue.put_nowait(group)
                break
            except queue.Full:
                if t_blocked is None:
                    t_blocked = time.monotonic()
                await self._sleep(0.05)
        self.admission.generated(version)
        if t_blocked is not None:
            self.metrics.add("rollout/backpressure_s", time.monotonic() - t_blocked)

    async def _produce(
        self,
        session: aiohttp.ClientSession,
        sem: asyncio.Semaphore,
        row: dict[str, Any],
        group_id: int,
        version: int,
    ) -> Group:
        """Generate the G samples of one prompt, score them, normalize advantages."""
        t0 = time.monotonic()
        prompt_ids = self._prompt_ids(row["prompt"])
        model = f"{self.lora_name}-v{version}"
        outs = await asyncio.gather(
            *[self._generate(session, sem, model, prompt_ids) for _ in range(self.G)]
        )
        completion_ids = [o[0] for o in outs]
        completions = [
            self.tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids
        ]
        columns = {
            k: [v] * self.G for k, v in row.items() if k not in ("prompt", "completion", "index")
        }
        loop = asyncio.get_running_loop()
        t_score = time.monotonic()
        assert self._pool is not None
        rewards, per_func = await loop.run_in_executor(
            self._pool,
            score_group,
            self.reward_funcs,
            completions,
            [row["prompt"]] * self.G,
            completion_ids,
            columns,
        )
        score_s = time.monotonic() - t_score
        adv, mean, std = group_advantages(rewards)
        samples = [
            Sample(prompt_ids, o[0], o[1], a, r, c)
            for o, a, r, c in zip(outs, adv, rewards, completions, strict=True)
        ]
        n_tokens = sum(len(o[0]) for o in outs)
        prompt_tokens = sum(o[2] for o in outs)
        cached = sum(o[3] for o in outs)
        group = Group(group_id, int(row.get("index", group_id)), version, samples, mean, std,
                      per_func)  # fmt: skip
        self.metrics.update(
            {
                "rollout/score_s": score_s,
                "rollout/duration_s": time.monotonic() - t0,
                "completions/mean_length": (float(n_tokens), float(self.G)),
                "completions/max_length": float(max(len(o[0]) for o in outs)),
                "completions/min_length": float(min(len(o[0]) for o in outs)),
                "rollout/generated_tokens_total": float(n_tokens),
                "rollout/prompt_tokens_total": float(prompt_tokens),
                "rollout/cached_prompt_tokens_total": float(cached),
                "rollout/prefix_cache_hit_rate": (float(cached), float(max(prompt_tokens, 1))),
                "rollout/inflight": float(self.admission.outstanding()),
            }
        )
        return group

    async def _generate(
        self,
        session: aiohttp.ClientSession,
        sem: asyncio.Semaphore,
        model: str,
        prompt_ids: list[int],
    ) -> tuple[list[int], list[float], int, int]:
        """One ``n=1`` completion: (token ids, logprobs, prompt tokens, cached tokens)."""
        payload = build_payload(model, prompt_ids, seed=self._rng.getrandbits(63),
                                **self.sampling)  # fmt: skip
        async with sem:
            out = await self._retry(lambda: self._post(session, payload), max_attempts=30)
        choice = out["choices"][0]
        usage = out.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return (
            list(choice["token_ids"]),
            [float(x) for x in choice["logprobs"]["token_logprobs"]],
            int(usage.get("prompt_tokens") or len(prompt_ids)),
            int(details.get("cached_tokens") or 0),
        )

    async def _post(self, session: aiohttp.ClientSession, payload: dict[str, Any]) -> Any:
        timeout = aiohttp.ClientTimeout(total=self.request_timeout)

        async def once() -> Any:
            async with session.post(
                f"{self.base_url}/v1/completions", json=payload, timeout=timeout
            ) as resp:
                if resp.status >= 400:
                    key = str(resp.status)
                    self.http_errors[key] = self.http_errors.get(key, 0) + 1
                    self.metrics.add("rollout/http_error_total", 1.0)
                resp.raise_for_status()
                return await resp.json()

        return await self._retry(once, max_attempts=3)

    async def _retry(self, factory: Callable[[], Any], *, max_attempts: int) -> Any:
        """TRL's backoff: 1, 2, 4, 8, 16, 16... s; the identical payload every time."""
        for attempt in range(max_attempts):
            try:
                return await factory()
            except _RETRYABLE as exc:
                if attempt >= max_attempts - 1:
                    raise
                self.metrics.add("rollout/vllm_retry_total", 1.0)
                log.warning("rollout request failed (%s); retry %d", exc, attempt + 1)
                await self._sleep(min(2 ** min(attempt, 4), 16))
        raise AssertionError("unreachable")
