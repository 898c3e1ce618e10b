"""Batched sampling from a causal LM with a hand-written KV-cache loop that also returns the log-probs
and the energy of the sampled tokens, both from the logits each token was sampled from: the rollouts an
RL step needs, with the layout TRL uses (each prompt's samples are consecutive rows), and no second
forward to score them.

A token is drawn as transformers' `generate` draws it: the settings of `SamplingSettings` (repetition
penalty, top-k, top-p, min-p) go through transformers' own logits processors, in the order `generate`
builds them, and a row ends where `generate` ends it: at any of the model's eos ids (`eos_token_ids`: the
generation config's and the tokenizer's, TRL's rule), at a stop string, or at its token budget. The
log-prob and the energy of each token stay those of softmax(z / T), without the filters: the policy a
trainer's loss differentiates (TRL's log-probs are the same).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer
from transformers.generation import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from otbrl import lm
from otbrl.energy import token_energy

# Why a row ended (`Decoded.reason`)
EOS, BUDGET, STOP, STOP_STRING = 0, 1, 2, 3


@dataclass(frozen=True)
class SamplingSettings:
    """How each token is drawn beyond the temperature, each field with `generate`'s meaning (None: off).

    top_k               keep the k most likely tokens (0: all)
    top_p               keep the fewest most likely tokens whose probability reaches top_p (1: all)
    min_p               keep the tokens at least min_p times as likely as the most likely one
    repetition_penalty  tokens already in the row (the prompt's real tokens and the generated ones) have
                        their logit divided by it when positive, multiplied when negative (1: off)
    stop_strings        a row ends with the token that completes one of them (the token is kept)

    `processors` builds them with transformers' own classes, so a token is drawn exactly as `generate`
    would draw it with the same settings; the energy and log-probs do not see them.
    """

    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        k, p, m, r = self.top_k, self.top_p, self.min_p, self.repetition_penalty
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f"top_k: must be an integer >= 0 (0: off), got {k!r}")
        if p is not None and not (_real(p) and 0 < p <= 1):
            raise ValueError(f"top_p: must be a number in (0, 1] (1: off), got {p!r}")
        if m is not None and not (_real(m) and 0 <= m <= 1):
            raise ValueError(f"min_p: must be a number in [0, 1], got {m!r}")
        if r is not None and not (_real(r) and r > 0):
            raise ValueError(f"repetition_penalty: must be a number > 0 (1: off), got {r!r}")
        strings = self.stop_strings
        strings = (strings,) if isinstance(strings, str) else tuple(strings or ())
        if not all(isinstance(x, str) and x for x in strings):
            raise ValueError(f"stop_strings: must be non-empty strings, got {self.stop_strings!r}")
        object.__setattr__(self, "stop_strings", strings)

    def processors(self, temperature: float, prompt_mask: torch.Tensor) -> LogitsProcessorList:
        """transformers' logits processors for these settings, in the order `generate` builds them
        (`GenerationMixin._get_logits_processor`): the repetition penalty, then, when sampling
        (temperature > 0), temperature, top-k, top-p and min-p. `prompt_mask` (B, P) is the left-padded
        prompt's attention mask: as in `generate`, the padding is not penalised."""
        out = LogitsProcessorList()
        if self.repetition_penalty is not None and self.repetition_penalty != 1.0:
            kwargs: dict[str, Any] = {}
            if "prompt_ignore_length" in inspect.signature(RepetitionPenaltyLogitsProcessor).parameters:
                kwargs["prompt_ignore_length"] = (prompt_mask != 0).int().argmax(dim=1)
            out.append(RepetitionPenaltyLogitsProcessor(float(self.repetition_penalty), **kwargs))
        if temperature == 0:  # greedy: generate applies no warper without do_sample
            return out
        if temperature != 1.0:
            out.append(TemperatureLogitsWarper(float(temperature)))
        if self.top_k:
            out.append(TopKLogitsWarper(top_k=self.top_k, min_tokens_to_keep=1))
        if self.top_p is not None and self.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=float(self.top_p), min_tokens_to_keep=1))
        if self.min_p is not None:
            out.append(MinPLogitsWarper(min_p=float(self.min_p), min_tokens_to_keep=1))
        return out


def _real(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def eos_token_ids(model: Any, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends a completion: the model's `generation_config.eos_token_id` (an id or a list;
    chat models often declare several, e.g. an end-of-turn token) and the tokenizer's eos id, first. The
    rule TRL's GRPOTrainer and `generate` follow."""
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
    first = tokenizer.eos_token_id
    if first is not None and first not in ids:
        ids = [first, *ids]
    if not ids:
        raise ValueError("tokenizer: no eos id, in the tokenizer or in the model's generation config")
    return [int(i) for i in ids]


@contextmanager
def float32_head(model: Any) -> Iterator[None]:
    """Run the model's output head in float32, outside autocast, inside the block (TRL's
    `cast_lm_head_to_fp32`: hidden states and weights cast to float32), then restore it. Under bf16
    autocast the head would otherwise run in bf16, and the logits a token is sampled from, its log-prob
    and its energy would not be those of the float32 head TRL's loss uses."""
    head = model.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError("model: its output head has no weight that could run in float32")
    own = head.__dict__.get("forward")  # an instance-level forward (TRL's own cast) to put back

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        bias = getattr(head, "bias", None)
        with torch.autocast(hidden.device.type, enabled=False):
            return F.linear(hidden.float(), head.weight.float(), None if bias is None else bias.float())

    head.forward = forward
    try:
        yield
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


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


@dataclass(frozen=True)
class RowCache:
    """One row's KV cache over its real tokens only (no padding): `ids` (L,) the tokens it covers, and per
    layer (keys, values), each (heads, L, head_dim). `decode(keep_cache=True)` returns one per row; a
    later `decode(past=...)` on a context that starts with `ids` feeds only the rest of it."""

    ids: torch.Tensor
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    @property
    def length(self) -> int:
        return int(self.ids.numel())


class Decoded(NamedTuple):
    """What `decode` returns: completion_ids (B, T) padded with pad, completion_mask (B, T), logprobs
    (B, T), reason (B,) why each row ended (EOS 0, BUDGET 1, STOP 2: the `stop` callable, STOP_STRING 3)
    and energy (B, T); logprobs and energy are float32 and 0 where the mask is 0. `caches`: with
    `keep_cache`, each row's `RowCache` over its context and its tokens but the last (which no forward has
    read yet); None without it, or for a model whose cache is not one plain tensor per layer (sliding
    windows, quantized caches)."""

    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    reason: torch.Tensor
    energy: torch.Tensor
    caches: list[RowCache] | None = None


def attention_for_decoding(device: torch.device) -> Any:
    """The attention kernels `decode` runs under: on CUDA, every SDPA backend but cuDNN's. cuDNN builds
    an execution graph for each new key length, and a KV-cache loop meets a new length at every step: on an
    H100 (torch 2.11) its attention call cost 1.88 ms of CPU per layer and step against microseconds of GPU
    work, so 1,024-token decoding ran at 75-80 ms a step once past the lengths already seen, 25 ms within
    them (docs/results/gpu-decode-profile.md). Elsewhere nothing changes."""
    if device.type != "cuda":
        return nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@torch.no_grad()
def _observer(on_step: Callable[[], None]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A `decode` stop rule that never stops a row and calls `on_step` once per step."""

    def stop(tokens: torch.Tensor) -> torch.Tensor:
        on_step()
        return torch.zeros_like(tokens, dtype=torch.bool)

    return stop


def sample(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    num_samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    sampling: SamplingSettings | None = None,
    on_step: Callable[[], None] | None = None,
    compact: bool = False,
) -> Samples:
    """Sample `num_samples` completions of each prompt, at most `max_new_tokens` tokens each (eos
    included). `temperature == 0` decodes greedily and reports log-probs and energy at temperature 1.
    Rows stop at any eos id of the model and the tokenizer (`eos_token_ids`) or a stop string of
    `sampling`; the loop ends when every row has. `generator` (on the model's device) makes it
    reproducible. `on_step()` is called after each decoding step (a progress bar; it changes nothing).
    `compact`: rows that have ended leave the KV cache and the forward (`decode`)."""
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
        eos_token_ids(model, tokenizer),
        tokenizer.pad_token_id,
        generator=generator,
        stop=None if on_step is None else _observer(on_step),
        sampling=sampling,
        tokenizer=tokenizer,
        compact=compact,
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
    eos_id: int | Sequence[int],
    pad_id: int,
    generator: torch.Generator | None = None,
    stop: Callable[[torch.Tensor], torch.Tensor] | None = None,
    *,
    sampling: SamplingSettings | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    head_in_float32: bool = False,
    compact: bool = False,
    past: Sequence[RowCache | None] | None = None,
    keep_cache: bool = False,
) -> Decoded:
    """The KV-cache sampling loop on left-padded ids (B, P). A row ends at any id of `eos_id` (one id or
    several: pass `eos_token_ids(model, tokenizer)` to end where `generate` ends), after its own budget
    (`max_new_tokens`, an int or a (B,) tensor), at a stop string of `sampling` (which needs the
    `tokenizer`), or when `stop(tokens (B,)) -> (B,) bool` says so (called once per step with the tokens
    just sampled; it may keep state). Each token is drawn from the logits after `sampling`'s processors
    (`SamplingSettings.processors`), as `generate` draws it; `head_in_float32` runs the output head in
    float32 outside autocast (`float32_head`); `compact` drops the rows that have ended from the KV cache
    and the forward: each row draws from the same random numbers, but its logits come from a smaller
    batch, so they may differ in the last bits (a token can then differ, rarely): off by default, so
    that no registered experiment's numbers move. Returns a
    `Decoded`: the tokens, their mask, and each token's log-prob and energy under softmax(z / T) of the
    very logits it was sampled from (the model's
    own, so any soft-capping or logit scale is in them; the processors' filters are not), at
    `temperature` (1 when decoding greedily). On CUDA it runs without cuDNN's attention
    (`attention_for_decoding`).

    `past` (one `RowCache` or None per row) resumes rows whose context begins with a cached prefix: only
    the rest of each row is fed (a multi-turn rollout's new tool output, not its whole context again).
    The logits are those of one forward over the whole context up to float rounding (attention summed in
    another order), so a token can differ, rarely, from a rollout that reads the context afresh.
    `keep_cache` returns each row's cache (`Decoded.caches`) for such a resume."""
    device = prompt_ids.device
    batch = prompt_ids.shape[0]
    settings = sampling if sampling is not None else SamplingSettings()
    eos = torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id), dtype=torch.long, device=device)
    if eos.numel() == 0:
        raise ValueError("eos_id: needs at least one id")
    if settings.stop_strings and tokenizer is None:
        raise ValueError("tokenizer: needed to find the stop strings of `sampling`")
    strings = StopStringCriteria(tokenizer, list(settings.stop_strings)) if settings.stop_strings else None
    processors = settings.processors(temperature, prompt_mask)
    budget = torch.as_tensor(max_new_tokens, device=device).expand(batch)
    with float32_head(model) if head_in_float32 else nullcontext(), attention_for_decoding(device):
        return _loop(
            model,
            prompt_ids,
            prompt_mask,
            budget,
            temperature,
            eos,
            pad_id,
            generator,
            stop,
            processors,
            strings,
            compact,
            past,
            keep_cache,
        )


def _plain(cache: Any, width: int) -> bool:
    """Whether every layer of `cache` holds one growing tensor of keys and one of values over all `width`
    positions (rows can then be cut out of it and put back together)."""
    layers = getattr(cache, "layers", None) or [None]
    return all(
        type(layer) is DynamicLayer and layer.keys is not None and layer.keys.shape[-2] == width
        for layer in layers
    )


def _row_layers(cache: Any, index: torch.Tensor, real: torch.Tensor) -> list[list[tuple[torch.Tensor, ...]]]:
    """Rows `index` (k,) of a batch cache, each over its real positions (`real` (k, S) bool): k lists
    of per-layer (keys, values) (heads, L_row, head_dim) copies."""
    out: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in range(index.numel())]
    for layer in cache.layers:
        keys, values = layer.keys[index], layer.values[index]
        for j in range(index.numel()):
            out[j].append((keys[j][:, real[j]], values[j][:, real[j]]))
    return out


def _resume(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, past: Sequence[RowCache | None]
) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch cache from per-row caches and each row's tokens beyond them: returns (cache, attention
    mask (B, C + N), new ids (B, N), their position ids (B, N)). Layout of row i: padding, its C_i
    cached positions | padding, its N_i new tokens; the padding is masked, so each row attends to
    exactly its own context and the last column of every row is its last token."""
    device, pad = prompt_ids.device, 0
    batch = prompt_ids.shape[0]
    if len(past) != batch:
        raise ValueError(f"past: one RowCache or None per row, got {len(past)} for {batch} rows")
    contexts = [prompt_ids[i][prompt_mask[i].bool()] for i in range(batch)]
    cached = [0 if c is None else c.length for c in past]
    for i, (c, ctx) in enumerate(zip(past, contexts, strict=True)):
        if c is not None and (c.length >= ctx.numel() or not torch.equal(ctx[: c.length], c.ids.to(device))):
            raise ValueError(
                f"past[{i}]: its {c.length} cached tokens must be a proper prefix of the row's "
                f"{ctx.numel()} context tokens"
            )
    reference = next(c for c in past if c is not None)
    width_c, width_n = max(cached), max(len(x) - n for x, n in zip(contexts, cached, strict=True))
    data = []
    for layer, (k0, v0) in enumerate(reference.layers):
        keys = k0.new_zeros((batch, k0.shape[0], width_c, k0.shape[2]))
        values = v0.new_zeros((batch, v0.shape[0], width_c, v0.shape[2]))
        for i, c in enumerate(past):
            if c is not None and c.length:
                keys[i, :, width_c - c.length :] = c.layers[layer][0]
                values[i, :, width_c - c.length :] = c.layers[layer][1]
        data.append((keys, values))
    ids = torch.full((batch, width_n), pad, dtype=prompt_ids.dtype, device=device)
    mask = torch.zeros((batch, width_c + width_n), dtype=prompt_mask.dtype, device=device)
    positions = torch.zeros((batch, width_n), dtype=torch.long, device=device)
    for i, (ctx, n) in enumerate(zip(contexts, cached, strict=True)):
        new = ctx[n:]
        ids[i, width_n - new.numel() :] = new
        mask[i, width_c - n : width_c] = 1
        mask[i, width_c + width_n - new.numel() :] = 1
        positions[i, width_n - new.numel() :] = torch.arange(n, n + new.numel(), device=device)
    return DynamicCache(ddp_cache_data=data), mask, ids, positions


def _loop(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    budget: torch.Tensor,
    temperature: float,
    eos: torch.Tensor,
    pad_id: int,
    generator: torch.Generator | None,
    stop: Callable[[torch.Tensor], torch.Tensor] | None,
    processors: LogitsProcessorList,
    strings: StopStringCriteria | None,
    compact: bool = False,
    past: Sequence[RowCache | None] | None = None,
    keep_cache: bool = False,
) -> Decoded:
    """`decode`'s loop, each step as `generate`'s sampling step: processors over the whole row so far
    (prompt, then generated tokens; pad after a row's end), then a draw from softmax of the result."""
    device = prompt_ids.device
    batch = prompt_ids.shape[0]
    if past is not None and any(c is not None for c in past):
        cache, attention_mask, ids, positions = _resume(prompt_ids, prompt_mask, past)
    else:
        cache, attention_mask, ids = DynamicCache(config=model.config), prompt_mask, prompt_ids
        positions = lm.positions(prompt_mask)  # left padding: first real token at 0
    out = model(
        input_ids=ids,
        attention_mask=attention_mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    next_pos = positions[:, -1:] + 1  # (B, 1)
    keep_cache = keep_cache and _plain(cache, attention_mask.shape[1])
    real = attention_mask.bool()  # (rows in the cache, S): the cache positions that hold a real token
    kept: dict[int, list[tuple[torch.Tensor, ...]]] = {}  # row -> its per-layer (keys, values)

    rows = prompt_ids  # (B, P + steps so far): what the processors and stop strings read
    tokens, logps, masks, energies = [], [], [], []
    done = budget <= 0
    reason = torch.full((batch,), BUDGET, dtype=torch.long, device=device)
    # The rows still in the KV cache: a row that has ended leaves it, so each step's forward runs on the
    # rows still decoding only (most rows of a large batch end long before its longest). Every step
    # still draws for all B rows (an ended row's logits are zeros and its token is discarded), so each
    # row's random draws are those of the uncompacted loop.
    cached = torch.arange(batch, device=device)
    for step in range(int(budget.max().item()) if batch else 0):
        if cached.numel() == batch:
            logits = out.logits[:, -1].float()  # (B, V)
        else:
            logits = out.logits.new_zeros((batch, out.logits.shape[-1]), dtype=torch.float32)
            logits[cached] = out.logits[:, -1].float()
        logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        scores = processors(rows, logits.clone()) if processors else logits
        if temperature == 0:
            tok = scores.argmax(-1)
        else:
            tok = torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator).squeeze(-1)
        live = ~done
        tok = torch.where(live, tok, pad_id)
        rows = torch.cat([rows, tok[:, None]], dim=1)
        tokens.append(tok)
        logps.append(torch.where(live, logp.gather(-1, tok[:, None]).squeeze(-1), 0.0))
        energies.append(torch.where(live, token_energy(logits, tok, temperature or 1.0), 0.0))
        masks.append(live.long())
        ended_eos = live & torch.isin(tok, eos)
        string = strings(rows, scores).to(device) if strings is not None else torch.zeros_like(live)
        ended_string = live & ~ended_eos & string
        paused = stop(tok) if stop is not None else torch.zeros_like(live)  # every step: it keeps state
        ended_stop = live & ~ended_eos & ~ended_string & paused
        reason = torch.where(ended_eos, EOS, reason)
        reason = torch.where(ended_string, STOP_STRING, torch.where(ended_stop, STOP, reason))
        done = done | ended_eos | ended_string | ended_stop | (budget <= step + 1)
        if bool(done.all()):
            break
        still = ~done[cached]
        if compact and not bool(still.all()):  # rows ended this step: drop them from the cache
            if keep_cache:
                gone = (~still).nonzero().squeeze(1)
                kept.update(zip(cached[gone].tolist(), _row_layers(cache, gone, real[gone]), strict=True))
            keep = still.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            cached, attention_mask, next_pos = cached[keep], attention_mask[keep], next_pos[keep]
            real = real[keep] if keep_cache else real
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=-1)
        if keep_cache:  # an ended row's fed pad is not its token
            real = torch.cat([real, ~done[cached, None]], dim=-1)
        out = model(
            input_ids=tok[cached, None],
            attention_mask=attention_mask,
            position_ids=next_pos,
            past_key_values=cache,
            use_cache=True,
        )
        next_pos = next_pos + 1

    if tokens:
        ids, mask = torch.stack(tokens, 1), torch.stack(masks, 1)
        decoded = Decoded(ids, mask, torch.stack(logps, 1), reason, torch.stack(energies, 1))
    else:
        empty = torch.zeros(batch, 0, dtype=torch.long, device=device)
        decoded = Decoded(empty, empty, empty.float(), reason, empty.float())
    if not keep_cache:
        return decoded
    at = torch.arange(cached.numel(), device=device)  # the cache's own rows, batch rows `cached`
    kept.update(zip(cached.tolist(), _row_layers(cache, at, real), strict=True))
    caches = []
    for i in range(batch):
        n = int(decoded.completion_mask[i].sum())
        context = prompt_ids[i][prompt_mask[i].bool()]
        covered = torch.cat([context, decoded.completion_ids[i, : max(n - 1, 0)]])
        held = kept[i][0][0].shape[1]
        if held != covered.numel():  # the loop's bookkeeping, checked, not assumed
            raise RuntimeError(f"row {i}: a cache of {held} positions for {covered.numel()} tokens")
        caches.append(RowCache(covered, tuple(kept[i])))
    return decoded._replace(caches=caches)
