"""`docs/results/claims.md`: one row per claim of the OTB paper (and two questions of ours), with what we
measured and a verdict computed from the studies' JSON results by the rules stated next to each row; a
study not yet run says so instead of guessing.

Rows from `python -m studies compare` experiments: one row per paired comparison the experiment's
YAML names (its `claim`, endpoints and verdict), the stability claim from the learning-rate ladder and the
length-triggered LR decay question. Arms are found by the roles the YAML gives them, so a renamed arm is
followed here and a missing role is a clear error.

Rows from the variance study (NAME.json of `python -m studies variance --name NAME`): (a) OTB lowers the
policy gradient's noise against the group mean, and the Logit-Gradient Proxy stands in for the exact score
norms. Both rest on the paired noise-to-signal ratios and their 95% intervals (`gradstats.nsr_ratio`), not on
point estimates.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otbrl.app.recipe import load_recipe
from otbrl.tasks import dataset
from studies.compare_page import power_text
from studies.experiment import arm_names, experiment_names, load_experiment, pilot_plan, pilot_seeds
from studies.inference import (
    HELD,
    IN_PROGRESS,
    INCONCLUSIVE,
    MATCHES_RULE,
    NOT_HELD,
    NOT_TESTED,
    Interval,
    combine,
    rule,
    t_interval,
    verdict,
    verdict_text,
)
from studies.multiplicity import holm, p_above, p_ratio_below
from studies.outcomes import cells, critical_lr, phenomenon_missing, split, stability_verdict
from studies.pages import kilo, markdown_table
from studies.pilot import gap_row, picks_and_gate
from studies.variance_a import STUDIES as STUDIES_A
from studies.variance_a import mechanism_claim, protocol_path
from studies.variance_page import GROUP_MEAN, command, ratio_name, task_horizon

Row = tuple[str, str, str, str]  # claim, measurement, verdict, command


def _interval(d: dict[str, Any]) -> Interval:
    nan = math.nan
    return Interval(*(nan if d[k] is None else d[k] for k in ("mean", "lo", "hi")), d["n"], d["confidence"])


def horizon_text(h: dict[str, float]) -> str:
    """'within-group length CV 0.53, energy CV 1.10, energy–reward correlation -0.31, reward spread in 92% of
    groups' from the keys of `stability.group_horizons` (without their prefix) that `h` has."""
    labels = (
        ("length_cv", "within-group length CV"),
        ("energy_cv", "energy CV"),
        ("energy_reward_corr", "energy–reward correlation"),
    )
    parts = [f"{label} {h[key]:.2f}" for key, label in labels if key in h]
    if "reward_spread" in h:
        parts.append(f"reward spread in {h['reward_spread']:.0%} of groups")
    return ", ".join(parts)


def horizon(res: dict[str, Any], task: str) -> str:
    """'walk (within-group length CV 0.53, ..., over every step of the runs)' (every arm of every seed):
    averaged over whole runs where the results have it, else over the runs' first 10 steps (results
    written before whole-run horizons were kept)."""
    whole = any(a.get("length_cv_run") for a in res["arms"].values())
    suffix, where = (
        ("_run", "over every step of the runs") if whole else ("_start", "over the runs' first 10 steps")
    )
    h = {}
    for key in ("length_cv", "energy_cv", "energy_reward_corr", "reward_spread"):
        runs = [v for a in res["arms"].values() for v in a.get(f"{key}{suffix}", [])]
        values = [v for v in runs if v is not None and v == v]  # NaN: a run without the metric
        if values:
            h[key] = statistics.fmean(values)
    text = horizon_text(h)
    return f"{task}" + (f" ({text}, {where})" if text else "")


def comparison_rows(res: dict[str, Any], experiment: str) -> list[Row]:
    """One row per comparison in `<experiment>.json` (written by `python -m studies compare`)."""
    exp = load_experiment(experiment)
    if "comparisons" not in res:
        raise ValueError(
            f"{experiment}.json: no paired comparisons (written by an older otbrl); rerun "
            f"`python -m studies compare {experiment}`"
        )
    task = horizon(res, exp.recipe)
    recipe = load_recipe(exp.recipe, {**exp.common, **exp.forced})
    if recipe.get("eval_distinct_problems"):  # what an evaluation measures: distinct problems, not wordings
        k = int(recipe.get("eval_samples", 1))
        task += (
            f"; each held-out score over {recipe['eval_size']} distinct held-out problems x {k} "
            f"sample{'s' * (k > 1)}"
        )
    note = provenance(res, exp)
    rows = []
    for c in res["comparisons"]:
        missing, cv_text = phenomenon_missing(res, exp, (c["candidate"], c["baseline"]))
        parts = []
        for h in c["heldout"]:
            at = kilo(h["budget"]) + (
                f" vs {kilo(h['baseline_budget'])}" if h["baseline_budget"] != h["budget"] else ""
            )
            role = " (primary)" if h.get("primary") else (" (secondary)" if "primary" in c else "")
            parts.append(f"held-out reward @{at}{role}: {_interval(h['interval'])}")
        for t in c["tokens"]:
            parts.append(
                f"tokens saved to train reward {t['threshold']:g}: "
                f"{_interval(t['interval']).text(thousands=True)} (reached by {c['candidate']} in "
                f"{t['reached'][0]} seeds, by {c['baseline']} in {t['reached'][1]})"
            )
        for arm in (c["candidate"], c["baseline"]):  # did they learn at all? (first -> last 10% of steps)
            a = res["arms"].get(arm, {})
            if a.get("start") and a.get("final"):
                parts.append(
                    f"{arm} train reward {statistics.fmean(a['start']):.2f} → "
                    f"{statistics.fmean(a['final']):.2f}"
                )
        if c.get("auc"):
            parts.append(
                f"held-out AUC to {kilo(c['auc']['budget'])} (secondary): {_interval(c['auc']['interval'])}"
            )
        for k in c.get("controls", []):  # same-N baselines on the same test (issue 33)
            h = next(
                (h for h in k["heldout"] if h.get("primary")), k["heldout"][-1] if k["heldout"] else None
            )
            if h is not None:
                parts.append(
                    f"same-N control {k['arm']} − {c['baseline']} on the same test: "
                    f"{_interval(h['interval'])} ({k['verdict']})"
                )
        if cv_text:
            parts.append(cv_text)
        seeds = max((h["interval"]["n"] for h in c["heldout"]), default=0)
        measured = (
            f"{task}; {c['candidate']} − {c['baseline']}, paired over {seeds} seeds, mean "
            f"[{exp.confidence:.0%} CI]: " + "; ".join(parts) + "." + (f" {note}" if note else "")
        )
        why = rule(c["kind"], c.get("margin", 0.0), exp.confidence)
        if c.get("controls"):
            why += f", {MATCHES_RULE} (an analysis rule of issue 33, applied after these runs)"
        decides = (
            "the primary endpoint decides; secondary ones are reported, not counted"
            if "primary" in c
            else "all endpoints must agree (registered before primary endpoints)"
        )
        result = verdict_text(c)
        planned = power_text(exp, c)
        if planned:  # an inconclusive verdict is read at the power the seeds were planned for
            decides = f"{decides}; {planned}"
        if missing:
            result, decides = NOT_TESTED, f"{decides}; not tested: {missing}"
        if c.get("interim"):  # no verdict before the planned seeds; said in bold, so the README carries it
            result = f"{IN_PROGRESS}, {c['interim']}"
        rows.append(
            (
                c.get("claim", c["name"]),
                measured,
                f"**{result}** (rule: {why}; {decides})",
                f"`python -m studies compare {experiment}`",
            )
        )
    return rows


def comparison_pvalues(res: dict[str, Any], experiment: str) -> dict[tuple[str, str], float]:
    """{(claim, command): two-sided p} of each comparison's deciding endpoint (the primary one, else the
    last budget) against its decision point: 0 for `better`, -margin for `matches`."""
    out = {}
    for c in res.get("comparisons", []):
        ends = c["heldout"]
        h = next((h for h in ends if h.get("primary")), ends[-1] if ends else None)
        if h is None or c.get("interim"):  # in progress: not a test yet, so not in the family
            continue
        floor = 0.0 if c["kind"] == "better" else -abs(float(c.get("margin", 0.0)))
        key = (c.get("claim", c["name"]), f"`python -m studies compare {experiment}`")
        out[key] = p_above(h["interval"], floor)
    return out


def variance_pvalue(res: dict[str, Any]) -> dict[tuple[str, str], float]:
    """{(claim (a), command): p}: every N must be below 1, so the claim's p is the largest over N."""
    ivs = intervals(res, ratio_name("otb", GROUP_MEAN))
    ps = [p_ratio_below(iv) for _, iv in ivs]
    p = max(ps) if ps and all(q == q for q in ps) else math.nan
    return {(variance_claim(res)[0], _command(res)): p}


def holm_section(rows: list[Row], pvalues: dict[tuple[str, str], float]) -> list[str]:
    """The Holm-adjusted verdicts beside the raw ones, over every tested claim (m)."""
    raw = [re.match(r"\*\*([^*]+)\*\*", r[2]) for r in rows]
    tested = [
        (r, m.group(1))
        for r, m in zip(rows, raw, strict=True)
        if m and not m.group(1).startswith((NOT_TESTED, IN_PROGRESS, "see the numbers"))
    ]
    ps = [pvalues.get((r[0], r[3]), math.nan) for r, _ in tested]
    rejected = holm(ps)
    table = []
    for (r, verdict_now), p, ok in zip(tested, ps, rejected, strict=True):
        if p != p:
            adjusted = (
                f"{verdict_now} (no single p-value: not adjusted)"
                if verdict_now.startswith(HELD)
                else verdict_now
            )
        elif verdict_now.startswith(HELD):
            adjusted = HELD if ok else f"{INCONCLUSIVE} after Holm"
        else:
            adjusted = verdict_now
        table.append([r[0], r[3], verdict_now, "—" if p != p else f"{p:.2g}", adjusted])
    return [
        f"**Multiplicity.** {len(tested)} claims are tested on this page (rows that read not tested, in "
        "progress or see the numbers are not). Holm's step-down procedure over all of them keeps the chance "
        "of any false **held** at 5%: the p-value of each interval-based claim is the two-sided one that "
        "matches its 95% rule (for (a): the largest over N); a claim whose verdict rests on no single "
        "interval counts in m and is not adjusted.",
        "",
        markdown_table(
            ["claim", "command", "raw verdict", "p", "Holm-adjusted (family-wise 5%)"], table, aligned=False
        ),
    ]


# Results made before protocols were registered and stamped (issue 22): what the history says about them.
LEGACY = {
    "walk": "its learning-rate pilot ran at 1.5x the budgets, which were cut after the pilot had seen 1e-4 "
    "fail (disclosed in walk.yaml)",
    "ladder": "its seeds, arms and the LR-decay verdict rule changed in the commits that brought new results "
    "(08a449c, d0c4983)",
    "tir": "its budgets were cut after its pilot (disclosed in tir.yaml)",
}


# Experiments rerun from scratch under a registered protocol that was itself chosen after earlier results
# had been seen: the rerun's runs are clean, the choice of its design is not.
RERUN_OF_LEGACY = {
    "ladder": "rerun in full (66 runs) under its registered protocol, whose seeds, arms and LR-decay verdict "
    "rule were set in the commits that brought the legacy results (08a449c, d0c4983): its design was chosen "
    "after those results were seen, its runs were not",
}


def heldout_overlap(task: str, train_size: int, eval_size: int, seeds: list[int]) -> float:
    """The share of held-out prompts that were also training prompts, as results made before the hash
    split drew them (`dataset` without a split: eval seed + 1), mean over `seeds`."""
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
            text.append(
                f"**protocol amended after its first run started** ({len(reg['amendments'])}x; see "
                "Protocol changes below)"
            )
        other = {h: n for h, n in stamps.items() if h != current}
        if other:
            text.append(
                "runs under other protocols: " + ", ".join(f"{n} under {h}" for h, n in other.items())
            )
        if reg.get("committed") is False:
            text.append("its YAML was not committed when the first run started")
        return ("⚠ " + "; ".join(text) + ".") if text else ""
    recipe = load_recipe(exp.recipe, exp.common)
    parts = [
        "⚠ **Legacy result**: made before protocols were registered and stamped (issue 22); "
        + LEGACY.get(exp.name, "its protocol history is in git")
    ]
    if recipe.get("task"):
        sizes = int(recipe["train_size"]), int(recipe["eval_size"])
        share = heldout_overlap(recipe["task"], *sizes, exp.seeds)
        parts.append(
            f"made before the held-out split: {share:.0%} of its held-out prompts were also "
            f"training prompts (seeds {exp.seeds[0]}–{exp.seeds[-1]})"
        )
    return "; ".join(parts) + "."


def _collapsed_text(
    rungs: dict[float, dict[int, bool]], low: dict[float, dict[int, bool]] | None = None
) -> str:
    out = []
    for lr, seeds in sorted(rungs.items()):
        ended = sum((low or {}).get(lr, {}).values())
        out.append(
            f"{sum(seeds.values())}/{len(seeds)} @ {lr:g}" + (f" (+{ended} censored)" if ended else "")
        )
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
            parts.append(
                f"{arm}{' (control)' if arm == control else ''}: collapsed "
                f"{_collapsed_text(table[arm], low.get(arm))}; critical lr {crit_text}"
                + (f"; {held}" if held else "")
            )
    result, intervals = stability_verdict(res["arms"], cand, means, exp.confidence)
    worst = {
        arm: {
            lr: {s: c or low.get(arm, {}).get(lr, {}).get(s, False) for s, c in seeds.items()}
            for lr, seeds in rungs.items()
        }
        for arm, rungs in table.items()
    }
    result_worst, intervals_worst = stability_verdict(res["arms"], cand, means, exp.confidence, table=worst)
    parts += [f"collapses {b} − {cand} over (rung, seed): {ci}" for b, ci in intervals]
    n_low = sum(sum(seeds.values()) for arm in (cand, *means) for seeds in low.get(arm, {}).values())
    if n_low:
        parts.append(
            f"with the {n_low} censored runs of these arms counted as collapses: "
            + "; ".join(f"{b} − {cand}: {ci}" for b, ci in intervals_worst)
        )
    decides = ""
    if result != result_worst:
        decides = f": censoring decides ({result} if censored runs survived, {result_worst} if not)"
        result = INCONCLUSIVE
    if control in table:
        crit_c = critical_lr(table[control])
        crit_m = [critical_lr(table[m]) for m in means if m in table]
        if crit_c is not None and any(m is not None and crit_c <= m for m in crit_m):
            parts.append(
                f"the N=16 control collapses at or below the N=4 group-mean arms' critical rate "
                f"({crit_c:g}): collapse here is not shown to come from small groups"
            )
    how = (
        "censored: ended with the trailing mean below the collapse level, too late to count"
        if exact
        else "censored (estimated from the JSON: last 10% of steps' mean train reward below "
        f"{exp.collapse_fraction:.0%} of the first 10%'s, not collapsed)"
    )
    note = provenance(res, exp)
    return (
        "(c) OTB prevents the training collapse that small groups suffer at high learning rates.",
        f"{horizon(res, exp.recipe)}; learning-rate ladder, N=4, {len(exp.seeds)} seeds per rung: "
        + "; ".join(parts)
        + f" ({how})."
        + (f" {note}" if note else ""),
        f"**{result}**{decides} (rule: collapse indicators paired by (rung, seed), baseline minus OTB; "
        f"{rule('better', 0.0, exp.confidence)} — against each group-mean arm; not tested if no run "
        "collapsed; censored runs read both ways, the verdict only where both readings agree — a change "
        "after the ladder's results were seen, issue 22 item 7)",
        f"`python -m studies compare {experiment}`",
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
            flags = [
                c is None and f is not None and st is not None and f < fraction * st for c, st, f in ends
            ]
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
    collapse_at = {
        (b, lr, seed): c
        for arm, a in arms.items()
        for (b, lr) in [split(arm)]
        for seed, c in zip(a["seed_list"], a["collapses"], strict=True)
    }
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
            parts.append(
                f"{base} collapsed {sum(theirs.values())}/{len(theirs)} @ {lr:g}, with the decay "
                f"{sum(seeds.values())}/{len(seeds)}"
            )
        base_collapsed = sum(sum(table.get(base, {}).get(lr, {}).values()) for lr in mine)
        parts.append(
            f"{variant}: {fired} LR-decay triggers, in {in_time} of the {base_collapsed} runs whose "
            "base collapsed before that collapse"
        )
        ci = t_interval(diffs, exp.confidence)
        verdicts.append(NOT_TESTED if in_time == 0 or base_collapsed == 0 else verdict("better", ci))
    return (
        "(companion paper, arXiv 2602.01826) Decaying the LR on a response-length surge prevents collapse.",
        f"{exp.recipe}, learning-rate ladder: " + "; ".join(parts) + ".",
        f"**{combine(verdicts)}** (rule: collapse indicators paired by seed at the same rung, base minus "
        f"decay, {rule('better', 0.0, exp.confidence)}; not tested where the trigger never fired before "
        "the base arm's collapse of the same seed and rung, or the base arm never collapsed)",
        f"`python -m studies compare {experiment}`",
    )


# The variance study's rows.

PROXY_RANK = 0.7  # least per-sequence Spearman of proxy and exact W_T for the proxy to stand in
PROXY_NSR = 1.25  # most NSR(otb proxy) / NSR(otb exact) for the proxy to stand in


def intervals(res: dict[str, Any], name: str) -> list[tuple[int, dict[str, float]]]:
    """(N, {ratio, lo, hi, k, log_se}) of the paired NSR ratio `name` at every N that has it."""
    per_n = sorted(res.get("per_n", {}).items(), key=lambda kv: int(kv[0]))
    return [(int(n), b["nsr_ratios"][name]) for n, b in per_n if name in b.get("nsr_ratios", {})]


def below(iv: dict[str, float], bound: float) -> bool:
    return iv["hi"] < bound  # False for an undetermined (NaN) interval: it decides nothing


def above(iv: dict[str, float], bound: float) -> bool:
    return iv["lo"] > bound


def interval_text(ivs: list[tuple[int, dict[str, float]]]) -> str:
    """N=4: 0.53 [0.45, 0.62], ... (an undetermined interval says so)."""

    def one(iv: dict[str, float]) -> str:
        if iv["ratio"] != iv["ratio"]:  # NaN: neither estimator had a measurable signal
            return "no measurable signal"
        if iv["lo"] != iv["lo"]:  # NaN: a leave-one-out subset had no measurable signal
            return f"{iv['ratio']:.2f} [interval undetermined]"
        return f"{iv['ratio']:.2f} [{iv['lo']:.2f}, {iv['hi']:.2f}]"

    return ", ".join(f"N={n}: {one(iv)}" for n, iv in ivs)


def task_label(res: dict[str, Any]) -> str:
    """The task, with how its samples differ inside a group as measured in the study's own samples
    (within-group length and energy CV, energy–reward correlation, share of groups with a reward spread)."""
    task = res.get("config", {}).get("task", "?")
    text = horizon_text(task_horizon(res))
    return f"{task} ({text} in the study's samples)" if text else task


def _command(res: dict[str, Any]) -> str:
    return f"`{command(res['config'])}`" if "config" in res else "`python -m studies variance`"


def variance_claim(res: dict[str, Any], label: str | None = None) -> Row:
    """(a): held if the 95% interval of NSR(otb) / NSR(group mean) lies below 1 at every N measured, did
    not hold if it lies above 1 at any N, inconclusive otherwise; not tested without that ratio."""
    ivs = intervals(res, ratio_name("otb", GROUP_MEAN))
    if not ivs:
        verdict = NOT_TESTED
    elif any(above(iv, 1.0) for _, iv in ivs):
        verdict = NOT_HELD
    elif all(below(iv, 1.0) for _, iv in ivs):
        verdict = HELD
    else:
        verdict = INCONCLUSIVE
    k = ", ".join(sorted({str(int(iv["k"])) for _, iv in ivs}))
    measured = (
        f"Noise-to-signal trace Cov / ‖E g‖² of OTB over the group mean ({GROUP_MEAN}), paired on the same "
        f"batches at a fixed {label or task_label(res)} checkpoint, K={k} batches per N, 95% interval: "
        f"{interval_text(ivs)}."
        if ivs
        else "no paired noise-to-signal ratio of OTB and the group mean in the study's results."
    )
    return (
        "(a) OTB lowers the policy gradient's noise (against the group-mean baseline, same samples).",
        measured,
        f"**{verdict}** (rule: held if the 95% interval of NSR(otb)/NSR({GROUP_MEAN}) lies below 1 at "
        "every N measured; did not hold if it lies above 1 at any N; inconclusive otherwise)",
        _command(res),
    )


def proxy_claim(res: dict[str, Any], label: str | None = None) -> Row:
    """Proxy: held if the per-sequence Spearman of proxy and exact W_T >= PROXY_RANK and the 95% interval of
    NSR(otb) / NSR(otb_exact) lies below PROXY_NSR at every N; did not hold if the Spearman is lower or an
    interval lies entirely above PROXY_NSR; inconclusive otherwise; not tested without either."""
    corr = res.get("correlations") or {}
    token, seq = corr.get("token"), corr.get("sequence")
    ivs = intervals(res, ratio_name("otb", "otb_exact"))
    if not ivs and not seq:
        verdict = NOT_TESTED
    elif (seq and seq[2] < PROXY_RANK) or any(above(iv, PROXY_NSR) for _, iv in ivs):
        verdict = NOT_HELD
    elif seq and ivs and all(below(iv, PROXY_NSR) for _, iv in ivs):
        verdict = HELD
    else:
        verdict = INCONCLUSIVE
    parts = []
    if token:
        parts.append(f"per token: Spearman {token[2]:.2f}, Pearson {token[0]:.2f} ({token[3]} tokens)")
    if seq:
        parts.append(f"per sequence W_T: Spearman {seq[2]:.2f}, Pearson {seq[0]:.2f} ({seq[3]} sequences)")
    if ivs:
        k = ", ".join(sorted({str(int(iv["k"])) for _, iv in ivs}))
        parts.append(
            f"noise-to-signal OTB-proxy / OTB-exact, paired on the {k} batches per N with exact norms, 95% "
            f"interval: {interval_text(ivs)}"
        )
    measured = f"At a fixed {label or task_label(res)} checkpoint: " + "; ".join(parts) if parts else "-"
    return (
        "The Logit-Gradient Proxy stands in for the exact per-token score norms, from forward-pass "
        "probabilities alone (no backward pass).",
        measured + ". The proxy needs no backward pass by construction; its cost beside the log-probs is "
        "in [energy.md](energy.md).",
        f"**{verdict}** (rule: held if the per-sequence Spearman ≥ {PROXY_RANK} and the 95% interval of "
        f"NSR(otb)/NSR(otb_exact) lies below {PROXY_NSR} at every N; did not hold if the Spearman is below "
        f"{PROXY_RANK} or an interval lies entirely above {PROXY_NSR}; inconclusive otherwise)",
        _command(res),
    )


# The page.


def _load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def loo_question(var: dict[str, Any]) -> Row:
    """(ours) leave-one-out against self-inclusive OTB, by noise-to-signal at each N."""
    r = []
    for n, block in sorted(var["per_n"].items(), key=lambda kv: int(kv[0])):
        s = block["stats"]
        if "otb" in s and "otb_loo" in s:
            r.append(f"N={n}: {s['otb_loo']['nsr']:.2f} vs {s['otb']['nsr']:.2f}")
    return (
        "(ours) Does the unbiased leave-one-out OTB beat the paper's self-inclusive form?",
        "noise-to-signal, leave-one-out vs self-inclusive: " + ", ".join(r) + "." if r else "not measured",
        "see the numbers: leave-one-out is unbiased by construction; the question is its noise",
        "`python -m studies variance`",
    )


STUDIES = {  # results JSON -> the command that writes it
    "variance": "python -m studies variance",
    "variance-walk": "python -m studies variance --task walk --name variance-walk",
    "walk": "python -m studies compare walk",
    "walk3": "python -m studies compare walk3",
    "ladder": "python -m studies compare ladder",
    "tir": "python -m studies compare tir",
    "tir2": "python -m studies compare tir2",
    "smollm2": "python -m studies compare smollm2",
    "smollm2c": "python -m studies compare smollm2c",
}


# an experiment -> the one that replaces it: once the successor has run every planned seed (`complete`), the
# old rows move to the superseded list (the old page stays, and says why)
SUCCESSORS = {"walk": "walk3", "tir": "tir2", "smollm2": "smollm2c"}
# designs that never reached their reported runs: their pilot pages say why
STOPPED_AT_PILOT = {
    "walk2": "its pilot failed the must-learn gate (GRPO N=32 +0.125 < 0.15); walk3 replaces it",
}


def protocol_changes(results: Path) -> list[str]:
    """One line per protocol change made after an experiment's first run started: amendments recorded in
    its registration, and the legacy results made before registration existed."""
    lines = []
    for name in STUDIES:
        res = _load(results, name)
        if res is None or "arms" not in res or name.startswith("variance"):
            continue
        reg = res.get("registration")
        if reg is None:
            lines.append(f"- `{name}`: made before protocols were registered; " + LEGACY.get(name, "see git"))
            continue
        if name in RERUN_OF_LEGACY:
            lines.append(f"- `{name}`: {RERUN_OF_LEGACY[name]}")
        for a in reg.get("amendments", []):
            lines.append(f"- `{name}`: amended at {a['at']} (keys {', '.join(a['changed'])}): {a['reason']}")
        if reg.get("committed") is False:
            lines.append(f"- `{name}`: its YAML was not committed when its first run started")
    for folder in sorted((results / "runs").glob("*-pilot")):
        reg = _load_json(folder / "protocol.json")
        for a in (reg or {}).get("amendments", []):
            lines.append(
                f"- `{folder.name}`: amended at {a['at']} (keys {', '.join(a['changed'])}): {a['reason']}"
            )
    return lines


def _load_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def gap_pilots(results: Path) -> list[tuple[str, str, bool | None]]:
    """Pilots that tested the gap itself (a `gate.gap` in their protocol), read from their committed
    records: the larger group at its budget against the smaller at its own, each at its pick, averaged
    over the pilot seeds (`pilot.gap_row`). One (experiment, line, whether the gap passed; None:
    pending) each."""
    lines = []
    for name in experiment_names():
        exp = load_experiment(name)
        gap = ((exp.pilot or {}).get("gate") or {}).get("gap")
        records = results / "runs" / f"{name}-pilot"
        if not gap or not records.is_dir():
            continue
        runs = pilot_plan(exp, Path("runs/compare") / name / "pilot")
        picks = picks_and_gate(exp, runs, records)[0]
        row, passed = gap_row(gap, picks, runs, records)
        if row[1] == "pending":
            lines.append(
                f"- `{name}` pilots the gap ({gap['larger']} against {gap['smaller']}): not complete"
            )
            continue
        budget = {
            role: kilo(next(r.overrides["max_generated_tokens"] for r in runs if r.arm.startswith(arm + "@")))
            for role, arm in (("larger", gap["larger"]), ("smaller", gap["smaller"]))
        }
        lrs = sorted({r.overrides["learning_rate"] for r in runs})
        edge = [arm for arm in (gap["larger"], gap["smaller"]) if picks[arm] == lrs[-1]]
        text = (
            f"- `{name}` pilots the gap itself ({len(pilot_seeds(exp))} seeds, each arm at its held-out "
            f"pick): {gap['larger']} at {budget['larger']} tokens {row[3]} against {gap['smaller']} at "
            f"{budget['smaller']} tokens {row[2]}, a difference of {row[4]} where the protocol needs "
            f"{row[5]}: **{'passed' if passed else 'failed'}**"
            + ("" if passed else ", so none of its reported runs starts")
            + " (the gate's rule on the pilot's means, not a tested difference: with so few seeds the true "
            "gap may lie on either side of the margin)"
            + (
                f". {' and '.join(edge)} picked the grid's top rate ({lrs[-1]:g}), so a higher rate might "
                "move either end"
                if edge
                else ""
            )
            + "."
        )
        lines.append((name, text, passed))
    return lines


def gap_section(studies: dict[str, dict[str, Any] | None], results: Path = Path("docs/results")) -> list[str]:
    """Claim (b) is about OTB, not about group size, only where the larger group at more tokens beats the
    small one (issue 33): each `matches` comparison's same-N controls on the same test, in words."""
    lines = []
    for name, res in studies.items():
        for c in (res or {}).get("comparisons", []):
            for k in c.get("controls", []):
                h = next((h for h in k["heldout"] if h.get("primary")), None)
                if h is None:
                    continue
                at = f"{kilo(h['budget'])} vs {kilo(h['baseline_budget'])} tokens"
                reading = {
                    HELD: "it passes: the small group needs no help here, so the test cannot single out OTB",
                    NOT_HELD: "it fails: the larger group's extra tokens buy something here (a gap)",
                }.get(k["verdict"], f"{k['verdict']}: no gap shown either way")
                lines.append(
                    f"- `{name}`, {k['arm']} − {c['baseline']} ({at}): {_interval(h['interval'])}: {reading}"
                )
    piloted = gap_pilots(results)
    if not lines and not piloted:
        return []
    shown = any(passed for _, _, passed in piloted)
    names = " and ".join(f"`{name}`" for name, _, _ in piloted)
    return [
        "**Claim (b) needs a gap.** A 'matches' verdict says something about OTB only where the larger "
        "group, given more tokens, beats the same-N baselines. These are the same-N controls of each "
        "matches comparison, on the same test:",
        "",
        *lines,
        "",
        "Against GRPO N=32 at 3x the tokens, as the paper states claim (b), "
        + ("only a task piloted for it (below) shows the gap" if shown else "no task here shows the gap")
        + ". On walk3 GRPO at N=4 matches N=32. On smollm2 the three N=32 seeds decide nothing; "
        "smollm2c, the real-model verdict, has no N=32 arm (why: below). walk2's "
        "N=32 arm failed its learning gate. "
        + (
            f"{names} {'were' if len(piloted) > 1 else 'was'} piloted for the gap itself (below); "
            if piloted
            else "No task was piloted for the gap itself; "
        )
        + "one N=32 run costs 1–2 CPU hours here, so no further task was tried. The group-mean form on "
        "tir2 (N=4 against N=16 at 4x the tokens) does show the gap, and there OTB's 'matches' held.",
        *(
            [
                "",
                "Piloted for the gap before any OTB run (issue 33, item 3):",
                "",
                *(t for _, t, _ in piloted),
            ]
            if piloted
            else []
        ),
    ]


def dropped_lines() -> list[str]:
    """What each experiment's protocol left out of its claims before its runs, and why (`dropped:`)."""
    return [
        f"- `{name}`: {what}: {why}"
        for name in experiment_names()
        for what, why in load_experiment(name).dropped.items()
    ]


def complete(res: dict[str, Any] | None) -> bool:
    """Whether an experiment's results have run every planned seed of every comparison: only then does it
    supersede the experiment it replaces, whose finished rows stay until then."""
    return res is not None and not any(c.get("interim") for c in res.get("comparisons", []))


def write_claims(results: Path = Path("docs/results")) -> Path:
    loaded = {n: _load(results, n) for n in STUDIES}
    names = ("variance", "variance-walk", "walk", "walk3", "ladder", "tir", "tir2", "smollm2", "smollm2c")
    var, var_walk, walk, walk3, ladder, tir, tir2, smollm2, smollm2c = (loaded[n] for n in names)
    superseded = [old for old, new in SUCCESSORS.items() if complete(_load(results, new))]
    rows: list[Row] = []
    missing: list[str] = []

    def add(study: dict[str, Any] | None, name: str, fn: Callable[[dict[str, Any]], Any]) -> None:
        if study is None:
            missing.append(name)
            return
        out = fn(study)
        rows.extend(out if isinstance(out, list) else [out])

    add(smollm2c, "smollm2c", lambda r: comparison_rows(r, "smollm2c"))  # the real model: read first
    if "smollm2" not in superseded:
        add(smollm2, "smollm2", lambda r: comparison_rows(r, "smollm2"))
    for name in STUDIES_A:  # (a) under its registered protocols (issue 33), each once it is registered
        registered = mechanism_claim(results, protocol_path(name))
        if registered is not None:
            claim, measured, verdict_cell, cmd = registered.row()
            rows.append((claim, measured, verdict_cell, f"`{cmd}`"))
    add(var, "variance", variance_claim)
    add(var_walk, "variance-walk", variance_claim)
    add(var, "variance", proxy_claim)
    add(var_walk, "variance-walk", proxy_claim)
    if "walk" not in superseded:
        add(walk, "walk", lambda r: comparison_rows(r, "walk"))
    add(walk3, "walk3", lambda r: comparison_rows(r, "walk3"))
    add(ladder, "ladder", stability_row)
    if "tir" not in superseded:
        add(tir, "tir", lambda r: comparison_rows(r, "tir"))
    add(tir2, "tir2", lambda r: comparison_rows(r, "tir2"))
    add(ladder, "ladder", lr_decay_row)
    if var is not None:
        rows.append(loo_question(var))
    pvalues: dict[tuple[str, str], float] = {}
    for name in ("smollm2c", "smollm2", "walk3", "tir2", "walk", "tir"):
        study = loaded[name]
        if study is not None and name not in superseded:
            pvalues.update(comparison_pvalues(study, name))
    for study in (var, var_walk):
        if study is not None:
            pvalues.update(variance_pvalue(study))
    lines = [
        "# The paper's claims, measured here",
        "",
        "Tiny Qwen2 models (0.5M parameters) on built-in tasks, and SmolLM2-135M-Instruct (the smollm2c "
        "and smollm2 rows), on a 2-core CPU (some runs on a lent GPU: each page lists where its runs were "
        "trained): a small-scale check of the mechanisms, not of the paper's 7B numbers. "
        "Each row's verdict follows the rule stated in it, "
        "applied to the numbers in the linked pages; regenerate this page with `python -m studies claims` "
        "after the "
        "studies. Verdicts: **held**, **did not hold**, **inconclusive** (the interval spans the decision "
        "point) or **not tested** (the phenomenon did not occur, or too few seeds pair up).",
        "",
        markdown_table(["claim", "measured", "verdict", "command"], rows, aligned=False),
        "",
        "Details: "
        + ", ".join(f"[{n}.md]({n}.md)" for n in STUDIES if _load(results, n) is not None)
        + "."
        + (
            " When the length-surge detector would have fired relative to the ladder's collapses (a replay "
            "on the base runs' lengths): [decay_timing.md](decay_timing.md)."
            if (results / "decay_timing.md").is_file()
            else ""
        )
        + "".join(
            f" Where {n}'s phenomenon heads, run by run (no reward shown): "
            f"[{n}-phenomenon.md]({n}-phenomenon.md)."
            for n in STUDIES
            if (results / f"{n}-phenomenon.md").is_file() and _load(results, n) is not None
        ),
        "",
        "Each row's interval is a 95% t confidence interval over paired seeds; in the linked pages' arm "
        'tables, "±" is the standard deviation across seeds, not an interval.',
        "",
        *holm_section(rows, pvalues),
        "",
        *gap_section({"walk3": walk3, "tir2": tir2, "smollm2": smollm2, "smollm2c": smollm2c}, results),
        "",
        "**Protocol changes after a first run started.**",
        "",
        "\n".join(protocol_changes(results)) or "None.",
        "",
        "Every experiment's protocol (its YAML but the description and quick section) is registered with "
        "its hash when its first run starts (`docs/results/runs/<experiment>/protocol.json`) and stamped "
        "on every run's committed record; `python -m studies compare` refuses a changed protocol unless "
        "the change is "
        "recorded with `--amend REASON`, and every such amendment is listed here.",
        "",
        "Withdrawn: round 1's `efficiency`, `efficiency48` and `stress` experiments (fixed-length answers, "
        "one learning rate for every arm, unequal step budgets, 3 seeds, no intervals; see issue 16). "
        "Their pages are in the git history.",
    ]
    if superseded:
        pairs = [f"[{o}.md]({o}.md) by [{SUCCESSORS[o]}.md]({SUCCESSORS[o]}.md)" for o in superseded]
        lines += ["", "Superseded: " + ", ".join(pairs) + "."]
    stopped = [
        f"`{n}` ({why}: [{n}-pilot.md]({n}-pilot.md))"
        for n, why in STOPPED_AT_PILOT.items()
        if (results / f"{n}-pilot.md").is_file()
    ]
    if stopped:
        lines += ["", "Stopped at the pilot: " + "; ".join(stopped) + "."]
    left_out = dropped_lines()
    if left_out:
        lines += ["", "Left out of the claims before their runs, and why:", "", *left_out]
    if missing:
        lines += ["", "Not run yet: " + ", ".join(sorted(set(missing))) + "."]
    out = results / "claims.md"
    out.write_text("\n".join(lines) + "\n")
    return out


BEGIN, END = (
    "<!-- claims.md begins: written by `python -m studies claims --readme` -->",
    "<!-- claims.md ends -->",
)


def readme_block(claims_md: Path, readme: Path) -> str:
    """The README's headline of claims.md: each claim with its verdict, then claims.md's protocol changes
    and what is not run yet. The measurements, rules and intervals stay in claims.md, linked."""
    prefix = os.path.relpath(claims_md.parent, readme.parent).replace(os.sep, "/")
    rows, keep, keeping = [], [], False
    for line in claims_md.read_text().splitlines()[1:]:
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")] if line.startswith("| ") else []
        if len(cells) == 4 and cells[0] != "claim" and not set(cells[0]) <= set("-"):
            verdict = re.match(r"\*\*([^*]+)\*\*|([^:(]+)", cells[2])
            where = re.search(r"--study (variance-\w+)", cells[3]) or re.search(
                r"--task (\S+)|compare (\S+?)`|studies (variance-\w+)", cells[3]
            )
            rows.append(
                [
                    cells[0],
                    f"`{next(g for g in where.groups() if g)}`" if where else "—",
                    f"**{(verdict[1] or verdict[2]).strip()}**" if verdict else cells[2],
                ]
            )
        heads = ("**Protocol changes", "Not run yet", "Superseded", "Stopped at", "Left out of the claims")
        keeping = line.startswith(heads) or (keeping and (line.startswith("- ") or line == ""))
        if keeping or (line == "" and keep and keep[-1] != ""):
            keep.append(line)
    body = "\n".join(
        [
            markdown_table(["claim", "experiment", "verdict"], rows, aligned=False),
            "",
            f"Measurements, verdict rules and intervals: [claims.md]({prefix}/claims.md).",
            "",
            *keep,
        ]
    )
    return re.sub(r"\]\(([\w.-]+\.(?:md|png))\)", lambda m: f"]({prefix}/{m.group(1)})", body).strip()


def sync_readme(readme: Path, claims_md: Path) -> None:
    """Put claims.md into the README between the BEGIN and END markers, so both say the same."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{readme}: no evidence section markers ({BEGIN} ... {END})")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{readme_block(claims_md, readme)}\n{END}{tail}")
