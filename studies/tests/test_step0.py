"""`python -m studies step0`: a seed's step-0 score computed ahead of its runs lands beside the records
under this kind of machine, and a new checkout finds it there instead of sampling it again."""

from __future__ import annotations

import json

import pytest

from studies import runs
from studies.cli import main
from studies.step0 import ahead

pytest.importorskip("otbrl.integrations.trl")

EXPERIMENT = """
recipe: smollm2-draws
common: {model: "random:tiny", model_fallback: null, sft_steps: 0, eval_size: 2, eval_samples: 1,
         max_completion_length: 12, max_steps: 1, bf16: false}
arms: {otb: {advantage_estimator: otb, num_generations: 2}}
seeds: [0]
pilot: {seed: 100, seeds: [100], variance_seeds: [103], learning_rates: [1.0e-4]}
"""


def test_a_score_computed_ahead_is_kept_and_found_by_a_new_checkout(tmp_path) -> None:
    spec = tmp_path / "tiny.yaml"
    spec.write_text(EXPERIMENT)
    results, said = tmp_path / "results", []
    assert ahead(str(spec), [7], runs_dir=tmp_path / "a", results=results, log=said.append) == []
    (kept,) = (results / "runs" / "tiny" / runs.STEP0_SCORES).glob("*.json")
    scores = json.loads(kept.read_text())["scores"]
    assert len(scores) == 1 and 0 <= next(iter(scores.values())) <= 1
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
