"""``rollout-testbed sim-replica``: serve one simulated vLLM replica with uvicorn.

``gateway.cli`` dispatches the ``sim-replica`` subcommand to ``main(argv)``; flags mirror the
``vllm serve`` ones they stand in for. Example::

    rollout-testbed sim-replica --port 8101 --max-loras 4 --latency-model \\
        prefill=2e-5,decode=1e-3,concurrency=1e-4
"""

from __future__ import annotations

import argparse

import uvicorn
from starlette.types import ASGIApp

from gateway.http.server.serving import listen_socket
from rollout_testbed.sim.app import create_sim_app
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.latency import LatencyModel
from rollout_testbed.sim.layout import LAYOUTS, Spaced

__all__ = ["VLLM_IDLE_S", "add_config_args", "build_parser", "config_from_args", "main", "serve"]

VLLM_IDLE_S = 5
"""How long vLLM keeps an idle keep-alive connection (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``,
uvicorn's default), and so the sim. A client that talks to a replica directly must give
up an idle connection sooner, or its next request can cross the replica's close."""


def _latency(spec: str) -> LatencyModel:
    try:
        return LatencyModel.parse(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollout-testbed sim-replica",
        description="A simulated vLLM replica (OpenAI server, runtime LoRA, dev-mode endpoints).",
    )
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    add_config_args(p)
    p.add_argument("--log-level", default="warning")
    p.add_argument(
        "--json-layout",
        choices=LAYOUTS,
        default="compact",
        help="compact: as vLLM writes JSON; spaced: as json.dumps does (another "
        "OpenAI-compatible server, or a proxy that re-serializes)",
    )
    return p


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The options ``config_from_args`` reads: one replica's, or each of a fleet host's
    (``rollout_testbed.sim.fleet_host``)."""
    d = SimConfig()
    p.add_argument("--model", default=d.model, help="served model name (default %(default)s)")
    p.add_argument("--max-loras", type=int, default=d.max_loras)
    p.add_argument("--max-cpu-loras", type=int, default=None)
    p.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--cache-blocks", type=int, default=d.cache_blocks)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument(
        "--max-num-seqs", type=int, default=None, help="requests run at once (default: no limit)"
    )
    p.add_argument(
        "--latency-model",
        type=_latency,
        default=LatencyModel(),
        metavar="SPEC",
        help="'instant' or 'prefill=S,decode=S,concurrency=S' in seconds per token",
    )
    p.add_argument(
        "--check-lora-paths",
        action="store_true",
        help="answer 404 'No adapter found' for a lora_path that is not a directory",
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        model=args.model,
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        max_lora_rank=args.max_lora_rank,
        block_size=args.block_size,
        cache_blocks=args.cache_blocks,
        max_model_len=args.max_model_len,
        latency=args.latency_model,
        max_num_seqs=args.max_num_seqs,
        check_lora_paths=args.check_lora_paths,
    )


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (without the subcommand name), then serve until interrupted."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    app = create_sim_app(config)
    serve(app if args.json_layout == "compact" else Spaced(app), args)
    return 0


def serve(app: ASGIApp, args: argparse.Namespace) -> None:
    """Serve ``app`` (the sim, or a wrapper around it) on ``args.host``:``args.port``."""
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            loop="uvloop",
            http="httptools",
            ws="none",
            lifespan="off",
            access_log=False,
            log_level=args.log_level,
            timeout_keep_alive=VLLM_IDLE_S,
            timeout_graceful_shutdown=5,  # do not wait forever on requests hung by a fault
        )
    )
    server.run(sockets=[listen_socket(args.host, args.port)])
