"""The studies' figures: a training run's curves, an experiment's arms compared, and the variance study's
variance-vs-N and proxy-vs-exact panels. matplotlib is imported only when a figure is drawn."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from otbrl.app.studies.runs import moving_average, read_metrics


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path, dpi: int, **options: Any) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, **options)
    _pyplot().close(fig)


def plot_curves(metrics: Path, png: Path, title: str = "") -> None:
    """One run: train reward (per step and a trailing 10-step mean) and gradient norm, against generated
    tokens; red lines where a gradient-norm surge was flagged."""
    plt = _pyplot()
    rows = read_metrics(metrics)
    rewarded = [r for r in rows if "reward" in r]
    tokens = [r["generated_tokens"] for r in rewarded]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(tokens, [r["reward"] for r in rewarded], lw=1, alpha=0.4, label="per step")
    smooth = moving_average([r["reward"] for r in rewarded], 10, centred=False)
    top.plot(tokens[: len(smooth)], smooth, lw=2, label="moving average (10 steps)")
    top.set_ylabel("train reward")
    top.legend(loc="lower right")
    top.set_title(title)
    normed = [r for r in rows if "grad_norm" in r]
    bottom.plot([r["generated_tokens"] for r in normed], [r["grad_norm"] for r in normed], lw=1)
    surges = [r["generated_tokens"] for r in rows if r.get("otb/grad_norm_surge")]
    for x in surges:
        bottom.axvline(x, color="red", alpha=0.3)
    bottom.set_ylabel("gradient norm" + (" (red: surge)" if surges else ""))
    bottom.set_xlabel("generated tokens")
    _save(fig, png, dpi=110)


def plot_arms(result: dict[str, Any], png: Path, title: str, smoothing: str) -> None:
    """An experiment (`outcomes.analyse` result): smoothed reward against generated tokens, gradient norm
    and mean length against step, one colour per arm; `smoothing` says what the reward is averaged over."""
    plt = _pyplot()
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
    axes[0].set(xlabel="generated tokens", ylabel=f"train reward (centred mean over {smoothing})")
    axes[0].set_xscale("log")
    axes[1].set(xlabel="step", ylabel="gradient norm (▼ surge)", yscale="log")
    axes[2].set(xlabel="step", ylabel="mean completion length (: lr decay)")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    _save(fig, png, dpi=100)


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
    import matplotlib.ticker

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
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
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
    plt = _pyplot()
    rows = 2 if res["scatter"] else 1
    fig, axes = plt.subplots(rows, 2, figsize=(11, 4.6 * rows), squeeze=False)
    _estimator_panel(axes[0, 0], res, "nsr")
    _estimator_panel(axes[0, 1], res, "rel_var")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    axes[0, 0].legend(handles, labels, fontsize=7, ncol=2, loc="best", framealpha=0.8)
    levels = (("token", "token w_t"), ("sequence", "sequence W_T"))
    for ax, (key, label) in zip(axes[1] if res["scatter"] else [], levels, strict=False):
        _scatter_panel(ax, *res["scatter"][key], label, res["correlations"][key])
    _save(fig, path, dpi=110, bbox_inches="tight")
