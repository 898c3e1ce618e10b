"""What an experiment's training runs achieved, from their metrics.jsonl: per run the smoothed reward,
final reward, tokens to a target, gradient-norm surges, LR-decay triggers and collapse; per arm the same
over seeds, with the tokens saved against the reference arm.

The train reward is smoothed by a centred moving average (no lag, which would otherwise cost large-batch
arms more tokens). Final reward: mean of the last 10% of steps. Tokens to target: generated tokens when
the smoothed reward first reaches `target_fraction` x the reference arm's final reward. Collapse: the
smoothed reward falls below `collapse_fraction` x its best so far and never comes back.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from otbrl.app.studies.experiment import Experiment
from otbrl.app.studies.runs import Run, moving_average, read_metrics


def collapse_step(steps: list[int], smooth: list[float], fraction: float) -> int | None:
    """First step from which the smoothed reward stays below `fraction` x its best value before it."""
    best, candidate = -math.inf, None
    for step, value in zip(steps, smooth, strict=True):
        if best > 0 and value < fraction * best:
            candidate = step if candidate is None else candidate
        else:
            candidate = None
        best = max(best, value)
    return candidate


def window(exp: Experiment, batch: int) -> int:
    """Steps in the reward's moving average for a run with `batch` samples per step. Matched in samples,
    small-batch arms (noisier per step) average over more steps, so all curves carry the same noise
    and a first crossing of the target is not won by noise."""
    if exp.smooth_samples:
        return max(1, round(exp.smooth_samples / batch))
    return exp.smooth


def analyse_run(run_dir: Path, exp: Experiment, seed: int = 0, batch: int = 1) -> dict[str, Any]:
    rows = read_metrics(run_dir / "metrics.jsonl", "reward")
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [r["step"] for r in rows]
    reward = [r["reward"] for r in rows]
    smooth = moving_average(reward, window(exp, batch))
    k = max(1, len(reward) // 10)
    return {
        "seed": seed,
        "steps": steps,
        "tokens": [r["generated_tokens"] for r in rows],
        "reward": reward,
        "smooth": smooth,
        "grad_norm": [r.get("grad_norm", math.nan) for r in rows],
        "length": [r.get("completions/mean_length", math.nan) for r in rows],
        "lr": [r.get("learning_rate", math.nan) for r in rows],
        "final": sum(reward[-k:]) / k if reward else math.nan,
        "start": sum(reward[:k]) / k if reward else math.nan,
        "held_out": summary.get("held-out reward after", math.nan),
        "train_seconds": summary.get("train seconds", math.nan),
        "total_tokens": rows[-1]["generated_tokens"] if rows else 0.0,
        "surges": [r["step"] for r in rows if r.get("otb/grad_norm_surge")],
        "decays": [r["step"] for r in rows if r.get("otb/lr_decay_trigger")],
        "collapse": collapse_step(steps, smooth, exp.collapse_fraction),
    }


def tokens_to(run: dict[str, Any], target: float) -> float | None:
    for tokens, value in zip(run["tokens"], run["smooth"], strict=True):
        if value >= target:
            return tokens
    return None


def _target(exp: Experiment, per_arm: dict[str, list[dict[str, Any]]]) -> tuple[float | None, str | None]:
    """(target, None), or (None, why there is none) when the reference arm ran but did not improve."""
    ref = per_arm.get(exp.reference or "")
    if not ref:
        return None, None
    target = exp.target_fraction * statistics.fmean(r["final"] for r in ref)
    start = statistics.fmean(r["start"] for r in ref)
    if target <= start:  # the reference did not improve: "reaching" the target would mean nothing
        return None, (f"{exp.reference} did not improve (first 10% of steps {start:.3f}, last "
                      f"{target / exp.target_fraction:.3f}): no tokens-to-target.")  # fmt: skip
    return target, None


def _arm_stats(results: list[dict[str, Any]], target: float | None) -> dict[str, Any]:
    ttt = [tokens_to(r, target) for r in results] if target is not None else []
    steps = [r["steps"][r["tokens"].index(t)] for r, t in zip(results, ttt, strict=False) if t]
    return {
        "seeds": len(results),
        "final": [r["final"] for r in results],
        "held_out": [r["held_out"] for r in results],
        "total_tokens": [r["total_tokens"] for r in results],
        "tokens_to_target": ttt,
        "steps_to_target": steps,
        "reached": sum(t is not None for t in ttt),
        "surges": sum(len(r["surges"]) for r in results),
        "collapses": [r["collapse"] for r in results],
        "decays": [r["decays"] for r in results],
        "first_surge": [r["surges"][0] if r["surges"] else None for r in results],
    }


def analyse(exp: Experiment, runs: list[Run]) -> dict[str, Any]:
    """Per-arm statistics over seeds: {"target", "note", "arms": {arm: {...}}, "runs": {arm: [run...]}}."""
    per_arm: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        if (run.dir / "summary.json").is_file():
            batch = int(run.overrides.get("per_device_train_batch_size", 1))
            per_arm.setdefault(run.arm, []).append(analyse_run(run.dir, exp, run.seed, batch))
    target, note = _target(exp, per_arm)
    arms = {arm: _arm_stats(results, target) for arm, results in per_arm.items()}
    theirs = [t for t in arms.get(exp.reference or "", {}).get("tokens_to_target", []) if t is not None]
    for stats in arms.values():
        mine = [t for t in stats["tokens_to_target"] if t is not None]
        stats["token_saving"] = (
            1 - statistics.fmean(mine) / statistics.fmean(theirs) if mine and theirs and
            stats["reached"] == stats["seeds"] else None
        )  # fmt: skip
    return {"target": target, "note": note, "arms": arms, "runs": per_arm}
