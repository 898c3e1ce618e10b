"""The real-model task pilots' problem draws and rule (studies/llm_pilot2.py, used by pilots 3-5)."""

from __future__ import annotations

import pytest

from otbrl.tasks import get_task
from otbrl.tasks.split import held_out
from studies.llm_pilot2 import FALLBACK, RULE, distinct_problems, pick, qualifies


def test_pilot_draws_are_distinct_problems_and_pilot5s_are_held_out() -> None:
    task = get_task("chat_pair")
    whole = distinct_problems("chat_pair", 64, 0)
    held = distinct_problems("chat_pair", 64, 0, heldout=True)
    for rows in (whole, held):
        assert len({key for _, _, key in rows}) == 64
    side = lambda key: held_out(key, task.heldout_fraction, task.name)  # noqa: E731
    assert all(side(key) for _, _, key in held)
    assert not all(side(key) for _, _, key in whole)  # the whole space's draw has training problems
    assert distinct_problems("chat_pair", 64, 0, heldout=True) == held  # the same on every call
    with pytest.raises(ValueError, match="held-out side has 370"):
        distinct_problems("chat_pair", 371, 0, heldout=True)  # would never end


def test_the_rule_picks_the_highest_cv_that_qualifies_at_the_first_temperature() -> None:
    base = {"problems": 1275, "heldout": 370, "accuracy": 0.3, "cv": 0.35, "capped": 0.1}
    results = {
        ("a", 1.0): {**base, "cv": 0.31},
        ("b", 1.0): {**base, "cv": 0.45, "accuracy": 0.55},  # too accurate for the rule
        ("c", 0.7): {**base, "cv": 0.60},
        ("d", 1.0): {**base, "cv": 0.40},
    }
    assert pick(results) == (("d", 1.0), "rule, T=1.0")
    assert qualifies(results["b", 1.0], FALLBACK) and not qualifies(results["b", 1.0], RULE)
    assert pick({("b", 1.0): results["b", 1.0]}) == (("b", 1.0), "fallback (provisional), T=1.0")
    assert pick({("x", 1.0): {**base, "heldout": 200}}) == (None, "none")


def test_pilot6_fails_a_candidate_on_any_part_of_its_rule_and_reads_rl_cv_over_the_steps() -> None:
    from studies.llm_pilot6 import failures, rl_cv

    def result(accuracy=0.3, cv=0.4, capped=0.1, rl=(0.5,) * 16, heldout=313):  # noqa: ANN001, ANN202
        steps = [{"otb/horizon/length_cv": c} for c in rl]
        probe = {"accuracy": accuracy, "cv": cv, "capped": capped}
        return {"problems": 1080, "heldout": heldout, "probe": probe, "rl": {"steps": steps}}

    assert failures(result()) == []
    assert rl_cv(result(rl=(0.6,) * 8 + (0.2,) * 8)) == pytest.approx((0.4, 0.2))
    assert failures(result(rl=(0.6,) * 8 + (0.2,) * 8)) == ["RL CV over the last half 0.200 < 0.3"]
    assert failures(result(accuracy=0.6))[0].startswith("accuracy 0.600 outside")
    assert failures(result(cv=0.29)) == ["warm-start CV 0.290 < 0.3"]
    assert failures(result(capped=0.31)) == ["0.31 at the cap > 0.3"]
    assert failures(result(heldout=249)) == ["fewer than 250 held out"]
    assert len(failures(result(rl=(0.1,) * 16))) == 2  # both RL checks
