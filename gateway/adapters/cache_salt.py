"""A rollout's ``cache_salt``: the adapter copy's load generation, added to the body (pure).

Why: vLLM keys an adapter's prefix-cache blocks by its name and path, never its bytes
(vllm#42125), so a name reloaded in place, or loaded again later at the same path, would
reuse KV computed with the old weights. vLLM's own ``cache_salt`` enters the first
block's key; a new salt per load generation (``AdapterRegistry.salt``) makes old blocks
unreachable while every request of one generation still shares its blocks (a GRPO group,
the next turn of a conversation).

The body is not re-serialized: the salt is spliced in after the opening brace, one copy
of the bytes. A client's own salt is kept by combining the two (hashed to stay within
vLLM's 128 characters), after checking it as vLLM would, so a bad one is still a 400.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
import xxhash

from gateway.errors import BadRequest

__all__ = ["check_client_salt", "salted"]

_FORBIDDEN = frozenset("@/\\\x00")  # vLLM's validate_cache_salt
_MAX_LEN = 128


def salted(body: bytes, payload: Mapping[str, Any], salt: str | None) -> bytes:
    """``body`` with ``"cache_salt"`` set to ``salt`` (combined with the client's own);
    ``body`` itself when there is no salt."""
    if salt is None:
        return body
    if "cache_salt" not in payload:
        start = body.find(b"{") + 1  # a JSON object with at least one member: never 0
        return b'%b"cache_salt":"%b",%b' % (body[:start], salt.encode(), body[start:])
    given = payload["cache_salt"]  # a string (check_client_salt ran first) or null
    if isinstance(given, str):
        salt = f"{salt}.{xxhash.xxh3_64_hexdigest(given.encode())}"
    return orjson.dumps({**payload, "cache_salt": salt})


def check_client_salt(payload: Mapping[str, Any]) -> None:
    """vLLM's own rule and message for a client's ``cache_salt`` (before ``salted``)."""
    given = payload.get("cache_salt")
    if given is None:
        return
    if not isinstance(given, str) or not given:
        raise BadRequest(
            "Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt"
        )
    if len(given) > _MAX_LEN or any(c in _FORBIDDEN for c in given):
        raise BadRequest(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL.",
            param="cache_salt",
        )
