"""https replicas: verified against ``upstream_ca_file`` on both upstream clients (the
routed h1client and aiohttp's control plane), and refused when the CA is unknown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trustme
from rollout_testbed.serve import serve_asgi
from rollout_testbed.sim.app import create_sim_app
from rollout_testbed.sim.config import SimConfig

from gateway.app import create_app
from gateway.config import load_settings


@pytest.fixture
def certs(tmp_path: Path) -> Iterator[tuple[Path, tuple[str, str]]]:
    """(CA bundle, (server cert, key)) for 127.0.0.1, from a CA made for this test."""
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    ca_file, cert, key = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    server.cert_chain_pems[0].write_to_path(str(cert))
    server.private_key_pem.write_to_path(str(key))
    yield ca_file, (str(cert), str(key))


def _settings(replica: str, ca_file: Path | None) -> dict[str, object]:
    values: dict[str, object] = {"replicas": [replica], "health_interval_s": 0.2}
    if ca_file is not None:
        values["upstream_ca_file"] = str(ca_file)
    return values


async def test_https_replica_verified_with_the_configured_ca(
    certs: tuple[Path, tuple[str, str]],
) -> None:
    ca_file, tls = certs
    async with serve_asgi(create_sim_app(SimConfig()), tls=tls) as replica:
        assert replica.startswith("https://")
        settings = load_settings(_settings(replica, ca_file), environ={})
        async with serve_asgi(create_app(settings)) as url, httpx.AsyncClient(base_url=url) as c:
            assert (await c.get("/health")).status_code == 200  # aiohttp probes
            body = {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 2}
            r = await c.post("/v1/completions", json=body)  # h1client
            assert r.status_code == 200, r.text
            load = {"lora_name": "pol-v1", "lora_path": "/adapters/pol-v1"}
            assert (await c.post("/v1/load_lora_adapter", json=load)).status_code == 200
            r = await c.post("/v1/completions", json={**body, "model": "pol-v1", "stream": True})
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


async def test_https_replica_with_an_unknown_ca_is_never_trusted(
    certs: tuple[Path, tuple[str, str]],
) -> None:
    _, tls = certs
    async with serve_asgi(create_sim_app(SimConfig()), tls=tls) as replica:
        settings = load_settings(_settings(replica, None), environ={})
        async with serve_asgi(create_app(settings)) as url, httpx.AsyncClient(base_url=url) as c:
            assert (await c.get("/health")).status_code == 503
            body = {"model": "tiny-base", "prompt": [1, 2, 3], "max_tokens": 2}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["message"] == "No healthy replica."


def test_a_missing_ca_file_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"upstream_ca_file .* is not a file"):
        load_settings(_settings("https://127.0.0.1:1", tmp_path / "nope.pem"), environ={})
