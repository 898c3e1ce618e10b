"""`python -m studies step0`: a seed's step-0 score computed ahead of its runs lands beside the records
under this kind of machine, and a new checkout finds it there instead of sampling it again."""

from __future__ import annotations

import json

import pytest

from studies import runs
from studies.cli import main
from studies.experiment import load_experiment, pilot_plan, variance_plan
from studies.step0 import ahead, step0_run

pytest.importorskip("otbrl.integrations.trl")

EXPERIMENT = """
recipe: smollm2-draws
common: {model: "random:tiny", model_fallback: null, sft_steps: 0, eval_size: 2, eval_samples: 1,
         max_completion_length: 12, max_steps: 1, bf16: false}
arms: {otb: {advantage_estimator: otb, num_generations: 2}}
seeds: [0]
pilot: {seed: 100, seeds: [100], variance_seeds: [103], learning_rates: [1.0e-4], eval_size: 3}
"""


def test_a_score_computed_ahead_is_kept_and_found_by_a_new_checkout(tmp_path) -> None:
    spec = tmp_path / "tiny.yaml"
    spec.write_text(EXPERIMENT)
    results, said = tmp_path / "results", []
    assert ahead(str(spec), [7], runs_dir=tmp_path / "a", results=results, log=said.append) == []
    (kept,) = (results / "runs" / "tiny" / runs.STEP0_SCORES).glob("*.json")
    scores = json.loads(kept.read_text())["scores"]
    assert len(scores) == 1 and 0 <= next(iter(scores.values())) <= 1
    # the file names the score's seed, so --stop-at's line does not offer seed 7 to `step0` again
    assert json.loads(kept.read_text())["seeds"] == {next(iter(scores)): 7}
    assert any("seed 7: step-0 held-out score" in line and "found" not in line for line in said)

    said.clear()  # a new checkout (another runs folder) of the same kind of machine
    assert ahead(str(spec), [7], runs_dir=tmp_path / "b", results=results, log=said.append) == []
    assert any("seed 7" in line and "found: computed before" in line for line in said)
    assert json.loads(kept.read_text())["scores"] == scores


def test_a_pilot_takes_only_its_own_seeds_and_seeds_are_required(tmp_path, capsys) -> None:
    spec = tmp_path / "tiny.yaml"
    spec.write_text(EXPERIMENT)
    with pytest.raises(ValueError, match=r"seeds \[5\] are not its seeds \[100, 103\]"):
        ahead(str(spec), [103, 5], pilot=True, runs_dir=tmp_path / "p", results=tmp_path / "r")
    with pytest.raises(SystemExit):
        main(["step0", str(spec)])  # --seeds is required
    assert "--seeds" in capsys.readouterr().err


def test_a_score_ahead_is_computed_with_the_settings_the_seeds_runs_get(tmp_path) -> None:
    """A pilot's own settings (here its eval_size) are the ones its runs evaluate with, so the score is
    computed with them: otherwise its key would differ and no run would find it. Arm, rate and folder
    are what may differ (the score depends on none of them)."""
    spec = tmp_path / "tiny.yaml"
    spec.write_text(EXPERIMENT)
    exp = load_experiment(str(spec))
    free = ("seed", "output_dir", "learning_rate", "eval_before_only")

    def same(overrides: dict) -> dict:
        return {k: v for k, v in overrides.items() if k not in free}

    ahead_of = step0_run(exp, tmp_path, 103, pilot=True)
    assert ahead_of.overrides["eval_size"] == 3 and ahead_of.overrides["eval_before_only"] is True
    (later,) = variance_plan(exp, tmp_path, {"otb": 1e-4})
    assert same(ahead_of.overrides) == same(later.overrides) and later.seed == ahead_of.seed == 103
    assert same(step0_run(exp, tmp_path, 100, pilot=True).overrides) == same(
        pilot_plan(exp, tmp_path)[0].overrides
    )
