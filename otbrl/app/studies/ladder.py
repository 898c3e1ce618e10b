"""A learning-rate ladder (an experiment with `ladder:`; arms named `arm@lr`): per estimator, the share of
seeds that collapsed at each rung, the critical learning rate (the lowest rung where at least half the
seeds collapsed), and the paired collapse comparison between two estimators over every (rung, seed)."""

from __future__ import annotations

import math
import statistics
from typing import Any

from otbrl.app.studies.inference import NOT_TESTED, Interval, combine, paired, t_interval, verdict
from otbrl.app.studies.plots import MARKERS, STYLES, pyplot, save
from otbrl.app.studies.report import markdown_table


def split(arm: str) -> tuple[str, float]:
    """'otb-N4@0.0002' -> ('otb-N4', 0.0002)."""
    base, _, lr = arm.rpartition("@")
    if not base:
        raise ValueError(f"{arm!r} is not a ladder arm (arm@lr)")
    return base, float(lr)


def cells(arms: dict[str, Any]) -> dict[str, dict[float, list[bool]]]:
    """{base arm: {learning rate: {seed: collapsed?}}} from an experiment's per-arm statistics
    (`outcomes.analyse(...)["arms"]`, or the same read back from its JSON)."""
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


def collapse_difference(arms: dict[str, Any], candidate: str, baseline: str, confidence: float,
                        table: dict[str, dict[float, dict[int, bool]]] | None = None
                        ) -> Interval:  # fmt: skip
    """Paired over (rung, seed): baseline collapsed (1/0) minus candidate collapsed; > 0 favours the
    candidate."""
    table = cells(arms) if table is None else table
    a, b = table.get(candidate, {}), table.get(baseline, {})
    diffs = []
    for lr in sorted(set(a) & set(b)):
        diffs += paired({s: float(c) for s, c in b[lr].items()}, {s: float(c) for s, c in a[lr].items()})
    return t_interval(diffs, confidence)


def stability_verdict(arms: dict[str, Any], candidate: str, baselines: list[str], confidence: float,
                      table: dict[str, dict[float, dict[int, bool]]] | None = None
                      ) -> tuple[str, list[tuple[str, Interval]]]:  # fmt: skip
    """`better` on collapses against each baseline; not tested when no run collapsed at all. `table`:
    collapse indicators to use instead of `cells(arms)` (e.g. censored runs counted as collapses)."""
    table = cells(arms) if table is None else table
    arms_here = (candidate, *baselines)
    collapsed = sum(sum(seeds.values()) for b in arms_here for seeds in table.get(b, {}).values())
    intervals = [(b, collapse_difference(arms, candidate, b, confidence, table)) for b in baselines]
    if collapsed == 0:
        return NOT_TESTED, intervals
    return combine([verdict("better", ci) for _, ci in intervals]), intervals


def ladder_table(arms: dict[str, Any]) -> str:
    """One row per estimator: collapsed seeds at each rung (and censored ones: below the collapse level at
    the end, too late to count), the critical learning rate, surges, clipped share of steps."""
    table = cells(arms)
    rates = sorted({lr for rungs in table.values() for lr in rungs})
    rows = []
    for base, rungs in table.items():
        mine = [stats for arm, stats in arms.items() if split(arm)[0] == base]
        clip = [c for s in mine for c in s["clip_fraction"] if c is not None and not math.isnan(c)]
        crit = critical_lr(rungs)
        low = {split(arm)[1]: sum(stats.get("censored", [])) for arm, stats in arms.items()
               if split(arm)[0] == base}  # fmt: skip
        cell = {lr: f"{sum(seeds.values())}/{len(seeds)}" + (f" (+{low[lr]} censored)" if low.get(lr) else "")
                for lr, seeds in rungs.items()}  # fmt: skip
        rows.append([
            base,
            *(cell.get(lr, "—") for lr in rates),
            "none collapsed" if crit is None else f"{crit:g}",
            sum(s["surges"] for s in mine),
            f"{statistics.fmean(clip):.2f}" if clip else "—",
        ])  # fmt: skip
    head = ["arm", *(f"collapsed @ lr {lr:g}" for lr in rates), "critical lr", "surges", "clipped"]
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


def plot_ladder_runs(runs: dict[str, list[dict[str, Any]]], png: Any, title: str, smoothing: str,
                     variants: Any = ()) -> None:  # fmt: skip
    """The ladder's runs (`outcomes.analyse(...)["runs"]`), one column per rung: smoothed train reward and
    mean completion length against step; the arms named in `variants` (the LR-decay variants: they run
    exactly as their base arm until a trigger, so drawn beside it they would hide it) get a third row of
    their own. Every seed is drawn (thin) under its arm's mean (thick): with a few seeds a t band is
    wider than the data, and a collapse is one seed's event. Crosses: collapses; triangles: LR-decay
    triggers. Each arm keeps one colour, line style and marker in every column."""
    import numpy as np

    plt = pyplot()
    rates = sorted({split(arm)[1] for arm in runs})
    bases = list(dict.fromkeys(split(arm)[0] for arm in runs))
    variants = set(variants) & set(bases)
    n_rows = 3 if variants else 2
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(n_rows, len(rates), figsize=(4.6 * len(rates) + 1, 4 * n_rows), sharey="row",
                             squeeze=False)  # fmt: skip
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
                    ax.plot([step], [np.interp(step, r["steps"], r[key])], marker=marker, ms=7, mew=2, ls="",
                            color=style["color"])  # fmt: skip
            if usable:
                end = min(r["steps"][-1] for r in usable)
                grid = np.arange(max(r["steps"][0] for r in usable), end + 1)
                mean = np.mean([np.interp(grid, r["steps"], r[key]) for r in usable], axis=0)
                ax.plot(grid, mean, lw=2, marker=MARKERS[i % len(MARKERS)], markevery=10, ms=5,
                        label=f"{base} (n={len(usable)})", **style)  # fmt: skip
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
    fig.legend([handles[k] for k in labels], [k.split(" (")[0] for k in labels], loc="lower center",
               ncol=min(len(labels), 7), fontsize=9)  # fmt: skip
    import textwrap

    legend = "(thick: mean over seeds; thin: each seed; x: collapse; v: LR-decay trigger)"
    fig.suptitle(textwrap.fill(title, int(13 * fig.get_figwidth())) + "\n" + legend, fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    save(fig, png, dpi=100, tight=False)
