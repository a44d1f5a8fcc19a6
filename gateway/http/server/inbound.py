"""One client request as the dispatch path needs it, whichever server read it.

Why: a rollout read by ``gateway.http.server.h1server`` never becomes an ASGI scope, a Starlette
``Request`` or a ``Response``: building those, and the coroutine layers that pass them
along, is work a rollout does not need (docs/decisions.md, 'HTTP: one request object, no
ASGI on the lean path'). Requests that uvicorn serves (hand-offs, FORWARDED paths) are
described by the same object, built from their scope, so routing, dispatch and error
mapping exist once.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import Receive, Scope

from gateway.http.server.disconnect import DisconnectGuard

__all__ = ["Inbound"]


class Inbound:
    """Method, target, headers (lower-case names, as the server parsed them), the client,
    the task serving the request, its disconnect guard, and the body if already read."""

    __slots__ = (
        "body", "client", "guard", "headers", "method", "path", "query", "raw_path",
        "receive", "table", "task",
    )  # fmt: skip

    def __init__(
        self,
        method: str,
        path: str,
        raw_path: bytes,
        query: bytes,
        headers: list[tuple[bytes, bytes]],
        client: tuple[str, int] | None,
        task: asyncio.Task[Any],
        guard: DisconnectGuard,
        *,
        body: bytes | None = None,
        receive: Receive | None = None,
    ) -> None:
        self.method = method
        self.path = path
        self.raw_path = raw_path
        self.query = query
        self.headers = headers
        self.table = dict(headers)  # one dict per request: every lookup after is O(1)
        self.client = client
        self.task = task
        self.guard = guard
        self.body = body  # None: still to be read from ``receive``
        self.receive = receive

    @classmethod
    def from_scope(cls, scope: Scope, receive: Receive) -> Inbound:
        """A request uvicorn serves (ASGI): the body is read from ``receive``."""
        task = asyncio.current_task()
        assert task is not None
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode("latin-1")
        return cls(
            scope["method"], scope["path"], raw_path, scope.get("query_string", b""),
            scope["headers"], scope.get("client"), task, DisconnectGuard(task, receive=receive),
            receive=receive,
        )  # fmt: skip

    def header(self, name: bytes) -> bytes | None:
        """One request header by lower-case name."""
        return self.table.get(name)

    @property
    def peer(self) -> bytes:
        """The client's address, the per-client key when it presents no credential."""
        return self.client[0].encode() if self.client else b"-"

    @property
    def target(self) -> bytes:
        """The request target as forwarded: the raw path and the query, if any."""
        return self.raw_path + b"?" + self.query if self.query else self.raw_path
