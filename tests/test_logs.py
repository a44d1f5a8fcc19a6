import io
import logging
import re

import orjson

from gateway import logs


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
