"""Rows of claims.md made from `otbrl compare` experiments' JSON results: one row per paired comparison
the experiment's YAML names (its `claim`, endpoints and verdict), the stability claim from the
learning-rate ladder and the length-triggered LR decay question. Arms are found by the roles the YAML
gives them, so a renamed arm is followed here and a missing role is a clear error."""

from __future__ import annotations

import math
import statistics
from typing import Any

from otbrl.app.studies.experiment import arm_names, load_experiment
from otbrl.app.studies.inference import NOT_TESTED, Interval, combine, rule, t_interval, verdict
from otbrl.app.studies.ladder import cells, critical_lr, split, stability_verdict

Row = tuple[str, str, str, str]  # claim, measurement, verdict, command


def _interval(d: dict[str, Any]) -> Interval:
    nan = math.nan
    return Interval(*(nan if d[k] is None else d[k] for k in ("mean", "lo", "hi")), d["n"], d["confidence"])


def _k(tokens: float) -> str:
    return f"{tokens / 1000:g}k"


def horizon_text(h: dict[str, float]) -> str:
    """'within-group length CV 0.53, energy CV 1.10, energy–reward correlation -0.31, reward spread in 92% of
    groups' from the keys of `stability.group_horizons` (without their prefix) that `h` has."""
    labels = (("length_cv", "within-group length CV"), ("energy_cv", "energy CV"),
              ("energy_reward_corr", "energy–reward correlation"))  # fmt: skip
    parts = [f"{label} {h[key]:.2f}" for key, label in labels if key in h]
    if "reward_spread" in h:
        parts.append(f"reward spread in {h['reward_spread']:.0%} of groups")
    return ", ".join(parts)


def horizon(res: dict[str, Any], task: str) -> str:
    """'walk (within-group length CV 0.53, ..., over the runs' first 10 steps)' from the runs' first steps
    (every arm of every seed)."""
    h = {}
    for key in ("length_cv", "energy_cv", "energy_reward_corr", "reward_spread"):
        runs = [v for a in res["arms"].values() for v in a.get(f"{key}_start", [])]
        values = [v for v in runs if v is not None and v == v]  # NaN: a run without the metric
        if values:
            h[key] = statistics.fmean(values)
    text = horizon_text(h)
    return f"{task}" + (f" ({text}, over the runs' first 10 steps)" if text else "")


def comparison_rows(res: dict[str, Any], experiment: str) -> list[Row]:
    """One row per comparison in `<experiment>.json` (written by `otbrl compare`)."""
    exp = load_experiment(experiment)
    if "comparisons" not in res:
        raise ValueError(f"{experiment}.json: no paired comparisons (written by an older otbrl); rerun "
                         f"`otbrl compare {experiment}`")  # fmt: skip
    task = horizon(res, exp.recipe)
    rows = []
    for c in res["comparisons"]:
        parts = []
        for h in c["heldout"]:
            at = _k(h["budget"]) + (f" vs {_k(h['baseline_budget'])}" if h["baseline_budget"] != h["budget"]
                                    else "")  # fmt: skip
            parts.append(f"held-out reward @{at}: {_interval(h['interval'])}")
        for t in c["tokens"]:
            parts.append(f"tokens saved to train reward {t['threshold']:g}: "
                         f"{_interval(t['interval']).text(thousands=True)} (reached by {c['candidate']} in "
                         f"{t['reached'][0]} seeds, by {c['baseline']} in {t['reached'][1]})")  # fmt: skip
        for arm in (c["candidate"], c["baseline"]):  # did they learn at all? (first -> last 10% of steps)
            a = res["arms"].get(arm, {})
            if a.get("start") and a.get("final"):
                parts.append(f"{arm} train reward {statistics.fmean(a['start']):.2f} → "
                             f"{statistics.fmean(a['final']):.2f}")  # fmt: skip
        seeds = len(exp.arm_seeds(c["baseline"]))
        measured = (f"{task}; {c['candidate']} − {c['baseline']}, paired over {seeds} seeds, mean "
                    f"[{exp.confidence:.0%} CI]: " + "; ".join(parts) + ".")  # fmt: skip
        why = rule(c["kind"], c.get("margin", 0.0), exp.confidence)
        rows.append((c.get("claim", c["name"]), measured,
                     f"**{c['verdict']}** (rule: {why}; all endpoints must agree)",
                     f"`otbrl compare {experiment}`"))  # fmt: skip
    return rows


def _collapsed_text(rungs: dict[float, dict[int, bool]]) -> str:
    return ", ".join(f"{sum(s.values())}/{len(s)} @ {lr:g}" for lr, s in sorted(rungs.items()))


def stability_row(res: dict[str, Any], experiment: str = "ladder") -> Row:
    """Claim (c) from a learning-rate ladder; roles candidate, group_mean (a list), control."""
    exp = load_experiment(experiment)
    cand, means = exp.role("candidate"), list(arm_names(exp.role("group_mean")))
    table = cells(res["arms"])
    parts = []
    for arm in (cand, *means, exp.roles.get("control")):
        if arm in table:
            crit = critical_lr(table[arm])
            crit_text = "none (no rung collapsed half its seeds)" if crit is None else f"{crit:g}"
            parts.append(f"{arm}: collapsed {_collapsed_text(table[arm])}; critical lr {crit_text}")
    result, intervals = stability_verdict(res["arms"], cand, means, exp.confidence)
    parts += [f"collapses {b} − {cand} over (rung, seed): {ci}" for b, ci in intervals]
    return (
        "(c) OTB prevents the training collapse that small groups suffer at high learning rates.",
        f"{horizon(res, exp.recipe)}; learning-rate ladder, N=4, {len(exp.seeds)} seeds per rung: "
        + "; ".join(parts) + ".",
        f"**{result}** (rule: collapse indicators paired by (rung, seed), baseline minus OTB; "
        f"{rule('better', 0.0, exp.confidence)} — against each group-mean arm; not tested if no run "
        "collapsed)",
        f"`otbrl compare {experiment}`",
    )


def lr_decay_row(res: dict[str, Any], experiment: str = "ladder") -> Row:
    """Role `lr_decay`: base arm -> its length-triggered decay variant, compared at the variant's rungs:
    collapse indicators paired by (rung, seed), base minus variant. Not tested unless the trigger fired
    in time somewhere: at or before the step where the base arm of the same seed and rung collapsed (a
    variant runs exactly as its base until its first trigger, so a later trigger cannot change whether
    it collapses)."""
    exp = load_experiment(experiment)
    arms = res["arms"]
    table = cells(arms)
    collapse_at = {(b, lr, seed): c for arm, a in arms.items() for (b, lr) in [split(arm)]
                   for seed, c in zip(a["seed_list"], a["collapses"], strict=True)}  # fmt: skip
    parts, verdicts = [], []
    for base, variant in exp.role("lr_decay").items():
        if not isinstance(variant, str):
            raise ValueError(f"experiment {exp.name}: roles: lr_decay: {base} must name one arm")
        mine = table.get(variant, {})
        fired = in_time = 0
        for arm, a in arms.items():
            name, lr = split(arm)
            if name != variant:
                continue
            for seed, steps in zip(a["seed_list"], a["decays"], strict=True):
                fired += len(steps)
                c = collapse_at.get((base, lr, seed))
                in_time += any(c is not None and step <= c for step in steps)
        diffs = []
        for lr, seeds in sorted(mine.items()):
            theirs = table.get(base, {}).get(lr, {})
            diffs += [float(theirs[s]) - float(c) for s, c in seeds.items() if s in theirs]
            parts.append(f"{base} collapsed {sum(theirs.values())}/{len(theirs)} @ {lr:g}, with the decay "
                         f"{sum(seeds.values())}/{len(seeds)}")  # fmt: skip
        base_collapsed = sum(sum(table.get(base, {}).get(lr, {}).values()) for lr in mine)
        parts.append(f"{variant}: {fired} LR-decay triggers, in {in_time} of the {base_collapsed} runs whose "
                     "base collapsed before that collapse")  # fmt: skip
        ci = t_interval(diffs, exp.confidence)
        verdicts.append(NOT_TESTED if in_time == 0 or base_collapsed == 0 else verdict("better", ci))
    return (
        "(companion paper, arXiv 2602.01826) Decaying the LR on a response-length surge prevents collapse.",
        f"{exp.recipe}, learning-rate ladder: " + "; ".join(parts) + ".",
        f"**{combine(verdicts)}** (rule: collapse indicators paired by seed at the same rung, base minus "
        f"decay, {rule('better', 0.0, exp.confidence)}; not tested where the trigger never fired before "
        "the base arm's collapse of the same seed and rung, or the base arm never collapsed)",
        f"`otbrl compare {experiment}`",
    )
