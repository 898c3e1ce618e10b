"""The variance study's rows of docs/results/claims.md, with verdicts by rule from its JSON results
(NAME.json of `otbrl variance --name NAME`): (a) OTB lowers the policy gradient's noise against the group
mean, and the Logit-Gradient Proxy stands in for the exact score norms. Both rest on the paired
noise-to-signal ratios and their 95% intervals (`gradstats.nsr_ratio`), not on point estimates."""

from __future__ import annotations

from typing import Any

from otbrl.app.studies.inference import HELD, INCONCLUSIVE, NOT_HELD, NOT_TESTED
from otbrl.app.studies.training_claims import Row, horizon_text
from otbrl.app.studies.variance_report import command, ratio_name, task_horizon

GROUP_MEAN = "dr_grpo"  # A = R - group mean: the baseline OTB generalises, what claim (a) sets it against
PROXY_RANK = 0.7  # least per-sequence Spearman of proxy and exact W_T for the proxy to stand in
PROXY_NSR = 1.25  # most NSR(otb proxy) / NSR(otb exact) for the proxy to stand in


def intervals(res: dict[str, Any], name: str) -> list[tuple[int, dict[str, float]]]:
    """(N, {ratio, lo, hi, k, log_se}) of the paired NSR ratio `name` at every N that has it."""
    per_n = sorted(res.get("per_n", {}).items(), key=lambda kv: int(kv[0]))
    return [(int(n), b["nsr_ratios"][name]) for n, b in per_n if name in b.get("nsr_ratios", {})]


def below(iv: dict[str, float], bound: float) -> bool:
    return iv["hi"] < bound  # False for an undetermined (NaN) interval: it decides nothing


def above(iv: dict[str, float], bound: float) -> bool:
    return iv["lo"] > bound


def interval_text(ivs: list[tuple[int, dict[str, float]]]) -> str:
    """N=4: 0.53 [0.45, 0.62], ... (an undetermined interval says so)."""

    def one(iv: dict[str, float]) -> str:
        if iv["ratio"] != iv["ratio"]:  # NaN: neither estimator had a measurable signal
            return "no measurable signal"
        if iv["lo"] != iv["lo"]:  # NaN: a leave-one-out subset had no measurable signal
            return f"{iv['ratio']:.2f} [interval undetermined]"
        return f"{iv['ratio']:.2f} [{iv['lo']:.2f}, {iv['hi']:.2f}]"

    return ", ".join(f"N={n}: {one(iv)}" for n, iv in ivs)


def task_label(res: dict[str, Any]) -> str:
    """The task, with how its samples differ inside a group as measured in the study's own samples
    (within-group length and energy CV, energy–reward correlation, share of groups with a reward spread)."""
    task = res.get("config", {}).get("task", "?")
    text = horizon_text(task_horizon(res))
    return f"{task} ({text} in the study's samples)" if text else task


def _command(res: dict[str, Any]) -> str:
    return f"`{command(res['config'])}`" if "config" in res else "`otbrl variance`"


def variance_claim(res: dict[str, Any], label: str | None = None) -> Row:
    """(a): held if the 95% interval of NSR(otb) / NSR(group mean) lies below 1 at every N measured, did
    not hold if it lies above 1 at any N, inconclusive otherwise; not tested without that ratio."""
    ivs = intervals(res, ratio_name("otb", GROUP_MEAN))
    if not ivs:
        verdict = NOT_TESTED
    elif any(above(iv, 1.0) for _, iv in ivs):
        verdict = NOT_HELD
    elif all(below(iv, 1.0) for _, iv in ivs):
        verdict = HELD
    else:
        verdict = INCONCLUSIVE
    k = ", ".join(sorted({str(int(iv["k"])) for _, iv in ivs}))
    measured = (
        f"Noise-to-signal trace Cov / ‖E g‖² of OTB over the group mean ({GROUP_MEAN}), paired on the same "
        f"batches at a fixed {label or task_label(res)} checkpoint, K={k} batches per N, 95% interval: "
        f"{interval_text(ivs)}."
        if ivs
        else "no paired noise-to-signal ratio of OTB and the group mean in the study's results."
    )
    return (
        "(a) OTB lowers the policy gradient's noise (against the group-mean baseline, same samples).",
        measured,
        f"**{verdict}** (rule: held if the 95% interval of NSR(otb)/NSR({GROUP_MEAN}) lies below 1 at "
        "every N measured; did not hold if it lies above 1 at any N; inconclusive otherwise)",
        _command(res),
    )


def proxy_claim(res: dict[str, Any], label: str | None = None) -> Row:
    """Proxy: held if the per-sequence Spearman of proxy and exact W_T >= PROXY_RANK and the 95% interval of
    NSR(otb) / NSR(otb_exact) lies below PROXY_NSR at every N; did not hold if the Spearman is lower or an
    interval lies entirely above PROXY_NSR; inconclusive otherwise; not tested without either."""
    corr = res.get("correlations") or {}
    token, seq = corr.get("token"), corr.get("sequence")
    ivs = intervals(res, ratio_name("otb", "otb_exact"))
    if not ivs and not seq:
        verdict = NOT_TESTED
    elif (seq and seq[2] < PROXY_RANK) or any(above(iv, PROXY_NSR) for _, iv in ivs):
        verdict = NOT_HELD
    elif seq and ivs and all(below(iv, PROXY_NSR) for _, iv in ivs):
        verdict = HELD
    else:
        verdict = INCONCLUSIVE
    parts = []
    if token:
        parts.append(f"per token: Spearman {token[2]:.2f}, Pearson {token[0]:.2f} ({token[3]} tokens)")
    if seq:
        parts.append(f"per sequence W_T: Spearman {seq[2]:.2f}, Pearson {seq[0]:.2f} ({seq[3]} sequences)")
    if ivs:
        k = ", ".join(sorted({str(int(iv["k"])) for _, iv in ivs}))
        parts.append(
            f"noise-to-signal OTB-proxy / OTB-exact, paired on the {k} batches per N with exact norms, 95% "
            f"interval: {interval_text(ivs)}"
        )
    measured = f"At a fixed {label or task_label(res)} checkpoint: " + "; ".join(parts) if parts else "-"
    return (
        "The Logit-Gradient Proxy stands in for the exact per-token score norms, from forward-pass "
        "probabilities alone (no backward pass).",
        measured + ". The proxy needs no backward pass by construction; its cost beside the log-probs is "
        "in [energy.md](energy.md).",
        f"**{verdict}** (rule: held if the per-sequence Spearman ≥ {PROXY_RANK} and the 95% interval of "
        f"NSR(otb)/NSR(otb_exact) lies below {PROXY_NSR} at every N; did not hold if the Spearman is below "
        f"{PROXY_RANK} or an interval lies entirely above {PROXY_NSR}; inconclusive otherwise)",
        _command(res),
    )
