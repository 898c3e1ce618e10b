"""Where an experiment's phenomenon stands, from its committed records alone: each run's value of the
protocol's `phenomenon` keys (e.g. the within-group length CV averaged over the run's steps) at every
arm's learning rate, per stage (the pilot's first stage and variance seeds at that rate, the reported
runs so far), and per comparison the level its reported runs head for. It shows no held-out or train
reward, so it can be looked at while the reported runs are still going.

    python -m studies phenomenon smollm2c     # -> docs/results/smollm2c-phenomenon.md and .png
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from studies.experiment import PILOT_KEYS, Experiment, load_experiment, pilot_plan, plan, variance_plan
from studies.inference import scipy_stats, t_interval
from studies.outcomes import analyse_rows, beside
from studies.pages import markdown_table
from studies.pilot import run_data
from studies.runs import Run, has_record

RUNS = Path("runs/compare")
REPORTED = "reported runs"


def stages(exp: Experiment) -> dict[str, list[Run]]:
    """The runs at each arm's learning rate (the YAML's, where the pilot's picks were written), by stage:
    the pilot's first stage, its variance seeds, and the reported runs (named by arm, as records are)."""
    rates = {arm: {**exp.common, **(exp.arms[arm] or {})}.get("learning_rate") for arm in exp.arms}
    out: dict[str, list[Run]] = {}
    if exp.pilot:
        first = pilot_plan(exp, RUNS / exp.name / "pilot")
        out["pilot, first stage"] = [
            r for r in first if rates.get(r.arm.rpartition("@")[0]) == r.overrides.get("learning_rate")
        ]
        if exp.pilot.get("variance_seeds") and all(rates[a] is not None for a in exp.arms):
            out["pilot, variance seeds"] = variance_plan(exp, RUNS / exp.name / "pilot", rates)
    out[REPORTED] = plan(exp, RUNS / exp.name)
    return out


def run_values(exp: Experiment, results: Path) -> list[dict[str, Any]]:
    """One row per finished run: stage, arm, seed and its value of each phenomenon key, read from the
    committed records (`results/runs/NAME[-pilot]/`) by the rule that reads the reported runs."""
    rows = []
    for stage, runs in stages(exp).items():
        records = results / "runs" / (exp.name if stage == REPORTED else f"{exp.name}-pilot")
        for run in runs:
            if not has_record(run, records):  # records alone: a run folder in this checkout does not count
                continue
            data = run_data(run, records)
            result = analyse_rows(*data, exp)
            arm = run.arm.rpartition("@")[0] or run.arm
            rows.append(
                {
                    "stage": stage,
                    "arm": arm,
                    "seed": run.seed,
                    **{k: result[k] for k in exp.phenomenon},
                    **{f"{k} steps": step_values(data[0], k) for k in exp.phenomenon},
                }
            )
    return rows


def step_values(metrics: list[dict[str, Any]], key: str) -> list[float]:
    """The per-step values behind a run-level key (`length_cv_run`: each step's `otb/horizon/length_cv`),
    over the steps `analyse_rows` reads; [] for a key that is not a mean over steps."""
    if not key.endswith("_run"):
        return []
    name = f"otb/horizon/{key.removesuffix('_run')}"
    return [r[name] for r in metrics if "reward" in r and r.get(name) is not None and math.isfinite(r[name])]


def pooled_over_steps(rows: list[dict[str, Any]], key: str) -> float:
    """The mean over every step of the runs in `rows`, each step weighing alike (so a run with more steps
    weighs more): the other reading of "averaged over every step of every compared run", beside the rule's
    mean of run means. NaN without steps."""
    values = [v for r in rows for v in r.get(f"{key} steps", [])]
    return statistics.fmean(values) if values else math.nan


def _cell(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) < 2:
        return f"{values[0]:.3f} (n=1)"
    iv = t_interval(values)
    return f"{iv.mean:.3f} [{iv.lo:.3f}, {iv.hi:.3f}] (SD {statistics.stdev(values):.3f}, n={iv.n})"


def _corr(a: dict[int, float], b: dict[int, float]) -> tuple[float, int]:
    """Pearson correlation of two arms' values over the seeds both ran, clipped at 0 (a negative one
    would narrow the spread; too few shared seeds to trust it say nothing), and how many they share."""
    shared = sorted(set(a) & set(b))
    if len(shared) < 3:
        return 0.0, len(shared)
    xs, ys = [a[k] for k in shared], [b[k] for k in shared]
    if statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
        return 0.0, len(shared)
    return max(0.0, statistics.correlation(xs, ys)), len(shared)


def heading_for(
    values: dict[str, dict[int, float]],
    reported: dict[str, dict[int, float]],
    planned: dict[str, list[int]],
    floor: float,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """Where a comparison's reported runs head for, as the rule reads them at the end: the mean over every
    planned run of both arms (`outcomes.phenomenon_missing`). Each arm's runs are estimated by the mean of
    all its runs at its rate (`values`: {arm: {seed: value}}, pilot seeds included), weighted by its planned
    runs (`planned`: {arm: seeds}); the spread counts the seeds arms share (their runs' correlation over
    shared seeds, clipped at 0) and a t interval on the fewest runs an arm has. `chance`: the finished
    plan reads at least `floor`, normal: the reported runs done so far (`reported`) are fixed, the runs to
    come vary as the arm's runs do around a mean known to its standard error (flat prior). `now`: the rule
    on the reported runs done so far."""
    arms = list(planned)
    done = [v for a in arms for v in reported.get(a, {}).values()]
    now = statistics.fmean(done) if done else math.nan
    if any(len(values.get(a, {})) < 2 for a in arms) or not arms:
        return {
            "mean": math.nan,
            "lo": math.nan,
            "hi": math.nan,
            "reads": "too few runs",
            "chance": math.nan,
            "now": now,
        }
    n = {a: len(values[a]) for a in arms}
    m = {a: statistics.fmean(values[a].values()) for a in arms}
    sd = {a: statistics.stdev(values[a].values()) for a in arms}

    def cov_means(a: str, b: str) -> float:  # covariance of two arms' mean estimates
        if a == b:
            return sd[a] ** 2 / n[a]
        r, shared = _corr(values[a], values[b])
        return r * sd[a] * sd[b] * shared / (n[a] * n[b])

    total = sum(len(planned[a]) for a in arms)
    w = {a: len(planned[a]) / total for a in arms}
    mean = sum(w[a] * m[a] for a in arms)
    se = math.sqrt(sum(w[a] * w[b] * cov_means(a, b) for a in arms for b in arms))
    stats = scipy_stats()
    half = stats.t.ppf(0.5 + confidence / 2, min(n.values()) - 1) * se
    lo, hi = mean - half, mean + half
    reads = (
        "below the floor" if hi < floor else "above the floor" if lo >= floor else "either side of the floor"
    )
    # the finished plan: the done reported runs as they are, the rest drawn around each arm's mean
    future = {a: [s for s in planned[a] if s not in reported.get(a, {})] for a in arms}
    expect = (sum(done) + sum(len(future[a]) * m[a] for a in arms)) / total
    var = sum(len(future[a]) * len(future[b]) * cov_means(a, b) for a in arms for b in arms)
    for a in arms:
        var += len(future[a]) * sd[a] ** 2
        for b in arms:
            if b != a:
                var += len(set(future[a]) & set(future[b])) * _corr(values[a], values[b])[0] * sd[a] * sd[b]
    spread = math.sqrt(var) / total
    chance = float(stats.norm.sf((floor - expect) / spread)) if spread > 0 else float(expect >= floor)
    return {"mean": mean, "lo": lo, "hi": hi, "reads": reads, "chance": chance, "now": now}


def _chance(p: float) -> str:
    if not math.isfinite(p):
        return "—"
    return "> 99%" if 0.99 < p < 1 else "< 1%" if 0 < p < 0.01 else f"{p:.0%}"


def _setting(exp: Experiment) -> str:
    """Whether the pilot's runs are the reported runs' setting on other seeds, in words."""
    if not exp.pilot:
        return "The experiment has no pilot: only its reported runs say where it heads."
    differ = sorted(k for k in exp.pilot if k not in PILOT_KEYS or k == "token_factor")
    unrated = [a for a in exp.arms if {**exp.common, **(exp.arms[a] or {})}.get("learning_rate") is None]
    text = (
        f"The pilot's runs differ from the reported runs in {', '.join(differ)} (the pilot's section), so "
        "they say only roughly where the reported runs head."
        if differ
        else "The pilot's runs ran the reported runs' setting on other seeds, so they say where the reported "
        "runs head."
    )
    if unrated:
        text += f" No learning rate in the YAML yet for {', '.join(unrated)}: its pilot runs are not read."
    return text


def phenomenon_page(exp: Experiment, results: Path) -> str:
    rows = run_values(exp, results)
    parts = [
        f"# Experiment `{exp.name}`: its phenomenon, run by run\n",
        f"Regenerate: `python -m studies phenomenon {exp.name}` (from the committed records alone; it trains "
        "nothing and shows no reward).\n",
        "The claims need "
        + ", ".join(f"{k} ≥ {float(v):g}" for k, v in exp.phenomenon.items())
        + " over each comparison's two arms' runs (each run's mean over its steps, averaged over the runs "
        "of both arms; `studies.outcomes.phenomenon_missing`), else they read **not tested**. Here is that "
        "quantity for every committed run at each arm's learning rate (the YAML's, the pilot's pick): the "
        "pilot's first stage, its variance seeds, and the reported runs so far. " + _setting(exp) + "\n",
    ]
    stage_names = list(dict.fromkeys(r["stage"] for r in rows))
    for key, floor in exp.phenomenon.items():
        table = []
        for arm in exp.arms:
            mine = [r for r in rows if r["arm"] == arm and math.isfinite(r[key])]
            by_stage = [_cell([r[key] for r in mine if r["stage"] == s]) for s in stage_names]
            table.append([arm, *by_stage, _cell([r[key] for r in mine])])
        parts.append(
            f"`{key}` of each arm: mean [95% t interval of the mean] (SD between runs, runs):\n\n"
            + markdown_table(["arm", *stage_names, "every run"], table, aligned=False)
            + "\n"
        )
        lines = []
        for c in exp.comparisons:
            arms = (c["candidate"], c["baseline"])
            values = {a: {(r["stage"], r["seed"]): r[key] for r in rows if r["arm"] == a} for a in arms}
            values = {a: {k[1]: v for k, v in by.items() if math.isfinite(v)} for a, by in values.items()}
            reported = {
                a: {
                    r["seed"]: r[key]
                    for r in rows
                    if r["arm"] == a and r["stage"] == REPORTED and math.isfinite(r[key])
                }
                for a in arms
            }
            planned = {a: exp.arm_seeds(a) for a in arms}
            done = [
                r
                for r in rows
                if r["arm"] in arms and r["stage"] == REPORTED and r["seed"] in reported[r["arm"]]
            ]
            pooled = pooled_over_steps(done, key)
            h = heading_for(values, reported, planned, float(floor), exp.confidence)
            lines.append(
                [
                    c["name"],
                    " + ".join(f"{a} ({len(values[a])} runs, {len(planned[a])} planned)" for a in arms),
                    f"{beside(h['now'], floor)} ({sum(map(len, reported.values()))} runs)"
                    if math.isfinite(h["now"])
                    else "no run yet",
                    beside(pooled, floor) if math.isfinite(pooled) else "—",
                    f"{h['mean']:.3f} [{h['lo']:.3f}, {h['hi']:.3f}]" if math.isfinite(h["mean"]) else "—",
                    f"{float(floor):g}",
                    f"**{h['reads']}**",
                    _chance(h["chance"]),
                ]
            )
        parts.append(
            "Each comparison: what its rule reads on the reported runs so far; the same runs' steps pooled "
            '(every step weighs alike, so a run of more steps weighs more: a reading of "averaged over every '
            'step of every run" that is not the rule, shown because the two differ); where it heads once '
            "every planned run is in (each arm's runs estimated by the mean of all its runs above, weighted "
            f"by its planned runs, with a {exp.confidence:.0%} t interval that counts the seeds the arms "
            "share); and the chance that the finished plan reads at least the floor (normal: the reported "
            "runs so far as they are, the runs to come varying as these did around a mean known to its "
            "standard error, flat prior):\n\n"
            + markdown_table(
                [
                    "comparison",
                    "runs",
                    f"{key}, reported runs so far",
                    "pooled over their steps (not the rule)",
                    "heading for",
                    "floor",
                    "reads",
                    "chance it ends ≥ floor",
                ],
                lines,
                aligned=False,
            )
            + "\n"
        )
    return "\n".join(parts)


def plot_phenomenon(exp: Experiment, rows: list[dict[str, Any]], png: Path) -> None:
    """Each run's value of the first phenomenon key, one column per arm, one marker per stage; the floor
    dashed."""
    from otbrl.app.plots import MARKERS, pyplot, save

    plt = pyplot()
    key, floor = next(iter(exp.phenomenon.items()))
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(exp.arms), 4))
    stage_names = list(dict.fromkeys(r["stage"] for r in rows))
    for i, arm in enumerate(exp.arms):
        for j, stage in enumerate(stage_names):
            ys = [r[key] for r in rows if r["arm"] == arm and r["stage"] == stage and math.isfinite(r[key])]
            xs = [i + (j - (len(stage_names) - 1) / 2) * 0.2] * len(ys)
            ax.scatter(
                xs, ys, marker=MARKERS[j % len(MARKERS)], color=f"C{j}", label=stage if i == 0 else None
            )
        every = [r[key] for r in rows if r["arm"] == arm and math.isfinite(r[key])]
        if len(every) >= 2:
            iv = t_interval(every)
            ax.errorbar(
                [i + 0.42],
                [iv.mean],
                yerr=[[iv.mean - iv.lo], [iv.hi - iv.mean]],
                color="k",
                fmt="o",
                capsize=4,
            )
    ax.axhline(float(floor), color="grey", ls="--", label=f"floor {float(floor):g}")
    ax.set_xticks(range(len(exp.arms)), list(exp.arms))
    ax.set_ylabel(f"{key} (each run: mean over its steps)")
    ax.set_title(
        f"{exp.name}: {key} of every run at the picks\n(black: mean of every run, 95% t interval)",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, png, dpi=100)


def phenomenon(name: str, results: Path = Path("docs/results")) -> Path:
    """Write `results/NAME-phenomenon.md` and its plot; returns the page's path."""
    exp = load_experiment(name)
    if not exp.phenomenon:
        raise ValueError(f"experiment {name}: no `phenomenon` floors to read")
    page = results / f"{exp.name}-phenomenon.md"
    png = page.with_suffix(".png")
    text = phenomenon_page(exp, results)
    rows = run_values(exp, results)
    if rows:
        plot_phenomenon(exp, rows, png)
        text += f"\n![{exp.phenomenon and next(iter(exp.phenomenon))} of every run]({png.name})\n"
    page.write_text(text)
    return page
