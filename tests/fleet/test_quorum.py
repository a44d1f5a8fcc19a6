"""The control-call rule, as a table: replies x quorum -> verdict."""

from __future__ import annotations

import pytest

from gateway.fleet.quorum import Reply, Verdict, judge, reply_for

A, R, L = Reply.APPLIED, Reply.REFUSED, Reply.LOST


@pytest.mark.parametrize(
    ("status", "reply"),
    [(0, L), (200, A), (204, A), (400, R), (404, R), (500, R), (503, R)],
)
def test_reply_for_status(status: int, reply: Reply) -> None:
    assert reply_for(status) is reply


@pytest.mark.parametrize(
    ("replies", "quorum", "verdict"),
    [
        ({0: A, 1: A}, 1, Verdict.OK),
        ({0: A, 1: L}, 1, Verdict.OK),  # lost, not failed
        ({0: A, 1: L}, 2, Verdict.NO_QUORUM),  # too few left for health_min_replicas
        ({0: L, 1: L}, 1, Verdict.NO_QUORUM),
        ({0: A, 1: R}, 1, Verdict.REFUSED),  # an answer that says no fails the call
        ({0: R, 1: L}, 1, Verdict.REFUSED),  # refusal wins over loss
        ({}, 1, Verdict.NO_QUORUM),
        ({0: A}, 0, Verdict.OK),  # a quorum below one still needs one replica
        ({}, 0, Verdict.NO_QUORUM),
    ],
)
def test_judge(replies: dict[int, Reply], quorum: int, verdict: Verdict) -> None:
    assert judge(replies, quorum).verdict is verdict


def test_tally_lists_replicas_in_order() -> None:
    tally = judge({2: A, 0: L, 1: A, 3: R}, 1)
    assert (tally.applied, tally.refused, tally.lost) == ((1, 2), (3,), (0,))
