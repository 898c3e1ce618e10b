"""What an experiment's training runs achieved, from their metrics.jsonl: per run the smoothed train
reward, held-out reward at each token budget, tokens to each absolute threshold, gradient-norm surges,
the clipped fraction, LR-decay triggers and collapse; per experiment the paired comparisons its YAML
names (`inference`) and a check that every arm of a seed saw the same prompts at each step; for a
learning-rate ladder (an experiment with `ladder:`; arms named `arm@lr`): per estimator, the share of
seeds that collapsed at each rung, the critical learning rate (the lowest rung where at least half the
seeds collapsed), and the paired collapse comparison between two estimators over every (rung, seed).

Definitions (stated again on the results page):
- Smoothed train reward: centred moving average over a window matched in samples (`window`), so a
  first crossing of a threshold is neither lagged nor won by one lucky small batch.
- Tokens to a threshold: generated tokens (every sample's completion, tool output excluded) when the
  smoothed reward first reaches the threshold; None if it never does.
- Collapse: the trailing mean reward (same window) stays below `collapse_fraction` x its starting level
  (the mean of the first window) for `collapse_steps` consecutive steps, all inside the run: a window the
  run's end cuts short never counts.
- Surge: the pre-clip gradient norm, smoothed by a trailing mean over 5 steps, exceeds `surge_factor` x
  the median of its previous 20 values; steps with a zero gradient (no reward spread in any group) are
  left out, and consecutive flagged steps are one surge.
"""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from otbrl.app.metrics import moving_average, read_metrics
from otbrl.app.plots import MARKERS, STYLES, pyplot, save
from studies.experiment import Experiment, arm_names
from studies.inference import NOT_TESTED, Interval, combine, discriminating, paired, t_interval, verdict
from studies.pages import markdown_table, read_record
from studies.runs import (
    Run,
    attempt_span,
    environment_label,
    has_record,
    kind_labels,
    machine_kind,
    record_path,
    wall_seconds,
)

SURGE_SMOOTH, SURGE_HISTORY = 5, 20


def collapse_step(
    steps: list[int], rewards: list[float], window: int, fraction: float, hold: int
) -> int | None:
    """First step of `hold` consecutive steps whose trailing mean reward (over `window` steps, full
    windows only) is below `fraction` x the mean of the first `window` steps."""
    if len(rewards) < window + hold:
        return None
    start = statistics.fmean(rewards[:window])
    if start <= 0:
        return None  # nothing to lose
    trailing = moving_average(rewards, window, centred=False)
    run = 0
    for i in range(window - 1, len(rewards)):
        run = run + 1 if trailing[i] < fraction * start else 0
        if run >= hold:
            return steps[i - hold + 1]
    return None


def surge_steps(steps: list[int], norms: list[float], factor: float) -> list[int]:
    """First step of each surge of the smoothed pre-clip gradient norm (zero-gradient steps left out)."""
    kept = [(s, n) for s, n in zip(steps, norms, strict=True) if math.isfinite(n) and n > 0]
    smooth = moving_average([n for _, n in kept], SURGE_SMOOTH, centred=False)
    out, inside = [], False
    for i, (step, _) in enumerate(kept):
        history = smooth[max(0, i - SURGE_HISTORY) : i]
        flagged = len(history) >= SURGE_HISTORY // 2 and smooth[i] > factor * statistics.median(history)
        if flagged and not inside:
            out.append(step)
        inside = flagged
    return out


def window(exp: Experiment, batch: int) -> int:
    """Steps in the reward's moving average for a run with `batch` samples per step. Matched in samples,
    small-batch arms (noisier per step) average over more steps, so all curves carry the same noise."""
    if exp.smooth_samples:
        return max(1, round(exp.smooth_samples / batch))
    return exp.smooth


def first_crossing(tokens: list[float], smooth: list[float], threshold: float) -> float | None:
    for t, value in zip(tokens, smooth, strict=True):
        if value >= threshold:
            return t
    return None


def _mean(values: list[float]) -> float:
    kept = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(kept) if kept else math.nan


def analyse_rows(
    rows: list[dict[str, Any]], summary: dict[str, Any], exp: Experiment, seed: int = 0, batch: int = 1
) -> dict[str, Any]:
    """One run's outcomes from its logged steps (a metrics.jsonl or a record's) and its summary."""
    rewarded = [r for r in rows if "reward" in r]
    steps = [r["step"] for r in rewarded]
    reward = [r["reward"] for r in rewarded]
    tokens = [r["generated_tokens"] for r in rewarded]
    w = window(exp, batch)
    smooth = moving_average(reward, w)
    norms = [r.get("grad_norm", math.nan) for r in rewarded]
    clipped = [r["clipped"] for r in rewarded if "clipped" in r and r.get("grad_norm", 0) > 0]
    before = summary.get("held-out reward before")
    heldout, heldout_tokens = ({0: before}, {0: 0.0}) if before is not None else ({}, {})
    for r in rows:
        for b in r.get("heldout_budgets", []):
            heldout[int(b)], heldout_tokens[int(b)] = r["heldout_reward"], r["generated_tokens"]
    k = max(1, len(reward) // 10)
    horizon = {
        key: [r[f"otb/horizon/{key}"] for r in rewarded if f"otb/horizon/{key}" in r]
        for key in ("length_cv", "energy_cv", "reward_spread", "energy_reward_corr")
    }
    w_end = moving_average(reward, w, centred=False)[-1] if reward else math.nan
    start_level = statistics.fmean(reward[:w]) if reward else math.nan
    collapse = collapse_step(steps, reward, w, exp.collapse_fraction, exp.collapse_steps)
    # Censored: the run ended with its trailing mean below the collapse level, too late for the rule to
    # count it (fewer than collapse_steps steps below at the end). A longer run might have collapsed.
    below_end = 0
    if reward and start_level > 0 and len(reward) >= w:
        trailing = moving_average(reward, w, centred=False)
        for i in range(len(reward) - 1, w - 2, -1):
            if trailing[i] >= exp.collapse_fraction * start_level:
                break
            below_end += 1
    return {
        "seed": seed,
        # the task's horizon as the runs met it: within-group spreads over the first 10 steps, and over
        # the whole run (mean over every logged step)
        **{f"{key}_start": statistics.fmean(v[:10]) if v else math.nan for key, v in horizon.items()},
        **{f"{key}_run": _mean(v) for key, v in horizon.items()},
        "steps": steps,
        "tokens": tokens,
        "reward": reward,
        "smooth": smooth,
        "grad_norm": norms,
        "length": [r.get("completions/mean_length", math.nan) for r in rewarded],
        "lr": [r.get("learning_rate", math.nan) for r in rewarded],
        "prompts": [r.get("prompts_sha") for r in rewarded],
        "final": sum(reward[-k:]) / k if reward else math.nan,
        "start": sum(reward[:k]) / k if reward else math.nan,
        "held_out": summary.get("held-out reward after", math.nan),
        "heldout": heldout,
        "heldout_tokens": heldout_tokens,
        "train_seconds": summary.get("train seconds", math.nan),
        "total_tokens": tokens[-1] if tokens else 0.0,
        "to_threshold": {th: first_crossing(tokens, smooth, th) for th in exp.thresholds},
        "surges": surge_steps(steps, norms, exp.surge_factor),
        "clip_fraction": statistics.fmean(clipped) if clipped else math.nan,
        "decays": [r["step"] for r in rewarded if r.get("otb/lr_decay_trigger")],
        "collapse": collapse,
        "censored": collapse is None and below_end > 0,
        "below_end_steps": below_end,
        "trailing_end": w_end,
    }


def _arm_stats(results: list[dict[str, Any]]) -> dict[str, Any]:
    budgets = sorted({b for r in results for b in r["heldout"]})
    thresholds = sorted({th for r in results for th in r["to_threshold"]})
    return {
        "seeds": len(results),
        "seed_list": [r["seed"] for r in results],
        "start": [r["start"] for r in results],
        "final": [r["final"] for r in results],
        "held_out": [r["held_out"] for r in results],
        "heldout": {b: [r["heldout"].get(b) for r in results] for b in budgets},
        "total_tokens": [r["total_tokens"] for r in results],
        "to_threshold": {th: [r["to_threshold"][th] for r in results] for th in thresholds},
        "surges": sum(len(r["surges"]) for r in results),
        "clip_fraction": [r["clip_fraction"] for r in results],
        **{
            key: [r[key] for r in results]
            for key in (
                "length_cv_start",
                "energy_cv_start",
                "reward_spread_start",
                "energy_reward_corr_start",
            )
        },
        **{
            f"{key}_run": [r[f"{key}_run"] for r in results]
            for key in ("length_cv", "energy_cv", "reward_spread", "energy_reward_corr")
        },
        "censored": [r["censored"] for r in results],
        "steps_run": [r["steps"][-1] if r["steps"] else 0 for r in results],
        "train_seconds": [r["train_seconds"] for r in results],
        "collapses": [r["collapse"] for r in results],
        "decays": [r["decays"] for r in results],
        "first_surge": [r["surges"][0] if r["surges"] else None for r in results],
    }


def prompt_check(per_arm: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Steps at which two arms of one seed that draw as many prompts a step scored different prompts
    (empty: the protocol held). Arms that draw different numbers of prompts a step (N=32 taking 2
    prompts where N=4 takes 16, for the same samples a step) see different prompts by design and are
    not checked against each other."""
    problems = []
    by_seed: dict[tuple[int, Any], list[tuple[str, list]]] = {}
    for arm, runs in per_arm.items():
        for r in runs:
            by_seed.setdefault((r["seed"], r.get("prompts_per_step")), []).append((arm, r["prompts"]))
    for (seed, _), arms in sorted(by_seed.items(), key=lambda item: (item[0][0], str(item[0][1]))):
        (first, ref), *rest = arms
        for arm, digests in rest:
            bad = [i + 1 for i, (a, b) in enumerate(zip(ref, digests, strict=False)) if a and b and a != b]
            if bad:
                problems.append(f"seed {seed}: {arm} and {first} differ at {len(bad)} steps (first {bad[0]})")
    return problems


def _seed_values(results: list[dict[str, Any]], get: Any) -> dict[int, float]:
    out = {}
    for r in results:
        value = get(r)
        if value is not None and math.isfinite(value):
            out[r["seed"]] = value
    return out


def by_where(
    cand: list[dict[str, Any]], base: list[dict[str, Any]], get_cand: Any, get_base: Any
) -> list[dict[str, Any]]:
    """The paired differences grouped by where each side's run was trained, when the runs were not all
    trained in one place: a check that the machines do not tell the arms apart, never a verdict.
    [{"candidate": where, "baseline": where, "seeds": n, "mean": difference}]; [] when every run of both
    arms ran in one place."""
    sides = enumerate((cand, base))
    where = {(i, r["seed"]): r.get("machine", "not recorded") for i, rs in sides for r in rs}
    if len(set(where.values())) < 2:
        return []
    groups: dict[tuple[str, str], list[float]] = {}
    values = (_seed_values(cand, get_cand), _seed_values(base, get_base))
    for seed in sorted(set(values[0]) & set(values[1])):
        groups.setdefault((where[0, seed], where[1, seed]), []).append(values[0][seed] - values[1][seed])
    return [
        {"candidate": c, "baseline": b, "seeds": len(v), "mean": statistics.fmean(v)}
        for (c, b), v in groups.items()
    ]


def compare_arms(
    exp: Experiment, spec: dict[str, Any], per_arm: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """One comparison of the YAML's `comparisons`: paired intervals of held-out reward at each budget
    (candidate budget against the baseline's, `baseline_budgets` when they differ) and, for `better`
    claims, of tokens saved to each threshold (over seeds where both arms reached it); its verdict. With
    `primary` (a budget), the verdict is that endpoint's alone: the others are secondary, reported beside
    it, and cannot veto it. Without it (protocols registered before primary endpoints existed), every
    tested endpoint must agree."""
    kind, margin = spec.get("kind", "better"), float(spec.get("margin", 0.0))
    cand, base = per_arm.get(spec["candidate"], []), per_arm.get(spec["baseline"], [])
    heldout = _heldout_endpoints(exp, spec, cand, base)
    verdicts = [h["verdict"] for h in heldout]
    tokens = []
    for th in exp.thresholds if kind == "better" else []:
        saved = paired(
            _seed_values(base, lambda r, th=th: r["to_threshold"][th]),
            _seed_values(cand, lambda r, th=th: r["to_threshold"][th]),
        )
        ci = t_interval(saved, exp.confidence)
        reached = (
            sum(t is not None for t in (r["to_threshold"][th] for r in cand)),
            sum(t is not None for t in (r["to_threshold"][th] for r in base)),
        )
        v = verdict(kind, ci)
        tokens.append({"threshold": th, "interval": ci, "verdict": v, "reached": reached})
        verdicts.append(v)
    auc = _auc_endpoint(exp, spec, cand, base) if "auc" in spec.get("secondary", []) else None
    overall = _decide(spec, heldout, verdicts)
    controls = []
    if kind == "matches":  # the same test for each same-N baseline (issue 33's rule)
        for arm in same_n_baselines(exp, spec):
            ends = _heldout_endpoints(exp, {**spec, "candidate": arm}, per_arm.get(arm, []), base)
            controls.append(
                {"arm": arm, "heldout": ends, "verdict": _decide(spec, ends, [h["verdict"] for h in ends])}
            )
        overall = discriminating(overall, {c["arm"]: c["verdict"] for c in controls})
    # A verdict read before every planned seed has run is a look at the data, not the result: said so.
    both = (spec["candidate"], spec["baseline"])  # --quick may drop an arm: then nothing was planned
    planned = len(set.intersection(*(set(exp.arm_seeds(a)) if a in exp.arms else set() for a in both)))
    paired_seeds = max((h["interval"].n for h in heldout), default=0)
    interim = f"interim: {paired_seeds} of {planned} planned seeds" if paired_seeds < planned else ""
    return {
        **spec,
        "kind": kind,
        "margin": margin,
        "heldout": heldout,
        "tokens": tokens,
        "controls": controls,
        **({"auc": auc} if auc is not None else {}),
        "verdict": overall,
        "interim": interim,
    }


def same_n_baselines(exp: Experiment, spec: dict[str, Any]) -> list[str]:
    """The arms the YAML's `same_n_baseline` role names, other than the comparison's own two."""
    named = arm_names(exp.roles.get("same_n_baseline", []))
    return [a for a in named if a not in (spec["candidate"], spec["baseline"])]


def budget_pairs(spec: dict[str, Any]) -> tuple[list[int], list[int]]:
    """A comparison's candidate budgets and, index by index, the baseline budgets they are read against
    (`baseline_budgets`, else the same)."""
    budgets = [int(b) for b in spec.get("budgets", [])]
    return budgets, [int(b) for b in spec.get("baseline_budgets", budgets)]


def _heldout_endpoints(
    exp: Experiment, spec: dict[str, Any], cand: list[dict[str, Any]], base: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The paired held-out endpoints of candidate against baseline at each of the spec's budgets."""
    kind, margin = spec.get("kind", "better"), float(spec.get("margin", 0.0))
    budgets, base_budgets = budget_pairs(spec)
    out = []
    for b, bb in zip(budgets, base_budgets, strict=True):
        mine, theirs = (lambda r, b=b: r["heldout"].get(b)), (lambda r, bb=bb: r["heldout"].get(bb))
        ci = t_interval(paired(_seed_values(cand, mine), _seed_values(base, theirs)), exp.confidence)
        out.append(
            {
                "budget": b,
                "baseline_budget": bb,
                "interval": ci,
                "verdict": verdict(kind, ci, margin),
                "primary": "primary" in spec and int(spec["primary"]) == b,
                "by_where": by_where(cand, base, mine, theirs),
            }
        )
    return out


def heldout_auc(heldout: dict[int, float], budgets: list[int]) -> float | None:
    """The area under a run's held-out curve from step 0 to the last of `budgets` (trapezoids between
    the evaluations), divided by that budget: its mean held-out reward over training, a summary of the
    whole curve that is less noisy than one evaluation. None if an evaluation on the way is missing."""
    points = [0, *sorted(int(b) for b in budgets)]
    if any(heldout.get(b) is None for b in points) or points[-1] <= 0:
        return None
    area = sum((b - a) * (heldout[a] + heldout[b]) / 2 for a, b in zip(points, points[1:], strict=False))
    return area / points[-1]


def _auc_endpoint(
    exp: Experiment, spec: dict[str, Any], cand: list[dict[str, Any]], base: list[dict[str, Any]]
) -> dict[str, Any]:
    """The registered secondary endpoint `secondary: [auc]`: the paired difference of held-out AUC up to
    each side's primary budget (its last, without one), tested by the comparison's own rule."""
    kind, margin = spec.get("kind", "better"), float(spec.get("margin", 0.0))
    budgets, base_budgets = budget_pairs(spec)
    end = budgets.index(int(spec["primary"])) + 1 if "primary" in spec else len(budgets)
    mine = _seed_values(cand, lambda r: heldout_auc(r["heldout"], budgets[:end]))
    theirs = _seed_values(base, lambda r: heldout_auc(r["heldout"], base_budgets[:end]))
    ci = t_interval(paired(mine, theirs), exp.confidence)
    return {
        "budget": budgets[end - 1],
        "baseline_budget": base_budgets[end - 1],
        "interval": ci,
        "verdict": verdict(kind, ci, margin),
    }


def _decide(spec: dict[str, Any], heldout: list[dict[str, Any]], verdicts: list[str]) -> str:
    """The primary endpoint decides; without one (older protocols) every tested endpoint must agree."""
    if "primary" in spec:
        return next(h["verdict"] for h in heldout if h["primary"])
    return combine(verdicts) if verdicts else NOT_TESTED


def analyse(exp: Experiment, runs: list[Run], records: Path | None = None) -> dict[str, Any]:
    """{"arms": {arm: per-arm stats}, "runs": {arm: [per-run...]}, "comparisons": [...],
    "prompt_problems": [...], "protocols": {hash: runs}, "environments": {where: runs}, "first_started":
    time}, over the runs that finished: from their committed records where `records` holds them, else
    from their directories."""
    per_arm: dict[str, list[dict[str, Any]]] = {}
    stamps: dict[str, int] = {}
    where: dict[str, int] = {}
    started: list[str] = []
    envs: list[dict[str, Any] | None] = []
    for run in runs:
        batch = int(run.overrides.get("per_device_train_batch_size", 1))
        if has_record(run, records):
            rec = read_record(record_path(records, run.arm, run.seed))
            rows, summary = rec["metrics"], rec["summary"]
            key = (rec.get("protocol") or {}).get("hash") or "unstamped"
            stamps[key] = stamps.get(key, 0) + 1
            started += [rec["started"]] if rec.get("started") else []
            env = environment_label(rec.get("environment"))
            wall, span, environment = wall_seconds(rec), attempt_span(rec), rec.get("environment")
        elif (run.dir / "summary.json").is_file():
            rows = read_metrics(run.dir / "metrics.jsonl")
            summary = json.loads((run.dir / "summary.json").read_text())
            stamps["unstamped"] = stamps.get("unstamped", 0) + 1
            env, wall, span, environment = "not recorded", math.nan, None, None
        else:
            continue
        where[env] = where.get(env, 0) + 1
        result = analyse_rows(rows, summary, exp, run.seed, batch)
        result["where"], result["wall_seconds"], result["span"] = env, wall, span
        envs.append(environment)
        result["kind"] = machine_kind(environment)
        n = run.overrides.get("num_generations")
        result["prompts_per_step"] = (
            batch // int(n) if n and "per_device_train_batch_size" in run.overrides else None
        )
        per_arm.setdefault(run.arm, []).append(result)
    # the kind of machine (`machine_kind`, what same_machine compares), named once a kind: the checks
    # that pairs trained in one place group by it, not by the label (which also names the core count)
    names = kind_labels(envs)
    for results in per_arm.values():
        for r in results:
            r["machine"] = names[r["kind"]]
    return {
        "arms": {arm: _arm_stats(results) for arm, results in per_arm.items()},
        "runs": per_arm,
        "comparisons": [compare_arms(exp, c, per_arm) for c in exp.comparisons],
        "prompt_problems": prompt_check(per_arm),
        "protocols": stamps,
        "environments": where,
        "first_started": min(started) if started else None,
    }


def interval_json(ci: Interval) -> dict[str, float]:
    return {"mean": ci.mean, "lo": ci.lo, "hi": ci.hi, "n": ci.n, "confidence": ci.confidence}


# A learning-rate ladder: arms named `arm@lr`.


def split(arm: str) -> tuple[str, float]:
    """'otb-N4@0.0002' -> ('otb-N4', 0.0002)."""
    base, _, lr = arm.rpartition("@")
    if not base:
        raise ValueError(f"{arm!r} is not a ladder arm (arm@lr)")
    return base, float(lr)


def cells(arms: dict[str, Any]) -> dict[str, dict[float, list[bool]]]:
    """{base arm: {learning rate: {seed: collapsed?}}} from an experiment's per-arm statistics
    (`analyse(...)["arms"]`, or the same read back from its JSON)."""
    out: dict[str, dict[float, dict[int, bool]]] = {}
    for arm, stats in arms.items():
        base, lr = split(arm)
        out.setdefault(base, {})[lr] = {
            seed: c is not None for seed, c in zip(stats["seed_list"], stats["collapses"], strict=True)
        }
    return out


def critical_lr(rungs: dict[float, dict[int, bool]]) -> float | None:
    """The lowest learning rate at which at least half of the seeds collapsed (None: none did)."""
    for lr in sorted(rungs):
        seeds = rungs[lr]
        if seeds and sum(seeds.values()) >= len(seeds) / 2:
            return lr
    return None


def collapse_difference(
    arms: dict[str, Any],
    candidate: str,
    baseline: str,
    confidence: float,
    table: dict[str, dict[float, dict[int, bool]]] | None = None,
) -> Interval:
    """Paired over (rung, seed): baseline collapsed (1/0) minus candidate collapsed; > 0 favours the
    candidate."""
    table = cells(arms) if table is None else table
    a, b = table.get(candidate, {}), table.get(baseline, {})
    diffs = []
    for lr in sorted(set(a) & set(b)):
        diffs += paired({s: float(c) for s, c in b[lr].items()}, {s: float(c) for s, c in a[lr].items()})
    return t_interval(diffs, confidence)


def stability_verdict(
    arms: dict[str, Any],
    candidate: str,
    baselines: list[str],
    confidence: float,
    table: dict[str, dict[float, dict[int, bool]]] | None = None,
) -> tuple[str, list[tuple[str, Interval]]]:
    """`better` on collapses against each baseline; not tested when no run collapsed at all. `table`:
    collapse indicators to use instead of `cells(arms)` (e.g. censored runs counted as collapses)."""
    table = cells(arms) if table is None else table
    arms_here = (candidate, *baselines)
    collapsed = sum(sum(seeds.values()) for b in arms_here for seeds in table.get(b, {}).values())
    intervals = [(b, collapse_difference(arms, candidate, b, confidence, table)) for b in baselines]
    if collapsed == 0:
        return NOT_TESTED, intervals
    return combine([verdict("better", ci) for _, ci in intervals]), intervals


def _end_heldout(stats: dict[str, Any]) -> str:
    """Mean held-out reward at the end of the runs (their summaries'), '—' where none was scored."""
    values = [v for v in stats.get("held_out", []) if v is not None and v == v]
    return f"{statistics.fmean(values):.3f}" if values else "—"


def ladder_table(arms: dict[str, Any]) -> str:
    """One row per estimator: collapsed seeds at each rung (and censored ones: below the collapse level at
    the end, too late to count), the mean held-out reward at the end of each rung's runs (a collapse
    count alone hides a run that ended low without collapsing), the critical learning rate, surges,
    clipped share of steps."""
    table = cells(arms)
    rates = sorted({lr for rungs in table.values() for lr in rungs})
    rows = []
    for base, rungs in table.items():
        mine = [stats for arm, stats in arms.items() if split(arm)[0] == base]
        clip = [c for s in mine for c in s["clip_fraction"] if c is not None and not math.isnan(c)]
        crit = critical_lr(rungs)
        low = {
            split(arm)[1]: sum(stats.get("censored", []))
            for arm, stats in arms.items()
            if split(arm)[0] == base
        }
        cell = {
            lr: f"{sum(seeds.values())}/{len(seeds)}" + (f" (+{low[lr]} censored)" if low.get(lr) else "")
            for lr, seeds in rungs.items()
        }
        held = {split(arm)[1]: _end_heldout(stats) for arm, stats in arms.items() if split(arm)[0] == base}
        rows.append(
            [
                base,
                *(cell.get(lr, "—") for lr in rates),
                *(held.get(lr, "—") for lr in rates),
                "none collapsed" if crit is None else f"{crit:g}",
                sum(s["surges"] for s in mine),
                f"{statistics.fmean(clip):.2f}" if clip else "—",
            ]
        )
    head = [
        "arm",
        *(f"collapsed @ lr {lr:g}" for lr in rates),
        *(f"held-out at the end @ lr {lr:g}" for lr in rates),
        "critical lr",
        "surges",
        "clipped",
    ]
    return markdown_table(head, rows, aligned=False)


def plot_ladder(arms: dict[str, Any], ax: Any) -> None:
    """Share of seeds collapsed against the learning rate, one line style and marker per estimator."""
    for i, (base, rungs) in enumerate(cells(arms).items()):
        lrs = sorted(rungs)
        share = [statistics.fmean(float(c) for c in rungs[lr].values()) for lr in lrs]
        jitter = 1 + 0.02 * (i - 2)  # side by side where shares coincide
        style = {"ls": STYLES[i % len(STYLES)], "marker": MARKERS[i % len(MARKERS)]}
        ax.plot([lr * jitter for lr in lrs], share, label=base, **style)
    ax.set(xscale="log", xlabel="learning rate", ylabel="share of seeds collapsed", ylim=(-0.05, 1.05))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def plot_ladder_runs(
    runs: dict[str, list[dict[str, Any]]], png: Any, title: str, smoothing: str, variants: Any = ()
) -> None:
    """The ladder's runs (`analyse(...)["runs"]`), one column per rung: smoothed train reward and
    mean completion length against step; the arms named in `variants` (the LR-decay variants: they run
    exactly as their base arm until a trigger, so drawn beside it they would hide it) get a third row of
    their own. Every seed is drawn (thin) under its arm's mean (thick): with a few seeds a t band is
    wider than the data, and a collapse is one seed's event. Crosses: collapses; triangles: LR-decay
    triggers. Each arm keeps one colour, line style and marker in every column."""
    plt = pyplot()
    rates = sorted({split(arm)[1] for arm in runs})
    bases = list(dict.fromkeys(split(arm)[0] for arm in runs))
    variants = set(variants) & set(bases)
    n_rows = 3 if variants else 2
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(
        n_rows, len(rates), figsize=(4.6 * len(rates) + 1, 4 * n_rows), sharey="row", squeeze=False
    )
    for arm, arm_runs in runs.items():
        base, lr = split(arm)
        i, col = bases.index(base), rates.index(lr)
        style = {"color": colours[i % len(colours)], "ls": STYLES[i % len(STYLES)]}
        panels = [(2, "smooth", "xv")] if base in variants else [(0, "smooth", "x"), (1, "length", "v")]
        usable = [r for r in arm_runs if len(r["steps"]) > 1]
        for row, key, kinds in panels:
            ax = axes[row, col]
            for r in usable:
                ax.plot(r["steps"], r[key], lw=0.7, alpha=0.3, **style)
                marks = [("x", r["collapse"])] if "x" in kinds and r["collapse"] is not None else []
                marks += [("v", step) for step in r["decays"]] if "v" in kinds else []
                for marker, step in marks:
                    ax.plot(
                        [step],
                        [np.interp(step, r["steps"], r[key])],
                        marker=marker,
                        ms=7,
                        mew=2,
                        ls="",
                        color=style["color"],
                    )
            if usable:
                end = min(r["steps"][-1] for r in usable)
                grid = np.arange(max(r["steps"][0] for r in usable), end + 1)
                mean = np.mean([np.interp(grid, r["steps"], r[key]) for r in usable], axis=0)
                ax.plot(
                    grid,
                    mean,
                    lw=2,
                    marker=MARKERS[i % len(MARKERS)],
                    markevery=10,
                    ms=5,
                    label=f"{base} (n={len(usable)})",
                    **style,
                )
    for col, lr in enumerate(rates):
        axes[0, col].set_title(f"learning rate {lr:g}", fontsize=10)
        axes[-1, col].set_xlabel("step")
        for ax in axes[:, col]:
            ax.grid(True, alpha=0.3)
        if variants and not axes[2, col].lines:
            ax = axes[2, col]
            ax.text(0.5, 0.5, "no LR-decay arm at this rung", ha="center", transform=ax.transAxes)
    axes[0, 0].set_ylabel(f"train reward (centred mean over {smoothing})")
    axes[1, 0].set_ylabel("mean completion length (tokens)")
    if variants:
        axes[2, 0].set_ylabel(f"with LR decay: train reward\n(centred mean over {smoothing})")
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_legend_handles_labels()[0]}
    labels = sorted(handles, key=lambda label: bases.index(label.split(" (")[0]))
    fig.legend(
        [handles[k] for k in labels],
        [k.split(" (")[0] for k in labels],
        loc="lower center",
        ncol=min(len(labels), 7),
        fontsize=9,
    )
    legend = "(thick: mean over seeds; thin: each seed; x: collapse; v: LR-decay trigger)"
    fig.suptitle(textwrap.fill(title, int(13 * fig.get_figwidth())) + "\n" + legend, fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    save(fig, png, dpi=100, tight=False)


def beside(value: float, floor: float, digits: int = 3) -> str:
    """`value` to `digits` decimals, or to as many more as it takes to read on its own side of `floor`:
    0.29961 against a floor of 0.3 reads 0.2996, not 0.300 beside a "not tested"."""
    for d in range(digits, 10):
        text = f"{value:.{d}f}"
        if (float(text) < floor) == (value < floor):
            return text
    return repr(value)


def phenomenon_missing(res: dict[str, Any], exp: Any, arms: tuple[str, ...]) -> tuple[str, str]:
    """(why the phenomenon the protocol requires, e.g. `phenomenon: {length_cv_run: 0.3}`, did not show
    in the compared arms' runs, or "" when it did or none is required; the per-arm means in words). The
    floor is read per comparison, over the runs of its two arms (issue 33: before, all arms were pooled,
    so one arm's long-varying runs could carry another's)."""
    out, shown = [], []
    for key, floor in (exp.phenomenon or {}).items():
        per_arm = {
            a: [v for v in res["arms"].get(a, {}).get(key, []) if v is not None and v == v] for a in arms
        }
        values = [v for vals in per_arm.values() for v in vals]
        if not values:
            out.append(f"{key} not measured")
            continue
        mean = statistics.fmean(values)
        each = ", ".join(f"{a} {statistics.fmean(v):.3f}" for a, v in per_arm.items() if v)
        shown.append(f"{key} (floor {float(floor):g}): {each}; over both arms' runs {beside(mean, floor)}")
        if mean < float(floor):
            out.append(
                f"{key} {beside(mean, floor)} < {float(floor):g} over the compared arms' runs "
                "(the phenomenon did not show)"
            )
    return "; ".join(out), "; ".join(shown)
