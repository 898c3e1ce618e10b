"""Held-out evaluation: the mean score of one sampled completion per prompt, with tool turns if asked."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from otbrl.rollout.multiturn import Episode, Tool, episode_seed, episode_toolboxes, sample_texts

# score(prompts, completions, answers) -> one number per completion
Scorer = Callable[[list[str], list[str], list[str]], Sequence[float]]


@torch.no_grad()
def evaluate(
    model: Any,
    tokenizer: Any,
    rows: list[dict[str, str]],
    score: Scorer,
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    tools: Sequence[str] | Mapping[str, Tool] = (),
    max_turns: int = 0,
    progress: bool = False,
    samples: int = 1,
    batch_size: int | None = None,
    compact: bool = False,
    episode: Episode | None = None,
    turn_cache: bool = False,
) -> float:
    """Mean of `score` over `samples` completions per row ({"prompt", "answer"}), sampled at
    `temperature` (reproducible given `seed`), with tool calls between turns when `tools` names any.
    `progress`: a bar over the decoding steps (at most `max_new_tokens`; the same numbers with or without
    it). `batch_size`: decode at most this many completions at a time (None: all at once), which bounds
    the KV cache's memory; chunks continue one random stream, so a chunked evaluation is reproducible but
    draws other samples than an unchunked one. `compact`: single-turn decoding drops ended rows from its
    KV cache (`decode`'s `compact`). `turn_cache`: with tools, each row's KV cache lives from turn to turn
    (`sample_with_tools`). `episode`: each completion meets its own episode of the environment
    (completion i's toolbox is built from `episode_seed("heldout", seed, i)` and its prompt; `tools` is
    then ignored), so a score is reproducible from `seed` and its samples meet different draws. Leaves
    the model in eval mode."""
    if not rows:
        raise ValueError("rows: nothing to evaluate")
    if samples < 1:
        raise ValueError(f"samples: must be >= 1, got {samples}")
    if episode is not None and max_turns < 1:
        raise ValueError("max_turns: an episode's tools need at least one call, got 0")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1 or None, got {batch_size}")
    model.eval()
    gen = torch.Generator(device=model.device).manual_seed(seed)
    rows = [r for r in rows for _ in range(samples)]  # each prompt's samples side by side
    prompts = [r["prompt"] for r in rows]
    size = batch_size or len(prompts)
    starts = range(0, len(prompts), size)
    chunks = [prompts[i : i + size] for i in starts]
    boxes = None
    if episode is not None:
        seeds = [episode_seed("heldout", seed, i) for i in range(len(prompts))]
        every = episode_toolboxes(episode, seeds, prompts)
        boxes = [every[i : i + size] for i in starts]
    bar = None
    if progress and not tools and episode is None:  # multi-turn decoding has no fixed step count to show
        from tqdm.auto import tqdm

        total = max_new_tokens * len(chunks)
        bar = tqdm(total=total, desc=f"held-out, {len(rows)} prompts", unit="step", leave=False)
    texts: list[str] = []
    try:
        for c, chunk in enumerate(chunks):
            texts += sample_texts(
                model,
                tokenizer,
                chunk,
                max_new_tokens,
                temperature,
                gen,
                tools if boxes is None else boxes[c],
                max_turns,
                on_step=None if bar is None else lambda: bar.update(1),
                compact=compact,
                turn_cache=turn_cache,
            )
    finally:
        if bar is not None:
            bar.close()
    scores = list(score(prompts, texts, [r["answer"] for r in rows]))
    return float(sum(scores) / len(scores))
