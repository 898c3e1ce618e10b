"""The evidence suite's own figures: a learning-rate pilot's curves per arm and rate, and the variance
study's noise-against-N and proxy-against-exact panels. A training run's curves and arms compared over
seeds are the application's (`otbrl.app.plots`)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import torch

from otbrl.app.plots import MARKERS, STYLES, pyplot, save


def plot_pilot(
    curves: dict[str, dict[float, dict[str, list[tuple[float, float]]]]],
    png: Path,
    title: str,
    gates: dict[str, tuple[float, float]] | None = None,
) -> None:
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
                top.plot(
                    *zip(*series["heldout"], strict=True),
                    marker=MARKERS[i % len(MARKERS)],
                    label=label,
                    lw=2.5 if pick else 1.2,
                    **style,
                )
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
            err = [
                [_gap(v, s.get("nsr_lo")) for v, (_, s) in zip(y, pts, strict=True)],
                [_gap(v, s.get("nsr_hi")) for v, (_, s) in zip(y, pts, strict=True)],
            ]
        else:
            err = [s["rel_var_se"] for _, s in pts]
        marker, dashes = _STYLES.get(e, ("o", "-"))
        ax.errorbar(
            [n * shift for n, _ in pts],
            y,
            yerr=err,
            marker=marker,
            ls=dashes,
            capsize=2,
            ms=5,
            label=e,
            lw=2.0 if e.startswith("otb") else 1.1,
            alpha=0.9,
        )
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


def plot_registered_variance(
    buckets: dict[str, dict[str, Any]], path: Path, candidate: str, baseline: str
) -> None:
    """The registered variance study (`variance_a`): NSR(candidate) / NSR(baseline) per cell with its 95%
    interval, for all policy tokens and for each position bucket, on a log axis with 1 (no difference)
    marked. `buckets`: {cell name: {bucket: {"ratio": RatioInterval, ...}}}."""
    plt = pyplot()
    cells = list(buckets)
    kinds = [("all", "o", "k"), ("early", "s", "tab:blue"), ("late", "^", "tab:orange")]
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(cells) * (len(kinds) + 1) + 1.5))
    for i, cell in enumerate(cells):
        for j, (bucket, marker, colour) in enumerate(kinds):
            iv = buckets[cell][bucket]["ratio"]
            if not math.isfinite(iv.ratio) or iv.ratio <= 0:
                continue
            y = -(i * (len(kinds) + 1) + j)
            err = [[_gap(iv.ratio, iv.lo)], [_gap(iv.ratio, iv.hi)]]
            ax.errorbar(
                [iv.ratio],
                [y],
                xerr=err,
                marker=marker,
                color=colour,
                capsize=2,
                ms=5,
                label=bucket if i == 0 else None,
                lw=2.0 if bucket == "all" else 1.0,
            )
    ax.axvline(1.0, color="grey", ls="--", lw=1)
    ax.set_yticks([-(i * (len(kinds) + 1) + 1) for i in range(len(cells))], cells, fontsize=8)
    ax.set_xscale("log")
    ticks = [0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_xlabel(f"NSR({candidate}) / NSR({baseline}), 95% interval (no bar: undetermined)")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best", title="tokens")
    ax.set_title("Below 1: OTB's gradient is less noisy relative to its signal (same samples)", fontsize=10)
    save(fig, path, dpi=100, bbox_inches="tight")
