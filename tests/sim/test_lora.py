"""Runtime LoRA API: every status and body from reference/trl-wire.md, as vLLM sends them."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.testing import SimURL, running_sim


def _load(name: str, path: str = "/lora/a", **extra: object) -> dict[str, object]:
    return {"lora_name": name, "lora_path": path, **extra}


def _error(r: httpx.Response, status: int, err_type: str, message: str) -> None:
    assert r.status_code == status
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {
        "error": {"message": message, "type": err_type, "param": None, "code": status}
    }


async def test_load_ok_is_bare_text_and_listed(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/load_lora_adapter", json=_load("trl-policy-v1", "/o/v1"))
    assert r.status_code == 200
    assert r.text == "Success: LoRA adapter 'trl-policy-v1' added successfully."
    # vLLM returns Response(content=str) without a media type: no Content-Type at all.
    assert "content-type" not in r.headers
    data = (await client.get("/v1/models")).json()["data"]
    assert [m["id"] for m in data] == ["tiny-base", "trl-policy-v1"]
    assert data[0]["max_model_len"] == 256 and data[0]["parent"] is None
    assert data[1]["root"] == "/o/v1" and data[1]["parent"] == "tiny-base"
    assert data[1]["object"] == "model" and data[1]["max_model_len"] is None


async def test_duplicate_name_is_400_unless_inplace(client: httpx.AsyncClient) -> None:
    await client.post("/v1/load_lora_adapter", json=_load("a"))
    r = await client.post("/v1/load_lora_adapter", json=_load("a", load_inplace=False))
    _error(
        r,
        400,
        "InvalidUserInput",
        "The lora adapter 'a' has already been loaded. If you want to load the adapter in "
        "place, set 'load_inplace' to True.",
    )
    r = await client.post("/v1/load_lora_adapter", json=_load("a", "/lora/a2", load_inplace=True))
    assert r.status_code == 200
    assert (await client.get("/v1/models")).json()["data"][1]["root"] == "/lora/a2"


async def test_missing_path_is_404_when_checked(tmp_path: Path) -> None:
    async with (
        running_sim(SimConfig(check_lora_paths=True)) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        missing = str(tmp_path / "nope")
        r = await client.post("/v1/load_lora_adapter", json=_load("x", missing))
        _error(r, 404, "NotFoundError", f"Loading lora x failed: No adapter found for {missing}")
        r = await client.post("/v1/load_lora_adapter", json=_load("x", str(tmp_path)))
        assert r.status_code == 200


async def test_any_path_loads_when_unchecked(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/load_lora_adapter", json=_load("x", "/does/not/exist"))
    assert r.status_code == 200


async def test_rank_above_max_is_500(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 16}))
    async with (
        running_sim(SimConfig(check_lora_paths=True, max_lora_rank=8)) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        r = await client.post("/v1/load_lora_adapter", json=_load("big", str(tmp_path)))
        _error(r, 500, "InternalServerError", "LoRA rank 16 is greater than max_lora_rank 8.")
        assert url.sim.adapters == {}


async def test_unload(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "ghost"})
    _error(r, 404, "NotFoundError", "The lora adapter 'ghost' cannot be found.")
    await client.post("/v1/load_lora_adapter", json=_load("a"))
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert r.status_code == 200
    assert r.text == "Success: LoRA adapter 'a' removed successfully."
    r = await client.post("/v1/completions", json={"model": "a", "prompt": [1, 2]})
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": "The model `a` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


async def test_empty_names_and_bad_requests_are_400(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/load_lora_adapter", json=_load("", "/p"))
    _error(r, 400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided.")
    r = await client.post("/v1/load_lora_adapter", json={"lora_name": "a"})  # no lora_path
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("Bad Request", 400, "body.lora_path")
    r = await client.post(
        "/v1/load_lora_adapter", content=b"{", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request"
    r = await client.post("/v1/load_lora_adapter", content=json.dumps(_load("a")))
    assert r.status_code == 400  # no application/json content type
    assert "Unsupported Media Type" in r.json()["error"]["message"]


async def test_adapters_beyond_max_loras_load_silently(
    sim: SimURL, client: httpx.AsyncClient
) -> None:
    for i in range(sim.sim.config.max_loras + 2):
        r = await client.post("/v1/load_lora_adapter", json=_load(f"v{i}"))
        assert r.status_code == 200
    assert len(sim.sim.adapters) == sim.sim.config.max_loras + 2
