"""The driver's GRPO math (``trainer/grpo.py``) against TRL 1.16's own code, same inputs.

Nothing of TRL is re-implemented here: every expected value comes out of a TRL function or
method, called on an object built with ``object.__new__`` and given only the attributes the
method reads, set from a real ``AsyncGRPOConfig`` / ``GRPOConfig`` the way the trainers'
``__init__`` sets them. The model forward is the only thing replaced: it hands back chosen
log-probabilities (leaf tensors, so gradients are compared too), and the accelerator is a
one-process stand-in whose ``reduce`` / ``gather`` are the identity, as accelerate's are on
one process.

TRL code under test:

* ``trl.experimental.async_grpo.async_rollout_worker._AsyncRolloutLoop._score_group``:
  rewards (``nansum`` over reward functions, NaN when none scored), group advantages,
  ``reward_std``;
* the packing pipeline ``FixedCountBatcher`` -> ``DataCollatorForRollout`` (``TreeRow``),
  then ``AsyncGRPOTrainer.compute_loss``: importance ratio against the rollout logprobs,
  clipping, token-mean loss, and the ``ratio`` / ``kl`` / ``clip_ratio/*`` metrics;
* ``trl.trainer.grpo_trainer.GRPOTrainer._compute_loss`` for the options the async
  trainer does not have (``loss_type``, ``importance_sampling_level``, ``delta``, ``beta``,
  ``use_bias_correction_kl``) and ``trl.trainer.utils.nanstd`` (``scale_rewards="group"``).

Driver setting -> TRL setting it equals (asserted below to the float32 rounding):

* ``group_advantages`` -> ``AsyncGRPOTrainer`` (no option there: population std,
  ``+ 1e-8``, unscorable samples get 0 and are left out of mean and std).
  ``GRPOTrainer``'s ``scale_rewards="group"`` is *not* the same: Bessel-corrected
  ``nanstd`` and ``+ 1e-4`` (documented by a test; the driver follows the async trainer);
* ``epsilon_low`` -> ``epsilon``; ``epsilon_high`` -> ``epsilon_high`` (``None`` falls back
  to ``epsilon`` in both);
* ``old_logp`` = the logprobs vLLM returned with the rollout -> the async trainer's
  ``old_log_probs``; in ``GRPOTrainer`` terms ``importance_sampling_level="token"`` with
  ``old_per_token_logps`` = those logprobs and no separate vLLM correction
  (``use_vllm=False``);
* ``normalizer`` = the optimizer step's token count, micro-batches summed ->
  ``AsyncGRPOTrainer`` with ``gradient_accumulation_steps=1`` (one TRL micro-batch of
  ``per_device_train_batch_size`` samples; the driver's ``--micro-batch-size`` is a memory
  split inside it), and ``GRPOTrainer`` ``loss_type="dapo"`` at any accumulation (or
  ``"bnpo"`` without accumulation);
* no ratio cap -> ``delta=None``;
* ``beta`` with ``ref_logp`` -> ``GRPOTrainer`` ``beta`` with
  ``use_bias_correction_kl=False`` (the async trainer has no KL term).

Documented differences (a test pins each, so a change on either side shows up):
``loss_type="grpo"`` (per-sequence means; equal only when all lengths are equal),
``"dr_grpo"`` (= the driver with ``normalizer=B * max_completion_length``),
``importance_sampling_level="sequence"`` (equal only when the log-ratio is constant along
each sequence), ``delta`` (caps the ratio on the unclipped side of negative advantages),
``use_bias_correction_kl=True`` (TRL's default: the KL term weighted by the ratio; same
value on-policy, different gradient), and the async trainer with
``gradient_accumulation_steps > 1`` (the mean of micro-batch token means, not the step's
token mean).
"""

from __future__ import annotations

import asyncio
import math
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
import torch
from accelerate import PartialState  # type: ignore[import-untyped]

from trainer.grpo import LossStats, clipped_pg_loss, group_advantages
from trainer.scoring import score_group

# Importing TRL warns about the installed vLLM version (and pytest turns warnings into
# errors); that is TRL's environment check, not something this module can act on.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import trl
    from trl.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig
    from trl.experimental.async_grpo.async_grpo_trainer import (
        AsyncGRPOTrainer,
        DataCollatorForRollout,
        FixedCountBatcher,
    )
    from trl.experimental.async_grpo.async_rollout_worker import (
        RolloutGroup,
        RolloutSample,
        TrainingSequence,
        _AsyncRolloutLoop,
    )
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import nanstd

Reward = float | None
ATOL = 2e-6  # float32 sums of a few hundred terms


@pytest.fixture(scope="module", autouse=True)
def _accelerate_state() -> None:
    """TRL logs through accelerate's logger, which wants the (one-process) state set up."""
    PartialState(cpu=True)


def test_trl_is_the_version_the_driver_mirrors() -> None:
    assert trl.__version__ == "1.16.0"


# --------------------------------------------------------------------------- helpers


class _OneProcess:
    """accelerate on one process: reductions and gathers are the identity."""

    num_processes = 1
    sync_gradients = True

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        assert reduction == "sum"
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    gather_for_metrics = gather


def _quiet_config(cls: type[Any], **kwargs: Any) -> Any:
    """A real TRL config (``TrainingArguments`` underneath), CPU, no reporting."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to="none", **kwargs)


def _reward_func(name: str, values: Sequence[Reward]) -> Callable[..., list[Reward]]:
    def func(**_: Any) -> list[Reward]:
        return list(values)

    func.__name__ = name
    return func


def _trl_score_group(
    columns: Sequence[Sequence[Reward]], sequences: Sequence[TrainingSequence] | None = None
) -> list[RolloutSample]:
    """``_AsyncRolloutLoop._score_group`` on one group, one column per reward function."""
    loop = object.__new__(_AsyncRolloutLoop)
    funcs: list[Any] = [_reward_func(f"r{k}", col) for k, col in enumerate(columns)]
    loop.reward_funcs = funcs
    loop.reward_func_names = [f.__name__ for f in funcs]
    loop._env_reward_types = []
    n = len(columns[0])
    seqs = sequences or [TrainingSequence([1, 2], [0, 1], [0.0, -1.0], f"r{i}") for i in range(n)]
    group = RolloutGroup(
        prompts=[[{"role": "user", "content": "p"}]] * n, reward_kwargs={},
        completions=[[{"role": "assistant", "content": "c"}]] * n,
        completions_ids=[list(s.input_ids) for s in seqs],
        completions_sequences=[[s] for s in seqs], tool_call_counts=[0] * n,
        tool_failure_counts=[0] * n, model_version=0, group_id=0, env_rewards=[None] * n,
        rollout_rewards=[None] * n,
    )  # fmt: skip
    samples: list[RolloutSample] = asyncio.run(loop._score_group(group))
    assert len(samples) == n
    return samples


def _driver_score_group(
    columns: Sequence[Sequence[Reward]],
) -> tuple[list[float], dict[str, float], list[float], float, float]:
    funcs = [_reward_func(f"r{k}", col) for k, col in enumerate(columns)]
    n = len(columns[0])
    totals, per_func = score_group(funcs, ["c"] * n, ["p"] * n, [[1]] * n, {})
    adv, mean, std = group_advantages(totals)
    return totals, per_func, adv, mean, std


def _random_columns(rng: np.random.Generator, g: int, kind: str) -> list[list[Reward]]:
    if kind == "continuous":
        col: list[Reward] = [float(x) for x in rng.normal(0.3, 2.0, g)]
    elif kind == "binary":
        col = [float(x) for x in rng.integers(0, 2, g)]
    elif kind == "offset":  # large common offset: cancellation in (r - mean)
        col = [float(x) for x in 1e6 + rng.normal(0.0, 1e-2, g)]
    else:
        raise AssertionError(kind)
    second: list[Reward] = [float(x) for x in rng.uniform(0.0, 1.0, g)]
    for i in range(g):  # a few samples unscorable by one function, or by both
        u = rng.random()
        if u < 0.15:
            col[i] = None
        elif u < 0.25:
            second[i] = None
        elif u < 0.3:
            col[i] = second[i] = None
    return [col, second]


def _assert_scores_match(columns: Sequence[Sequence[Reward]]) -> list[float]:
    samples = _trl_score_group(columns)
    totals, per_func, adv, _mean, std = _driver_score_group(columns)
    trl_rewards = [s.metrics["reward"] for s in samples]
    assert [math.isnan(r) for r in totals] == [math.isnan(r) for r in trl_rewards]
    assert totals == pytest.approx(trl_rewards, rel=1e-12, abs=1e-12, nan_ok=True)
    assert adv == pytest.approx([s.advantage for s in samples], rel=1e-6, abs=1e-6)
    trl_std = samples[0].metrics["reward_std"]
    assert std == pytest.approx(trl_std, rel=1e-9, abs=1e-12, nan_ok=True)
    for k in range(len(columns)):  # TRL's collator reduces rewards/<f> as a nan-aware mean
        vals = [s.metrics[f"rewards/r{k}"] for s in samples]
        valid = [v for v in vals if not math.isnan(v)]
        want = sum(valid) / len(valid) if valid else math.nan
        assert per_func[f"rewards/r{k}"] == pytest.approx(want, nan_ok=True)
    return [s.advantage for s in samples]


# --------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("kind", ["continuous", "binary", "offset"])
@pytest.mark.parametrize("g", [2, 3, 4, 8, 16, 64])
def test_group_advantages_match_trl_score_group(g: int, kind: str) -> None:
    nonzero = 0
    for seed in range(4):
        rng = np.random.default_rng(1000 * g + seed)
        adv = _assert_scores_match(_random_columns(rng, g, kind))
        nonzero += sum(abs(a) > 1e-3 for a in adv)
    assert nonzero > 0  # the comparison covered real advantages, not only zeros


@pytest.mark.parametrize(
    "columns",
    [
        [[0.7] * 8],  # all equal: no signal
        [[0.1] * 3],  # all equal, not exactly representable
        [[1e6] * 4, [0.5] * 4],  # all equal, large
        [[1.0] + [0.0] * 7],  # one success in eight
        [[1.0, None, 0.0, None]],  # unscorable samples are left out of mean and std
        [[None, 2.0, None]],  # one scorable sample: advantage 0
        [[None, None], [None, None]],  # nothing scorable
        [[1.0, None, None], [None, 2.0, None]],  # disjoint Nones across functions
        [[-3.0, 5.0], [None, 0.25]],  # G=2 with a None in one function
    ],
)
def test_group_advantages_edge_cases_match_trl(columns: list[list[Reward]]) -> None:
    _assert_scores_match(columns)


@pytest.mark.parametrize("g", [2, 3, 8, 64])
def test_sync_scale_rewards_group_uses_bessel_std(g: int) -> None:
    """Documented difference: ``GRPOTrainer(scale_rewards="group")`` divides by TRL's
    ``nanstd`` (Bessel-corrected) + 1e-4; the driver, like the async trainer, by the
    population std + 1e-8. The two std's differ by ``sqrt(n / (n - 1))``."""
    rng = np.random.default_rng(g)
    rewards = [float(x) for x in rng.normal(0.0, 1.0, g)]
    if g > 2:
        rewards[0] = math.nan  # left out by both
    _, _, std = group_advantages(rewards)
    n = sum(not math.isnan(r) for r in rewards)
    trl_std = float(nanstd(torch.tensor(rewards, dtype=torch.float64)))
    # (nanstd's Bessel factor is computed in float32)
    assert trl_std == pytest.approx(std * math.sqrt(n / (n - 1)), rel=1e-6)
    assert trl_std != pytest.approx(std, rel=1e-3)


# --------------------------------------------------------------------------- async loss


@dataclass
class _Rollout:
    input_ids: list[int]
    completion_mask: list[int]  # per input token: 1 = trained
    old: list[float]  # per input token: the rollout logprob of that token (0 on the prompt)
    new: torch.Tensor  # leaf [L]: the current policy's logprob of each token


def _make_rollouts(
    rng: np.random.Generator, group_sizes: Sequence[int], spread: float
) -> list[list[_Rollout]]:
    """Groups sharing a prompt, completions of varied length (some with an untrained span
    inside, like a tool result), log-ratios ~ N(0, spread) so many fall outside the clip.
    Every completion of a group starts with its own token, so no two trained positions
    share a node of TRL's prefix trie (each loss term has its own forward position)."""
    groups = []
    next_first = 5000
    for g in group_sizes:
        prompt = [int(t) for t in rng.integers(10, 4000, int(rng.integers(2, 7)))]
        rollouts = []
        for _ in range(g):
            n = int(rng.integers(1, 13))
            completion = [next_first, *(int(t) for t in rng.integers(10, 4000, n - 1))]
            next_first += 1
            mask = [0] * len(prompt) + [1] * n
            if n >= 6 and rng.random() < 0.5:
                mask[len(prompt) + 2 : len(prompt) + 4] = [0, 0]
            old = [0.0] * len(prompt) + [float(x) for x in -rng.exponential(2.0, n)]
            log_ratio = rng.normal(0.0, spread, len(old))
            new = torch.tensor(np.array(old) + log_ratio, dtype=torch.float32)
            rollouts.append(_Rollout(prompt + completion, mask, old, new.requires_grad_(True)))
        groups.append(rollouts)
    return groups


def _group_columns(rng: np.random.Generator, g: int, index: int) -> list[list[Reward]]:
    if index == 1:
        return [[0.5] * g]  # all equal: advantage 0 for the whole group
    col: list[Reward] = [float(x) for x in rng.normal(0.0, 1.0, g)]
    col[0] = None if index == 2 else col[0]  # an unscorable sample: advantage 0
    return [col]


def _scored(
    groups: Sequence[Sequence[_Rollout]], rng: np.random.Generator
) -> tuple[list[dict[str, Any]], list[float]]:
    """TRL's queued sample dicts (as ``RolloutQueueDataset`` yields them) and the driver's
    advantages, both from the same rewards, in the same sample order."""
    dicts: list[dict[str, Any]] = []
    adv: list[float] = []
    for gid, rollouts in enumerate(groups):
        columns = _group_columns(rng, len(rollouts), gid)
        seqs = [
            TrainingSequence(r.input_ids, r.completion_mask, r.old, f"g{gid}-{i}")
            for i, r in enumerate(rollouts)
        ]
        for s in _trl_score_group(columns, seqs):
            dicts.append({"input_ids": s.input_ids, "completion_mask": s.completion_mask,
                          "old_log_probs": s.old_log_probs, "advantage": s.advantage,
                          "group_id": gid, "metrics": s.metrics})  # fmt: skip
        adv += _driver_score_group(columns)[2]
    return dicts, adv


class _PackedPolicy:
    """Stands in for the model's fused forward: the chosen logprob at each packed position."""

    def __init__(self, log_probs: torch.Tensor, n_forward: int) -> None:
        self.log_probs, self.n_forward = log_probs, n_forward

    def __call__(self, *, input_ids: torch.Tensor, **_: Any) -> Any:
        assert input_ids.shape == (1, self.n_forward)
        lp = self.log_probs.unsqueeze(0)
        return SimpleNamespace(log_probs=lp, entropy=torch.zeros_like(lp))


def _async_trainer(epsilon: float, epsilon_high: float | None, ga: int) -> AsyncGRPOTrainer:
    args = _quiet_config(AsyncGRPOConfig, epsilon=epsilon, epsilon_high=epsilon_high,
                         gradient_accumulation_steps=ga)  # fmt: skip
    t = object.__new__(AsyncGRPOTrainer)
    t.args = args
    t.epsilon_low = args.epsilon  # as AsyncGRPOTrainer.__init__ sets them
    t.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    t.accelerator = _OneProcess()
    t.aux_loss_enabled = False
    t.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t._step_forward_tokens = t._step_trained_tokens = t._step_seq_len_weighted = 0.0
    t._step_samples = t._step_forward_s = 0.0
    return t


def _trl_async_loss(
    trainer: AsyncGRPOTrainer, dicts: list[dict[str, Any]], rollouts: Sequence[_Rollout],
    per_device_train_batch_size: int,
) -> tuple[torch.Tensor, list[float]]:  # fmt: skip
    """TRL's planner, packer and ``compute_loss`` over the samples; the loss summed over
    micro-batches (what ``backward`` accumulates) and each micro-batch's trained tokens."""
    by_id = {id(d): r for d, r in zip(dicts, rollouts, strict=True)}
    collator = DataCollatorForRollout(pad_token_id=0)
    total = torch.zeros(())
    tokens = []
    queue: Any = dicts  # the planner only iterates its source
    planner = FixedCountBatcher(queue, num_processes=1, microbatch_size=per_device_train_batch_size)
    for rows in planner:
        batch = collator([rows])
        sel = batch["token_index"] >= 0
        token_index, segment = batch["token_index"][sel], batch["segment_id"][sel]
        # pack() emits loss terms sample by sample, trained position by position
        vals, olds, segs = [], [], []
        for i, sample in enumerate(rows[0].samples):
            r = by_id[id(sample)]
            for p in range(1, len(r.input_ids)):
                if r.completion_mask[p]:
                    vals.append(r.new[p])
                    olds.append(r.old[p])
                    segs.append(i)
        assert segment.tolist() == segs
        assert batch["old_log_probs"][sel].tolist() == pytest.approx(olds, abs=1e-6)
        assert token_index.unique().numel() == token_index.numel()
        n_forward = int(batch["attention_mask"].sum())
        log_probs = torch.zeros(n_forward).index_put((token_index,), torch.stack(vals))
        loss = cast(Any, trainer).compute_loss(_PackedPolicy(log_probs, n_forward), batch)
        total = total + loss
        tokens.append(float(batch["global_n_tokens"][0]))
    assert sum(tokens) == sum(sum(r.completion_mask) for r in rollouts)  # nothing dropped
    return total, tokens


def _driver_batch(
    rollouts: Sequence[_Rollout],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``[B, L-1]`` tensors, the driver's layout (``token_logprobs`` shifts by
    one): garbage where the mask is 0, ``-inf`` logprobs on the padding."""
    width = max(len(r.input_ids) for r in rollouts) - 1
    logp, old, mask = [], [], []
    for r in rollouts:
        pad = width - (len(r.input_ids) - 1)
        logp.append(torch.cat([r.new[1:], torch.full((pad,), -math.inf)]))
        old.append(torch.tensor(r.old[1:] + [7.0] * pad))
        mask.append(torch.tensor(r.completion_mask[1:] + [0] * pad, dtype=torch.float32))
    return torch.stack(logp), torch.stack(old), torch.stack(mask)


def _driver_loss(
    rollouts: Sequence[_Rollout], adv: Sequence[float], micro_batch: int, *,
    epsilon: float, epsilon_high: float | None, step_normalizer: bool = True,
    **kw: Any,
) -> tuple[torch.Tensor, LossStats]:  # fmt: skip
    """The driver's step as ``trainer/loop.py`` runs it: micro-batches, each normalized by
    the step's token count, losses summed (``step_normalizer=False``: each by its own)."""
    n_tokens = float(sum(sum(r.completion_mask[1:]) for r in rollouts))
    total = torch.zeros(())
    sums = np.zeros(7)
    for i in range(0, len(rollouts), micro_batch):
        logp, old, mask = _driver_batch(rollouts[i : i + micro_batch])
        loss, st = clipped_pg_loss(
            logp, old, torch.tensor(adv[i : i + micro_batch]), mask, epsilon_low=epsilon,
            epsilon_high=epsilon_high, normalizer=n_tokens if step_normalizer else None, **kw,
        )  # fmt: skip
        total = total + loss
        sums += np.array([st.tokens, st.ratio_sum, st.kl_sum, st.low_clip_sum,
                          st.high_clip_sum, st.region_clip_sum, st.ref_kl_sum])  # fmt: skip
    return total, LossStats(*(float(x) for x in sums))


def _f(t: torch.Tensor) -> float:
    return float(t.detach())


def _grads(loss: torch.Tensor, leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, list(leaves), retain_graph=True))


def _assert_grads_equal(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=ATOL, rtol=1e-5)


def _assert_stats_match(metrics: dict[str, list[float]], st: LossStats, *, kl: str) -> None:
    n = st.tokens
    assert metrics["clip_ratio/low_mean"][-1] == pytest.approx(st.low_clip_sum / n, abs=1e-6)
    assert metrics["clip_ratio/high_mean"][-1] == pytest.approx(st.high_clip_sum / n, abs=1e-6)
    assert metrics["clip_ratio/region_mean"][-1] == pytest.approx(st.region_clip_sum / n, abs=1e-6)
    if kl == "rollout":  # the async trainer's logged ratio and kl (k3 vs the rollout policy)
        assert metrics["ratio"][-1] == pytest.approx(st.ratio_sum / n, rel=1e-5)
        assert metrics["kl"][-1] == pytest.approx(st.kl_sum / n, rel=1e-5, abs=1e-6)
    elif kl == "ref":  # GRPOTrainer's kl is the reference-KL term
        assert metrics["kl"][-1] == pytest.approx(st.ref_kl_sum / n, rel=1e-5, abs=1e-6)


EPSILONS = [(0.2, None), (0.2, 0.28), (0.1, 0.5)]


@pytest.mark.parametrize(("epsilon", "epsilon_high"), EPSILONS)
@pytest.mark.parametrize("group_sizes", [(4, 4, 4), (8, 8), (2, 3, 5, 6)])
def test_clipped_loss_matches_async_compute_loss(
    group_sizes: tuple[int, ...], epsilon: float, epsilon_high: float | None
) -> None:
    """End to end: rewards -> advantages -> packed batch -> loss, gradient and metrics."""
    rng = np.random.default_rng(sum(group_sizes) * 7 + int(100 * epsilon))
    groups = _make_rollouts(rng, group_sizes, spread=0.5)
    rollouts = [r for g in groups for r in g]
    dicts, adv = _scored(groups, rng)
    assert adv == pytest.approx([d["advantage"] for d in dicts], abs=1e-6)
    trainer = _async_trainer(epsilon, epsilon_high, ga=1)
    trl_loss, _ = _trl_async_loss(trainer, dicts, rollouts, len(dicts))
    metrics = trainer._metrics["train"]
    # the ratios reach both sides of the clip range, on tokens of both advantage signs
    assert metrics["clip_ratio/low_mean"][-1] > 0 and metrics["clip_ratio/high_mean"][-1] > 0
    leaves = [r.new for r in rollouts]
    trl_grads = _grads(trl_loss, leaves)
    for micro_batch in (len(rollouts), 5, 1):  # the driver's memory split changes nothing
        loss, st = _driver_loss(rollouts, adv, micro_batch, epsilon=epsilon,
                                epsilon_high=epsilon_high)  # fmt: skip
        assert _f(loss) == pytest.approx(_f(trl_loss), abs=ATOL)
        _assert_grads_equal(_grads(loss, leaves), trl_grads)
        _assert_stats_match(metrics, st, kl="rollout")
        assert st.tokens == trainer._step_trained_tokens


def test_async_gradient_accumulation_is_a_mean_of_micro_batch_means() -> None:
    """Documented difference: with ``gradient_accumulation_steps=2`` the async trainer
    normalizes each micro-batch by its own token count and halves it, so the step is the
    mean of two token means; the driver's step is always one token mean (TRL with GA=1)."""
    rng = np.random.default_rng(7)
    groups = _make_rollouts(rng, (4, 4, 4, 4), spread=0.5)
    rollouts = [r for g in groups for r in g]
    dicts, adv = _scored(groups, rng)
    half = len(dicts) // 2
    trl_ga2, tokens = _trl_async_loss(_async_trainer(0.2, 0.28, ga=2), dicts, rollouts, half)
    assert len(tokens) == 2 and tokens[0] != tokens[1]
    trl_ga1, _ = _trl_async_loss(_async_trainer(0.2, 0.28, ga=1), dicts, rollouts, len(dicts))
    driver, _ = _driver_loss(rollouts, adv, half, epsilon=0.2, epsilon_high=0.28)
    assert _f(driver) == pytest.approx(_f(trl_ga1), abs=ATOL)
    assert _f(driver) != pytest.approx(_f(trl_ga2), abs=1e-3)
    # what TRL's GA=2 computes is the driver's per-micro-batch token means, averaged
    per_mb, _ = _driver_loss(rollouts, adv, half, epsilon=0.2, epsilon_high=0.28,
                             step_normalizer=False)  # fmt: skip
    assert _f(per_mb) / 2 == pytest.approx(_f(trl_ga2), abs=ATOL)


# --------------------------------------------------------------------------- GRPOTrainer


@dataclass
class _Batch:
    """``GRPOTrainer``'s layout: completion tokens only, right-padded to ``T``."""

    new: torch.Tensor  # leaf [B, T]
    old: torch.Tensor
    ref: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor


def _make_batch(
    seed: int, b: int = 12, t: int = 10, *, equal_lengths: bool = False,
    constant_log_ratio: bool = False, on_policy: bool = False,
) -> _Batch:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.full((b,), t) if equal_lengths else torch.randint(1, t + 1, (b,), generator=gen)
    if not equal_lengths:
        lengths[0], lengths[1] = t, 0  # one full-length row; one fully masked (truncated)
    mask = (torch.arange(t) < lengths.unsqueeze(1)).float()
    old = -torch.rand(b, t, generator=gen) * 4
    if constant_log_ratio:
        log_ratio = (torch.randn(b, 1, generator=gen) * 0.3).expand(b, t)
    else:
        log_ratio = torch.randn(b, t, generator=gen) * 0.5
    log_ratio = torch.where(mask.bool(), log_ratio, torch.full_like(log_ratio, 3.0))  # garbage
    new = (old + (0.0 if on_policy else 1.0) * log_ratio).requires_grad_(True)
    ref = old + torch.randn(b, t, generator=gen) * 0.3
    adv = torch.randn(b, generator=gen)
    adv[2:4] = 0.0  # an all-equal group: no signal
    return _Batch(new, old, ref, mask, adv)


def _grpo_trainer(**kwargs: Any) -> GRPOTrainer:
    """``GRPOTrainer`` with just what ``_compute_loss`` reads, set as ``__init__`` sets it."""
    args = _quiet_config(GRPOConfig, **kwargs)
    t = object.__new__(GRPOTrainer)
    t.args = args
    t.loss_type = args.loss_type
    t.epsilon_low = args.epsilon
    t.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    t.beta = args.beta
    t.importance_sampling_level = args.importance_sampling_level
    t.off_policy_mask_threshold = args.off_policy_mask_threshold
    t.top_entropy_quantile = args.top_entropy_quantile
    t.use_vllm = args.use_vllm
    t.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction
    t.max_completion_length = args.max_completion_length
    t._entropy_bonus_enabled = args.entropy_coef != 0.0 or args.use_adaptive_entropy
    t.aux_loss_enabled = False
    t.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    t.model = torch.nn.Module()  # .training is True
    t.accelerator = _OneProcess()
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    return t


def _trl_sync_loss(
    trainer: GRPOTrainer, batch: _Batch, rows: slice | None = None,
    num_items_in_batch: float | None = None,
) -> torch.Tensor:  # fmt: skip
    rows = rows or slice(None)
    new, mask = batch.new[rows], batch.mask[rows]
    b, t = new.shape

    def forward(_model: Any, input_ids: torch.Tensor, _attn: torch.Tensor, keep: int,
                **_: Any) -> tuple[torch.Tensor, torch.Tensor, None]:  # fmt: skip
        assert keep == t and input_ids.shape == (b, 3 + t)
        return new, torch.zeros_like(new), None

    cast(Any, trainer)._get_per_token_logps_and_entropies = forward
    n_items = float(batch.mask.sum()) if num_items_in_batch is None else num_items_in_batch
    inputs = {
        "prompt_ids": torch.ones(b, 3, dtype=torch.long), "prompt_mask": torch.ones(b, 3),
        "completion_ids": torch.ones(b, t, dtype=torch.long), "completion_mask": mask,
        "advantages": batch.adv[rows], "old_per_token_logps": batch.old[rows],
        "ref_per_token_logps": batch.ref[rows], "num_items_in_batch": torch.tensor(n_items),
    }  # fmt: skip
    loss: torch.Tensor = cast(Any, trainer)._compute_loss(None, inputs)
    return loss


def _driver_sync(batch: _Batch, **kw: Any) -> tuple[torch.Tensor, LossStats]:
    return clipped_pg_loss(batch.new, batch.old, batch.adv, batch.mask, **kw)


@pytest.mark.parametrize(("epsilon", "epsilon_high"), EPSILONS)
@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_mean_matches_grpo_trainer(
    loss_type: str, epsilon: float, epsilon_high: float | None, seed: int
) -> None:
    batch = _make_batch(seed)
    trainer = _grpo_trainer(loss_type=loss_type, epsilon=epsilon, epsilon_high=epsilon_high,
                            max_completion_length=10)  # fmt: skip
    trl_loss = _trl_sync_loss(trainer, batch)
    loss, st = _driver_sync(batch, epsilon_low=epsilon, epsilon_high=epsilon_high)
    assert _f(loss) == pytest.approx(_f(trl_loss), abs=ATOL)
    _assert_grads_equal(_grads(loss, [batch.new]), _grads(trl_loss, [batch.new]))
    metrics = trainer._metrics["train"]
    assert metrics["clip_ratio/region_mean"][-1] > 0
    _assert_stats_match(metrics, st, kl="none")


def test_dapo_with_accumulation_is_the_step_token_mean() -> None:
    """``loss_type="dapo"`` normalizes every micro-batch by the generation batch's token
    count: summed over GA=2 micro-batches it is the driver's step token mean."""
    batch = _make_batch(3)
    trainer = _grpo_trainer(loss_type="dapo", epsilon_high=0.28, gradient_accumulation_steps=2,
                            max_completion_length=10)  # fmt: skip
    assert cast(GRPOConfig, trainer.args).steps_per_generation == 2
    trl_loss = _trl_sync_loss(trainer, batch, slice(0, 6)) + _trl_sync_loss(
        trainer, batch, slice(6, 12)
    )
    n = float(batch.mask.sum())
    a, _ = clipped_pg_loss(batch.new[:6], batch.old[:6], batch.adv[:6], batch.mask[:6],
                           epsilon_high=0.28, normalizer=n)  # fmt: skip
    b, _ = clipped_pg_loss(batch.new[6:], batch.old[6:], batch.adv[6:], batch.mask[6:],
                           epsilon_high=0.28, normalizer=n)  # fmt: skip
    assert _f(a + b) == pytest.approx(_f(trl_loss), abs=ATOL)
    _assert_grads_equal(_grads(a + b, [batch.new]), _grads(trl_loss, [batch.new]))


def test_grpo_loss_type_is_a_mean_of_sequence_means() -> None:
    """Documented difference: ``loss_type="grpo"`` averages per-sequence token means (rows
    with no tokens count as 0); equal to the driver only when every length is equal."""
    batch = _make_batch(4)
    trl_loss = _trl_sync_loss(_grpo_trainer(loss_type="grpo", max_completion_length=10), batch)
    driver, _ = _driver_sync(batch)
    assert _f(driver) != pytest.approx(_f(trl_loss), abs=1e-3)
    rows = [_driver_sync(_Batch(batch.new[i : i + 1], batch.old[i : i + 1], batch.ref,
                                batch.mask[i : i + 1], batch.adv[i : i + 1]))[0]
            for i in range(batch.new.shape[0])]  # fmt: skip
    per_seq = torch.stack(rows).mean()
    assert _f(per_seq) == pytest.approx(_f(trl_loss), abs=ATOL)
    equal = _make_batch(5, equal_lengths=True)
    trl_equal = _trl_sync_loss(_grpo_trainer(loss_type="grpo", max_completion_length=10), equal)
    assert _f(_driver_sync(equal)[0]) == pytest.approx(_f(trl_equal), abs=ATOL)


def test_dr_grpo_is_the_driver_with_a_constant_normalizer() -> None:
    """Documented difference: ``loss_type="dr_grpo"`` divides by ``B * max_completion_length``
    instead of the token count: the driver's ``normalizer`` argument reproduces it."""
    batch = _make_batch(6)
    trainer = _grpo_trainer(loss_type="dr_grpo", max_completion_length=10)
    trl_loss = _trl_sync_loss(trainer, batch)
    assert _f(_driver_sync(batch)[0]) != pytest.approx(_f(trl_loss), abs=1e-3)
    loss, _ = _driver_sync(batch, normalizer=12 * 10)
    assert _f(loss) == pytest.approx(_f(trl_loss), abs=ATOL)
    _assert_grads_equal(_grads(loss, [batch.new]), _grads(trl_loss, [batch.new]))


def test_sequence_level_importance_sampling_differs() -> None:
    """Documented difference: ``importance_sampling_level="sequence"`` (GSPO) uses one ratio
    per sequence, ``exp(mean log-ratio)``; the driver's is per token (``"token"``). They
    coincide when the log-ratio is constant along each sequence."""
    for constant, same in ((False, False), (True, True)):
        batch = _make_batch(7, constant_log_ratio=constant)
        trainer = _grpo_trainer(loss_type="bnpo", importance_sampling_level="sequence",
                                max_completion_length=10)  # fmt: skip
        trl_loss = _trl_sync_loss(trainer, batch)
        driver, _ = _driver_sync(batch)
        if same:
            assert _f(driver) == pytest.approx(_f(trl_loss), abs=ATOL)
        else:
            assert _f(driver) != pytest.approx(_f(trl_loss), abs=1e-3)


def test_delta_caps_what_the_driver_leaves_unbounded() -> None:
    """Documented difference: ``delta`` (two-sided clipping) caps the ratio on the unclipped
    branch of negative advantages; the driver, like the async trainer, has no cap
    (``delta=None``). Equal whenever no such token has a ratio above ``delta``."""
    batch = _make_batch(8)
    ratio = torch.exp(batch.new.detach() - batch.old)
    hit = (ratio > 1.5) & (batch.adv.unsqueeze(1) < 0) & batch.mask.bool()
    assert hit.any()
    driver, _ = _driver_sync(batch)
    for delta, same in ((None, True), (1.5, False), (1e6, True)):
        trainer = _grpo_trainer(loss_type="bnpo", delta=delta, max_completion_length=10)
        trl_loss = _trl_sync_loss(trainer, batch)
        if same:
            assert _f(driver) == pytest.approx(_f(trl_loss), abs=ATOL)
        else:
            assert _f(driver) > _f(trl_loss) + 1e-3


@pytest.mark.parametrize("beta", [0.04, 0.5])
def test_reference_kl_matches_grpo_trainer_without_bias_correction(beta: float) -> None:
    batch = _make_batch(9)
    trainer = _grpo_trainer(loss_type="bnpo", beta=beta, use_bias_correction_kl=False,
                            epsilon_high=0.28, max_completion_length=10)  # fmt: skip
    trl_loss = _trl_sync_loss(trainer, batch)
    loss, st = _driver_sync(batch, epsilon_high=0.28, ref_logp=batch.ref, beta=beta)
    assert st.ref_kl_sum > 0
    assert _f(loss) == pytest.approx(_f(trl_loss), abs=ATOL)
    _assert_grads_equal(_grads(loss, [batch.new]), _grads(trl_loss, [batch.new]))
    _assert_stats_match(trainer._metrics["train"], st, kl="ref")


def test_bias_corrected_kl_differs_in_gradient() -> None:
    """Documented difference: TRL's default ``use_bias_correction_kl=True`` multiplies the KL
    term by the (differentiable) ratio. On-policy the loss is the same but the gradient is
    not; off-policy both differ. The driver is ``use_bias_correction_kl=False``."""
    for on_policy in (True, False):
        batch = _make_batch(10, on_policy=on_policy)
        trainer = _grpo_trainer(loss_type="bnpo", beta=0.5, max_completion_length=10)
        assert cast(GRPOConfig, trainer.args).use_bias_correction_kl
        trl_loss = _trl_sync_loss(trainer, batch)
        loss, _ = _driver_sync(batch, ref_logp=batch.ref, beta=0.5)
        if on_policy:
            assert _f(loss) == pytest.approx(_f(trl_loss), abs=ATOL)
        else:
            assert _f(loss) != pytest.approx(_f(trl_loss), abs=1e-4)
        diff = (_grads(loss, [batch.new])[0] - _grads(trl_loss, [batch.new])[0]).abs().max()
        assert _f(diff) > 1e-4
