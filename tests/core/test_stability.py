"""otbrl.stability: the logit-space update norm against autograd, batch statistics, and the
gradient-norm surge detector."""

from __future__ import annotations

import math

import pytest
import torch

import otbrl
from otbrl.stability import SurgeDetector, batch_diagnostics, group_horizons, update_energy


def test_update_energy_is_the_logit_space_squared_norm():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 7, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 7, (3, 5))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1], [0, 0, 0, 0, 0]])
    adv = torch.randn(3, 5, dtype=torch.float64)
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    (grad,) = torch.autograd.grad((adv * logp * mask).sum(), logits)
    expected = grad.square().sum(dim=(1, 2))
    energy = otbrl.token_energy(logits.detach(), tokens)
    torch.testing.assert_close(update_energy(adv, energy, mask), expected)


def test_batch_diagnostics_values():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    adv = torch.tensor([[1.0, -2.0, 9.0], [5.0, 5.0, 5.0], [3.0, 0.0, 0.0]])
    energy = torch.tensor([[0.5, 0.25, 9.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    d = batch_diagnostics(adv, energy, mask)
    assert d["energy/mean"] == pytest.approx(1.75 / 3)
    assert d["energy/traj_mean"] == pytest.approx(1.75 / 2)  # over the two non-empty trajectories
    assert d["adv/mean"] == pytest.approx(2 / 3)
    assert d["adv/mean_sq"] == pytest.approx(14 / 3)
    assert d["adv/abs_max"] == 3.0
    assert d["update_energy/mean"] == pytest.approx((0.5 + 1.0 + 9.0) / 2)
    assert d["update_energy/max"] == pytest.approx(9.0)


def test_batch_diagnostics_on_empty_mask_are_zero_not_nan():
    d = batch_diagnostics(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
    assert all(v == 0.0 for v in d.values())


def test_diagnostics_reject_bad_input():
    with pytest.raises(ValueError, match="energy: must be >= 0"):
        update_energy(torch.ones(1, 2), -torch.ones(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="advantages: shape"):
        batch_diagnostics(torch.ones(1, 3), torch.ones(1, 2), torch.ones(1, 2))


def noisy_norms(steps: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 0.2 * torch.randn(steps, generator=g)).abs().tolist()


def test_surge_detector_fires_on_a_surge_only():
    det = SurgeDetector(factor=3.0, window=20, warmup=5)
    flags = [det.update(x) for x in noisy_norms(60, 0)]
    assert not any(flags)
    assert det.update(10.0)
    assert det.surges == [60]


def test_surge_detector_warmup_and_non_finite():
    det = SurgeDetector(factor=2.0, window=10, warmup=3)
    assert [det.update(x) for x in [1.0, 50.0, 1.0]] == [False, False, False]  # warm-up: never fires
    assert det.update(math.nan)
    assert det.update(torch.tensor(float("inf")))
    assert not det.update(1.0)


def test_surge_detector_adapts_to_a_lasting_new_level():
    det = SurgeDetector(factor=3.0, window=10, warmup=2)
    for x in noisy_norms(20, 1):
        det.update(x)
    flags = [det.update(10.0 * y) for y in noisy_norms(20, 2)]
    assert flags[0] and not flags[-1]


def test_surge_detector_ignores_zero_gradient_steps():
    """A zero norm (no reward spread in any group) must not drag the median to 0: before, the next
    ordinary step after a run of zeros was flagged as a surge."""
    det = SurgeDetector(factor=3.0, window=10, warmup=2)
    norms = noisy_norms(10, 5)
    for x in norms:
        det.update(x)
    assert [det.update(0.0) for _ in range(10)] == [False] * 10
    assert not det.update(1.0) and det.surges == []
    assert list(det.history)[-1] == 1.0 and 0.0 not in det.history


def test_group_horizons_against_a_loop():
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 3, 3, 0, 7, 2, 4]  # row 4 has no policy token: not a member of its group
    mask = torch.zeros(8, 8)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    energy = torch.rand(8, 8, generator=g, dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    got = group_horizons(mask, energy, rewards, groups)

    def cv(xs):
        mean = sum(xs) / len(xs)
        return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)) / mean

    want_len, want_energy, spread = [], [], []
    for gid in range(4):
        rows = [i for i in range(8) if groups[i] == gid and lengths[i] > 0]
        if len(rows) < 2:
            continue  # group 2 has one member left
        want_len.append(cv([lengths[i] for i in rows]))
        want_energy.append(cv([float(energy[i, : lengths[i]].sum()) for i in rows]))
        spread.append(float(len({float(rewards[i]) for i in rows}) > 1))
    assert got["horizon/length_cv"] == pytest.approx(sum(want_len) / 3, rel=1e-12)
    assert got["horizon/energy_cv"] == pytest.approx(sum(want_energy) / 3, rel=1e-12)
    assert got["horizon/reward_spread"] == pytest.approx(sum(spread) / 3) == pytest.approx(1 / 3)
    # only group 0 has a reward spread: its correlation of W_T and reward is +-1 with two members
    e0, e1 = (float(energy[i, : lengths[i]].sum()) for i in (0, 1))
    assert got["horizon/energy_reward_corr"] == pytest.approx(1.0 if e0 > e1 else -1.0)
    lone = group_horizons(mask[:1], energy[:1], rewards[:1], groups[:1])
    assert set(lone.values()) == {0.0}


def test_surge_detector_state_roundtrip():
    a = SurgeDetector(factor=2.5, window=8, warmup=4)
    norms = noisy_norms(30, 3) + [9.0] + noisy_norms(10, 4)
    for x in norms[:20]:
        a.update(x)
    b = SurgeDetector()
    b.load_state_dict(a.state_dict())
    assert [a.update(x) for x in norms[20:]] == [b.update(x) for x in norms[20:]]
    assert a.surges == b.surges and a.surges


@pytest.mark.parametrize("kwargs", [{"factor": 1.0}, {"window": 0}, {"warmup": 0}])
def test_surge_detector_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        SurgeDetector(**kwargs)
