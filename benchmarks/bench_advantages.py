"""Time and peak memory of otbrl's vectorised OTB against a per-group Python loop and against GRPO.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_advantages.py  # writes docs/results/advantages.md
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_advantages.py --quick  # B=256, T=1024; temp file

Inputs: groups of N=8, outcome rewards in {0, 1} (or, for token rewards, N(0, 1) on every policy token),
response lengths uniform in [T/4, T] (left-aligned masks), energy uniform in [0, 1). Each (estimator,
size) cell runs in a fresh process; the OTB/GRPO ratio cells time both side by side in one process,
alternating calls, so load from other work on the machine hits both alike.
"""

from __future__ import annotations

import statistics
import time

import torch
from common import command_line, in_fresh_process, markdown_table, measure, write_result
from torch import Tensor

import otbrl

GROUP_SIZE = 8
FULL_SIZES = [(256, 1024), (256, 8192), (1024, 1024), (1024, 8192)]
QUICK_SIZES = [(256, 1024)]
BUDGET_S = 3.0  # timing budget per cell; slow cells still get 3 repeats
TARGET_LOOP_SPEEDUP = 50.0
TARGET_GRPO_RATIO = 3.0  # outcome rewards, largest size of the main table
# Side-by-side OTB/GRPO cells (B, T, rewards); the first one is judged against TARGET_TOKEN_RATIO.
RATIO_CASES = [(1024, 4096, "token"), (1024, 8192, "outcome")]
QUICK_RATIO_CASES = [(256, 1024, "token"), (256, 1024, "outcome")]
TARGET_TOKEN_RATIO = 2.5


def make_inputs(batch: int, length: int, seed: int = 0, token_rewards: bool = False) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=gen)
    # float mask, as trainers usually hand it over
    mask = (torch.arange(length) < lengths[:, None]).float()
    outcome = torch.randint(0, 2, (batch,), generator=gen).float()
    return {
        "rewards": torch.randn(batch, length, generator=gen) * mask if token_rewards else outcome,
        "mask": mask,
        "group_ids": torch.arange(batch) // GROUP_SIZE,
        "energy": torch.rand(batch, length, generator=gen),
    }


def otb_loop(rewards: Tensor, mask: Tensor, group_ids: Tensor, energy: Tensor) -> Tensor:
    """Self-inclusive OTB written the straightforward way, one group at a time, in the input dtype."""
    lengths = mask.sum(-1).long()
    token_rewards = torch.zeros_like(mask)
    # the outcome reward sits on the last policy token
    token_rewards[torch.arange(len(rewards)), lengths - 1] = rewards
    returns = (token_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    realized = (energy * mask).cumsum(-1)
    baselines = torch.zeros_like(mask)
    for g in group_ids.unique():
        rows = (group_ids == g).nonzero().squeeze(1)
        if len(rows) < 2:
            continue  # a group of one has no baseline
        m, w = mask[rows], realized[rows]
        base = (returns[rows] * w * m).sum(0) / ((w * m).sum(0) + 1e-8)
        longest, second = lengths[rows].topk(2).values.tolist()
        if longest > second:
            base[second:] = 0.0  # only the longest is active there; its baseline would be its own return
        baselines[rows] = base
    return (returns - baselines) * mask


def otb_row_loop(rewards: Tensor, mask: Tensor, group_ids: Tensor, energy: Tensor) -> Tensor:
    """The same OTB in the shape of the authors' multi-turn variant: each row's policy tokens are
    compacted in a Python loop over rows, baselines are formed per group, then scattered back."""
    realized = (energy * mask).cumsum(-1)
    lengths = mask.sum(-1).long()
    width = int(lengths.max())
    frame_w, frame_g = torch.zeros(len(mask), width), torch.zeros(len(mask), width)
    for i in range(len(mask)):
        keep = mask[i].bool()
        frame_w[i, : lengths[i]] = realized[i, keep]
        frame_g[i, : lengths[i]] = rewards[i]  # outcome reward: the return at every policy token
    frame_m = (torch.arange(width) < lengths[:, None]).float()
    base = torch.zeros_like(frame_w)
    for g in group_ids.unique():
        rows = (group_ids == g).nonzero().squeeze(1)
        if len(rows) < 2:
            continue
        w = frame_w[rows] * frame_m[rows]
        b = (frame_g[rows] * w).sum(0) / (w.sum(0) + 1e-8)
        base[rows] = b
        longest, second = lengths[rows].topk(2).values.tolist()
        if longest > second:
            base[rows[lengths[rows].argmax()], second:] = 0.0
    adv = torch.zeros_like(mask)
    for i in range(len(mask)):
        adv[i, mask[i].bool()] = frame_g[i, : lengths[i]] - base[i, : lengths[i]]
    return adv


def run_otb(rewards: Tensor, mask: Tensor, group_ids: Tensor, energy: Tensor) -> Tensor:
    res = otbrl.compute_advantages("otb", rewards=rewards, mask=mask, group_ids=group_ids, energy=energy)
    return res.advantages


def run_otb_generated(rewards: Tensor, mask: Tensor, group_ids: Tensor, energy: Tensor) -> Tensor:
    kw = dict(rewards=rewards, mask=mask, group_ids=group_ids, energy=energy, align="generated")
    return otbrl.compute_advantages("otb", **kw).advantages


def run_otb_loo(rewards: Tensor, mask: Tensor, group_ids: Tensor, energy: Tensor) -> Tensor:
    kw = dict(rewards=rewards, mask=mask, group_ids=group_ids, energy=energy, leave_one_out=True)
    return otbrl.compute_advantages("otb", **kw).advantages


def run_grpo(rewards: Tensor, mask: Tensor, group_ids: Tensor, energy: Tensor) -> Tensor:
    # GRPO has no use for energy; passing it would only add otbrl's validation of it to GRPO's time
    return otbrl.compute_advantages("grpo", rewards=rewards, mask=mask, group_ids=group_ids).advantages


FUNCTIONS = {
    "otb": run_otb,
    "otb generated": run_otb_generated,
    "otb loo": run_otb_loo,
    "grpo": run_grpo,
    "group loop": otb_loop,
    "row loop": otb_row_loop,
}


def cell(name: str, batch: int, length: int, threads: int) -> dict[str, float]:
    """Runs in a fresh process: peak extra memory of the first call, then the median time."""
    torch.set_num_threads(threads)
    fn = FUNCTIONS[name]
    fn(**make_inputs(2 * GROUP_SIZE, 64))  # load kernels and start thread pools before measuring memory
    inputs = make_inputs(batch, length)
    result = measure(lambda: fn(**inputs), BUDGET_S, min_repeats=3, max_repeats=20)
    del result["out"]
    return result


def ratio_cell(batch: int, length: int, rewards: str, threads: int) -> dict[str, float]:
    """Runs in a fresh process: OTB and GRPO called alternately (after one warm-up call each) for about
    BUDGET_S. Wall and CPU time (user + system of this process, which time slices taken by other work
    on a shared machine do not inflate) of each; the ratio is the median of the per-pair CPU-time ratios."""
    torch.set_num_threads(threads)
    inputs = make_inputs(batch, length, token_rewards=rewards == "token")
    calls = {"otb": lambda: run_otb(**inputs), "grpo": lambda: run_grpo(**inputs)}
    start = time.perf_counter()
    for call in calls.values():
        call()
    pairs = max(7, min(30, int(BUDGET_S / (time.perf_counter() - start))))
    wall: dict[str, list[float]] = {k: [] for k in calls}
    cpu: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(pairs):
        for k, call in calls.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            call()
            cpu[k].append(time.process_time() - start_cpu)
            wall[k].append(time.perf_counter() - start)
    ratios = [o / g for o, g in zip(cpu["otb"], cpu["grpo"], strict=True)]
    out = {f"{k}_ms": 1e3 * statistics.median(v) for k, v in wall.items()}
    out |= {f"{k}_cpu_ms": 1e3 * statistics.median(v) for k, v in cpu.items()}
    return out | {"ratio": statistics.median(ratios), "pairs": pairs}


def ratio_table(cases: list[tuple[int, int, str]], threads: int) -> tuple[str, list[dict[str, float]]]:
    """The side-by-side OTB/GRPO table, each case in a fresh process."""
    header = ["B", "T", "rewards", "threads", "otb ms", "grpo ms", "otb cpu ms", "grpo cpu ms"]
    header += ["otb/grpo", "pairs"]
    rows, results = [], []
    for batch, length, rewards in cases:
        res = in_fresh_process(ratio_cell, batch, length, rewards, threads)
        results.append(res)
        rows.append(
            [
                str(batch),
                str(length),
                rewards,
                str(threads),
                f"{res['otb_ms']:.1f}",
                f"{res['grpo_ms']:.1f}",
                f"{res['otb_cpu_ms']:.1f}",
                f"{res['grpo_cpu_ms']:.1f}",
                f"{res['ratio']:.2f}x",
                str(res["pairs"]),
            ]
        )
    return markdown_table(header, rows), results


def main() -> None:
    quick, out, threads = command_line(__doc__.splitlines()[0], "B=256, T=1024 only", "advantages.md")
    sizes = QUICK_SIZES if quick else FULL_SIZES
    cases = QUICK_RATIO_CASES if quick else RATIO_CASES
    side_by_side, ratio_results = ratio_table(cases, threads)
    print(side_by_side)

    header = ["B", "T", *(f"{k} ms" for k in FUNCTIONS), "group loop/otb", "row loop/otb", "otb/grpo"]
    header.insert(2, "threads")
    header += ["otb peak MiB", "grpo peak MiB"]
    rows, results = [], {}
    for batch, length in sizes:
        # The comparison is only honest if both compute the same thing.
        inputs = make_inputs(batch, length)
        expected = run_otb(**inputs)
        diff = max(
            (fn(**inputs) - expected).abs().max().item() for fn in (otb_loop, otb_row_loop, run_otb_generated)
        )
        if not diff <= 1e-4:
            raise RuntimeError(f"loops and otbrl disagree at B={batch}, T={length}: max abs diff {diff:.3g}")
        res = {name: in_fresh_process(cell, name, batch, length, threads) for name in FUNCTIONS}
        results[batch, length] = res
        otb, grpo = res["otb"], res["grpo"]
        times = [f"{res[k]['ms']:.1f}" for k in FUNCTIONS]
        ratios = [f"{res[k]['ms'] / otb['ms']:.1f}x" for k in ("group loop", "row loop")]
        ratios.append(f"{otb['ms'] / grpo['ms']:.2f}x")
        peaks = [f"{res[k]['peak_mib']:.0f}" for k in ("otb", "grpo")]
        rows.append([str(batch), str(length), str(threads), *times, *ratios, *peaks])
        repeats = ", ".join(f"{k} {v['repeats']}" for k, v in res.items())
        print(f"B={batch} T={length}: max |loop - otb| = {diff:.2g}; repeats {repeats}")
    table = markdown_table(header, rows)
    print(table)

    # Targets are judged at the largest size measured (B=1024, T=8192 in the full run).
    batch, length = sizes[-1]
    res = results[batch, length]
    ratio = res["otb"]["ms"] / res["grpo"]["ms"]
    speedups = {k: res[k]["ms"] / res["otb"]["ms"] for k in ("group loop", "row loop")}

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    verdict = (
        f"Targets at B={batch}, T={length}: OTB >= {TARGET_LOOP_SPEEDUP:.0f}x faster than a loop: "
        + "; ".join(
            f"{met(v >= TARGET_LOOP_SPEEDUP)} against the {k} ({v:.1f}x)" for k, v in speedups.items()
        )
        + f". OTB <= {TARGET_GRPO_RATIO:.0f}x GRPO time: {met(ratio <= TARGET_GRPO_RATIO)} ({ratio:.2f}x)."
    )
    batch, length, rewards = cases[0]
    token_ratio = ratio_results[0]["ratio"]
    verdict += (
        f" Side by side, {rewards} rewards at B={batch}, T={length}: OTB <= {TARGET_TOKEN_RATIO}x GRPO time: "
        f"{met(token_ratio <= TARGET_TOKEN_RATIO)} ({token_ratio:.2f}x)."
    )
    print(verdict)
    description = (
        f"Groups of {GROUP_SIZE}, outcome rewards in {{0, 1}}, response lengths uniform in [T/4, T], "
        "energy uniform in [0, 1). `otb` and `grpo` are `otbrl.compute_advantages` (input validation "
        "included); `group loop` is the same self-inclusive OTB (with zero tail) as a Python loop over "
        "groups, each group vectorised (the authors' single-turn structure); `row loop` compacts each "
        "row's policy tokens in a Python loop over rows first (their multi-turn structure). Both are "
        "float32 and are checked equal to otbrl's advantages (atol 1e-4) before timing, as is `otb "
        "generated`. `otb loo` (leave-one-out) computes in float64 on purpose: its total-minus-own sums "
        "would cancel in float32. Times are medians after one warm-up call; peak is the extra resident "
        "memory of one call in a fresh process (VmHWM - VmRSS before).\n\n"
        "Side by side (first table): OTB and GRPO through `otbrl.compute_advantages` on the same inputs, "
        "called alternately in one fresh process; `ms` is wall time, `cpu ms` the process's CPU time "
        "(user + system: page faults count, time slices taken by other work on the machine do not), both "
        "medians; `otb/grpo` is the median of the per-pair CPU-time ratios (robust to load that changes "
        "during the run; with one thread CPU time equals wall time on an idle machine). Token rewards are "
        "N(0, 1) on every policy token, so both pay for the reward-to-go. `threads` is torch's intra-op "
        "thread count."
    )
    table = side_by_side + "\n\n" + table
    write_result(
        out,
        "Advantage estimators: time and peak memory",
        "bench_advantages.py",
        quick,
        threads,
        description,
        table,
        verdict,
        env=f"OMP_NUM_THREADS={threads} ",
    )


if __name__ == "__main__":
    main()
