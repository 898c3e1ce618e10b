"""`otbrl variance`: how noisy is each advantage estimator's policy gradient at one fixed checkpoint, and
how well does the Logit-Gradient Proxy track the exact per-token score norms it stands in for?

Method (repeated on the results page):
- Policy: a warm-started tiny model on a built-in task (default running_sum16 / small, the shipped
  checkpoint), sampled at temperature 1. Nothing is trained.
- A batch is P fresh prompts x N samples (B = P N rows). Its policy-gradient estimate with advantages A is
      g = (1 / B) sum_i sum_t A_it grad_theta log pi(y_it | x_i, y_i,<t)
  (sequence sum, divided by the number of samples), the same aggregation for every estimator: with an
  unbiased baseline (rloo, otb leave-one-out) it is an unbiased estimate of grad E[R]. grpo keeps its std
  normalisation and dr_grpo / otb / sob / opo their self-inclusive baselines; the MSE shows their bias.
- Each batch is sampled once and every estimator is applied to the same samples: one forward pass, one
  backward pass per estimator (g is linear in A). K independent batches per N.
- Reference: M chunks of P prompts x 32 samples with rloo (unbiased), averaged; its noise
  E||g_ref - grad||^2 is estimated from the spread of the chunks.
- Over the K estimates g_k: relative variance trace Cov(g_k) / ||g_ref||^2 (unbiased, K - 1); relative MSE
  mean_k ||g_k - g_ref||^2 / ||g_ref||^2 (includes the reference's own noise); noise-to-signal
  trace Cov / ||E g||^2 with ||E g||^2 estimated without bias as ||mean g||^2 - trace Cov / K (scale-free:
  rloo and the group mean differ by the factor N / (N - 1)); cosine(mean g_k, g_ref). Same definitions as
  `otbrl.app.studies.toy.gradient_study`, except
  that the noise-to-signal ratio is debiased for the small K here.
  Standard errors of variances and their ratios are delete-one jackknife over batches.
- otb_exact uses exact ||grad_theta log pi(y_t)||^2 (`otbrl.exact`, one backward per token), so it runs on
  the first `exact_batches` batches of each N only; its ratio to the proxy OTB is taken on those batches.
  The same batches give the proxy-vs-exact correlations (per token, and per sequence for W_T).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

import otbrl
from otbrl.app.studies.report import machine, markdown_table
from otbrl.energy import token_energy
from otbrl.exact import score_sq_norms
from otbrl.lm import predicting

# label -> (registered estimator, its options, which energy it reads: None, "proxy" or "exact")
SETTINGS: dict[str, tuple[str, dict[str, Any], str | None]] = {
    "grpo": ("grpo", {}, None),
    "dr_grpo": ("dr_grpo", {}, None),
    "rloo": ("rloo", {}, None),
    "opo": ("opo", {}, None),
    "sob": ("sob", {}, "proxy"),
    "otb": ("otb", {}, "proxy"),
    "otb_loo": ("otb", {"leave_one_out": True}, "proxy"),
    "otb_exact": ("otb_exact", {}, "exact"),
}
GROUP_MEAN = "dr_grpo"  # A = R - group mean: the baseline OTB generalises
RATIOS = (("otb", GROUP_MEAN), ("otb_loo", "rloo"), ("otb", "otb_exact"))  # headline variance ratios
REFERENCE_ESTIMATOR, REFERENCE_GROUP_SIZE = "rloo", 32


@dataclass(frozen=True)
class Config:
    task: str = "running_sum16"
    preset: str = "small"
    estimators: tuple[str, ...] = tuple(SETTINGS)
    group_sizes: tuple[int, ...] = (4, 8, 16, 32)
    k: int = 24  # independent batches per N
    prompts: int = 8  # prompts per batch
    exact_batches: int = 4  # of the K batches per N, those that also get exact score norms
    ref_batches: int = 32  # chunks of the reference gradient
    seed: int = 0
    quick: bool = False


QUICK = {"group_sizes": (4, 8), "k": 5, "prompts": 6, "exact_batches": 2, "ref_batches": 4}


# ----------------------------------------------------------------------------------------------------
# One batch: samples, log-probs with their graph, energies, advantages, gradients.


@dataclass
class Rollout:
    """B rows, each prompt's samples consecutive. input_ids / attention_mask (B, L): left-padded prompt,
    then the completion; mask (B, T): policy tokens, aligned with the last T columns; logprobs (B, T):
    the sampler's log pi of each policy token; rewards, group_ids (B,)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    mask: torch.Tensor
    logprobs: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor


def draw(model: Any, tokenizer: Any, task: Any, rows: list[dict], n: int, gen: torch.Generator) -> Rollout:
    """Sample n completions of each row's prompt at temperature 1 and score them."""
    from otbrl.rollout import sample

    s = sample(
        model, tokenizer, [r["prompt"] for r in rows], n, task.max_completion_tokens, 1.0, generator=gen
    )
    rewards = [
        task.reward(text, rows[g]["answer"]) for text, g in zip(s.texts, s.group_ids.tolist(), strict=True)
    ]
    return Rollout(
        input_ids=torch.cat([s.prompt_ids, s.completion_ids], dim=1),
        attention_mask=torch.cat([s.prompt_mask, s.completion_mask], dim=1),
        mask=s.completion_mask,
        logprobs=s.logprobs,
        rewards=torch.tensor(rewards),
        group_ids=s.group_ids,
    )


def token_logprobs(model: torch.nn.Module, r: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) log pi(y_t) of the policy tokens, with autograd graph, and their proxy energy w_t (no graph);
    both 0 where mask == 0. Positions skip the left padding, as in the sampler."""
    positions = (r.attention_mask.cumsum(-1) - 1).clamp(min=0)
    width = r.mask.shape[1]
    out = model(input_ids=r.input_ids, attention_mask=r.attention_mask, position_ids=positions)
    logits = predicting(out.logits, width)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    tokens = r.input_ids[:, -width:]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    keep = r.mask.bool()
    return torch.where(keep, logp, 0.0), torch.where(keep, token_energy(logits.detach(), tokens), 0.0)


def exact_energy(model: torch.nn.Module, r: Rollout) -> torch.Tensor:
    """(B, T) float64 exact ||grad_theta log pi(y_t)||^2. score_sq_norms runs the model without an
    attention mask, so rows are grouped by their left padding and called with it cut off."""
    lead = (r.attention_mask.cumsum(-1) == 0).sum(-1)
    out = torch.zeros(r.mask.shape, dtype=torch.float64)
    for pad in lead.unique().tolist():
        rows = (lead == pad).nonzero().flatten()
        out[rows] = score_sq_norms(model, r.input_ids[rows, pad:], r.mask[rows])
    return out


def estimator_advantages(
    r: Rollout, labels: list[str], energy: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """label -> (B, T) advantages from `otbrl.compute_advantages`."""
    out = {}
    for label in labels:
        name, options, source = SETTINGS[label]
        out[label] = otbrl.compute_advantages(
            name,
            rewards=r.rewards,
            mask=r.mask,
            group_ids=r.group_ids,
            energy=energy[source] if source else None,
            **options,
        ).advantages
    return out


def policy_gradients(
    model: torch.nn.Module, logp: torch.Tensor, advantages: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """label -> flat g = (1/B) sum_i sum_t A_it grad log pi(y_it): one backward per estimator through the
    one forward graph of `logp` (B, T)."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = {}
    for i, (label, adv) in enumerate(advantages.items()):
        loss = (adv.to(logp.dtype) * logp).sum() / logp.shape[0]
        grads = torch.autograd.grad(loss, params, retain_graph=i < len(advantages) - 1)
        out[label] = torch.cat([g.reshape(-1) for g in grads])
    return out


# ----------------------------------------------------------------------------------------------------
# Statistics from Gram matrices: every quantity is a function of g_k . g_l and g_k . g_ref, so subsets
# (the exact batches, jackknife leave-one-outs) cost nothing once the Gram matrix is known.


def trace_cov(gram: torch.Tensor, idx: list[int]) -> float:
    """Unbiased trace of the covariance of the gradients idx:
    (sum ||g_k||^2 - ||sum g_k||^2 / K) / (K - 1)."""
    sub = gram[idx][:, idx]
    k = len(idx)
    return ((sub.diagonal().sum() - sub.sum() / k) / (k - 1)).item()


def jackknife_se(stat: Callable[[list[int]], float], idx: list[int]) -> float:
    """Delete-one jackknife standard error of stat over the batches idx."""
    k = len(idx)
    if k < 3:
        return math.nan
    loo = torch.tensor([stat(idx[:j] + idx[j + 1 :]) for j in range(k)], dtype=torch.float64)
    return math.sqrt((k - 1) / k * (loo - loo.mean()).square().sum().item())


def gradient_stats(gram: torch.Tensor, dots: torch.Tensor, ref_sq: float, idx: list[int]) -> dict[str, float]:
    """Relative variance (with jackknife SE), relative MSE, noise-to-signal and cosine of the gradients idx,
    given their Gram matrix, their dot products with g_ref and ||g_ref||^2."""
    k, sub, d = len(idx), gram[idx][:, idx], dots[idx]
    var = trace_cov(gram, idx)
    mean_sq = (sub.sum() / k**2).item()  # ||mean g||^2
    signal = mean_sq - var / k  # unbiased ||E g||^2
    return {
        "rel_var": var / ref_sq,
        "rel_var_se": jackknife_se(lambda s: trace_cov(gram, s), idx) / ref_sq,
        "rel_mse": ((sub.diagonal() - 2 * d + ref_sq).mean() / ref_sq).item(),
        "nsr": var / signal if signal > 0 else math.inf,
        "cosine": d.mean().item() / math.sqrt(mean_sq * ref_sq),
        "k": k,
    }


def variance_ratio(gram_a: torch.Tensor, gram_b: torch.Tensor, idx: list[int]) -> tuple[float, float]:
    """trace Cov(a) / trace Cov(b) on the same batches idx, and its jackknife SE (paired: the batch-to-batch
    luck that the two share cancels)."""

    def ratio(s: list[int]) -> float:
        return trace_cov(gram_a, s) / trace_cov(gram_b, s)

    return ratio(idx), jackknife_se(ratio, idx)


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    return (x @ y / (x.norm() * y.norm())).item()


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Rank correlation (ties broken by order: the energies are continuous)."""
    return pearson(x.argsort().argsort(), y.argsort().argsort())


def correlations(
    proxy: torch.Tensor, exact: torch.Tensor, mask: torch.Tensor, groups: torch.Tensor
) -> dict[str, tuple[float, float, float, int]]:
    """Proxy vs exact: (Pearson, Pearson of the logs, Spearman, count) per policy token; per sequence for
    W_T (sum over the sequence); and for W_T relative to its group's mean (OTB's baseline only compares
    energies within a group). The norms span orders of magnitude, so the linear Pearson is dominated by
    the largest few; the log and rank versions describe the bulk."""

    def stats(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float, int]:
        tiny = 1e-30  # a zero energy (mask edge cases) must not give log(0)
        return (
            pearson(x, y),
            pearson(x.clamp_min(tiny).log(), y.clamp_min(tiny).log()),
            spearman(x, y),
            len(x),
        )

    keep = mask.bool()
    w_seq, e_seq = proxy.double().sum(-1), exact.sum(-1)

    def within(x: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(int(groups.max()) + 1, dtype=x.dtype).index_add_(0, groups, x)
        count = torch.bincount(groups).to(x.dtype)
        return x / (total / count)[groups]

    return {
        "token": stats(proxy[keep], exact[keep]),
        "sequence": stats(w_seq, e_seq),
        "within_group": stats(within(w_seq), within(e_seq)),
    }


# ----------------------------------------------------------------------------------------------------
# The study.


def run_study(cfg: Config, log: Callable[[str], Any] = print, progress: bool = True) -> dict[str, Any]:
    """Run the whole measurement; returns the numbers the report and the plot are made from."""
    from tqdm.auto import tqdm

    from otbrl.tasks import dataset, get_task, warm_start

    unknown = sorted(set(cfg.estimators) - set(SETTINGS))
    if unknown:
        raise ValueError(f"estimators: unknown {unknown}; known: {', '.join(SETTINGS)}")
    if cfg.k < 3 or cfg.ref_batches < 2 or cfg.prompts < 1 or min(cfg.group_sizes) < 2:
        raise ValueError("need k >= 3, ref_batches >= 2, prompts >= 1 and group sizes >= 2")
    start = time.perf_counter()
    task = get_task(cfg.task)
    model, tokenizer, info = warm_start(cfg.task, cfg.preset, log=log)
    # vmap (in the exact norms) has no batching rule for the CPU flash-attention backward; eager is the
    # same function and ~1.4x faster there.
    model.set_attn_implementation("eager")
    n_exact = min(cfg.exact_batches, cfg.k)
    batches = cfg.ref_batches + cfg.k * len(cfg.group_sizes)
    pool = iter(dataset(task, cfg.prompts * batches, seed=cfg.seed))  # every batch gets fresh prompts
    gen = torch.Generator().manual_seed(cfg.seed)
    seconds = {"sampling": 0.0, "gradients": 0.0, "exact norms": 0.0}

    def next_batch(n: int) -> Rollout:
        t = time.perf_counter()
        r = draw(model, tokenizer, task, [next(pool) for _ in range(cfg.prompts)], n, gen)
        seconds["sampling"] += time.perf_counter() - t
        return r

    bar = tqdm(total=batches, desc="variance", disable=not progress, dynamic_ncols=True)
    # Reference gradient.
    chunks = []
    for _ in range(cfg.ref_batches):
        bar.set_postfix_str(f"reference N={REFERENCE_GROUP_SIZE}")
        r = next_batch(REFERENCE_GROUP_SIZE)
        t = time.perf_counter()
        logp, _ = token_logprobs(model, r)
        adv = estimator_advantages(r, [REFERENCE_ESTIMATOR], {})
        chunks.append(policy_gradients(model, logp, adv)[REFERENCE_ESTIMATOR].double())
        seconds["gradients"] += time.perf_counter() - t
        bar.update()
    stack = torch.stack(chunks)
    ref = stack.mean(0)
    ref_sq = ref.square().sum().item()
    ref_noise = stack.var(0).sum().item() / len(chunks) / ref_sq  # E||g_ref - grad||^2 / ||g_ref||^2
    del chunks, stack

    per_n, tokens = {}, {"proxy": [], "exact": [], "mask": [], "groups": []}
    for n in cfg.group_sizes:
        grads: dict[str, list[torch.Tensor]] = {label: [] for label in cfg.estimators}
        rewards, lengths = [], []
        for k in range(cfg.k):
            bar.set_postfix_str(f"N={n} batch {k + 1}/{cfg.k}" + (" +exact" if k < n_exact else ""))
            r = next_batch(n)
            rewards.append(r.rewards.mean().item())
            lengths.append(r.mask.sum(-1).double().mean().item())
            labels = [e for e in cfg.estimators if SETTINGS[e][2] != "exact" or k < n_exact]
            t = time.perf_counter()
            logp, proxy = token_logprobs(model, r)
            # The teacher-forced pass must reproduce what was sampled (catches misaligned columns).
            torch.testing.assert_close(logp.detach().float(), r.logprobs, atol=1e-3, rtol=0)
            energy = {"proxy": proxy}
            seconds["gradients"] += time.perf_counter() - t
            if k < n_exact:
                t = time.perf_counter()
                energy["exact"] = exact_energy(model, r)
                seconds["exact norms"] += time.perf_counter() - t
                for key, value in (("proxy", proxy), ("exact", energy["exact"]), ("mask", r.mask)):
                    tokens[key].append(value.detach().cpu())
                tokens["groups"].append(r.group_ids + cfg.prompts * len(tokens["groups"]))  # distinct ids
            t = time.perf_counter()
            for label, g in policy_gradients(model, logp, estimator_advantages(r, labels, energy)).items():
                grads[label].append(g.detach())
            seconds["gradients"] += time.perf_counter() - t
            bar.update()
        stats, grams = {}, {}
        for label, gs in grads.items():
            g64 = torch.stack(gs).double()
            grams[label] = g64 @ g64.T
            stats[label] = gradient_stats(grams[label], g64 @ ref, ref_sq, list(range(len(gs))))
        del grads
        ratios = {}
        for a, b in RATIOS:
            if a in grams and b in grams:
                idx = list(range(min(len(grams[a]), len(grams[b]))))
                ratios[f"{a} / {b}"] = (*variance_ratio(grams[a], grams[b], idx), len(idx))
        per_n[n] = {
            "stats": stats,
            "ratios": ratios,
            "reward": sum(rewards) / len(rewards),
            "length": sum(lengths) / len(lengths),
        }
    bar.close()

    corr, scatter = {}, {}
    if tokens["mask"]:
        width = max(m.shape[1] for m in tokens["mask"])

        def cat(key: str) -> torch.Tensor:  # rows of different widths: pad with zeros (mask 0)
            return torch.cat([torch.nn.functional.pad(x, (0, width - x.shape[1])) for x in tokens[key]])

        proxy, exact, mask = cat("proxy").double(), cat("exact"), cat("mask")
        corr = correlations(proxy, exact, mask, torch.cat(tokens["groups"]))
        keep = mask.bool()
        scatter = {"token": (proxy[keep], exact[keep]), "sequence": (proxy.sum(-1), exact.sum(-1))}
    return {
        "config": asdict(cfg),
        "checkpoint": {k: info.get(k) for k in ("task", "preset", "reward", "steps")},
        "params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "ref": {"noise": ref_noise, "rows": cfg.ref_batches * cfg.prompts * REFERENCE_GROUP_SIZE},
        "per_n": per_n,
        "correlations": corr,
        "scatter": scatter,
        "seconds": {**seconds, "total": time.perf_counter() - start},
        "threads": torch.get_num_threads(),
    }


# ----------------------------------------------------------------------------------------------------
# Report.


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


def command(cfg: Config) -> str:
    """The command line that regenerates these results."""
    parts = ["otbrl variance", f"--task {cfg.task}", f"--k {cfg.k}", f"--prompts {cfg.prompts}"]
    parts += [
        f"--group-sizes {','.join(map(str, cfg.group_sizes))}",
        f"--estimators {','.join(cfg.estimators)}",
    ]
    parts += [
        f"--exact-batches {cfg.exact_batches}",
        f"--ref-batches {cfg.ref_batches}",
        f"--seed {cfg.seed}",
    ]
    return " ".join(parts)


def reading_notes(cfg: Config) -> str:
    """How to read the N dependence and the small-K rows (no numbers: those come from the tables)."""
    return (
        f"Reading the N dependence: with {cfg.prompts} prompts per batch the variance is roughly a + b/N, "
        "where a is the spread of the per-prompt expected gradients (no baseline removes it) and b/N the "
        "within-group noise that baselines reduce. Where a dominates, every curve flattens and the ratios "
        'drift toward 1 as N grows; "needs N > ..." means the group mean does not reach OTB\'s level '
        f"anywhere in the measured range. The otb_exact rows rest on {min(cfg.exact_batches, cfg.k)} "
        "batches per N: their noise-to-signal and cosine are not comparable with the other rows. Exact "
        "score norms span many orders of magnitude (see the scatter), so a few batches carry much of each "
        "variance estimate and the jackknife errors are rough."
    )


def report(res: dict[str, Any]) -> str:
    cfg = Config(**{**res["config"], "estimators": tuple(res["config"]["estimators"])})
    ns = list(res["per_n"])
    est = list(cfg.estimators)

    def cell(n: int, e: str, key: str) -> str:
        s = res["per_n"][n]["stats"].get(e)
        if s is None:
            return "-"
        if key == "rel_var":
            return f"{s['rel_var']:.3f} ± {s['rel_var_se']:.3f}"
        return f"{s[key]:.3f}"

    def metric_table(key: str) -> str:
        return markdown_table(
            ["estimator", *(f"N={n}" for n in ns)], [[e, *(cell(n, e, key) for n in ns)] for e in est]
        )

    ratio_names = list(res["per_n"][ns[0]]["ratios"])
    ratio_rows = [
        [f"N={n}"]
        + [
            "{:.3f} ± {:.3f} (K={})".format(*res["per_n"][n]["ratios"][r])
            if r in res["per_n"][n]["ratios"]
            else "-"
            for r in ratio_names
        ]
        for n in ns
    ]
    sec = res["seconds"]
    smallest = min(s["rel_var"] for n in ns for s in res["per_n"][n]["stats"].values())
    lines = [
        "# Gradient variance of advantage estimators at a fixed checkpoint",
        "",
        f"Machine: {machine(res['threads'])}.",
        "",
        f"Regenerate (from the repo root): `{command(cfg)}`"
        + ("  (this is a `--quick` run)" if cfg.quick else ""),
        "",
        f"Wall time {sec['total'] / 60:.1f} min: sampling {sec['sampling']:.0f} s, forward + backward "
        f"{sec['gradients']:.0f} s, exact score norms {sec['exact norms']:.0f} s.",
        "",
        "## Method",
        "",
        f"Policy: the warm-started `{cfg.task}` / `{cfg.preset}` checkpoint ({res['params']:,} parameters, "
        f"sampled reward {res['checkpoint']['reward']:.2f} when it was saved), temperature 1, never trained "
        f"here. A batch is {cfg.prompts} fresh prompts x N samples (B rows); its gradient estimate is "
        "g = (1/B) Σ_i Σ_t A_it ∇θ log π(y_it): the sequence sum divided by the number of samples, for every "
        "estimator, so with an unbiased baseline (rloo, otb_loo) g is an unbiased estimate of ∇E[R]. grpo "
        "keeps its std normalisation; dr_grpo (the group mean), opo, sob and otb use self-inclusive "
        "baselines (biased by O(1/N)). Every estimator sees the same samples: each batch is drawn once per "
        f"N and K = {cfg.k} independent batches are drawn per N.",
        "",
        f"Reference: {cfg.ref_batches} chunks of {cfg.prompts} prompts x {REFERENCE_GROUP_SIZE} samples "
        f"({res['ref']['rows']:,} rows) with rloo, averaged. Its own noise, estimated from the spread of the "
        f"chunks, is E||g_ref - ∇E[R]||² / ||g_ref||² = **{res['ref']['noise']:.4f}**, "
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
        f"{min(cfg.exact_batches, cfg.k)} of the K batches at each N only (its rows use that K); the "
        "otb / otb_exact ratio is taken on those same batches.",
        "",
        "## Relative variance (± SE)",
        "",
        metric_table("rel_var"),
        "",
        "## Relative MSE against the reference",
        "",
        metric_table("rel_mse"),
        "",
        "## Noise-to-signal (scale-free)",
        "",
        metric_table("nsr"),
        "",
        "## Cosine of the mean gradient with the reference",
        "",
        metric_table("cosine"),
        "",
        "## Headline: variance ratios at equal N (paired, same batches; ± jackknife SE)",
        "",
        markdown_table(["N", *ratio_names], ratio_rows),
        "",
    ]
    stats = {n: res["per_n"][n]["stats"] for n in ns}
    if "otb" in est and GROUP_MEAN in est:
        curve = {n: stats[n][GROUP_MEAN]["rel_var"] for n in ns}
        verdict = []
        for n in ns:
            ratio = res["per_n"][n]["ratios"][f"otb / {GROUP_MEAN}"][0]
            match = matching_group_size(curve, stats[n]["otb"]["rel_var"])
            verdict.append(
                f"- At N={n}, OTB's gradient variance is {ratio:.2f}x the group mean's; the group mean "
                f"needs N {match} to match it."
            )
        lines += ["What the numbers say:", "", *verdict, "", reading_notes(cfg), ""]
    corr = res["correlations"]
    if corr:
        lines += [
            "## Proxy vs exact score norms",
            "",
            "On the batches with exact norms (all N pooled). The proxy w_t = ||e_y - π_t||² is the "
            "logit-space part of ||∇θ log π(y_t)||²; the rest (the hidden state's norm, deeper layers) is "
            "what it ignores.",
            "",
            markdown_table(
                ["level", "Pearson", "Pearson of logs", "Spearman", "count"],
                [
                    [name, f"{p:.3f}", f"{lp:.3f}", f"{s:.3f}", str(c)]
                    for name, (p, lp, s, c) in (
                        ("token w_t", corr["token"]),
                        ("sequence W_T", corr["sequence"]),
                        ("W_T / group mean", corr["within_group"]),
                    )
                ],
            ),
            "",
        ]
    lines += [
        "Mean reward and completion length per N: "
        + ", ".join(f"N={n}: {res['per_n'][n]['reward']:.3f}, {res['per_n'][n]['length']:.1f}" for n in ns)
        + ".",
        "",
        "![relative variance vs N, and proxy vs exact](variance.png)",
        "",
    ]
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    ns = list(res["per_n"])
    panels = 3 if res["scatter"] else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.4), squeeze=False)
    ax = axes[0, 0]
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
    corr = res["correlations"]
    for ax, key, label in zip(
        axes[0, 1:], ("token", "sequence"), ("token w_t", "sequence W_T"), strict=False
    ):
        proxy, exact = res["scatter"][key]
        if len(proxy) > 20000:  # keep the PNG small; a fixed subsample
            keep = torch.randperm(len(proxy), generator=torch.Generator().manual_seed(0))[:20000]
            proxy, exact = proxy[keep], exact[keep]
        ax.scatter(proxy.clamp_min(1e-12), exact.clamp_min(1e-12), s=2, alpha=0.25)
        ax.set(xscale="log", yscale="log", xlabel=f"proxy {label}", ylabel="exact ||∇θ log π||² (sum)")
        p, lp, s, _ = corr[key]
        ax.set_title(f"{label}: Pearson {p:.2f} (logs {lp:.2f}), Spearman {s:.2f}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legend sits below the first panel
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------
# Command line (otbrl.app.cli adds these arguments to its `variance` subcommand).


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = Config()
    parser.add_argument("--quick", action="store_true", help="a <= 2 minute smoke run (N=4,8, small K)")
    parser.add_argument(
        "--out", type=Path, help="output folder (default docs/results, or a temp dir with --quick)"
    )
    parser.add_argument("--task", default=d.task, help=f"built-in task (default {d.task})")
    parser.add_argument("--preset", default=d.preset, help=f"model preset (default {d.preset})")
    parser.add_argument("--k", type=int, help=f"independent batches per N (default {d.k})")
    parser.add_argument("--prompts", type=int, help=f"prompts per batch (default {d.prompts})")
    parser.add_argument("--group-sizes", help="comma-separated N values (default 4,8,16,32)")
    parser.add_argument("--estimators", help=f"comma-separated, from {','.join(SETTINGS)} (default all)")
    parser.add_argument(
        "--exact-batches", type=int, help=f"batches per N with exact norms (default {d.exact_batches})"
    )
    parser.add_argument(
        "--ref-batches", type=int, help=f"chunks of the reference gradient (default {d.ref_batches})"
    )
    parser.add_argument("--seed", type=int, default=d.seed)


def config_from_args(args: argparse.Namespace) -> Config:
    """Defaults, then the --quick settings, then whatever was given explicitly."""
    cfg = replace(
        Config(), **(QUICK if args.quick else {}), quick=args.quick, task=args.task, preset=args.preset
    )
    given = {
        "k": args.k,
        "prompts": args.prompts,
        "exact_batches": args.exact_batches,
        "ref_batches": args.ref_batches,
        "group_sizes": tuple(int(x) for x in args.group_sizes.split(",")) if args.group_sizes else None,
        "estimators": tuple(x.strip() for x in args.estimators.split(",")) if args.estimators else None,
    }
    return replace(cfg, seed=args.seed, **{k: v for k, v in given.items() if v is not None})


def main(args: argparse.Namespace) -> Path:
    """Run the study and write variance.md and variance.png; returns the markdown path."""
    cfg = config_from_args(args)
    out = args.out or (Path(tempfile.gettempdir()) / "otbrl-variance" if cfg.quick else Path("docs/results"))
    res = run_study(cfg)
    text = report(res)
    out.mkdir(parents=True, exist_ok=True)
    (out / "variance.md").write_text(text)
    # The numbers behind the page (everything but the scatter tensors), for otbrl claims and readers.
    numbers = {k: v for k, v in res.items() if k != "scatter"}
    numbers["per_n"] = {str(n): block for n, block in res["per_n"].items()}
    (out / "variance.json").write_text(json.dumps(numbers, indent=1, default=float))
    plot(res, out / "variance.png")
    print(text)
    print(f"wrote {out / 'variance.md'}, .json and .png")
    return out / "variance.md"
