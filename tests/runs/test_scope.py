"""``runs.scope``: a run reads its own adapter names in completions and streams."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.runs.scope import StreamUnscope, unscope_body
from gateway.runs.table import Run

RUN = Run("run-a", b"k", 1)
BODY = b'{"id":"cmpl-1","object":"text_completion","model":"run-a~trl-policy-v3",' \
    b'"choices":[{"text":"say \\"run-a~trl-policy-v3\\""}]}'  # fmt: skip


def test_only_the_model_field_is_rewritten_in_a_success_body() -> None:
    out = json.loads(unscope_body(RUN, 200, BODY))
    assert out["model"] == "trl-policy-v3"
    assert out["choices"][0]["text"] == 'say "run-a~trl-policy-v3"'  # generated text intact


def test_errors_lose_every_occurrence_of_the_prefix() -> None:
    error = b'{"error":{"message":"The model `run-a~trl-policy-v9` does not exist."}}'
    assert b"run-a~" not in unscope_body(RUN, 404, error)


def _events(n: int) -> bytes:
    chunk = {"object": "text_completion", "model": "run-a~trl-policy-v3",
             "choices": [{"text": "tok"}]}  # fmt: skip
    return b"".join(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
                    for _ in range(n)) + b"data: [DONE]\n\n"  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=400), max_size=12), st.integers(1, 5))
def test_a_stream_cut_anywhere_reads_the_same_as_whole(cuts: list[int], n: int) -> None:
    stream = _events(n)
    points = sorted({min(c, len(stream)) for c in cuts})
    pieces = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    unscope = StreamUnscope(RUN, 200)
    out = b"".join(unscope(p, False) for p in pieces) + unscope(b"", True)
    assert out == unscope_body(RUN, 200, stream)
    assert b"run-a~" not in out and out.count(b'"model":"trl-policy-v3"') == n
