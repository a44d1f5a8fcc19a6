"""prefix.py: every payload shape, malformed input, determinism, family seeding, the cap."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.config import RoutingConfig, model_family
from gateway.routing.prefix import PromptKind, prompt_key

CFG = RoutingConfig()
COMP = "/v1/completions"
CHAT = "/v1/chat/completions"


def key(
    payload: Any,
    path: str = COMP,
    model: str | None = "trl-policy-v1",
    session: str | None = None,
    cfg: RoutingConfig = CFG,
):
    return prompt_key(path, model, payload, session, cfg)


def test_token_ids_blocks_and_cap() -> None:
    ids = list(range(10_000))
    k = key({"prompt": ids})
    assert k is not None and k.kind is PromptKind.TOKENS
    assert len(k.hashes) == CFG.max_blocks  # capped at K
    short = key({"prompt": ids[: CFG.block_size * 3 + 5]})
    assert short is not None and len(short.hashes) == 4 and short.has_tail  # tail chained last
    assert short.hashes[:3] == k.hashes[:3]  # chained: a prefix shares its hashes
    tiny = key({"prompt": [1, 2, 3]})
    assert tiny is not None and len(tiny.hashes) == 1  # shorter than a block still keyed


def test_family_seeding() -> None:
    p = {"prompt": list(range(200))}
    assert key(p, model="trl-policy-v7") == key(p, model="trl-policy-v8")
    assert key(p, model="trl-policy-v7") != key(p, model="other-v7")
    assert key(p, model="trl-policy-v7") != key(p, model=None)
    assert model_family("trl-policy-v12", CFG) == "trl-policy"
    assert model_family("Qwen/Qwen3-0.6B", CFG) == "Qwen/Qwen3-0.6B"
    custom = RoutingConfig(family_fn=lambda m: m.split(":")[0])
    assert model_family("a:b", custom) == "a"
    assert key({**p, "model": "trl-policy-v9"}, model=None) == key(p, model="trl-policy-v1")


def test_text_and_batch() -> None:
    text = "You are helpful. " * 100
    k = key({"prompt": text})
    assert k is not None and k.kind is PromptKind.TEXT
    batch = key({"prompt": [text, "other"]})
    assert batch is not None and batch.hashes == k.hashes and batch.batch == 2
    tok_batch = key({"prompt": [list(range(300)), [5, 6]]})
    assert tok_batch is not None and tok_batch.hashes == key({"prompt": list(range(300))}).hashes


def test_chat_roles_tools_and_extension() -> None:
    sys_msg = {"role": "system", "content": "Be terse. " * 60}
    t1 = [sys_msg, {"role": "user", "content": [{"type": "text", "text": "hi " * 80}]}]
    t2 = [
        *t1,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    k1, k2 = key({"messages": t1}, CHAT), key({"messages": t2}, CHAT)
    assert k1 is not None and k2 is not None and k1.kind is PromptKind.CHAT
    whole = len(k1.hashes) - k1.has_tail
    assert k2.hashes[:whole] == k1.hashes[:whole]  # later turns extend earlier ones
    swapped = [{"role": "user", "content": sys_msg["content"]}, t1[1]]
    assert key({"messages": swapped}, CHAT) != k1  # roles are part of the key
    with_tools = key({"messages": t1, "tools": [{"type": "function"}]}, CHAT)
    assert with_tools != k1


def test_session_overrides() -> None:
    p = {"prompt": list(range(100))}
    a = key(p, session="s1")
    assert a is not None and a.kind is PromptKind.SESSION
    assert a == key({"prompt": [9]}, session="s1")
    assert key({**p, "user": "s1"}) == a
    assert key({**p, "user": ""}) == key(p)


@pytest.mark.parametrize(
    "payload",
    [
        {},
        {"prompt": []},
        {"prompt": ""},
        {"prompt": [-1, 2]},
        {"prompt": [2**40]},
        {"prompt": [1.5]},
        {"prompt": ["a", 3]},
        {"prompt": [[]]},
        {"prompt": [None]},
        {"prompt": {"a": 1}},
        {"prompt": 7},
        {"prompt": [[1, "x"]]},
        {"messages": []},
        {"messages": "hi"},
        {"messages": [1]},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": 3, "content": "x"}]},
        [],
        "str",
        None,
        5,
    ],
)
def test_malformed_gives_no_key(payload: Any) -> None:
    assert key(payload) is None
    assert key(payload, CHAT) is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300)
@given(prompt=json_values, messages=json_values, path=st.sampled_from([COMP, CHAT, "/x"]))
def test_never_raises_and_is_deterministic(prompt: Any, messages: Any, path: str) -> None:
    payload = {"prompt": prompt, "messages": messages}
    first = key(payload, path)
    assert first == key(payload, path)
    if first is not None:
        assert 1 <= len(first.hashes) <= CFG.max_blocks


@given(
    ids=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=3000),
    extra=st.lists(st.integers(0, 2**32 - 1), max_size=300),
)
def test_extension_shares_prefix_hashes(ids: list[int], extra: list[int]) -> None:
    a, b = key({"prompt": ids}), key({"prompt": ids + extra})
    assert a is not None and b is not None
    full = min(len(ids) // CFG.block_size, CFG.max_blocks)
    assert a.hashes[:full] == b.hashes[:full]
