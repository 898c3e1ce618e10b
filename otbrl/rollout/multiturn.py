"""Multi-turn rollouts with tools: the model writes a call `name(arguments)`, generation pauses when the
call's parentheses close, the tool runs, its output comes back into the context as `:output;` (mask 0:
never trained on, no energy, no advantage), and generation resumes, up to `max_turns` tool calls.

`sample_with_tools` is the loop; `otbrl.integrations.trl.rollout_func` plugs it into TRL, and
`sample_texts` serves evaluation and warm starts.

After `max_turns` calls, a further call is left as plain text: it does not pause and gets no output.
Tool output is cut to fit the completion budget. A tool that raises returns its error as its output;
the rollout never fails because of a tool.

Tools are shared by every row (a mapping name -> callable), or each row has its own toolbox: an
*episode* (`Episode`: (seed, prompt) -> toolbox) is an environment whose state lives in its tools (a deck
of cards, a hidden number), built afresh for each completion from a seed (`episode_seed`) and the prompt
it answers, so the samples of one prompt meet different draws of the environment and one seed gives the
same draws on any machine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from otbrl.rollout.sampler import STOP, RowCache, SamplingSettings, decode, eos_token_ids, sample
from otbrl.tools import calculator, run_python

Tool = Callable[[str], str]
Toolbox = Mapping[str, Tool]
Episode = Callable[[int, str], Toolbox]  # (seed, prompt) -> the toolbox of one episode (its own state)
OUTPUT_START, OUTPUT_END = ":", ";"  # around a tool's output in the context


def episode_seed(*parts: object) -> int:
    """A seed in [0, 2**63) from `parts` (run seed, step, row, ...): a keyed hash of their repr, the same
    in every process and on every machine (unlike `hash`)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8, key=b"otbrl-episode").digest()
    return int.from_bytes(digest, "big") >> 1


def toolboxes(tools: Toolbox | Sequence[Toolbox], rows: int) -> list[Toolbox]:
    """One toolbox per row: a shared mapping repeated, or the rows' own (`rows` of them; a stateful tool
    must not be shared between rows, which may call it at the same time)."""
    if isinstance(tools, Mapping):
        return [tools] * rows
    boxes = list(tools)
    if len(boxes) != rows:
        raise ValueError(f"tools: one toolbox per row, got {len(boxes)} for {rows} rows")
    return boxes


def episode_toolboxes(episode: Episode, seeds: Sequence[int], prompts: Sequence[str]) -> list[Toolbox]:
    """A fresh toolbox per (seed, prompt), each checked to be a non-empty mapping of callables."""
    boxes = []
    for s, p in zip(seeds, prompts, strict=True):
        box = episode(s, p)
        if not isinstance(box, Mapping) or not box or not all(callable(t) for t in box.values()):
            raise ValueError(f"episode: must return a non-empty mapping name -> callable, got {box!r}")
        boxes.append(box)
    return boxes


def default_tools() -> dict[str, Tool]:
    """`calc(1+2*3)`: the safe arithmetic calculator; `py(print(1))`: Python in the sandbox."""

    def py(code: str) -> str:
        return run_python(code, timeout_s=2, memory_mb=256, max_output_bytes=200).to_text()

    return {"calc": calculator, "py": py}


def resolve_tools(names: list[str] | tuple[str, ...] | Mapping[str, Tool]) -> dict[str, Tool]:
    """Tool names from `default_tools()` (or a mapping name -> callable, passed through)."""
    if isinstance(names, Mapping):
        return dict(names)
    known = default_tools()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"tools: unknown {unknown[0]!r}; known: {', '.join(sorted(known))}")
    return {n: known[n] for n in names}


def find_call(text: str, tools: Mapping[str, Tool]) -> tuple[str, str] | None:
    """The call that `text` ends with, `name(arguments)` with balanced parentheses, if `name` is a tool."""
    if not text.endswith(")"):
        return None
    depth = 0
    for i in range(len(text) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(text[i], 0)
        if depth == 0:
            head = text[:i]
            for name in tools:
                if head.endswith(name) and not head[: len(head) - len(name)][-1:].isalnum():
                    return name, text[i + 1 : -1]
            return None
    return None


def run_tool(tools: Mapping[str, Tool], name: str, arguments: str) -> str:
    try:
        return str(tools[name](arguments))
    except Exception as err:  # noqa: BLE001 -- a tool's failure is the model's feedback, not the run's
        return f"error: {type(err).__name__}: {err}"


DEPTH = 8  # parenthesis depth tracked exactly; deeper nesting counts as DEPTH (a call that deep is rare)


def paren_table(vocab: Mapping[str, int], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token id and depth before it (0..DEPTH): the depth after its characters, and whether one of
    its `)` brings the depth back to 0 (closes a call). A subword tokenizer has tokens such as `()` or
    `):` that open and close in one piece; tokens without parentheses keep the depth."""
    after = torch.arange(DEPTH + 1).repeat(size, 1)
    closes = torch.zeros(size, DEPTH + 1, dtype=torch.bool)
    for token, i in vocab.items():
        if i >= size or ("(" not in token and ")" not in token):
            continue
        for start in range(DEPTH + 1):
            depth, closed = start, False
            for c in token:
                if c == "(":
                    depth = min(depth + 1, DEPTH)
                elif c == ")" and depth > 0:
                    depth -= 1
                    closed |= depth == 0
            after[i, start], closes[i, start] = depth, closed
    return after, closes


class _CallCloser:
    """Stop condition for `decode`: a row pauses when a `)` (alone or inside a token) brings its
    parenthesis depth back to 0."""

    def __init__(self, table: tuple[torch.Tensor, torch.Tensor], active: torch.Tensor) -> None:
        self.after, self.closes = (t.to(active.device) for t in table)
        self.active = active
        self.depth = torch.zeros_like(active, dtype=torch.long)

    def __call__(self, tok: torch.Tensor) -> torch.Tensor:
        known = tok < self.after.shape[0]  # ids past the tokenizer's vocabulary hold no parenthesis
        t = torch.where(known, tok, 0)
        closes = self.closes[t, self.depth] & known
        self.depth = torch.where(known, self.after[t, self.depth], self.depth)
        return closes & self.active


@dataclass
class ToolRollouts:
    """B rollouts as lists (rows differ in length). Completion = everything after the prompt: model
    tokens and tool output. `model_mask` is 1 on model tokens, 0 on tool output; `logprobs` and `energy`
    (each model token's, from the logits it was sampled from, with all earlier tool output in context) are
    0 on tool output. `calls` counts executed tool calls per row; `texts` are decoded completions."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    model_mask: list[list[int]]
    logprobs: list[list[float]]
    calls: list[int]
    texts: list[str]
    energy: list[list[float]]


@torch.no_grad()
def sample_with_tools(
    model: Any,
    tokenizer: Any,
    prompt_ids: list[list[int]],
    tools: Toolbox | Sequence[Toolbox],
    max_new_tokens: int,
    max_turns: int = 3,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    workers: int = 4,
    *,
    sampling: SamplingSettings | None = None,
    eos_ids: Sequence[int] | None = None,
    head_in_float32: bool = False,
    compact: bool = False,
    turn_cache: bool = False,
) -> ToolRollouts:
    """One completion per prompt (repeat prompts for groups), with tool calls executed between turns:
    `tools` is one toolbox for every row or one per row (`toolboxes`). Every turn re-reads each unfinished
    row's whole context (prompt, its tokens, tool output) and samples with a KV cache until an eos id
    (`eos_ids`, by default `eos_token_ids(model, tokenizer)`), a stop string of `sampling`, the end of its
    token budget, or a closed tool call. Tokens are drawn with
    `sampling`'s processors over the whole context, as `generate` would draw them from it. `compact`: within
    a turn, rows that pause or end leave the KV cache (`decode`'s `compact`: the same tokens, faster when
    rows pause at different steps). `turn_cache`: a row's KV cache lives on from turn to turn, so a turn
    feeds only the row's last token and the tool's output instead of its whole context again (`decode`'s
    `past`: the same logits up to float rounding, so a token may differ, rarely, from a rollout without
    it; its memory is the rows' caches between turns)."""
    if max_turns < 0:
        raise ValueError(f"max_turns: must be >= 0, got {max_turns}")
    vocab = tokenizer.get_vocab()
    missing = [c for c in "()" + OUTPUT_START + OUTPUT_END if c not in vocab]
    if missing:
        raise ValueError(f"tokenizer: needs single tokens for {missing}, the tool-call syntax")
    size = max(max(vocab.values()) + 1, int(getattr(model.config, "vocab_size", 0) or 0))
    parens = paren_table(vocab, size)
    pad_id = tokenizer.pad_token_id
    eos = list(eos_ids) if eos_ids is not None else eos_token_ids(model, tokenizer)
    device = model.device
    rows = len(prompt_ids)
    boxes = toolboxes(tools, rows)
    completion: list[list[int]] = [[] for _ in range(rows)]
    mask: list[list[int]] = [[] for _ in range(rows)]
    logps: list[list[float]] = [[] for _ in range(rows)]
    energy: list[list[float]] = [[] for _ in range(rows)]
    calls, running = [0] * rows, list(range(rows))
    kv: list[RowCache | None] = [None] * rows  # each running row's cache from its last turn (turn_cache)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        while running:
            contexts = [prompt_ids[r] + completion[r] for r in running]
            width = max(map(len, contexts))
            ids = torch.tensor([[pad_id] * (width - len(c)) + c for c in contexts], device=device)
            attn = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts], device=device)
            budget = torch.tensor([max_new_tokens - len(completion[r]) for r in running], device=device)
            can_call = torch.tensor([calls[r] < max_turns for r in running], device=device)
            stop = _CallCloser(parens, can_call)
            out = decode(
                model,
                ids,
                attn,
                budget,
                temperature,
                eos,
                pad_id,
                generator=generator,
                stop=stop,
                sampling=sampling,
                tokenizer=tokenizer,
                head_in_float32=head_in_float32,
                compact=compact,
                past=[kv[r] for r in running] if turn_cache else None,
                keep_cache=turn_cache,
            )
            new, new_mask, new_logp, why, new_energy = out[:5]
            for j, r in enumerate(running):
                kv[r] = out.caches[j] if out.caches is not None else None
            pending = []
            for j, r in enumerate(running):
                n = int(new_mask[j].sum())
                completion[r] += new[j, :n].tolist()
                mask[r] += [1] * n
                logps[r] += new_logp[j, :n].tolist()
                energy[r] += new_energy[j, :n].tolist()
                if int(why[j]) == STOP:  # paused at a closed call: is it a tool call?
                    text = tokenizer.decode(completion[r], skip_special_tokens=True)
                    # a subword token may close the call and go on (`():`): the call is the text up to its
                    # `)`, so the tool still answers it (else the model could write the output itself)
                    call = find_call(text, boxes[r]) or find_call(text[: text.rfind(")") + 1], boxes[r])
                    pending.append((r, call))
            # at most one call per row at a time: a row's own stateful tools need no lock
            results = pool.map(lambda rc: None if rc[1] is None else run_tool(boxes[rc[0]], *rc[1]), pending)
            running = []
            for (r, call), output in zip(pending, results, strict=True):
                room = max_new_tokens - len(completion[r])
                if call is not None:
                    calls[r] += 1
                    out = tokenizer.encode(OUTPUT_START + output + OUTPUT_END, add_special_tokens=False)
                    out = out[: max(0, room)]
                    completion[r] += out
                    mask[r] += [0] * len(out)
                    logps[r] += [0.0] * len(out)
                    energy[r] += [0.0] * len(out)
                if max_new_tokens - len(completion[r]) > 0:
                    running.append(r)
            alive = set(running)
            kv = [c if r in alive else None for r, c in enumerate(kv)]  # free the ended rows' caches
    texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
    return ToolRollouts(prompt_ids, completion, mask, logps, calls, texts, energy)


def sample_texts(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    tools: list[str] | tuple[str, ...] | Toolbox | Sequence[Toolbox] = (),
    max_turns: int = 0,
    on_step: Callable[[], None] | None = None,
    compact: bool = False,
    turn_cache: bool = False,
) -> list[str]:
    """One decoded completion per prompt: with tool calls between turns when `tools` names any, or gives
    them (a mapping, or one per prompt: `toolboxes`), tool output included in the text; else a plain
    single-turn sample (`on_step` after each of its decoding steps). `compact`: ended (and, with tools,
    paused) rows leave the KV cache; `turn_cache`: with tools, a row's KV cache lives from turn to turn."""
    if tools:
        ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
        named = isinstance(tools, list | tuple) and all(isinstance(t, str) for t in tools)
        toolbox = resolve_tools(tools) if named or isinstance(tools, Mapping) else tools
        return sample_with_tools(
            model,
            tokenizer,
            ids,
            toolbox,
            max_new_tokens,
            max_turns,
            temperature,
            generator,
            compact=compact,
            turn_cache=turn_cache,
        ).texts
    return sample(
        model,
        tokenizer,
        prompts,
        1,
        max_new_tokens,
        temperature,
        generator=generator,
        on_step=on_step,
        compact=compact,
    ).texts
