"""GRPO math on hand-computed cases: advantages, clipping, masking, importance ratios."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.grpo import clipped_pg_loss, group_advantages, k3_kl, token_logprobs


def test_advantages_hand_computed() -> None:
    # mean 0.5, population std 0.5 -> (r - 0.5) / 0.5
    adv, mean, std = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert (mean, std) == (0.5, 0.5)
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-6)
    # rewards 1, 2, 3: mean 2, std sqrt(2/3)
    adv, _, std = group_advantages([1.0, 2.0, 3.0])
    assert std == pytest.approx(math.sqrt(2 / 3))
    assert adv == pytest.approx([-1.2247449, 0.0, 1.2247449], abs=1e-6)


def test_advantages_equal_rewards_carry_no_signal() -> None:
    adv, mean, std = group_advantages([0.7] * 8)
    assert adv == pytest.approx([0.0] * 8, abs=1e-6)
    assert mean == pytest.approx(0.7) and std == pytest.approx(0.0, abs=1e-12)


def test_advantages_nan_is_left_out() -> None:
    adv, mean, std = group_advantages([1.0, math.nan, 0.0])
    assert (mean, std) == (0.5, 0.5)
    assert adv == pytest.approx([1.0, 0.0, -1.0], abs=1e-6)
    adv, mean, _ = group_advantages([math.nan, math.nan])
    assert adv == [0.0, 0.0] and math.isnan(mean)


def _one_token(log_ratio: float, adv: float, **kw: float) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.tensor([[-1.0]])
    logp = (old + log_ratio).clone().requires_grad_(True)
    loss, _ = clipped_pg_loss(logp, old, torch.tensor([adv]), torch.ones(1, 1), **kw)
    loss.backward()
    assert logp.grad is not None
    return loss.detach(), logp.grad


@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "grad"),
    [
        (1.0, 1.0, -1.0, -1.0),  # on-policy: loss -A, d/dlogp = -A * ratio
        (1.5, 1.0, -1.2, 0.0),  # above 1+eps with A>0: clipped, no gradient
        (1.5, -1.0, 1.5, 1.5),  # above 1+eps with A<0: unclipped (pessimistic) branch
        (0.5, -1.0, 0.8, 0.0),  # below 1-eps with A<0: clipped, no gradient
        (0.5, 1.0, -0.5, -0.5),  # below 1-eps with A>0: unclipped branch
        (1.1, 2.0, -2.2, -2.2),  # inside the trust region
    ],
)
def test_clipping_hand_computed(ratio: float, adv: float, loss: float, grad: float) -> None:
    got_loss, got_grad = _one_token(math.log(ratio), adv, epsilon_low=0.2)
    assert float(got_loss) == pytest.approx(loss, abs=1e-5)
    assert float(got_grad) == pytest.approx(grad, abs=1e-5)


def test_asymmetric_epsilon_high() -> None:
    # DAPO's clip-higher: 1.25 is inside [0.8, 1.28], so it is not clipped
    loss, grad = _one_token(math.log(1.25), 1.0, epsilon_low=0.2, epsilon_high=0.28)
    assert float(loss) == pytest.approx(-1.25, abs=1e-5)
    assert float(grad) == pytest.approx(-1.25, abs=1e-5)
    loss, _ = _one_token(math.log(1.5), 1.0, epsilon_low=0.2, epsilon_high=0.28)
    assert float(loss) == pytest.approx(-1.28, abs=1e-5)


def test_importance_ratio_and_stats() -> None:
    old = torch.log(torch.tensor([[0.5, 0.25, 0.1]]))
    new = torch.log(torch.tensor([[0.5, 0.5, 0.1]]))  # ratios 1, 2, 1
    loss, st = clipped_pg_loss(new, old, torch.tensor([1.0]), torch.ones(1, 3))
    # token mean of -min(r A, clip(r) A): (-1 - 1.2 - 1) / 3
    assert float(loss) == pytest.approx(-3.2 / 3, abs=1e-5)
    assert st.tokens == 3 and st.ratio_sum == pytest.approx(4.0)
    # TRL's kl: (r - 1) - log r, only the middle token contributes: 1 - ln 2
    assert st.kl_sum == pytest.approx(1 - math.log(2), abs=1e-6)
    assert (st.high_clip_sum, st.low_clip_sum, st.region_clip_sum) == (1.0, 0.0, 1.0)


def test_masking_ignores_prompt_and_padding() -> None:
    old = torch.tensor([[0.0, -1.0, -1.0, 0.0], [0.0, -2.0, 0.0, 0.0]])
    new = torch.tensor([[-9.0, -1.0, -1.0, -math.inf], [5.0, -2.0, 3.0, 3.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    loss, st = clipped_pg_loss(new, old, adv, mask)
    # three on-policy tokens: (-1 - 1 + 2) / 3 = 0; -inf / garbage outside the mask ignored
    assert float(loss) == pytest.approx(0.0, abs=1e-6)
    assert st.tokens == 3 and st.ratio_sum == pytest.approx(3.0)
    assert math.isfinite(float(loss))


def test_step_token_mean_across_micro_batches() -> None:
    """Summing micro-batch losses with the step's token count = the full-batch loss."""
    torch.manual_seed(0)
    new, old = torch.randn(4, 5), torch.randn(4, 5)
    mask = (torch.rand(4, 5) > 0.3).float()
    adv = torch.randn(4)
    full, _ = clipped_pg_loss(new, old, adv, mask)
    n = float(mask.sum())
    a, _ = clipped_pg_loss(new[:2], old[:2], adv[:2], mask[:2], normalizer=n)
    b, _ = clipped_pg_loss(new[2:], old[2:], adv[2:], mask[2:], normalizer=n)
    assert float(a + b) == pytest.approx(float(full), abs=1e-6)


def test_token_logprobs_with_temperature() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])  # [B=1, L=2, V=2]
    ids = torch.tensor([[0, 1]])
    # T=1: softmax([0, ln 3]) -> p(1) = 3/4
    assert float(token_logprobs(logits, ids)[0, 0]) == pytest.approx(math.log(0.75))
    # T=0.5: logits doubled -> p(1) = 9/10
    assert float(token_logprobs(logits, ids, 0.5)[0, 0]) == pytest.approx(math.log(0.9))


def test_k3_kl_hand_computed() -> None:
    val = k3_kl(torch.tensor([math.log(2.0)]), torch.tensor([0.0]))
    assert float(val) == pytest.approx(1 - math.log(2), abs=1e-6)
    assert float(k3_kl(torch.tensor([0.3]), torch.tensor([0.3]))) == 0.0


def test_reference_kl_penalty_adds_beta_k3() -> None:
    old = torch.tensor([[-1.0]])
    ref = torch.tensor([[-1.0 - math.log(2.0)]])  # pi_ref / pi_theta = 1/2
    loss, st = clipped_pg_loss(old.clone(), old, torch.tensor([0.0]), torch.ones(1, 1),
                               ref_logp=ref, beta=0.1)  # fmt: skip
    expected = 0.5 - 1 + math.log(2.0)  # (r - 1) - log r with r = 1/2
    assert st.ref_kl_sum == pytest.approx(expected, abs=1e-6)
    assert float(loss) == pytest.approx(0.1 * expected, abs=1e-6)
