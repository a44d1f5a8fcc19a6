"""GRPO math, kept free of I/O so it can be unit-tested on hand-computed cases.

Everything here mirrors TRL 1.16's ``AsyncGRPOTrainer`` so that a run of this driver and a
run of TRL mean the same thing by ``reward``, ``ratio``, ``kl`` and ``clip_ratio/*``:

* advantages are group-normalized ``(r - mean) / (std + 1e-8)`` with the *population*
  std (``numpy.std``), NaN rewards get advantage 0 and are left out of the statistics;
* the loss is the PPO-clipped surrogate ``-min(rA, clip(r, 1-ε_low, 1+ε_high)A)`` where
  ``r = exp(logπ_θ - logπ_rollout)`` uses the logprobs vLLM returned with the rollout
  (that is what makes stale samples usable: the ratio corrects for the policy lag);
* the loss is a token mean over the whole optimizer step (sum over every completion
  token of every sample, divided by the step's token count), not a per-sequence mean;
* ``kl`` is TRL's logged approximation of KL(rollout ‖ current) per token,
  ``(r - 1) - log r`` (Schulman's k3), and the optional reference penalty uses the same
  estimator against the adapter-disabled base model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "LossStats",
    "clipped_pg_loss",
    "group_advantages",
    "k3_kl",
    "token_logprobs",
]

ADV_EPS = 1e-8


def group_advantages(rewards: Sequence[float]) -> tuple[list[float], float, float]:
    """Advantages of one group of ``G`` samples of the same prompt, plus (mean, std).

    NaN rewards (an unscorable sample) get advantage 0 and are excluded from the mean and
    std, as TRL does, so they neither pull the policy nor distort the baseline. A group
    whose rewards are all equal has all-zero advantages: it carries no learning signal.
    """
    scored = [r for r in rewards if not math.isnan(r)]
    if not scored:
        return [0.0] * len(rewards), math.nan, math.nan
    mean = sum(scored) / len(scored)
    std = math.sqrt(sum((r - mean) ** 2 for r in scored) / len(scored))
    adv = [0.0 if math.isnan(r) else (r - mean) / (std + ADV_EPS) for r in rewards]
    return adv, mean, std


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Logprob of each next token: ``out[b, t] = log softmax(logits[b, t] / T)[ids[b, t+1]]``.

    Shape ``[B, L-1]``. The temperature matters: vLLM samples from ``softmax(logits / T)``
    and, with ``--logprobs-mode processed_logprobs``, returns those logprobs; the trainer
    must score the same distribution or the importance ratio is biased for ``T != 1``.
    """
    scaled = logits[:, :-1, :].float() / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets).squeeze(-1)


def k3_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(q ‖ p) from samples of q: ``(p/q - 1) - log(p/q)``.

    Non-negative, unbiased, low variance (http://joschu.net/blog/kl-approx.html).
    """
    log_ratio = logp - logq
    return torch.exp(log_ratio) - 1.0 - log_ratio


@dataclass(frozen=True, slots=True)
class LossStats:
    """Per-token sums for logging; divide by ``tokens`` for TRL's step means."""

    tokens: float
    ratio_sum: float
    kl_sum: float
    low_clip_sum: float
    high_clip_sum: float
    region_clip_sum: float
    ref_kl_sum: float


def clipped_pg_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    normalizer: float | None = None,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
) -> tuple[torch.Tensor, LossStats]:
    """Clipped policy-gradient loss over the masked tokens, and its logging statistics.

    ``logp``, ``old_logp``, ``mask``: ``[B, T]`` (mask is 1 on completion tokens only:
    prompt and padding never carry gradient). ``advantages``: ``[B]`` (one per sample,
    stamped on all its tokens). ``normalizer`` is the token count of the *whole optimizer
    step*; micro-batches then sum to the step's token mean (default: this batch's count).
    ``ref_logp`` with ``beta > 0`` adds ``beta * k3(KL(π_θ ‖ π_ref))`` per token.
    """
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    m = mask.to(logp.dtype)
    n_tokens = float(m.sum().item())
    denom = normalizer if normalizer is not None else max(n_tokens, 1.0)
    # Padding positions may hold garbage (e.g. -inf from a masked softmax): zero them first
    # so that 0 * inf never turns the sum into NaN.
    log_ratio = torch.where(m.bool(), logp - old_logp, torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logp.dtype).unsqueeze(-1).expand_as(ratio)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    ref_kl = torch.zeros_like(per_token)
    if ref_logp is not None and beta > 0.0:
        ref_kl = k3_kl(torch.where(m.bool(), ref_logp, logp).detach(), logp)
        # k3 with p=π_ref, q=π_θ: gradient flows through logp (the sampled policy's side).
        per_token = per_token + beta * ref_kl
    loss = (per_token * m).sum() / denom
    with torch.no_grad():
        low = ((ratio < 1.0 - epsilon_low) & (adv < 0)).to(m.dtype) * m
        high = ((ratio > 1.0 + eps_high) & (adv > 0)).to(m.dtype) * m
        stats = LossStats(
            tokens=n_tokens,
            ratio_sum=float((ratio * m).sum()),
            kl_sum=float((((ratio - 1.0) - log_ratio) * m).sum()),
            low_clip_sum=float(low.sum()),
            high_clip_sum=float(high.sum()),
            region_clip_sum=float(((low + high) > 0).to(m.dtype).sum()),
            ref_kl_sum=float((ref_kl * m).sum()),
        )
    return loss, stats
