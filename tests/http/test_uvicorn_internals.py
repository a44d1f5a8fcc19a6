"""The private uvicorn names the socket layer relies on, checked loudly.

``gateway/http/h1server.py`` (the lean rollout protocol) and ``gateway/http/handoff.py``
reuse uvicorn's header validators, status lines and ``HttpToolsProtocol`` (odd connections
are handed over to it, extended to bound a head that never ends), and
``gateway/cli.py`` clears ``Server._captured_signals`` so SIGTERM exits 0. None of these
are public API, so ``pyproject.toml`` pins uvicorn to the minor range tested here, and
this test fails the moment an upgrade changes any of them.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from importlib.metadata import version

import uvicorn
from uvicorn.protocols.http import httptools_impl
from uvicorn.server import ServerState


def test_uvicorn_is_the_tested_minor() -> None:
    assert version("uvicorn").startswith("0.54."), "re-check the names below, then the pin"


def test_header_validators_refuse_what_they_refused() -> None:
    name, value = httptools_impl.HEADER_RE, httptools_impl.HEADER_VALUE_RE
    assert isinstance(name, re.Pattern) and isinstance(value, re.Pattern)
    for bad in (b"x y", b"x:y", b"x\r", b"x\n", b"x\x00", b"(x)"):
        assert name.search(bad), bad
    assert not name.search(b"x-request-id")
    for bad in (b"a\r\nb", b"a\nb", b"a\x00b", b"a\x7f"):
        assert value.search(bad), bad
    assert not value.search(b"text/plain; charset=utf-8\tx")


def test_status_lines() -> None:
    assert httptools_impl.STATUS_LINE[200] == b"HTTP/1.1 200 OK\r\n"
    assert httptools_impl.STATUS_LINE[400] == b"HTTP/1.1 400 Bad Request\r\n"
    assert httptools_impl.STATUS_LINE[431] == b"HTTP/1.1 431 Request Header Fields Too Large\r\n"


def test_protocol_and_server_state_shapes() -> None:
    params = inspect.signature(httptools_impl.HttpToolsProtocol.__init__).parameters
    assert list(params) == ["self", "config", "server_state", "app_state", "_loop"]
    state = ServerState()
    assert isinstance(state.connections, set) and isinstance(state.tasks, set)
    assert isinstance(state.default_headers, list)
    for method in ("connection_made", "data_received", "connection_lost", "eof_received"):
        assert callable(getattr(httptools_impl.HttpToolsProtocol, method))
    # handoff.BoundedHttpToolsProtocol extends the parser callbacks that bracket a head,
    # and the end of the stream (its lingering close); it uses the protocol's loop.
    for callback, expected in (
        ("on_headers_complete", ["self"]),
        ("on_message_complete", ["self"]),
        ("eof_received", ["self"]),
        ("connection_lost", ["self", "exc"]),
    ):
        params = inspect.signature(getattr(httptools_impl.HttpToolsProtocol, callback)).parameters
        assert list(params) == expected, callback
    assert "self.loop = " in inspect.getsource(httptools_impl.HttpToolsProtocol.__init__)


def test_server_captures_signals_in_a_list_cli_can_clear() -> None:
    server = uvicorn.Server(uvicorn.Config(app))
    assert server._captured_signals == []
    assert inspect.isfunction(uvicorn.Server.capture_signals.__wrapped__)


async def app(scope: object, receive: object, send: object) -> None:
    await asyncio.sleep(0)
