"""Per-token log-prob, sum pi^2, energy and entropy from bf16 hidden states on a CUDA GPU: the Triton
kernel and the tiled torch path against materialised logits, with the trainer's log-prob-only pass as
the floor. Time and peak extra GPU memory, side by side in one run, plus the kernel's block sizes.

    python benchmarks/bench_fused_gpu.py                      # writes docs/results/energy-gpu.md
    python benchmarks/bench_fused_gpu.py --quick --out X.md   # one small size

Needs CUDA and Triton (this repository's CI has neither; run it where a GPU is lent).
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable

import torch
from bench_fused import materialised  # the same formulas as the CPU benchmark's
from common import command_line, markdown_table, write_result
from torch import Tensor

from otbrl.fused import fused_token_stats

# (tokens, V, H): the heads of SmolLM2-135M, Qwen2.5-0.5B, Qwen2.5-7B and Llama-3-8B, with a batch of
# tokens a training step scores at once.
FULL = [(4096, 49152, 576), (16384, 151936, 896), (16384, 151936, 3584), (16384, 128256, 4096)]
QUICK = [(2048, 32768, 512)]
BLOCKS = [(64, 128, 64), (32, 64, 32), (64, 64, 64), (128, 128, 64), (64, 128, 128), (64, 256, 64)]
DTYPE = torch.bfloat16


def make_inputs(tokens: int, vocab: int, hidden_size: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=g, device="cuda").to(DTYPE)
    weight = (torch.randn(vocab, hidden_size, generator=g, device="cuda") * 4 * hidden_size**-0.5).to(DTYPE)
    return hidden, weight, torch.randint(0, vocab, (tokens,), generator=g, device="cuda")


def logprobs_only(hidden: Tensor, weight: Tensor, tokens: Tensor) -> Tensor:
    """What a trainer computes anyway: bf16 logits, float32 log-softmax at the sampled tokens."""
    z = (hidden @ weight.T).float()
    return z.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(z, -1)


def fused(backend: str) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    return lambda h, w, y: torch.stack(list(fused_token_stats(h, w, y, backend=backend)))


def blocks(bn: int, bv: int, bk: int) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    from otbrl.fused_triton import triton_token_stats

    return lambda h, w, y: torch.stack(list(triton_token_stats(h, w, y, 1.0, None, bn, bv, bk)))


METHODS = {
    "Triton fused": fused("triton"),
    "torch fused": fused("torch"),
    "materialised": materialised,
    "log-prob only (floor)": logprobs_only,
}


def measure(fn: Callable[[], Tensor], repeats: int = 10) -> dict[str, float]:
    """Peak extra GPU memory of the first call (also the warm-up and compile), then the median of
    `repeats` timed calls (CUDA events)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    try:
        fn()
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:  # a size whose logits do not fit: the point of the fused paths
        torch.cuda.empty_cache()
        return {"ms": math.nan, "peak_mib": math.nan}
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {"ms": statistics.median(times), "peak_mib": peak}


def max_rel_error(got: Tensor, hidden: Tensor, weight: Tensor, tokens: Tensor) -> float:
    """Largest relative error of the four statistics against float64 materialised logits."""
    z = hidden.double() @ weight.double().T
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    y = tokens[:, None]
    others = p.scatter(-1, y, 0.0)
    ref = [
        logp.gather(-1, y).squeeze(-1),
        p.square().sum(-1),
        others.sum(-1).square() + others.square().sum(-1),
        -torch.where(p > 0, p * logp, 0.0).sum(-1),
    ]
    return max(((a.double() - b).abs() / b.abs()).max().item() for a, b in zip(got, ref, strict=True))


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_fused_gpu.py needs a CUDA GPU")
    quick, out, threads = command_line(__doc__.splitlines()[0], "one small size", "energy-gpu.md")
    import triton

    gpu = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}"
    print(gpu)
    sizes = QUICK if quick else FULL
    rows, error_rows, block_rows = [], [], []
    for tokens, vocab, hidden_size in sizes:
        small = make_inputs(256, vocab, hidden_size, seed=1)
        error_rows.append(
            [f"{vocab} x {hidden_size}"]
            + [f"{max_rel_error(METHODS[k](*small), *small):.1e}" for k in ("Triton fused", "torch fused")]
        )
        inputs = make_inputs(tokens, vocab, hidden_size)
        res = {k: measure(lambda fn=fn, x=inputs: fn(*x)) for k, fn in METHODS.items()}
        floor = res["log-prob only (floor)"]["ms"]
        rows.append(
            [str(tokens), str(vocab), str(hidden_size)]
            + [f"{r['ms']:.2f}" if r["ms"] == r["ms"] else "OOM" for r in res.values()]
            + [f"{res['Triton fused']['ms'] / floor:.2f}x", f"{res['torch fused']['ms'] / floor:.2f}x"]
            + [f"{r['peak_mib']:.0f}" if r["ms"] == r["ms"] else "OOM" for r in res.values()]
        )
        print(rows[-1], flush=True)
        if (tokens, vocab, hidden_size) == sizes[-1] or quick:
            continue
        reference = METHODS["Triton fused"](*inputs)
        for bn, bv, bk in BLOCKS:
            fn = blocks(bn, bv, bk)
            diff = ((fn(*inputs) - reference).abs() / reference.abs().clamp_min(1e-30)).max().item()
            block_rows.append(
                [
                    f"{tokens} x {vocab} x {hidden_size}",
                    f"{bn} x {bv} x {bk}",
                    f"{measure(lambda fn=fn, x=inputs: fn(*x), repeats=5)['ms']:.2f}",
                    f"{diff:.1e}",
                ]
            )
            print(block_rows[-1], flush=True)
    header = ["tokens", "V", "H"] + [f"{k} ms" for k in METHODS] + ["Triton / floor", "torch fused / floor"]
    header += [f"{k} peak MiB" for k in METHODS]
    table = markdown_table(header, rows)
    table += "\n\nAccuracy, 256 tokens, largest relative error of the four statistics against float64:\n\n"
    table += markdown_table(["head (V x H)", "Triton fused", "torch fused"], error_rows)
    if block_rows:
        table += "\n\nThe Triton kernel's blocks (rows x vocabulary x hidden; the default is the first):\n\n"
        table += markdown_table(["size", "blocks", "ms", "largest relative difference"], block_rows)
    print(table)
    done = [r for r in rows if "OOM" not in r[3:6]]

    def span(i: int) -> str:
        ratios = [float(r[i]) / float(r[5]) for r in done]
        return f"{min(ratios):.2f}x to {max(ratios):.2f}x" if ratios else "n/a"

    verdict = (
        f"Time over materialised logits: Triton fused {span(3)}, torch fused {span(4)}. "
        "Peak memory is the column that decides where logits do not fit."
    )
    print(verdict)
    description = (
        f"GPU: {gpu}. bf16 hidden states (tokens x H) and bf16 output head (V x H), random, logits of "
        "a few units. `Triton fused` and `torch fused` are `otbrl.fused_token_stats(..., backend=...)` "
        "(log-prob, sum pi^2, energy, entropy; the torch path walks vocabulary tiles); `materialised` forms "
        "the (tokens x V) logits, upcasts them to float32 and applies the logsumexp formulas; `log-prob "
        "only (floor)` is what a trainer computes anyway (bf16 logits, float32 log-softmax at the sampled "
        "token). Times are medians of 10 calls after a warm-up (CUDA events); peak is the extra allocated "
        "GPU memory of one call (inputs excluded)."
    )
    write_result(
        out,
        "Fused per-token statistics on a GPU (bf16)",
        "bench_fused_gpu.py",
        quick,
        threads,
        description,
        table,
        verdict,
    )


if __name__ == "__main__":
    main()
