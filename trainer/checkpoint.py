"""Checkpoints: adapter, optimizer, version counter and prompt cursor in ``output_dir``.

Layout, one directory per saved step, written to a temp name and renamed into place so a
kill mid-save leaves the previous checkpoint intact::

    <output_dir>/checkpoint-<step>/
        adapter/                 peft adapter (adapter_config.json + safetensors)
        optimizer.pt             AdamW state
        trainer_state.json       global_step, model_version, prompt_index, rng, seed
        rollout_state.json       {"prompt_index", "model_version"}: TRL 1.16's file

``model_version`` rides along, as in TRL, so that adapter names keep counting across a
resume: restarting at v1 would republish different weights under a name a still-running
server may hold.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.policy import Policy

__all__ = ["TrainState", "find_checkpoint", "load_checkpoint", "save_checkpoint"]

PREFIX = "checkpoint-"


@dataclass
class TrainState:
    global_step: int = 0
    model_version: int = 0
    prompt_index: int = 0
    trained_groups: int = 0
    dropped_stale_total: int = 0
    elapsed_s: float = 0.0


def _checkpoints(output_dir: Path) -> list[Path]:
    found = []
    if output_dir.is_dir():
        for p in output_dir.iterdir():
            if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit():
                found.append(p)
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def find_checkpoint(output_dir: Path, spec: str | None) -> Path | None:
    """``None`` -> no resume; ``latest``/``true`` -> newest in output_dir; else a path."""
    if not spec or spec.lower() in ("false", "no", "none"):
        return None
    if spec.lower() in ("latest", "true", "yes", "last"):
        found = _checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(spec)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint (no trainer_state.json)")
    return path


def save_checkpoint(
    output_dir: Path,
    state: TrainState,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    *,
    keep: int = 2,
) -> Path:
    final = output_dir / f"{PREFIX}{state.global_step}"
    tmp = output_dir / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    policy.save_adapter(tmp / "adapter")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    payload: dict[str, Any] = {
        **state.__dict__,
        "torch_rng": torch.get_rng_state().tolist(),
        "py_rng": repr(random.getstate()),
    }
    (tmp / "trainer_state.json").write_text(json.dumps(payload))
    (tmp / "rollout_state.json").write_text(
        json.dumps({"prompt_index": state.prompt_index, "model_version": state.model_version})
    )
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    for old in _checkpoints(output_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, policy: Policy, optimizer: torch.optim.Optimizer) -> TrainState:
    data = json.loads((path / "trainer_state.json").read_text())
    policy.load_adapter_weights(path / "adapter")
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    torch.set_rng_state(torch.tensor(data["torch_rng"], dtype=torch.uint8))
    fields = TrainState.__dataclass_fields__
    return TrainState(**{k: v for k, v in data.items() if k in fields})
