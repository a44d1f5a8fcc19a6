import io
import logging
import re
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
from rollout_testbed.procs import Proc, free_port, sim_argv

from gateway import logs
from tests.deploy._proc import base_env
from tests.eventually import eventually_sync


def _handler(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    handler.addFilter(logs._RequestIdFilter())
    logger = logging.getLogger(f"test-logs-{id(stream)}")
    logger.propagate = False
    logger.addHandler(handler)
    return logger, stream


def test_json_lines_carry_the_request_id_only_inside_a_request() -> None:
    logger, stream = _handler(logs.JsonFormatter())
    logger.warning("outside")
    token = logs.REQUEST_ID.set("req-42")
    try:
        logger.warning("replica %d ejected", 1)
    finally:
        logs.REQUEST_ID.reset(token)
    outside, inside = (orjson.loads(line) for line in stream.getvalue().splitlines())
    assert "request_id" not in outside
    assert inside["request_id"] == "req-42"
    assert inside["message"] == "replica 1 ejected"
    assert inside["level"] == "WARNING"


def test_text_lines_carry_the_request_id() -> None:
    logger, stream = _handler(logs.TextFormatter())
    token = logs.REQUEST_ID.set("req-7")
    try:
        logger.error("boom")
    finally:
        logs.REQUEST_ID.reset(token)
    assert stream.getvalue().rstrip().endswith("boom request_id=req-7")


def test_request_controlled_text_cannot_split_a_text_line() -> None:
    """An adapter name with CR/LF (refused with 400, but logged on the way) or an ANSI
    escape stays on its record's line, escaped."""
    logger, stream = _handler(logs.TextFormatter())
    logger.warning("adapter %s not loaded", "pol-v1\r\nINFO gateway: forged\x1b[2J")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    assert lines[0].endswith("adapter pol-v1\\r\\nINFO gateway: forged\\x1b[2J not loaded")


def test_json_messages_are_escaped_too() -> None:
    logger, stream = _handler(logs.JsonFormatter())
    logger.warning("name %s", "a\nb\x00c\td")
    [line] = stream.getvalue().splitlines()
    assert orjson.loads(line)["message"] == "name a\\nb\\x00c\td"


def test_tracebacks_keep_their_lines() -> None:
    logger, stream = _handler(logs.TextFormatter())
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("failed")
    assert "Traceback (most recent call last):\n" in stream.getvalue()


def test_json_lines_carry_the_structured_fields_as_keys() -> None:
    """What an on-call searches by is a key of its own, not words inside the message;
    only the known fields are written, and strings are escaped like messages."""
    logger, stream = _handler(logs.JsonFormatter())
    logger.warning("replica %d ejected", 1, extra={
        "event": "replica_ejected", "replica": 1, "replica_url": "http://gpu-b:8001",
        "kind": "refused", "run": "run-a", "adapter": "pol\nv1", "password": "never",
    })  # fmt: skip
    [line] = stream.getvalue().splitlines()
    record = orjson.loads(line)
    assert record["event"] == "replica_ejected" and record["replica"] == 1
    assert record["replica_url"] == "http://gpu-b:8001" and record["kind"] == "refused"
    assert record["run"] == "run-a" and record["adapter"] == "pol\\nv1"
    assert "password" not in record


def test_timestamps_are_utc_with_milliseconds() -> None:
    for formatter in (logs.JsonFormatter(), logs.TextFormatter()):
        logger, stream = _handler(formatter)
        logger.warning("tick")
        line = stream.getvalue()
        assert re.search(r"\b\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z\b", line), line
    assert logs.timestamp(0.9996) == "1970-01-01T00:00:00.999Z"


def test_text_lines_append_fields_as_key_value() -> None:
    logger, stream = _handler(logs.TextFormatter())
    logger.warning("down", extra={"event": "probe_failed", "replica": 0, "kind": "dns",
                                  "adapter": "a b"})  # fmt: skip
    assert (
        stream.getvalue()
        .rstrip()
        .endswith('down event=probe_failed replica=0 adapter="a b" kind=dns')
    )


def test_uvicorn_lines_are_written_under_the_gateways_names() -> None:
    for formatter, name in (
        (logs.JsonFormatter(), "uvicorn.error"),
        (logs.TextFormatter(), "uvicorn.access"),
    ):
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        handler.setFormatter(formatter)
        record = logging.LogRecord(
            name, logging.INFO, __file__, 1, "Started server process", None, None
        )
        handler.handle(record)
        line = stream.getvalue()
        assert "uvicorn" not in line and ("gateway.server" in line or "gateway.access" in line), (
            line
        )


def test_repeats_logs_the_first_each_change_and_then_one_a_minute() -> None:
    """A replica down for 5 minutes, probed every 0.5 s (600 failures): 6 lines, not 600."""
    repeats = logs.Repeats(every_s=60.0)
    logged = [t / 2 for t in range(600) if repeats.seen(1, "refused", t / 2) is not None]
    assert logged == [0.0, 60.0, 120.0, 180.0, 240.0]
    streak = repeats.seen(1, "dns", 300.0)  # a change is said at once
    assert streak is not None and streak.count == 601 and streak.since == 0.0
    assert repeats.seen(1, "dns", 300.5) is None
    assert repeats.ended(1) is streak and repeats.ended(1) is None
    assert repeats.seen(1, "dns", 301.0) is not None  # a new outage starts over


# --- through a real gateway process ------------------------------------------------------

_MS_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def _records(log: Path) -> list[dict[str, Any]]:
    """Every line of the gateway's log, each of which must be one JSON object."""
    return [orjson.loads(line) for line in log.read_text().splitlines() if line.strip()]


def test_a_gateway_logs_searchable_json_and_carries_request_ids(tmp_path: Path) -> None:
    """``serve --log-format json`` with ``--request-id-header x-correlation-id``, over a
    sim replica and one whose name does not resolve: every line is JSON with a millisecond
    UTC timestamp under a ``gateway.*`` logger (uvicorn's own lines too); the DNS failure
    says ``dns``; a request's id comes from the configured header, reaches the replica
    (vLLM makes it the completion's id), and is in the answer's header, the error body and
    the log lines about that request, whose failure says ``refused``."""
    log = tmp_path / "gw.log"
    sim_port, port = free_port(), free_port()
    sim = Proc("sim-replica", sim_argv(sim_port), tmp_path / "sim.log", env=base_env(),
               url=f"http://127.0.0.1:{sim_port}", new_session=False)  # fmt: skip
    unresolvable = "http://does-not-exist.invalid:1"
    # A long probe period: the request below meets the stopped replica before a probe does.
    argv = [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--replica", sim.url,
            "--replica", unresolvable, "--log-format", "json", "--health-interval-s", "60",
            "--request-id-header", "x-correlation-id",
            "--request-id-header", "x-request-id"]  # fmt: skip
    gateway = Proc("gateway", argv, log, env=base_env(), url=f"http://127.0.0.1:{port}",
                   new_session=False)  # fmt: skip
    completion = {"model": "tiny-base", "prompt": "hi", "max_tokens": 2}
    with sim, gateway, httpx.Client(base_url=gateway.url, timeout=30) as client:
        sim.wait_http("/health")
        gateway.wait_http("/metrics", request_timeout=1.0)
        ids = {"x-correlation-id": "corr-1", "x-request-id": "other"}
        r = client.post("/v1/completions", json=completion, headers=ids)
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "corr-1"  # the first configured header wins
        assert r.json()["id"] == "cmpl-corr-1"  # the replica was sent X-Request-Id: corr-1
        r = client.post("/v1/completions", json=completion, headers={"x-correlation-id": "a b"})
        made = r.headers["x-request-id"]  # not sane (a space): the gateway makes one
        assert made != "a b" and r.json()["id"] == f"cmpl-{made}"
        r = client.post("/v1/completions", content=b"{not json", headers={"x-correlation-id": "c4"})
        assert r.status_code == 400  # the gateway's own error: the id in its body too
        assert r.headers["x-request-id"] == "c4" == r.json()["request_id"]
        sim.stop(grace=15, kill_wait=5)  # its port now refuses connections
        r = client.post("/v1/completions", json=completion,
                        headers={"x-correlation-id": "corr-dead"})  # fmt: skip
        assert r.status_code == 503, r.text
        assert r.headers["x-request-id"] == "corr-dead" == r.json()["request_id"]
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}  # vLLM's

        def failure_logged() -> list[dict[str, Any]]:
            return [x for x in _records(log) if x.get("request_id") == "corr-dead"]

        about = eventually_sync(failure_logged, "the failed request's log lines")
        gateway.stop(grace=15, kill_wait=5)
    records = _records(log)
    for record in records:
        assert _MS_UTC.fullmatch(record["ts"]), record
        assert record["logger"].startswith("gateway"), record
    assert any(r["message"].startswith("Started server process") for r in records)  # uvicorn's
    failed = [r for r in about if r.get("event") == "upstream_failed"]
    assert failed and failed[0]["kind"] == "refused" and failed[0]["replica"] == 0, about
    assert failed[0]["replica_url"] == sim.url
    dns = [r for r in records if r.get("replica") == 1 and r.get("event") == "probe_failed"]
    assert dns and dns[0]["kind"] == "dns" and dns[0]["replica_url"] == unresolvable, records
    [down] = [r for r in records if r.get("event") == "replica_down_at_start"]
    assert down["replica"] == 1 and down["kind"] == "dns" and down["level"] == "WARNING"
