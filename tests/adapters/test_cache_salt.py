"""Splicing a load generation's ``cache_salt`` into a rollout body."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.adapters.cache_salt import check_client_salt, salted
from gateway.errors import BadRequest


def test_no_salt_sends_the_body_untouched() -> None:
    body = b'{"model":"base","prompt":[1,2]}'
    assert salted(body, orjson.loads(body), None) is body


@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"p-v1","prompt":[1,2,3],"max_tokens":4}',
        b'  \n{ "model" : "p-v1", "prompt": "hi" }',
        b'{"prompt":"}{","model":"p-v1"}',
    ],
)
def test_the_salt_is_spliced_into_an_otherwise_identical_object(body: bytes) -> None:
    payload = orjson.loads(body)
    out = salted(body, payload, "ab12.7")
    assert orjson.loads(out) == {**payload, "cache_salt": "ab12.7"}
    assert out.replace(b'"cache_salt":"ab12.7",', b"") == body  # nothing else re-written


def test_a_clients_own_salt_is_combined_not_replaced() -> None:
    def send(own: str, ours: str) -> str:
        payload: dict[str, Any] = {"model": "p-v1", "prompt": [1], "cache_salt": own}
        check_client_salt(payload)
        result = orjson.loads(salted(orjson.dumps(payload), payload, ours))["cache_salt"]
        assert isinstance(result, str)
        return result

    a, b = send("tenant-a", "g.1"), send("tenant-b", "g.1")
    assert a != b and a.startswith("g.1.") and b.startswith("g.1.")  # isolation kept
    assert send("tenant-a", "g.1") == a and send("tenant-a", "g.2") != a
    assert len(send("x" * 128, "f" * 8 + ".123456")) <= 128  # within vLLM's limit


@pytest.mark.parametrize("bad", ["", 3, "a/b", "a@b", "x" * 129, None])
def test_a_bad_client_salt_is_vllms_400(bad: object) -> None:
    payload = {"model": "p-v1", "prompt": [1], "cache_salt": bad}
    if bad is None:
        check_client_salt(payload)  # null: absent, as vLLM reads it; ours replaces it
        assert orjson.loads(salted(orjson.dumps(payload), payload, "g.1"))["cache_salt"] == "g.1"
        return
    with pytest.raises(BadRequest) as info:
        check_client_salt(payload)
    assert info.value.param == "cache_salt" and "cache_salt" in info.value.message
