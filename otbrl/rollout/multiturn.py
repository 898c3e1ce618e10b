"""Multi-turn rollouts with tools: the model writes a call `name(arguments)`, generation pauses when the
call's parentheses close, the tool runs, its output comes back into the context as `:output;` (mask 0:
never trained on, no energy, no advantage), and generation resumes, up to `max_turns` tool calls.

`sample_with_tools` is the loop; `otbrl.integrations.trl.rollout_func` plugs it into TRL, and
`sample_texts` serves evaluation and warm starts.

After `max_turns` calls, a further call is left as plain text: it does not pause and gets no output.
Tool output is cut to fit the completion budget. A tool that raises returns its error as its output;
the rollout never fails because of a tool.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from otbrl.rollout.sampler import STOP, SamplingSettings, decode, eos_token_ids, sample
from otbrl.tools import calculator, run_python

Tool = Callable[[str], str]
OUTPUT_START, OUTPUT_END = ":", ";"  # around a tool's output in the context


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


class _CallCloser:
    """Stop condition for `decode`: a row pauses when a `)` brings its parenthesis depth back to 0."""

    def __init__(self, open_id: int, close_id: int, active: torch.Tensor) -> None:
        self.open_id, self.close_id, self.active = open_id, close_id, active
        self.depth = torch.zeros_like(active, dtype=torch.long)

    def __call__(self, tok: torch.Tensor) -> torch.Tensor:
        closes = (tok == self.close_id) & (self.depth > 0)
        self.depth = (self.depth + (tok == self.open_id).long() - closes.long()).clamp_min(0)
        return closes & (self.depth == 0) & self.active


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
    tools: Mapping[str, Tool],
    max_new_tokens: int,
    max_turns: int = 3,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    workers: int = 4,
    *,
    sampling: SamplingSettings | None = None,
    eos_ids: Sequence[int] | None = None,
    head_in_float32: bool = False,
) -> ToolRollouts:
    """One completion per prompt (repeat prompts for groups), with tool calls executed between turns.
    Every turn re-reads each unfinished row's whole context (prompt, its tokens, tool output) and samples
    with a KV cache until an eos id (`eos_ids`, by default `eos_token_ids(model, tokenizer)`), a stop
    string of `sampling`, the end of its token budget, or a closed tool call. Tokens are drawn with
    `sampling`'s processors over the whole context, as `generate` would draw them from it."""
    if max_turns < 0:
        raise ValueError(f"max_turns: must be >= 0, got {max_turns}")
    vocab = tokenizer.get_vocab()
    missing = [c for c in "()" + OUTPUT_START + OUTPUT_END if c not in vocab]
    if missing:
        raise ValueError(f"tokenizer: needs single tokens for {missing}, the tool-call syntax")
    pad_id = tokenizer.pad_token_id
    eos = list(eos_ids) if eos_ids is not None else eos_token_ids(model, tokenizer)
    device = model.device
    rows = len(prompt_ids)
    completion: list[list[int]] = [[] for _ in range(rows)]
    mask: list[list[int]] = [[] for _ in range(rows)]
    logps: list[list[float]] = [[] for _ in range(rows)]
    energy: list[list[float]] = [[] for _ in range(rows)]
    calls, running = [0] * rows, list(range(rows))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        while running:
            contexts = [prompt_ids[r] + completion[r] for r in running]
            width = max(map(len, contexts))
            ids = torch.tensor([[pad_id] * (width - len(c)) + c for c in contexts], device=device)
            attn = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts], device=device)
            budget = torch.tensor([max_new_tokens - len(completion[r]) for r in running], device=device)
            can_call = torch.tensor([calls[r] < max_turns for r in running], device=device)
            stop = _CallCloser(vocab["("], vocab[")"], can_call)
            new, new_mask, new_logp, why, new_energy = decode(
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
            )
            pending = []
            for j, r in enumerate(running):
                n = int(new_mask[j].sum())
                completion[r] += new[j, :n].tolist()
                mask[r] += [1] * n
                logps[r] += new_logp[j, :n].tolist()
                energy[r] += new_energy[j, :n].tolist()
                if int(why[j]) == STOP:  # paused at a closed call: is it a tool call?
                    text = tokenizer.decode(completion[r], skip_special_tokens=True)
                    call = find_call(text, tools)
                    pending.append((r, call))
            results = pool.map(lambda rc: None if rc[1] is None else run_tool(tools, *rc[1]), pending)
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
    texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
    return ToolRollouts(prompt_ids, completion, mask, logps, calls, texts, energy)


def sample_texts(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    tools: list[str] | tuple[str, ...] | Mapping[str, Tool] = (),
    max_turns: int = 0,
    on_step: Callable[[], None] | None = None,
    compact: bool = False,
) -> list[str]:
    """One decoded completion per prompt: with tool calls between turns when `tools` names any (tool
    output included in the text), else a plain single-turn sample (`on_step` after each of its decoding
    steps; `compact`: ended rows leave the KV cache)."""
    if tools:
        ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
        toolbox = resolve_tools(tools)
        return sample_with_tools(
            model, tokenizer, ids, toolbox, max_new_tokens, max_turns, temperature, generator=generator
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
