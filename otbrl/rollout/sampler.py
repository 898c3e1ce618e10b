"""Batched sampling from a causal LM with a hand-written KV-cache loop that also returns the log-probs
and the energy of the sampled tokens, both from the logits each token was sampled from: the rollouts an
RL step needs, with the layout TRL uses (each prompt's samples are consecutive rows), and no second
forward to score them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from otbrl import lm
from otbrl.energy import token_energy


@dataclass
class Samples:
    """Rollouts for `len(prompts) * num_samples` rows, B of them; T is the longest completion (<= the
    `max_new_tokens` asked for).

    prompt_ids      (B, P) long, left-padded with pad
    prompt_mask     (B, P) long, 1 on real prompt tokens
    completion_ids  (B, T) long, sampled tokens, pad after eos (and after T for rows that never end)
    completion_mask (B, T) long, 1 on generated tokens up to and including eos
    logprobs        (B, T) float32, log pi(token) at the sampling temperature; 0 where the mask is 0
    group_ids       (B,)   long, index of the prompt each row came from
    texts           B decoded completions without special tokens
    energy          (B, T) float32, ||e_y - pi||^2 of each sampled token under the distribution it was
                    sampled from (the model's logits at the sampling temperature); 0 where the mask is 0
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    group_ids: torch.Tensor
    texts: list[str]
    energy: torch.Tensor | None = None
    rewards: torch.Tensor | None = None  # (B,) once scored (the sampler does not score)

    @property
    def input_ids(self) -> torch.Tensor:
        """(B, P + T) prompt then completion: what a teacher-forced forward over the rollout reads."""
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """(B, P + T) 1 on real prompt and generated tokens."""
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    @property
    def mask(self) -> torch.Tensor:
        """(B, T) policy tokens, aligned with the last T columns of `input_ids` (the estimators' mask)."""
        return self.completion_mask


class Decoded(NamedTuple):
    """What `decode` returns: completion_ids (B, T) padded with pad, completion_mask (B, T), logprobs
    (B, T), reason (B,) why each row ended (0 eos, 1 budget, 2 stop) and energy (B, T); logprobs and
    energy are float32 and 0 where the mask is 0."""

    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    reason: torch.Tensor
    energy: torch.Tensor


@torch.no_grad()
def sample(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    num_samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> Samples:
    """Sample `num_samples` completions of each prompt, at most `max_new_tokens` tokens each (eos
    included). `temperature == 0` decodes greedily and reports log-probs and energy at temperature 1.
    Rows stop at eos; the loop ends when every row has. `generator` (on the model's device) makes it
    reproducible."""
    if num_samples < 1 or max_new_tokens < 1:
        raise ValueError("num_samples and max_new_tokens must be >= 1")
    if temperature < 0:
        raise ValueError(f"temperature: must be >= 0, got {temperature}")
    device = model.device
    enc = tokenizer(prompts, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt")
    prompt_ids = enc["input_ids"].to(device).repeat_interleave(num_samples, dim=0)  # (B, P)
    prompt_mask = enc["attention_mask"].to(device).repeat_interleave(num_samples, dim=0)  # (B, P)
    group_ids = torch.arange(len(prompts), device=device).repeat_interleave(num_samples)  # (B,)
    out = decode(
        model,
        prompt_ids,
        prompt_mask,
        max_new_tokens,
        temperature,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        generator=generator,
    )
    return Samples(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=out.completion_ids,
        completion_mask=out.completion_mask,
        logprobs=out.logprobs,
        group_ids=group_ids,
        texts=tokenizer.batch_decode(out.completion_ids.tolist(), skip_special_tokens=True),
        energy=out.energy,
    )


@torch.no_grad()
def decode(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    max_new_tokens: int | torch.Tensor,
    temperature: float,
    eos_id: int,
    pad_id: int,
    generator: torch.Generator | None = None,
    stop: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Decoded:
    """The KV-cache sampling loop on left-padded ids (B, P). A row ends at eos, after its own budget
    (`max_new_tokens`, an int or a (B,) tensor), or when `stop(tokens (B,)) -> (B,) bool` says so (called
    once per step with the tokens just sampled; it may keep state). Returns a `Decoded`: the tokens, their
    mask, and each token's log-prob and energy from the very logits it was sampled from (the model's own,
    so any soft-capping or logit scale is in them), at `temperature` (1 when decoding greedily)."""
    device = prompt_ids.device
    batch = prompt_ids.shape[0]
    budget = torch.as_tensor(max_new_tokens, device=device).expand(batch)
    attention_mask = prompt_mask
    positions = lm.positions(prompt_mask)  # left padding: first real token at 0
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=prompt_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    next_pos = positions[:, -1:] + 1  # (B, 1)

    tokens, logps, masks, energies = [], [], [], []
    done = budget <= 0
    reason = torch.ones(batch, dtype=torch.long, device=device)
    for step in range(int(budget.max().item()) if batch else 0):
        logits = out.logits[:, -1].float()  # (B, V)
        logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        if temperature == 0:
            tok = logits.argmax(-1)
        else:
            tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        live = ~done
        tok = torch.where(live, tok, pad_id)
        tokens.append(tok)
        logps.append(torch.where(live, logp.gather(-1, tok[:, None]).squeeze(-1), 0.0))
        energies.append(torch.where(live, token_energy(logits, tok, temperature or 1.0), 0.0))
        masks.append(live.long())
        ended_eos = live & (tok == eos_id)
        ended_stop = live & ~ended_eos & stop(tok) if stop is not None else torch.zeros_like(live)
        reason = torch.where(ended_eos, 0, torch.where(ended_stop, 2, reason))
        done = done | ended_eos | ended_stop | (budget <= step + 1)
        if bool(done.all()):
            break
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=-1)
        out = model(
            input_ids=tok[:, None],
            attention_mask=attention_mask,
            position_ids=next_pos,
            past_key_values=cache,
            use_cache=True,
        )
        next_pos = next_pos + 1

    if not tokens:
        empty = torch.zeros(batch, 0, dtype=torch.long, device=device)
        return Decoded(empty, empty, empty.float(), reason, empty.float())
    return Decoded(
        torch.stack(tokens, 1), torch.stack(masks, 1), torch.stack(logps, 1), reason, torch.stack(energies, 1)
    )
