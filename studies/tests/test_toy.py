"""Monte-Carlo checks on the toy autoregressive policy, whose exact policy gradient is known: leave-one-out
OTB is unbiased, the self-inclusive form is not, and OTB has lower variance than the group mean at N = 4
when trajectory energies are heterogeneous. Fixed seeds: the outcomes are deterministic."""

from __future__ import annotations

import pytest
import torch

from studies import toy

SETTINGS = {
    "none": ("dr_grpo", {}),  # with groups of one: plain REINFORCE, no baseline
    "mean": ("dr_grpo", {}),
    "rloo": ("rloo", {}),
    "otb": ("otb", {}),
    "otb_loo": ("otb", {"leave_one_out": True}),
}


@pytest.fixture(scope="module")
def policy() -> toy.ToyPolicy:
    return toy.ToyPolicy.heterogeneous(horizon=6, vocab=5, calm=3.0, seed=0)


@pytest.fixture(scope="module")
def study(policy) -> dict:
    return toy.gradient_study(policy, group_size=4, groups=10_000, seed=0, settings=SETTINGS)


def test_toy_scores_match_autograd(policy):
    traj = toy.sample(policy, 6, torch.Generator().manual_seed(3))
    adv = torch.randn(traj["mask"].shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    theta = policy.theta.clone().requires_grad_(True)
    objective = 0.0
    for i in range(6):
        for t in range(policy.horizon):
            if traj["mask"][i, t]:
                logits = theta[t, traj["prev"][i, t]]
                objective = objective + adv[i, t] * torch.log_softmax(logits, -1)[traj["tokens"][i, t]]
    (expected,) = torch.autograd.grad(objective, theta)
    got = toy.policy_gradients(policy, traj, adv, groups=1) * 6  # the estimator averages over the group
    torch.testing.assert_close(got[0], expected.reshape(-1))
    # The proxy is exact in the tabular policy: w_t is the squared norm of grad_theta log pi(y_t).
    energy = toy.score_energy(policy, traj)
    for t in range(int(traj["mask"][0].sum())):
        logits = theta[t, traj["prev"][0, t]]
        (g,) = torch.autograd.grad(torch.log_softmax(logits, -1)[traj["tokens"][0, t]], theta)
        assert energy[0, t].item() == pytest.approx(g.square().sum().item(), rel=1e-12)


def test_sampler_and_exact_gradient_agree(policy):
    stats = toy.gradient_study(
        policy, group_size=1, groups=20_000, seed=5, settings={"none": SETTINGS["none"]}
    )
    assert stats["none"]["bias_z"] < 4.0


@pytest.mark.parametrize("name", ["rloo", "otb_loo"])
def test_leave_one_out_estimators_are_unbiased(study, name):
    assert study[name]["bias_z"] < 4.0
    assert study[name]["cosine"] > 0.999


def test_self_inclusive_otb_is_biased(study):
    # The positive control that shows the bias test has power: the paper's form shrinks the gradient.
    assert study["otb"]["bias_z_along_g"] < -10


def test_otb_has_lower_variance_than_group_mean(study):
    assert study["otb"]["variance"] < 0.9 * study["mean"]["variance"]
    assert study["otb"]["nsr"] < study["mean"]["nsr"]
    assert study["otb"]["rel_mse"] < study["mean"]["rel_mse"]
