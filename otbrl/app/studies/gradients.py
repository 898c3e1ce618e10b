"""Batches of the variance study at a fixed checkpoint: sampled completions, their teacher-forced
log-probs (with autograd graph) and energies (proxy, or exact score norms), advantages from each
estimator, and the policy-gradient estimate each gives, one backward pass apiece."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

import otbrl
from otbrl.energy import token_energy
from otbrl.exact import score_sq_norms
from otbrl.lm import positions, predicting

if TYPE_CHECKING:
    from otbrl.rollout import Samples

# label -> (registered estimator, its options, which energy it reads: None, "proxy" or "exact")
Setting = tuple[str, dict[str, Any], str | None]


def draw(model: Any, tokenizer: Any, task: Any, rows: list[dict], n: int, gen: torch.Generator) -> Samples:
    """Sample n completions of each row's prompt at temperature 1 and score them."""
    from otbrl.rollout import sample

    s = sample(
        model, tokenizer, [r["prompt"] for r in rows], n, task.max_completion_tokens, 1.0, generator=gen
    )
    rewards = [
        task.reward(text, rows[g]["answer"]) for text, g in zip(s.texts, s.group_ids.tolist(), strict=True)
    ]
    return replace(s, rewards=torch.tensor(rewards))


@dataclass
class Bench:
    """What every batch is drawn with: the policy, a pool of fresh prompts, one sampling generator; and
    the seconds spent per phase."""

    model: Any
    tokenizer: Any
    task: Any
    pool: Iterator[dict]
    gen: torch.Generator
    prompts: int
    seconds: dict[str, float] = field(
        default_factory=lambda: {"sampling": 0.0, "gradients": 0.0, "exact norms": 0.0}
    )

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[phase] += time.perf_counter() - start

    def batch(self, n: int) -> Samples:
        with self.timed("sampling"):
            return draw(self.model, self.tokenizer, self.task, [next(self.pool) for _ in range(self.prompts)],
                        n, self.gen)  # fmt: skip


def token_logprobs(model: torch.nn.Module, r: Samples) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) log pi(y_t) of the policy tokens, with autograd graph, and their proxy energy w_t (no graph);
    both 0 where mask == 0. Positions skip the left padding, as in the sampler."""
    width = r.mask.shape[1]
    attention = r.attention_mask
    out = model(input_ids=r.input_ids, attention_mask=attention, position_ids=positions(attention))
    logits = predicting(out.logits, width)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    tokens = r.input_ids[:, -width:]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    keep = r.mask.bool()
    return torch.where(keep, logp, 0.0), torch.where(keep, token_energy(logits.detach(), tokens), 0.0)


def exact_energy(model: torch.nn.Module, r: Samples) -> torch.Tensor:
    """(B, T) float64 exact ||grad_theta log pi(y_t)||^2. score_sq_norms runs the model without an
    attention mask, so rows are grouped by their left padding and called with it cut off."""
    lead = (r.attention_mask.cumsum(-1) == 0).sum(-1)
    out = torch.zeros(r.mask.shape, dtype=torch.float64)
    for pad in lead.unique().tolist():
        rows = (lead == pad).nonzero().flatten()
        out[rows] = score_sq_norms(model, r.input_ids[rows, pad:], r.mask[rows])
    return out


def estimator_advantages(
    r: Samples, settings: dict[str, Setting], energy: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """label -> (B, T) advantages from `otbrl.compute_advantages`, one per setting; `energy` maps the
    settings' energy sources ("proxy", "exact") to (B, T) energies."""
    out = {}
    for label, (name, options, source) in settings.items():
        out[label] = otbrl.compute_advantages(
            name,
            rewards=r.rewards,
            mask=r.mask,
            group_ids=r.group_ids,
            energy=energy[source] if source else None,
            **options,
        ).advantages
    return out


def policy_gradients(
    model: torch.nn.Module, logp: torch.Tensor, advantages: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """label -> flat g = (1/B) sum_i sum_t A_it grad log pi(y_it): one backward per estimator through the
    one forward graph of `logp` (B, T)."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = {}
    for i, (label, adv) in enumerate(advantages.items()):
        loss = (adv.to(logp.dtype) * logp).sum() / logp.shape[0]
        grads = torch.autograd.grad(loss, params, retain_graph=i < len(advantages) - 1)
        out[label] = torch.cat([g.reshape(-1) for g in grads])
    return out
