"""The private uvicorn names the gateway's server relies on, checked loudly.

They are all in one module, ``gateway/http/server/uvicorn_private.py``: the protocol
factory's arguments and ``ServerState``, uvicorn's header validators and status lines,
its ``HttpToolsProtocol`` (odd connections are handed over to it, extended to bound a head
that never ends) and ``Server._captured_signals`` (cleared so SIGTERM exits 0). None of
these are public API, so ``pyproject.toml`` pins uvicorn to the minor range tested here;
this test fails the moment an upgrade changes any of them, or a gateway module other than
that one imports uvicorn's private modules or touches ``_captured_signals``.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from importlib.metadata import version
from pathlib import Path

import uvicorn
from uvicorn.protocols.http import httptools_impl
from uvicorn.server import ServerState

import gateway
from gateway.http.server import uvicorn_private


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
    # uvicorn_private.BoundedHttpToolsProtocol extends the parser callbacks that bracket a head,
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


def test_config_keeps_the_keep_alive_timeout() -> None:
    assert uvicorn.Config(app, timeout_keep_alive=7).timeout_keep_alive == 7


def test_server_captures_signals_in_a_list_that_can_be_cleared() -> None:
    server = uvicorn.Server(uvicorn.Config(app))
    assert server._captured_signals == []
    assert inspect.isfunction(uvicorn.Server.capture_signals.__wrapped__)


async def app(scope: object, receive: object, send: object) -> None:
    await asyncio.sleep(0)


# Where uvicorn's private modules are, and the one private member of its public Server.
_PRIVATE = re.compile(
    r"\buvicorn\.(protocols|server|config|lifespan|loops|middleware|supervisors)\b"
    r"|\bfrom\s+uvicorn\s+import\s+[^\n]*\b(protocols|server|config)\b"
    r"|_captured_signals"
)


def private_uses(root: Path, allowed: Path) -> list[str]:
    """``file:line: text`` for every line under ``root`` (but ``allowed``) that names a
    private uvicorn module or ``_captured_signals``: a grep over the source text, so a
    mention in a docstring counts too (say "uvicorn's protocol" there instead)."""
    return [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        if path != allowed
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _PRIVATE.search(line)
    ]


def test_no_other_gateway_module_uses_uvicorn_privately() -> None:
    root = Path(gateway.__file__).parent
    allowed = Path(uvicorn_private.__file__)
    assert private_uses(root, allowed) == []
    assert _PRIVATE.search(allowed.read_text()), "the check must match the one module"


def test_the_check_would_catch_a_private_use(tmp_path: Path) -> None:
    lines = [
        "from uvicorn.server import ServerState",
        "from uvicorn.protocols.http.httptools_impl import STATUS_LINE",
        "import uvicorn.config",
        "from uvicorn import server",
        "server._captured_signals.clear()",
    ]
    for n, line in enumerate(lines):
        (tmp_path / f"m{n}.py").write_text(line + "\n")
    (tmp_path / "public.py").write_text("import uvicorn\nuvicorn.Server(uvicorn.Config(a))\n")
    assert len(private_uses(tmp_path, tmp_path / "none.py")) == len(lines)
