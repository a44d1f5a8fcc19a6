"""``rollout-testbed``: simulated and local replicas, and the demo, one subcommand each."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from importlib import import_module

__all__ = ["main"]

# name -> (module with main(argv), help); imported only when run (the sim needs FastAPI,
# the tiny model torch).
COMMANDS: dict[str, tuple[str, str]] = {
    "sim-replica": ("rollout_testbed.sim.server", "run a simulated vLLM replica"),
    "make-tiny-model": ("rollout_testbed.local.tiny_model", "build the tiny local model"),
    "replicas": ("rollout_testbed.local.replicas", "start/stop/inspect local vLLM or sim replicas"),
    "demo": ("rollout_testbed.demo", "async LoRA GRPO through the gateway (make demo)"),
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in COMMANDS:
        asked = bool(args) and args[0] in ("-h", "--help")
        out = sys.stdout if asked else sys.stderr
        print("usage: rollout-testbed COMMAND [options]   (COMMAND --help for its options)\n",
              file=out)  # fmt: skip
        width = max(len(n) for n in COMMANDS)
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<{width}}  {text}", file=out)
        return 0 if asked else 2
    entry: Callable[[list[str]], int | None] = import_module(COMMANDS[args[0]][0]).main
    return entry(args[1:]) or 0
