"""Every figure the application draws: a training run's curves (written by `otbrl train`) and arms compared
over seeds (`otbrl compare`). matplotlib is a heavy optional dependency (otbrl[trl]): imported only when a
figure is drawn."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from otbrl.app.intervals import t_quantile
from otbrl.app.metrics import moving_average, read_metrics


def pyplot() -> Any:
    """matplotlib's pyplot, imported on first use (heavy and optional)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path, dpi: int, tight: bool = True, **options: Any) -> None:
    if tight:
        fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, **options)
    pyplot().close(fig)


def plot_curves(metrics: Path, png: Path, title: str = "", before: float | None = None) -> None:
    """One run against generated tokens: train reward (per step and a trailing 10-step mean) with the
    held-out evaluations (`before`: the one before training, drawn at 0 tokens), completion length (mean,
    and the within-group length CV where logged), and the gradient norm with red lines where a surge was
    flagged."""
    plt = pyplot()
    rows = read_metrics(metrics)
    rewarded = [r for r in rows if "reward" in r]
    tokens = [r["generated_tokens"] for r in rewarded]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    top.plot(tokens, [r["reward"] for r in rewarded], lw=1, alpha=0.4, label="per step")
    smooth = moving_average([r["reward"] for r in rewarded], 10, centred=False)
    top.plot(tokens[: len(smooth)], smooth, lw=2, label="moving average (10 steps)")
    held = [(r["generated_tokens"], r["heldout_reward"]) for r in rows if r.get("heldout_reward") is not None]
    held = ([(0.0, before)] if before is not None else []) + held
    if held:
        top.plot(*zip(*held, strict=True), "ko-", label="held-out")
    top.set_ylabel("reward")
    top.legend(loc="lower right")
    top.set_title(title)
    lengths = [r for r in rows if "completions/mean_length" in r]
    middle.plot(
        [r["generated_tokens"] for r in lengths],
        [r["completions/mean_length"] for r in lengths],
        lw=1,
        label="mean completion length",
    )
    middle.set_ylabel("tokens")
    cv = [r for r in rows if r.get("otb/horizon/length_cv") is not None]
    if cv:
        twin = middle.twinx()
        twin.plot(
            [r["generated_tokens"] for r in cv],
            [r["otb/horizon/length_cv"] for r in cv],
            lw=1,
            color="tab:orange",
            alpha=0.7,
        )
        twin.set_ylabel("length CV within groups", color="tab:orange")
    normed = [r for r in rows if "grad_norm" in r]
    bottom.plot([r["generated_tokens"] for r in normed], [r["grad_norm"] for r in normed], lw=1)
    surges = [r["generated_tokens"] for r in rows if r.get("otb/grad_norm_surge")]
    for x in surges:
        bottom.axvline(x, color="red", alpha=0.3)
    bottom.set_ylabel("gradient norm" + (" (red: surge)" if surges else ""))
    bottom.set_xlabel("generated tokens")
    save(fig, png, dpi=110)


def plot_figure(draw: Any, png: Path, title: str) -> None:
    """One panel drawn by `draw(ax)`, saved to `png`."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    draw(ax)
    ax.set_title(title, fontsize=10)
    save(fig, png, dpi=100)


STYLES = ["-", "--", "-.", ":"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


def band(xs: list[list[float]], ys: list[list[float]], points: int = 60) -> tuple[Any, Any, Any]:
    """Mean and 95% t band over runs of curves y(x), each interpolated onto a common grid of x up to the
    shortest run's end. (grid, mean, half-width); half-width 0 for a single run."""
    end = min(x[-1] for x in xs)
    grid = np.linspace(max(x[0] for x in xs), end, points)
    curves = np.stack([np.interp(grid, x, y) for x, y in zip(xs, ys, strict=True)])
    n = len(curves)
    mean = curves.mean(axis=0)
    if n < 2:
        return grid, mean, np.zeros_like(mean)
    half = t_quantile(0.975, n - 1) * curves.std(axis=0, ddof=1) / np.sqrt(n)
    return grid, mean, half


def _arm_band(
    ax: Any,
    runs: list[dict[str, Any]],
    x: str,
    y: str,
    style: dict[str, Any],
    label: str,
    log_y: bool = False,
) -> None:
    usable = [r for r in runs if len(r[x]) > 1]
    if not usable:
        return
    ys = [np.log(np.clip(np.nan_to_num(r[y], nan=0.0), 1e-12, None)) if log_y else r[y] for r in usable]
    grid, mean, half = band([r[x] for r in usable], ys)
    lo, mid, hi = (
        (np.exp(v) for v in (mean - half, mean, mean + half)) if log_y else (mean - half, mean, mean + half)
    )
    ax.plot(grid, mid, label=f"{label} (n={len(usable)})", markevery=12, ms=4, lw=1.6, **style)
    ax.fill_between(grid, lo, hi, color=style["color"], alpha=0.15, lw=0)


def plot_arms(result: dict[str, Any], png: Path, title: str, smoothing: str) -> None:
    """An experiment (`outcomes.analyse` result), mean over seeds with a 95% t band per arm, distinct
    line style and marker per arm (curves that coincide stay visible): smoothed train reward and mean
    completion length against generated tokens, held-out reward at each token budget (95% intervals),
    and the smoothed pre-clip gradient norm (log scale) against step."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    (reward_ax, heldout_ax), (length_ax, norm_ax) = axes
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    arms = list(result["runs"].items())
    for i, (arm, runs) in enumerate(arms):
        style = {
            "color": colours[i % len(colours)],
            "ls": STYLES[i % len(STYLES)],
            "marker": MARKERS[i % len(MARKERS)],
        }
        _arm_band(reward_ax, runs, "tokens", "smooth", style, arm)
        _arm_band(length_ax, runs, "tokens", "length", style, arm)
        smoothed = [
            {**r, "norm": moving_average([n if n == n else 0.0 for n in r["grad_norm"]], 5, False)}
            for r in runs
        ]
        _arm_band(norm_ax, smoothed, "steps", "norm", style, arm, log_y=True)
        budgets = sorted({b for r in runs for b in r["heldout"]})
        xs, means, halves = [], [], []
        for b in budgets:
            vals = [r["heldout"][b] for r in runs if b in r["heldout"] and r["heldout"][b] == r["heldout"][b]]
            if not vals:
                continue
            xs.append(b * (1 + 0.03 * (i - len(arms) / 2)) if b else 0.0)  # side by side, not on top
            means.append(float(np.mean(vals)))
            halves.append(
                float(t_quantile(0.975, len(vals) - 1) * np.std(vals, ddof=1) / np.sqrt(len(vals)))
                if len(vals) > 1
                else 0.0
            )
        heldout_ax.errorbar(xs, means, yerr=halves, capsize=3, label=arm, **{**style, "ms": 5})
        for r in runs:
            for s in r["surges"]:
                norm_ax.axvline(s, color=style["color"], alpha=0.25, lw=0.8)
    reward_ax.set(xlabel="generated tokens", ylabel=f"train reward (centred mean over {smoothing})")
    length_ax.set(xlabel="generated tokens", ylabel="mean completion length (tokens)")
    heldout_ax.set(xlabel="generated tokens (budget)", ylabel="held-out reward (mean, 95% CI)")
    norm_ax.set(
        xlabel="step", ylabel="pre-clip gradient norm (trailing mean of 5; lines: surges)", yscale="log"
    )
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 3)) if ax is not norm_ax else None
    reward_ax.legend(fontsize=8, loc="best")
    heldout_ax.legend(fontsize=8, loc="best")
    fig.suptitle(textwrap.fill(title, 150) + "\n(lines: mean over seeds; bands: 95% t interval)", fontsize=10)
    save(fig, png, dpi=100)
