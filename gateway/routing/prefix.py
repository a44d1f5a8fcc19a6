"""Request payload -> canonical block stream -> chained xxh3_64 block hashes (the routing key).

Algorithm
    1. Canonicalise the prompt into one byte string, read only as far as the cap needs:

       * completions ``prompt`` as token ids -> little-endian uint32, ``block_size`` ids per
         block (vLLM-aligned);
       * ``prompt`` as text -> UTF-8, ``text_block_bytes`` bytes per block (~4 bytes/token);
       * chat ``messages`` -> for each message ``\\x1e role \\x1f content [\\x1f name]
         [\\x1f tool_call_id] [\\x1f tool_calls as sorted JSON]``; content parts of type
         ``text`` contribute their text, other parts their sorted JSON; ``tools`` (rendered by
         chat templates before the messages) come first. Same block size as text.
       * a *batch* prompt (list of prompts) is keyed by its **first element** and routed whole:
         the body is forwarded byte for byte, and splitting would need the gateway to re-index
         and merge ``choices`` across replicas. TRL never sends batches (one request per
         sample), so this path only has to be correct, not optimal. ``PromptKey.batch`` says
         how many prompts rode along.
    2. Chain: ``h_0 = xxh3_64(block_0, seed=S)``, ``h_i = xxh3_64(block_i, seed=h_{i-1})``,
       where ``S = xxh3_64(kind ':' family)``. ``h_i`` identifies the whole prefix up to block
       ``i``, so two prompts agree on ``h_i`` iff they share their first ``i+1`` blocks, and the
       adapter family (not the version) keeps a group's home across policy versions.
    3. A trailing partial block is chained last (``has_tail``), so the last hash is the
       exact prompt's identity (two prompts sharing all whole blocks, e.g. a long system
       prompt plus a short question, still get distinct keys), while the whole-block hashes
       before it are what a longer continuation of the prompt will share.

Invariants
    * Never raises on any JSON-shaped payload: anything malformed (wrong types, negative or
      >= 2**32 token ids, empty prompt) gives ``None`` (the caller routes it ``no_key``).
    * At most ``max_blocks`` (K) hashes per request, and at most K blocks' worth of input is
      converted, so the cost is O(K * block) regardless of prompt length.
    * A session key (``X-Session-ID`` header, else the OpenAI ``user`` field) replaces the
      prompt key with one hash of the session string.

Complexity: O(min(len, K * block)) bytes touched, K xxh3 calls (~0.3 us each).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping
from enum import StrEnum
from functools import lru_cache
from typing import Any

import orjson
from xxhash import xxh3_64_intdigest

from gateway.routing.config import RoutingConfig, _family, model_family

__all__ = ["PromptKey", "PromptKind", "chain_hashes", "prompt_key"]

_BIG_ENDIAN = sys.byteorder == "big"
_SORT = orjson.OPT_SORT_KEYS


class PromptKind(StrEnum):
    TOKENS = "tokens"
    TEXT = "text"
    CHAT = "chat"
    SESSION = "session"


class PromptKey:
    """The routing features of one request: chained block hashes (1..K of them).

    A plain ``__slots__`` class rather than a frozen dataclass: it is built once per routed
    request, and a frozen dataclass's ``__init__`` costs ~1 us (one ``object.__setattr__``
    per field). Treat it as immutable. Equality ignores ``data`` and ``block``.
    """

    __slots__ = ("batch", "block", "data", "has_tail", "hashes", "kind")

    def __init__(
        self,
        kind: PromptKind,
        hashes: tuple[int, ...],
        batch: int = 1,
        has_tail: bool = False,
        data: bytes = b"",
        block: int = 0,
    ) -> None:
        self.kind = kind
        self.hashes = hashes
        self.batch = batch
        #: The last hash covers a partial block (the prompt's exact end), not a whole block.
        self.has_tail = has_tail
        #: The canonical bytes that were hashed and the block size in bytes, so the index can
        #: check that this prompt really extends an earlier one (:meth:`tail_at`).
        self.data = data
        self.block = block

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PromptKey):
            return NotImplemented
        return (self.kind, self.hashes, self.batch, self.has_tail) == (
            other.kind,
            other.hashes,
            other.batch,
            other.has_tail,
        )

    def __hash__(self) -> int:
        return hash((self.kind, self.hashes, self.batch, self.has_tail))

    def __repr__(self) -> str:
        return (
            f"PromptKey(kind={self.kind!r}, hashes={self.hashes!r}, batch={self.batch}, "
            f"has_tail={self.has_tail})"
        )

    def tail_at(self, depth: int, length: int) -> int | None:
        """Hash of ``length`` bytes right after whole block ``depth``, chained from it."""
        start = (depth + 1) * self.block
        segment = self.data[start : start + length]
        if len(segment) != length:
            return None
        return int(xxh3_64_intdigest(segment, self.hashes[depth]))


def chain_hashes(
    data: bytes, block: int, max_blocks: int, seed: int
) -> tuple[tuple[int, ...], bool]:
    """Chained xxh3_64 over whole ``block``-byte blocks, then the partial tail if any.

    Returns ``(hashes, has_tail)``. At most ``max_blocks`` hashes; the tail (a last, partial
    block) is chained after the whole blocks only when there is room for it, and makes the
    last hash identify the exact (capped) prompt.

    Slices are ``bytes`` copies, not ``memoryview`` slices: copying 256 bytes is as cheap as
    building a view, and bytes are not tracked by the cyclic GC, so a decision allocates
    almost nothing that counts towards a gen-0 collection (those land in the p99).
    """
    size = len(data)
    full = min(size // block, max_blocks)
    h = seed
    out = []
    end = full * block
    for off in range(0, end, block):
        h = xxh3_64_intdigest(data[off : off + block], h)
        out.append(h)
    has_tail = full < max_blocks and end < size
    if has_tail:
        out.append(xxh3_64_intdigest(data[end : end + block], h))
    return tuple(out), has_tail


@lru_cache(maxsize=1024)
def _seed(kind: PromptKind, family: str) -> int:
    return int(xxh3_64_intdigest(f"{kind}:{family}".encode()))


@lru_cache(maxsize=4096)
def _pattern_seed(kind: PromptKind, pattern: str, model: str | None) -> int:
    """``_seed(kind, family(model))`` for the regex family rule, in one cached call."""
    family = "" if model is None else _family(pattern, model)
    return _seed(kind, family)


def _model_seed(kind: PromptKind, model: str | None, config: RoutingConfig) -> int:
    if config.family_fn is not None:
        return _seed(kind, model_family(model, config))
    return _pattern_seed(kind, config.family_pattern, model)


def _token_bytes(ids: Any, limit: int) -> bytes | None:
    if not isinstance(ids, list) or not ids:
        return None
    try:
        # One C-level pass over at most ``limit`` ids ('I' is the fastest typecode to fill
        # from Python ints); the slice is skipped when the prompt is under the cap.
        arr = array("I", ids if len(ids) <= limit else ids[:limit])
    except (TypeError, OverflowError, ValueError):
        return None
    if arr.itemsize != 4:  # pragma: no cover - every mainstream ABI has a 4-byte uint
        return None
    if _BIG_ENDIAN:  # pragma: no cover - keys must agree across gateway hosts
        arr.byteswap()
    return arr.tobytes()


def _text_bytes(text: str, limit: int) -> bytes | None:
    if not text:
        return None
    # Slicing characters first bounds the encode work; 4 bytes/char is UTF-8's maximum.
    return text[:limit].encode("utf-8", "surrogatepass")[:limit]


def _part_bytes(part: Any) -> bytes:
    if isinstance(part, str):
        return part.encode("utf-8", "surrogatepass")
    if (
        isinstance(part, Mapping)
        and part.get("type") == "text"
        and isinstance(part.get("text"), str)
    ):
        return str(part["text"]).encode("utf-8", "surrogatepass")
    return orjson.dumps(part, option=_SORT)


def _chat_bytes(payload: Mapping[str, Any], limit: int) -> bytes | None:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    out = bytearray()
    tools = payload.get("tools")
    if tools is not None:
        out += orjson.dumps(tools, option=_SORT)
    for msg in messages:
        if not isinstance(msg, Mapping):
            return None
        role = msg.get("role")
        if not isinstance(role, str):
            return None
        out += b"\x1e" + role.encode("utf-8", "surrogatepass") + b"\x1f"
        content = msg.get("content")
        if isinstance(content, list):
            for part in content:
                out += _part_bytes(part)
        elif content is not None:
            out += _part_bytes(content)
        for extra in ("name", "tool_call_id"):
            value = msg.get(extra)
            if isinstance(value, str):
                out += b"\x1f" + value.encode("utf-8", "surrogatepass")
        calls = msg.get("tool_calls")
        if calls is not None:
            out += b"\x1f" + orjson.dumps(calls, option=_SORT)
        if len(out) >= limit:
            break
    return bytes(out[:limit])


def _session(request_key: str | None, payload: Mapping[str, Any]) -> str | None:
    if request_key:
        return request_key
    user = payload.get("user")
    return user if isinstance(user, str) and user else None


def prompt_key(
    path: str,
    model: str | None,
    payload: Mapping[str, Any],
    session_key: str | None,
    config: RoutingConfig,
) -> PromptKey | None:
    """The routing key of a request, or ``None`` when it has none (never raises)."""
    try:
        return _prompt_key(path, model, payload, session_key, config)
    except (TypeError, ValueError, AttributeError, RecursionError):
        return None


def _prompt_key(
    path: str,
    model: str | None,
    payload: object,
    session_key: str | None,
    config: RoutingConfig,
) -> PromptKey | None:
    # ``type(...) is dict`` first: an ABC isinstance check costs ~0.4 us on the hot path.
    if type(payload) is not dict and not isinstance(payload, Mapping):
        return None
    if not isinstance(model, str):
        raw = payload.get("model")
        model = raw if isinstance(raw, str) else None
    session = _session(session_key, payload)
    if session is not None:
        h = xxh3_64_intdigest(
            session.encode("utf-8", "surrogatepass"),
            _model_seed(PromptKind.SESSION, model, config),
        )
        return PromptKey(PromptKind.SESSION, (h,))
    k = config.max_blocks
    prompt = payload.get("prompt")
    use_chat = prompt is None or path.endswith("chat/completions")
    if use_chat:
        data = _chat_bytes(payload, k * config.text_block_bytes)
        return _make(PromptKind.CHAT, data, config.text_block_bytes, model, config)
    batch = 1
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        kind = list if isinstance(prompt[0], list) else str
        if not all(isinstance(p, kind) for p in prompt):
            return None  # a mixed batch is invalid for vLLM too
        batch = len(prompt)
        prompt = prompt[0]  # batch: routed whole, keyed by its first prompt (see docstring)
    if isinstance(prompt, str):
        data = _text_bytes(prompt, k * config.text_block_bytes)
        return _make(PromptKind.TEXT, data, config.text_block_bytes, model, config, batch)
    data = _token_bytes(prompt, k * config.block_size)
    return _make(PromptKind.TOKENS, data, 4 * config.block_size, model, config, batch)


def _make(
    kind: PromptKind,
    data: bytes | None,
    block: int,
    model: str | None,
    config: RoutingConfig,
    batch: int = 1,
) -> PromptKey | None:
    if not data:
        return None
    seed = _model_seed(kind, model, config)
    hashes, has_tail = chain_hashes(data, block, config.max_blocks, seed)
    return PromptKey(kind, hashes, batch, has_tail, data, block) if hashes else None
