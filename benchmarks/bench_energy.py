"""Chunked otbrl.sum_pi_squared / otbrl.token_energy against the naive full-softmax computation:
time, peak extra memory, and max relative error against a float64 reference on confident tokens.

    .venv/bin/python benchmarks/bench_energy.py            # full run, writes docs/results/sum_pi_squared.md
    .venv/bin/python benchmarks/bench_energy.py --quick    # V=32768, rows 256/512, writes to a temp file

Timing inputs are bf16 logits randn * 4 with each row's argmax as the token. Accuracy is measured on a
separate set of confident rows (the argmax raised 8 to 20 above the rest), where 1 - 2 p_y + sum p^2
loses most to cancellation: max relative error against a float64 reference. Each (fn, impl, V, rows)
cell runs in a fresh process.
"""

from __future__ import annotations

import torch
from common import command_line, in_fresh_process, markdown_table, measure, write_result
from torch import Tensor

import otbrl
from otbrl.energy import CHUNK_ELEMENTS

FULL_VOCABS, FULL_ROWS = [32768, 151936], [1024, 2048, 4096]
QUICK_VOCABS, QUICK_ROWS = [32768], [256, 512]
ERROR_ROWS = 64  # rows checked against the float64 reference
BUDGET_S = 6.0
FLAT_TOLERANCE = 0.25  # "independent of rows": peak varies by less than this fraction over the rows


def make_inputs(rows: int, vocab: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.bfloat16).mul_(4)
    return logits, logits.argmax(dim=-1)


def make_confident(rows: int, vocab: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    logits, tokens = make_inputs(rows, vocab, seed)
    gap = torch.linspace(8.0, 20.0, rows, dtype=torch.bfloat16)
    logits[torch.arange(rows), tokens] = logits.max(dim=-1).values + gap
    return logits, tokens


def naive_sum_pi_squared(logits: Tensor, tokens: Tensor | None = None) -> Tensor:
    z = logits.float()
    return torch.exp(torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1))


def naive_token_energy(logits: Tensor, tokens: Tensor) -> Tensor:
    z = logits.float()
    p_y = torch.softmax(z, -1).gather(-1, tokens[:, None]).squeeze(-1)
    return 1 - 2 * p_y + torch.exp(torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1))


def reference(fn: str, logits: Tensor, tokens: Tensor) -> Tensor:
    """float64. The energy as (sum_{v != y} p_v)^2 + sum_{v != y} p_v^2: writing 1 - p_y as the sum of
    the other probabilities keeps even float64 from cancelling on confident tokens."""
    p = torch.softmax(logits.double(), -1)
    if fn == "sum_pi_squared":
        return p.square().sum(-1)
    others = p.scatter(-1, tokens[:, None], 0.0)
    return others.sum(-1).square() + others.square().sum(-1)


FUNCTIONS = {
    ("sum_pi_squared", "chunked"): lambda logits, tokens: otbrl.sum_pi_squared(logits),
    ("sum_pi_squared", "naive"): naive_sum_pi_squared,
    ("token_energy", "chunked"): otbrl.token_energy,
    ("token_energy", "naive"): naive_token_energy,
}


def cell(fn: str, impl: str, vocab: int, rows: int, threads: int) -> dict[str, float]:
    """Runs in a fresh process: peak extra memory of the first call, median time, error on ERROR_ROWS rows."""
    torch.set_num_threads(threads)
    call = FUNCTIONS[fn, impl]
    call(*make_inputs(4, vocab))  # load kernels and start thread pools before measuring memory
    logits, tokens = make_inputs(rows, vocab)
    result = measure(lambda: call(logits, tokens), BUDGET_S, min_repeats=2, max_repeats=5)
    del result["out"]
    logits, tokens = make_confident(ERROR_ROWS, vocab)
    ref = reference(fn, logits, tokens)
    result["err"] = ((call(logits, tokens).double() - ref).abs() / ref).max().item()
    return result


def main() -> None:
    quick, out, threads = command_line(__doc__.splitlines()[0], "V=32768, rows 256/512", "sum_pi_squared.md")
    vocabs, row_counts = (QUICK_VOCABS, QUICK_ROWS) if quick else (FULL_VOCABS, FULL_ROWS)

    header = ["V", "rows", "fn", "chunked ms", "naive ms", "chunked peak MiB", "naive peak MiB"]
    header += ["max rel err chunked", "max rel err naive"]
    table_rows, peaks = [], {}
    for vocab in vocabs:
        for fn in ("sum_pi_squared", "token_energy"):
            for rows in row_counts:
                chunked = in_fresh_process(cell, fn, "chunked", vocab, rows, threads)
                naive = in_fresh_process(cell, fn, "naive", vocab, rows, threads)
                peaks[vocab, fn, rows] = chunked["peak_mib"], naive["peak_mib"]
                cells = [f"{chunked['ms']:.1f}", f"{naive['ms']:.1f}"]
                cells += [f"{chunked['peak_mib']:.0f}", f"{naive['peak_mib']:.0f}"]
                cells += [f"{chunked['err']:.2e}", f"{naive['err']:.2e}"]
                table_rows.append([str(vocab), str(rows), fn, *cells])
                print(" | ".join(table_rows[-1]), flush=True)
    table = markdown_table(header, table_rows)
    print(table)

    # Compare the peak at the most rows with the peak at the fewest, per (V, fn).
    growth = []
    for vocab in vocabs:
        for fn in ("sum_pi_squared", "token_energy"):
            (c_lo, n_lo), (c_hi, n_hi) = peaks[vocab, fn, row_counts[0]], peaks[vocab, fn, row_counts[-1]]
            growth.append((vocab, fn, c_hi / max(c_lo, 1.0), n_hi / max(n_lo, 1.0)))
    flat = all(abs(c - 1) < FLAT_TOLERANCE for _, _, c, _ in growth)
    rows_factor = row_counts[-1] / row_counts[0]
    summary = (
        f"Chunked peak memory independent of rows: {'yes' if flat else 'NO'} (criterion: each chunked "
        f"peak changes by less than {FLAT_TOLERANCE:.0%} while rows grow x{rows_factor:.0f}, "
        f"from {row_counts[0]} to {row_counts[-1]}). "
        "Peak at most rows / peak at fewest rows, chunked vs naive: "
        + "; ".join(f"V={v} {fn} x{c:.2f} vs x{n:.2f}" for v, fn, c, n in growth)
        + ". Up to one tile of rows (otbrl.energy.CHUNK_ELEMENTS // V: "
        + ", ".join(f"{CHUNK_ELEMENTS // v} at V={v}" for v in vocabs)
        + ") the tile itself grows with rows."
    )
    print(summary)
    description = (
        "Logits are bf16 `randn * 4`, tokens each row's argmax. `chunked` is `otbrl.sum_pi_squared` / "
        "`otbrl.token_energy`; `naive` is `exp(logsumexp(2z) - 2 logsumexp(z))` and `1 - 2 p_y + sum p^2` on "
        "`z = logits.float()`. Times are medians of 2-5 calls after one warm-up call; peak is the extra "
        "resident memory of one call in a fresh process (VmHWM - VmRSS before, the bf16 input excluded); "
        f"errors are max relative differences from a float64 reference on {ERROR_ROWS} separate confident "
        "rows (the sampled token's logit 8 to 20 above the rest, as for most tokens of a trained model)."
    )
    write_result(
        out,
        "sum pi^2 and token energy: chunked vs naive full softmax",
        "bench_energy.py",
        quick,
        threads,
        description,
        table,
        summary,
    )


if __name__ == "__main__":
    main()
