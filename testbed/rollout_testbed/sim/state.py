"""The simulated engine behind one sim app: adapters, pause gate, generation, faults, metrics.

``SimState`` lives on ``app.state.sim``; tests drive it directly (``sim.faults.load_not_found
= 2``) or over HTTP under ``/sim/...`` when the replica runs in a subprocess.

Engine semantics copied from vLLM 0.32 (``vllm/v1/engine/async_llm.py`` ``pause_generation``
and ``serve/dev/rlhf/api_router.py``):

* ``/pause?mode=keep`` freezes running requests between tokens; ``wait`` lets them finish;
  ``abort`` ends them with ``finish_reason="abort"``. In every mode new requests are accepted
  but wait (counted in ``vllm:num_requests_waiting``) until ``/resume``. ``clear_cache``
  (default true, ignored for ``keep``) empties the prefix cache.
* Unload only removes the name: requests already running on that adapter finish.
* Loading more adapters than ``max_loras`` never errors (vLLM evicts silently).
* The prefix cache is queried once per prompt when the request is admitted, so a request
  with ``n > 1`` counts its prompt once (vLLM queries once per child request; TRL uses n=1).

Fault counters mean "the next N calls"; -1 means "every call until cleared".
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field, fields
from http import HTTPStatus
from typing import Any, Literal

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge as PromGauge

from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.prefix_cache import BlockPrefixCache
from rollout_testbed.sim.protocol import SimError
from rollout_testbed.sim.tokenizer import SampledToken, sample

__all__ = ["Adapter", "Faults", "Generation", "PauseMode", "SimState", "SimStats"]

PauseMode = Literal["abort", "wait", "keep"]


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    path: str
    int_id: int


@dataclass(slots=True)
class Faults:
    """Scripted failures. Counts are "next N calls" (-1: always); see the module docstring."""

    load_not_found: int = 0  # 404 "No adapter found" (shared-filesystem mount lag)
    load_error: int = 0  # 500 with ``load_error_message``
    load_error_message: str = "Simulated engine failure while loading LoRA adapter"
    load_delay_s: float = 0.0  # added to every load
    load_hang: int = 0  # loads block until faults are cleared (then go on as usual)
    completion_error: int = 0  # completions/chat answer ``completion_error_status``
    completion_error_status: int = 500
    completion_error_delay_s: float = 0.0  # wait this long before answering the error
    completion_hang: int = 0  # completions/chat block until faults are cleared
    health_status: int = 200  # what GET /health answers
    pause_error: int = 0  # /pause answers 500 like vLLM's engine error (and does not pause)

    def update(self, values: dict[str, Any]) -> None:
        """Set the given fields; unknown names or wrong types raise ``ValueError``."""
        known = {f.name for f in fields(self)}
        for key, value in values.items():
            if key not in known:
                raise ValueError(f"unknown fault {key!r}; known: {sorted(known)}")
            current = getattr(self, key)
            ok = (
                isinstance(value, str)
                if isinstance(current, str)
                else isinstance(value, (int, float)) and not isinstance(value, bool)
            )
            if not ok or (isinstance(current, int) and not isinstance(value, int)):
                raise ValueError(f"fault {key!r} must be {type(current).__name__}")
            if key.endswith("_status") and not 200 <= value <= 599:
                raise ValueError(f"fault {key!r} must be an HTTP status (200-599)")
            setattr(self, key, type(current)(value))

    @staticmethod
    def take(count: int) -> tuple[bool, int]:
        """(fires?, remaining) for a "next N / -1 always" counter."""
        if count == 0:
            return False, 0
        return True, count if count < 0 else count - 1


@dataclass(slots=True)
class SimStats:
    """What the replica received; ``/sim/stats`` returns ``snapshot()``."""

    requests_by_model: Counter[str] = field(default_factory=Counter)
    loads: list[str] = field(default_factory=list)
    unloads: list[str] = field(default_factory=list)
    pauses: list[str] = field(default_factory=list)  # modes, in order
    resumes: int = 0

    def snapshot(self) -> dict[str, Any]:
        d = asdict(self)
        d["requests_by_model"] = dict(self.requests_by_model)
        return d


class _Metrics:
    """vLLM's metric names on a private registry (several sims share one test process)."""

    def __init__(self, state: SimState) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": state.config.model, "engine": "0"}
        names = list(labels)

        def counter(name: str, doc: str) -> Any:
            return PromCounter(name, doc, names, registry=self.registry).labels(**labels)

        self.queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.prompt = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.cached = counter("vllm:prompt_tokens_cached", "Prompt tokens served from cache.")
        self.generation = counter("vllm:generation_tokens", "Number of generated tokens.")
        success = PromCounter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=self.registry,
        )
        self.success: Callable[[str], Any] = lambda reason: success.labels(
            **labels, finished_reason=reason
        )

        def gauge(name: str, doc: str, fn: Callable[[], float]) -> None:
            PromGauge(name, doc, names, registry=self.registry).labels(**labels).set_function(fn)

        gauge(
            "vllm:num_requests_running",
            "Requests in model execution batches.",
            lambda: state.running,
        )
        gauge(
            "vllm:num_requests_waiting", "Requests waiting to be processed.", lambda: state.waiting
        )
        cap = max(1, state.config.cache_blocks)
        gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            lambda: len(state.cache) / cap,
        )


@dataclass(slots=True)
class Generation:
    """One admitted request: prompts, pre-sampled outputs, and its pacing via ``run()``."""

    state: SimState
    adapter: str | None
    prompts: list[list[int]]
    outputs: list[list[SampledToken]]  # len(prompts) * n, prompt-major
    n: int
    cache_key: str | None = None  # what the prefix cache keys blocks by (adapter, salt)
    cached: list[int] = field(default_factory=list)  # per prompt, set on admission
    produced: int = 0  # decode steps done (each sequence has min(produced, len) tokens)
    aborted: bool = False

    @property
    def steps(self) -> int:
        return max((len(o) for o in self.outputs), default=0)

    def finish_reason(self) -> str:
        return "abort" if self.aborted else "length"

    async def run(self) -> AsyncIterator[int]:
        """Wait for admission, query the prefix cache, then yield k = tokens available so far
        (1..steps), sleeping per the latency model. Stops early if aborted by ``/pause``."""
        st = self.state
        async with st.slot() as epoch:
            uncached = 0
            for ids in self.prompts:
                hit = st.cache.query(self.cache_key, ids)
                self.cached.append(hit)
                uncached += len(ids) - hit
                st.metrics.queries.inc(len(ids))
                st.metrics.hits.inc(hit)
                st.metrics.prompt.inc(len(ids))
                st.metrics.cached.inc(hit)
            prefill, _ = st.config.latency.delays(uncached, st.running)
            await asyncio.sleep(prefill)
            for k in range(1, self.steps + 1):
                _, decode = st.config.latency.delays(0, st.running)
                await asyncio.sleep(decode)
                await st.wait_unfrozen()
                if st.abort_epoch != epoch:
                    self.aborted = True
                    break
                self.produced = k
                yield k
            st.metrics.generation.inc(sum(min(self.produced, len(o)) for o in self.outputs))
            st.metrics.success("abort" if self.aborted else "length").inc(len(self.outputs))


def _probe_adapter(path: str) -> tuple[bool, int | None]:
    """(directory exists?, LoRA rank ``r`` from its adapter_config.json if readable)."""
    if not os.path.isdir(path):
        return False, None
    try:
        with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as fh:
            r = json.load(fh).get("r")
    except (OSError, ValueError, AttributeError):
        return True, None
    return True, r if isinstance(r, int) else None


class SimState:
    """Mutable engine state and fault control for one simulated replica."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.cache = BlockPrefixCache(config.block_size, config.cache_blocks)
        self.adapters: dict[str, Adapter] = {}
        self.faults = Faults()
        self.stats = SimStats()
        self.running = 0
        self.waiting = 0
        self.hanging = 0  # completions held by ``completion_hang``: a test's marker
        self.abort_epoch = 0
        self.paused = False
        self._next_lora_id = 1
        self._admit = asyncio.Event()
        self._unfrozen = asyncio.Event()
        self._admit.set()
        self._unfrozen.set()
        self._idle = asyncio.Condition()
        self._hang_release = asyncio.Event()
        self._lora_locks: dict[str, asyncio.Lock] = {}
        seqs = config.max_num_seqs
        self._seqs = None if seqs is None else asyncio.Semaphore(seqs)  # FIFO, as vLLM's FCFS
        self.metrics = _Metrics(self)

    # -- models and adapters -------------------------------------------------------------

    def resolve_model(self, name: str | None) -> str | None:
        """Adapter name for ``name`` (None = base model); unknown -> vLLM's 404."""
        if not name or name == self.config.model:
            return None
        if name in self.adapters:
            return name
        raise SimError(
            f"The model `{name}` does not exist.", HTTPStatus.NOT_FOUND, "NotFoundError", "model"
        )

    async def load_adapter(self, name: str, path: str, load_inplace: bool) -> str:
        """vLLM's ``OpenAIServingModels.load_lora_adapter``: checks, then the engine load."""
        self.stats.loads.append(name)
        async with self._lora_locks.setdefault(name, asyncio.Lock()):
            if not name or not path:
                raise SimError(
                    "Both 'lora_name' and 'lora_path' must be provided.",
                    err_type="InvalidUserInput",
                )
            if not load_inplace and name in self.adapters:
                raise SimError(
                    f"The lora adapter '{name}' has already been loaded. If you want to load "
                    "the adapter in place, set 'load_inplace' to True.",
                    err_type="InvalidUserInput",
                )
            f = self.faults
            if f.load_delay_s > 0:
                await asyncio.sleep(f.load_delay_s)
            fire, f.load_hang = Faults.take(f.load_hang)
            if fire:  # a fan-out held mid-way for as long as the test needs, not a guess
                await self._hang_release.wait()
                f = self.faults  # cleared: the load goes on under the faults set now
            exists, rank = True, None
            if self.config.check_lora_paths:
                exists, rank = await asyncio.to_thread(_probe_adapter, path)
            fire, f.load_not_found = Faults.take(f.load_not_found)
            if fire or not exists:
                # LoRAAdapterNotFoundError is a VLLMNotFoundError: 404, type NotFoundError.
                raise SimError(
                    f"Loading lora {name} failed: No adapter found for {path}",
                    HTTPStatus.NOT_FOUND,
                    "NotFoundError",
                )
            fire, f.load_error = Faults.take(f.load_error)
            if fire:
                raise SimError(
                    f.load_error_message, HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError"
                )
            if rank is not None and rank > self.config.max_lora_rank:
                raise SimError(
                    f"LoRA rank {rank} is greater than max_lora_rank {self.config.max_lora_rank}.",
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    "InternalServerError",
                )
            old = self.adapters.get(name)
            int_id = old.int_id if old else self._take_lora_id()
            self.adapters[name] = Adapter(name, path, int_id)
            return f"Success: LoRA adapter '{name}' added successfully."

    def _take_lora_id(self) -> int:
        self._next_lora_id += 1
        return self._next_lora_id - 1

    async def unload_adapter(self, name: str) -> str:
        self.stats.unloads.append(name)
        async with self._lora_locks.setdefault(name, asyncio.Lock()):
            if not name:
                raise SimError(
                    "'lora_name' needs to be provided to unload a LoRA adapter.",
                    err_type="InvalidUserInput",
                )
            if name not in self.adapters:
                raise SimError(
                    f"The lora adapter '{name}' cannot be found.",
                    HTTPStatus.NOT_FOUND,
                    "NotFoundError",
                )
            del self.adapters[name]
            return f"Success: LoRA adapter '{name}' removed successfully."

    # -- pause / resume ------------------------------------------------------------------

    async def pause(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        self.stats.pauses.append(mode)
        self.paused = True
        self._admit.clear()
        if mode == "keep":
            self._unfrozen.clear()
            return
        if mode == "abort":
            self.abort_epoch += 1
        self._unfrozen.set()  # requests frozen by an earlier keep-pause must drain or abort
        async with self._idle:
            await self._idle.wait_for(lambda: self.running == 0)
        if clear_cache:
            self.cache.reset()

    def resume(self) -> None:
        self.stats.resumes += 1
        self.paused = False
        self._unfrozen.set()
        self._admit.set()

    async def wait_unfrozen(self) -> None:
        while not self._unfrozen.is_set():
            await self._unfrozen.wait()

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[int]:
        """Hold a running slot; waits (as "waiting") while paused, and while
        ``max_num_seqs`` requests run (first come, first served). Yields the abort epoch."""
        self.waiting += 1
        try:
            while not self._admit.is_set():
                await self._admit.wait()
            if self._seqs is not None:
                await self._seqs.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield self.abort_epoch
        finally:
            self.running -= 1
            if self._seqs is not None:
                self._seqs.release()
            async with self._idle:
                self._idle.notify_all()

    # -- generation ----------------------------------------------------------------------

    async def apply_completion_faults(self) -> None:
        f = self.faults
        fire, f.completion_error = Faults.take(f.completion_error)
        if fire:
            status = f.completion_error_status
            if f.completion_error_delay_s > 0:  # "slow 429s": a struggling replica
                await asyncio.sleep(f.completion_error_delay_s)
            err_type = "InternalServerError" if status >= 500 else "BadRequestError"
            raise SimError(f"Simulated failure (HTTP {status})", status, err_type)
        fire, f.completion_hang = Faults.take(f.completion_hang)
        if fire:
            self.hanging += 1
            try:
                await self._hang_release.wait()
            finally:
                self.hanging -= 1

    def plan(
        self,
        adapter: str | None,
        prompts: list[list[int]],
        n: int,
        max_tokens: list[int],
        seed: int | None,
        num_top: int,
        cache_salt: str | None = None,
    ) -> Generation:
        model = adapter or self.config.model
        outputs = [
            sample(ids, model, i, seed, max_tokens[p], num_top)
            for p, ids in enumerate(prompts)
            for i in range(n)
        ]
        # vLLM puts the request's cache_salt into the first block's key, beside the LoRA
        key = adapter if cache_salt is None else f"{adapter or ''}\x00salt:{cache_salt}"
        return Generation(self, adapter, prompts, outputs, n, cache_key=key)

    # -- fault control -------------------------------------------------------------------

    def clear_faults(self) -> None:
        """Reset every fault and release what ``completion_hang`` and ``load_hang`` hold."""
        self.faults = Faults()
        self._hang_release.set()
        self._hang_release = asyncio.Event()

    def reset_prefix_cache(self) -> None:
        self.cache.reset()
