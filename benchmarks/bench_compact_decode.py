"""Decoding with and without dropping ended rows from the KV cache (`decode(compact=...)`), on SmolLM2.

Issue 34, item 5 (speed per run): a held-out evaluation of 1,024 prompts took about 32 minutes on one
loaded core in smollm2b's first pilot run, because the loop forwards every row for all 128 steps while
the median answer of the warm-started model is 27 tokens (22% of the row-steps are live). This measures
both loops on the same prompts and seed, alternating, and how many rows draw the same tokens (the
compacted forward runs on a smaller batch, so logits may differ in their last bits).

The model is the supervised warm start of smollm2b (`otbrl sft`, built by the first run of its pilot in
$OTBRL_CACHE/sft/); 64 distinct held-out chat_addlist_work problems x 4 samples (quick: 8 x 4), T=1,
at most 128 new tokens, float32, the torch threads of the machine (`OMP_NUM_THREADS`).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_compact_decode.py   # docs/results/compact-decode.md
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from common import command_line, markdown_table, write_result

from otbrl.app.sources import as_chat, cache_dir, load_model
from otbrl.rollout.sampler import decode, eos_token_ids
from studies.llm_pilot2 import distinct_problems


def main() -> None:
    quick, out, threads = command_line(__doc__.splitlines()[0], "8 problems x 4", "compact-decode.md")
    found = sorted((cache_dir() / "sft").glob("chat_addlist_work-32-*/final"))
    if not found:
        raise SystemExit("no smollm2b warm start in $OTBRL_CACHE/sft: run smollm2b's pilot (or otbrl sft)")
    model, tok = load_model({"model": str(found[0])}, print)
    model.eval()
    problems = 8 if quick else 64
    rows = distinct_problems("chat_addlist_work", problems, 0, heldout=True)
    texts = [
        tok.apply_chat_template(as_chat(p, None), tokenize=False, add_generation_prompt=True)
        for p, _, _ in rows
        for _ in range(4)
    ]
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    eos = eos_token_ids(model, tok)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    results = {}
    for compact in (False, True, False, True):
        gen = torch.Generator().manual_seed(0)
        start = time.perf_counter()
        with torch.no_grad():
            ids, mask = enc.input_ids, enc.attention_mask
            results[compact] = decode(model, ids, mask, 128, 1.0, eos, tok.pad_token_id, gen, compact=compact)
        seconds[compact].append(time.perf_counter() - start)
        print(f"compact={compact}: {seconds[compact][-1]:.1f} s", flush=True)
    ref, fast = results[False], results[True]
    same = int((ref.completion_ids == fast.completion_ids).all(1).sum())
    lengths = ref.completion_mask.sum(1).float()
    table = markdown_table(
        ["loop", "seconds (two runs)", "completion tokens", "tokens / s"],
        [
            [
                "compact" if c else "every row every step",
                " / ".join(f"{s:.1f}" for s in seconds[c]),
                f"{int(results[c].completion_mask.sum()):,}",
                f"{int(results[c].completion_mask.sum()) / min(seconds[c]):.0f}",
            ]
            for c in (False, True)
        ],
    )
    diff = float((ref.logprobs - fast.logprobs).abs().max())
    verdict = (
        f"Speed-up (best of two each): {min(seconds[False]) / min(seconds[True]):.2f}x. Rows with identical "
        f"tokens: {same} of {len(texts)}; largest log-prob difference "
        f"{diff:.1e}. Answer lengths: mean {lengths.mean():.1f}, "
        f"longest {int(lengths.max())} of 128 steps (live share of row-steps {lengths.mean() / 128:.2f})."
    )
    write_result(
        out,
        "Decoding with ended rows dropped from the KV cache (SmolLM2, issue 34)",
        Path(__file__).name,
        quick,
        threads,
        f"{problems} held-out problems x 4 samples, T=1, 128 new tokens at most, float32; model {found[0]}.",
        table,
        verdict,
        env="OMP_NUM_THREADS=1 ",
    )


if __name__ == "__main__":
    main()
