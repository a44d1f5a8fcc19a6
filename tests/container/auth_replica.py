"""A simulated replica that requires the upstream token, for the container tests.

The sim replica itself takes any caller; a real upstream (an HF endpoint, a vLLM started
with ``--api-key``) answers 401 without the token. This wraps the sim app in an ASGI check
of ``Authorization: Bearer <token>`` on every path, so a 200 through the gateway proves the
gateway read the token from its mounted file and injected it. ``GET /_auth`` (answered
here, never by the sim) reports how many requests carried the token and how many did not.

    python -m tests.container.auth_replica --port P --token-file F [sim-replica flags]
"""

from __future__ import annotations

import argparse
import hmac
import sys
from pathlib import Path

import orjson
from rollout_testbed.sim.app import create_sim_app
from rollout_testbed.sim.server import build_parser, config_from_args, serve
from starlette.types import ASGIApp, Receive, Scope, Send


class RequireToken:
    """401 for any HTTP request whose bearer token is not ``token``; counts both kinds."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.counts = {"authorised": 0, "rejected": 0}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] == "/_auth":
            await _json(send, 200, self.counts)
            return
        auth = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(auth, self.expected):
            self.counts["rejected"] += 1
            await _json(send, 401, {"error": {"message": "bad token", "code": 401}})
            return
        self.counts["authorised"] += 1
        await self.app(scope, receive, send)


async def _json(send: Send, status: int, body: object) -> None:
    data = orjson.dumps(body)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


def main(argv: list[str] | None = None) -> int:
    outer = argparse.ArgumentParser(add_help=False)
    outer.add_argument("--token-file", type=Path, required=True)
    ours, rest = outer.parse_known_args(argv)
    args = build_parser().parse_args(rest)
    app = RequireToken(create_sim_app(config_from_args(args)), ours.token_file.read_text().strip())
    serve(app, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
