"""How a causal language model turns its final hidden states into the logits it samples from, and how
those outputs line up with the tokens they score (the output at position t predicts token t + 1).

Every place in otbrl that scores completion tokens with a model goes through here: `predicting` (the
next-token shift), `head_transform` (logit scale and final soft-capping, read from the config for every
family TRL's fused head supports), `full_head` (the output head's whole weight when it is sharded by
FSDP2 or DeepSpeed ZeRO-3) and `completion_energy` (the energy of each completion token under the
distribution the model samples from, at the sampling temperature). A model whose logits differ from
what otbrl rebuilds gets an error (`check_head`), never a silently different distribution.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

from otbrl.energy import token_energy
from otbrl.fused import fused_token_stats
from otbrl.inputs import check_temperature

# Elements of one float32 logits tile when logits have to be formed (soft-capped heads, adapted heads,
# `from_logits`): 16 MiB, whatever the number of tokens.
TILE_ELEMENTS = 1 << 22

WAY_OUT = (
    "compute the energy from the model's own logits instead (OTBGRPOConfig(energy_from_logits=True), or "
    "otbrl.lm.completion_energy(..., from_logits=True)), which tiles the model's forward over rows"
)


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) position ids of left- (or right-) padded rows, as generation numbers them: each row's first
    real token is at 0. Models with absolute position embeddings score a padded row differently
    without them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def predicting(outputs: torch.Tensor, n: int) -> torch.Tensor:
    """(B, L, ...) per-position outputs (logits or hidden states) of a causal LM run over L tokens ->
    (B, n, ...): the outputs at the positions that predict the last n of those tokens."""
    length = outputs.shape[1]
    if not 0 <= n < length:
        raise ValueError(f"n: {n} tokens cannot be predicted from {length} positions (need 0 <= n < L)")
    return outputs[:, length - n - 1 : length - 1]


# ----------------------------------------------------------------------------------------------------------
# the head transform
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadTransform:
    """What a model does to `hidden @ W.T + b` before sampling: multiply by `scale`, then soft-cap
    (`softcap * tanh(z / softcap)`, when set). Dividing by the temperature comes after both.

    `origin` says where it came from: "declared" (built by hand, for a bare head), "config" (read by
    `head_transform`, unverified: a model can do more than its config says) or "checked" (returned by
    `check_head`, verified against the model's own logits). `head_energy` refuses "config"."""

    scale: float = 1.0
    softcap: float | None = None
    origin: str = field(default="declared", compare=False)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) raw head outputs -> (..., V) the model's logits (a new tensor only when needed)."""
        z = logits if self.scale == 1.0 else logits * self.scale
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z


def _number(name: str, value: Any, owner: str) -> float:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value > 0):
        raise ValueError(
            f"model: {owner} sets {name}={value!r}, which otbrl does not recognise as an output-head "
            f"transform (expected a finite number > 0); {WAY_OUT}"
        )
    return float(value)


def head_transform(model_or_config: Any) -> HeadTransform:
    """The head transform a model's config declares (unverified: `check_head` verifies it). Recognised,
    as in TRL's fused head: Gemma-2/3 `final_logit_softcapping`, and RecurrentGemma's `logits_soft_cap`
    (which TRL 1.16 does not read); a multiplier `logit_scale` (Cohere), `output_multiplier` or
    `lm_head_multiplier` (Falcon-H1); `logits_scaling`, which Granite and MiniCPM3 divide by and
    HyperCLOVA X multiplies by. The first multiplier found wins, as in the models themselves."""
    config = getattr(model_or_config, "config", model_or_config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    owner = type(model_or_config).__name__
    softcap = None
    for name in ("final_logit_softcapping", "logits_soft_cap"):
        value = getattr(text, name, None)
        if value is not None:
            softcap = _number(name, value, owner)
            break
    scale = 1.0
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(text, name, None)
        if value is not None:
            scale = _number(name, value, owner)
            break
    else:
        value = getattr(text, "logits_scaling", None)
        if value is not None:
            value = _number("logits_scaling", value, owner)
            scale = value if getattr(text, "model_type", None) == "hyperclovax" else 1.0 / value
    return HeadTransform(scale=scale, softcap=softcap, origin="config")


# ----------------------------------------------------------------------------------------------------------
# the parts of a model
# ----------------------------------------------------------------------------------------------------------


def base_model(model: Any) -> Any:
    """The transformers model under a PEFT wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_of(model: Any) -> torch.nn.Module:
    """The module whose output is the final hidden states (after the last norm)."""
    base = base_model(model)
    if hasattr(base, "get_decoder"):
        decoder = base.get_decoder()
        if decoder is not None:
            return decoder
    decoder = getattr(base, getattr(base, "base_model_prefix", "model"), None)
    if not isinstance(decoder, torch.nn.Module):
        raise ValueError(f"model: cannot find the decoder of {type(base).__name__}; {WAY_OUT}")
    return decoder


def _is_plain_linear(head: torch.nn.Module) -> bool:
    """A head whose output is exactly F.linear(h, head.weight, head.bias): nn.Linear itself, or a subclass
    (such as FSDP2's wrapper class) that keeps its forward."""
    return isinstance(head, torch.nn.Linear) and type(head).forward is torch.nn.Linear.forward


def _vocab(head: torch.nn.Module) -> int:
    """Output width of a head module (an adapter wrapper exposes its base layer's weight)."""
    width = getattr(head, "out_features", None)
    return int(width) if width is not None else int(head.weight.shape[0])


def _zero3_gather(params: list[torch.nn.Parameter]) -> Any:
    """DeepSpeed ZeRO-3 keeps a partitioned parameter empty outside its module's forward: gather the head's
    parameters for a direct read (deepspeed.zero.GatheredParameters, read-only), skipping those already
    available (a tied head inside the embedding's forward). A null context without ZeRO-3."""
    partitioned = [p for p in params if p is not None and hasattr(p, "ds_id")]
    if not partitioned:
        return nullcontext()
    import deepspeed  # heavy and optional: present only where a ZeRO-3 run put partitioned parameters here
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    unique = {id(p): p for p in partitioned if p.ds_status != ZeroParamStatus.AVAILABLE}
    if not unique:
        return nullcontext()
    return deepspeed.zero.GatheredParameters(list(unique.values()), modifier_rank=None)


@contextmanager
def full_head(head: torch.nn.Module) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight (V, H), bias (V,) or None) of a linear output head, whole: an FSDP2 head's DTensor shards
    are all-gathered (every rank must call this together), a ZeRO-3 head is gathered for the duration."""
    weight, bias = head.weight, getattr(head, "bias", None)
    with _zero3_gather([weight, bias]):
        if hasattr(weight, "full_tensor"):  # a DTensor (FSDP2, tensor parallel)
            weight = weight.full_tensor()
            bias = bias.full_tensor() if bias is not None and hasattr(bias, "full_tensor") else bias
        yield weight, bias


@torch.no_grad()
def final_hidden(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int = 1
) -> tuple[torch.Tensor, Any]:
    """(B, L, H) final hidden states and the model's own output, from one call of the whole model: its
    wrappers' hooks (FSDP2 unsharding, ZeRO-3 gathering, PEFT adapters) run as in training. The hidden
    states are read from the decoder with a forward hook; only the last `logits_to_keep` positions get
    logits (0: all of them)."""
    seen: list[torch.Tensor] = []

    def grab(module: torch.nn.Module, args: Any, output: Any) -> None:
        seen.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    handle = decoder_of(model).register_forward_hook(grab)
    try:
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions(attention_mask),
            use_cache=False,
            logits_to_keep=logits_to_keep,
        )
    finally:
        handle.remove()
    if len(seen) != 1:
        raise ValueError(
            f"model: the decoder of {type(base_model(model)).__name__} ran {len(seen)} times in one forward; "
            f"{WAY_OUT}"
        )
    return seen[0], out


# ----------------------------------------------------------------------------------------------------------
# energy
# ----------------------------------------------------------------------------------------------------------


def _tiled_energy(
    hidden: torch.Tensor, tokens: torch.Tensor, temperature: float, logits_of: Any, vocab: int
) -> torch.Tensor:
    """Energy of (N,) tokens from (N, H) hidden states, forming the (rows, V) logits `logits_of(rows of
    hidden)` one row tile at a time."""
    step = max(1, TILE_ELEMENTS // max(1, vocab))
    out = [
        token_energy(logits_of(hidden[r0 : r0 + step]), tokens[r0 : r0 + step], temperature).float()
        for r0 in range(0, hidden.shape[0], step)
    ]
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


@torch.no_grad()
def head_energy(
    head: torch.nn.Module,
    transform: HeadTransform,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """(..., H) final hidden states, (...) tokens -> (...) float32 energy of each token under
    softmax(transform(head(hidden)) / temperature).

    A linear head with no soft-capping stays fused (`otbrl.fused_token_stats`, no (tokens x vocabulary)
    logits): a scale s only changes the temperature, softmax(s z / T) = softmax(z / (T / s)). Soft-capping
    is not linear, so those logits are formed one row tile at a time; so are those of a head that is not a
    plain linear layer (e.g. with a PEFT adapter), through the head module itself.

    `transform` must be verified (from `check_head(model)`) or declared by hand for a bare head; one read
    from a config by `head_transform` is refused, as the model may do more than its config says."""
    check_temperature(temperature)
    if not isinstance(transform, HeadTransform) or transform.origin == "config":
        raise ValueError(
            "transform: expected a HeadTransform verified by otbrl.lm.check_head(model) (or one declared "
            "for a bare head), not one read from a config by head_transform, which nothing has checked"
        )
    shape = tokens.shape
    h, y = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)
    if not _is_plain_linear(head):

        def adapted(x: torch.Tensor) -> torch.Tensor:
            return transform(head(x).float())

        return _tiled_energy(h, y, temperature, adapted, _vocab(head)).reshape(shape)
    with full_head(head) as (weight, bias):
        if transform.softcap is None:
            stats = fused_token_stats(h, weight, y, temperature=temperature / transform.scale, bias=bias)
            return stats.energy.float().reshape(shape)

        def capped(x: torch.Tensor) -> torch.Tensor:
            dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
            return transform(
                F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
            )

        return _tiled_energy(h, y, temperature, capped, weight.shape[0]).reshape(shape)


@torch.no_grad()
def completion_energy(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    n: int,
    temperature: float,
    *,
    rows: int | None = None,
    from_logits: bool = False,
    transform: HeadTransform | None = None,
) -> torch.Tensor:
    """(B, n) float32 energy of the last n tokens of `input_ids` (B, L) under the distribution the model
    samples from at `temperature`, each token scored with everything before it visible (as far as
    `attention_mask` (B, L) allows: keep tool output in it). Zero where the attention mask is 0.

    One no-grad call of the whole model per `rows` rows (default: all). The default path reads the final
    hidden states and applies the output head itself (`head_energy`) with `transform`, which defaults to
    `check_head(model)` (one short forward first: a head otbrl does not recognise is refused); pass the
    transform check_head returned to skip that probe on later calls. `from_logits` uses the model's own
    logits instead, for a model whose head otbrl does not rebuild."""
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"attention_mask: shape {tuple(attention_mask.shape)} does not match input_ids "
            f"{tuple(input_ids.shape)} (expected (B, L))"
        )
    check_temperature(temperature)
    rows = rows or max(1, input_ids.shape[0])
    head = base_model(model).get_output_embeddings()
    if not from_logits and transform is None:
        transform = check_head(model)
    out = []
    # As sampled: no dropout (a training-mode forward would score a random perturbation of the policy).
    was_training = model.training
    model.eval()
    try:
        for r0 in range(0, input_ids.shape[0], rows):
            out.append(
                _rows_energy(
                    model,
                    input_ids[r0 : r0 + rows],
                    attention_mask[r0 : r0 + rows],
                    n,
                    temperature,
                    from_logits,
                    head,
                    transform,
                )
            )
    finally:
        model.train(was_training)
    energy = torch.cat(out) if out else torch.zeros(0, n, device=input_ids.device)
    return torch.where(attention_mask[:, input_ids.shape[1] - n :].bool(), energy, 0.0)  # even over NaN


def _rows_energy(
    model: Any,
    ids: torch.Tensor,
    attn: torch.Tensor,
    n: int,
    temperature: float,
    from_logits: bool,
    head: torch.nn.Module,
    transform: HeadTransform,
) -> torch.Tensor:
    """(rows, n) energy of the last n tokens of `ids`, from one call of the model."""
    y = ids[:, ids.shape[1] - n :]
    if from_logits:
        logits = model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=positions(attn),
            use_cache=False,
            logits_to_keep=n + 1,
        ).logits
        return token_energy(predicting(logits, n), y, temperature).float()
    hidden, _ = final_hidden(model, ids, attn)
    return head_energy(head, transform, predicting(hidden, n), y, temperature)


HALF = (torch.float16, torch.bfloat16)


def _head_precision(head: torch.nn.Module, param: torch.Tensor, ran_in: torch.dtype) -> Any:
    """A context that runs otbrl's rebuild of the head in the precision the model's own forward ran it:
    under autocast to `ran_in` when the head's output came out in half precision from full-precision
    weights (TRL's bf16=True wraps the model's forward in autocast; a caller's own autocast counts too),
    as it was otherwise."""
    if ran_in in HALF and param.dtype not in HALF:
        return torch.autocast(param.device.type, dtype=ran_in)
    return nullcontext()


def _rebuilt_logits(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """head(hidden) as otbrl computes it in `head_energy`: a plain linear head from its whole weight, any
    other head called as a module."""
    if not _is_plain_linear(head):
        return head(hidden)
    with full_head(head) as (weight, bias):
        return F.linear(hidden.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))


@torch.no_grad()
def check_head(model: Any, length: int = 8) -> HeadTransform:
    """The model's head transform (`head_transform`), once verified: a ValueError naming the model's class
    when the logits otbrl rebuilds from the final hidden states (`head_transform` of `head(hidden)`)
    differ from the model's own logits, e.g. for a family whose head does something otbrl does not know.
    One short forward; every rank must call it together when the model is sharded.

    The rebuild runs in the precision the model's head actually ran in, autocast included (bf16 autocast
    over float32 weights gives bf16 logits), and the tolerance follows it: 1e-4 relative in float32, 2e-2
    in bf16 or fp16."""
    base = base_model(model)
    head = base.get_output_embeddings()
    transform = head_transform(base)
    param = next(iter(head.parameters()))
    device = param.device if param.device.type != "meta" else torch.device("cpu")
    vocab = int(base.config.get_text_config().vocab_size)
    ids = (torch.arange(length, device=device) * 7919 % vocab)[None, :]
    ran: list[Any] = []  # the dtype of the head's output in the model's own forward

    def record(module: torch.nn.Module, args: Any, output: Any) -> None:
        ran.append(getattr(output, "dtype", None))

    handle = head.register_forward_hook(record)
    was_training = model.training
    model.eval()
    try:
        hidden, out = final_hidden(model, ids, torch.ones_like(ids), logits_to_keep=0)
        handle.remove()
        ran_in = ran[0] if ran and ran[0] is not None else out.logits.dtype
        with _head_precision(head, param, ran_in):
            try:
                ours = transform(_rebuilt_logits(head, hidden).float())
            except RuntimeError as err:  # e.g. a head that takes something other than the hidden states
                _refuse(base, f"{transform}; rebuilding its logits failed: {err}")
    finally:
        handle.remove()
        model.train(was_training)
    theirs = out.logits.float()
    _compare(base, transform, ours, theirs, 2e-2 if ran_in in HALF or param.dtype in HALF else 1e-4)
    return replace(transform, origin="checked")


def _compare(
    base: Any, transform: HeadTransform, ours: torch.Tensor, theirs: torch.Tensor, tol: float
) -> None:
    """Refuse the model, naming it and the way out, when its logits are not otbrl's rebuild of them."""
    why = f"{transform}"
    if ours.shape != theirs.shape:  # e.g. a head that slices the vocabulary after the projection
        why += f"; its logits have shape {tuple(theirs.shape)}, the rebuilt ones {tuple(ours.shape)}"
        error = math.inf
    else:
        error = (ours - theirs).abs().max().item() / max(1.0, theirs.abs().max().item())
        why += f", relative error {error:.2g} > {tol:g}"
    if not error <= tol:  # also catches NaN
        _refuse(base, why)


def _refuse(base: Any, why: str) -> None:
    raise ValueError(
        f"model: {type(base).__name__}'s logits are not what otbrl rebuilds from its hidden states and "
        f"output head ({why}): its head does something otbrl does not recognise, so its energy would "
        f"come from a different distribution; {WAY_OUT}"
    )
