"""otbrl.lm: the energy of each completion token under the distribution the model samples from, for tiny
random models of real families whose output heads differ (plain, soft-capped, scaled), with their heads
sharpened so that the transform matters; the probe that refuses a head otbrl does not know; PEFT adapters;
the sampler's energies. References are float64 loops over the model's own logits.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

import otbrl  # noqa: E402
from otbrl.lm import HeadTransform, check_head, completion_energy, head_energy, head_transform  # noqa: E402
from tests.models import COMMON, FAMILIES, SHARPEN, VOCAB, ScaledQwen2, family_model, half_supported  # noqa: E402
from tests.references import model_reference, reference_energy  # noqa: E402

TEMPERATURE = 0.7


def _batch(
    model, seed: int = 0, rows: int = 3, prompt: int = 8, n: int = 6
) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """(rows, prompt + n) ids and attention: random prompts (the first left-padded by 3), then n tokens
    sampled from the model at TEMPERATURE, so that confident and uncertain tokens both occur."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, prompt), generator=g)
    attention = torch.ones_like(ids)
    attention[0, :3] = 0
    ids[0, :3] = 0
    for _ in range(n):
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attention).logits[:, -1].double()
        nxt = torch.multinomial(torch.softmax(logits / TEMPERATURE, -1), 1, generator=g)
        ids, attention = torch.cat([ids, nxt], 1), torch.cat([attention, torch.ones_like(nxt)], 1)
    return ids, attention


pytestmark = pytest.mark.usefixtures("one_thread")


def test_head_transforms_read_from_configs():
    assert head_transform(family_model("qwen2")) == otbrl.lm.HeadTransform(1.0, None)
    assert head_transform(family_model("gemma2")) == otbrl.lm.HeadTransform(1.0, 5.0)
    assert head_transform(family_model("granite")) == otbrl.lm.HeadTransform(1 / 8.0, None)
    assert head_transform(family_model("cohere")) == otbrl.lm.HeadTransform(4.0, None)
    config = transformers.GraniteConfig(**COMMON, logits_scaling=8.0)
    config.model_type = "hyperclovax"  # HyperCLOVA X multiplies by logits_scaling
    assert head_transform(config).scale == 8.0
    falcon = transformers.Qwen2Config(**COMMON)
    falcon.lm_head_multiplier = 0.5
    assert head_transform(falcon).scale == 0.5


@pytest.mark.parametrize("value", ["inv_sqrt_d_model", 0.0, -2.0, math.inf])
def test_unrecognised_config_value_is_an_error(value):
    config = transformers.Qwen2Config(**COMMON)
    config.logit_scale = value  # e.g. MPT's string setting
    with pytest.raises(ValueError, match="logit_scale.*energy_from_logits"):
        head_transform(config)


@settings(max_examples=40, deadline=None)
@given(
    scale=st.floats(0.05, 20.0),
    softcap=st.one_of(st.none(), st.floats(0.5, 50.0)),
    temperature=st.floats(0.2, 3.0),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_head_energy_law(scale, softcap, temperature, with_bias, seed):
    """For any scale, soft-cap and temperature, the energy from hidden states and a linear head equals
    the energy of softmax(softcap(scale (h W^T + b)) / T), computed token by token in float64."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(8, 11, bias=with_bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(11, 8, generator=g) * 3)
        if with_bias:
            head.bias.copy_(torch.randn(11, generator=g))
    hidden, tokens = torch.randn(2, 5, 8, generator=g), torch.randint(0, 11, (2, 5), generator=g)
    got = head_energy(head, HeadTransform(scale, softcap), hidden, tokens, temperature)
    z = hidden.double() @ head.weight.double().T
    if with_bias:
        z = z + head.bias.double()
    z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    torch.testing.assert_close(got.double(), reference_energy(z, tokens, temperature), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_energy_matches_the_models_own_logits(family):
    model = family_model(family)
    ids, attention = _batch(model)
    n = 6
    expected = model_reference(model, ids, attention, n, TEMPERATURE)
    got = completion_energy(model, ids, attention, n, TEMPERATURE, rows=2)
    assert got.dtype == torch.float32 and got.shape == (3, n)
    torch.testing.assert_close(got.double(), expected, rtol=2e-5, atol=1e-7)
    from_logits = completion_energy(model, ids, attention, n, TEMPERATURE, from_logits=True)
    torch.testing.assert_close(from_logits.double(), expected, rtol=2e-5, atol=1e-7)
    check_head(model)  # otbrl's rebuilt logits are the model's: no error


@pytest.mark.parametrize("family", ["gemma2", "granite", "cohere"])
def test_plain_head_would_be_a_different_distribution(family):
    """What ignoring the head transform gives (the trainer's energy before otbrl.lm): far off."""
    model = family_model(family)
    ids, attention = _batch(model)
    expected = model_reference(model, ids, attention, 6, TEMPERATURE)
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
    plain = otbrl.fused_token_stats(hidden[:, -7:-1], model.lm_head.weight, ids[:, -6:], TEMPERATURE).energy
    assert ((plain.double() - expected).abs() / expected).max() > 0.5


def test_masked_positions_get_zero():
    model = family_model("qwen2")
    ids, attention = _batch(model)
    attention[1, -2:] = 0
    got = completion_energy(model, ids, attention, 6, TEMPERATURE)
    assert (got[1, -2:] == 0).all() and (got[1, :-2] > 0).all()


def test_unknown_head_is_refused_with_the_way_out():
    torch.manual_seed(0)
    model = ScaledQwen2(transformers.Qwen2Config(**COMMON)).eval()
    with pytest.raises(ValueError, match="ScaledQwen2.*energy_from_logits"):
        check_head(model)
    ids, attention = _batch(model)
    expected = model_reference(model, ids, attention, 5, TEMPERATURE)
    got = completion_energy(model, ids, attention, 5, TEMPERATURE, from_logits=True)  # the way out works
    torch.testing.assert_close(got.double(), expected, rtol=2e-5, atol=1e-7)


def test_bad_arguments():
    model = family_model("qwen2")
    ids, attention = _batch(model)
    with pytest.raises(ValueError, match="attention_mask"):
        completion_energy(model, ids, attention[:, 1:], 3, 1.0)
    with pytest.raises(ValueError, match="temperature"):
        completion_energy(model, ids, attention, 3, 0.0)
    with pytest.raises(ValueError, match="n: "):
        completion_energy(model, ids, attention, ids.shape[1], 1.0)


# ----------------------------------------------------------------------------------------------------------
# PEFT
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "lm_head"]])
def test_peft_lora(targets):
    """An adapter on attention (the head stays linear: fused path) and one on the output head itself
    (the head module is called in tiles, so the adapter's delta is in the logits)."""
    peft = pytest.importorskip("peft")
    base = family_model("gemma2" if "lm_head" in targets else "qwen2", sharpen=5.0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(base, config).eval()
    ids, attention = _batch(model, seed=1)
    expected = model_reference(model, ids, attention, 6, TEMPERATURE)
    with model.disable_adapter():
        without = model_reference(model, ids, attention, 6, TEMPERATURE)
    assert ((without - expected).abs() / expected).max() > 1e-2  # the adapter matters
    got = completion_energy(model, ids, attention, 6, TEMPERATURE)
    torch.testing.assert_close(got.double(), expected, rtol=2e-5, atol=1e-7)
    check_head(model)


# ----------------------------------------------------------------------------------------------------------
# the sampler's energies: from the very logits each token was sampled from
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "cohere"])
def test_sampler_energy_is_the_sampled_distributions(family):
    from otbrl.rollout import sample
    from otbrl.tasks import char_tokenizer

    model = family_model(family, sharpen=3.0)
    tok = char_tokenizer()
    out = sample(
        model, tok, ["12+34=", "7+8="], 3, 7, TEMPERATURE, generator=torch.Generator().manual_seed(0)
    )
    assert out.energy is not None and out.energy.shape == out.completion_ids.shape
    ids = torch.cat([out.prompt_ids, out.completion_ids], dim=1)
    attention = torch.cat([out.prompt_mask, out.completion_mask], dim=1)
    with torch.no_grad():  # positions as the sampler counts them (left padding)
        logits = model(
            input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0)
        ).logits
    n = out.completion_ids.shape[1]
    width = ids.shape[1]
    expected = reference_energy(logits[:, width - n - 1 : width - 1], out.completion_ids, TEMPERATURE)
    expected = expected * out.completion_mask
    torch.testing.assert_close(out.energy.double(), expected, rtol=1e-4, atol=1e-6)
    assert (out.energy[out.completion_mask == 0] == 0).all()


# ----------------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-3 (not installed here): the gather protocol against a stand-in
# ----------------------------------------------------------------------------------------------------------


def test_zero3_head_is_gathered_for_the_read(monkeypatch):
    """DeepSpeed is not installed and ZeRO-3 needs its engine, so this checks only the protocol against a
    stand-in: a partitioned parameter (ds_id, ds_status NOT_AVAILABLE, empty data) is gathered read-only
    (GatheredParameters(params, modifier_rank=None)) for the read and released after; an available one
    (a tied head inside the embedding's forward) is not gathered again."""
    import enum
    import sys
    import types

    class ZeroParamStatus(enum.Enum):
        AVAILABLE = 1
        NOT_AVAILABLE = 2

    calls: list[tuple[list, object]] = []

    class GatheredParameters:
        def __init__(self, params: list, modifier_rank: object = "unset") -> None:
            self.params = params
            calls.append((params, modifier_rank))

        def __enter__(self) -> None:
            for p in self.params:
                p.data, p.ds_status = p.ds_full, ZeroParamStatus.AVAILABLE

        def __exit__(self, *exc: object) -> None:
            for p in self.params:
                p.data, p.ds_status = torch.empty(0), ZeroParamStatus.NOT_AVAILABLE

    deepspeed = types.ModuleType("deepspeed")
    deepspeed.zero = types.SimpleNamespace(GatheredParameters=GatheredParameters)
    partition = types.ModuleType("deepspeed.runtime.zero.partition_parameters")
    partition.ZeroParamStatus = ZeroParamStatus
    for name, module in {
        "deepspeed": deepspeed,
        "deepspeed.runtime": types.ModuleType("deepspeed.runtime"),
        "deepspeed.runtime.zero": types.ModuleType("deepspeed.runtime.zero"),
        "deepspeed.runtime.zero.partition_parameters": partition,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=True)
    full_w, full_b = torch.randn(11, 8, generator=g) * 3, torch.randn(11, generator=g)
    for p, full in ((head.weight, full_w), (head.bias, full_b)):
        p.ds_id, p.ds_full, p.ds_status = 1, full, ZeroParamStatus.NOT_AVAILABLE
        p.data = torch.empty(0)
    hidden, tokens = torch.randn(6, 8, generator=g), torch.randint(0, 11, (6,), generator=g)
    got = head_energy(head, HeadTransform(), hidden, tokens, 0.7)
    z = hidden.double() @ full_w.double().T + full_b.double()
    torch.testing.assert_close(
        got.double(), reference_energy(z[None], tokens[None], 0.7)[0], rtol=1e-4, atol=1e-6
    )
    assert (
        len(calls) == 1
        and calls[0][1] is None
        and {id(p) for p in calls[0][0]} == {id(head.weight), id(head.bias)}
    )
    assert head.weight.numel() == 0  # released after the read
    for p in (head.weight, head.bias):  # already available: no second gather
        p.data, p.ds_status = p.ds_full, ZeroParamStatus.AVAILABLE
    head_energy(head, HeadTransform(), hidden, tokens, 0.7)
    assert len(calls) == 1


def test_left_padded_rows_keep_their_positions():
    """A model with absolute position embeddings (GPT-2) numbers each row's first real token 0 when it
    generates; a left-padded row scored without position ids would be scored at shifted positions."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # tied to the embedding: sharpens both
    g = torch.Generator().manual_seed(1)
    row = torch.randint(3, VOCAB, (1, 10), generator=g)
    pad = 4
    padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), row], 1)
    attention = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(row)], 1)
    n = 5
    alone = completion_energy(model, row, torch.ones_like(row), n, TEMPERATURE)
    in_batch = completion_energy(model, padded, attention, n, TEMPERATURE)
    reference = model_reference(model, row, torch.ones_like(row), n, TEMPERATURE)
    torch.testing.assert_close(alone.double(), reference, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(in_batch.double(), reference, rtol=1e-4, atol=1e-6)


def test_energy_forward_runs_without_dropout():
    """The energy of the policy as sampled: a model left in training mode (as inside a Trainer) with
    dropout gives the eval-mode energy, and stays in training mode afterwards."""
    config_cls, model_cls, _ = FAMILIES["qwen2"]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**COMMON, "attention_dropout": 0.5})
    model = getattr(transformers, model_cls)(config)
    ids, attention = _batch(model.eval(), n=5)
    expected = completion_energy(model, ids, attention, 5, TEMPERATURE)
    model.train()
    got = completion_energy(model, ids, attention, 5, TEMPERATURE)
    assert model.training
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------
# the head check in the precision the model ran in (issue 21: bf16=True refused a plain Llama)
# ----------------------------------------------------------------------------------------------------------


def _autocast_forward(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The model's forward wrapped in autocast, as accelerate wraps it for TRL's bf16=True / fp16=True
    (mixed precision over float32 weights); its logits come back in float32, as accelerate returns them."""
    forward = model.forward

    def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with torch.autocast("cpu", dtype=dtype):
            out = forward(*args, **kwargs)
        out.logits = out.logits.float()
        return out

    model.forward = wrapped
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wrapped", [True, False], ids=["forward_autocast", "caller_autocast"])
def test_float32_model_under_autocast_passes_the_head_check(dtype, wrapped):
    """A float32 tiny Llama run under bf16 (TRL's default) or fp16 autocast has a standard head: its logits
    are bf16-rounded, and a float32 rebuild compared at float32's tolerance refused it (relative error
    ~1e-3 here, 0.0059 on SmolLM2-135M). A head that is really unusual is still refused."""
    if not half_supported(dtype):
        pytest.skip(f"this CPU has no {dtype} autocast")
    torch.manual_seed(0)
    model = family_model("llama")
    scaled = ScaledQwen2(transformers.Qwen2Config(**COMMON)).eval()
    if wrapped:
        _autocast_forward(model, dtype)
        _autocast_forward(scaled, dtype)
        assert check_head(model) == HeadTransform()
        with pytest.raises(ValueError, match="ScaledQwen2.*energy_from_logits"):
            check_head(scaled)
    else:
        with torch.autocast("cpu", dtype=dtype):
            assert check_head(model) == HeadTransform()
            with pytest.raises(ValueError, match="ScaledQwen2.*energy_from_logits"):
                check_head(scaled)


def test_half_precision_tolerance_still_refuses_a_small_change():
    """Under bf16 autocast the tolerance widens to 2e-2 of the largest logit: a head scaled by 1.1 (a 10%
    change, e.g. an unread logit multiplier) is still refused."""
    if not half_supported(torch.bfloat16):
        pytest.skip("this CPU has no bf16 autocast")

    class Slightly(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 1.1
            return out

    torch.manual_seed(0)
    model = _autocast_forward(Slightly(transformers.LlamaConfig(**COMMON)).eval(), torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(SHARPEN)
    with pytest.raises(ValueError, match="Slightly.*relative error"):
        check_head(model)


# ----------------------------------------------------------------------------------------------------------
# every public energy function is right or refuses (issue 24 item 4)
# ----------------------------------------------------------------------------------------------------------


def _recurrent_gemma(cap: float = 5.0) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.RecurrentGemmaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        lru_width=32,
        attention_window_size=16,
        conv1d_width=4,
        block_types=["recurrent", "attention"],
        logits_soft_cap=cap,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.RecurrentGemmaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(SHARPEN)
    return model


def test_recurrent_gemmas_logit_cap_is_read():
    """RecurrentGemma soft-caps its logits with `logits_soft_cap` (not Gemma-2's field name): the energy
    used to be the uncapped distribution's (relative error ~0.99 with a cap of 5)."""
    model = _recurrent_gemma()
    assert head_transform(model) == HeadTransform(1.0, 5.0)
    ids, attention = _batch(model, prompt=6, n=5)
    attention = torch.ones_like(attention)  # no left padding: its recurrent blocks do not mask
    ids[0, :3] = 5
    expected = model_reference(model, ids, attention, 5, TEMPERATURE)
    got = completion_energy(model, ids, attention, 5, TEMPERATURE)
    torch.testing.assert_close(got.double(), expected, rtol=2e-5, atol=1e-7)
    assert check_head(model).origin == "checked"


class SlicedVocab(transformers.Qwen2ForCausalLM):
    """A head that keeps only the first 40 logits (as Inkling's unpadded_vocab_size does)."""

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        out = super().forward(*args, **kwargs)
        out.logits = out.logits[..., :40]
        return out


class HalvedHidden(transformers.Qwen2ForCausalLM):
    """A head that divides the hidden states before the projection (a muP width multiplier)."""

    def forward(self, *args, logits_to_keep=0, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
        out = self.model(*args, **kwargs)
        hidden = out.last_hidden_state if logits_to_keep == 0 else out.last_hidden_state[:, -logits_to_keep:]
        return transformers.modeling_outputs.CausalLMOutputWithPast(logits=self.lm_head(hidden / 2.0))


@pytest.mark.parametrize("cls", [SlicedVocab, HalvedHidden, ScaledQwen2])
def test_unusual_heads_are_refused_by_every_energy_function(cls):
    """completion_energy checks the head as the trainer does: an unusual head gets the friendly refusal
    (never a shape error, never another distribution's energy), and the way out works."""
    torch.manual_seed(0)
    model = cls(transformers.Qwen2Config(**COMMON)).eval()
    ids, attention = _batch(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)).eval())
    with pytest.raises(ValueError, match=f"{cls.__name__}.*energy_from_logits"):
        completion_energy(model, ids, attention, 5, TEMPERATURE)
    if cls is not SlicedVocab:  # the sampled ids may lie beyond the 40 logits kept
        expected = model_reference(model, ids, attention, 5, TEMPERATURE)
        got = completion_energy(model, ids, attention, 5, TEMPERATURE, from_logits=True)
        torch.testing.assert_close(got.double(), expected, rtol=2e-5, atol=1e-7)


def test_head_energy_takes_a_verified_or_declared_transform():
    """head_energy refuses a transform read from a config (unverified); the one check_head returns, or
    one declared by hand for a bare head, is accepted."""
    model = family_model("gemma2")
    ids, attention = _batch(model)
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state[:, -7:-1]
    with pytest.raises(ValueError, match="transform: .*check_head"):
        head_energy(model.lm_head, head_transform(model), hidden, ids[:, -6:], TEMPERATURE)
    checked = head_energy(model.lm_head, check_head(model), hidden, ids[:, -6:], TEMPERATURE)
    declared = head_energy(model.lm_head, HeadTransform(1.0, 5.0), hidden, ids[:, -6:], TEMPERATURE)
    torch.testing.assert_close(checked, declared, rtol=0, atol=0)
    expected = model_reference(model, ids, attention, 6, TEMPERATURE)
    torch.testing.assert_close(checked.double(), expected, rtol=2e-5, atol=1e-7)
