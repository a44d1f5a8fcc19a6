"""Reading and checking a request before anything is sent upstream: body size, JSON
shape and depth, generation parameters, header limits, the request id."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.types import Receive

from gateway.errors import (
    BadRequest,
    HeadersTooLarge,
    PayloadTooLarge,
)
from gateway.http.server.disconnect import ClientDisconnected
from gateway.http.server.inbound import Inbound
from gateway.logs import REQUEST_ID

if TYPE_CHECKING:
    from gateway.config import Settings


def header(request: Request, name: bytes) -> bytes | None:
    """One request header by lower-case name (Starlette handlers; ``Inbound.header`` for
    the dispatch path). The raw list is turned into a dict once per request: Starlette's
    ``Headers.get`` scans the whole list on every call."""
    scope = request.scope
    table: dict[bytes, bytes] | None = scope.get("gateway.headers")
    if table is None:
        table = scope["gateway.headers"] = dict(scope["headers"])
    return table.get(name)


# A client's id is taken when it is at most 128 bytes of letters, digits and ``-_.:/+=@``
# (UUIDs, W3C trace ids, base64): it goes into every log line and upstream header of the
# request. Nothing that a log reader or a replica might decode (``%``, quotes, backslash,
# spaces, controls) is echoed: such an id is replaced by one of ours.
_REQUEST_ID = re.compile(rb"[A-Za-z0-9\-_.:/+=@]{1,128}")
_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count()


async def read_body(receive: Receive, declared: bytes | None, limit: int) -> bytes:
    """The whole body from ASGI ``receive``, refused early (413) when its declared
    ``Content-Length`` is, or what arrives becomes, larger than ``limit``."""
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest("Invalid Content-Length header.")
        check_body_size(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        check_body_size(size, limit)
        chunks.append(chunk)
        more = message.get("more_body", False)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def request_body(request: Request, limit: int) -> bytes:
    return await read_body(request.receive, header(request, b"content-length"), limit)


def check_body_size(size: int, limit: int) -> None:
    if size > limit:
        raise PayloadTooLarge(f"Request body exceeds the {limit}-byte limit.", limit="body")


def parse_json_object(body: bytes, max_depth: int | None = None) -> dict[str, Any]:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"Invalid JSON body: {exc.msg}.") from None
    if not isinstance(payload, dict):
        raise BadRequest("Request body must be a JSON object.")
    if max_depth is not None and _too_deep(body, payload, max_depth):
        raise BadRequest(f"JSON body nests deeper than {max_depth} levels.", limit="json_depth")
    return payload


def _too_deep(body: bytes, payload: dict[str, Any], limit: int) -> bool:
    """Whether objects/arrays nest more than ``limit`` deep. The number of ``[`` and ``{``
    in the raw bytes bounds the depth from above, so the walk runs only for bodies with
    many containers -- never for a TRL rollout (a token-id list inside one object)."""
    if not _openers_exceed(body, limit):
        return False
    stack: list[tuple[Any, int]] = [(payload, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((v, depth + 1) for v in children if isinstance(v, dict | list))
    return False


def _openers_exceed(body: bytes, limit: int) -> bool:
    """``body.count(b"[") + body.count(b"{") > limit``, found with ``find`` (memchr) from
    opener to opener and stopping past ``limit``: a TRL body (one of each) costs four
    calls, where counting walked every byte twice (5 % of a rollout's instructions,
    ``bench/results/instructions.ablations.md``)."""
    seen = 0
    for opener in (b"[", b"{"):
        at = body.find(opener)
        while at >= 0:
            seen += 1
            if seen > limit:
                return True
            at = body.find(opener, at + 1)
    return False


_CEILINGS = ("n", "max_tokens", "max_completion_tokens")  # n: max_n; else max_tokens_limit


def check_generation(path: str, payload: Mapping[str, Any], settings: Settings) -> None:
    """Reject, with the offending ``param``, what no replica could serve or the operator's
    ceilings forbid. The rest is vLLM's to validate: the body is forwarded untouched."""
    get = payload.get
    model = get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string.", param="model")
    stream = get("stream")
    if stream is not None and stream is not True and stream is not False:
        raise BadRequest("'stream' must be a boolean.", param="stream")
    for name in _CEILINGS:
        value = get(name)
        if value is None:
            continue
        if type(value) is not int or value < 1:  # JSON ints only: bool is a subclass
            raise BadRequest(f"'{name}' must be a positive integer.", param=name)
        ceiling = settings.max_n if name == "n" else settings.max_tokens_limit
        if ceiling is not None and value > ceiling:
            raise BadRequest(f"'{name}' must be at most {ceiling} here.", param=name, limit=name)
    if path.endswith("/chat/completions"):
        if not isinstance(get("messages"), list):
            raise BadRequest("'messages' must be a list.", param="messages")
    elif not isinstance(get("prompt"), (str, list)):
        raise BadRequest("'prompt' must be a string, token ids, or a list of them.", param="prompt")


def assign_request_id(header: Callable[[bytes], bytes | None], names: Sequence[bytes]) -> str:
    """The request's id, set for the logs (``REQUEST_ID``) as the request arrives: the
    value of the first of the ``request_id_headers`` (``names``, lower-case) the client
    sent with a sane value, else a new one. ``header``: a lookup by lower-case name.

    New ids are a random per-process prefix plus a counter: unique across gateways and
    restarts without a ``getrandom`` syscall per request."""
    for name in names:
        given = header(name)
        if given is not None and _REQUEST_ID.fullmatch(given):
            request_id = given.decode("ascii")
            break
    else:
        request_id = f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"
    REQUEST_ID.set(request_id)
    return request_id


def request_id() -> str:
    """The id ``assign_request_id`` gave the request being served (a new one if none
    did): sent upstream as ``X-Request-Id`` and answered in the same header."""
    return REQUEST_ID.get() or assign_request_id(_absent, ())


def _absent(name: bytes) -> None:
    return None


def session_key(inbound: Inbound, payload: Mapping[str, Any]) -> str | None:
    given = inbound.header(b"x-session-id")
    key = given.decode("latin-1") if given else payload.get("user")
    return key if isinstance(key, str) and key else None


def check_headers(headers: Sequence[tuple[bytes, bytes]], settings: Settings) -> None:
    """431 for too many or too large request headers (the server parsed them already;
    this keeps them out of everything downstream: logs, upstream, the router)."""
    if len(headers) > settings.max_header_count:
        raise HeadersTooLarge(f"More than {settings.max_header_count} request headers.",
                              limit="header_count")  # fmt: skip
    size = 0
    for name, value in headers:
        size += len(name) + len(value)
    if size > settings.max_header_bytes:
        raise HeadersTooLarge(f"Request headers exceed {settings.max_header_bytes} bytes.",
                              limit="header_bytes")  # fmt: skip
