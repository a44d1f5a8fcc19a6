"""The one rule every control call fanned out to the fleet is judged by. Pure, no I/O.

TRL 1.16 retries none of ``/pause``, ``/resume``, ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``: any non-200 ends the training run. A replica dying is what
the gateway exists to hide, so a replica's answer is one of three kinds:

* **applied**: it answered 2xx;
* **refused**: it answered with an HTTP error. The replica is alive and said no, so the
  call fails, all or nothing (the caller rolls back what it can);
* **lost**: no answer at all -- connect refused, reset, no response within the call's
  deadline, or ejected by the health checker while the call waited. Its state is unknown,
  so it is ejected and left out of the call; it is reconciled (adapters replayed, pause
  state applied) before it serves again.

The call succeeds when nothing was refused and at least ``quorum`` replicas applied it.
The table in docs/operations.md ("Control calls") spells this out per call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Reply", "Verdict", "judge", "reply_for"]


class Reply(StrEnum):
    APPLIED = "applied"
    REFUSED = "refused"
    LOST = "lost"


def reply_for(status: int) -> Reply:
    """Status 0 stands for "no HTTP answer" (the fan-out's marker for a lost replica)."""
    if status == 0:
        return Reply.LOST
    return Reply.APPLIED if 200 <= status < 300 else Reply.REFUSED


class Verdict(StrEnum):
    OK = "ok"
    REFUSED = "refused"  # some replica answered with an error: 502 (its answer is quoted)
    NO_QUORUM = "no_quorum"  # too few replicas left to apply it: 503


@dataclass(frozen=True, slots=True)
class Tally:
    verdict: Verdict
    applied: tuple[int, ...]
    refused: tuple[int, ...]
    lost: tuple[int, ...]


def judge(replies: Mapping[int, Reply], quorum: int) -> Tally:
    """Judge one fan-out. ``quorum``: replicas that must apply it (at least 1)."""

    def having(kind: Reply) -> tuple[int, ...]:
        return tuple(sorted(r for r, reply in replies.items() if reply is kind))

    applied, refused, lost = having(Reply.APPLIED), having(Reply.REFUSED), having(Reply.LOST)
    if refused:
        verdict = Verdict.REFUSED
    elif len(applied) < max(1, quorum):
        verdict = Verdict.NO_QUORUM
    else:
        verdict = Verdict.OK
    return Tally(verdict, applied, refused, lost)
