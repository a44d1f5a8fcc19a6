"""Which rollouts name a retired version (``naming.retired_successor``), and what the
gateway does with them, on simulated replicas."""

from __future__ import annotations

import httpx
import pytest

from gateway.adapters.naming import NamePattern, retired_successor
from tests.cluster import cluster

LIVE = ["p-v4", "p-v5", "p-v6", "q-v1", "plain"]


@pytest.mark.parametrize(
    ("asked", "successor"),
    [
        ("p-v1", "p-v4"),  # older than every live one: retired
        ("p-v3", "p-v4"),
        ("p-v4", None),  # live
        ("p-v5", None),
        ("p-v9", None),  # newer: another run's numbering, not retired
        ("q-v0", "q-v1"),
        ("r-v1", None),  # a family with nothing live
        ("plain", None),
        ("p", None),
        ("", None),
    ],
)
def test_retired_successor(asked: str, successor: str | None) -> None:
    assert retired_successor(NamePattern(), asked, LIVE) == successor


def test_run_prefixed_names_stay_within_their_run() -> None:
    live = ["a~p-v5", "a~p-v6", "b~p-v1"]
    assert retired_successor(NamePattern(), "a~p-v2", live) == "a~p-v5"
    assert retired_successor(NamePattern(), "b~p-v0", live) == "b~p-v1"


async def test_a_retired_version_is_served_by_the_oldest_live_one() -> None:
    async with cluster(2, max_staleness=1) as c, httpx.AsyncClient(base_url=c.url) as client:
        for v in (1, 2, 3):
            adapter = {"lora_name": f"p-v{v}", "lora_path": f"/a/p-v{v}"}
            r = await client.post("/v1/load_lora_adapter", json=adapter)
            assert r.status_code == 200, r.text
        body = {"prompt": [1, 2, 3], "max_tokens": 2}
        r = await client.post("/v1/completions", json={**body, "model": "p-v1"})
        assert r.status_code == 200 and r.json()["model"] == "p-v2"  # says who answered
        assert (
            await client.post("/v1/completions", json={**body, "model": "p-v7"})
        ).status_code == 404
        metrics = (await client.get("/metrics")).text
        assert "gateway_retired_version_rollouts_total 1.0" in metrics
