"""The Gemma probe's page (studies/gemma_probe.py) from a finished run's folder: counts out of the 0/1
rewards, exact intervals, and a verdict that follows the interval, not the point estimate."""

from __future__ import annotations

import json
import re

import pytest
import yaml

pytest.importorskip("scipy")

from otbrl.tasks import char_tokenizer, tiny_model  # noqa: E402
from studies import gemma_probe  # noqa: E402


def test_exact_interval_matches_clopper_pearson() -> None:
    low, high = gemma_probe.exact_interval(2, 32)
    assert (round(low, 4), round(high, 4)) == (0.0077, 0.2081)  # beta quantiles, by hand elsewhere
    assert gemma_probe.exact_interval(0, 10)[0] == 0.0 and gemma_probe.exact_interval(10, 10)[1] == 1.0


def _probe(tmp_path, held: float, train: list[float]):
    warm = tmp_path / "sft"
    tiny_model("tiny", seed=0).save_pretrained(warm / "final")
    char_tokenizer().save_pretrained(warm / "final")
    (warm / "sft-summary.json").write_text(
        json.dumps({"steps": 10, "batch_size": 8, "seconds": 100.0, "loss_first": 1.0, "loss_last": 0.2})
    )
    out = tmp_path / f"out-{held}"
    out.mkdir()
    recipe = {
        "model": str(warm / "final"),
        "task": "chat_draws_told",
        "eval_size": 32,
        "eval_samples": 1,
        "eval_distinct_problems": True,
        "per_device_train_batch_size": 16,
        "num_generations": 4,
        "learning_rate": 1e-5,
    }
    (out / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    rows = [
        {
            "step": i + 1,
            "step_time": 300.0,
            "reward": r,
            "completions/mean_length": 30.0,
            "otb/tool_calls": 2.0,
            "otb/horizon/length_cv": 0.3,
        }
        for i, r in enumerate(train)
    ]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {
        "generated tokens": 1500,
        "steps": len(train),
        "train seconds": 900.0,
        "held-out reward before": held,
    }
    (out / "summary.json").write_text(json.dumps(summary))
    return out


def test_the_page_counts_samples_and_reads_the_verdict_from_the_interval(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(gemma_probe, "smollm2c_cost", lambda: (0.2, 2))
    low = gemma_probe.page(_probe(tmp_path, 2 / 32, [0.0625, 0.0625, 0.0]))
    assert "2 of 32: 0.062 [0.008, 0.208]" in low  # the held-out interval alone reaches the band...
    assert re.search(r"RL steps \(16 samples a step\) \|\s+2 of 48 \|", low)
    assert "(32 distinct problems x 1)" in low
    assert "scores 4 of 80 samples" in low and "below the task's band" in low  # ...the pooled one does not
    assert "costs 3.0x SmolLM2's" in low  # 900 s / 1500 tokens against 0.2
    # 6 of 80 (0.075) has an upper bound above 0.15: not shown to be below, though the estimate is
    mid = gemma_probe.page(_probe(tmp_path, 3 / 32, [0.0625, 0.0625, 0.0625]))
    assert "scores 6 of 80 samples" in mid and "not shown to be below the task's band" in mid


def test_the_probe_runs_smollm2cs_setting_with_its_own_few_changes(tmp_path) -> None:
    from otbrl.app.recipe import load_recipe
    from studies.experiment import load_experiment

    model = tmp_path / "gemma.gguf"
    model.write_bytes(b"GGUF")  # the recipe check reads no model
    recipe, overrides = gemma_probe.probe_overrides(str(model), tmp_path / "out")
    checked = load_recipe(recipe, overrides)  # every key is a recipe key, every value in range
    assert checked["chat_template_path"] == "gemma" and checked["max_steps"] == 3
    exp = load_experiment("smollm2c")
    kept = {k: v for k, v in {**exp.common, **exp.arms["otb-N4"]}.items() if k not in gemma_probe.PROBE}
    assert kept and all(checked[k] == v for k, v in kept.items())
