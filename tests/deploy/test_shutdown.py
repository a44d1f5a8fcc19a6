"""Graceful shutdown of the real `rollout-gateway serve` process: SIGTERM refuses new work
(503, /readyz 503: tests/test_probes.py), drains in-flight streams up to
--shutdown-timeout-s, stops listening, then exits 0 (what Kubernetes'
terminationGracePeriodSeconds and HF Jobs' cancellation expect)."""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from rollout_testbed.procs import free_port, wait_http

from tests.deploy._proc import base_env, process
from tests.eventually import eventually_sync


def _refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except OSError:
        return True


class Stream(threading.Thread):
    """One streamed completion in a thread; records chunks, whether [DONE] arrived."""

    def __init__(self, url: str, model: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.first = threading.Event()
        self.chunks = 0
        self.done = False
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": self.model, "prompt": "drain me", "max_tokens": self.max_tokens,
                "stream": True, "ignore_eos": True}  # fmt: skip
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=30) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.chunks += 1
                        self.first.set()
                        self.done |= line == "data: [DONE]"
        except httpx.HTTPError as exc:
            self.error = exc
        finally:
            self.first.set()


@contextlib.contextmanager
def gateway(replica: str, timeout_s: int, log: Path) -> Iterator[tuple[str, int, object]]:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway", "serve", "--replica", replica, "--port", str(port),
           "--shutdown-timeout-s", str(timeout_s), "--log-format", "json"]  # fmt: skip
    with process(cmd, env=base_env(), log=log) as proc:
        yield f"http://127.0.0.1:{port}", port, proc


def test_sigterm_drains_in_flight_then_exits_zero(tmp_path: Path) -> None:
    sim_port = free_port()
    sim_cmd = [sys.executable, "-m", "rollout_testbed", "sim-replica", "--port", str(sim_port),
               "--latency-model", "decode=0.05"]  # fmt: skip
    replica = f"http://127.0.0.1:{sim_port}"
    with (
        process(sim_cmd),
        gateway(replica, 8, tmp_path / "drain.log") as (url_a, port_a, proc_a),
        gateway(replica, 1, tmp_path / "cut.log") as (url_b, _, proc_b),
    ):
        t_start = time.monotonic()
        wait_http(replica + "/health", timeout=30)
        wait_http(url_a + "/v1/models", timeout=30)
        model = httpx.get(url_a + "/v1/models", timeout=5).json()["data"][0]["id"]
        wait_http(url_b + "/health", timeout=30)
        assert model
        t_up = time.monotonic()

        # A: a ~2 s stream is in flight when SIGTERM arrives; it completes.
        a = Stream(url_a, model, max_tokens=40)
        a.start()
        assert a.first.wait(10) and a.error is None
        t0 = time.monotonic()
        proc_a.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
        eventually_sync(lambda: _refused(port_a), "the listener closed once drained")
        assert proc_a.wait(15) == 0  # type: ignore[attr-defined]
        drained_s = time.monotonic() - t0
        a.join(5)
        assert a.done and a.error is None, (a.chunks, a.error)
        assert a.chunks >= 40

        # B: a ~10 s stream outlives --shutdown-timeout-s 1: cut, and still exit 0 promptly.
        b = Stream(url_b, model, max_tokens=200)
        b.start()
        assert b.first.wait(10) and b.error is None
        t0 = time.monotonic()
        proc_b.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
        assert proc_b.wait(10) == 0  # type: ignore[attr-defined]
        cut_s = time.monotonic() - t0
        b.join(5)
        assert not b.done
        assert cut_s < 5, cut_s
        print(f"startup {t_up - t_start:.1f}s; b joined {time.monotonic() - t0:.1f}s")
        print(f"drained a 2 s stream in {drained_s:.2f}s; cut a 10 s stream after {cut_s:.2f}s")
