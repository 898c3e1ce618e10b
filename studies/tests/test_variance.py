"""`python -m studies variance` and its parts (variance, gradstats, variance_page): batch gradients and exact
norms against per-token float64 autograd on left-padded rollouts, the Gram-matrix statistics against direct
formulas, and `python -m studies variance --quick` end to end."""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import asdict

import pytest
import torch

import otbrl
from otbrl.rollout import Samples
from studies import gradstats as gs
from studies import variance as v
from studies.cli import main
from studies.variance_page import command, matching_group_size


@pytest.fixture(scope="module")
def setup():
    from otbrl.tasks import char_tokenizer, dataset, get_task, tiny_model

    model = tiny_model("tiny", seed=0).double()  # random weights: varied completion lengths
    task = get_task("reverse")  # prompts of 6-10 letters: rows get different left padding
    rows = dataset(task, 3, seed=0)
    r = v.draw(model, char_tokenizer(), task, rows, 2, torch.Generator().manual_seed(0))
    assert (r.attention_mask[:, 0] == 0).any() and (r.mask.sum(-1) < r.mask.shape[1]).any()
    return model, r


def per_token_scores(model: torch.nn.Module, r: Samples) -> dict[tuple[int, int], list[torch.Tensor]]:
    """(row, t) -> grad log pi(y_t), each from its own forward pass on the unpadded prefix."""
    params = [p for p in model.parameters() if p.requires_grad]
    width = r.mask.shape[1]
    out = {}
    for i in range(r.mask.shape[0]):
        lead = int((r.attention_mask[i] == 0).cumprod(0).sum())
        ids = r.input_ids[i, lead:]
        for t in r.mask[i].nonzero().flatten().tolist():
            col = ids.shape[0] - width + t
            logits = model(ids[None, :col]).logits[0, -1]
            out[i, t] = torch.autograd.grad(torch.log_softmax(logits, -1)[ids[col]], params)
    return out


def test_gradients_and_exact_norms_match_per_token_autograd(setup):
    model, r = setup
    scores = per_token_scores(model, r)
    logp, proxy = v.token_logprobs(model, r)
    torch.testing.assert_close(logp.detach().float(), r.logprobs, atol=1e-5, rtol=0)  # what was sampled
    otb = otbrl.compute_advantages(
        "otb", rewards=torch.tensor([1.0, 0, 0, 1, 1, 0]), mask=r.mask, group_ids=r.group_ids, energy=proxy
    ).advantages
    advantages = {
        "ones": torch.ones(r.mask.shape),
        "random": torch.randn(r.mask.shape, generator=torch.Generator().manual_seed(1)),
        "otb": otb,
    }
    got = v.policy_gradients(model, logp, advantages)
    rows = r.mask.shape[0]
    for name, adv in advantages.items():
        want = sum(adv[i, t].double() * torch.cat([s.reshape(-1) for s in g]) for (i, t), g in scores.items())
        torch.testing.assert_close(got[name], want / rows, msg=name)
    exact = v.exact_energy(model, r)
    want = torch.zeros(r.mask.shape, dtype=torch.float64)
    for (i, t), g in scores.items():
        want[i, t] = sum(s.square().sum() for s in g)
    torch.testing.assert_close(exact, want)


def test_gram_statistics_match_direct_formulas():
    g = torch.randn(6, 9, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.5
    ref = torch.randn(9, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.5
    ref_sq = ref.square().sum().item()
    idx = [0, 2, 3, 4, 5]
    got = gs.gradient_stats(g @ g.T, g @ ref, ref_sq, idx)
    sub = g[idx]
    var = sub.var(0).sum().item()  # per-coordinate unbiased variance, summed
    mean = sub.mean(0)
    assert got["rel_var"] == pytest.approx(var / ref_sq)
    assert got["rel_mse"] == pytest.approx((sub - ref).square().sum(1).mean().item() / ref_sq)
    assert got["cosine"] == pytest.approx(torch.cosine_similarity(mean, ref, dim=0).item())
    assert got["nsr"] == pytest.approx(var / (mean.square().sum().item() - var / len(idx)))
    loo = torch.tensor([sub[[j for j in range(5) if j != k]].var(0).sum().item() for k in range(5)])
    se = math.sqrt(4 / 5 * (loo - loo.mean()).square().sum().item()) / ref_sq
    assert got["rel_var_se"] == pytest.approx(se)
    same = g[:1].expand(4, -1)  # one estimator applied to identical batches: no variance
    stats = gs.gradient_stats(same @ same.T, same @ ref, ref_sq, list(range(4)))
    assert stats["rel_var"] == pytest.approx(0.0, abs=1e-12)
    assert stats["rel_mse"] == pytest.approx((g[0] - ref).square().sum().item() / ref_sq)
    ratio, ratio_se = gs.variance_ratio(4 * g @ g.T, g @ g.T, idx)  # doubling the gradients
    assert ratio == pytest.approx(4.0) and ratio_se == pytest.approx(0.0, abs=1e-9)


def _two_estimators(
    gen: torch.Generator, k: int, rho: float, tau2: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """K paired gradients of two estimators with the same mean: g_b = mu + z, g_a = mu + rho z + tau e, with
    z and e ~ N(0, diag(lam)), a decaying spectrum (real gradients' noise has a low effective rank), and
    tr Cov_b / ||mu||^2 = 5. True NSR(a) / NSR(b) = rho^2 + tau^2 (the means are equal)."""
    d = 64
    lam = 1.0 / torch.arange(1, d + 1, dtype=torch.float64) ** 1.5
    lam = lam / lam.sum() * 5.0
    mu = torch.zeros(d, dtype=torch.float64)
    mu[0] = 1.0
    z, e = (torch.randn(k, d, generator=gen, dtype=torch.float64) * lam.sqrt() for _ in range(2))
    return mu + rho * z + math.sqrt(tau2) * e, mu + z


def test_nsr_ratio_interval_covers_the_known_ratio():
    """Over repeated synthetic studies (K = 24 paired batches) the 95% interval of NSR(a) / NSR(b) holds the
    true ratio about 95% of the time (an undetermined interval counts as a miss), never excludes 1 on the
    wrong side, and excludes it once the batches are many."""
    gen, k, reps = torch.Generator().manual_seed(0), 24, 200
    for rho, tau2 in ((0.5, 0.25), (1.0, 0.3)):  # true ratios 0.5 and 1.3
        truth = rho**2 + tau2
        ivs = []
        for _ in range(reps):
            a, b = _two_estimators(gen, k, rho, tau2)
            ivs.append(gs.nsr_ratio(a @ a.T, b @ b.T, list(range(k))))
        coverage = sum(iv.lo <= truth <= iv.hi for iv in ivs) / reps
        assert 0.88 <= coverage <= 0.995, (truth, coverage)
        assert all(iv.k == k and iv.lo <= iv.ratio <= iv.hi for iv in ivs if iv.lo == iv.lo)
    assert sum(iv.hi < 1 for iv in ivs) == 0  # truth 1.3: never significantly below 1
    # Power: with this much noise 24 batches rarely settle a true ratio of 0.5; 96 batches always do here.
    for seed in range(5):
        a, b = _two_estimators(torch.Generator().manual_seed(seed), 96, 0.5, 0.25)
        assert gs.nsr_ratio(a @ a.T, b @ b.T, list(range(96))).hi < 1


def test_nsr_ratio_is_scale_free_unlike_the_variance_ratio():
    """Shrinking every advantage by a factor (a self-inclusive baseline's (N-1)/N) moves the variance ratio,
    not the noise-to-signal ratio: its interval collapses onto 1."""
    a, _ = _two_estimators(torch.Generator().manual_seed(2), 16, 1.0, 0.0)
    idx = list(range(16))
    shrunk = 0.75 * a
    iv = gs.nsr_ratio(shrunk @ shrunk.T, a @ a.T, idx)
    assert iv.ratio == pytest.approx(1.0) and iv.lo == pytest.approx(1.0) and iv.hi == pytest.approx(1.0)
    assert gs.variance_ratio(shrunk @ shrunk.T, a @ a.T, idx)[0] == pytest.approx(0.5625)


def test_nsr_interval_is_undetermined_without_signal():
    """No signal (+-e1, +-e2, +-e3: mean 0, and the debiased signal is negative on every subset): NSR is
    infinite, so the interval is undetermined (NaN) and no verdict can rest on it."""
    eye = torch.eye(3, dtype=torch.float64)
    noise = torch.cat([eye, -eye])
    signal = torch.ones(6, 3, dtype=torch.float64) + 0.1 * noise
    idx = list(range(6))
    for a, b in ((noise, signal), (signal, noise)):
        iv = gs.nsr_ratio(a @ a.T, b @ b.T, idx)
        assert math.isnan(iv.lo) and math.isnan(iv.hi)
    assert not math.isnan(gs.nsr_ratio(signal @ signal.T, signal @ signal.T, idx).lo)


def test_moments_of_vectors_match_plain_loops():
    g = torch.randn(7, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 1.5
    ref = torch.randn(5, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.3
    k, d = g.shape
    mean = [sum(g[i, j].item() for i in range(k)) / k for j in range(d)]
    var = sum((g[i, j].item() - mean[j]) ** 2 for i in range(k) for j in range(d)) / (k - 1)
    mean_sq = sum(m * m for m in mean)
    ref_sq = sum(r * r for r in ref.tolist())
    mse = sum((g[i, j].item() - ref[j].item()) ** 2 for i in range(k) for j in range(d)) / k / ref_sq
    cos = sum(m * r for m, r in zip(mean, ref.tolist(), strict=True)) / math.sqrt(mean_sq * ref_sq)
    m = gs.Moments.of_vectors(g, ref)
    assert m.trace_cov == pytest.approx(var) and m.mean_sq == pytest.approx(mean_sq)
    assert m.rel_mse == pytest.approx(mse) and m.cosine == pytest.approx(cos)
    assert m.nsr(debiased=False) == pytest.approx(var / mean_sq)
    assert m.nsr() == pytest.approx(var / (mean_sq - var / k))
    gram = gs.Moments.of_gram(g @ g.T, list(range(k)), g @ ref, ref_sq)
    for name in ("trace_cov", "rel_mse", "cosine"):
        assert getattr(gram, name) == pytest.approx(getattr(m, name))
    noise = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]], dtype=torch.float64)
    assert gs.Moments.of_vectors(noise).nsr() == math.inf  # no signal at all
    # bias z-scores: (mean projection - truth projection) / its standard error, per direction
    dirs = torch.eye(5, dtype=torch.float64)[:2]
    z = gs.bias_z(g, ref, dirs)
    for j in range(2):
        col = [g[i, j].item() for i in range(k)]
        sd = math.sqrt(sum((c - mean[j]) ** 2 for c in col) / (k - 1) / k)
        assert z[j].item() == pytest.approx((mean[j] - ref[j].item()) / sd)


def test_correlations_and_matching_group_size():
    exact = torch.rand(4, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.1
    mask = torch.ones(4, 5)
    corr = gs.correlations(3 * exact, exact, mask, torch.tensor([0, 0, 1, 1]))
    for p, lp, s, _ in corr.values():
        assert p == pytest.approx(1.0) and lp == pytest.approx(1.0) and s == pytest.approx(1.0)
    assert corr["token"][3] == 20 and corr["sequence"][3] == 4
    assert gs.pearson(torch.tensor([1.0, 2, 3]), torch.tensor([3.0, 2, 1])) == pytest.approx(-1.0)
    curve = {4: 1.0, 8: 0.5, 16: 0.25}
    assert matching_group_size(curve, 0.5) == "~8"
    assert matching_group_size(curve, 0.7) in ("~6", "~5")
    assert matching_group_size(curve, 2.0) == "<= 4"
    assert matching_group_size(curve, 0.1) == "> 16"


def test_unknown_estimator_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="estimators: unknown"):
        main(["variance", "--quick", "--estimators", "otb,nope", "--out", str(tmp_path)])


def test_name_chooses_the_pages_file_stem():
    parser = argparse.ArgumentParser()
    v.add_arguments(parser)
    assert v.config_from_args(parser.parse_args([])).name == "variance"
    cfg = v.config_from_args(parser.parse_args(["--task", "walk", "--name", "variance-walk"]))
    assert cfg.name == "variance-walk" and cfg.task == "walk"
    assert "--name variance-walk" in command(asdict(cfg)) and "--name" not in command(asdict(v.Config()))
    for bad in ("", "../x", "a b", "x.md"):
        with pytest.raises(ValueError, match="--name"):
            v.check_name(bad)


def test_quick_run_writes_the_table_with_every_estimator(tmp_path, capsys):
    main(["variance", "--quick", "--out", str(tmp_path), "--name", "variance-q", "--threads", "1"])
    assert not (tmp_path / "variance.md").exists()  # --name: the pages are variance-q.*
    text = (tmp_path / "variance-q.md").read_text()
    assert (tmp_path / "variance-q.png").stat().st_size > 10_000
    import json

    numbers = json.loads((tmp_path / "variance-q.json").read_text())
    assert set(numbers["per_n"]) == {"4", "8"} and "otb" in numbers["per_n"]["4"]["stats"]
    assert "Regenerate" in text and "--quick" in text and "--name variance-q" in text
    # the headline: paired noise-to-signal ratios with intervals, and the verdict rows
    headline = text.split("## Headline")[1].split("## Method")[0]
    assert re.search(r"\| N=4 \|\s+[\d.]+ \[([\d.]+, [\d.]+|undetermined)\] \(K=5\)", headline), headline
    assert "otb / dr_grpo" in headline and "otb / otb_exact" in headline
    assert re.search(r"\*\*(held|did not hold|inconclusive)\*\*", headline)
    iv = numbers["per_n"]["4"]["nsr_ratios"]["otb / otb_exact"]
    assert iv["k"] == v.QUICK["exact_batches"]
    section = text.split("## Relative variance")[1].split("##")[0]
    for label in v.SETTINGS:
        row = re.search(rf"^\|\s+{label} \|(.*)\|$", section, re.MULTILINE)
        assert row, label
        values = [float(c.split("±")[0]) for c in row.group(1).split("|")]
        assert len(values) == len(v.QUICK["group_sizes"]) and all(math.isfinite(x) and x > 0 for x in values)
    assert re.search(r"otb / dr_grpo", text) and "Pearson" in text


def test_raw_variance_reading_survives_the_json_round_trip():
    """The page is rendered from results read back from JSON too, where N keys are strings: N=16 must
    still sort after N=4 (a lexicographic sort gave "needs N <= 16" for "~16")."""
    from studies.variance_page import _verdict

    per_n = {}
    for n, (gm, otb) in {4: (1.0, 0.25), 8: (0.5, 0.3), 16: (0.25, 0.2)}.items():
        per_n[n] = {
            "stats": {"dr_grpo": {"rel_var": gm}, "otb": {"rel_var": otb}},
            "ratios": {"otb / dr_grpo": (otb / gm, 0.0, 0.0, 8)},
        }
    cfg = {"estimators": ["dr_grpo", "otb"], "prompts": 8, "exact_batches": 0, "k": 8, "task": "walk"}
    res = {"config": cfg, "per_n": per_n}
    lines = _verdict(res, "dr_grpo")
    assert lines == _verdict(json.loads(json.dumps(res)), "dr_grpo")
    assert (
        "At N=4, OTB's raw gradient variance is 0.25x the group mean's; the group mean needs N ~16"
        in (lines[2])
    )
