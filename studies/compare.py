"""`python -m studies compare`: an experiment's training runs (arms x seeds, see `experiment`), each one
`otbrl train` run in its own process, analysed (`outcomes`) into one results page with a table, the runs'
events and a plot of what the arms bought."""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from otbrl.app.metrics import moving_average, read_metrics
from otbrl.app.plots import plot_arms, plot_figure
from otbrl.app.recipe import load_recipe
from otbrl.tasks import get_task
from studies.experiment import (
    Experiment,
    experiment_names,
    load_experiment,
    pilot_plan,
    pilot_seeds,
    piloted,
    plan,
    variance_plan,
)
from studies.inference import NOT_TESTED, power_plan, rule, verdict_text
from studies.outcomes import (
    SURGE_HISTORY,
    SURGE_SMOOTH,
    analyse,
    budget_pairs,
    ladder_table,
    phenomenon_missing,
    plot_ladder,
    plot_ladder_runs,
)
from studies.outcomes import interval_json as _interval
from studies.pages import kilo, markdown_table, mean_sd, read_record
from studies.plots import plot_pilot
from studies.runs import (
    ProtocolChanged,
    Run,
    execute,
    has_record,
    protocol,
    protocol_hash,
    record_path,
    register,
    registration,
)

# experiment_names: for otbrl.app.cli
__all__ = ["ProtocolChanged", "compare", "events", "experiment_names", "pilot", "report", "table"]

RESULTS = Path("docs/results")


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
    as on claims.md (`outcomes.phenomenon_missing`)."""
    rows = []
    for c in result["comparisons"]:
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
                    h["verdict"],
                ]
            )
        for t in c["tokens"]:
            endpoint = (
                f"tokens saved to {t['threshold']:g} ({c['baseline']} − {c['candidate']}; "
                f"reached in {t['reached'][0]} and {t['reached'][1]} seeds)"
                + (" (secondary)" if "primary" in c else "")
            )
            rows.append([c["name"], endpoint, t["interval"].text(thousands=True), t["verdict"]])
        if c.get("auc"):
            a = c["auc"]
            endpoint = (
                f"held-out AUC (mean held-out reward from step 0 to {kilo(a['budget'])}"
                + (f" vs {kilo(a['baseline_budget'])}" if a["baseline_budget"] != a["budget"] else "")
                + f"), {c['candidate']} − {c['baseline']} (secondary)"
            )
            rows.append([c["name"], endpoint, str(a["interval"]), a["verdict"]])
        for k in c.get("controls", []):
            for h in k["heldout"]:
                if h.get("primary") or "primary" not in c:
                    at = kilo(h["budget"]) + f" vs {kilo(h['baseline_budget'])}"
                    endpoint = f"same-N control: held-out reward @{at}, {k['arm']} − {c['baseline']}"
                    rows.append([c["name"], endpoint, str(h["interval"]), h["verdict"]])
        kind = c["kind"] + (f", margin {c['margin']:g}" if c["kind"] == "matches" else "")
        if c.get("controls"):
            kind += "; held only if no same-N control passes"
        verdict = f"**{verdict_text(c)}**"
        missing = phenomenon_missing(result, exp, (c["candidate"], c["baseline"]))[0] if exp else ""
        if missing:
            verdict = f"**{NOT_TESTED}**: {missing} (the intervals alone would read {verdict_text(c)})"
        rows.append(
            [c["name"], "**verdict**", kind, verdict + (f" ({c['interim']})" if c.get("interim") else "")]
        )
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
    """The seeds whose arms' records name more than one machine, each with the machines, arm by arm."""
    by_seed: dict[int, dict[str, str]] = {}
    for arm, runs in result["runs"].items():
        for r in runs:
            by_seed.setdefault(r["seed"], {})[arm] = r.get("where", "not recorded")
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
    failed = "\n".join(f"- {f}" for f in failures) or "none"
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
            f"; learning rates picked on {_pilot_seeds_text(exp)} "
            f"([{exp.name}-pilot.md]({exp.name}-pilot.md))"
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
        f"Failed runs: {failed}",
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


def _stamp(exp: Experiment, records: Path, kind: str, amend: str | None, quick: bool) -> dict[str, Any]:
    """Register the protocol (at the first run) or check it against the registered one; the stamp every
    run of this invocation records."""
    proto = protocol(exp.raw, kind)
    if quick:  # a smoke run: its own protocol, never compared with the real one
        proto = {**proto, "quick": {"forced": exp.forced, "seeds": exp.seeds, "arms": list(exp.arms)}}
    register(records, proto, exp.source, amend)
    return {"hash": protocol_hash(proto), "kind": kind}


def _heldout_split(exp: Experiment) -> dict[str, Any] | None:
    """The held-out side the runs' evaluations drew from (built-in tasks: `load_rows` splits them)."""
    task = load_recipe(exp.recipe, {**exp.common, **exp.forced}).get("task")
    if not task:
        return None
    return {"task": task, "fraction": get_task(task).heldout_fraction, "salt": task}


def select(exp: Experiment, runs: list[Run], seeds: list[int] | None, arms: list[str] | None) -> list[Run]:
    """The runs of `seeds` and `arms` (None: all): the share of an experiment one machine trains while
    others train the rest; their records merge in the experiment's folder. Seeds and arms outside the
    protocol are an error, not an empty share."""
    extra = sorted(set(seeds or ()) - set(exp.seeds))
    if extra:
        raise ValueError(f"{exp.name}: seeds {extra} are not among the protocol's seeds {exp.seeds}")
    unknown = sorted(set(arms or ()) - set(exp.arms))
    if unknown:
        raise ValueError(f"{exp.name}: arms {unknown} are not among the protocol's arms {list(exp.arms)}")
    return [r for r in runs if (seeds is None or r.seed in seeds) and (arms is None or r.arm in arms)]


def _execute(
    exp: Experiment,
    label: str,
    runs: list[Run],
    jobs: int,
    log: Any,
    records: Path,
    stamp: dict[str, Any],
    stop_at: float | None = None,
    commit: bool = False,
) -> list[str]:
    """`execute` with what every stage of an experiment shares: its recipe and machine rule."""
    return execute(
        label,
        exp.recipe,
        runs,
        jobs=jobs,
        log=log,
        records=records,
        stamp=stamp,
        same_machine=exp.same_machine,
        stop_at=stop_at,
        commit=commit,
    )


def compare(
    spec: str,
    *,
    quick: bool = False,
    jobs: int = 2,
    runs_dir: Path | None = None,
    results: Path | None = None,
    log: Any = print,
    amend: str | None = None,
    train: bool = True,
    seeds: list[int] | None = None,
    arms: list[str] | None = None,
    stop_at: float | None = None,
    commit: bool = False,
) -> tuple[Path, list[str]]:
    """Plan, run (resuming from committed records; `train=False`: nothing, the page from the committed
    records alone), analyse and report one experiment. Returns (results
    page, failures). Quick runs go to runs/compare-quick/ and leave docs/results alone unless `results`
    says otherwise. The protocol is registered at the first run and checked at every later invocation
    (`amend`: the reason for a change, recorded); with a pilot gate, no reported run starts until the
    pilot's committed runs pass it and the YAML holds its picks (and its power calculation). `seeds` and
    `arms` train only that share of the runs (`select`); the page reads every run that has a record."""
    exp = load_experiment(spec, quick)
    root = Path("runs/compare-quick" if quick else "runs/compare")
    runs_dir = runs_dir or root / exp.name
    results = results or (root / "results" if quick else RESULTS)
    records = results / "runs" / exp.name
    runs = plan(exp, runs_dir)
    share = select(exp, runs, seeds, arms)  # a share outside the protocol fails before anything else
    if not quick and train:
        problems = gate_problems(exp, results)
        if problems:
            raise RuntimeError(
                f"{exp.name}: the pilot's gate is not passed, so no reported run starts:\n- "
                + "\n- ".join(problems)
            )
    start = time.perf_counter()
    failures: list[str] = []
    if train:
        stamp = _stamp(exp, records, "main", amend, quick)
        log(
            f"{exp.name}: {len(runs)} runs ({len(exp.arms)} arms, seeds {exp.seeds}) in {runs_dir}; records "
            f"in {records}; protocol {stamp['hash']}"
        )
        if len(share) < len(runs):
            log(
                f"{exp.name}: this share is {len(share)} of the {len(runs)} runs (seeds {seeds or 'all'}, "
                f"arms {arms or 'all'}); the page reads every run with a record"
            )
        failures = _execute(exp, exp.name, share, jobs, log, records, stamp, stop_at, commit)
    else:
        runs = [r for r in runs if has_record(r, records)]
        log(f"{exp.name}: {len(runs)} runs with committed records in {records} (none trained)")
        if not runs:  # e.g. only step-0 scores committed ahead of the runs: nothing to build a page from
            raise RuntimeError(f"{exp.name}: no committed run record in {records} to build a page from")
    result = analyse(exp, runs, records)
    if not result["arms"]:
        raise RuntimeError(f"{exp.name}: every run failed:\n" + "\n".join(failures))
    result["registration"], result["heldout_split"] = registration(records), _heldout_split(exp)
    command = f"python -m studies compare {spec}" + (" --quick" if quick else "") + f" --jobs {jobs}"
    seconds = time.perf_counter() - start if train else None  # a rebuild's seconds say nothing: not shown
    page = report(exp, result, results, command, seconds, failures)
    log(table(exp, result))
    return page, failures


def _pilot_seeds_text(exp: Experiment) -> str:
    seeds = pilot_seeds(exp)
    return f"pilot seed {seeds[0]}" if len(seeds) == 1 else f"pilot seeds {', '.join(map(str, seeds))}"


def pilot_rule(exp: Experiment) -> str:
    """The pilot's pick rule in words: the older one (train reward, one seed) or issue 33's (held-out
    reward at the end of the arm's budget, averaged over at least three pilot seeds)."""
    seeds = pilot_seeds(exp)
    if (exp.pilot or {}).get("pick") == "heldout":
        return (
            f"Seeds {', '.join(map(str, seeds))} (not reported seeds). Rule: each arm takes the learning "
            "rate with the highest held-out reward at the end of its budget, averaged over these seeds (the "
            "gate reads the mean gain at the pick); the picks are written into the experiment's YAML before "
            "its reported runs. These numbers are not evidence for any claim."
        )
    return (
        f"Seed {seeds[0]} (not a reported seed). Rule: each arm takes the learning rate with the "
        "highest mean train reward over the last quarter of its steps; the picks are written into the "
        "experiment's YAML before its reported runs. These numbers are not evidence for any claim."
    )


def pilot_score(rows: Path | list[dict[str, Any]]) -> float:
    """The pilot's rule: mean train reward over the last quarter of the run's steps (rows of a
    metrics.jsonl, or a run directory holding one)."""
    if isinstance(rows, Path):
        rows = read_metrics(rows / "metrics.jsonl", "reward")
    rewards = [r["reward"] for r in rows if "reward" in r]
    k = max(1, len(rewards) // 4)
    return sum(rewards[-k:]) / k


def _run_data(run: Run, records: Path | None) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
    """(metrics rows, summary) of a finished run: its committed record, else its directory."""
    if has_record(run, records):
        rec = read_record(record_path(records, run.arm, run.seed))
        return rec["metrics"], rec["summary"]
    if (run.dir / "summary.json").is_file():
        return read_metrics(run.dir / "metrics.jsonl"), json.loads((run.dir / "summary.json").read_text())
    return None


def _pick_score(data: tuple[list[dict[str, Any]], dict[str, Any]], by_heldout: bool) -> float:
    """One pilot run's score for the pick: its held-out reward at the end of the run (the arm's final
    budget; `pilot.pick: heldout`, issue 33), else the older rule, its late train reward."""
    rows, summary = data
    if by_heldout:
        after = summary.get("held-out reward after")
        return math.nan if after is None else float(after)
    return pilot_score(rows)


def _seeds_run(data: list[Any]) -> str:
    """A pilot cell whose seeds have not all run: how many have (no mean of the first ones)."""
    done = sum(d is not None for d in data)
    return f"{done} of {len(data)} seeds run" if done else "not run"


def _gain(summary: dict[str, Any]) -> float | None:
    before, after = summary.get("held-out reward before"), summary.get("held-out reward after")
    return None if before is None or after is None else after - before


def gate_need(gate: dict[str, Any], arm: str) -> float:
    """The held-out gain the pilot's gate asks of `arm`: its own threshold, else the common one."""
    return float((gate.get("arms") or {}).get(arm, gate["heldout_gain"]))


def picks_and_gate(
    exp: Experiment, runs: list[Run], records: Path | None
) -> tuple[dict[str, float], list[list[Any]], list[list[Any]], bool]:
    """From the pilot's first-stage runs: each arm's pick (`pilot_score`), the score table, the gate table
    (held-out reward at step 0 and at the end of the picked run, its gain, the arm's threshold) and
    whether every arm passed (True when the pilot has no gate)."""
    gate = (exp.pilot or {}).get("gate")
    by_heldout = (exp.pilot or {}).get("pick") == "heldout"
    lrs = sorted({r.overrides["learning_rate"] for r in runs})
    picks, score_rows, gate_rows, ok = {}, [], [], True
    for arm in piloted(exp):
        mine = [r for r in runs if r.arm.startswith(arm + "@")]
        data: dict[float, list[Any]] = {}
        for r in mine:  # every seed of every rate; a rate is scored only once all its seeds are in
            data.setdefault(r.overrides["learning_rate"], []).append(_run_data(r, records))
        scores = {
            lr: statistics.fmean(_pick_score(d, by_heldout) for d in ds)
            for lr, ds in data.items()
            if ds and all(d is not None for d in ds)
        }
        cells = [
            f"{scores[lr]:.3f}" if lr in scores else _seeds_run(data[lr]) if lr in data else "—" for lr in lrs
        ]
        if len(scores) < len(data) or not scores:  # a pick needs every rate of the arm's grid
            score_rows.append([arm, *cells, "pending"])
            if gate is not None:
                need = gate_need(gate, arm)
                gate_rows.append([arm, "pending", "—", "—", "—", f"≥ {need:g}", "pending"])
            ok = False
            continue
        picks[arm] = max(scores, key=scores.__getitem__)
        score_rows.append([arm, *cells, f"{picks[arm]:g}"])
        if gate is not None:
            need = gate_need(gate, arm)
            summaries = [d[1] for d in data[picks[arm]]]
            gains = [g for g in map(_gain, summaries) if g is not None]
            gain = statistics.fmean(gains) if len(gains) == len(summaries) else None  # over the pilot seeds
            passed = gain is not None and gain >= need
            ok &= passed
            gate_rows.append(
                [
                    arm,
                    f"{picks[arm]:g}",
                    _fmt(
                        statistics.fmean(s.get("held-out reward before") for s in summaries)
                        if gain is not None
                        else None
                    ),
                    _fmt(
                        statistics.fmean(s.get("held-out reward after") for s in summaries)
                        if gain is not None
                        else None
                    ),
                    _fmt(gain, sign=True),
                    f"≥ {need:g}",
                    "**passed**" if passed else "**failed**",
                ]
            )
    if gate is not None and gate.get("gap"):
        row, passed = gap_row(gate["gap"], picks, runs, records)
        gate_rows.append(row)
        ok &= passed
    return picks, score_rows, gate_rows, ok


def gap_row(
    gap: dict[str, Any], picks: dict[str, float], runs: list[Run], records: Path | None
) -> tuple[list[Any], bool]:
    """The gate's gap (issue 33, item 3): claim (b) can single out OTB only where the larger group, given
    its budget, beats the smaller one. Passed when the larger arm's held-out reward at the end of its
    budget, at its pick and averaged over the pilot seeds, exceeds the smaller arm's by at least `margin`."""
    ends = {}
    for role in ("larger", "smaller"):
        arm = gap[role]
        mine = [r for r in runs if r.arm == f"{arm}@{picks.get(arm)}"] if arm in picks else []
        data = [_run_data(r, records) for r in mine]
        after = [d[1].get("held-out reward after") for d in data if d is not None]
        ends[role] = (
            statistics.fmean(after) if mine and len(after) == len(mine) and None not in after else None
        )
    name = f"gap: {gap['larger']} − {gap['smaller']}"
    if None in ends.values():
        return [name, "pending", "—", "—", "—", f"≥ {float(gap['margin']):g}", "pending"], False
    diff = ends["larger"] - ends["smaller"]
    passed = diff >= float(gap["margin"])
    return [
        name,
        f"{picks[gap['larger']]:g} / {picks[gap['smaller']]:g}",
        _fmt(ends["smaller"]),
        _fmt(ends["larger"]),
        _fmt(diff, sign=True),
        f"≥ {float(gap['margin']):g}",
        "**passed**" if passed else "**failed**",
    ], passed


def pilot_grids(
    exp: Experiment, runs: list[Run], records: Path | None
) -> tuple[list[list[Any]], list[list[Any]]]:
    """Per arm and rate, for reading the pilot (not for its rule): the held-out gain from step 0 to the
    end of the run, and the within-group length CV averaged over every step of the run, each averaged
    over the pilot's seeds as the rule averages its score; a cell with some seeds still to run says how
    many have run, not a mean of the first ones."""
    lrs = sorted({r.overrides["learning_rate"] for r in runs})
    gains, cvs = [], []
    for arm in exp.arms:
        g, c = [arm], [arm]
        for lr in lrs:
            mine = [r for r in runs if r.arm.startswith(arm + "@") and r.overrides["learning_rate"] == lr]
            data = [_run_data(r, records) for r in mine]
            if not data or None in data:
                g.append(_seeds_run(data) if data else "—")
                c.append(g[-1])
                continue
            per_run = [_gain(d[1]) for d in data]
            g.append(_fmt(None if None in per_run else statistics.fmean(per_run), sign=True))
            run_cvs = [
                statistics.fmean(values)
                for values in (
                    [row["otb/horizon/length_cv"] for row in d[0] if "otb/horizon/length_cv" in row]
                    for d in data
                )
                if values
            ]
            c.append(_fmt(statistics.fmean(run_cvs)) if len(run_cvs) == len(data) else "—")
        gains.append(g)
        cvs.append(c)
    return gains, cvs


def pilot_curves(
    exp: Experiment, runs: list[Run], records: Path | None, picks: dict[str, float]
) -> tuple[dict[str, Any], dict[str, tuple[float, float]]]:
    """What `plots.plot_pilot` draws: per arm and rate, held-out reward at step 0 and at each budget, and
    the trailing mean of train reward (over a quarter of the run's steps, as the pick rule reads it),
    against generated tokens; and per picked arm the held-out level its gate asks for."""
    gate = (exp.pilot or {}).get("gate")
    curves: dict[str, Any] = {}
    gates: dict[str, tuple[float, float]] = {}
    for r in runs:
        d = _run_data(r, records)
        if d is None:
            continue
        rows, summary = d
        arm, lr = r.arm.rpartition("@")[0], float(r.overrides["learning_rate"])
        before = summary.get("held-out reward before")
        held = [(0.0, before)] if before is not None else []
        held += [
            (row["generated_tokens"], row["heldout_reward"]) for row in rows if row.get("heldout_budgets")
        ]
        rewarded = [row for row in rows if "reward" in row]
        w = max(1, len(rewarded) // 4)
        smooth = moving_average([row["reward"] for row in rewarded], w, centred=False)
        train = [(row["generated_tokens"], s) for row, s in zip(rewarded, smooth, strict=False)]
        curves.setdefault(arm, {})[lr] = {"heldout": held, "train": train}
        if gate is not None and picks.get(arm) == lr and before is not None:
            gates[arm] = (lr, before + gate_need(gate, arm))
    return {a: curves[a] for a in exp.arms if a in curves}, gates


def superseded_text(folder: Path) -> str:
    """The runs an amendment set aside (`<folder>/<amendment>/<arm>/seed<k>.json.gz`): kept, not read by
    the picks or the gate, listed with their held-out reward so the reason for the amendment stays
    checkable."""
    lines = []
    for path in sorted(folder.glob("*/*/seed*.json.gz")):
        rec = read_record(path)
        s = rec["summary"]
        lines.append(
            f"- {path.parent.parent.name}: `{rec['arm']}` seed {rec['seed']}, held-out "
            f"{_fmt(s.get('held-out reward before'))} → {_fmt(s.get('held-out reward after'))} "
            f"({_fmt(_gain(s), sign=True)}), {s.get('steps')} steps, "
            f"{s.get('generated tokens', 0) / 1000:.0f}k tokens"
        )
    head = (
        f"Runs set aside by an amendment (their design changed; kept under `{folder.as_posix()}/` for "
        "audit, not read by the picks or the gate):"
    )
    return head + "\n\n" + "\n".join(lines)


def _fmt(value: float | None, sign: bool = False) -> str:
    return "—" if value is None else (f"{value:+.3f}" if sign else f"{value:.3f}")


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


def power_plans(exp: Experiment, runs: list[Run], records: Path | None) -> list[dict[str, Any]]:
    """The power calculation of each comparison from the pilot's variance seeds: paired differences of
    held-out reward at the comparison's primary budget (its last budget without one), the planned SD
    (an upper confidence limit, `inference.sd_upper`) and the seeds that reach the protocol's power."""
    settings = power_settings(exp)
    by_arm: dict[str, dict[int, float]] = {}
    for r in runs:
        d = _run_data(r, records)
        if d is None:
            continue
        heldout = {int(b): row["heldout_reward"] for row in d[0] for b in row.get("heldout_budgets", [])}
        by_arm.setdefault(r.arm.rpartition("@")[0], {})[r.seed] = heldout
    out = []
    arms = set(piloted(exp))  # an arm fixed outside the pilot has no pilot data to plan its comparison on
    for c in (c for c in exp.comparisons if {c["candidate"], c["baseline"]} <= arms):
        budget = int(c.get("primary", c.get("budgets", [0])[-1]))
        budgets, base_budgets = budget_pairs(c)
        base_budget = base_budgets[budgets.index(budget)] if budget in budgets else budget
        cand, base = by_arm.get(c["candidate"], {}), by_arm.get(c["baseline"], {})
        diffs = [
            cand[s][budget] - base[s][base_budget]
            for s in sorted(set(cand) & set(base))
            if budget in cand[s] and base_budget in base[s]
        ]
        kind = c.get("kind", "better")
        calc = power_plan(
            diffs,
            kind,
            float(c.get("margin", 0.0)),
            float(settings["effect"]),
            exp.confidence,
            float(settings["power"]),
            float(settings["sd_level"]),
        )
        out.append(
            {
                "name": c["name"],
                "kind": kind,
                "budget": budget,
                "diffs": diffs,
                **calc,
                "target": settings["power"],
            }
        )
    return out


def gate_problems(exp: Experiment, results: Path) -> list[str]:
    """Why the reported runs may not start yet (empty: they may): with a pilot gate, every arm must have
    passed it in the pilot's committed runs and the YAML must hold each arm's pick; with variance seeds,
    the YAML's `power.seeds` must be at least what the pilot's variance calls for."""
    if not exp.pilot or "gate" not in exp.pilot:
        return []
    records = results / "runs" / f"{exp.name}-pilot"
    stage1 = pilot_plan(exp, Path("runs/compare") / exp.name / "pilot")
    picks, _, gate_rows, ok = picks_and_gate(exp, stage1, records)
    problems = [
        f"{row[0]}: held-out gain {row[4]} at its pick {row[1]} (needs {row[5]})"
        for row in gate_rows
        if row[-1] not in ("**passed**", "pending")
    ]
    if not ok and len(picks) < len(piloted(exp)):
        problems.append(
            f"the pilot has not run (or not every arm): `python -m studies compare {exp.name} --pilot`"
        )
    for arm, lr in picks.items():
        own = (exp.arms[arm] or {}).get("learning_rate")
        if own is None or float(own) != float(lr):
            problems.append(f"{arm}: the YAML's learning_rate is {own}, the pilot picked {lr:g}")
    if ok and exp.pilot.get("variance_seeds"):
        stage2 = variance_plan(exp, Path("runs/compare") / exp.name / "pilot", picks)
        picked = [r for r in stage1 if r.overrides["learning_rate"] == picks.get(r.arm.rpartition("@")[0])]
        plans = power_plans(exp, picked + stage2, records)
        need = [p["seeds"] for p in plans]
        floor = int((exp.power or {}).get("min_seeds", 0))
        have = (exp.power or {}).get("seeds")
        if any(n is None for n in need) or not need:
            problems.append("the pilot's variance seeds are not all run, or call for more than 200 seeds")
        elif have is None or int(have) < max(*need, floor):
            problems.append(
                f"power: the pilot's variance calls for {max(need)} seeds per compared arm"
                + (f" and the protocol's floor is {floor}" if floor else "")
                + f"; the YAML's power section says {have}"
            )
    return problems


def pilot(
    spec: str,
    *,
    jobs: int = 2,
    runs_dir: Path | None = None,
    results: Path | None = None,
    log: Any = print,
    amend: str | None = None,
    train: bool = True,
    arms: list[str] | None = None,
    stop_at: float | None = None,
    commit: bool = False,
) -> tuple[Path, dict[str, float]]:
    """Run the experiment's pilot (`train=False`: nothing; its page from the committed records alone):
    every arm at each pilot learning rate on the pilot seed, each arm's pick by `pilot_score` and the
    gate (held-out gain at the pick); if every arm passed and the pilot has `variance_seeds`, the picks
    on those seeds and the power calculation from their paired differences. Writes
    `<results>/<name>-pilot.md`; its runs' records go to `<results>/runs/<name>-pilot/`. The picks and
    the power calculation go into the experiment's YAML by hand, before its reported runs (which
    `compare` checks); the pilot's seeds are never reported ones. `arms` trains only those arms' runs
    of the first stage (the gap's arms first, say: if the gap fails, the others need not run); the page
    reads every run with a record, and the second stage waits for the whole first."""
    exp = load_experiment(spec)
    runs_dir = runs_dir or Path("runs/compare") / exp.name / "pilot"
    results = results or RESULTS
    records = results / "runs" / f"{exp.name}-pilot"
    runs = pilot_plan(exp, runs_dir)
    unknown = sorted(set(arms or ()) - set(piloted(exp)))
    if unknown:
        raise ValueError(f"{exp.name} pilot: arms {unknown} are not among its arms {piloted(exp)}")
    share = [r for r in runs if arms is None or r.arm.split("@")[0] in arms]
    stamp: dict[str, Any] = {}
    failures: list[str] = []
    if train:
        stamp = _stamp(exp, records, "pilot", amend, quick=False)
        log(
            f"{exp.name} pilot: {len(share)} of {len(runs)} runs ({_pilot_seeds_text(exp)}; arms "
            f"{arms or 'all'}) in {runs_dir}; protocol {stamp['hash']}"
        )
        failures = _execute(exp, f"{exp.name} pilot", share, jobs, log, records, stamp, stop_at, commit)
    if failures:
        raise RuntimeError(f"{exp.name} pilot: failed runs:\n" + "\n".join(failures))
    picks, _, _, ok = picks_and_gate(exp, runs, records)
    stage2: list[Run] = []
    if ok and exp.pilot.get("variance_seeds") and not train:
        stage2 = [r for r in variance_plan(exp, runs_dir, picks) if has_record(r, records)]
    elif ok and exp.pilot.get("variance_seeds") and arms is not None:
        log(f"{exp.name} pilot: gate passed; its second stage runs without --arms (every arm at its pick)")
    elif ok and exp.pilot.get("variance_seeds"):
        stage2 = variance_plan(exp, runs_dir, picks)
        log(
            f"{exp.name} pilot: gate passed; {len(stage2)} runs at the picks on seeds "
            f"{exp.pilot['variance_seeds']}"
        )
        failures = _execute(
            exp, f"{exp.name} pilot variance", stage2, jobs, log, records, stamp, stop_at, commit
        )
        if failures:
            raise RuntimeError(f"{exp.name} pilot: failed runs:\n" + "\n".join(failures))
    command = f"python -m studies compare {spec} --pilot --jobs {jobs}"
    return pilot_page(exp, runs, results, command, log, records=records, stage2=stage2)


def pilot_page(
    exp: Experiment,
    runs: list[Any],
    results: Path,
    command: str,
    log: Any = print,
    records: Path | None = None,
    stage2: list[Run] | None = None,
) -> tuple[Path, dict[str, float]]:
    """The pilot's picks, gate and power calculation from its finished runs (committed records where
    `records` holds them), and its page `<results>/<name>-pilot.md`."""
    picks, rows, gate_rows, ok = picks_and_gate(exp, runs, records)
    lrs = [f"{lr:g}" for lr in sorted({r.overrides["learning_rate"] for r in runs})]
    results.mkdir(parents=True, exist_ok=True)
    page = results / f"{exp.name}-pilot.md"
    grid = markdown_table(["arm", *(f"lr {lr}" for lr in lrs), "pick"], rows, aligned=False)
    parts = [
        f"# Pilot of experiment `{exp.name}`",
        f"Regenerate: `{command}` (runs with a committed record in `docs/results/runs/{exp.name}-pilot/` "
        f"are not redone; `python -m studies compare {exp.name} --pilot --no-run` rebuilds this page from "
        "them alone).",
        pilot_rule(exp),
        grid,
    ]
    first = [r for r in runs if r.seed == pilot_seeds(exp)[0]]  # the curves read one seed
    gains, cvs = pilot_grids(exp, runs, records)
    head = ["arm", *(f"lr {lr}" for lr in lrs)]
    seeds = pilot_seeds(exp)
    over = f"on {_pilot_seeds_text(exp)}" if len(seeds) == 1 else f"the mean over {_pilot_seeds_text(exp)}"
    parts += [
        "Held-out gain of each arm and rate (held-out reward at the end of its budget minus at step 0, same "
        f"prompts), {over}, for reading the pilot; the gate reads it at each arm's pick:\n\n"
        + markdown_table(head, gains, aligned=False),
        "Within-group length CV of each arm and rate, averaged over every step of a run, "
        f"{over} (the phenomenon must hold over whole runs: "
        f"{', '.join(f'{k} ≥ {v:g}' for k, v in exp.phenomenon.items()) or 'no floor set'}):\n\n"
        + markdown_table(head, cvs, aligned=False),
    ]
    reg = registration(records) if records is not None else None
    if reg is not None:
        parts.insert(2, protocol_text(exp, {"registration": reg, "protocols": {}}).replace(" Runs: .", ""))
    gate = exp.pilot.get("gate")
    if gate is not None:
        parts.append(
            "Gate (fixed in the protocol before the pilot ran): at its pick, each arm's held-out reward must "
            "rise by at least its threshold from step 0 to the end of its budget"
            + (
                "; and the gap: the larger group's held-out reward at the end of its budget must exceed "
                "the smaller group's at the end of its own by the margin (its row: the smaller's end, the "
                "larger's end, their difference)"
                if gate.get("gap")
                else ""
            )
            + "; reported runs start only when every row passes. "
            + ("**Every arm passed.**" if ok else "**Not passed: no reported run starts.**")
            + "\n\n"
            + markdown_table(
                ["arm", "pick", "held-out @0", "held-out at the end", "gain", "needs", "gate"],
                gate_rows,
                aligned=False,
            )
        )
    if stage2:
        picked = [r for r in runs if r.overrides["learning_rate"] == picks.get(r.arm.rpartition("@")[0])]
        plans = power_plans(exp, picked + stage2, records)
        prow = [
            [
                p["name"],
                p["kind"],
                kilo(p["budget"]),
                p["pilot_seeds"],
                " ".join(f"{d:+.3f}" for d in p["diffs"]) or "—",
                _fmt(p["pilot_sd"]),
                _fmt(p["sd_planned"]),
                f"{p['floor']:+g}",
                f"{p['delta']:+g}",
                p["seeds"] if p["seeds"] is not None else "> 200",
            ]
            for p in plans
        ]
        target = plans[0]["target"] if plans else 0.8
        parts.append(
            f"Power (the pilot seed and variance seeds {exp.pilot['variance_seeds']}, each arm at its pick): "
            "paired differences "
            "of held-out reward at each comparison's primary budget; the plan's SD is the upper 80% "
            "confidence limit of their SD; seeds: the fewest for which the verdict rule says held with "
            f"probability ≥ {target:g} when the true difference is δ ({exp.confidence:.0%} t interval above "
            "the floor; "
            "`studies.inference`). The YAML's `power.seeds` must be at least the largest (and at least "
            "`power.min_seeds`, the protocol's floor, where it sets one).\n\n"
            + markdown_table(
                [
                    "comparison",
                    "kind",
                    "primary budget",
                    "seeds",
                    "differences",
                    "SD",
                    "SD planned",
                    "floor",
                    "δ",
                    "seeds needed",
                ],
                prow,
                aligned=False,
            )
        )
    if records is not None and (records / "superseded").is_dir():
        parts.append(superseded_text(records / "superseded"))
    curves, gates = pilot_curves(exp, first, records, picks)  # the first pilot seed: one line per rate
    if curves:
        png = results / f"{exp.name}-pilot.png"
        title = (
            f"Pilot of {exp.name} (seed {exp.pilot['seed']}): held-out and train reward per learning "
            "rate; dotted: the level the gate asks of each arm's pick"
        )
        plot_pilot(curves, png, title, gates)
        parts.insert(4, f"![held-out and train reward of every pilot run]({png.name})")
    page.write_text("\n\n".join(parts) + "\n")
    log(grid)
    return page, picks
