"""Every figure the application draws: a training run's curves (written by `otbrl train` and benchmarks/),
an experiment's arms compared, and the variance study's variance-vs-N and proxy-vs-exact panels.
matplotlib and scipy are heavy optional dependencies (otbrl[trl]): imported only when a figure is drawn."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import torch

from otbrl.app.metrics import moving_average, read_metrics


def pyplot() -> Any:
    """matplotlib's pyplot, imported on first use (heavy and optional)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (scipy imported on first use: heavy)."""
    from scipy import stats

    return float(stats.t.ppf(0.975, df))


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
    middle.plot([r["generated_tokens"] for r in lengths], [r["completions/mean_length"] for r in lengths],
                lw=1, label="mean completion length")  # fmt: skip
    middle.set_ylabel("tokens")
    cv = [r for r in rows if r.get("otb/horizon/length_cv") is not None]
    if cv:
        twin = middle.twinx()
        twin.plot([r["generated_tokens"] for r in cv], [r["otb/horizon/length_cv"] for r in cv], lw=1,
                  color="tab:orange", alpha=0.7)  # fmt: skip
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
    half = t975(n - 1) * curves.std(axis=0, ddof=1) / np.sqrt(n)
    return grid, mean, half


def _arm_band(ax: Any, runs: list[dict[str, Any]], x: str, y: str, style: dict[str, Any], label: str,
              log_y: bool = False) -> None:  # fmt: skip
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
        style = {"color": colours[i % len(colours)], "ls": STYLES[i % len(STYLES)],
                 "marker": MARKERS[i % len(MARKERS)]}  # fmt: skip
        _arm_band(reward_ax, runs, "tokens", "smooth", style, arm)
        _arm_band(length_ax, runs, "tokens", "length", style, arm)
        smoothed = [{**r, "norm": moving_average([n if n == n else 0.0 for n in r["grad_norm"]], 5, False)}
                    for r in runs]  # fmt: skip
        _arm_band(norm_ax, smoothed, "steps", "norm", style, arm, log_y=True)
        budgets = sorted({b for r in runs for b in r["heldout"]})
        xs, means, halves = [], [], []
        for b in budgets:
            vals = [r["heldout"][b] for r in runs if b in r["heldout"] and r["heldout"][b] == r["heldout"][b]]
            if not vals:
                continue
            xs.append(b * (1 + 0.03 * (i - len(arms) / 2)) if b else 0.0)  # side by side, not on top
            means.append(float(np.mean(vals)))
            halves.append(float(t975(len(vals) - 1) * np.std(vals, ddof=1) / np.sqrt(len(vals)))
                          if len(vals) > 1 else 0.0)  # fmt: skip
        heldout_ax.errorbar(xs, means, yerr=halves, capsize=3, label=arm, **{**style, "ms": 5})
        for r in runs:
            for s in r["surges"]:
                norm_ax.axvline(s, color=style["color"], alpha=0.25, lw=0.8)
    reward_ax.set(xlabel="generated tokens", ylabel=f"train reward (centred mean over {smoothing})")
    length_ax.set(xlabel="generated tokens", ylabel="mean completion length (tokens)")
    heldout_ax.set(xlabel="generated tokens (budget)", ylabel="held-out reward (mean, 95% CI)")
    norm_ax.set(xlabel="step", ylabel="pre-clip gradient norm (trailing mean of 5; lines: surges)",
                yscale="log")  # fmt: skip
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 3)) if ax is not norm_ax else None
    reward_ax.legend(fontsize=8, loc="best")
    heldout_ax.legend(fontsize=8, loc="best")
    fig.suptitle(textwrap.fill(title, 150) + "\n(lines: mean over seeds; bands: 95% t interval)", fontsize=10)
    save(fig, png, dpi=100)


def plot_pilot(curves: dict[str, dict[float, dict[str, list[tuple[float, float]]]]], png: Path, title: str,
               gates: dict[str, tuple[float, float]] | None = None) -> None:  # fmt: skip
    """A learning-rate pilot, one column per arm: held-out reward against generated tokens (top; step 0
    included) and train reward (trailing mean, bottom), one line per learning rate. `curves`: {arm: {lr:
    {"heldout": [(tokens, reward)], "train": [(tokens, reward)]}}}; `gates`: {arm: (pick, level)} draws
    the level the arm's pick must reach (held-out at step 0 plus the gate's gain) as a dotted line."""
    plt = pyplot()
    arms = list(curves)
    fig, axes = plt.subplots(2, len(arms), figsize=(4.2 * len(arms), 7), sharey="row", squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    rates = sorted({lr for by_lr in curves.values() for lr in by_lr})
    for col, arm in enumerate(arms):
        top, bottom = axes[0][col], axes[1][col]
        for lr, series in sorted(curves[arm].items()):
            i = rates.index(lr)
            style = {"color": colours[i % len(colours)], "ls": STYLES[i % len(STYLES)]}
            pick = gates is not None and arm in gates and gates[arm][0] == lr
            label = f"lr {lr:g}" + (" (pick)" if pick else "")
            if series["heldout"]:
                top.plot(*zip(*series["heldout"], strict=True), marker=MARKERS[i % len(MARKERS)], label=label,
                         lw=2.5 if pick else 1.2, **style)  # fmt: skip
            if series["train"]:
                bottom.plot(*zip(*series["train"], strict=True), lw=1.5 if pick else 0.9, **style)
        if gates is not None and arm in gates:
            top.axhline(gates[arm][1], color="k", ls=":", lw=1, label="gate at the pick")
        top.set_title(arm, fontsize=10)
        top.set(xlabel="generated tokens", ylabel="held-out reward" if col == 0 else None)
        bottom.set(xlabel="generated tokens", ylabel="train reward (trailing mean)" if col == 0 else None)
        for ax in (top, bottom):
            ax.grid(True, alpha=0.3)
            ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 3))
        top.legend(fontsize=8, loc="best")
    fig.suptitle(textwrap.fill(title, 150), fontsize=10)
    save(fig, png, dpi=90)


# Estimators whose curves coincide (dr_grpo and rloo have equal noise-to-signal; grpo and opo lie close)
# get distinct markers and dashes, and a small sideways shift, so every one stays visible.
_STYLES = {
    "grpo": ("v", (0, (1, 1))),
    "dr_grpo": ("s", "-"),
    "rloo": ("x", (0, (4, 2))),
    "opo": ("^", (0, (1, 2))),
    "sob": ("D", (0, (6, 2, 1, 2))),
    "otb": ("o", "-"),
    "otb_loo": ("P", (0, (3, 1, 1, 1))),
    "otb_exact": ("*", "--"),
}


def _gap(value: float, bound: float | None) -> float:
    """Length of an error bar from value to bound; none (0) for a missing or undetermined bound."""
    return abs(bound - value) if bound is not None and math.isfinite(bound) and math.isfinite(value) else 0.0


def _estimator_panel(ax: Any, res: dict[str, Any], key: str) -> None:
    """One statistic against N per estimator, log-log: key "nsr" (95% interval bars) or "rel_var" (± SE)."""
    ns = list(res["per_n"])
    estimators = list(res["config"]["estimators"])
    for i, e in enumerate(estimators):
        pts = [(n, res["per_n"][n]["stats"][e]) for n in ns if e in res["per_n"][n]["stats"]]
        shift = 1.03 ** (i - (len(estimators) - 1) / 2)  # multiplicative: the x axis is logarithmic
        y = [s[key] for _, s in pts]
        if key == "nsr":
            err = [[_gap(v, s.get("nsr_lo")) for v, (_, s) in zip(y, pts, strict=True)],
                   [_gap(v, s.get("nsr_hi")) for v, (_, s) in zip(y, pts, strict=True)]]  # fmt: skip
        else:
            err = [s["rel_var_se"] for _, s in pts]
        marker, dashes = _STYLES.get(e, ("o", "-"))
        ax.errorbar(
            [n * shift for n, _ in pts], y, yerr=err, marker=marker, ls=dashes, capsize=2, ms=5,
            label=e, lw=2.0 if e.startswith("otb") else 1.1, alpha=0.9,
        )  # fmt: skip
    ylabel = "trace Cov(g) / ||E g||²" if key == "nsr" else "trace Cov(g) / ||g_ref||²"
    ax.set(xscale="log", yscale="log", xlabel="group size N", ylabel=ylabel)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.xaxis.set_minor_formatter(pyplot().NullFormatter())
    nsr_title = "noise-to-signal (95% interval; no bar: undetermined)"
    title = nsr_title if key == "nsr" else "relative variance (± SE; not scale-free)"
    ax.set_title(f"{res['config']['task']}: {title}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)


def _scatter_panel(ax: Any, proxy: torch.Tensor, exact: torch.Tensor, label: str, corr: tuple) -> None:
    if len(proxy) > 20000:  # keep the PNG small; a fixed subsample
        keep = torch.randperm(len(proxy), generator=torch.Generator().manual_seed(0))[:20000]
        proxy, exact = proxy[keep], exact[keep]
    ax.scatter(proxy.clamp_min(1e-12), exact.clamp_min(1e-12), s=2, alpha=0.25)
    ax.set(xscale="log", yscale="log", xlabel=f"proxy {label}", ylabel="exact ||∇θ log π||² (sum)")
    p, lp, s, _ = corr
    ax.set_title(f"{label}: Pearson {p:.2f} (logs {lp:.2f}), Spearman {s:.2f}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)


def plot_variance(res: dict[str, Any], path: Path) -> None:
    """The variance study (`variance.run_study` result): noise-to-signal (with 95% intervals) and relative
    variance against N per estimator, and, when exact norms were measured, proxy against exact energy per
    token and per sequence."""
    plt = pyplot()
    rows = 2 if res["scatter"] else 1
    fig, axes = plt.subplots(rows, 2, figsize=(11, 4.6 * rows), squeeze=False)
    _estimator_panel(axes[0, 0], res, "nsr")
    _estimator_panel(axes[0, 1], res, "rel_var")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    axes[0, 0].legend(handles, labels, fontsize=7, ncol=2, loc="best", framealpha=0.8)
    levels = (("token", "token w_t"), ("sequence", "sequence W_T"))
    for ax, (key, label) in zip(axes[1] if res["scatter"] else [], levels, strict=False):
        _scatter_panel(ax, *res["scatter"][key], label, res["correlations"][key])
    save(fig, path, dpi=110, bbox_inches="tight")
