"""An experiment's results page (`python -m studies compare NAME`): the arms' table, the paired comparisons
and the power their seeds were planned for, the evaluation's own noise, where and at what cost the runs
trained, the protocol they ran under, and the JSON that `python -m studies claims` reads."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from otbrl.app.plots import plot_arms, plot_figure
from otbrl.app.recipe import load_recipe
from studies.experiment import (
    Experiment,
    pilot_seeds,
    piloted,
)
from studies.inference import IN_PROGRESS, NOT_TESTED, rule, verdict_text
from studies.outcomes import (
    SURGE_HISTORY,
    SURGE_SMOOTH,
    ladder_table,
    phenomenon_missing,
    plot_ladder,
    plot_ladder_runs,
)
from studies.outcomes import interval_json as _interval
from studies.pages import kilo, markdown_table, mean_sd


def _smoothing(exp: Experiment) -> str:
    return f"{exp.smooth_samples} samples" if exp.smooth_samples else f"{exp.smooth} steps"


def _whole(values: list[float]) -> str:
    """'41 ± 1' (whole numbers: steps, seconds)."""
    kept = [v for v in values if v is not None and v == v]
    if not kept:
        return "—"
    return f"{statistics.fmean(kept):.0f}" + (f" ± {statistics.stdev(kept):.0f}" if len(kept) > 1 else "")


def _collapsed(s: dict[str, Any]) -> str:
    steps = [c for c in s["collapses"] if c is not None]
    return f"{len(steps)}/{s['seeds']}" + (f" ({', '.join(map(str, steps))})" if steps else "")


SD_NOTE = (
    "Each cell is the mean ± the standard deviation across seeds (an SD, not a confidence interval: "
    "the intervals are in the paired comparisons)."
)


def table(exp: Experiment, result: dict[str, Any]) -> str:
    """One row per arm: held-out reward at each budget, tokens to each threshold, final train reward,
    tokens, steps and train seconds (the energy pass included), clipped fraction, surges, collapses
    (mean ± SD over seeds: `SD_NOTE` says so under it)."""
    budgets = sorted({b for s in result["arms"].values() for b in s["heldout"]})
    # runs bounded by steps, not tokens (the ladder), are scored once more at their end
    end = not any(budgets) and any(v == v for s in result["arms"].values() for v in s.get("held_out", []))
    head = [
        "arm",
        "seeds",
        *(f"held-out @{kilo(b)}" if b else "held-out @0 (start)" for b in budgets),
        *(["held-out at the end"] if end else []),
        *(f"tokens to {th:g} (reached)" for th in exp.thresholds),
        "final train reward",
        "length CV (run)",
        "tokens",
        "steps",
        "train s",
        "clipped",
        "surges",
        "collapsed (step)",
        "censored",
    ]
    rows = []
    for arm, s in result["arms"].items():
        reach = [
            f"{mean_sd(ts)} ({sum(t is not None for t in ts)}/{s['seeds']})"
            for ts in (s["to_threshold"][th] for th in exp.thresholds)
        ]
        rows.append(
            [
                arm,
                s["seeds"],
                *(mean_sd(s["heldout"].get(b, [])) for b in budgets),
                *([mean_sd(s["held_out"])] if end else []),
                *reach,
                mean_sd(s["final"]),
                mean_sd(s.get("length_cv_run", [])),
                mean_sd(s["total_tokens"]),
                _whole(s["steps_run"]),
                _whole(s["train_seconds"]),
                mean_sd(s["clip_fraction"]),
                s["surges"],
                _collapsed(s),
                f"{sum(s.get('censored', []))}/{s['seeds']}",
            ]
        )
    return markdown_table(head, rows, aligned=False)


CONTROLS_NOTE = (
    "Same-N controls (issue 33): a `matches` claim reads **held** only if no same-N baseline (the YAML's "
    "`same_n_baseline` role, each arm at its own rate) passes the same test against the same reference; "
    "if one does, the test cannot single out OTB and the claim reads **not discriminating**. This rule was "
    "added after walk3, tir2 and smollm2 had run: for them it is an analysis change, applied to their "
    "committed records; for experiments registered since, it is part of the protocol."
)


def comparisons_table(result: dict[str, Any], exp: Experiment | None = None) -> str:
    """One row per paired endpoint of each comparison: the mean difference, its interval, the verdict.
    With `exp`, a comparison whose two arms' runs miss the protocol's phenomenon floor reads "not tested",
    as on claims.md (`outcomes.phenomenon_missing`). Before every planned seed has run (`interim`), no
    endpoint has a verdict: the intervals so far are shown, and the comparison reads "in progress"."""
    rows = []
    for c in result["comparisons"]:
        said = (lambda v: "—") if c.get("interim") else (lambda v: v)
        for h in c["heldout"]:
            at = kilo(h["budget"]) + (
                f" vs {kilo(h['baseline_budget'])}" if h["baseline_budget"] != h["budget"] else ""
            )
            role = " (**primary**)" if h.get("primary") else (" (secondary)" if "primary" in c else "")
            rows.append(
                [
                    c["name"],
                    f"held-out reward @{at}, {c['candidate']} − {c['baseline']}{role}",
                    str(h["interval"]),
                    said(h["verdict"]),
                ]
            )
        for t in c["tokens"]:
            endpoint = (
                f"tokens saved to {t['threshold']:g} ({c['baseline']} − {c['candidate']}; "
                f"reached in {t['reached'][0]} and {t['reached'][1]} seeds)"
                + (" (secondary)" if "primary" in c else "")
            )
            rows.append([c["name"], endpoint, t["interval"].text(thousands=True), said(t["verdict"])])
        if c.get("auc"):
            a = c["auc"]
            endpoint = (
                f"held-out AUC (mean held-out reward from step 0 to {kilo(a['budget'])}"
                + (f" vs {kilo(a['baseline_budget'])}" if a["baseline_budget"] != a["budget"] else "")
                + f"), {c['candidate']} − {c['baseline']} (secondary)"
            )
            rows.append([c["name"], endpoint, str(a["interval"]), said(a["verdict"])])
        for k in c.get("controls", []):
            for h in k["heldout"]:
                if h.get("primary") or "primary" not in c:
                    at = kilo(h["budget"]) + f" vs {kilo(h['baseline_budget'])}"
                    endpoint = f"same-N control: held-out reward @{at}, {k['arm']} − {c['baseline']}"
                    rows.append([c["name"], endpoint, str(h["interval"]), said(h["verdict"])])
        kind = c["kind"] + (f", margin {c['margin']:g}" if c["kind"] == "matches" else "")
        if c.get("controls"):
            kind += "; held only if no same-N control passes"
        verdict = f"**{verdict_text(c)}**"
        missing = phenomenon_missing(result, exp, (c["candidate"], c["baseline"]))[0] if exp else ""
        if missing:
            verdict = f"**{NOT_TESTED}**: {missing} (the intervals alone would read {verdict_text(c)})"
        if c.get("interim"):
            verdict = f"**{IN_PROGRESS}** ({c['interim']}; the rule is read when every planned seed has run)"
        rows.append([c["name"], "**verdict**", kind, verdict])
    return markdown_table(["comparison", "endpoint", "mean [95% CI] (seeds)", "verdict"], rows, aligned=False)


def where_table(result: dict[str, Any]) -> str:
    """The primary endpoints' paired differences grouped by where each side was trained: when runs were
    split over machines, a check that the machine does not stand in for the arm (not part of any verdict)."""
    rows = [
        [
            c["name"],
            f"held-out @{kilo(h['budget'])}",
            g["candidate"],
            g["baseline"],
            g["seeds"],
            f"{g['mean']:+.3f}",
        ]
        for c in result["comparisons"]
        for h in c["heldout"]
        if h.get("primary") or "primary" not in c
        for g in h.get("by_where", [])
    ]
    return (
        "Where each pair was trained (primary endpoints; mean paired difference by machine, a check "
        'beside the verdict and not part of it; "not recorded": a record made before records named '
        "their machine):\n\n"
        + markdown_table(
            [
                "comparison",
                "endpoint",
                "candidate trained on",
                "baseline trained on",
                "seeds",
                "mean difference",
            ],
            rows,
            aligned=False,
        )
    )


def cost_table(result: dict[str, Any]) -> str:
    """What a run costs, per machine: median wall minutes from a record's start to its finish (training and
    evaluations, with whatever else the machine ran beside it), median training minutes, and the runs one
    process finishes an hour at that median. Empty when no record stamps its times."""
    by_env: dict[str, list[tuple[float, float]]] = {}
    spans: dict[str, list[tuple[float, float]]] = {}
    for runs in result["runs"].values():
        for r in runs:
            wall = r.get("wall_seconds", math.nan)
            if wall == wall and wall > 0:
                env = r.get("where", "not recorded")
                by_env.setdefault(env, []).append((wall, r["train_seconds"]))
                if r.get("span") and env != "not recorded":  # unnamed machines may be several
                    spans.setdefault(env, []).append(tuple(r["span"]))
    if not by_env:
        return ""
    rows = []
    for env, times in by_env.items():
        wall = statistics.median(w for w, _ in times) / 60
        train = [t for _, t in times if t == t]
        busy = busy_seconds(spans.get(env, []))
        rows.append(
            [
                env,
                len(times),
                f"{wall:.1f}",
                f"{statistics.median(train) / 60:.1f}" if train else "—",
                f"{60 / wall:.2f}",
                f"{len(spans[env]) * 3600 / busy:.2f}" if busy > 0 else "—",
            ]
        )
    head = [
        "machine",
        "runs",
        "wall min a run (median)",
        "training min (median)",
        "runs an hour, one process",
        "runs an hour, as they ran",
    ]
    return (
        "Cost per run, from the records' start and finish times (a run's evaluations included; runs that "
        "shared a machine with other work took longer). As they ran: runs finished per hour in which at "
        "least one of them was running on that kind of machine (side by side where they went so; the "
        "finishing attempt of each, so a run continued from a checkpoint counts from its last start):\n\n"
        + markdown_table(head, rows, aligned=False)
    )


def machine_splits(result: dict[str, Any]) -> list[str]:
    """The seeds whose arms' records name more than one kind of machine (`machine_kind`, as same_machine
    compares them: not the core count, but the CPU's bf16 and the library versions), each with the
    machines, arm by arm."""
    by_seed: dict[int, dict[str, str]] = {}
    for arm, runs in result["runs"].items():
        for r in runs:
            by_seed.setdefault(r["seed"], {})[arm] = r.get("machine", "not recorded")
    return [
        f"seed {seed}: " + ", ".join(f"{arm} on {where}" for arm, where in arms.items())
        for seed, arms in sorted(by_seed.items())
        if len(set(arms.values())) > 1
    ]


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: the time at least one of them was running."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def events(result: dict[str, Any]) -> str:
    """Per run with any event: first gradient-norm surge, first LR-decay trigger, collapse (steps)."""
    rows = [
        [
            arm,
            r["seed"],
            r["surges"][0] if r["surges"] else "—",
            r["decays"][0] if r["decays"] else "—",
            "—" if r["collapse"] is None else r["collapse"],
        ]
        for arm, runs in result["runs"].items()
        for r in runs
        if r["surges"] or r["decays"] or r["collapse"] is not None
    ]
    if not rows:
        return "No surges, LR-decay triggers or collapses."
    head = ["arm", "seed", "first grad-norm surge", "first LR-decay trigger", "collapse"]
    return markdown_table(head, rows, aligned=False)


def evaluation_noise(exp: Experiment, result: dict[str, Any]) -> str:
    """The evaluation's own noise: a held-out score is the mean of eval_size x eval_samples 0/1 scores, so
    at the arms' mean score p its binomial SD is sqrt(p (1 - p) / (eval_size x eval_samples)) (a lower
    bound when samples of one prompt agree); a paired difference of two evaluations has about sqrt(2) x it."""
    recipe = load_recipe(exp.recipe, {**exp.common, **exp.forced})
    k = int(recipe.get("eval_samples", 1))
    n = int(recipe["eval_size"]) * k
    finals = [v for a in result["arms"].values() for v in a.get("held_out", []) if v is not None and v == v]
    if not finals or n < 1:
        return ""
    p = statistics.fmean(finals)
    sd = math.sqrt(p * (1 - p) / n)
    posed = (
        "distinct held-out problems, each posed once,"
        if recipe.get("eval_distinct_problems")
        else "held-out prompts"
    )
    return (
        f"Evaluation noise: each held-out score averages {n:,} scored samples ({recipe['eval_size']} "
        f"{posed} x {k} sample{'s' * (k > 1)}); at the arms' mean final score {p:.3f} its "
        "binomial SD "
        f"is {sd:.3f}, "
        f"and a paired difference of two evaluations about {math.sqrt(2) * sd:.3f} (lower bounds: samples of "
        "one prompt are correlated)."
    )


def definitions(exp: Experiment) -> str:
    kinds = sorted({c.get("kind", "better") for c in exp.comparisons})
    margins = {c.get("kind"): c.get("margin", 0.0) for c in exp.comparisons}
    rules = "; ".join(f"`{k}`: {rule(k, margins.get(k, 0.0) or 0.0, exp.confidence)}" for k in kinds)
    k = int(load_recipe(exp.recipe, {**exp.common, **exp.forced}).get("eval_samples", 1))
    each = "one sampled completion" if k == 1 else f"the mean score of {k} sampled completions"
    return (
        f"Held-out reward: {each} (temperature of the run) for each held-out prompt, the "
        "same prompts and sampling seed for every arm of a seed, at the first step whose generated tokens "
        "reach the budget. Steps and train seconds are the cost: the seconds include generation, the "
        "energy (for OTB a forward pass of its own unless the sampler or TRL's old-log-prob pass gave it; "
        "`otb/energy_own_pass` in metrics.jsonl says which) and the update, not the held-out evaluations; "
        "runs shared the machine, so seconds compare loosely. Tokens to a threshold: generated tokens "
        f"when the centred moving average of the train reward (over {_smoothing(exp)}) first reaches "
        "it. Clipped: the fraction of steps whose "
        "pre-clip gradient norm exceeded max_grad_norm. Surge: the pre-clip gradient norm, trailing mean "
        f"over {SURGE_SMOOTH} steps with zero-gradient steps left out, above {exp.surge_factor:g}x the "
        f"median of its previous {SURGE_HISTORY} values. Collapsed: the trailing mean reward below "
        f"{exp.collapse_fraction:.0%} of its first window's for {exp.collapse_steps} consecutive steps "
        "inside the run. Censored: a run that ended with its trailing mean below that level for fewer than "
        f"{exp.collapse_steps} steps (too late for the rule to count it; a longer run might have collapsed). "
        "Length CV (run): the within-group length CV (std / mean of completion lengths per group, averaged "
        "over groups) averaged over every logged step of the run, not only its start."
        + (
            " Comparisons are paired by seed (same warm start, same prompts per step, same held-out set); "
            f"verdict rules: {rules}. "
            + (
                "A comparison's verdict is its primary endpoint's (named in the protocol before the runs); "
                "secondary endpoints are reported beside it and do not change it."
                if all("primary" in c for c in exp.comparisons)
                else "A comparison with a primary endpoint takes that endpoint's verdict "
                "(secondary endpoints do not change it); one without (a protocol registered before primary "
                "endpoints existed) is held or did not hold when all its tested endpoints agree, "
                "inconclusive otherwise."
            )
            if exp.comparisons
            else " Verdicts on collapse are stated with the claims that read this page "
            "(`python -m studies claims`)."
        )
    )


def report(
    exp: Experiment,
    result: dict[str, Any],
    results: Path,
    command: str,
    seconds: float | None,
    failures: list[str],
) -> Path:
    """Write `<results>/<name>.md` (+ .png and a .json of the per-arm numbers and comparisons); `seconds`:
    the wall time of an invocation that trained, None for a rebuild from the committed records."""
    results.mkdir(parents=True, exist_ok=True)
    run_minutes = sum(r["train_seconds"] for runs in result["runs"].values() for r in runs) / 60
    md, png = results / f"{exp.name}.md", results / f"{exp.name}.png"
    title = f"{exp.name}: {exp.description}".strip(": ")
    if exp.ladder:  # many arms of few seeds, each with its own learning rate: one column per rung
        decay = exp.roles.get("lr_decay") or {}
        plot_ladder_runs(result["runs"], png, title, _smoothing(exp), variants=decay.values())
    else:
        plot_arms(result, png, title, _smoothing(exp))
    base = load_recipe(exp.recipe, {**exp.common, **exp.forced})
    setting = ", ".join(
        f"{k} {base[k]}"
        for k in (
            "task",
            "model",
            "learning_rate",
            "lr_scheduler_type",
            "warmup_steps",
            "max_generated_tokens",
            "max_completion_length",
            "temperature",
            "eval_size",
            "eval_distinct_problems",
            "eval_samples",
        )
        if k in base and (k not in ("eval_distinct_problems", "eval_samples") or base[k] not in (False, 1))
    )
    arms = "\n".join(f"- `{a}`: {json.dumps(o)}, seeds {exp.arm_seeds(a)}" for a, o in exp.arms.items())
    parts_protocol = protocol_text(exp, result)
    prompts = result["prompt_problems"]
    check = (
        "Same prompts per step: checked from the runs' prompt digests, no difference between the arms "
        "of any seed."
        if not prompts
        else "Same prompts per step: **violated**: " + "; ".join(prompts)
    )
    if exp.same_machine:
        split = machine_splits(result)
        check += " Whole seeds on one kind of machine (`same_machine`, enforced when a run starts): " + (
            "checked from the records, every seed's arms trained on one machine."
            if not split
            else "**violated**: " + "; ".join(split)
        )
    failed = "".join(f"\n- {f}" for f in failures) or " none"
    parts = [
        f"# Experiment `{exp.name}`\n\n{exp.description}",
        f"Regenerate: `{command}` (runs resume: finished ones are kept). Training time summed over the runs: "
        f"{run_minutes:.0f} min; "
        + (
            "this page was rebuilt from the committed run records (nothing trained)."
            if seconds is None
            else f"wall time of the invocation that wrote this page: {seconds / 60:.1f} min."
        ),
        f"Setting: {setting}; prompts per step {exp.prompts_per_step}; seeds {exp.seeds}"
        + (
            f"; learning rates picked on {pilot_seeds_text(exp)} ([{exp.name}-pilot.md]({exp.name}-pilot.md))"
            if exp.pilot
            else ""
        )
        + ".",
        f"Arms:\n{arms}",
        parts_protocol,
        table(exp, result) + "\n\n" + SD_NOTE,
    ]
    if exp.ladder:
        fig_path = results / f"{exp.name}-collapse.png"
        title = f"{exp.name}: collapse against learning rate"
        plot_figure(lambda ax: plot_ladder(result["arms"], ax), fig_path, title)
        parts.append(
            "Learning-rate ladder (collapsed seeds per rung; critical lr: the lowest rung where at least "
            f"half the seeds collapsed):\n\n{ladder_table(result['arms'])}\n\n![collapse]({fig_path.name})"
        )
    if result["comparisons"]:
        parts.append(
            f"Paired comparisons ({exp.confidence:.0%} t intervals over seeds):\n\n"
            + comparisons_table(result, exp)
        )
        if any(c.get("controls") for c in result["comparisons"]):
            parts.append(CONTROLS_NOTE)
        planned = power_text(exp)
        if planned:
            parts.append(
                f"Power: {planned}, from the pilot's power calculation ([{exp.name}-pilot.md]"
                f"({exp.name}-pilot.md)); an inconclusive verdict is read at that power."
            )
        noise = evaluation_noise(exp, result)
        parts += [noise] if noise else []
        parts += (
            [where_table(result)]
            if any(h.get("by_where") for c in result["comparisons"] for h in c["heldout"])
            else []
        )
    if exp.dropped:
        parts.append(
            "Left out of the claims before any run, and why:\n\n"
            + "\n".join(f"- {what}: {why}" for what, why in exp.dropped.items())
        )
    cost = cost_table(result)
    parts += [cost] if cost else []
    parts += [
        f"Events by run (steps):\n\n{events(result)}",
        check,
        definitions(exp),
        f"Failed runs:{failed}",
        f"![{exp.name}]({png.name})",
    ]
    md.write_text("\n\n".join(parts) + "\n")
    (results / f"{exp.name}.json").write_text(json.dumps(to_json(result), indent=1))
    return md


def protocol_text(exp: Experiment, result: dict[str, Any]) -> str:
    """What the page's runs were made under: the registered protocol's hash and time, its amendments,
    and the stamps the runs carry (a run stamped with another hash ran under a changed protocol)."""
    reg = result.get("registration")
    stamps = result.get("protocols", {})
    if reg is None:
        runs = ", ".join(f"{n} under `{h}`" for h, n in stamps.items()) or "none"
        return (
            f"Protocol: **not registered** (runs made before protocol registration). Runs: {runs}."
            + where_text(result)
        )
    text = (
        f"Protocol: registered as `{reg['hash']}` at {reg['registered']} when the first run started "
        + (
            "(its YAML committed then" + (f", {reg['commit'][:10]})" if reg.get("commit") else ")")
            if reg.get("committed")
            else "(its YAML **not committed** then)"
        )
        + "."
    )
    for a in reg.get("amendments", []):
        text += f" **Amended** at {a['at']} (`{a['hash']}`; keys {', '.join(a['changed'])}): {a['reason']}."
    runs = ", ".join(f"{n} under `{h}`" for h, n in stamps.items())
    return text + f" Runs: {runs}." + where_text(result)


def where_text(result: dict[str, Any]) -> str:
    """Where the runs were trained, when records say (an experiment split over machines shows it)."""
    where = result.get("environments") or {}
    if not where or set(where) == {"not recorded"}:
        return ""
    return (
        " Trained on: "
        + "; ".join(
            f"{n} runs on {w}" if w != "not recorded" else f"{n} runs whose record does not name the machine"
            for w, n in where.items()
        )
        + "."
    )


def to_json(result: dict[str, Any]) -> dict[str, Any]:
    """The per-arm numbers and comparisons (intervals as mappings), for `python -m studies claims`."""
    comparisons = []
    for c in result["comparisons"]:
        heldout = [{**h, "interval": _interval(h["interval"])} for h in c["heldout"]]
        tokens = [{**t, "interval": _interval(t["interval"])} for t in c["tokens"]]
        controls = [
            {**k, "heldout": [{**h, "interval": _interval(h["interval"])} for h in k["heldout"]]}
            for k in c.get("controls", [])
        ]
        auc = {"auc": {**c["auc"], "interval": _interval(c["auc"]["interval"])}} if c.get("auc") else {}
        comparisons.append({**c, "heldout": heldout, "tokens": tokens, "controls": controls, **auc})
    reg = result.get("registration")
    return {
        "arms": result["arms"],
        "comparisons": comparisons,
        "prompt_problems": result["prompt_problems"],
        "protocols": result.get("protocols", {}),
        "environments": result.get("environments", {}),
        "first_started": result.get("first_started"),
        "registration": None
        if reg is None
        else {k: v for k, v in reg.items() if k != "protocol"}
        | {"amendments": [{k: v for k, v in a.items() if k != "protocol"} for a in reg["amendments"]]},
        "heldout_split": result.get("heldout_split"),
    }


def pilot_seeds_text(exp: Experiment) -> str:
    seeds = pilot_seeds(exp)
    return f"pilot seed {seeds[0]}" if len(seeds) == 1 else f"pilot seeds {', '.join(map(str, seeds))}"


def power_settings(exp: Experiment) -> dict[str, Any]:
    """The power calculation's settings: the pilot's `power` section over the defaults (80% power at a
    true difference of 0.03, the SD planned at its upper 80% confidence limit)."""
    return {"power": 0.8, "effect": 0.03, "sd_level": 0.8, **((exp.pilot or {}).get("power") or {})}


def power_text(exp: Experiment, comparison: dict[str, Any] | None = None) -> str:
    """The power the reported seeds were planned for, in words (empty without a power calculation in
    the YAML): an inconclusive verdict is read at this power. With `comparison`, its own alternative: a
    true difference of the effect (`better`), or of 0 against the floor -margin (`matches`)."""
    power = exp.power or {}
    if "seeds" not in power:
        return ""
    if comparison is not None and not {comparison["candidate"], comparison["baseline"]} <= set(piloted(exp)):
        return ""  # an arm fixed outside the pilot: the calculation had no data on this comparison
    settings = power_settings(exp)
    kinds = {c.get("kind", "better") for c in ([comparison] if comparison else exp.comparisons)}
    alternative = " or ".join(
        f"a true difference of {float(settings['effect']):+g}"
        if kind == "better"
        else "a true difference of 0 against the margin"
        for kind in sorted(kinds)
    )
    needed = power.get("seeds_needed")
    needed = max(needed) if isinstance(needed, list) and needed else needed
    why = [f"the pilot's variance called for {needed}"] if needed is not None else []
    if power.get("min_seeds"):
        why.append(f"the protocol's floor is {power['min_seeds']}")
    return (
        f"{power['seeds']} seeds a compared arm, planned for {float(settings['power']):.0%} power to say "
        f"held at {alternative}" + (f" ({'; '.join(why)})" if why else "")
    )
