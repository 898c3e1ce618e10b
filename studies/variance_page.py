"""The results page of `python -m studies variance` (docs/results/NAME.md): the headline paired
noise-to-signal ratios with 95% intervals and the verdicts they give, the method, one table per statistic, the
raw variance ratios, what they say about OTB against the group mean, and proxy-vs-exact correlations. Made
from the numbers `variance.run_study` returns; no measurement happens here."""

from __future__ import annotations

import math
from typing import Any

from studies.pages import machine, markdown_table

GROUP_MEAN = "dr_grpo"  # A = R - group mean: the baseline OTB generalises, what claim (a) sets it against


def matching_group_size(curve: dict[int, float], target: float) -> str:
    """The N at which a decreasing variance curve reaches `target` (log-log interpolation), as text."""
    ns = sorted(curve)
    if target >= curve[ns[0]]:
        return f"<= {ns[0]}"
    for lo, hi in zip(ns, ns[1:], strict=False):
        if curve[hi] <= target < curve[lo]:
            frac = math.log(curve[lo] / target) / math.log(curve[lo] / curve[hi])
            return f"~{math.exp(math.log(lo) + frac * math.log(hi / lo)):.0f}"
    return f"> {ns[-1]}"


def ratio_name(a: str, b: str) -> str:
    """How the page and variance.json label the variance ratio of estimator a to estimator b."""
    return f"{a} / {b}"


def command(cfg: dict[str, Any], threads: int | None = None) -> str:
    """The command line that regenerates these results (cfg: the study's Config as a dict; threads: the
    torch threads it ran with, when given)."""
    parts = ["python -m studies variance", f"--task {cfg['task']}"]
    if cfg.get("preset", "small") != "small":
        parts.append(f"--preset {cfg['preset']}")
    parts += [f"--k {cfg['k']}", f"--prompts {cfg['prompts']}"]
    parts += [
        f"--group-sizes {','.join(map(str, cfg['group_sizes']))}",
        f"--estimators {','.join(cfg['estimators'])}",
    ]
    parts += [
        f"--exact-batches {cfg['exact_batches']}",
        f"--ref-batches {cfg['ref_batches']}",
        f"--seed {cfg['seed']}",
    ]
    if cfg.get("name", "variance") != "variance":
        parts.append(f"--name {cfg['name']}")
    if threads:
        parts.append(f"--threads {threads}")
    return " ".join(parts)


def interval_cell(iv: dict[str, float]) -> str:
    """0.530 [0.450, 0.620] (K=24): a paired ratio with its 95% interval."""
    if iv["ratio"] != iv["ratio"]:  # NaN: neither estimator had a measurable signal
        return f"no signal (K={int(iv['k'])})"
    if iv["lo"] != iv["lo"]:  # NaN: some leave-one-out subset had no measurable signal
        return f"{iv['ratio']:.3f} [undetermined] (K={int(iv['k'])})"
    return f"{iv['ratio']:.3f} [{iv['lo']:.3f}, {iv['hi']:.3f}] (K={int(iv['k'])})"


def _headline(res: dict[str, Any], group_mean: str, verdict_rows: list[tuple[str, ...]]) -> list[str]:
    """The paired noise-to-signal ratios per N with their intervals, and the verdicts they give
    (verdict_rows: the claims rows, `claims.variance_claim` and `claims.proxy_claim`)."""
    ns = list(res["per_n"])
    names = list(res["per_n"][ns[0]].get("nsr_ratios", {}))
    if not names:
        return []
    rows = [
        [
            f"N={n}",
            *(
                interval_cell(res["per_n"][n]["nsr_ratios"][r]) if r in res["per_n"][n]["nsr_ratios"] else "-"
                for r in names
            ),
        ]
        for n in ns
    ]
    verdicts = [list(row[:3]) for row in verdict_rows]
    return [
        "## Headline: noise-to-signal ratios at equal N (paired, same batches, 95% interval)",
        "",
        "NSR = trace Cov(g) / ||E g||², per estimator; the table gives NSR(a) / NSR(b) computed on the same "
        "batches. Below 1: a's gradient is less noisy relative to its signal. Unlike the raw variance ratio "
        f"further down, it is scale-free: {group_mean}, sob and otb subtract self-inclusive baselines, which "
        "shrink every advantage and so lower the variance and the signal together; the NSR is not moved by "
        "that. Interval: the delete-one jackknife standard error of log(ratio) over the K batches, times "
        "the Student t quantile t(0.975, K-1), exponentiated back around the estimate on all K batches. "
        "An interval that does not contain 1 is a significant difference at the 5% level. Undetermined: on "
        "some subset of K - 1 batches the debiased signal ||mean g||² - trace Cov / K was not positive, so "
        "the noise was too large for K batches to measure the signal; such a ratio decides no verdict. On "
        "synthetic Gaussian gradients with a known ratio (tests/app/test_variance.py) the interval held the "
        "true ratio in about 95% of 200 repetitions at K = 24.",
        "",
        markdown_table(["N", *names], rows),
        "",
        "Verdicts (the same rows and rules as in [claims.md](claims.md)):",
        "",
        markdown_table(["claim", "measured", "verdict"], verdicts, aligned=False),
        "",
    ]


def reading_notes(cfg: dict[str, Any]) -> str:
    """How to read the N dependence and the small-K rows (no numbers: those come from the tables)."""
    return (
        f"Reading the N dependence: with {cfg['prompts']} prompts per batch the variance is roughly a + b/N, "
        "where a is the spread of the per-prompt expected gradients (no baseline removes it) and b/N the "
        "within-group noise that baselines reduce. Where a dominates, every curve flattens and the ratios "
        'drift toward 1 as N grows; "needs N > ..." means the group mean does not reach OTB\'s level '
        f"anywhere in the measured range. The otb_exact rows rest on {min(cfg['exact_batches'], cfg['k'])} "
        f"of the {cfg['k']} batches per N: compare them with otb through the paired ratios, not across "
        "rows. Exact score norms span many orders of magnitude (see the scatter), so a few batches carry "
        "much of each variance estimate."
    )


def _method(res: dict[str, Any], group_mean: str, reference_group_size: int) -> list[str]:
    cfg, ns = res["config"], list(res["per_n"])
    smallest = min(s["rel_var"] for n in ns for s in res["per_n"][n]["stats"].values())
    return [
        f"Policy: the warm-started `{cfg['task']}` / `{cfg['preset']}` checkpoint ({res['params']:,} "
        f"parameters, sampled reward {res['checkpoint']['reward']:.2f} when it was saved), temperature 1, "
        f"never trained here. A batch is {cfg['prompts']} fresh prompts x N samples (B rows); its gradient "
        "estimate is g = (1/B) Σ_i Σ_t A_it ∇θ log π(y_it): the sequence sum divided by the number of "
        "samples, for every estimator, so with an unbiased baseline (rloo, otb_loo) g is an unbiased "
        f"estimate of ∇E[R]. grpo keeps its std normalisation; {group_mean} (the group mean), opo, sob and "
        "otb use self-inclusive baselines (biased by O(1/N)). Every estimator sees the same samples: each "
        f"batch is drawn once per N and K = {cfg['k']} independent batches are drawn per N.",
        "",
        f"Reference: {cfg['ref_batches']} chunks of {cfg['prompts']} prompts x {reference_group_size} "
        f"samples ({res['ref']['rows']:,} rows) with rloo, averaged. Its own noise, estimated from the "
        f"spread of the chunks, is E||g_ref - ∇E[R]||² / ||g_ref||² = **{res['ref']['noise']:.4f}**, "
        f"{100 * res['ref']['noise'] / smallest:.1f}% of the smallest relative variance below "
        f"({smallest:.3f}). It adds about that much to every relative MSE; it also inflates ||g_ref||², "
        "which scales every relative figure by the same factor (ratios are unaffected).",
        "",
        "Relative variance = trace Cov(g_k) / ||g_ref||² (unbiased over the K batches, ± a jackknife "
        "standard error). Relative MSE = mean_k ||g_k - g_ref||² / ||g_ref||². Noise-to-signal = "
        "trace Cov / ||E g||² (||E g||² estimated without bias; scale-free, so rloo and the group mean, "
        "whose gradients differ by the factor N/(N-1), are comparable). Cosine = cos(mean_k g_k, g_ref) "
        "(lowered by the noise left in a mean of K).",
        "",
        f"otb_exact is OTB with the exact per-token ||∇θ log π(y_t)||² (`otbrl.exact`, one backward per "
        f"token) instead of the Logit-Gradient Proxy. It is expensive, so it runs on the first "
        f"{min(cfg['exact_batches'], cfg['k'])} of the K batches at each N only (its rows use that K); the "
        "otb / otb_exact ratio is taken on those same batches.",
    ]


def _tables(res: dict[str, Any]) -> list[str]:
    ns, est = list(res["per_n"]), list(res["config"]["estimators"])

    def cell(n: int, e: str, key: str) -> str:
        s = res["per_n"][n]["stats"].get(e)
        if s is None:
            return "-"
        if key == "rel_var":
            return f"{s['rel_var']:.3f} ± {s['rel_var_se']:.3f}"
        if key == "nsr" and "nsr_lo" in s:
            bounds = "undetermined" if s["nsr_lo"] != s["nsr_lo"] else f"{s['nsr_lo']:.2f}, {s['nsr_hi']:.2f}"
            return f"{s['nsr']:.3f} [{bounds}]"
        return f"{s[key]:.3f}"

    lines = []
    for title, key in (
        ("Relative variance (± SE)", "rel_var"),
        ("Relative MSE against the reference", "rel_mse"),
        ("Noise-to-signal (scale-free; 95% interval as in the headline)", "nsr"),
        ("Cosine of the mean gradient with the reference", "cosine"),
    ):
        header = ["estimator", *(f"N={n}" for n in ns)]
        rows = [[e, *(cell(n, e, key) for n in ns)] for e in est]
        lines += [f"## {title}", "", markdown_table(header, rows), ""]
    names = list(res["per_n"][ns[0]]["ratios"])
    ratio_rows = [
        [f"N={n}"]
        + [
            "{:.3f} ± {:.3f} (K={})".format(*res["per_n"][n]["ratios"][r])
            if r in res["per_n"][n]["ratios"]
            else "-"
            for r in names
        ]
        for n in ns
    ]
    return lines + [
        "## Raw variance ratios at equal N (paired, same batches; ± jackknife SE)",
        "",
        "Not scale-free: a self-inclusive baseline's shrinkage of the advantages lowers these (the "
        "headline's noise-to-signal ratios are not moved by it).",
        "",
        markdown_table(["N", *names], ratio_rows),
        "",
    ]


def _verdict(res: dict[str, Any], group_mean: str) -> list[str]:
    ns, est = list(res["per_n"]), res["config"]["estimators"]
    if "otb" not in est or group_mean not in est:
        return []
    stats = {n: res["per_n"][n]["stats"] for n in ns}
    curve = {int(n): stats[n][group_mean]["rel_var"] for n in ns}  # int: JSON keys are strings ("16" < "4")
    verdict = []
    for n in ns:
        ratio = res["per_n"][n]["ratios"][ratio_name("otb", group_mean)][0]
        match = matching_group_size(curve, stats[n]["otb"]["rel_var"])
        verdict.append(
            f"- At N={n}, OTB's raw gradient variance is {ratio:.2f}x the group mean's; the group mean "
            f"needs N {match} to match it."
        )
    return ["What the raw variances say:", "", *verdict, "", reading_notes(res["config"]), ""]


def _correlations(corr: dict[str, tuple[float, float, float, int]]) -> list[str]:
    if not corr:
        return []
    levels = (("token w_t", "token"), ("sequence W_T", "sequence"), ("W_T / group mean", "within_group"))
    rows = [[name, *(f"{x:.3f}" for x in corr[key][:3]), str(corr[key][3])] for name, key in levels]
    return [
        "## Proxy vs exact score norms",
        "",
        "On the batches with exact norms (all N pooled). The proxy w_t = ||e_y - π_t||² is the "
        "logit-space part of ||∇θ log π(y_t)||²; the rest (the hidden state's norm, deeper layers) is "
        "what it ignores.",
        "",
        markdown_table(["level", "Pearson", "Pearson of logs", "Spearman", "count"], rows),
        "",
    ]


HORIZON_LABELS = (
    ("length_cv", "within-group length CV (std / mean per group, averaged)"),
    ("energy_cv", "within-group energy CV (of W_T, the proxy's)"),
    ("energy_reward_corr", "within-group energy–reward correlation"),
    ("reward_spread", "share of groups with a reward spread"),
)


def horizon(block: dict[str, Any]) -> dict[str, float]:
    """One N's horizon statistics (`stability.group_horizons`, averaged over its batches); results
    written before they were measured carry the length CV alone."""
    return block.get("horizon") or ({"length_cv": block["length_cv"]} if "length_cv" in block else {})


def task_horizon(res: dict[str, Any]) -> dict[str, float]:
    """The horizon statistics averaged over the study's group sizes (keys every N has)."""
    blocks = [horizon(b) for b in res.get("per_n", {}).values()]
    keys = [k for k, _ in HORIZON_LABELS if blocks and all(k in b for b in blocks)]
    return {k: sum(b[k] for b in blocks) / len(blocks) for k in keys}


def report(
    res: dict[str, Any], group_mean: str, reference_group_size: int, verdict_rows: list[tuple[str, ...]]
) -> str:
    """The page as markdown. group_mean: the estimator label OTB is set against; reference_group_size:
    the N of the reference gradient's samples; verdict_rows: the study's claims rows with their
    verdicts (`claims`, which reads this module's helpers: passed in, not imported)."""
    cfg, ns, sec = res["config"], list(res["per_n"]), res["seconds"]
    budget = f", token budget {res['budget']}" if "budget" in res else ""
    cv = "".join(
        f", {label} " + ", ".join(f"N={n}: {horizon(res['per_n'][n])[key]:.2f}" for n in ns)
        for key, label in HORIZON_LABELS
        if all(key in horizon(res["per_n"][n]) for n in ns)
    )
    lines = [
        f"# Gradient variance of advantage estimators at a fixed checkpoint: {cfg['task']}",
        "",
        f"Machine: {machine(res['threads'])}.",
        "",
        f"Regenerate (from the repo root): `{command(cfg, res['threads'])}`"
        + ("  (this is a `--quick` run)" if cfg["quick"] else ""),
        "",
        f"Wall time {sec['total'] / 60:.1f} min: sampling {sec['sampling']:.0f} s, forward + backward "
        f"{sec['gradients']:.0f} s, exact score norms {sec['exact norms']:.0f} s.",
        "",
        f"Task `{cfg['task']}`{budget}; the completions sampled here: mean length "
        + ", ".join(f"N={n}: {res['per_n'][n]['length']:.1f}" for n in ns)
        + f"{cv}.",
        "",
        *_headline(res, group_mean, verdict_rows),
        "## Method",
        "",
        *_method(res, group_mean, reference_group_size),
        "",
        *_tables(res),
        *_verdict(res, group_mean),
        *_correlations(res["correlations"]),
        "Mean reward and completion length per N: "
        + ", ".join(f"N={n}: {res['per_n'][n]['reward']:.3f}, {res['per_n'][n]['length']:.1f}" for n in ns)
        + ".",
        "",
        f"![noise-to-signal and relative variance vs N, proxy vs exact]({cfg.get('name', 'variance')}.png)",
        "",
    ]
    return "\n".join(lines)
