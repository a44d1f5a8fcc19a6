"""``runs.scope``: a run reads its own adapter names in completions and streams."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.runs.scope import StreamUnscope, answer_body, own_listing, unscope_body
from gateway.runs.table import Run
from gateway.runs.usage import RunUsage

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


# -- any layout an OpenAI-compatible server may write reads as vLLM's compact one

PREFIX = "run-a~"
_TEXT = st.lists(
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=4)
    | st.sampled_from(['"model":"run-a~x', '"usage":{', "run-a~", "\\u", "\n\n", '\\"', "\x1b"]),
    max_size=4,
).map("".join)  # generated text that looks like what the gateway scans for


@st.composite
def answers(draw: st.DrawFn) -> tuple[list[dict[str, Any]], bool, tuple[int, int]]:
    """(documents, is_stream, the tokens they carry): a completion or chat body, or a
    stream of chunks (``n`` choices, ``usage: null`` in each chunk or none, the usage
    last), with the run's adapter or the base model, text that looks like JSON keys and
    names, and logprobs that may be ``-Infinity``."""
    model = draw(st.sampled_from([PREFIX + "trl-policy-v3", "tiny-base"]))
    n = draw(st.integers(1, 3))
    tokens = (draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6)))
    usage = {"prompt_tokens": tokens[0], "total_tokens": sum(tokens),
             "completion_tokens": tokens[1],
             "prompt_tokens_details": draw(st.none() | st.just({"cached_tokens": 4}))}  # fmt: skip
    logprob = st.floats(allow_nan=False, max_value=0.0)  # -inf: what Python servers write

    def choice(i: int) -> dict[str, Any]:
        return {"index": i, "text": draw(_TEXT), "logprobs": {"token_logprobs": [draw(logprob)]},
                "finish_reason": draw(st.sampled_from([None, "length"]))}  # fmt: skip

    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": model}
    if not draw(st.booleans()):
        return [{**head, "choices": [choice(i) for i in range(n)], "usage": usage}], False, tokens
    nulls = draw(st.booleans())
    chunks = [{**head, "choices": [choice(i % n)], **({"usage": None} if nulls else {})}
              for i in range(draw(st.integers(0, 4)))]  # fmt: skip
    return [*chunks, {**head, "choices": [], "usage": usage}], True, tokens


LAYOUTS = st.fixed_dictionaries({
    "separators": st.sampled_from([(",", ":"), (", ", ": "), (",", ": "), (" ,", " : ")]),
    "indent": st.sampled_from([None, None, 0, 2, "\t"]),
    "ensure_ascii": st.booleans(),
    "sort_keys": st.booleans(),
})  # fmt: skip


def _escaped(text: str) -> str:
    """Keys and the run's prefix spelled with ``\\u`` escapes, as JSON allows (in key
    and value positions only: a quote inside a string is always escaped, so these
    patterns meet no generated text)."""
    text = re.sub(r'"(model|usage)"(\s*):',
                  lambda m: f'"\\u{ord(m[1][0]):04x}{m[1][1:]}"{m[2]}:', text)  # fmt: skip
    return re.sub(r'(:\s*)"run-a~', r'\1"\\u0072un-a\\u007e', text)


def _write(docs: list[dict[str, Any]], stream: bool, layout: dict[str, Any], shuffle: Any,
           escape: bool, crlf: bool) -> bytes:  # fmt: skip
    def dump(doc: dict[str, Any]) -> str:
        if shuffle is not None:
            doc = _shuffled(doc, shuffle)
        text = json.dumps(doc, **layout)
        return _escaped(text) if escape else text

    if not stream:
        return dump(docs[0]).encode()
    newline = "\r\n" if crlf else "\n"
    events = [newline.join("data: " + line for line in dump(d).split("\n")) for d in docs]
    return "".join(e + newline * 2 for e in [*events, "data: [DONE]"]).encode()


def _shuffled(node: Any, rnd: Any) -> Any:
    if isinstance(node, dict):
        items = [(k, _shuffled(v, rnd)) for k, v in node.items()]
        rnd.shuffle(items)
        return dict(items)
    if isinstance(node, list):
        return [_shuffled(v, rnd) for v in node]
    return node


def _read(out: bytes, stream: bool) -> list[Any]:
    if not stream:
        return [json.loads(out)]
    events = re.split(rb"\r\n\r\n|\n\n", out)
    data = [b"\n".join(line[5:].lstrip(b" ") for line in re.split(rb"\r\n|\n", e)
                       if line.startswith(b"data:")) for e in events]  # fmt: skip
    return [json.loads(d) for d in data if d and d != b"[DONE]"]


def _models(docs: list[Any]) -> list[str]:
    return [d["model"] for d in docs]


@settings(max_examples=300)
@given(answers(), LAYOUTS, st.randoms(use_true_random=False) | st.none(), st.booleans(),
       st.booleans(), st.lists(st.integers(0, 3000), max_size=6))  # fmt: skip
def test_every_layout_counts_and_names_as_the_compact_one(
    answer: tuple[list[dict[str, Any]], bool, tuple[int, int]], layout: dict[str, Any],
    shuffle: Any, escape: bool, crlf: bool, cuts: list[int],
) -> None:  # fmt: skip
    """The same answer written compact (as vLLM does) and in any other valid layout: the
    same tokens counted, the same names read, nothing unread, no prefix on a model."""
    docs, stream, tokens = answer
    compact = _write(docs, stream, {"separators": (",", ":"), "ensure_ascii": False},
                     None, False, False)  # fmt: skip
    other = _write(docs, stream, layout, shuffle, escape, crlf)
    results = []
    for content in (compact, other):
        usage = RunUsage()
        if stream:  # read in pieces, as a relay reads it
            points = sorted({min(c, len(content)) for c in cuts})
            pieces = [content[a:b] for a, b in zip([0, *points], [*points, len(content)],
                                                   strict=True)]  # fmt: skip
            unscope = StreamUnscope(RUN, 200, usage)
            out = b"".join(unscope(p, False) for p in pieces) + unscope(b"", True)
        else:
            out = answer_body(RUN, usage, 200, content)
        assert (usage.prompt_tokens, usage.completion_tokens) == tokens
        assert not usage.unread
        read = _read(out, stream)
        assert not any(m.startswith(PREFIX) for m in _models(read))
        results.append(read)
    assert results[0] == results[1]
    assert _models(results[0]) == [m.removeprefix(PREFIX) for m in _models(docs)]


def test_an_answer_that_is_not_json_loses_the_prefix_and_is_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    usage = RunUsage()
    with caplog.at_level(logging.WARNING, logger="gateway.runs"):
        out = answer_body(RUN, usage, 200, b'{"model": "run-a~trl-policy-v3", "choices": [')
        assert b"run-a~" not in out and usage.unread["model"] == 1
        spelled = b'{"model": "\\u0072un-a~x", "choices": ['  # escaped: not found as text
        answer_body(RUN, usage, 200, spelled)
    assert usage.unread["model"] == 2
    said = [r.getMessage() for r in caplog.records if "for its model" in r.getMessage()]
    assert len(said) == 1 and "run run-a" in said[0]  # once per run and part, not per answer


def test_an_error_body_loses_an_escaped_prefix_too() -> None:
    error = b'{"error": {"message": "The model `\\u0072un-a\\u007etrl-policy-v9` does not exist."}}'
    out = unscope_body(RUN, 404, error)
    assert json.loads(out)["error"]["message"] == "The model `trl-policy-v9` does not exist."


def test_a_crlf_stream_is_passed_on_event_by_event() -> None:
    """A stream whose lines end in CRLF has no ``\\n\\n``: each event still goes out when
    it is whole (it was held to 64 KiB)."""
    unscope = StreamUnscope(RUN, 200)
    event = b'data: {"model":"run-a~trl-policy-v3","choices":[]}\r\n\r\n'
    assert json.loads(unscope(event, False)[6:])["model"] == "trl-policy-v3"


def test_running_usage_of_every_chunk_is_counted_once() -> None:
    """vLLM's ``continuous_usage_stats``: each chunk carries the running total."""
    usage = RunUsage()
    unscope = StreamUnscope(RUN, 200, usage)
    for done in (1, 2, 3):
        chunk = {
            "model": "run-a~x",
            "choices": [],
            "usage": {"prompt_tokens": 5, "completion_tokens": done},
        }
        unscope(b"data: " + json.dumps(chunk).encode() + b"\n\n", False)
    unscope(b"data: [DONE]\n\n", False)
    assert (usage.prompt_tokens, usage.completion_tokens) == (5, 3)


def test_a_listing_in_another_layout_shows_the_runs_own_names_only() -> None:
    listing = (
        b'{"object": "list", "\\u0064ata": [{"id": "tiny-base", "parent": null},\n'
        b' {"id": "run-a\\u007etrl-policy-v2", "parent": "tiny-base"},\n'
        b' {"id": "run-b~trl-policy-v2", "parent": "tiny-base"}]}'
    )
    out = own_listing(RUN, listing)
    assert [d["id"] for d in json.loads(out)["data"]] == ["tiny-base", "trl-policy-v2"]


def test_a_part_first_unread_is_said_without_saying_again_the_part_said_before(
    caplog: pytest.LogCaptureFixture,
) -> None:
    usage = RunUsage()
    with caplog.at_level(logging.WARNING, logger="gateway.runs"):
        answer_body(RUN, usage, 200, b'{"model": "run-a~trl-policy-v3", "choices": [')
        bad_usage = b'{"model": "x", "usage": {"prompt_tokens": 1, "completion_tokens": ['
        answer_body(RUN, usage, 200, bad_usage)
    assert usage.unread == {"model": 1, "usage": 1}
    said = [r.getMessage() for r in caplog.records if "could not be read" in r.getMessage()]
    assert len(said) == 2 and "for its model" in said[0] and "for its usage" in said[1], said
