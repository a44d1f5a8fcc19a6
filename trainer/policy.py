"""The trainable policy: base model + peft LoRA, scoring and publishing.

No reference model copy is kept: ``with model.disable_adapter()`` *is* the reference
policy (the frozen base), which is all a KL penalty needs.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from trainer.grpo import token_logprobs

__all__ = ["Policy", "publish_adapter"]


class Policy:
    def __init__(
        self,
        model_dir: str,
        *,
        lora_r: int,
        lora_alpha: int,
        target_modules: str,
        seed: int,
    ):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # float32 on CPU: the trainer's precision (TRL's default dtype too).
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        targets: str | list[str] = (
            "all-linear"
            if target_modules == "all-linear"
            else [t.strip() for t in target_modules.split(",") if t.strip()]
        )
        # Plain LoRA only: no bias, no modules_to_save, no DoRA, no embedding/head targets
        # -- anything else cannot be served by vLLM as an adapter (TRL checks the same).
        config = LoraConfig(
            r=lora_r,
            lora_alpha=lora_alpha,
            target_modules=targets,
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        )
        self.model: Any = get_peft_model(base, config)
        self.model.train()
        self.pad_id = int(self.tokenizer.pad_token_id or 0)
        self.eos_ids = {int(self.tokenizer.eos_token_id)} if self.tokenizer.eos_token_id else set()

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def batch(
        self, seqs: list[tuple[list[int], list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded ``input_ids``, ``attention_mask`` and the completion-token mask.

        ``mask[b, t] = 1`` where position ``t+1`` is a completion token of sample ``b``
        (aligned with :func:`token_logprobs`), so prompt and padding carry no loss.
        """
        length = max(len(p) + len(c) for p, c in seqs)
        ids = torch.full((len(seqs), length), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(seqs), length), dtype=torch.long)
        mask = torch.zeros((len(seqs), length - 1), dtype=torch.float32)
        for b, (p, c) in enumerate(seqs):
            n = len(p) + len(c)
            ids[b, :n] = torch.tensor(p + c, dtype=torch.long)
            attn[b, :n] = 1
            mask[b, len(p) - 1 : n - 1] = 1.0
        return ids, attn, mask

    def logprobs(
        self, ids: torch.Tensor, attn: torch.Tensor, temperature: float, reference: bool = False
    ) -> torch.Tensor:
        if reference:
            with torch.no_grad(), self.model.disable_adapter():
                logits = self.model(input_ids=ids, attention_mask=attn).logits
        else:
            logits = self.model(input_ids=ids, attention_mask=attn).logits
        return token_logprobs(logits, ids, temperature)

    def adapter_state(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model).items()}

    def load_adapter_weights(self, adapter_dir: str | Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(self.model, state)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise RuntimeError(f"checkpoint adapter has unexpected keys: {unexpected[:5]}")

    def save_adapter(self, directory: str | Path) -> None:
        self.model.save_pretrained(str(directory), safe_serialization=True)


def publish_adapter(policy: Policy, lora_dir: Path, lora_name: str, version: int) -> Path:
    """Write ``<lora_dir>/<name>-v<N>`` atomically, exactly as TRL 1.16 does.

    Staged under the dot-prefixed sibling ``.<name>-v<N>.tmp`` (a plain ``<name>.tmp`` in
    the adapter namespace would be a half-written adapter a server could try to read),
    then published with one ``os.rename``: a server reading the directory, even over a
    shared filesystem, never sees a half-flushed adapter.
    """
    lora_dir.mkdir(parents=True, exist_ok=True)
    dest = lora_dir / f"{lora_name}-v{version}"
    tmp = lora_dir / f".{dest.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    policy.save_adapter(tmp)
    (tmp / "README.md").unlink(missing_ok=True)
    shutil.rmtree(dest, ignore_errors=True)
    os.rename(tmp, dest)
    return dest
