"""Offline tasks: prompt generators and their reward functions.

Reward functions follow TRL's convention: ``f(completions, prompts, completion_ids,
**columns) -> list[float | None]``, where ``columns`` are the dataset row's other fields
repeated once per sample. They run in a separate worker *process*, so they must be
picklable: module-level functions, ``functools.partial`` or callable instances (never
lambdas or closures). ``None`` means "cannot score this sample" (advantage 0).

Two built-in tasks:

``digits`` (learnable on CPU in minutes)
    "Write some digits." The reward is the share of characters in the completion that are
    digits. Why this task: the tiny local model is random, tied-embedding and 2048-token
    wide, so its next-token distribution is near uniform (logit std ~0.22) and its
    RMS-normalized hidden state can lift any one token's logit by at most ~2.6 nats at
    T=1. A reward on a *set* of tokens that already appears ~3 % of the time gives every
    group variance from step one, and sampling at a low temperature (0.3) lets the LoRA
    concentrate mass on a few digit tokens. Reward rises from ~0.03 to >0.3 within ~100
    steps (``bench/results/train.md``).

``arith`` (realistic, need not improve)
    GSM8K-style word problems with a numeric answer, generated offline from a seed; the
    reward is 1 when the last number in the completion equals the answer, plus 0.1 for
    producing any number at all (a format reward).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["TASKS", "Task", "arith_reward", "digit_reward", "get_task", "number_format_reward"]

RewardFunc = Callable[..., list[float | None]]
Row = dict[str, Any]


def digit_reward(completions: list[str], **_: Any) -> list[float | None]:
    """Share of non-space characters that are ASCII digits (0.0 for an empty completion)."""
    out: list[float | None] = []
    for text in completions:
        chars = [c for c in text if not c.isspace()]
        out.append(sum(c in "0123456789" for c in chars) / len(chars) if chars else 0.0)
    return out


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def arith_reward(completions: list[str], answer: list[str], **_: Any) -> list[float | None]:
    """1.0 when the last number in the completion equals the gold answer, else 0.0."""
    out: list[float | None] = []
    for text, gold in zip(completions, answer, strict=True):
        nums = _NUMBER.findall(text.replace(",", ""))
        if not nums:
            out.append(0.0)
            continue
        try:
            out.append(1.0 if abs(float(nums[-1]) - float(gold)) < 1e-6 else 0.0)
        except ValueError:
            out.append(None)
    return out


def number_format_reward(completions: list[str], **_: Any) -> list[float | None]:
    """0.1 for a completion that contains any number: a small shaping term."""
    return [0.1 if _NUMBER.search(text) else 0.0 for text in completions]


# --------------------------------------------------------------------------------------
# Prompt generators: deterministic from a seed, endless, indexable by a cursor.
# --------------------------------------------------------------------------------------

_SYSTEM = (
    "You are a careful assistant. Answer briefly. Use plain text. Think about the request, "
    "then reply in one short line without any preamble."
)
_NAMES = ["Ava", "Ben", "Cleo", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun"]
_ITEMS = ["apples", "books", "coins", "pens", "shells", "stamps", "marbles", "cards"]
_FILLER = ["please", "quickly", "now", "again", "here", "today", "for me", "in a row"]


def _digits_row(rng: random.Random, index: int) -> Row:
    n = rng.randint(3, 9)
    ask = rng.choice(["Write", "Type", "List", "Give"])
    tail = rng.choice(_FILLER)
    return {
        "prompt": [
            {"role": "system", "content": _SYSTEM},
            {"role": "user", "content": f"{ask} {n} digits {tail}."},
        ],
        "index": index,
    }


def _arith_row(rng: random.Random, index: int) -> Row:
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(1, 9)
    name, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    kind = rng.randrange(3)
    if kind == 0:
        q = f"{name} has {a} {item}. {other} gives {name} {b} more. How many {item} now?"
        ans = a + b
    elif kind == 1:
        q = f"{name} has {a + b} {item} and gives {b} to {other}. How many are left?"
        ans = a
    else:
        q = f"{name} buys {c} bags with {b} {item} each. How many {item} in total?"
        ans = b * c
    return {
        "prompt": [
            {"role": "system", "content": _SYSTEM},
            {"role": "user", "content": q + " Give only the number."},
        ],
        "answer": str(ans),
        "index": index,
    }


@dataclass(frozen=True)
class Task:
    """A named prompt stream plus the reward functions that score it."""

    name: str
    make_row: Callable[[random.Random, int], Row]
    reward_funcs: tuple[RewardFunc, ...]

    def rows(self, seed: int, start: int = 0) -> Iterator[Row]:
        """Rows ``start, start+1, ...``; row ``i`` depends only on ``(seed, i)``.

        That is what makes the prompt cursor a complete checkpoint of the data stream:
        a resumed run sees exactly the prompts the killed run had not trained on.
        """
        i = start
        while True:
            yield self.make_row(random.Random(f"{self.name}:{seed}:{i}"), i)
            i += 1


TASKS: dict[str, Task] = {
    "digits": Task("digits", _digits_row, (digit_reward,)),
    "arith": Task("arith", _arith_row, (arith_reward, number_format_reward)),
}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose from {sorted(TASKS)}") from None
