"""claims.md: verdicts follow the stated rules on synthetic study results, and a study that has not
been run is reported as such instead of guessed."""

from __future__ import annotations

import json

import pytest

from otbrl.app.studies.claims import write_claims
from otbrl.app.studies.training_claims import efficiency_claim, lr_decay_question, stability_claim


def _arm(final, reached, seeds=3, saving=None, collapses=(None, None, None), surges=0, tokens=1000.0):  # noqa: ANN001, ANN202
    return {"seeds": seeds, "final": list(final), "held_out": list(final), "total_tokens": [tokens] * seeds,
            "tokens_to_target": [tokens] * reached + [None] * (seeds - reached), "reached": reached,
            "token_saving": saving, "collapses": list(collapses), "surges": surges,
            "decays": [[] for _ in range(seeds)], "first_surge": [None] * seeds}  # fmt: skip


def _variance(otb: list[float], mean: list[float]) -> dict:
    """A variance study whose paired NSR ratio otb / mean has a narrow interval around it at N = 4, 8."""
    per_n = {
        str(n): {
            "stats": {"otb": {"rel_var": o, "nsr": 1.0}, "dr_grpo": {"rel_var": m, "nsr": 1.0}},
            "nsr_ratios": {"otb / dr_grpo": {"ratio": o / m, "lo": 0.9 * o / m, "hi": 1.1 * o / m, "k": 24}},
        }
        for n, o, m in zip((4, 8), otb, mean, strict=True)
    }
    return {"per_n": per_n, "correlations": {}}


def test_efficiency_verdicts() -> None:
    base = {"grpo-N32": _arm([0.9] * 3, 3, saving=0.0, tokens=8000.0)}
    held = {"target": 0.8, "arms": {**base, "otb-N4": _arm([0.85] * 3, 3, saving=0.7)}}
    partly = {"target": 0.8, "arms": {**base, "otb-N4": _arm([0.85] * 3, 3, saving=0.5)}}
    some = {"target": 0.8, "arms": {**base, "otb-N4": _arm([0.7] * 3, 1)}}
    never = {"target": 0.8, "arms": {**base, "otb-N4": _arm([0.5] * 3, 0)}}
    assert "**held**" in efficiency_claim(held)[2]
    assert "**partly**" in efficiency_claim(partly)[2]
    assert "**partly**" in efficiency_claim(some)[2]
    assert "**did not hold**" in efficiency_claim(never)[2]
    assert "70% fewer than grpo-N32" in efficiency_claim(held)[1]


def test_stability_verdicts() -> None:
    collapsing = _arm([0.1] * 3, 0, collapses=(10, 12, None), surges=4)
    calm = _arm([0.5] * 3, 0)
    assert "**held**" in stability_claim({"arms": {"dr_grpo-N4": collapsing, "otb-N4": calm}})[2]
    assert (
        "**did not hold**" in stability_claim({"arms": {"dr_grpo-N4": collapsing, "otb-N4": collapsing}})[2]
    )
    half = _arm([0.3] * 3, 0, collapses=(9, None, None), surges=5)
    assert "**partly**" in stability_claim({"arms": {"dr_grpo-N4": collapsing, "otb-N4": half}})[2]
    assert "not tested" in stability_claim({"arms": {"dr_grpo-N4": calm, "otb-N4": calm}})[2]


def test_write_claims_reports_what_is_missing(tmp_path) -> None:
    (tmp_path / "variance.json").write_text(json.dumps(_variance([0.5, 0.8], [1.0, 1.0])))
    text = write_claims(tmp_path).read_text()
    assert "| (a) OTB lowers" in text and "**held**" in text
    assert "Not run yet: efficiency, efficiency48, stress, tir." in text


def test_no_target_when_the_reference_did_not_improve() -> None:
    res = {"target": None, "note": "grpo-N32 did not improve", "arms": {"otb-N4": _arm([0.2] * 3, 0)}}
    row = efficiency_claim(res, "efficiency48", "long")
    assert "**not measurable**" in row[2] and "grpo-N32 did not improve" in row[1]


def _experiment(tmp_path, roles: str) -> str:
    path = tmp_path / "mine.yaml"
    path.write_text(
        "recipe: demo\nseeds: [0, 1, 2]\nreference: big\n"
        "arms: {big: {}, small: {}, mean4: {}, small-len: {}}\n" + roles
    )
    return str(path)


def test_claims_follow_the_roles_in_the_experiment_yaml(tmp_path) -> None:
    spec = _experiment(tmp_path, "roles: {candidate: small, same_n_baseline: mean4}\n")
    arms = {"big": _arm([0.9] * 3, 3, saving=0.0), "small": _arm([0.85] * 3, 3, saving=0.7),
            "mean4": _arm([0.6] * 3, 0)}  # fmt: skip
    measured, verdict = efficiency_claim({"target": 0.8, "arms": arms}, spec)[1:3]
    assert "**held**" in verdict and "small reaches the target" in verdict and "than big" in verdict
    assert "70% fewer than big" in measured and "final 0.850 vs 0.600" in measured
    assert "otb-N4" not in measured + verdict and "grpo-N32" not in measured + verdict


def test_a_missing_role_is_a_clear_error(tmp_path) -> None:
    spec = _experiment(tmp_path, "roles: {candidate: small}\n")
    res = {"target": 0.8, "arms": {"small": _arm([0.85] * 3, 3, saving=0.7)}}
    with pytest.raises(ValueError, match="no arm has the role 'same_n_baseline'.*roles:"):
        efficiency_claim(res, spec)
    with pytest.raises(ValueError, match="no arm has the role 'group_mean'"):
        stability_claim({"arms": {}}, spec)
    spec = _experiment(tmp_path, "roles: {lr_decay: {small: {linear: small-len}}}\n")
    with pytest.raises(ValueError, match="lr_decay: small needs a `length` variant"):
        lr_decay_question({"arms": {}}, spec)


def test_lr_decay_question_reads_its_variants_from_the_roles(tmp_path) -> None:
    spec = _experiment(tmp_path, "roles: {lr_decay: {small: {length: small-len}}}\n")
    fired = _arm([0.5] * 3, 0, collapses=(None, None, None))
    fired["decays"] = [[4], [], [6]]
    res = {"arms": {"small": _arm([0.3] * 3, 0, collapses=(5, 6, None)), "small-len": fired}}
    measured, verdict = lr_decay_question(res, spec)[1:3]
    assert "small-len: collapsed 0/3, final 0.500 ± 0.000, 2 LR-decay triggers" in measured
    assert verdict.startswith("**held**")
