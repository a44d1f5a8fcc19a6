"""FORWARDED paths (``/tokenize``, ``/detokenize``, ...) in multi-run mode are scoped to the
calling run like its rollouts (real sockets, sim replicas): its own adapter names are
translated, another run's are unknown to it, and its answers show its names only."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from gateway.runs.scope import own_listing
from gateway.runs.table import Run
from tests.cluster import Cluster
from tests.runs.test_many_runs import as_run, homes, load, shared

TOKENIZE = {"prompt": "hello"}


async def test_a_runs_own_adapter_is_translated_and_sent_to_its_homes(tmp_path: Path) -> None:
    async with shared(tmp_path) as c, as_run(c, "run-a") as a:
        assert (await a.post("/v1/load_lora_adapter", json=load(tmp_path, "run-a", 1))).is_success
        for _ in range(4):
            r = await a.post("/tokenize", json={**TOKENIZE, "model": "trl-policy-v1"})
            assert r.status_code == 200, r.text  # the sim knows only `run-a~trl-policy-v1`
            assert int(r.headers["x-gateway-replica"]) in homes(c)["run-a"]
            base = await a.post("/tokenize", json={**TOKENIZE, "model": "tiny-base"})
            assert base.status_code == 200 and base.json()["count"] > 0
            assert int(base.headers["x-gateway-replica"]) in homes(c)["run-a"]
        detok = await a.post("/detokenize", json={"model": "trl-policy-v1", "tokens": [104, 105]})
        assert detok.status_code == 200, detok.text
        assert (await a.get("/version")).status_code == 200  # no body: nothing to scope


@pytest.mark.parametrize(
    "model", ["trl-policy-v1", "run-a~trl-policy-v1", "run-b~trl-policy-v1", "trl-policy-v9"]
)
async def test_another_runs_adapter_does_not_exist_for_a_run(tmp_path: Path, model: str) -> None:
    async with shared(tmp_path) as c:
        async with as_run(c, "run-a") as a:
            assert (
                await a.post("/v1/load_lora_adapter", json=load(tmp_path, "run-a", 1))
            ).is_success
        before = _served(c)
        async with as_run(c, "run-b") as b:
            for path, extra in (("/tokenize", TOKENIZE), ("/detokenize", {"tokens": [104]})):
                r = await b.post(path, json={**extra, "model": model})
                assert r.status_code == 404, (path, r.text)  # what a rollout gets: vLLM's 404
                assert r.json()["error"] == {
                    "message": f"The model `{model}` does not exist.",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": 404,
                }
        assert _served(c) == before  # refused at the gateway: no replica was asked


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"model": 7, "prompt": "x"}', "model"),
        (b'{"model": ["trl-policy-v1"], "prompt": "x"}', "model"),
    ],
    ids=["malformed", "not-an-object", "model-number", "model-list"],
)
async def test_bad_forwarded_bodies_are_openai_400s(
    tmp_path: Path, body: bytes, param: str | None
) -> None:
    async with shared(tmp_path) as c, as_run(c, "run-c") as client:
        headers = {"content-type": "application/json"}
        r = await client.post("/tokenize", content=body, headers=headers)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "BadRequestError" and error["param"] == param
        ok = await client.post("/tokenize", json={**TOKENIZE, "model": "tiny-base"})
        assert ok.status_code == 200  # the gateway lives on


def _served(c: Cluster) -> int:
    """Requests the gateway sent to any replica."""
    return sum(r.served for r in c.gateway.pool.replicas)


def test_a_listing_shows_the_base_models_and_the_runs_own_adapters_only() -> None:
    run = Run("run-a", b"k", 1)
    listing = (
        b'{"object":"list","data":[{"id":"tiny-base","object":"model","parent":null},'
        b'{"id":"run-a~trl-policy-v2","object":"model","parent":"tiny-base","root":"/a/v2"},'
        b'{"id":"run-b~trl-policy-v2","object":"model","parent":"tiny-base","root":"/b/v2"},'
        b'{"id":"trl-policy-v999","object":"model","parent":"tiny-base"},'
        b'"run-b~trl-policy-v3","run-a~trl-policy-v3",7]}'
    )
    out = own_listing(run, listing)
    assert b"run-b" not in out and b"run-a~" not in out and b"v999" not in out
    data = orjson.loads(out)["data"]
    assert [d["id"] if isinstance(d, dict) else d for d in data] == [
        "tiny-base", "trl-policy-v2", "trl-policy-v3", 7,
    ]  # fmt: skip
    not_a_listing = b'{"count":2,"tokens":[1,2]}'
    assert own_listing(run, not_a_listing) is not_a_listing
    assert own_listing(Run("", None, 1), listing) is listing  # single-run mode: as it came
