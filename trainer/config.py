"""Driver configuration: one dataclass, named after TRL's ``AsyncGRPOConfig`` fields.

Every field is a CLI flag (``--max-staleness`` for ``max_staleness``) and a key of the
optional ``--config`` file (YAML or JSON). Precedence: flags, then the file, then the
defaults below. Where a field means the same as in TRL, it has TRL's name and meaning;
the few that differ are marked "driver" in their help text.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["TrainConfig", "build_parser", "parse_config"]


@dataclass
class TrainConfig:
    # --- model and data
    model: str = field(
        default=".run/tiny-model",
        metadata={"help": "model directory (HF format); its tokenizer is used too"},
    )
    task: str = field(default="digits", metadata={"help": "digits | arith (driver)"})
    output_dir: str = field(default=".run/train", metadata={"help": "checkpoints, adapters, logs"})
    seed: int = field(default=0, metadata={"help": "seeds torch, sampling seeds and prompts"})
    # --- server
    vllm_server_base_url: str = field(
        default="http://127.0.0.1:8000",
        metadata={"help": "the gateway (or one vLLM replica); alias --gateway"},
    )
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "wait for /health"})
    request_timeout: int = field(default=600, metadata={"help": "per rollout request, seconds"})
    # --- generation (TRL names)
    num_generations: int = field(default=8, metadata={"help": "G samples per prompt"})
    max_completion_length: int = field(default=16, metadata={"help": "max_tokens per request"})
    temperature: float = field(default=0.3, metadata={"help": "sampling temperature"})
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    # --- optimization (TRL names)
    learning_rate: float = field(
        default=1e-2, metadata={"help": "AdamW LR on the LoRA params (tiny-model value)"}
    )
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    epsilon: float = field(default=0.2, metadata={"help": "lower clip ε"})
    epsilon_high: float | None = field(
        default=0.28, metadata={"help": "upper clip ε (DAPO's clip-higher; TRL: = epsilon)"}
    )
    beta: float = field(
        default=0.0, metadata={"help": "KL-to-reference coefficient (reference = adapter off)"}
    )
    per_device_train_batch_size: int = field(
        default=32, metadata={"help": "samples per optimizer step (multiple of num_generations)"}
    )
    micro_batch_size: int = field(default=32, metadata={"help": "samples per forward (driver)"})
    max_steps: int = field(default=100, metadata={"help": "optimizer steps (0: until time)"})
    max_duration_s: float = field(
        default=0.0, metadata={"help": "stop after this many seconds of training (driver)"}
    )
    # --- LoRA (peft names, prefixed lora_)
    lora_r: int = field(default=8, metadata={"help": "LoRA rank (1 allowed)"})
    lora_alpha: int = field(default=16)
    lora_target_modules: str = field(
        default="all-linear", metadata={"help": "'all-linear' or comma-separated module names"}
    )
    # --- async pipeline (TRL names)
    max_staleness: int = field(
        default=1, metadata={"help": "max policy versions a trained sample may lag (TRL: 4)"}
    )
    max_inflight_tasks: int = field(
        default=-1, metadata={"help": "concurrent requests; -1 = max_staleness * batch size"}
    )
    queue_maxsize: int = field(default=1024, metadata={"help": "rollout queue bound, samples"})
    weight_sync_steps: int = field(default=1, metadata={"help": "steps between weight syncs"})
    heartbeat_stale_after_s: float = 300.0
    # --- checkpoints and logging
    save_steps: int = field(default=10, metadata={"help": "checkpoint every N steps (0: end only)"})
    save_total_limit: int = 2
    resume_from_checkpoint: str | None = field(
        default=None, metadata={"help": "'latest', or a checkpoint directory"}
    )
    logging_steps: int = 1
    metrics_file: str | None = field(
        default=None, metadata={"help": "JSONL metrics path (default <output_dir>/metrics.jsonl)"}
    )
    plot_file: str | None = field(
        default=None, metadata={"help": "PNG path (default <output_dir>/curves.png)"}
    )
    progress: bool = field(default=True, metadata={"help": "progress bar"})
    log_level: str = field(default="WARNING", metadata={"help": "python logging level"})
    torch_threads: int = field(
        default=1, metadata={"help": "torch CPU threads for the learner (driver)"}
    )
    lora_name: str = field(default="trl-policy", metadata={"help": "adapter family name"})

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ValueError("num_generations must be >= 2 (group-normalized advantages)")
        if self.per_device_train_batch_size % self.num_generations:
            raise ValueError("per_device_train_batch_size must be a multiple of num_generations")
        if self.max_staleness < 0 or self.weight_sync_steps < 1 or self.lora_r < 1:
            raise ValueError("need max_staleness >= 0, weight_sync_steps >= 1, lora_r >= 1")
        if self.max_steps <= 0 and self.max_duration_s <= 0:
            raise ValueError("set max_steps or max_duration_s")

    @property
    def prompts_per_step(self) -> int:
        return self.per_device_train_batch_size // self.num_generations

    @property
    def inflight_limit(self) -> int:
        """TRL's auto value: ``max_staleness * batch``; at least one whole group."""
        if self.max_inflight_tasks > 0:
            return self.max_inflight_tasks
        batch = self.per_device_train_batch_size
        return max(self.num_generations, max(self.max_staleness, 1) * batch)

    @property
    def epsilon_high_value(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_ALIASES = {"vllm_server_base_url": ["--gateway"], "model": ["--model-dir"]}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def build_parser(prog: str = "python -m trainer") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Async LoRA GRPO driver speaking TRL 1.16's wire protocol.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", help="YAML or JSON file with any of the fields below")
    for f in fields(TrainConfig):
        kind = str(f.type)
        conv: Any = str
        if kind.startswith("int"):
            conv = int
        elif kind.startswith("float"):
            conv = float
        elif kind.startswith("bool"):
            conv = _bool
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f.metadata.get("help", "") + f" (default {default})"
        p.add_argument(_flag(f.name), *_ALIASES.get(f.name, []), dest=f.name, type=conv,
                       help=help_text)  # fmt: skip
    return p


def load_file(path: str | Path) -> dict[str, Any]:
    text = Path(path).read_text()
    if str(path).endswith(".json"):
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    known = {f.name for f in fields(TrainConfig)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    return data


def parse_config(argv: Sequence[str] | None = None) -> TrainConfig:
    ns = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    cfg_file = ns.pop("config", None)
    if cfg_file:
        values.update(load_file(cfg_file))
    values.update(ns)
    return TrainConfig(**values)
