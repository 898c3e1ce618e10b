"""Rows of claims.md made from `otbrl compare` experiments' JSON results: one row per paired comparison
the experiment's YAML names (its `claim`, endpoints and verdict), the stability claim from the
learning-rate ladder and the length-triggered LR decay question. Arms are found by the roles the YAML
gives them, so a renamed arm is followed here and a missing role is a clear error."""

from __future__ import annotations

import math
import statistics
from typing import Any

from otbrl.app.studies.experiment import arm_names, load_experiment
from otbrl.app.studies.inference import INCONCLUSIVE, NOT_TESTED, Interval, combine, rule, t_interval, verdict
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
    """'walk (within-group length CV 0.53, ..., over every step of the runs)' (every arm of every seed):
    averaged over whole runs where the results have it, else over the runs' first 10 steps (results
    written before whole-run horizons were kept)."""
    whole = any(a.get("length_cv_run") for a in res["arms"].values())
    suffix, where = ("_run", "over every step of the runs") if whole else ("_start",
                                                                          "over the runs' first 10 steps")
    h = {}
    for key in ("length_cv", "energy_cv", "energy_reward_corr", "reward_spread"):
        runs = [v for a in res["arms"].values() for v in a.get(f"{key}{suffix}", [])]
        values = [v for v in runs if v is not None and v == v]  # NaN: a run without the metric
        if values:
            h[key] = statistics.fmean(values)
    text = horizon_text(h)
    return f"{task}" + (f" ({text}, {where})" if text else "")


def comparison_rows(res: dict[str, Any], experiment: str) -> list[Row]:
    """One row per comparison in `<experiment>.json` (written by `otbrl compare`)."""
    exp = load_experiment(experiment)
    if "comparisons" not in res:
        raise ValueError(f"{experiment}.json: no paired comparisons (written by an older otbrl); rerun "
                         f"`otbrl compare {experiment}`")  # fmt: skip
    task = horizon(res, exp.recipe)
    missing = phenomenon_missing(res, exp)
    note = provenance(res, exp)
    rows = []
    for c in res["comparisons"]:
        parts = []
        for h in c["heldout"]:
            at = _k(h["budget"]) + (f" vs {_k(h['baseline_budget'])}" if h["baseline_budget"] != h["budget"]
                                    else "")  # fmt: skip
            role = " (primary)" if h.get("primary") else (" (secondary)" if "primary" in c else "")
            parts.append(f"held-out reward @{at}{role}: {_interval(h['interval'])}")
        for t in c["tokens"]:
            parts.append(f"tokens saved to train reward {t['threshold']:g}: "
                         f"{_interval(t['interval']).text(thousands=True)} (reached by {c['candidate']} in "
                         f"{t['reached'][0]} seeds, by {c['baseline']} in {t['reached'][1]})")  # fmt: skip
        for arm in (c["candidate"], c["baseline"]):  # did they learn at all? (first -> last 10% of steps)
            a = res["arms"].get(arm, {})
            if a.get("start") and a.get("final"):
                parts.append(f"{arm} train reward {statistics.fmean(a['start']):.2f} → "
                             f"{statistics.fmean(a['final']):.2f}")  # fmt: skip
        seeds = max((h["interval"]["n"] for h in c["heldout"]), default=0)
        measured = (f"{task}; {c['candidate']} − {c['baseline']}, paired over {seeds} seeds, mean "
                    f"[{exp.confidence:.0%} CI]: " + "; ".join(parts) + "."
                    + (f" {note}" if note else ""))  # fmt: skip
        why = rule(c["kind"], c.get("margin", 0.0), exp.confidence)
        decides = ("the primary endpoint decides; secondary ones are reported, not counted" if "primary" in c
                   else "all endpoints must agree (registered before primary endpoints)")  # fmt: skip
        result = c["verdict"]
        if missing:
            result, decides = NOT_TESTED, f"{decides}; not tested: {missing}"
        rows.append((c.get("claim", c["name"]), measured, f"**{result}** (rule: {why}; {decides})",
                     f"`otbrl compare {experiment}`"))  # fmt: skip
    return rows


def phenomenon_missing(res: dict[str, Any], exp: Any) -> str:
    """Why the phenomenon the protocol requires (`phenomenon: {length_cv_run: 0.3}`) did not show in the
    runs (the mean over every run of every arm), or "" when it did or none is required."""
    out = []
    for key, floor in (exp.phenomenon or {}).items():
        values = [v for a in res["arms"].values() for v in a.get(key, []) if v is not None and v == v]
        if not values:
            out.append(f"{key} not measured")
        elif statistics.fmean(values) < float(floor):
            mean = statistics.fmean(values)
            out.append(f"{key} {mean:.2f} < {float(floor):g} (the phenomenon did not show)")
    return "; ".join(out)


# Results made before protocols were registered and stamped (issue 22): what the history says about them.
LEGACY = {
    "walk": "its learning-rate pilot ran at 1.5x the budgets, which were cut after the pilot had seen 1e-4 "
            "fail (disclosed in walk.yaml)",
    "ladder": "its seeds, arms and the LR-decay verdict rule changed in the commits that brought new results "
              "(08a449c, d0c4983)",
    "tir": "its budgets were cut after its pilot (disclosed in tir.yaml)",
}


def heldout_overlap(task: str, train_size: int, eval_size: int, seeds: list[int]) -> float:
    """The share of held-out prompts that were also training prompts, as results made before the hash
    split drew them (`dataset` without a split: eval seed + 1), mean over `seeds`."""
    from otbrl.tasks import dataset

    shares = []
    for seed in seeds:
        train = {r["prompt"] for r in dataset(task, train_size, seed)}
        held = [r["prompt"] for r in dataset(task, eval_size, seed + 1)]
        shares.append(sum(p in train for p in held) / len(held))
    return statistics.fmean(shares)


def provenance(res: dict[str, Any], exp: Any) -> str:
    """'' for a result made under its registered protocol with held-out prompts disjoint from training;
    otherwise what is wrong with it, said next to its numbers."""
    if res.get("registration"):
        reg = res["registration"]
        current = reg["amendments"][-1]["hash"] if reg.get("amendments") else reg["hash"]
        stamps = res.get("protocols", {})
        text = []
        if reg.get("amendments"):
            text.append(f"**protocol amended after its first run started** ({len(reg['amendments'])}x; see "
                        "Protocol changes below)")  # fmt: skip
        other = {h: n for h, n in stamps.items() if h != current}
        if other:
            text.append("runs under other protocols: "
                        + ", ".join(f"{n} under {h}" for h, n in other.items()))  # fmt: skip
        if reg.get("committed") is False:
            text.append("its YAML was not committed when the first run started")
        return ("⚠ " + "; ".join(text) + ".") if text else ""
    from otbrl.app.recipe import load_recipe

    recipe = load_recipe(exp.recipe, exp.common)
    parts = ["⚠ **Legacy result**: made before protocols were registered and stamped (issue 22); "
             + LEGACY.get(exp.name, "its protocol history is in git")]
    if recipe.get("task"):
        sizes = int(recipe["train_size"]), int(recipe["eval_size"])
        share = heldout_overlap(recipe["task"], *sizes, exp.seeds)
        parts.append(f"made before the held-out split: {share:.0%} of its held-out prompts were also "
                     f"training prompts (seeds {exp.seeds[0]}–{exp.seeds[-1]})")  # fmt: skip
    return "; ".join(parts) + "."


def _collapsed_text(rungs: dict[float, dict[int, bool]], low: dict[float, dict[int, bool]] | None = None
                    ) -> str:  # fmt: skip
    out = []
    for lr, seeds in sorted(rungs.items()):
        ended = sum((low or {}).get(lr, {}).values())
        out.append(f"{sum(seeds.values())}/{len(seeds)} @ {lr:g}"
                   + (f" (+{ended} censored)" if ended else ""))  # fmt: skip
    return ", ".join(out)


def _heldout_text(arms: dict[str, Any], base: str) -> str:
    """'held-out at the end 0.31 @ 0.0001, ...' (mean over seeds) where the arm's runs have one."""
    parts = []
    for arm, a in sorted(arms.items(), key=lambda kv: split(kv[0])[1]):
        name, lr = split(arm)
        values = [v for v in a.get("held_out", []) if v is not None and v == v]
        if name == base and values:
            parts.append(f"{statistics.fmean(values):.2f} @ {lr:g}")
    return ("final held-out reward " + ", ".join(parts)) if parts else ""


def stability_row(res: dict[str, Any], experiment: str = "ladder") -> Row:
    """Claim (c) from a learning-rate ladder; roles candidate, group_mean (a list), control. A run that
    ended below the collapse level too late for the rule to count it is censored: the verdict is computed
    with censored runs read as survivors and again as collapses, and stands only where both agree. The
    N=16 control is read beside it: if it collapses at the same rung as the N=4 group-mean arms, the
    collapse is not shown to be a small-group effect here."""
    exp = load_experiment(experiment)
    cand, means = exp.role("candidate"), list(arm_names(exp.role("group_mean")))
    control = exp.roles.get("control")
    table, low = cells(res["arms"]), censored_cells(res["arms"], exp.collapse_fraction)
    exact = all("censored" in a for a in res["arms"].values())
    parts = []
    for arm in (cand, *means, control):
        if arm in table:
            crit = critical_lr(table[arm])
            crit_text = "none (no rung collapsed half its seeds)" if crit is None else f"{crit:g}"
            held = _heldout_text(res["arms"], arm)
            parts.append(f"{arm}{' (control)' if arm == control else ''}: collapsed "
                         f"{_collapsed_text(table[arm], low.get(arm))}; critical lr {crit_text}"
                         + (f"; {held}" if held else ""))  # fmt: skip
    result, intervals = stability_verdict(res["arms"], cand, means, exp.confidence)
    worst = {arm: {lr: {s: c or low.get(arm, {}).get(lr, {}).get(s, False) for s, c in seeds.items()}
                   for lr, seeds in rungs.items()} for arm, rungs in table.items()}  # fmt: skip
    result_worst, intervals_worst = stability_verdict(res["arms"], cand, means, exp.confidence, table=worst)
    parts += [f"collapses {b} − {cand} over (rung, seed): {ci}" for b, ci in intervals]
    n_low = sum(sum(seeds.values()) for arm in (cand, *means) for seeds in low.get(arm, {}).values())
    if n_low:
        parts.append(f"with the {n_low} censored runs of these arms counted as collapses: "
                     + "; ".join(f"{b} − {cand}: {ci}" for b, ci in intervals_worst))  # fmt: skip
    decides = ""
    if result != result_worst:
        decides = f": censoring decides ({result} if censored runs survived, {result_worst} if not)"
        result = INCONCLUSIVE
    if control in table:
        crit_c = critical_lr(table[control])
        crit_m = [critical_lr(table[m]) for m in means if m in table]
        if crit_c is not None and any(m is not None and crit_c <= m for m in crit_m):
            parts.append(f"the N=16 control collapses at or below the N=4 group-mean arms' critical rate "
                         f"({crit_c:g}): collapse here is not shown to come from small groups")  # fmt: skip
    how = ("censored: ended with the trailing mean below the collapse level, too late to count" if exact else
           "censored (estimated from the JSON: last 10% of steps' mean train reward below "
           f"{exp.collapse_fraction:.0%} of the first 10%'s, not collapsed)")  # fmt: skip
    note = provenance(res, exp)
    return (
        "(c) OTB prevents the training collapse that small groups suffer at high learning rates.",
        f"{horizon(res, exp.recipe)}; learning-rate ladder, N=4, {len(exp.seeds)} seeds per rung: "
        + "; ".join(parts) + f" ({how})." + (f" {note}" if note else ""),
        f"**{result}**{decides} (rule: collapse indicators paired by (rung, seed), baseline minus OTB; "
        f"{rule('better', 0.0, exp.confidence)} — against each group-mean arm; not tested if no run "
        "collapsed; censored runs read both ways, the verdict only where both readings agree — a change "
        "after the ladder's results were seen, issue 22 item 7)",
        f"`otbrl compare {experiment}`",
    )


def censored_cells(arms: dict[str, Any], fraction: float) -> dict[str, dict[float, dict[int, bool]]]:
    """{base arm: {lr: {seed: censored?}}}: from the runs' `censored` flags, or for results written
    before them, estimated from the per-seed start and final train rewards (final < fraction x start and
    no collapse counted)."""
    out: dict[str, dict[float, dict[int, bool]]] = {}
    for arm, a in arms.items():
        base, lr = split(arm)
        if "censored" in a:
            flags = list(a["censored"])
        else:
            ends = zip(a["collapses"], a.get("start", []), a.get("final", []), strict=False)
            flags = [c is None and f is not None and st is not None and f < fraction * st
                     for c, st, f in ends]  # fmt: skip
        out.setdefault(base, {})[lr] = dict(zip(a["seed_list"], flags, strict=False))
    return out


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
