"""Execute the adapter core's actions against replicas, concurrently; feed outcomes back.

The thin async shell around ``state.AdapterRegistry``:

* ``perform(action)`` sends one ``/v1/load_lora_adapter`` or ``/v1/unload_lora_adapter``
  through the upstream module and classifies the answer **by status code** (200 ok,
  404 not found, other 4xx rejected, 5xx failed; no HTTP answer: unreachable or timed
  out, both *lost* in ``gateway.fleet.quorum``'s sense). The
  message body is kept only as detail for error messages and logs.
* ``Executor.submit(actions)`` runs each action in its own task: it sleeps until the
  action's ``not_before`` (mount-lag backoff decided by the core), skips it if the core
  cancelled it meanwhile, performs it, and feeds the result back, submitting whatever
  follow-up actions the core returns. So per-replica retries, deadlines and rollbacks are
  all decided in the core; this file only waits and sends.
* Waiters (``wait_until``) are woken after every state change; they re-check a predicate
  on the core, so there is no per-transaction bookkeeping here.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson

from gateway.adapters.state import (
    Action,
    AdapterRegistry,
    LoadOnReplica,
    Outcome,
    Result,
)
from gateway.errors import GatewayError, UpstreamTimeout

__all__ = ["Executor", "ReplicaCaller", "ResponseLike", "classify", "perform"]

log = logging.getLogger("gateway.adapters")

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
_DETAIL_LIMIT = 300


class ResponseLike(Protocol):
    @property
    def status(self) -> int: ...
    @property
    def content(self) -> bytes: ...


class ReplicaCaller(Protocol):
    """The part of ``gateway.http.upstream.Upstream`` this package uses."""

    async def call(
        self,
        replica: int,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        query: str = "",
        timeout: float | None = None,
    ) -> ResponseLike: ...


def classify(status: int) -> Outcome:
    if status == 200:
        return Outcome.OK
    if status == 404:
        return Outcome.NOT_FOUND
    if 400 <= status < 500:
        return Outcome.REJECTED
    return Outcome.FAILED


def detail(content: bytes) -> str:
    """The message of a vLLM error body (either envelope) or its text, truncated."""
    text = content.decode("utf-8", "replace")
    try:
        data: Any = orjson.loads(content)
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        inner = data.get("error", data)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            text = inner["message"]
    return text[:_DETAIL_LIMIT]


async def perform(upstream: ReplicaCaller, action: Action, timeout: float) -> Result:
    if isinstance(action, LoadOnReplica):
        path = LOAD_PATH
        payload: dict[str, Any] = {
            "lora_name": action.name,
            "lora_path": action.path,
            "load_inplace": action.inplace,
        }
    else:
        path = UNLOAD_PATH
        payload = {"lora_name": action.name}
    try:
        response = await upstream.call(
            action.replica, "POST", path, body=orjson.dumps(payload), timeout=timeout
        )
    except UpstreamTimeout:  # hung: lost, like an unreachable replica (gateway.fleet.quorum)
        return Result(Outcome.TIMED_OUT, None, f"no answer within {timeout:g}s")
    except GatewayError as exc:  # refused, reset before or during the response
        return Result(Outcome.UNREACHABLE, None, exc.message)
    return Result(classify(response.status), response.status, detail(response.content))


class Executor:
    """Runs actions as tasks and feeds their results into the registry."""

    def __init__(
        self,
        registry: AdapterRegistry,
        perform: Callable[[Action], Awaitable[Result]],
        *,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_result: Callable[[Action, Result], None] | None = None,
    ) -> None:
        self._core = registry
        self._perform = perform
        self._clock = clock
        self._sleep = sleep
        self._on_result = on_result
        self._tasks: set[asyncio.Task[None]] = set()
        self._sending: Counter[int] = Counter()  # requests on the wire, per replica
        self._changed = asyncio.Event()

    def submit(self, actions: list[Action]) -> None:
        for action in actions:
            task = asyncio.get_running_loop().create_task(
                self._run(action), name=f"adapter-{type(action).__name__}-{action.op}"
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self.notify()

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._changed.wait()

    def sending_to(self, replica: int) -> bool:
        """Requests already on the wire to ``replica`` (even ones the core disowned)."""
        return self._sending[replica] > 0

    async def _run(self, action: Action) -> None:
        if isinstance(action, LoadOnReplica):
            delay = action.not_before - self._clock()
            if delay > 0:
                await self._sleep(delay)
        if not self._core.is_current(action):
            return
        self._sending[action.replica] += 1
        try:
            result = await self._perform(action)
        except Exception as exc:  # a bug in the shell must not wedge a transaction
            log.exception("adapter action %s failed unexpectedly", action)
            result = Result(Outcome.FAILED, None, type(exc).__name__)
        finally:
            self._sending[action.replica] -= 1
        follow = self._core.on_result(action, result, self._clock())
        if self._on_result is not None:
            self._on_result(action, result)
        self.submit(follow)

    async def aclose(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
