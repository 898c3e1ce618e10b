"""The studies' figures: a training run's curves, an experiment's arms compared, and the variance study's
variance-vs-N and proxy-vs-exact panels. matplotlib is imported only when a figure is drawn."""

from __future__ import annotations

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


def _variance_panel(ax: Any, res: dict[str, Any]) -> None:
    import matplotlib.ticker

    ns = list(res["per_n"])
    for e in res["config"]["estimators"]:
        pts = [(n, res["per_n"][n]["stats"][e]) for n in ns if e in res["per_n"][n]["stats"]]
        ax.errorbar(
            [n for n, _ in pts],
            [s["rel_var"] for _, s in pts],
            yerr=[s["rel_var_se"] for _, s in pts],
            marker="o",
            capsize=2,
            label=e,
            lw=2.2 if e.startswith("otb") else 1.2,
            ls="--" if e == "otb_exact" else "-",
        )
    ax.set(xscale="log", yscale="log", xlabel="group size N", ylabel="trace Cov(g) / ||g_ref||²")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_title("relative gradient variance")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(0.0, -0.15), frameon=False)


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
    """The variance study (`variance.run_study` result): relative variance against N per estimator, and,
    when exact norms were measured, proxy against exact energy per token and per sequence."""
    plt = _pyplot()
    panels = 3 if res["scatter"] else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.4), squeeze=False)
    _variance_panel(axes[0, 0], res)
    levels = (("token", "token w_t"), ("sequence", "sequence W_T"))
    for ax, (key, label) in zip(axes[0, 1:], levels, strict=False):
        _scatter_panel(ax, *res["scatter"][key], label, res["correlations"][key])
    _save(fig, path, dpi=110, bbox_inches="tight")  # the legend sits below the first panel
