"""Training runs compared: arms (estimator, group size, learning rate, ...) x seeds, each one
`otbrl train` run in its own process, then one table and one plot of what the arms bought.

An experiment is a YAML file (packaged ones live in `otbrl/experiments/`):

    recipe: running_sum48          # base recipe for every run
    common: {max_steps: 100}       # overrides for every arm
    prompts_per_step: 8            # same prompt budget per step: batch = prompts_per_step x num_generations
    seeds: [0, 1, 2]
    reference: grpo-N32            # arm whose final reward sets the target
    arms:
      grpo-N4: {advantage_estimator: grpo, num_generations: 4}
      ...
    quick: {common: {max_steps: 3}, seeds: [0], arms: [grpo-N4, otb-N4]}   # what --quick changes

Per run, from its metrics.jsonl: the train reward smoothed by a centred moving average (so it has no lag,
which would otherwise cost large-batch arms more tokens), the final reward (mean of the last 10% of
steps), tokens-to-target (generated tokens when the smoothed reward first reaches `target_fraction` x
the reference arm's final reward, averaged over seeds), gradient-norm surges, learning-rate decay
triggers, and collapse: the smoothed reward falls below `collapse_fraction` x its best so far and never
comes back.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
RESULTS = Path("docs/results")


@dataclass
class Experiment:
    name: str
    recipe: str
    arms: dict[str, dict[str, Any]]
    seeds: list[int]
    reference: str | None = None
    common: dict[str, Any] = field(default_factory=dict)
    prompts_per_step: int | None = None
    target_fraction: float = 0.9
    collapse_fraction: float = 0.5
    smooth: int = 9  # steps in the centred moving average of the train reward ...
    smooth_samples: int | None = None  # ... or as many steps as hold this many samples (per arm)
    description: str = ""


@dataclass
class Run:
    arm: str
    seed: int
    dir: Path
    overrides: dict[str, Any]


def experiment_names() -> list[str]:
    return sorted(p.stem for p in EXPERIMENTS.glob("*.yaml"))


def load_experiment(spec: str, quick: bool = False) -> Experiment:
    """An experiment file (or a packaged experiment by name); `quick` applies its `quick` section."""
    path = Path(spec)
    if not path.is_file():
        path = EXPERIMENTS / f"{spec}.yaml"
        if not path.is_file():
            raise ValueError(
                f"experiment: no file {spec!r} and no packaged experiment of that name "
                f"({', '.join(experiment_names())})"
            )
    raw = yaml.safe_load(path.read_text()) or {}
    quick_section = raw.pop("quick", {}) or {}
    known = {f for f in Experiment.__dataclass_fields__ if f != "name"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"experiment {path}: unknown key {unknown[0]!r} (keys: {', '.join(sorted(known))})")
    for key in ("recipe", "arms", "seeds"):
        if key not in raw:
            raise ValueError(f"experiment {path}: missing key {key!r}")
    exp = Experiment(name=path.stem, **raw)
    if quick:
        exp.common = {**exp.common, **quick_section.get("common", {})}
        exp.seeds = list(quick_section.get("seeds", exp.seeds[:1]))
        keep = quick_section.get("arms")
        if keep:
            missing = [a for a in keep if a not in exp.arms]
            if missing:
                raise ValueError(f"experiment {path}: quick arm {missing[0]!r} is not an arm")
            exp.arms = {a: exp.arms[a] for a in keep}
        if exp.reference not in exp.arms:
            exp.reference = None
        exp.smooth, exp.smooth_samples = quick_section.get("smooth", 1), None
    if exp.reference is not None and exp.reference not in exp.arms:
        raise ValueError(f"experiment {path}: reference {exp.reference!r} is not an arm")
    return exp


def plan(exp: Experiment, out: Path) -> list[Run]:
    """One Run per (arm, seed), with the overrides that make it (recipe keys, as `otbrl train` takes)."""
    from otbrl.app.train import load_recipe

    runs = []
    for arm, arm_overrides in exp.arms.items():
        for seed in exp.seeds:
            overrides = {**exp.common, **(arm_overrides or {})}
            if exp.prompts_per_step and "per_device_train_batch_size" not in overrides:
                n = overrides.get("num_generations") or load_recipe(exp.recipe)["num_generations"]
                overrides["per_device_train_batch_size"] = exp.prompts_per_step * int(n)
            run_dir = out / arm / f"seed{seed}"
            overrides.update(seed=seed, output_dir=str(run_dir), plot=False)
            overrides.setdefault("threads", 1)  # parallel runs: one thread each gets more done
            load_recipe(exp.recipe, overrides)  # a bad key fails now, not after an hour of runs
            runs.append(Run(arm, seed, run_dir, overrides))
    return runs


def _is_done(run: Run) -> bool:
    """A run counts as done when it wrote its summary with the same recipe it would be run with now."""
    recipe = run.dir / "run.json"
    return (
        (run.dir / "summary.json").is_file()
        and recipe.is_file()
        and (json.loads(recipe.read_text()) == run.overrides)
    )


def execute(exp: Experiment, runs: list[Run], jobs: int = 2, log: Any = print) -> list[str]:
    """Run what is not done yet, `jobs` at a time, each in its own process with its log in the run's
    directory. Returns one line per failed run (nothing is dropped silently)."""
    todo = [r for r in runs if not _is_done(r)]
    if len(todo) < len(runs):
        log(f"{len(runs) - len(todo)} of {len(runs)} runs already done (delete a run's directory to redo it)")
    failures: list[str] = []
    try:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc=f"{exp.name} runs", unit="run")
    except ImportError:
        bar = None

    def one(run: Run) -> None:
        run.dir.mkdir(parents=True, exist_ok=True)
        args = [sys.executable, "-m", "otbrl.app.cli", "train", "--config", exp.recipe]
        for key, value in run.overrides.items():
            args += [f"--{key}", json.dumps(value) if isinstance(value, dict | list | bool) else str(value)]
        env = {**os.environ, "OMP_NUM_THREADS": str(run.overrides["threads"])}
        start = time.perf_counter()
        with (run.dir / "train.log").open("w") as out:
            code = subprocess.call(args, stdout=out, stderr=subprocess.STDOUT, env=env)
        if code == 0:
            (run.dir / "run.json").write_text(json.dumps(run.overrides))
        else:
            tail = (run.dir / "train.log").read_text().strip().splitlines()[-1:] or ["(no output)"]
            failures.append(f"{run.arm} seed {run.seed}: exit {code}: {tail[0]} (log: {run.dir}/train.log)")
        if bar is not None:
            bar.set_postfix_str(f"{run.arm} s{run.seed} {time.perf_counter() - start:.0f}s")
            bar.update()
        else:
            log(f"done {run.arm} seed {run.seed} ({time.perf_counter() - start:.0f}s, exit {code})")

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(one, todo))
    if bar is not None:
        bar.close()
    return failures


# ---------------------------------------------------------------------------------------------------------
# analysis
# ---------------------------------------------------------------------------------------------------------


def centred_average(values: list[float], window: int) -> list[float]:
    """Moving average over `window` steps centred on each step (shorter at the ends): no lag."""
    half = max(0, window // 2)
    out = []
    for i in range(len(values)):
        part = values[max(0, i - half) : i + half + 1]
        out.append(sum(part) / len(part))
    return out


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
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "reward" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [r["step"] for r in rows]
    reward = [r["reward"] for r in rows]
    smooth = centred_average(reward, window(exp, batch))
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


def mean_sd(values: list[float]) -> str:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "—"
    mean = statistics.fmean(values)
    big = abs(mean) >= 1000
    fmt = (lambda v: f"{v / 1000:.1f}k") if big else (lambda v: f"{v:.3f}")
    return fmt(mean) + (f" ± {fmt(statistics.stdev(values))}" if len(values) > 1 else "")


def analyse(exp: Experiment, runs: list[Run]) -> dict[str, Any]:
    """Per-arm statistics over seeds. Returns {"target", "arms": {arm: {...}}, "runs": {arm: [run...]}}."""
    per_arm: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        if (run.dir / "summary.json").is_file():
            batch = int(run.overrides.get("per_device_train_batch_size", 1))
            per_arm.setdefault(run.arm, []).append(analyse_run(run.dir, exp, run.seed, batch))
    target, note = None, None
    if exp.reference and per_arm.get(exp.reference):
        ref = per_arm[exp.reference]
        target = exp.target_fraction * statistics.fmean(r["final"] for r in ref)
        start = statistics.fmean(r["start"] for r in ref)
        if target <= start:  # the reference did not improve: "reaching" the target would mean nothing
            note = (f"{exp.reference} did not improve (first 10% of steps {start:.3f}, last "
                    f"{target / exp.target_fraction:.3f}): no tokens-to-target.")  # fmt: skip
            target = None
    arms: dict[str, dict[str, Any]] = {}
    for arm, results in per_arm.items():
        ttt = [tokens_to(r, target) for r in results] if target is not None else []
        reached = [t for t in ttt if t is not None]
        steps_to = [r["steps"][r["tokens"].index(t)] for r, t in zip(results, ttt, strict=False) if t]
        arms[arm] = {
            "seeds": len(results),
            "final": [r["final"] for r in results],
            "held_out": [r["held_out"] for r in results],
            "total_tokens": [r["total_tokens"] for r in results],
            "tokens_to_target": ttt,
            "steps_to_target": steps_to,
            "reached": len(reached),
            "surges": sum(len(r["surges"]) for r in results),
            "collapses": [r["collapse"] for r in results],
            "decays": [r["decays"] for r in results],
            "first_surge": [r["surges"][0] if r["surges"] else None for r in results],
        }
    ref = arms.get(exp.reference or "")
    for stats in arms.values():
        mine = [t for t in stats["tokens_to_target"] if t is not None]
        theirs = [t for t in (ref or {}).get("tokens_to_target", []) if t is not None]
        stats["token_saving"] = (
            1 - statistics.fmean(mine) / statistics.fmean(theirs) if mine and theirs and
            stats["reached"] == stats["seeds"] else None
        )  # fmt: skip
    return {"target": target, "note": note, "arms": arms, "runs": per_arm}


def table(exp: Experiment, result: dict[str, Any]) -> str:
    target = result["target"]
    head = [
        "arm", "seeds", "final train reward", "held-out reward", "generated tokens",
        f"tokens to {target:.3f}" if target is not None else "tokens to target", "steps to it", "reached",
        f"tokens saved vs {exp.reference}" if exp.reference else "tokens saved", "grad-norm surges",
        "collapsed (step)",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, s in result["arms"].items():
        collapsed = [c for c in s["collapses"] if c is not None]
        saving = s["token_saving"]
        lines.append(
            "| " + " | ".join([
                arm, str(s["seeds"]), mean_sd(s["final"]), mean_sd(s["held_out"]),
                mean_sd(s["total_tokens"]), mean_sd(s["tokens_to_target"]),
                mean_sd(s["steps_to_target"]).replace(".000", ""), f"{s['reached']}/{s['seeds']}",
                "—" if saving is None else f"{100 * saving:.0f}%", str(s["surges"]),
                f"{len(collapsed)}/{s['seeds']}" + (f" ({', '.join(map(str, collapsed))})" * bool(collapsed)),
            ]) + " |"
        )  # fmt: skip
    return "\n".join(lines)


def events(result: dict[str, Any]) -> str:
    """Per run with any event: first gradient-norm surge, first LR-decay trigger, collapse (steps)."""
    lines = [
        "| arm | seed | first grad-norm surge | first LR-decay trigger | collapse |",
        "|---|---|---|---|---|",
    ]
    for arm, runs in result["runs"].items():
        for r in runs:
            if r["surges"] or r["decays"] or r["collapse"] is not None:
                cells = [r["surges"][0] if r["surges"] else "—", r["decays"][0] if r["decays"] else "—",
                         "—" if r["collapse"] is None else r["collapse"]]  # fmt: skip
                lines.append(f"| {arm} | {r['seed']} | " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) if len(lines) > 2 else "No surges, LR-decay triggers or collapses."


def plot(exp: Experiment, result: dict[str, Any], png: Path) -> None:
    """Smoothed reward against generated tokens, gradient norm and mean length against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (arm, runs) in enumerate(result["runs"].items()):
        c = colours[i % len(colours)]
        for j, r in enumerate(runs):
            label = arm if j == 0 else None
            axes[0].plot(r["tokens"], r["smooth"], color=c, lw=1.3, alpha=0.8, label=label)
            axes[1].plot(r["steps"], r["grad_norm"], color=c, lw=0.8, alpha=0.7, label=label)
            axes[2].plot(r["steps"], r["length"], color=c, lw=0.8, alpha=0.7, label=label)
            for s in r["surges"]:
                axes[1].plot([s], [r["grad_norm"][r["steps"].index(s)]], "v", color=c, ms=5)
            for s in r["decays"]:
                axes[2].axvline(s, color=c, ls=":", alpha=0.6)
    if result["target"] is not None:
        axes[0].axhline(result["target"], color="grey", ls="--", lw=1, label="target")
    span = f"{exp.smooth_samples} samples" if exp.smooth_samples else f"{exp.smooth} steps"
    axes[0].set(xlabel="generated tokens", ylabel=f"train reward (centred mean over {span})")
    axes[0].set_xscale("log")
    axes[1].set(xlabel="step", ylabel="gradient norm (▼ surge)", yscale="log")
    axes[2].set(xlabel="step", ylabel="mean completion length (: lr decay)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{exp.name}: {exp.description}".strip(": "), fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def report(exp: Experiment, result: dict[str, Any], results: Path, command: str, seconds: float,
           failures: list[str]) -> Path:  # fmt: skip
    """Write `<results>/<name>.md` (+ .png and a .json of the per-arm numbers)."""
    from otbrl.app.train import load_recipe

    results.mkdir(parents=True, exist_ok=True)
    run_minutes = sum(r["train_seconds"] for runs in result["runs"].values() for r in runs) / 60
    md, png = results / f"{exp.name}.md", results / f"{exp.name}.png"
    plot(exp, result, png)
    base = load_recipe(exp.recipe, exp.common)
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
        f"reward (over {f'{exp.smooth_samples} samples' if exp.smooth_samples else f'{exp.smooth} steps'}) "
        "first reaches the target, mean ± sd over the seeds that reached it. "
        f"Collapsed: the smoothed reward fell below {exp.collapse_fraction:.0%} of its best and stayed "
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
    failures = execute(exp, runs, jobs=jobs, log=log)
    result = analyse(exp, runs)
    if not result["arms"]:
        raise RuntimeError(f"{exp.name}: every run failed:\n" + "\n".join(failures))
    command = f"otbrl compare {spec}" + (" --quick" if quick else "") + f" --jobs {jobs}"
    page = report(exp, result, results, command, time.perf_counter() - start, failures)
    log(table(exp, result))
    return page, failures
