"""A simulated replica started as vLLM is when one of TRL's prerequisites is missing.

    python -m tests.partial_replica PORT [dev-mode] [lora-updating] [enable-lora]

Each word names a prerequisite to leave *off*, mirroring vLLM 0.32's own registration
(``entrypoints/launchers/api_server/routers.py``, ``serve/lora/api_router.py``):

* ``dev-mode``: no ``VLLM_SERVER_DEV_MODE=1``, so the dev and RL routes (``/server_info``,
  ``/pause``, ``/resume``, ``/is_paused``, ``/reset_prefix_cache``, ``/get_world_size``)
  do not exist and answer 404;
* ``lora-updating``: no ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, so the load and unload
  routes do not exist;
* ``enable-lora``: no ``--enable-lora``, so ``/server_info`` reports ``lora_config: null``.

Everything else is the unmodified sim app (``rollout_testbed.sim``), served by uvicorn on a
real socket. ``/sim/stats`` still answers, so a test can prove the gateway's start-up
checks paused, loaded and unloaded nothing.
"""

from __future__ import annotations

import sys
from typing import Annotated, Literal

import orjson
import uvicorn
from fastapi import FastAPI, Query
from fastapi.responses import Response
from rollout_testbed.sim import responses as R
from rollout_testbed.sim.app import create_sim_app
from rollout_testbed.sim.config import SimConfig

DEV_ROUTES = {"/server_info", "/pause", "/resume", "/is_paused", "/reset_prefix_cache",
              "/get_world_size"}  # fmt: skip
LORA_ROUTES = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
OFF = ("dev-mode", "lora-updating", "enable-lora")


def partial_app(off: set[str]) -> FastAPI:
    unknown = off - set(OFF)
    if unknown:
        raise SystemExit(f"unknown prerequisite(s) {sorted(unknown)}; choose from {OFF}")
    cfg = SimConfig()
    app = create_sim_app(cfg)
    drop = (DEV_ROUTES if "dev-mode" in off else set()) | (
        LORA_ROUTES if "lora-updating" in off else set()
    )
    if "enable-lora" in off:
        drop.add("/server_info")
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", "") not in drop]
    if "enable-lora" in off and "dev-mode" not in off:

        @app.get("/server_info")
        async def server_info(
            config_format: Annotated[Literal["text", "json"], Query()] = "text",
        ) -> Response:
            info = R.server_info(cfg, as_json=config_format == "json")
            if isinstance(info["vllm_config"], dict):
                info["vllm_config"]["lora_config"] = None
            return Response(orjson.dumps(info), media_type="application/json")

    return app


def main(argv: list[str]) -> None:
    port, off = int(argv[0]), set(argv[1:])
    uvicorn.run(partial_app(off), host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1:])
