"""``/server_info`` and ``/v1/models`` read any valid JSON a replica writes (real sockets)."""

from __future__ import annotations

import json

import httpx
from rollout_testbed.serve import serve_asgi
from rollout_testbed.sim.app import create_sim_app
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.app import create_app
from gateway.config import load_settings

LONE = "\ud800"  # a lone surrogate: valid JSON (as "\\ud800"), which orjson refuses


class _PythonServerInfo:
    """A replica whose ``/server_info`` is written as a Python server may write it:
    spaced, with a lone surrogate escaped, and data parallel 2 (as one replica of a DP
    deployment reports it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/server_info":
            await self.app(scope, receive, send)
            return
        parts: list[bytes] = []

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.body":
                parts.append(message.get("body", b""))

        await self.app(scope, receive, capture)
        info = json.loads(b"".join(parts))
        info["vllm_config"]["parallel_config"] = {"data_parallel_size": 2, "tag": LONE}
        body = json.dumps(info).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


async def test_server_info_past_orjson_still_presents_dp1() -> None:
    async with serve_asgi(_PythonServerInfo(create_sim_app())) as sim_url:
        settings = load_settings({"replicas": [sim_url]}, environ={})
        async with serve_asgi(create_app(settings)) as url, httpx.AsyncClient(base_url=url) as cl:
            r = await cl.get("/server_info", params={"config_format": "json"})
    assert r.status_code == 200, r.text
    parallel = json.loads(r.content)["vllm_config"]["parallel_config"]
    assert parallel == {"data_parallel_size": 1, "tag": LONE}  # TRL's check, nothing lost
