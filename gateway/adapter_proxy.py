"""Interim LoRA load/unload broadcast (replaced by ``gateway.adapters`` once it lands).

All or nothing: a load that fails on some replicas is rolled back on the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson
from starlette.responses import Response

from gateway.errors import BadRequest, BroadcastFailed

if TYPE_CHECKING:
    from gateway.app import Gateway


class BroadcastAdapters:
    def __init__(self, gateway: Gateway) -> None:
        self._gw = gateway

    def candidates(self, model: str | None) -> frozenset[int] | None:
        return None

    def live_names(self, listings: Sequence[Mapping[str, Any]]) -> set[str]:
        sets = [
            {m["id"] for m in listing.get("data", []) if m.get("parent")} for listing in listings
        ]
        return set.intersection(*sets) if sets else set()

    async def handle(self, path: str, payload: Mapping[str, Any], request_id: str) -> Response:
        from gateway.routes import _relay_buffered, describe_failures

        name = payload.get("lora_name")
        if not isinstance(name, str) or not name:
            raise BadRequest("'lora_name' must be a non-empty string.", param="lora_name")
        gw = self._gw
        results = await gw.fan_out("POST", path, body=orjson.dumps(payload))
        failed = [r for r in results if not 200 <= r.status < 300]
        endpoint = path.rsplit("/", 1)[-1]
        gw.metrics.broadcasts.labels(endpoint, "failed" if failed else "ok").inc()
        if not failed:
            return _relay_buffered(results[0], request_id)
        ok = [r.replica for r in results if 200 <= r.status < 300]
        if path.endswith("load_lora_adapter") and ok and not path.endswith("unload_lora_adapter"):
            await gw.fan_out(
                "POST", "/v1/unload_lora_adapter", body=orjson.dumps({"lora_name": name}),
                replicas=ok,
            )  # fmt: skip
        if not ok and len({r.status for r in failed}) == 1 and 400 <= failed[0].status < 500:
            return _relay_buffered(failed[0], request_id)
        raise BroadcastFailed(describe_failures(failed))
