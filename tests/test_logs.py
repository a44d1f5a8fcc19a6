import io
import logging

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
    assert stream.getvalue().rstrip().endswith("boom [request_id=req-7]")


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
