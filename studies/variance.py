"""`python -m studies variance`: how noisy is each advantage estimator's policy gradient at one fixed
checkpoint, and how well does the Logit-Gradient Proxy track the exact per-token score norms it stands in for?

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
- Headline: the paired noise-to-signal ratio NSR(a) / NSR(b) of two estimators on the same batches, with a
  95% interval (delete-one jackknife SE of its log, Student t at K - 1 df). The raw variance ratio is not
  the headline: a self-inclusive baseline shrinks the advantages, lowering variance and signal alike.
- Over the K estimates g_k: relative variance trace Cov(g_k) / ||g_ref||^2 (unbiased, K - 1); relative MSE
  mean_k ||g_k - g_ref||^2 / ||g_ref||^2 (includes the reference's own noise); noise-to-signal
  trace Cov / ||E g||^2 with ||E g||^2 estimated without bias as ||mean g||^2 - trace Cov / K (scale-free:
  rloo and the group mean differ by the factor N / (N - 1)); cosine(mean g_k, g_ref). Same definitions
  (`gradstats`) as `studies.toy.gradient_study`, except that the noise-to-signal ratio is
  debiased for the small K here.
  Standard errors of variances and their ratios are delete-one jackknife over batches.
- otb_exact uses exact ||grad_theta log pi(y_t)||^2 (`otbrl.exact`, one backward per token), so it runs on
  the first `exact_batches` batches of each N only; its ratio to the proxy OTB is taken on those batches.
  The same batches give the proxy-vs-exact correlations (per token, and per sequence for W_T).

This module is the study's batch mechanics (sampled completions, their teacher-forced log-probs with
autograd graph, energies from the proxy or exact score norms, each estimator's policy-gradient estimate, one
backward pass apiece), its design (estimators, reference, defaults), its loop and its command line; the
statistics are in `gradstats`, the page in `variance_page`, the verdicts in `claims`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

import otbrl
from otbrl.energy import token_energy
from otbrl.exact import score_sq_norms
from otbrl.lm import positions, predicting
from otbrl.rollout import Samples, sample
from otbrl.stability import group_horizons
from otbrl.tasks import dataset, get_task, warm_start
from otbrl.tasks.warmstart import SHIPPED, default_cache_dir
from studies.gradstats import gradient_stats, nsr_ratio, pooled_correlations, variance_ratio
from studies.plots import plot_variance
from studies.variance_page import GROUP_MEAN, ratio_name, report

# label -> (registered estimator, its options, which energy it reads: None, "proxy" or "exact")
Setting = tuple[str, dict[str, Any], str | None]


def draw(model: Any, tokenizer: Any, task: Any, rows: list[dict], n: int, gen: torch.Generator) -> Samples:
    """Sample n completions of each row's prompt at temperature 1 and score them."""
    s = sample(
        model, tokenizer, [r["prompt"] for r in rows], n, task.max_completion_tokens, 1.0, generator=gen
    )
    rewards = [
        task.reward(text, rows[g]["answer"]) for text, g in zip(s.texts, s.group_ids.tolist(), strict=True)
    ]
    return replace(s, rewards=torch.tensor(rewards))


@dataclass
class Bench:
    """What every batch is drawn with: the policy, a pool of fresh prompts, one sampling generator; and
    the seconds spent per phase."""

    model: Any
    tokenizer: Any
    task: Any
    pool: Iterator[dict]
    gen: torch.Generator
    prompts: int
    seconds: dict[str, float] = field(
        default_factory=lambda: {"sampling": 0.0, "gradients": 0.0, "exact norms": 0.0}
    )

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[phase] += time.perf_counter() - start

    def batch(self, n: int) -> Samples:
        with self.timed("sampling"):
            return draw(
                self.model,
                self.tokenizer,
                self.task,
                [next(self.pool) for _ in range(self.prompts)],
                n,
                self.gen,
            )


def token_logprobs(model: torch.nn.Module, r: Samples) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) log pi(y_t) of the policy tokens, with autograd graph, and their proxy energy w_t (no graph);
    both 0 where mask == 0. Positions skip the left padding, as in the sampler."""
    width = r.mask.shape[1]
    attention = r.attention_mask
    out = model(input_ids=r.input_ids, attention_mask=attention, position_ids=positions(attention))
    logits = predicting(out.logits, width)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    tokens = r.input_ids[:, -width:]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    keep = r.mask.bool()
    return torch.where(keep, logp, 0.0), torch.where(keep, token_energy(logits.detach(), tokens), 0.0)


def exact_energy(model: torch.nn.Module, r: Samples) -> torch.Tensor:
    """(B, T) float64 exact ||grad_theta log pi(y_t)||^2. score_sq_norms runs the model without an
    attention mask, so rows are grouped by their left padding and called with it cut off."""
    lead = (r.attention_mask.cumsum(-1) == 0).sum(-1)
    out = torch.zeros(r.mask.shape, dtype=torch.float64)
    for pad in lead.unique().tolist():
        rows = (lead == pad).nonzero().flatten()
        out[rows] = score_sq_norms(model, r.input_ids[rows, pad:], r.mask[rows])
    return out


def estimator_advantages(
    r: Samples, settings: dict[str, Setting], energy: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """label -> (B, T) advantages from `otbrl.compute_advantages`, one per setting; `energy` maps the
    settings' energy sources ("proxy", "exact") to (B, T) energies."""
    out = {}
    for label, (name, options, source) in settings.items():
        out[label] = otbrl.compute_advantages(
            name,
            rewards=r.rewards,
            mask=r.mask,
            group_ids=r.group_ids,
            energy=energy[source] if source else None,
            **options,
        ).advantages
    return out


def position_buckets(mask: torch.Tensor, late_from: int) -> dict[str, torch.Tensor]:
    """(B, T) 0/1 masks of a response's policy tokens by their index k along it (0-based, counting policy
    tokens only, so tool output moves no token into a later bucket): "early" k < late_from, "late" the
    rest. They partition the policy tokens: the advantages times each mask give gradients that add up to
    the whole one (g is linear in A)."""
    if late_from < 1:
        raise ValueError(f"late_from: must be >= 1, got {late_from}")
    policy = mask.bool()
    k = policy.long().cumsum(-1) - 1
    return {
        "early": (policy & (k < late_from)).to(mask.dtype),
        "late": (policy & (k >= late_from)).to(mask.dtype),
    }


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


SETTINGS: dict[str, Setting] = {
    "grpo": ("grpo", {}, None),
    "dr_grpo": ("dr_grpo", {}, None),
    "rloo": ("rloo", {}, None),
    "opo": ("opo", {}, None),
    "sob": ("sob", {}, "proxy"),
    "otb": ("otb", {}, "proxy"),
    "otb_loo": ("otb", {"leave_one_out": True}, "proxy"),
    "otb_exact": ("otb_exact", {}, "exact"),
}
RATIOS = (("otb", GROUP_MEAN), ("otb_loo", "rloo"), ("otb", "otb_exact"))  # paired ratios (NSR, variance)
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
    name: str = "variance"  # the pages' file stem: NAME.md, NAME.json, NAME.png


QUICK = {"group_sizes": (4, 8), "k": 5, "prompts": 6, "exact_batches": 3, "ref_batches": 4}


def check(cfg: Config) -> None:
    unknown = sorted(set(cfg.estimators) - set(SETTINGS))
    if unknown:
        raise ValueError(f"estimators: unknown {unknown}; known: {', '.join(SETTINGS)}")
    if cfg.k < 3 or cfg.ref_batches < 2 or cfg.prompts < 1 or min(cfg.group_sizes) < 2:
        raise ValueError("need k >= 3, ref_batches >= 2, prompts >= 1 and group sizes >= 2")
    if "otb_exact" in cfg.estimators and cfg.exact_batches < 3:  # a variance needs 2, an interval 3
        raise ValueError("otb_exact needs --exact-batches >= 3")


def load_checkpoint(task: str, preset: str, log: Callable[[str], Any]) -> tuple[Any, Any, dict[str, Any]]:
    """The warm start that ships with otbrl (or sits in the cache), never a new one: building one takes up
    to 35 minutes and would not be the policy the pages describe."""
    stored = [d for root in (default_cache_dir(), SHIPPED) for d in root.glob(f"{task}-{preset}-*")]
    if not any((d / "info.json").is_file() for d in stored):
        raise ValueError(
            f"no shipped or cached warm start for {task}/{preset} under {SHIPPED}; build one first with "
            f"`python -m otbrl.tasks.warmstart {task}`"
        )
    model, tokenizer, info = warm_start(task, preset, log=log)
    if not info.get("cached"):  # only reachable if the stored one was made with other settings
        raise ValueError(f"warm start for {task}/{preset} was rebuilt instead of loaded")
    return model, tokenizer, info


def reference_gradient(bench: Bench, chunks: int, bar: Any) -> tuple[torch.Tensor, float]:
    """(g_ref (D,) float64, its own relative noise E||g_ref - grad||^2 / ||g_ref||^2) from `chunks`
    batches of N = REFERENCE_GROUP_SIZE with the unbiased REFERENCE_ESTIMATOR, averaged."""
    grads = []
    for _ in range(chunks):
        bar.set_postfix_str(f"reference N={REFERENCE_GROUP_SIZE}")
        r = bench.batch(REFERENCE_GROUP_SIZE)
        with bench.timed("gradients"):
            logp, _ = token_logprobs(bench.model, r)
            adv = estimator_advantages(r, {REFERENCE_ESTIMATOR: SETTINGS[REFERENCE_ESTIMATOR]}, {})
            grads.append(policy_gradients(bench.model, logp, adv)[REFERENCE_ESTIMATOR].double())
        bar.update()
    stack = torch.stack(grads)
    ref = stack.mean(0)
    return ref, stack.var(0).sum().item() / chunks / ref.square().sum().item()


def measure_group_size(
    bench: Bench, cfg: Config, n: int, ref: torch.Tensor, tokens: dict[str, list], bar: Any
) -> dict[str, Any]:
    """K batches at group size n: every estimator's gradient statistics and the headline ratios. The
    first exact_batches also get exact norms; their energies are added to `tokens` for the correlations."""
    n_exact = min(cfg.exact_batches, cfg.k)
    grads: dict[str, list[torch.Tensor]] = {label: [] for label in cfg.estimators}
    rewards, lengths, horizons = [], [], []
    for k in range(cfg.k):
        bar.set_postfix_str(f"N={n} batch {k + 1}/{cfg.k}" + (" +exact" if k < n_exact else ""))
        r = bench.batch(n)
        rewards.append(r.rewards.mean().item())
        lengths.append(r.mask.sum(-1).double().mean().item())
        with bench.timed("gradients"):
            logp, proxy = token_logprobs(bench.model, r)
            # The teacher-forced pass must reproduce what was sampled (catches misaligned columns).
            torch.testing.assert_close(logp.detach().float(), r.logprobs, atol=1e-3, rtol=0)
        energy = {"proxy": proxy}
        horizons.append(group_horizons(r.mask, proxy.detach(), r.rewards, r.group_ids))
        if k < n_exact:
            with bench.timed("exact norms"):
                energy["exact"] = exact_energy(bench.model, r)
            for key, value in (("proxy", proxy), ("exact", energy["exact"]), ("mask", r.mask)):
                tokens[key].append(value.detach().cpu())
            tokens["groups"].append(r.group_ids + cfg.prompts * len(tokens["groups"]))  # distinct ids
        settings = {e: SETTINGS[e] for e in cfg.estimators if SETTINGS[e][2] != "exact" or k < n_exact}
        with bench.timed("gradients"):
            advantages = estimator_advantages(r, settings, energy)
            for label, g in policy_gradients(bench.model, logp, advantages).items():
                grads[label].append(g.detach())
        bar.update()
    stats, grams = {}, {}
    ref_sq = ref.square().sum().item()
    for label, gs in grads.items():
        g64 = torch.stack(gs).double()
        grams[label] = g64 @ g64.T
        stats[label] = gradient_stats(grams[label], g64 @ ref, ref_sq, list(range(len(gs))))
    ratios, nsr_ratios = {}, {}
    for a, b in RATIOS:
        if a in grams and b in grams:
            idx = list(range(min(len(grams[a]), len(grams[b]))))  # the batches both have: paired
            ratios[ratio_name(a, b)] = (*variance_ratio(grams[a], grams[b], idx), len(idx))
            nsr_ratios[ratio_name(a, b)] = asdict(nsr_ratio(grams[a], grams[b], idx))
    return {
        "stats": stats,
        "nsr_ratios": nsr_ratios,
        "ratios": ratios,
        "reward": sum(rewards) / len(rewards),
        "length": sum(lengths) / len(lengths),
        # how the samples of one prompt differ (the setting OTB's per-token weights act in), averaged over
        # the K batches: length_cv, energy_cv, reward_spread, energy_reward_corr (stability.group_horizons)
        "horizon": {
            key.removeprefix("horizon/"): sum(h[key] for h in horizons) / len(horizons) for key in horizons[0]
        },
    }


def run_study(cfg: Config, log: Callable[[str], Any] = print, progress: bool = True) -> dict[str, Any]:
    """Run the whole measurement; returns the numbers the report and the plot are made from."""
    check(cfg)
    start = time.perf_counter()
    task = get_task(cfg.task)  # its own token budget (max_completion_tokens) bounds every sample
    model, tokenizer, info = load_checkpoint(cfg.task, cfg.preset, log)
    # vmap (in the exact norms) has no batching rule for the CPU flash-attention backward; eager is the
    # same function and ~1.4x faster there.
    model.set_attn_implementation("eager")
    batches = cfg.ref_batches + cfg.k * len(cfg.group_sizes)
    pool = iter(dataset(task, cfg.prompts * batches, seed=cfg.seed))  # every batch gets fresh prompts
    bench = Bench(model, tokenizer, task, pool, torch.Generator().manual_seed(cfg.seed), cfg.prompts)
    bar = tqdm(total=batches, desc="variance", disable=not progress, dynamic_ncols=True)
    ref, ref_noise = reference_gradient(bench, cfg.ref_batches, bar)
    tokens: dict[str, list] = {"proxy": [], "exact": [], "mask": [], "groups": []}
    per_n = {n: measure_group_size(bench, cfg, n, ref, tokens, bar) for n in cfg.group_sizes}
    bar.close()
    corr, scatter = pooled_correlations(tokens)
    return {
        "config": asdict(cfg),
        "checkpoint": {k: info.get(k) for k in ("task", "preset", "reward", "steps")},
        "budget": task.max_completion_tokens,
        "params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "ref": {"noise": ref_noise, "rows": cfg.ref_batches * cfg.prompts * REFERENCE_GROUP_SIZE},
        "per_n": per_n,
        "correlations": corr,
        "scatter": scatter,
        "seconds": {**bench.seconds, "total": time.perf_counter() - start},
        "threads": torch.get_num_threads(),
    }


# ----------------------------------------------------------------------------------------------------
# Command line (otbrl.app.cli adds these arguments to its `variance` subcommand and calls main).


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = Config()
    parser.add_argument("--quick", action="store_true", help="a <= 2 minute smoke run (N=4,8, small K)")
    parser.add_argument(
        "--out", type=Path, help="output folder (default docs/results, or runs/variance-quick with --quick)"
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
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the batches sampled (default 0)")
    parser.add_argument(
        "--name", default=d.name, help=f"file stem of the pages: NAME.md, .json, .png (default {d.name})"
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")


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
    return replace(cfg, seed=args.seed, name=args.name, **{k: v for k, v in given.items() if v is not None})


def check_name(name: str) -> str:
    """A page name is a plain file stem (it becomes NAME.md next to the other results)."""
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ValueError(f"--name: {name!r} is not a plain file stem (letters, digits, '-' and '_')")
    return name


Verdicts = Callable[[dict[str, Any]], list[tuple[str, ...]]]


def write_pages(res: dict[str, Any], out: Path, verdicts: Verdicts) -> Path:
    """NAME.md, NAME.json and NAME.png under out (NAME: res["config"]["name"]); returns the markdown path.
    `verdicts(res)`: the claims rows the page heads with (the caller's rules: the measurement does not
    depend on the verdict page)."""
    name = check_name(res["config"]["name"])
    text = report(res, GROUP_MEAN, REFERENCE_GROUP_SIZE, verdicts(res))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text)
    # The numbers behind the page (everything but the scatter tensors), for `studies claims` and readers.
    numbers = {k: v for k, v in res.items() if k != "scatter"}
    numbers["per_n"] = {str(n): block for n, block in res["per_n"].items()}
    (out / f"{name}.json").write_text(json.dumps(numbers, indent=1, default=float))
    plot_variance(res, out / f"{name}.png")
    return out / f"{name}.md"


def main(args: argparse.Namespace, verdicts: Verdicts) -> Path:
    """Run the study and write NAME.md, NAME.json and NAME.png (NAME: --name, default variance); returns
    the markdown path."""
    cfg = config_from_args(args)
    check_name(cfg.name)  # before the run, not after it
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or (Path("runs/variance-quick") if cfg.quick else Path("docs/results"))
    res = run_study(cfg)
    if not cfg.quick:  # everything the pages are made from, so they can be redrawn without a rerun
        Path("runs").mkdir(exist_ok=True)
        torch.save(res, Path("runs") / f"{cfg.name}-result.pt")
    page = write_pages(res, out, verdicts)
    print(page.read_text())
    print(f"wrote {page}, .json and .png")
    return page
