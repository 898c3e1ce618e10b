"""TRL `rollout_func`s on otbrl's sampler. `rollout_func` samples with tool calls between turns
(`otbrl.rollout.sample_with_tools`) and returns `env_mask`, which TRL turns into the `tool_mask` that the
trainer and OTB's generated-token alignment use; `sampler_rollout_func` samples one turn. Both return
`otb_energy`, each model token's energy from the logits it was sampled from, which OTBGRPOTrainer takes
instead of scoring the completions again.

Both sample as TRL's own generation would with the trainer's settings (`sampling_settings`): the
temperature, `top_k`, `top_p`, `min_p`, `repetition_penalty` and `stop_strings`, merged with the model's
generation config as `generate` merges them, drawn through transformers' own logits processors; every eos
id TRL stops at (`trainer.eos_token_ids`); the output head in float32 with `cast_lm_head_to_fp32`. A
setting the sampler does not apply is refused when the trainer is built, never silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from otbrl.rollout.multiturn import (
    Episode,
    Tool,
    episode_seed,
    episode_toolboxes,
    resolve_tools,
    sample_with_tools,
)
from otbrl.rollout.sampler import SamplingSettings, decode, eos_token_ids

ENERGY_FIELD = "otb_energy"  # per row, one energy per completion token (0 on tool output)
SAMPLER_MARK = "otbrl_sampler"  # set on otbrl's rollout functions: OTBGRPOTrainer checks their settings
WAY_OUT = "generate with TRL instead (recipe `sampler: trl`, i.e. no `rollout_func`)"

# Settings the sampler applies, as SamplingSettings' fields.
APPLIED = ("top_k", "top_p", "min_p", "repetition_penalty", "stop_strings")
# generate's own defaults for settings that TRL may leave at None (transformers 4.56 to 5.x): a top_k of
# None in both TRL's and the model's generation config means 50, not "off".
GENERATE_DEFAULTS = {"top_k": 50}
# generation_kwargs that change nothing the sampler draws or returns.
NEUTRAL = {
    "pad_token_id",
    "bos_token_id",
    "cache_implementation",
    "cache_config",
    "disable_compile",
    "compile_config",
    "use_cache",
    "renormalize_logits",
    "low_memory",
    "output_scores",
    "output_logits",
    "output_attentions",
    "output_hidden_states",
    "return_dict_in_generate",
    "num_return_sequences",
    "max_length",
}


def _active(name: str, value: Any) -> bool:
    """Whether `generate` does anything with `value` for this setting (its own conditions, transformers'
    `_get_logits_processor` and `_prepare_generation_config`); unknown settings: anything but None."""
    if value is None:
        return False
    if isinstance(value, list | tuple | dict):  # token lists and biases: an empty one does nothing
        return len(value) > 0
    if name in ("guidance_scale", "encoder_repetition_penalty"):
        return value != 1
    if name in ("no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "min_length", "min_new_tokens"):
        return value > 0
    if name == "typical_p":
        return value < 1.0
    if name in ("epsilon_cutoff", "eta_cutoff"):
        return 0.0 < value < 1.0
    if name in ("num_beams", "num_beam_groups"):
        return value > 1
    if name == "do_sample":
        return value is not True
    if name in ("remove_invalid_values", "diversity_penalty", "penalty_alpha", "token_healing"):
        return bool(value)
    return True


# Settings `generate` reads from the model's generation config when TRL leaves them unset, and that
# would change what it draws: the sampler refuses them when they are active.
NOT_APPLIED = (
    "guidance_scale",
    "sequence_bias",
    "encoder_repetition_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "min_length",
    "min_new_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "top_h",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "watermarking_config",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "penalty_alpha",
    "dola_layers",
    "constraints",
    "force_words_ids",
    "token_healing",
    "max_time",
    "do_sample",
)


def sampling_settings(trainer: Any) -> SamplingSettings:
    """The sampling settings TRL's own generation would use for this trainer, as `SamplingSettings`:
    GRPOConfig's `top_k`, `top_p`, `min_p`, `repetition_penalty`, overridden by `generation_kwargs`
    (TRL's order), each one left at None taken from the model's generation config, then from
    `generate`'s defaults (the merge `generate` does). Raises a ValueError naming the setting and the
    way out for one the sampler would not apply: a `generation_kwargs` key it does not know, a
    `temperature`, `max_new_tokens` or `eos_token_id` there that differs from what TRL's loss and masks
    use, or an active setting of the model's generation config such as `no_repeat_ngram_size`."""
    args = trainer.args
    requested: dict[str, Any] = {
        "temperature": trainer.temperature,
        "top_p": getattr(args, "top_p", 1.0),
        "top_k": getattr(args, "top_k", 0),
        "min_p": getattr(args, "min_p", None),
        "repetition_penalty": getattr(args, "repetition_penalty", 1.0),
        "do_sample": True,
    }
    extra = dict(getattr(args, "generation_kwargs", None) or {})
    model = trainer.accelerator.unwrap_model(trainer.model)
    tokenizer = trainer.processing_class
    fixed = {
        "temperature": trainer.temperature,
        "max_new_tokens": trainer.max_completion_length,
        "eos_token_id": _trainer_eos_ids(trainer, model, tokenizer),
        "do_sample": True,
    }
    for key, value in extra.items():
        if key in fixed:
            same = sorted(_ids(value)) == sorted(fixed[key]) if key == "eos_token_id" else value == fixed[key]
            if not same:
                raise ValueError(
                    f"generation_kwargs[{key!r}]={value!r}: otbrl's sampler uses {fixed[key]!r}, the value "
                    f"TRL's loss and masks assume; remove it from generation_kwargs, or {WAY_OUT}"
                )
        elif key not in APPLIED and key not in NEUTRAL and (key not in NOT_APPLIED or _active(key, value)):
            raise ValueError(
                f"generation_kwargs[{key!r}]={value!r}: otbrl's sampler does not apply this setting "
                f"(it applies temperature, {', '.join(APPLIED)}); remove it, or {WAY_OUT}"
            )
    requested.update(extra)
    declared = getattr(model, "generation_config", None)

    def effective(name: str) -> tuple[Any, str]:
        if requested.get(name) is not None:
            return requested[name], "generation_kwargs" if name in extra else "GRPOConfig"
        value = getattr(declared, name, None)
        if value is not None:
            return value, "the model's generation_config"
        return GENERATE_DEFAULTS.get(name), "generate's default"

    for name in NOT_APPLIED:
        value, where = effective(name)
        if _active(name, value):
            raise ValueError(
                f"{name}={value!r} (from {where}, which generate would apply): otbrl's sampler does not "
                f"apply it; set generation_kwargs={{{name!r}: <a value that turns it off>}} or clear it in "
                f"model.generation_config, or {WAY_OUT}"
            )
    return SamplingSettings(**{name: effective(name)[0] for name in APPLIED})


def _ids(value: Any) -> list[int]:
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _trainer_eos_ids(trainer: Any, model: Any, tokenizer: Any) -> list[int]:
    """The eos ids TRL stops at and masks after (`GRPOTrainer.eos_token_ids`, trl >= 1.16), else the same
    rule computed here."""
    ids = getattr(trainer, "eos_token_ids", None)
    return list(ids) if ids else eos_token_ids(model, tokenizer)


def _head_in_float32(trainer: Any) -> bool:
    return bool(getattr(trainer.args, "cast_lm_head_to_fp32", False))


def rollout_func(
    tools: list[str] | tuple[str, ...] | Mapping[str, Tool] | Episode = ("calc",),
    max_turns: int = 3,
    workers: int = 4,
    compact: bool = False,
    turn_cache: bool = False,
) -> Callable[[list, Any], dict[str, Any]]:
    """A TRL `rollout_func` that samples with tools: `OTBGRPOTrainer(..., rollout_func=rollout_func())`.
    `tools`: names of `otbrl.rollout.default_tools`, a mapping name -> callable, or an episode (a callable
    (seed, prompt text) -> toolbox, `otbrl.rollout.multiturn.Episode`): then every completion gets its
    own toolbox, seeded by the run's seed, the step, the call within the step, the process and the row,
    so the samples of one prompt meet different draws of the environment. Chat prompts (message lists) go
    through the tokenizer's chat template. Reward functions receive `tool_calls` (calls executed per
    completion). `compact`: rows that pause or end leave the KV cache within a turn (the same tokens);
    `turn_cache`: each row's KV cache lives from turn to turn (`sample_with_tools`)."""
    episode = tools if callable(tools) and not isinstance(tools, Mapping) else None
    toolbox = None if episode is not None else resolve_tools(tools)
    calls = {"step": None, "n": 0}  # rollouts within one optimizer step: each gets its own episodes

    def rollout(prompts: list, trainer: Any) -> dict[str, Any]:
        tokenizer = trainer.processing_class
        model = trainer.accelerator.unwrap_model(trainer.model)
        settings = sampling_settings(trainer)
        kwargs = dict(getattr(trainer.args, "chat_template_kwargs", None) or {})
        ids = [prompt_ids(tokenizer, p, **kwargs) for p in prompts]
        if episode is None:
            boxes = toolbox
        else:
            step = trainer.state.global_step
            calls["n"] = calls["n"] + 1 if calls["step"] == step else 0
            calls["step"] = step
            where = (trainer.args.seed, step, calls["n"], trainer.accelerator.process_index)
            seeds = [episode_seed("train", *where, i) for i in range(len(ids))]
            boxes = episode_toolboxes(episode, seeds, [prompt_text(p) for p in prompts])
        was_training = model.training
        model.eval()
        try:
            out = sample_with_tools(
                model,
                tokenizer,
                ids,
                boxes,
                trainer.max_completion_length,
                max_turns,
                trainer.temperature,
                workers=workers,
                sampling=settings,
                eos_ids=_trainer_eos_ids(trainer, model, tokenizer),
                head_in_float32=_head_in_float32(trainer),
                compact=compact,
                turn_cache=turn_cache,
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

    setattr(rollout, SAMPLER_MARK, True)
    return rollout


def prompt_ids(tokenizer: Any, prompt: str | list[dict[str, Any]], **template: Any) -> list[int]:
    """A prompt's token ids: plain text as it is, chat messages through the tokenizer's chat template with
    the generation prompt (transformers 5 returns a mapping there, 4.x a list)."""
    if isinstance(prompt, str):
        return list(tokenizer(text=prompt, add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, **template)
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    """A prompt as text for an episode: itself, or its messages' contents joined by blank lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n\n".join(str(m.get("content", "")) for m in prompt)


def sampler_rollout_func(compact: bool = False) -> Callable[[list, Any], dict[str, Any]]:
    """A single-turn TRL `rollout_func` through otbrl's KV-cache sampler (`otbrl.rollout.sampler.decode`):
    each token's energy comes from the logits it was sampled from (`otb_energy`), so OTB needs no extra
    forward pass. Chat prompts (message lists) go through the tokenizer's chat template. `compact`: rows
    that have ended leave the KV cache (`decode`'s `compact`)."""

    def rollout(prompts: list, trainer: Any) -> dict[str, Any]:
        tokenizer = trainer.processing_class
        model = trainer.accelerator.unwrap_model(trainer.model)
        settings = sampling_settings(trainer)
        kwargs = dict(getattr(trainer.args, "chat_template_kwargs", None) or {})
        ids = [prompt_ids(tokenizer, p, **kwargs) for p in prompts]
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
                    _trainer_eos_ids(trainer, model, tokenizer),
                    pad,
                    sampling=settings,
                    tokenizer=tokenizer,
                    head_in_float32=_head_in_float32(trainer),
                    compact=compact,
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

    setattr(rollout, SAMPLER_MARK, True)
    return rollout
