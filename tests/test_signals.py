"""Signals to the real CLI (``rollout-gateway serve``, real processes, sim replicas), in
every mode: SIGHUP reloads what the mode can reload, or says it has nothing to, and the
gateway serves on; SIGUSR1 and SIGUSR2 are logged and ignored; SIGTERM still drains and
exits 0 afterwards. Before, SIGHUP ended a single-run gateway (exit 129, no line), and in
``serve --workers N`` it ended the owner, which the supervisor then restarted
(``docs/operations.md``, "Signals").
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from rollout_testbed.procs import Proc, free_port

from gateway.app import Reloads
from gateway.fleet.discovery import Discovery
from tests.cluster import cluster
from tests.deploy._proc import REPO, VENV_BIN, base_env, sim_replica
from tests.eventually import eventually, eventually_sync

ADMIN = "admin-key-signals"
COMPLETION = {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 2}
RUN = ("run-a", "key-run-a")


@pytest.fixture(scope="module")
def sims() -> Iterator[tuple[str, str]]:
    """Two sim replica processes, shared by the module's gateways."""
    with sim_replica() as a, sim_replica() as b:
        yield a, b


@contextlib.contextmanager
def gateway(tmp_path: Path, *args: str) -> Iterator[Proc]:
    """``rollout-gateway serve ARGS`` in its own session, once ``/health`` is 200; on
    exit, SIGTERM must end it with 0 (the SIGHUPs before changed nothing of that)."""
    port = free_port()
    argv = [str(VENV_BIN / "rollout-gateway"), "serve", "--port", str(port),
            "--health-interval-s", "0.5", *args]  # fmt: skip
    proc = Proc("gateway", argv, tmp_path / "gateway.log", env=base_env(), cwd=REPO,
                url=f"http://127.0.0.1:{port}")  # fmt: skip
    proc.start()
    try:
        proc.wait_http("/health", timeout=60)
        yield proc
    finally:
        code = proc.stop(grace=30)
    assert code == 0, f"exit {code}:\n{proc.log_tail()}"


def multi_run_config(tmp_path: Path, replica: str, runs: list[str]) -> Path:
    config = tmp_path / "gateway.yaml"
    specs = []
    for name in runs:
        (tmp_path / name).mkdir(exist_ok=True)
        specs.append({"name": name, "key": f"key-{name}", "adapter_root": str(tmp_path / name),
                      "max_staleness": 1})  # fmt: skip
    tmp = config.with_name("gateway.yaml.tmp")
    tmp.write_text(yaml.safe_dump({"replicas": [replica], "runs": specs, "admin_key": ADMIN}))
    os.replace(tmp, config)
    return config


def count(proc: Proc, text: str) -> int:
    return proc.output().count(text)


def logged(proc: Proc, text: str, n: int, *, at_least: bool = False) -> None:
    """Wait until ``text`` is in the log ``n`` times (or more); fail at once if the
    gateway exited instead."""

    def seen() -> bool:
        found = count(proc, text)
        return not proc.alive or (found >= n if at_least else found == n)

    eventually_sync(seen, f"{text!r} {n} times in the log")
    assert proc.alive, f"the gateway exited with {proc.returncode}:\n{proc.log_tail()}"
    assert count(proc, text) >= n if at_least else count(proc, text) == n


def hangup(proc: Proc, line: str, times: int = 3) -> None:
    """SIGHUP to the gateway's main process, ``times`` times, each once the one before
    was answered by ``line`` (signals sent together may merge into one)."""
    before = count(proc, line)
    for n in range(1, times + 1):
        os.kill(proc.pid, signal.SIGHUP)
        logged(proc, line, before + n)


def serves(proc: Proc, auth: tuple[str, str] | None = None) -> None:
    with httpx.Client(base_url=proc.url, timeout=30, auth=auth) as client:
        assert client.get("/health").status_code == 200
        r = client.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 200, r.text


def status(proc: Proc) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=proc.url, timeout=30, headers=headers) as client:
        r = client.get("/gateway/status")
        assert r.status_code == 200, r.text
        found: dict[str, Any] = r.json()
        return found


NOTHING = "SIGHUP: nothing to reload in this mode"
RUNS_UNCHANGED = "SIGHUP: run set re-read from the config file: unchanged"
PASSED = "SIGHUP: passed to the owner (pid "


@pytest.mark.parametrize("mode", ["plain", "config", "replicas-file", "multi-run"])
def test_sighup_in_one_process_reloads_or_says_why_not_and_serves_on(
    tmp_path: Path, sims: tuple[str, str], mode: str
) -> None:
    a = sims[0]
    auth: tuple[str, str] | None = None
    if mode == "plain":
        args, line = ["--replica", a], NOTHING
    elif mode == "config":  # single-run mode with a config file: read at start only
        config = tmp_path / "gateway.yaml"
        config.write_text(yaml.safe_dump({"replicas": [a], "max_staleness": 2}))
        args, line = ["--config", str(config)], NOTHING
    elif mode == "replicas-file":
        listing = tmp_path / "replicas.txt"
        listing.write_text(f"{a}\n")
        args = ["--replicas-file", str(listing), "--discovery-interval-s", "3600"]
        line = f"SIGHUP: re-read replicas file {listing}: 1 replicas in the pool, 1 healthy"
    else:
        args = ["--config", str(multi_run_config(tmp_path, a, [RUN[0]]))]
        line, auth = RUNS_UNCHANGED, RUN
    with gateway(tmp_path, *args) as gw:
        hangup(gw, line)
        gw.signal(signal.SIGHUP)  # the whole process group, as a closed terminal does
        logged(gw, line, 4)
        serves(gw, auth)
    assert "Traceback" not in gw.output()


@pytest.mark.parametrize("mode", ["single-run", "multi-run"])
def test_sighup_with_workers_reaches_the_owner_and_ends_no_process(
    tmp_path: Path, sims: tuple[str, str], mode: str
) -> None:
    a = sims[0]
    if mode == "single-run":
        args, line, auth = ["--replica", a], NOTHING, None
    else:
        config = multi_run_config(tmp_path, a, [RUN[0]])
        args, line, auth = ["--config", str(config)], RUNS_UNCHANGED, RUN
    with gateway(tmp_path, "--workers", "2", *args) as gw:
        before = status(gw)
        hangup(gw, line)
        assert count(gw, PASSED) == 3
        # A worker signalled alone says where SIGHUP goes, and lives on.
        worker = before["workers"][0]["pid"]
        os.kill(worker, signal.SIGHUP)
        logged(gw, f"(pid {worker}) ignored: send it to the supervisor (pid {gw.pid})", 1)
        # The whole group (a closed terminal): every process survives it.
        gw.signal(signal.SIGHUP)
        logged(gw, "SIGHUP to data-plane worker", 3)
        logged(gw, line, 4, at_least=True)  # the owner's: signals to it may merge
        serves(gw, auth)
        after = status(gw)
        assert after["owner_pid"] == before["owner_pid"]  # never restarted
        assert [w["pid"] for w in after["workers"]] == [w["pid"] for w in before["workers"]]
    assert "exited with" not in gw.output() and "Traceback" not in gw.output()


def test_sighup_applies_a_changed_replicas_file(tmp_path: Path, sims: tuple[str, str]) -> None:
    a, b = sims
    listing = tmp_path / "replicas.txt"
    listing.write_text(f"{a}\n")
    args = ["--replicas-file", str(listing), "--discovery-interval-s", "3600"]
    with gateway(tmp_path, *args) as gw:
        listing.write_text(f"{a}\n{b}\n")
        hangup(gw, f"re-read replicas file {listing}: 2 replicas in the pool, 2 healthy", 1)
        assert {r["address"] for r in status(gw)["replicas"]} == {a, b}
        serves(gw)


def test_sighup_applies_a_changed_run_set(tmp_path: Path, sims: tuple[str, str]) -> None:
    config = multi_run_config(tmp_path, sims[0], ["run-a"])
    with gateway(tmp_path, "--config", str(config)) as gw:
        multi_run_config(tmp_path, sims[0], ["run-a", "run-b"])
        hangup(gw, "run set re-read from the config file: applied (added ['run-b']); 2 runs", 1)
        serves(gw, ("run-b", "key-run-b"))


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sigusr1_and_sigusr2_are_logged_and_ignored(
    tmp_path: Path, sims: tuple[str, str], workers: str
) -> None:
    with gateway(tmp_path, "--workers", workers, "--replica", sims[0]) as gw:
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            os.kill(gw.pid, sig)
            logged(gw, f"{sig.name} ignored", 1)
        serves(gw)


def test_sighup_while_draining_ends_nothing(tmp_path: Path) -> None:
    """SIGTERM, then SIGHUP during the drain: the stream in flight still completes and
    the gateway still exits 0."""
    first, lines = threading.Event(), []

    def stream(url: str) -> None:
        body = {"model": "tiny-base", "prompt": "drain me", "max_tokens": 40, "stream": True,
                "ignore_eos": True}  # fmt: skip
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        first.set()
        finally:
            first.set()

    with sim_replica("--latency-model", "decode=0.05") as slow:
        with gateway(tmp_path, "--replica", slow, "--shutdown-timeout-s", "30") as gw:
            reader = threading.Thread(target=stream, args=(gw.url,), daemon=True)
            reader.start()
            assert first.wait(30) and lines, "the stream's first chunk"
            # The replica freezes the stream between tokens until the SIGHUPs are answered,
            # so the drain outlasts them however slow the machine (a marker, not a duration).
            assert httpx.post(slow + "/pause", params={"mode": "keep"}, timeout=30).is_success
            os.kill(gw.pid, signal.SIGTERM)
            hangup(gw, "SIGHUP", 2)  # during the drain
            assert reader.is_alive(), "the stream ended before the SIGHUPs"
            assert httpx.post(slow + "/resume", timeout=30).is_success
        reader.join(30)
    assert lines[-1] == "data: [DONE]", lines[-3:]


async def test_sighups_reported_in_one_instant_reload_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The loop callback may run twice for one signal (seen once in CI, right after a
    SIGTERM): a reload queued but not yet reading covers the second, so one line is logged.
    A SIGHUP that comes once the reload began reading starts another."""
    async with cluster(1) as c:
        gateway = c.gateway
        discovery = Discovery(gateway.settings, gateway.health.apply_membership)
        reloads = Reloads(gateway.settings, gateway, discovery)
        with caplog.at_level(logging.INFO, logger="gateway"):
            reloads.hangup()
            reloads.hangup()  # the same instant: merged
            await eventually(lambda: not reloads._tasks, "the reload done")
            reloads.hangup()  # after it: its own reload
            await eventually(lambda: not reloads._tasks, "the second reload done")
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SIGHUP:")]
        assert len(lines) == 2, lines
