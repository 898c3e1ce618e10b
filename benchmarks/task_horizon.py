"""Horizon statistics of built-in tasks at their warm starts: how long the sampled completions are, how
much their lengths and energies vary within a prompt group, how energy relates to reward, and how many
groups carry any reward signal at all.

    .venv/bin/python benchmarks/task_horizon.py                  # walk, running_sum16, running_sum48
    .venv/bin/python benchmarks/task_horizon.py --quick          # 8 prompts x 8 samples, temp file
    .venv/bin/python benchmarks/task_horizon.py --tasks walk --prompts 64 --samples 16
    .venv/bin/python benchmarks/task_horizon.py --from-samples docs/results/horizon-samples.json.gz
                                                                 # the page again from the committed samples

Every sampled completion's length, energy, reward and end are kept in `docs/results/horizon-samples.json.gz`
(next to the page), so the page can be rechecked, and rebuilt, without sampling again.

Each task's shipped (or cached) warm start (`otbrl.tasks.warm_start(task)`, never rebuilt here) samples
`--samples` completions of each of `--prompts` held-out prompts at temperature 1 with the task's own
token budget. Per-token energy is ||e_y - softmax(z)||^2 (`otbrl.token_energy`) from a full forward pass
over prompt + completion; a sequence's energy is its sum over the completion's tokens (eos included).
Within-group CVs are std / mean (population std) per group, averaged over groups.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import machine, markdown_table, read_record, write_record

from otbrl.energy import token_energy
from otbrl.rollout.sampler import sample
from otbrl.tasks import dataset, get_task, warm_start

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
DEFAULT_TASKS = ["walk", "running_sum16", "running_sum48"]
TAIL = 150  # tokens: the long tail the horizon task must reach


@torch.no_grad()
def sequence_energy(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    logprobs: torch.Tensor,
    chunk: int = 64,
) -> torch.Tensor:
    """Total token energy of each completion (B,), from one forward pass over prompt (B, P) left-padded and
    completion (B, T) right-padded, `chunk` rows at a time. The pass's log-probs of the completion must
    match the sampler's `logprobs` (B, T): a check that the energies sit on the right tokens."""
    totals = []
    for rows in torch.arange(prompt_ids.shape[0]).split(chunk):
        ids = torch.cat([prompt_ids[rows], completion_ids[rows]], dim=1)  # (b, P + T)
        mask = torch.cat([prompt_mask[rows], completion_mask[rows]], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: first real token at position 0
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
        # the logits at position t predict token t + 1: completion token j is predicted at P + j - 1
        start = prompt_ids.shape[1] - 1
        pred = logits[:, start : start + completion_ids.shape[1]]  # (b, T, V)
        energy = token_energy(pred, completion_ids[rows])  # (b, T)
        mask = completion_mask[rows].bool()
        logp = torch.log_softmax(pred, -1).gather(-1, completion_ids[rows, :, None]).squeeze(-1)
        if (logp - logprobs[rows]).abs()[mask].max() > 1e-3:
            raise RuntimeError("forward pass and sampler disagree on the completion's log-probs")
        totals.append((energy * completion_mask[rows]).sum(-1).double())
    return torch.cat(totals)


def _cv(values: list[float]) -> float:
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else float("nan")


def _pearson(x: list[float], y: list[float]) -> float:
    """Pearson correlation; nan when either side is constant."""
    if len(x) < 2 or statistics.pstdev(x) == 0 or statistics.pstdev(y) == 0:
        return float("nan")
    return statistics.correlation(x, y)


def _centred(values: list[float], groups: list[list[int]]) -> list[float]:
    """Each value minus its group's mean: what a group baseline sees."""
    out = list(values)
    for g in groups:
        mean = statistics.fmean(values[i] for i in g)
        for i in g:
            out[i] = values[i] - mean
    return out


def horizon_stats(
    task_name: str, prompts: int, samples: int, seed: int = 0, batch_prompts: int = 16
) -> dict[str, Any]:
    """Sample and measure one task at its warm start; returns a dict of the statistics (see module doc)."""
    return stats_from_samples(sample_task(task_name, prompts, samples, seed, batch_prompts))


def sample_task(
    task_name: str, prompts: int, samples: int, seed: int = 0, batch_prompts: int = 16, split: str = "all"
) -> dict[str, Any]:
    """Sample one task at its warm start: every completion's length, energy, reward and whether it ended
    (samples of one prompt are consecutive), with the warm start's facts: what `stats_from_samples` reads."""
    task = get_task(task_name)
    model, tokenizer, info = warm_start(task.name, split=split, log=None)
    if not info.get("cached"):
        raise RuntimeError(f"{task.name}: no shipped or cached warm start (this script never builds one)")
    rows = dataset(task, prompts, seed=20_000 + seed)  # held out from training (0) and warm-start eval
    gen = torch.Generator().manual_seed(seed)
    lengths, energies, rewards, ended = [], [], [], []
    start = time.perf_counter()
    for k in range(0, prompts, batch_prompts):
        part = rows[k : k + batch_prompts]
        s = sample(
            model,
            tokenizer,
            [r["prompt"] for r in part],
            samples,
            task.max_completion_tokens,
            temperature=1.0,
            generator=gen,
        )
        ids = s.completion_ids * s.completion_mask  # pad rows after eos with pad (id 0) for the forward pass
        energies += sequence_energy(
            model, s.prompt_ids, s.prompt_mask, ids, s.completion_mask, s.logprobs
        ).tolist()
        lengths += s.completion_mask.sum(-1).tolist()
        ends_with_eos = (s.completion_ids == tokenizer.eos_token_id) & s.completion_mask.bool()
        ended += ends_with_eos.any(-1).tolist()
        answers = [r["answer"] for r in part for _ in range(samples)]
        rewards += [task.reward(t, a) for t, a in zip(s.texts, answers, strict=True)]
    return {
        "task": task.name,
        "warm start reward": info["reward"],
        "warm start seconds": info["seconds"],
        "warm start steps": info["steps"],
        "budget": task.max_completion_tokens,
        "prompts": prompts,
        "samples": samples,
        "sampling seconds": time.perf_counter() - start,
        "lengths": [int(x) for x in lengths],
        "energies": [float(f"{e:.6g}") for e in energies],
        "rewards": rewards,
        "ended": [bool(e) for e in ended],
    }


def stats_from_samples(raw: dict[str, Any]) -> dict[str, Any]:
    """The page's statistics of one task from its samples (`sample_task`)."""
    prompts, samples = raw["prompts"], raw["samples"]
    lengths, energies, rewards, ended = raw["lengths"], raw["energies"], raw["rewards"], raw["ended"]
    groups = [list(range(g * samples, (g + 1) * samples)) for g in range(prompts)]
    lengths_f = [float(x) for x in lengths]
    ordered = sorted(lengths_f)
    reward_spread = [len({rewards[i] for i in g}) > 1 for g in groups]
    return {
        "task": raw["task"],
        "warm start reward": raw["warm start reward"],
        "warm start seconds": raw["warm start seconds"],
        "warm start steps": raw["warm start steps"],
        "budget": raw["budget"],
        "prompts": prompts,
        "samples": samples,
        "reward": statistics.fmean(rewards),
        "median length": statistics.median(lengths_f),
        "mean length": statistics.fmean(lengths_f),
        "p95 length": ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)],
        "max length": ordered[-1],
        f"share > {TAIL}": sum(x > TAIL for x in lengths_f) / len(lengths_f),
        "share cut off": 1 - sum(ended) / len(ended),
        "length CV (within group)": statistics.fmean(_cv([lengths_f[i] for i in g]) for g in groups),
        "length CV (all)": _cv(lengths_f),
        "energy CV (within group)": statistics.fmean(_cv([energies[i] for i in g]) for g in groups),
        "corr(energy, reward)": _pearson(energies, rewards),
        "corr(energy, reward) within group": _pearson(_centred(energies, groups), _centred(rewards, groups)),
        "corr(length, reward) within group": _pearson(_centred(lengths_f, groups), _centred(rewards, groups)),
        "groups with reward spread": sum(reward_spread) / len(groups),
        "sampling seconds": raw["sampling seconds"],
    }


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def verdict(stats: dict[str, Any]) -> str:
    """The horizon criteria of issue 16 (item 1), checked for one task."""
    checks = {
        "within-group length CV >= 0.3": stats["length CV (within group)"] >= 0.3,
        "median length >= 64": stats["median length"] >= 64,
        f"tail past {TAIL}": stats["max length"] > TAIL,
        "reward spread in most groups (>= 0.5)": stats["groups with reward spread"] >= 0.5,
    }
    return ", ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in checks.items())


def _methods() -> str:
    """The module docstring's paragraphs after the usage block: how the numbers are made."""
    return "\n\n".join(__doc__.split("\n\n")[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=DEFAULT_TASKS)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 prompts x 8 samples; output to a temp file")
    parser.add_argument("--out", type=Path, help="markdown output path (default docs/results/horizon.md)")
    parser.add_argument("--from-samples", type=Path, help="rebuild the page from these committed samples")
    parser.add_argument(
        "--warm-start-split", default="all", choices=("all", "train"), help="train: training-side starts"
    )
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.samples = 8, 8
    out = args.out or (Path(tempfile.gettempdir()) if args.quick else RESULTS) / "horizon.md"
    samples_path = out.with_name(out.stem + "-samples.json.gz")
    threads = torch.get_num_threads()
    if args.from_samples:
        saved = read_record(args.from_samples)
        raws, where = saved["tasks"], saved["machine"]
        for key, value in saved["args"].items():
            setattr(args, key, value)
    else:
        where = machine(threads)
        print(where)
        split = args.warm_start_split
        raws = [sample_task(name, args.prompts, args.samples, args.seed, split=split) for name in args.tasks]
        args_saved = {
            k: getattr(args, k) for k in ("tasks", "prompts", "samples", "seed", "warm_start_split")
        }
        write_record(samples_path, {"machine": where, "args": args_saved, "tasks": raws})
    results = []
    for raw in raws:
        stats = stats_from_samples(raw)
        print(", ".join(f"{k}={_fmt(v)}" for k, v in stats.items()), flush=True)
        results.append(stats)
    keys = [k for k in results[0] if k != "task"]
    table = markdown_table(
        ["statistic", *(r["task"] for r in results)], [[k, *(_fmt(r[k]) for r in results)] for k in keys]
    )
    command = "python benchmarks/task_horizon.py " + " ".join(
        [
            "--tasks",
            *args.tasks,
            "--prompts",
            str(args.prompts),
            "--samples",
            str(args.samples),
            "--seed",
            str(args.seed),
            *(["--warm-start-split", args.warm_start_split] if args.warm_start_split != "all" else []),
        ]
    )
    verdicts = "\n".join(f"- {r['task']}: {verdict(r)}" for r in results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        f"# Horizon statistics at the shipped warm starts\n\nMachine (of the sampling): {where}.\n\n"
        f"Regenerate (from the repo root, `PYTHONPATH=.`): `{command}`; from the committed samples "
        f"(`{samples_path.name}`, no sampling): `python benchmarks/task_horizon.py --from-samples "
        f"docs/results/{samples_path.name}`\n\n{_methods()}\n"
        f"{table}\n\nCriteria (issue 16, item 1):\n\n{verdicts}\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
