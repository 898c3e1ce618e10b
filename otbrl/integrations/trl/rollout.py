"""TRL `rollout_func`s on otbrl's sampler. `rollout_func` samples with tool calls between turns
(`otbrl.rollout.sample_with_tools`) and returns `env_mask`, which TRL turns into the `tool_mask` that the
trainer and OTB's generated-token alignment use; `sampler_rollout_func` samples one turn. Both return
`otb_energy`, each model token's energy from the logits it was sampled from, which OTBGRPOTrainer takes
instead of scoring the completions again."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from otbrl.rollout.multiturn import Tool, resolve_tools, sample_with_tools
from otbrl.rollout.sampler import decode

ENERGY_FIELD = "otb_energy"  # per row, one energy per completion token (0 on tool output)


def rollout_func(
    tools: list[str] | tuple[str, ...] | Mapping[str, Tool] = ("calc",), max_turns: int = 3, workers: int = 4
) -> Callable[[list, Any], dict[str, Any]]:
    """A TRL `rollout_func` that samples with tools: `OTBGRPOTrainer(..., rollout_func=rollout_func())`.
    Prompts must be plain text. Reward functions receive `tool_calls` (calls executed per completion)."""
    toolbox = resolve_tools(tools)

    def rollout(prompts: list, trainer: Any) -> dict[str, Any]:
        if any(not isinstance(p, str) for p in prompts):
            raise ValueError("rollout_func: tool rollouts take plain-text prompts, not chat messages")
        tokenizer = trainer.processing_class
        model = trainer.accelerator.unwrap_model(trainer.model)
        was_training = model.training
        model.eval()
        try:
            ids = tokenizer(text=prompts, add_special_tokens=False)["input_ids"]
            out = sample_with_tools(
                model,
                tokenizer,
                ids,
                toolbox,
                trainer.max_completion_length,
                max_turns,
                trainer.temperature,
                workers=workers,
            )
        finally:
            model.train(was_training)
        return {
            "prompt_ids": out.prompt_ids,
            "completion_ids": out.completion_ids,
            "logprobs": out.logprobs,
            "env_mask": out.model_mask,
            "tool_calls": out.calls,
            ENERGY_FIELD: out.energy,
        }

    return rollout


def sampler_rollout_func() -> Callable[[list, Any], dict[str, Any]]:
    """A single-turn TRL `rollout_func` through otbrl's KV-cache sampler (`otbrl.rollout.sampler.decode`):
    each token's energy comes from the logits it was sampled from (`otb_energy`), so OTB needs no extra
    forward pass. Chat prompts (message lists) go through the tokenizer's chat template."""

    def rollout(prompts: list, trainer: Any) -> dict[str, Any]:
        tokenizer = trainer.processing_class
        model = trainer.accelerator.unwrap_model(trainer.model)
        kwargs = dict(getattr(trainer.args, "chat_template_kwargs", None) or {})
        ids = [
            tokenizer(text=p, add_special_tokens=False)["input_ids"]
            if isinstance(p, str)
            else tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, **kwargs)
            for p in prompts
        ]
        ids = [list(i["input_ids"]) if isinstance(i, Mapping) else list(i) for i in ids]
        width = max(map(len, ids))
        pad = tokenizer.pad_token_id
        padded = torch.tensor([[pad] * (width - len(i)) + i for i in ids], device=model.device)
        attention = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids], device=model.device)
        was_training = model.training
        model.eval()
        try:
            with trainer.accelerator.autocast():  # the precision the training forward runs in (bf16, ...)
                out = decode(
                    model,
                    padded,
                    attention,
                    trainer.max_completion_length,
                    trainer.temperature,
                    tokenizer.eos_token_id,
                    pad,
                )
        finally:
            model.train(was_training)
        lengths = out.completion_mask.sum(1).tolist()
        rows = lambda t: [r[:n] for r, n in zip(t.tolist(), lengths, strict=True)]  # noqa: E731
        return {
            "prompt_ids": ids,
            "completion_ids": rows(out.completion_ids),
            "logprobs": rows(out.logprobs),
            ENERGY_FIELD: rows(out.energy),
        }

    return rollout
