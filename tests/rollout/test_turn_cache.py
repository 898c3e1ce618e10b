"""A KV cache that lives from turn to turn (`decode(past=..., keep_cache=True)`, `sample_with_tools(
turn_cache=True)`): feeding only the new tokens gives the logits of a forward over the whole context,
on a real (tiny, float64) transformer, so the tokens, masks and log-probs of a multi-turn rollout are
those of one that reads each context afresh."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("transformers")

from otbrl.rollout.multiturn import sample_with_tools  # noqa: E402
from otbrl.rollout.sampler import RowCache, decode  # noqa: E402
from otbrl.tasks import char_tokenizer, tiny_model  # noqa: E402

TOK = char_tokenizer()
PAD, EOS = TOK.pad_token_id, TOK.eos_token_id


def real_model(seed: int = 0) -> torch.nn.Module:
    return tiny_model("tiny", vocab_size=len(TOK), seed=seed).double()


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def encode(texts: list[str]) -> list[list[int]]:
    return TOK(texts, add_special_tokens=False)["input_ids"]


PROMPTS = ["12*3=", "7=", "123*45*6=", "8*9="]


@pytest.mark.parametrize("compact", [False, True])
def test_a_kept_cache_covers_the_context_and_all_but_the_last_token(compact: bool) -> None:
    model = real_model()
    ids, mask = left_padded(encode(PROMPTS))
    budget = torch.tensor([5, 1, 7, 3])  # rows end at different steps (compact drops them one by one)
    out = decode(model, ids, mask, budget, 0.0, [EOS], PAD, keep_cache=True, compact=compact)
    assert out.caches is not None and len(out.caches) == len(PROMPTS)
    for i, cache in enumerate(out.caches):
        n = int(out.completion_mask[i].sum())
        want = encode([PROMPTS[i]])[0] + out.completion_ids[i, : n - 1].tolist()
        assert cache.ids.tolist() == want
        assert len(cache.layers) == model.config.num_hidden_layers
        config = model.config
        heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
        assert all(k.shape == v.shape == (heads, len(want), dim) for k, v in cache.layers)
    # the cache holds what a forward over those tokens computes, position by position
    alone = torch.tensor([out.caches[2].ids.tolist()])
    ref = model(input_ids=alone, use_cache=True).past_key_values
    for layer, (k, v) in zip(ref.layers, out.caches[2].layers, strict=True):
        torch.testing.assert_close(k, layer.keys[0], rtol=0, atol=1e-10)
        torch.testing.assert_close(v, layer.values[0], rtol=0, atol=1e-10)


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_resuming_from_kept_caches_samples_what_a_fresh_context_samples(
    compact: bool, temperature: float
) -> None:
    """Turn 1 keeps the caches; turn 2's contexts add text of different lengths per row (a tool's output);
    one row starts without a cache. Its draws match decoding the whole contexts afresh."""
    model = real_model(seed=1)
    ids, mask = left_padded(encode(PROMPTS))
    first = decode(model, ids, mask, torch.tensor([4, 2, 6, 3]), 0.0, [EOS], PAD, keep_cache=True)
    extra = [":1;", ":123456;", ":42;", ":7;"]
    written = [first.completion_ids[i, : int(first.completion_mask[i].sum())].tolist() for i in range(4)]
    contexts = [encode([p])[0] + w + encode([x])[0] for p, w, x in zip(PROMPTS, written, extra, strict=True)]
    ids2, mask2 = left_padded(contexts)
    past: list[RowCache | None] = list(first.caches)
    past[3] = None  # a row may start afresh beside resumed ones
    runs = {}
    for name, p in (("fresh", None), ("resumed", past)):
        gen = torch.Generator().manual_seed(7)
        runs[name] = decode(model, ids2, mask2, 8, temperature, [EOS], PAD, gen, compact=compact, past=p)
    fresh, resumed = runs["fresh"], runs["resumed"]
    assert torch.equal(resumed.completion_ids, fresh.completion_ids)
    assert torch.equal(resumed.completion_mask, fresh.completion_mask)
    torch.testing.assert_close(resumed.logprobs, fresh.logprobs, rtol=0, atol=1e-5)  # float32 from float64
    torch.testing.assert_close(resumed.energy, fresh.energy, rtol=0, atol=1e-5)


def test_a_past_that_is_not_the_contexts_prefix_is_refused() -> None:
    model = real_model()
    ids, mask = left_padded(encode(["12*3="]))
    cache = decode(model, ids, mask, 3, 0.0, [EOS], PAD, keep_cache=True).caches[0]
    other, other_mask = left_padded(encode(["13*3=ab"]))
    with pytest.raises(ValueError, match="proper prefix"):
        decode(model, other, other_mask, 2, 0.0, [EOS], PAD, past=[cache])
    whole, whole_mask = left_padded([cache.ids.tolist()])  # nothing new to feed
    with pytest.raises(ValueError, match="proper prefix"):
        decode(model, whole, whole_mask, 2, 0.0, [EOS], PAD, past=[cache])
    with pytest.raises(ValueError, match="one RowCache or None per row"):
        decode(model, ids, mask, 2, 0.0, [EOS], PAD, past=[cache, None])


class Scripted(torch.nn.Module):
    """A real transformer whose logits get a bonus for the script's next character, chosen by the last
    token a forward reads (the same token whether the context is read afresh or resumed): prompts ending
    in "x" write "y " first, then each row calls `c()` until its calls run out, then ends. The transformer
    underneath makes every log-prob depend on the whole context, cache included."""

    SCRIPT = {"x": "y", "y": " ", " ": "c", "=": "c", "c": "(", "(": ")", ";": "c", ")": None}

    def __init__(self, bonus: float) -> None:
        super().__init__()
        self.base, self.bonus = real_model(seed=2), bonus
        self.config = self.base.config

    @property
    def device(self) -> torch.device:
        return self.base.device

    def forward(self, input_ids: torch.Tensor, **kwargs: object) -> types.SimpleNamespace:
        out = self.base(input_ids=input_ids, **kwargs)
        logits = out.logits.clone()
        for i, last in enumerate(input_ids[:, -1].tolist()):
            nxt = self.SCRIPT.get(TOK.convert_ids_to_tokens(last), None)
            logits[i, -1, EOS if nxt is None else TOK.convert_tokens_to_ids(nxt)] += self.bonus
        return types.SimpleNamespace(logits=logits, past_key_values=out.past_key_values)


def counter(row: int) -> dict[str, object]:
    """A tool whose outputs have different lengths call by call and row by row."""
    calls = []

    def c(_: str) -> str:
        calls.append(1)
        return "9" * (3 * len(calls) + 2 * row - 2)

    return {"c": c}


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize(("temperature", "bonus"), [(0.0, 10.0), (1.0, 6.0)])
def test_a_multi_turn_rollout_with_a_turn_cache_writes_the_same_completions(
    compact: bool, temperature: float, bonus: float
) -> None:
    ids = encode(["12=", "3=x", "45*6=x", "7="])
    runs = {}
    for turn_cache in (False, True):
        gen = torch.Generator().manual_seed(3)
        boxes = [counter(row) for row in range(len(ids))]
        runs[turn_cache] = sample_with_tools(
            Scripted(bonus), TOK, ids, boxes, 40, 3, temperature, gen, compact=compact, turn_cache=turn_cache
        )
    plain, cached = runs[False], runs[True]
    assert cached.completion_ids == plain.completion_ids and cached.model_mask == plain.model_mask
    assert cached.calls == plain.calls
    assert sum(plain.calls) >= 8  # the script ran: rows paused for their calls (greedy: all of them)
    if temperature == 0.0:
        assert plain.calls == [3] * 4
    for a, b in zip(cached.logprobs, plain.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)


def test_a_model_without_a_plain_cache_falls_back_to_reading_the_context() -> None:
    """A model that writes nothing into the cache (or a sliding-window one) gets no `caches`; the
    multi-turn loop then reads each context afresh and still finishes."""

    class NoCache(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = real_model()
            self.config = self.base.config

        @property
        def device(self) -> torch.device:
            return self.base.device

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_: object):  # noqa: ANN202
            full = self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            return types.SimpleNamespace(logits=full.logits[:, -1:])

    ids, mask = left_padded(encode(["12="]))
    assert decode(NoCache(), ids, mask, 2, 0.0, [EOS], PAD, keep_cache=True).caches is None
