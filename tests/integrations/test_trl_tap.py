"""otbrl.integrations.trl.tap.LogSumSqTap on its own: installed over TRL's fused head, as the trainer
installs it, it records log sum pi^2 only for fused forwards inside `capture()`, and those values are the
sampling distribution's (temperature, the family's logit scale and soft-capping); every other forward is
TRL's own, and an exception inside `capture()` leaves the tap disarmed. References are float64, from the
model's own logits.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import pytest

pytest.importorskip("trl")
pytest.importorskip("otbrl.integrations.trl")

import torch  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from otbrl.integrations.trl.tap import LogSumSqTap  # noqa: E402
from tests.models import FAMILIES, VOCAB, family_model  # noqa: E402

TEMPERATURE = 0.7
PROMPT = 3  # leading positions whose labels are -100, as TRL masks the prompt

pytestmark = pytest.mark.usefixtures("one_thread")


def counted(forward):  # noqa: ANN001, ANN201
    """TRL's patched forward with a count of the calls that reach it (`.calls`); functools.wraps keeps
    its signature, which generate() reads."""

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        wrapper.calls += 1
        return forward(*args, **kwargs)

    wrapper.calls = 0
    return wrapper


def tapped(family: str) -> tuple[torch.nn.Module, LogSumSqTap, Any]:
    """A tiny model of `family` with TRL's fused head (the outputs GRPOTrainer asks for), a counter on that
    forward, and the tap installed over it."""
    model = family_model(family)
    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    trl_forward = counted(model.forward)
    model.forward = trl_forward
    return model, LogSumSqTap(model, TEMPERATURE, cast_lm_head_to_fp32=False), trl_forward


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, L) ids, attention mask with one left-padded row, and labels: -100 on the prompt and padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, 9), generator=g)
    attention = torch.ones_like(ids)
    attention[2, :2] = 0
    labels = ids.masked_fill(attention == 0, -100)
    labels[:, :PROMPT] = -100
    return ids, attention, labels


def reference_log_sum_sq(model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """(B, L - 1) float64 log sum_v softmax(z / T)_v^2 of the next-token distribution at each position,
    z the model's own logits (its scale and soft-capping applied), one position at a time."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits
    out = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.float64)
    for b in range(out.shape[0]):
        for t in range(out.shape[1]):
            z = logits[b, t].double() / TEMPERATURE
            p = torch.exp(z - z.max())
            p = p / p.sum()
            out[b, t] = torch.log((p * p).sum())
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_captured_values_are_the_sampling_distributions(family):
    model, tap, trl_forward = tapped(family)
    ids, attention, labels = batch()
    expected = reference_log_sum_sq(model, ids, attention)
    scored = labels[:, 1:] != -100
    with torch.no_grad(), tap.capture() as seen:
        out = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
    assert len(seen) == 1 and seen[0] is out.log_sum_sq_probs
    assert seen[0].shape == scored.shape
    # TRL's kernel accumulates in float32
    torch.testing.assert_close(seen[0][scored].double(), expected[scored], rtol=1e-5, atol=1e-5)
    assert (seen[0][~scored] == 0).all()
    # the captured forward still returns what TRL's head returns
    with torch.no_grad():
        trl_out = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
    torch.testing.assert_close(out.log_probs, trl_out.log_probs)
    torch.testing.assert_close(out.entropy, trl_out.entropy)


def test_every_fused_forward_in_the_block_is_recorded_in_order():
    model, tap, _ = tapped("qwen2")
    ids, attention, labels = batch()
    with torch.no_grad(), tap.capture() as seen:
        first = model(input_ids=ids[:2], attention_mask=attention[:2], labels=labels[:2], fused_lm_head=True)
        # a plain forward inside the block (as generation runs) is TRL's and records nothing
        model(input_ids=ids, attention_mask=attention)
        second = model(input_ids=ids[2:], attention_mask=attention[2:], labels=labels[2:], fused_lm_head=True)
    assert [s.shape[0] for s in seen] == [2, 1]
    assert seen[0] is first.log_sum_sq_probs and seen[1] is second.log_sum_sq_probs
    expected = reference_log_sum_sq(model, ids, attention)
    scored = labels[:, 1:] != -100
    torch.testing.assert_close(torch.cat(seen)[scored].double(), expected[scored], rtol=1e-5, atol=1e-5)


def test_unarmed_forwards_are_trls_own():
    """Outside capture(), fused or not, with or without gradients, every forward reaches TRL's patched
    forward and returns its output: no log sum pi^2 computed, the training gradient through TRL's head."""
    model, tap, trl_forward = tapped("gemma2")
    ids, attention, labels = batch()
    with torch.no_grad(), tap.capture() as seen:
        model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
    assert trl_forward.calls == 0  # the captured forward went to the tap's own head
    out = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
    assert trl_forward.calls == 1 and out.log_sum_sq_probs is None and out.entropy is not None
    out.loss.backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    plain = model(input_ids=ids, attention_mask=attention)
    assert trl_forward.calls == 2 and plain.logits.shape == (*ids.shape, VOCAB)
    assert len(seen) == 1  # the closed block's list got nothing more


def test_generate_goes_through_the_tap():
    """The tap keeps the forward's signature, which generate() reads (which keyword arguments to pass,
    whether the model takes an attention mask or logits_to_keep); generation is TRL's forward, unchanged."""
    model, tap, trl_forward = tapped("llama")
    untapped = family_model("llama")
    add_fused_lm_head(untapped, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    assert inspect.signature(model.forward) == inspect.signature(untapped.forward)
    assert {"attention_mask", "logits_to_keep"} <= set(inspect.signature(model.forward).parameters)
    ids, attention, _ = batch()
    greedy = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad(), tap.capture() as seen:
        generated = model.generate(input_ids=ids, attention_mask=attention, **greedy)
    assert trl_forward.calls == 3 and seen == []
    with torch.no_grad():
        assert torch.equal(generated, untapped.generate(input_ids=ids, attention_mask=attention, **greedy))


@pytest.mark.parametrize("where", ["in_block", "in_forward"])
def test_exception_inside_capture_leaves_the_tap_disarmed(where):
    model, tap, trl_forward = tapped("qwen2")
    ids, attention, labels = batch()
    with pytest.raises(RuntimeError), torch.no_grad(), tap.capture() as seen:
        if where == "in_block":
            model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
            raise RuntimeError("step failed")
        # labels of the wrong width fail inside the tap's fused head
        model(input_ids=ids, attention_mask=attention, labels=labels[:, :4], fused_lm_head=True)
    recorded = len(seen)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
    assert out.log_sum_sq_probs is None and trl_forward.calls == 1 and len(seen) == recorded
    # and arms again cleanly, with a fresh list
    with torch.no_grad(), tap.capture() as again:
        model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
    assert len(again) == 1 and again is not seen and trl_forward.calls == 1
