"""Exact per-token squared score norms ||grad_theta log pi(y_t)||^2 for small torch models: the quantity
the Logit-Gradient Proxy approximates, and the `otb_exact` estimator built on it.

Cost: one forward pass per sequence plus one backward pass per policy token (vectorised with
torch.func.vmap in the default method), and memory for (policy tokens x parameters) gradients of one
sequence at a time. Fine for models of up to a few million parameters; a research reference, not a
training path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.func import functional_call, jacrev

from otbrl.estimators import ESTIMATORS, otb, register_estimator
from otbrl.inputs import Rollouts, check_temperature

METHODS = ("vmap", "loop")


def _logits(model: torch.nn.Module, params: dict, ids: torch.Tensor) -> torch.Tensor:
    out = functional_call(model, params, (ids[None],))
    return (out.logits if hasattr(out, "logits") else out)[0]


def score_sq_norms(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
    method: str = "vmap",
) -> torch.Tensor:
    """Exact ||grad_theta log softmax(z_{t-1} / T)[x_t]||^2 for every policy token.

    model: maps (1, L) token ids to logits (1, L, V) (or an output with `.logits`), e.g. a transformers
        causal LM; trainable parameters are those with requires_grad.
    input_ids: (B, L) full sequences (prompt + response). mask: (B, T) with T <= L, aligned with the
        last T columns of input_ids; 1 marks policy tokens (never the first column of input_ids).
    method: "vmap" (torch.func.jacrev, fast) or "loop" (one autograd backward per token, for models
        that vmap cannot trace).
    Returns (B, T) float64, zero where mask == 0.
    """
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    check_temperature(temperature)
    if input_ids.dim() != 2 or mask.dim() != 2 or mask.shape[0] != input_ids.shape[0]:
        raise ValueError(
            f"mask: shape {tuple(mask.shape)} is not (B, T) for input_ids {tuple(input_ids.shape)}"
        )
    offset = input_ids.shape[1] - mask.shape[1]
    if offset < 0:
        raise ValueError("mask: has more columns than input_ids")
    keep = mask.bool()
    if offset == 0 and keep[:, 0].any():
        raise ValueError("mask: the first token of a sequence has no logits that predict it")
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}
    frozen.update(dict(model.named_buffers()))
    out = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    was_training = model.training
    model.eval()  # dropout would make the score random
    try:
        for row in range(input_ids.shape[0]):
            cols = keep[row].nonzero().flatten()
            if cols.numel() == 0:
                continue
            ids, pos = input_ids[row], cols + offset

            def token_logprobs(p: dict, ids=ids, pos=pos) -> torch.Tensor:
                logits = _logits(model, {**p, **frozen}, ids)[pos - 1]
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
                return torch.log_softmax(logits, dim=-1).gather(-1, ids[pos][:, None]).squeeze(-1)

            if method == "vmap":
                grads = jacrev(token_logprobs)(params)
                flat = [g.reshape(cols.numel(), -1) for g in grads.values()]
                sq = sum(f.double().square().sum(dim=1) for f in flat)
            else:
                with torch.enable_grad():
                    live = {k: v.clone().requires_grad_(True) for k, v in params.items()}
                    lp = token_logprobs(live)
                    sq = torch.stack(
                        [
                            sum(
                                g.double().square().sum()
                                for g in torch.autograd.grad(lp[k], list(live.values()), retain_graph=True)
                            )
                            for k in range(cols.numel())
                        ]
                    )
            out[row, cols] = sq.to(out.device)
    finally:
        model.train(was_training)
    return out


@register_estimator(
    "otb_exact",
    options=("model", "input_ids", "temperature", "method", *ESTIMATORS["otb"].options),
    masked_output=True,
    needs_model=True,
)
def otb_exact(
    batch: Rollouts,
    *,
    model: torch.nn.Module | None = None,
    input_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    method: str = "vmap",
    **otb_options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB with exact per-token score norms ||grad_theta log pi(y_t)||^2 as the energy (the limit the
    Logit-Gradient Proxy approximates). Needs `model` and `input_ids` (see `score_sq_norms`); takes
    otb's options. With `energy=` given instead, that energy is used as is."""
    if batch.energy is None:
        if model is None or input_ids is None:
            raise ValueError("model: otb_exact needs model= and input_ids= (or precomputed energy=)")
        energy = score_sq_norms(model, input_ids, batch.mask, temperature=temperature, method=method)
        batch = dataclasses.replace(batch, energy=energy.to(batch.mask.device))
    return otb(batch, **otb_options)
