"""`otbrl compare`: an experiment's training runs (arms x seeds, see `experiment`), each one `otbrl train`
run in its own process, analysed (`outcomes`) into one results page with a table, the runs' events and a
plot of what the arms bought."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from otbrl.app.studies.experiment import Experiment, experiment_names, load_experiment, pilot_plan, plan
from otbrl.app.studies.ladder import ladder_table, plot_ladder, plot_ladder_runs
from otbrl.app.studies.outcomes import SURGE_HISTORY, SURGE_SMOOTH, analyse
from otbrl.app.studies.outcomes import interval_json as _interval
from otbrl.app.studies.plots import plot_arms, plot_figure
from otbrl.app.studies.report import markdown_table, mean_sd
from otbrl.app.studies.runs import execute, read_metrics

# experiment_names: for otbrl.app.cli
__all__ = ["compare", "events", "experiment_names", "pilot", "report", "table"]

RESULTS = Path("docs/results")


def _smoothing(exp: Experiment) -> str:
    return f"{exp.smooth_samples} samples" if exp.smooth_samples else f"{exp.smooth} steps"


def _k(tokens: float) -> str:
    return f"{tokens / 1000:g}k"


def _whole(values: list[float]) -> str:
    """'41 ± 1' (whole numbers: steps, seconds)."""
    kept = [v for v in values if v is not None and v == v]
    if not kept:
        return "—"
    return f"{statistics.fmean(kept):.0f}" + (f" ± {statistics.stdev(kept):.0f}" if len(kept) > 1 else "")


def _collapsed(s: dict[str, Any]) -> str:
    steps = [c for c in s["collapses"] if c is not None]
    return f"{len(steps)}/{s['seeds']}" + (f" ({', '.join(map(str, steps))})" if steps else "")


def table(exp: Experiment, result: dict[str, Any]) -> str:
    """One row per arm: held-out reward at each budget, tokens to each threshold, final train reward,
    tokens, steps and train seconds (the energy pass included), clipped fraction, surges, collapses
    (mean ± sd over seeds)."""
    budgets = sorted({b for s in result["arms"].values() for b in s["heldout"]})
    head = ["arm", "seeds", *(f"held-out @{_k(b)}" if b else "held-out before" for b in budgets),
            *(f"tokens to {th:g} (reached)" for th in exp.thresholds),
            "final train reward", "tokens", "steps", "train s", "clipped", "surges",
            "collapsed (step)"]  # fmt: skip
    rows = []
    for arm, s in result["arms"].items():
        reach = [
            f"{mean_sd(ts)} ({sum(t is not None for t in ts)}/{s['seeds']})"
            for ts in (s["to_threshold"][th] for th in exp.thresholds)
        ]
        rows.append([
            arm, s["seeds"], *(mean_sd(s["heldout"].get(b, [])) for b in budgets), *reach,
            mean_sd(s["final"]), mean_sd(s["total_tokens"]), _whole(s["steps_run"]),
            _whole(s["train_seconds"]), mean_sd(s["clip_fraction"]), s["surges"],
            _collapsed(s),
        ])  # fmt: skip
    return markdown_table(head, rows, aligned=False)


def comparisons_table(result: dict[str, Any]) -> str:
    """One row per paired endpoint of each comparison: the mean difference, its interval, the verdict."""
    rows = []
    for c in result["comparisons"]:
        for h in c["heldout"]:
            at = _k(h["budget"]) + (f" vs {_k(h['baseline_budget'])}" if h["baseline_budget"] != h["budget"]
                                    else "")  # fmt: skip
            rows.append([c["name"], f"held-out reward @{at}, {c['candidate']} − {c['baseline']}",
                         str(h["interval"]), h["verdict"]])  # fmt: skip
        for t in c["tokens"]:
            endpoint = (f"tokens saved to {t['threshold']:g} ({c['baseline']} − {c['candidate']}; "
                        f"reached in {t['reached'][0]} and {t['reached'][1]} seeds)")  # fmt: skip
            rows.append([c["name"], endpoint, t["interval"].text(thousands=True), t["verdict"]])
        kind = c["kind"] + (f", margin {c['margin']:g}" if c["kind"] == "matches" else "")
        rows.append([c["name"], "**verdict**", kind, f"**{c['verdict']}**"])
    return markdown_table(["comparison", "endpoint", "mean [95% CI] (seeds)", "verdict"], rows, aligned=False)


def events(result: dict[str, Any]) -> str:
    """Per run with any event: first gradient-norm surge, first LR-decay trigger, collapse (steps)."""
    rows = [
        [arm, r["seed"], r["surges"][0] if r["surges"] else "—", r["decays"][0] if r["decays"] else "—",
         "—" if r["collapse"] is None else r["collapse"]]
        for arm, runs in result["runs"].items()
        for r in runs
        if r["surges"] or r["decays"] or r["collapse"] is not None
    ]  # fmt: skip
    if not rows:
        return "No surges, LR-decay triggers or collapses."
    head = ["arm", "seed", "first grad-norm surge", "first LR-decay trigger", "collapse"]
    return markdown_table(head, rows, aligned=False)


def definitions(exp: Experiment) -> str:
    from otbrl.app.studies.inference import rule

    kinds = sorted({c.get("kind", "better") for c in exp.comparisons})
    margins = {c.get("kind"): c.get("margin", 0.0) for c in exp.comparisons}
    rules = "; ".join(f"`{k}`: {rule(k, margins.get(k, 0.0) or 0.0, exp.confidence)}" for k in kinds)
    return (
        "Held-out reward: one sampled completion (temperature of the run) for each held-out prompt, the "
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
        "inside the run."
        + (
            " Comparisons are paired by seed (same warm start, same prompts per step, same held-out set); "
            f"verdict rules: {rules}. A comparison's verdict combines its endpoints: held or did not hold "
            "when all tested endpoints agree, inconclusive otherwise."
            if exp.comparisons
            else " Verdicts on collapse are stated with the claims that read this page (`otbrl claims`)."
        )
    )


def report(exp: Experiment, result: dict[str, Any], results: Path, command: str, seconds: float,
           failures: list[str]) -> Path:  # fmt: skip
    """Write `<results>/<name>.md` (+ .png and a .json of the per-arm numbers and comparisons)."""
    from otbrl.app.recipe import load_recipe

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
        f"{k} {base[k]}" for k in ("task", "model", "learning_rate", "lr_scheduler_type", "warmup_steps",
                                   "max_generated_tokens", "max_completion_length", "temperature",
                                   "eval_size") if k in base
    )  # fmt: skip
    arms = "\n".join(f"- `{a}`: {json.dumps(o)}, seeds {exp.arm_seeds(a)}" for a, o in exp.arms.items())
    prompts = result["prompt_problems"]
    check = (
        "Same prompts per step: checked from the runs' prompt digests, no difference between the arms "
        "of any seed." if not prompts else "Same prompts per step: **violated**: " + "; ".join(prompts)
    )
    failed = "\n".join(f"- {f}" for f in failures) or "none"
    parts = [
        f"# Experiment `{exp.name}`\n\n{exp.description}",
        f"Regenerate: `{command}` (runs resume: finished ones are kept). Training time summed over the runs: "
        f"{run_minutes:.0f} min; wall time of the invocation that wrote this page: {seconds / 60:.1f} min.",
        f"Setting: {setting}; prompts per step {exp.prompts_per_step}; seeds {exp.seeds}"
        + (f"; learning rates picked on pilot seed {exp.pilot['seed']} "
           f"([{exp.name}-pilot.md]({exp.name}-pilot.md))" if exp.pilot else "") + ".",
        f"Arms:\n{arms}",
        table(exp, result),
    ]  # fmt: skip
    if exp.ladder:
        fig_path = results / f"{exp.name}-collapse.png"
        title = f"{exp.name}: collapse against learning rate"
        plot_figure(lambda ax: plot_ladder(result["arms"], ax), fig_path, title)
        parts.append(
            "Learning-rate ladder (collapsed seeds per rung; critical lr: the lowest rung where at least "
            f"half the seeds collapsed):\n\n{ladder_table(result['arms'])}\n\n![collapse]({fig_path.name})"
        )
    if result["comparisons"]:
        parts.append(f"Paired comparisons ({exp.confidence:.0%} t intervals over seeds):\n\n"
                     + comparisons_table(result))  # fmt: skip
    parts += [f"Events by run (steps):\n\n{events(result)}", check, definitions(exp),
              f"Failed runs: {failed}", f"![{exp.name}]({png.name})"]
    md.write_text("\n\n".join(parts) + "\n")
    (results / f"{exp.name}.json").write_text(json.dumps(to_json(result), indent=1))
    return md


def to_json(result: dict[str, Any]) -> dict[str, Any]:
    """The per-arm numbers and comparisons (intervals as mappings), for `otbrl claims`."""
    comparisons = []
    for c in result["comparisons"]:
        heldout = [{**h, "interval": _interval(h["interval"])} for h in c["heldout"]]
        tokens = [{**t, "interval": _interval(t["interval"])} for t in c["tokens"]]
        comparisons.append({**c, "heldout": heldout, "tokens": tokens})
    return {"arms": result["arms"], "comparisons": comparisons, "prompt_problems": result["prompt_problems"]}


def compare(spec: str, *, quick: bool = False, jobs: int = 2, runs_dir: Path | None = None,
            results: Path | None = None, log: Any = print) -> tuple[Path, list[str]]:  # fmt: skip
    """Plan, run (resuming), analyse and report one experiment. Returns (results page, failures).
    Quick runs go to runs/compare-quick/ and leave docs/results alone unless `results` says otherwise."""
    exp = load_experiment(spec, quick)
    root = Path("runs/compare-quick" if quick else "runs/compare")
    runs_dir = runs_dir or root / exp.name
    results = results or (root / "results" if quick else RESULTS)
    runs = plan(exp, runs_dir)
    log(f"{exp.name}: {len(runs)} runs ({len(exp.arms)} arms, seeds {exp.seeds}) in {runs_dir}")
    start = time.perf_counter()
    failures = execute(exp.name, exp.recipe, runs, jobs=jobs, log=log)
    result = analyse(exp, runs)
    if not result["arms"]:
        raise RuntimeError(f"{exp.name}: every run failed:\n" + "\n".join(failures))
    command = f"otbrl compare {spec}" + (" --quick" if quick else "") + f" --jobs {jobs}"
    page = report(exp, result, results, command, time.perf_counter() - start, failures)
    log(table(exp, result))
    return page, failures


def pilot_score(run_dir: Path) -> float:
    """The pilot's rule: mean train reward over the last quarter of the run's steps."""
    rewards = [r["reward"] for r in read_metrics(run_dir / "metrics.jsonl", "reward")]
    k = max(1, len(rewards) // 4)
    return sum(rewards[-k:]) / k


def pilot(spec: str, *, jobs: int = 2, runs_dir: Path | None = None, results: Path | None = None,
          log: Any = print) -> tuple[Path, dict[str, float]]:  # fmt: skip
    """Run the experiment's pilot (every arm at each pilot learning rate, on the pilot seed), pick each
    arm's learning rate by `pilot_score`, write `<results>/<name>-pilot.md`. The pick goes into the
    experiment's YAML by hand, before its reported runs: the pilot seed is never one of them."""
    exp = load_experiment(spec)
    runs_dir = runs_dir or Path("runs/compare") / exp.name / "pilot"
    runs = pilot_plan(exp, runs_dir)
    log(f"{exp.name} pilot: {len(runs)} runs (seed {exp.pilot['seed']}) in {runs_dir}")
    failures = execute(f"{exp.name} pilot", exp.recipe, runs, jobs=jobs, log=log)
    if failures:
        raise RuntimeError(f"{exp.name} pilot: failed runs:\n" + "\n".join(failures))
    return pilot_page(exp, runs, results or RESULTS, f"otbrl compare {spec} --pilot --jobs {jobs}", log)


def pilot_page(exp: Experiment, runs: list[Any], results: Path, command: str, log: Any = print
               ) -> tuple[Path, dict[str, float]]:  # fmt: skip
    """The pilot's picks from its finished runs, and its page `<results>/<name>-pilot.md`."""
    rows, picks = [], {}
    lrs = sorted({r.overrides["learning_rate"] for r in runs})
    for arm in exp.arms:
        mine = [r for r in runs if r.arm.startswith(arm + "@")]
        scores = {r.overrides["learning_rate"]: pilot_score(r.dir) for r in mine}
        picks[arm] = max(scores, key=scores.__getitem__)
        cells = [f"{scores[lr]:.3f}" if lr in scores else "not run" for lr in lrs]
        rows.append([arm, *cells, f"{picks[arm]:g}"])
    lrs = [f"{lr:g}" for lr in lrs]
    results.mkdir(parents=True, exist_ok=True)
    page = results / f"{exp.name}-pilot.md"
    page.write_text(
        f"# Pilot of experiment `{exp.name}`\n\nRegenerate: `{command}`.\n\n"
        f"Seed {exp.pilot['seed']} (not a reported seed). Rule: each arm takes the learning rate with the "
        "highest mean train reward over the last quarter of its steps; the picks are written into the "
        "experiment's YAML before its reported runs. These numbers are not evidence for any claim.\n\n"
        + markdown_table(["arm", *(f"lr {lr}" for lr in lrs), "pick"], rows, aligned=False) + "\n"
    )
    log(markdown_table(["arm", *(f"lr {lr}" for lr in lrs), "pick"], rows, aligned=False))
    return page, picks
