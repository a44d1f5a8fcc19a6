"""Adapter-only weight sync, TRL 1.16's sequence, plus start-of-run cleanup.

Per sync to version ``N`` (TRL ``_sync_weight_lora``):

1. save the adapter to ``<output_dir>/.vllm_lora/.<name>-vN.tmp`` and ``os.rename`` it
   to ``<name>-vN`` (done *before* pausing: the save is off the wire, and doing it first
   keeps the pause window to the three HTTP calls);
2. ``POST /pause?mode=keep``;
3. ``POST /v1/load_lora_adapter``
   ``{"lora_name": "<name>-vN", "lora_path": ..., "load_inplace": false}``;
4. ``POST /resume``;
5. bump the version (rollouts admitted from now on name ``<name>-vN``);
6. ``POST /v1/unload_lora_adapter`` for ``v(N - max_staleness - 1)`` once positive;
7. delete the directory of ``v(N - max_staleness - 2)``: files outlive their unload by one
   sync, because vLLM resolves ``lora_path`` lazily and a missing directory is fatal.

The wire sequence (pause, load, resume, unload) is byte-for-byte TRL's.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.client import ControlClient
from trainer.policy import Policy, publish_adapter

__all__ = ["AdapterSync", "SyncTiming", "check_server"]

log = logging.getLogger("trainer.sync")

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def check_server(info: dict[str, Any], *, lora_r: int, max_staleness: int) -> None:
    """TRL's adapter-sync preconditions, as hard errors (there is no NCCL fallback here)."""
    lora = info.get("lora_config")
    if lora is None:
        raise RuntimeError("server has no lora_config: start vLLM with --enable-lora")
    dp = int(info.get("parallel_config", {}).get("data_parallel_size", 1))
    if dp != 1:
        raise RuntimeError(f"server reports data_parallel_size={dp}; adapter sync needs 1")
    if int(lora["max_lora_rank"]) < lora_r:
        rank = next((r for r in VLLM_LORA_RANKS if r >= lora_r), lora_r)
        raise RuntimeError(f"LoRA rank {lora_r} > server max_lora_rank; use --max-lora-rank {rank}")
    if int(lora["max_loras"]) < max_staleness + 2:
        raise RuntimeError(
            f"server max_loras={lora['max_loras']} < max_staleness + 2 = {max_staleness + 2}"
        )


@dataclass(slots=True)
class SyncTiming:
    version: int
    save_s: float
    pause_s: float
    load_s: float
    resume_s: float
    total_s: float


@dataclass
class AdapterSync:
    client: ControlClient
    policy: Policy
    lora_dir: Path
    lora_name: str
    max_staleness: int
    version: int = 0
    leftover_dirs: list[Path] = field(default_factory=list)

    def name(self, version: int) -> str:
        return f"{self.lora_name}-v{version}"

    def cleanup_leftovers(self) -> list[str]:
        """Unload every ``<name>-v*`` the server still lists (a killed or earlier run).

        A fresh run restarts at v1 and a resumed one continues from its checkpoint, so any
        listed version is either a stale leftover or a name about to be reused; unloading
        them first means no load ever collides with a leftover name. Their directories are
        deleted one sync later (see ``sync``).
        """
        pattern = re.compile(rf"^{re.escape(self.lora_name)}-v(\d+)$")
        names = [m["id"] for m in self.client.models() if pattern.match(str(m.get("id", "")))]
        for name in sorted(names, key=lambda n: int(n.rsplit("-v", 1)[1])):
            status = self.client.unload_lora_adapter(name)
            log.info("unloaded leftover adapter %s (%d)", name, status)
        if self.lora_dir.is_dir():
            self.leftover_dirs = [p for p in self.lora_dir.iterdir() if p.is_dir()]
        return names

    def sync(self) -> SyncTiming:
        version = self.version + 1
        t0 = time.monotonic()
        path = publish_adapter(self.policy, self.lora_dir, self.lora_name, version)
        t_save = time.monotonic()
        self.client.pause()
        t_pause = time.monotonic()
        try:
            self.client.load_lora_adapter(self.name(version), str(path.resolve()))
        finally:
            # Never leave the server paused: a failed load is fatal for the run, but the
            # replicas must keep serving other clients.
            t_load = time.monotonic()
            self.client.resume()
        t_resume = time.monotonic()
        self.version = version
        stale = version - (self.max_staleness + 1)
        if stale > 0:
            self.client.unload_lora_adapter(self.name(stale))
        if stale > 1:
            shutil.rmtree(self.lora_dir / self.name(stale - 1), ignore_errors=True)
        keep = {self.name(v) for v in range(max(stale, 1), version + 1)}
        for leftover in self.leftover_dirs:
            if leftover.name not in keep:
                shutil.rmtree(leftover, ignore_errors=True)
        self.leftover_dirs = []
        return SyncTiming(
            version=version,
            save_s=t_save - t0,
            pause_s=t_pause - t_save,
            load_s=t_load - t_pause,
            resume_s=t_resume - t_load,
            total_s=time.monotonic() - t0,
        )
