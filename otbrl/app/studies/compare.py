"""`otbrl compare`: an experiment's training runs (arms x seeds, see `experiment`), each one `otbrl train`
run in its own process, analysed (`outcomes`) into one results page with a table, the runs' events and a
plot of what the arms bought."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from otbrl.app.studies.experiment import Experiment, experiment_names, load_experiment, pilot_plan, plan
from otbrl.app.studies.outcomes import analyse
from otbrl.app.studies.plots import plot_arms
from otbrl.app.studies.report import markdown_table, mean_sd
from otbrl.app.studies.runs import execute, read_metrics

__all__ = ["compare", "events", "experiment_names", "pilot", "report", "table"]  # experiment_names: for otbrl.app.cli

RESULTS = Path("docs/results")


def _smoothing(exp: Experiment) -> str:
    return f"{exp.smooth_samples} samples" if exp.smooth_samples else f"{exp.smooth} steps"


def table(exp: Experiment, result: dict[str, Any]) -> str:
    """One row per arm: rewards, tokens, tokens to the target and saved against the reference, events."""
    target = result["target"]
    head = [
        "arm", "seeds", "final train reward", "held-out reward", "generated tokens",
        f"tokens to {target:.3f}" if target is not None else "tokens to target", "steps to it", "reached",
        f"tokens saved vs {exp.reference}" if exp.reference else "tokens saved", "grad-norm surges",
        "collapsed (step)",
    ]  # fmt: skip
    rows = []
    for arm, s in result["arms"].items():
        collapsed = [c for c in s["collapses"] if c is not None]
        saving = s["token_saving"]
        rows.append([
            arm, s["seeds"], mean_sd(s["final"]), mean_sd(s["held_out"]),
            mean_sd(s["total_tokens"]), mean_sd(s["tokens_to_target"]),
            mean_sd(s["steps_to_target"]).replace(".000", ""), f"{s['reached']}/{s['seeds']}",
            "—" if saving is None else f"{100 * saving:.0f}%", s["surges"],
            f"{len(collapsed)}/{s['seeds']}" + (f" ({', '.join(map(str, collapsed))})" * bool(collapsed)),
        ])  # fmt: skip
    return markdown_table(head, rows, aligned=False)


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


def report(exp: Experiment, result: dict[str, Any], results: Path, command: str, seconds: float,
           failures: list[str]) -> Path:  # fmt: skip
    """Write `<results>/<name>.md` (+ .png and a .json of the per-arm numbers)."""
    from otbrl.app.recipe import load_recipe

    results.mkdir(parents=True, exist_ok=True)
    run_minutes = sum(r["train_seconds"] for runs in result["runs"].values() for r in runs) / 60
    md, png = results / f"{exp.name}.md", results / f"{exp.name}.png"
    plot_arms(result, png, f"{exp.name}: {exp.description}".strip(": "), _smoothing(exp))
    base = load_recipe(exp.recipe, {**exp.common, **exp.forced})
    setting = ", ".join(
        f"{k} {base[k]}" for k in ("task", "model", "learning_rate", "max_steps", "max_completion_length",
                                   "temperature") if k in base
    )  # fmt: skip
    arms = "\n".join(f"- `{a}`: {json.dumps(o)}" for a, o in exp.arms.items())
    notes = [
        f"Target: {exp.target_fraction:.0%} of `{exp.reference}`'s final train reward (mean over seeds) = "
        f"{result['target']:.3f}."
        if result["target"] is not None
        else (result.get("note") or "No reference arm: no target."),
        "Final train reward: mean of the last 10% of steps. Held-out reward: one sample per held-out prompt "
        "after training. Tokens to target: generated tokens when the centred moving average of the train "
        f"reward (over {_smoothing(exp)}) first reaches the target, mean ± sd over the seeds that reached "
        f"it. Collapsed: the smoothed reward fell below {exp.collapse_fraction:.0%} of its best and stayed "
        "there.",
    ]
    failed = "\n".join(f"- {f}" for f in failures) or "none"
    md.write_text(
        f"# Experiment `{exp.name}`\n\n{exp.description}\n\nRegenerate: `{command}` "
        f"(runs resume: finished ones are kept). Training time summed over the runs: {run_minutes:.0f} min "
        f"(with `--jobs 2` about half that in wall time, plus ~15 s of start-up per run); wall time of the "
        f"invocation that wrote this page: {seconds / 60:.1f} min.\n\n"
        f"Setting: {setting}; prompts per step {exp.prompts_per_step}; seeds {exp.seeds}.\n\n"
        f"Arms:\n{arms}\n\n"
        f"{table(exp, result)}\n\n"
        f"Events by run (steps):\n\n{events(result)}\n\n"
        + "\n\n".join(notes)
        + f"\n\nFailed runs: {failed}\n\n![{exp.name}]({png.name})\n"
    )
    (results / f"{exp.name}.json").write_text(
        json.dumps({"target": result["target"], "note": result.get("note"), "arms": result["arms"]}, indent=1)
    )
    return md


def compare(spec: str, *, quick: bool = False, jobs: int = 2, runs_dir: Path | None = None,
            results: Path | None = None, log: Any = print) -> tuple[Path, list[str]]:  # fmt: skip
    """Plan, run (resuming), analyse and report one experiment. Returns (results page, failures).
    Quick runs go to runs/compare-quick/ and leave docs/results alone unless `results` says otherwise."""
    exp = load_experiment(spec, quick)
    root = Path("runs/compare-quick" if quick else "runs/compare")
    runs_dir = runs_dir or root / exp.name
    results = results or (root / "results" if quick else RESULTS)
    runs = plan(exp, runs_dir)
    log(f"{exp.name}: {len(exp.arms)} arms x {len(exp.seeds)} seeds = {len(runs)} runs in {runs_dir}")
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
    rows, picks = [], {}
    for arm in exp.arms:
        scores = {r.overrides["learning_rate"]: pilot_score(r.dir) for r in runs if r.arm.startswith(arm + "@")}
        picks[arm] = max(scores, key=scores.__getitem__)
        rows.append([arm, *(f"{scores[lr]:.3f}" for lr in scores), f"{picks[arm]:g}"])
    lrs = [f"{float(lr):g}" for lr in exp.pilot["learning_rates"]]
    results = results or RESULTS
    results.mkdir(parents=True, exist_ok=True)
    page = results / f"{exp.name}-pilot.md"
    page.write_text(
        f"# Pilot of experiment `{exp.name}`\n\nRegenerate: `otbrl compare {spec} --pilot --jobs {jobs}`.\n\n"
        f"Seed {exp.pilot['seed']} (not a reported seed). Rule: each arm takes the learning rate with the "
        "highest mean train reward over the last quarter of its steps; the picks are written into the "
        "experiment's YAML before its reported runs. These numbers are not evidence for any claim.\n\n"
        + markdown_table(["arm", *(f"lr {lr}" for lr in lrs), "pick"], rows, aligned=False) + "\n"
    )
    log(markdown_table(["arm", *(f"lr {lr}" for lr in lrs), "pick"], rows, aligned=False))
    return page, picks
