from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from rollout_testbed.sim.tokenizer import (
    EOS_ID,
    SPECIAL_TOKENS,
    apply_chat_template,
    decode,
    encode,
    message_text,
    sample,
)


@given(st.text())
def test_text_round_trips(text: str) -> None:
    assert decode(encode(text), skip_special_tokens=False) == text


def test_special_tokens() -> None:
    ids = encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == SPECIAL_TOKENS["<|im_start|>"] and ids[-1] == EOS_ID
    assert decode(ids) == "hi"
    assert decode([5000], skip_special_tokens=False) == "<|id:5000|>"
    assert decode([5000]) == ""


def test_chat_template_is_chatml() -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "q"}]},
    ]
    text = decode(apply_chat_template(msgs), skip_special_tokens=False)
    assert text == (
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not decode(apply_chat_template(msgs, False), skip_special_tokens=False).endswith(
        "assistant\n"
    )
    assert message_text(None) == ""


def test_sampling_is_deterministic_and_keyed() -> None:
    a = sample([1, 2, 3], "m", 0, None, 8, num_top=2)
    assert a == sample([1, 2, 3], "m", 0, None, 8, num_top=2)
    assert len(a) == 8 and all(len(t.top) == 3 and t.top[0][0] == t.token_id for t in a)
    ids = [t.token_id for t in a]
    assert ids != [t.token_id for t in sample([1, 2, 3], "other", 0, None, 8)]
    assert ids != [t.token_id for t in sample([1, 2, 3], "m", 1, None, 8)]
    seeded = [t.token_id for t in sample([1, 2, 3], "m", 0, 42, 8)]
    assert seeded == [t.token_id for t in sample([9], "m", 0, 42, 8)]  # seed wins over prompt
    assert all(t.logprob <= 0 for t in a)
