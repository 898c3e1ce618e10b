"""A TRL `rollout_func` that samples with tool calls between turns (`otbrl.rollout.sample_with_tools`):
it returns TRL's rollout dict with `env_mask`, which TRL turns into the `tool_mask` that the trainer and
OTB's generated-token alignment use, and `otb_energy`, each model token's energy from the logits it was
sampled from, which OTBGRPOTrainer takes instead of scoring the completions again."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from otbrl.rollout.multiturn import Tool, resolve_tools, sample_with_tools

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
                model, tokenizer, ids, toolbox, trainer.max_completion_length, max_turns,
                trainer.temperature, workers=workers,
            )  # fmt: skip
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
