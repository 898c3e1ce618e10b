"""The variance study's rows of claims.py: each verdict category follows its stated rule on synthetic
study results, and the rows state the task, K and the intervals."""

from __future__ import annotations

import math

from studies.claims import proxy_claim, task_label, variance_claim


def _iv(lo: float, hi: float, k: int = 24) -> dict[str, float]:
    return {"ratio": math.sqrt(lo * hi) if lo == lo else 0.9, "lo": lo, "hi": hi, "k": k, "log_se": 0.1}


def _study(name: str, bounds: list[tuple[float, float]], k: int = 24, corr: dict | None = None) -> dict:
    per_n = {
        str(n): {"nsr_ratios": {name: _iv(lo, hi, k)}, "length_cv": 0.5}
        for n, (lo, hi) in zip((4, 8), bounds, strict=True)
    }
    cfg = {
        "task": "walk",
        "k": 24,
        "prompts": 4,
        "group_sizes": [4, 8],
        "estimators": ["otb"],
        "exact_batches": 16,
        "ref_batches": 8,
        "seed": 0,
        "name": "variance-walk",
    }
    return {"config": cfg, "per_n": per_n, "correlations": corr or {}}


def _verdict(row: tuple[str, str, str, str]) -> str:
    return row[2].split("**")[1]


def test_variance_claim_verdicts() -> None:
    name = "otb / dr_grpo"
    assert _verdict(variance_claim(_study(name, [(0.4, 0.6), (0.7, 0.95)]))) == "held"
    assert _verdict(variance_claim(_study(name, [(0.4, 0.6), (0.9, 1.1)]))) == "inconclusive"
    assert _verdict(variance_claim(_study(name, [(0.4, 0.6), (1.05, 1.3)]))) == "did not hold"
    nan = float("nan")
    assert _verdict(variance_claim(_study(name, [(0.4, 0.6), (nan, nan)]))) == "inconclusive"
    assert _verdict(variance_claim(_study("otb / otb_exact", [(0.4, 0.6), (0.4, 0.6)]))) == "not tested"
    row = variance_claim(_study(name, [(0.4, 0.6), (0.7, 0.95)]))
    assert "walk (within-group length CV 0.50 in the study's samples)" in row[1] and "K=24" in row[1]
    assert "N=4: 0.49 [0.40, 0.60]" in row[1] and "--name variance-walk" in row[3]
    assert "below 1 at every N" in row[2]  # the rule is stated with the verdict
    assert "running_sum16" in variance_claim(_study(name, [(0.4, 0.6)] * 2), "running_sum16")[1]


def test_proxy_claim_verdicts() -> None:
    name = "otb / otb_exact"
    good = {"token": [0.5, 0.8, 0.75, 1000], "sequence": [0.6, 0.9, 0.85, 64]}
    poor = {"token": [0.5, 0.8, 0.75, 1000], "sequence": [0.6, 0.9, 0.6, 64]}
    assert _verdict(proxy_claim(_study(name, [(0.8, 1.2), (0.9, 1.1)], 16, good))) == "held"
    assert _verdict(proxy_claim(_study(name, [(0.8, 1.3), (0.9, 1.1)], 16, good))) == "inconclusive"
    assert _verdict(proxy_claim(_study(name, [(1.3, 1.6), (0.9, 1.1)], 16, good))) == "did not hold"
    assert _verdict(proxy_claim(_study(name, [(0.8, 1.2), (0.9, 1.1)], 16, poor))) == "did not hold"
    assert _verdict(proxy_claim(_study("otb / dr_grpo", [(0.8, 1.2)] * 2))) == "not tested"
    row = proxy_claim(_study(name, [(0.8, 1.2), (0.9, 1.1)], 16, good))
    assert "16 batches per N with exact norms" in row[1] and "Spearman 0.85" in row[1]


def test_task_label_without_lengths() -> None:
    assert task_label({"config": {"task": "running_sum16"}, "per_n": {"4": {}}}) == "running_sum16"


def test_task_label_states_the_samples_horizon() -> None:
    """Every study states, per task, how its samples differ inside a group: averaged over the study's N."""
    res = _study("otb / dr_grpo", [(0.4, 0.6), (0.7, 0.95)])
    res["per_n"]["4"]["horizon"] = {
        "length_cv": 0.4,
        "energy_cv": 1.0,
        "energy_reward_corr": -0.2,
        "reward_spread": 0.5,
    }
    res["per_n"]["8"]["horizon"] = {
        "length_cv": 0.6,
        "energy_cv": 1.2,
        "energy_reward_corr": -0.4,
        "reward_spread": 0.7,
    }
    assert task_label(res) == (
        "walk (within-group length CV 0.50, energy CV 1.10, energy–reward correlation -0.30, "
        "reward spread in 60% of groups in the study's samples)"
    )
    del res["per_n"]["8"]["horizon"]["energy_cv"]  # a key one N lacks is left out, not half-averaged
    assert "energy CV" not in task_label(res) and "length CV 0.50" in task_label(res)
