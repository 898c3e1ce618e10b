"""otbrl's KV-cache sampler against transformers' `generate` on a tiny model: it stops where `generate`
stops (every declared eos id, stop strings) and draws each token as `generate` draws it with top-k, top-p,
min-p and the repetition penalty (the same tokens from the same seed, and the same distribution from an
independent generator), while the log-probs and the energy it returns stay those of softmax(z / T).
References are float64 loops or transformers' own code, never otbrl's.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GenerationConfig, LogitsProcessorList  # noqa: E402

from otbrl.rollout.sampler import (  # noqa: E402
    EOS,
    STOP_STRING,
    SamplingSettings,
    attention_for_decoding,
    decode,
    eos_token_ids,
    float32_head,
    sample,
)
from otbrl.tasks import char_tokenizer  # noqa: E402
from otbrl.tasks.tokenizer import VOCAB  # noqa: E402
from tests.models import family_model, half_supported  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TOK = char_tokenizer()
PAD, FIRST_EOS = VOCAB["<pad>"], VOCAB["<eos>"]
SECOND_EOS = VOCAB[";"]  # an end-of-turn token the model declares next to the tokenizer's eos
SETTINGS = {
    "top_k": {"top_k": 3},
    "top_k_1": {"top_k": 1},
    "top_p": {"top_p": 0.6},
    "min_p": {"min_p": 0.25},
    "repetition_penalty": {"repetition_penalty": 2.5},
    "all": {"top_k": 6, "top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.5},
}


def biased_model(bias: dict[int, float], sharpen: float = 3.0, seed: int = 0) -> torch.nn.Module:
    """The tiny Qwen2 with an output head that has a bias (`bias`: token id -> logit offset)."""
    model = family_model("qwen2", seed=seed, sharpen=sharpen)
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        for token, value in bias.items():
            head.bias[token] = value
    model.lm_head = head
    return model.eval()


def prompts(rows: int, width: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, width) left-padded prompts of random characters (half of them 2 tokens shorter)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, len(VOCAB), (rows, width), generator=g)
    mask = torch.ones_like(ids)
    mask[: rows // 2, :2] = 0
    ids[: rows // 2, :2] = PAD
    return ids, mask


def generate(model, ids, mask, new: int, temperature: float, eos, seed: int, **settings):  # noqa: ANN001, ANN201
    """transformers' `generate` as TRL calls it (do_sample, its eos ids, its pad), seeded; new tokens only."""
    config = GenerationConfig(
        do_sample=True,
        max_new_tokens=new,
        temperature=temperature,
        eos_token_id=eos,
        pad_token_id=PAD,
        top_k=settings.get("top_k", 0),
        top_p=settings.get("top_p", 1.0),
        min_p=settings.get("min_p"),
        repetition_penalty=settings.get("repetition_penalty", 1.0),
        stop_strings=settings.get("stop_strings"),
    )
    torch.manual_seed(seed)
    extra = {"tokenizer": TOK} if settings.get("stop_strings") else {}
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, **extra)
    return out[:, ids.shape[1] :]


def sampled(model, ids, mask, new: int, temperature: float, eos, seed: int, **settings):  # noqa: ANN001, ANN201
    """otbrl's sampler from the same global seed as `generate`."""
    torch.manual_seed(seed)
    return decode(
        model, ids, mask, new, temperature, eos, PAD, sampling=SamplingSettings(**settings), tokenizer=TOK
    )


def same_tokens(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Equal where both generated; `generate` pads finished rows up to its own last step."""
    n = ours.shape[1]
    return torch.equal(ours, theirs[:, :n]) and bool((theirs[:, n:] == PAD).all())


def first_end(row: list[int], ends: set[int]) -> int:
    """Length of a completion that stops at the first id of `ends` (included); the whole row otherwise."""
    for t, tok in enumerate(row):
        if tok in ends:
            return t + 1
    return len(row)


# ----------------------------------------------------------------------------------------------------------
# where a row ends
# ----------------------------------------------------------------------------------------------------------


def test_eos_ids_are_the_generation_configs_and_the_tokenizers():
    model = biased_model({})
    model.generation_config.eos_token_id = [SECOND_EOS, 40]
    assert eos_token_ids(model, TOK) == [FIRST_EOS, SECOND_EOS, 40]  # TRL's rule: the tokenizer's first
    model.generation_config.eos_token_id = SECOND_EOS
    assert eos_token_ids(model, TOK) == [FIRST_EOS, SECOND_EOS]
    model.generation_config.eos_token_id = None
    assert eos_token_ids(model, TOK) == [FIRST_EOS]


def test_a_model_with_two_eos_ids_stops_at_the_first_like_generate():
    """The model declares a second eos id, which it samples often: every row ends at the first of the
    two, with the same tokens as `generate` from the same seed; with the tokenizer's eos alone (the
    sampler before), rows ran past it."""
    model = biased_model({SECOND_EOS: 2.5})
    model.generation_config.eos_token_id = [FIRST_EOS, SECOND_EOS]
    ids, mask = prompts(32)
    eos = eos_token_ids(model, TOK)
    out = sampled(model, ids, mask, 12, 1.0, eos, seed=3)
    assert same_tokens(out.completion_ids, generate(model, ids, mask, 12, 1.0, eos, seed=3))
    ended = 0
    for i, row in enumerate(out.completion_ids.tolist()):
        n = int(out.completion_mask[i].sum())
        assert n == first_end(row, {FIRST_EOS, SECOND_EOS})
        assert out.completion_mask[i, :n].all() and not out.completion_mask[i, n:].any()
        if row[n - 1] == SECOND_EOS:
            ended += 1
            assert int(out.reason[i]) == EOS
    assert ended >= 8, "the second eos id should end many rows"
    before = sampled(model, ids, mask, 12, 1.0, FIRST_EOS, seed=3)  # stops at the tokenizer's eos only
    ran_past = [
        int(before.completion_mask[i].sum()) > first_end(row, {FIRST_EOS, SECOND_EOS})
        for i, row in enumerate(before.completion_ids.tolist())
    ]
    assert sum(ran_past) >= 8


def test_sample_stops_at_every_eos_id_of_the_model():
    model = biased_model({SECOND_EOS: 2.5})
    model.generation_config.eos_token_id = [FIRST_EOS, SECOND_EOS]
    out = sample(model, TOK, ["12+3=", "45+67="], 8, 12, generator=torch.Generator().manual_seed(0))
    for row, keep in zip(out.completion_ids.tolist(), out.completion_mask.tolist(), strict=True):
        assert sum(keep) == first_end(row, {FIRST_EOS, SECOND_EOS})
    assert any(SECOND_EOS in row for row in out.completion_ids.tolist())


def test_stop_strings_end_rows_like_generate():
    """A row ends with the token that completes a stop string (kept; the string may begin in the
    prompt, as in `generate`), with the tokens `generate` draws from the same seed."""
    model = biased_model({VOCAB["a"]: 3.0, VOCAB["b"]: 3.0})
    ids, mask = prompts(32, seed=1)
    eos = [FIRST_EOS]
    out = sampled(model, ids, mask, 16, 1.0, eos, seed=5, stop_strings=("ab", "ba"))
    theirs = generate(model, ids, mask, 16, 1.0, eos, seed=5, stop_strings=["ab", "ba"])
    assert same_tokens(out.completion_ids, theirs)
    stopped = 0
    for i, row in enumerate(out.completion_ids.tolist()):
        n = int(out.completion_mask[i].sum())
        prompt = ids[i][mask[i].bool()].tolist()
        ends = [TOK.decode(prompt + row[:k]).endswith(("ab", "ba")) for k in range(1, n + 1)]
        assert not any(ends[:-1])  # no earlier token completed a stop string
        if int(out.reason[i]) == STOP_STRING:
            stopped += 1
            assert ends[-1]
        else:
            assert not ends[-1] and (row[n - 1] == FIRST_EOS or n == 16)
    assert stopped >= 16


@pytest.mark.parametrize("name", ["qwen2", "llama", "gemma2"])
@pytest.mark.parametrize("settings", [{}, SETTINGS["all"]])
def test_dropping_ended_rows_from_the_cache_keeps_every_draw(name, settings):
    """Rows that have ended leave the KV cache and the forward (`compact`): every token, mask and reason
    equals the reference loop's, and log-probs and energies agree to float32 rounding (the forward runs
    on a smaller batch), while rows end at many different steps."""
    model = family_model(name, seed=1, sharpen=4.0)
    ids, mask = prompts(40, seed=5)
    budget = torch.tensor([3 + (i * 7) % 20 for i in range(40)])  # own budgets too: 3..22 tokens
    eos = [FIRST_EOS, SECOND_EOS]
    out = {}
    for compact in (False, True):
        torch.manual_seed(3)
        out[compact] = decode(
            model, ids, mask, budget, 0.9, eos, PAD, sampling=SamplingSettings(**settings), compact=compact
        )
    ref, fast = out[False], out[True]
    lengths = ref.completion_mask.sum(1)
    assert len(set(lengths.tolist())) > 5  # rows did end at many steps: the compaction was exercised
    for field in ("completion_ids", "completion_mask", "reason"):
        assert torch.equal(getattr(ref, field), getattr(fast, field)), field
    torch.testing.assert_close(fast.logprobs, ref.logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(fast.energy, ref.energy, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# how a token is drawn
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_each_setting_draws_the_tokens_generate_draws(name, temperature):
    """From the same seed, the sampler draws exactly `generate`'s tokens with the setting on (8 steps,
    48 rows, left padding, two eos ids); without it, different ones: the setting matters here."""
    model = biased_model({SECOND_EOS: 1.0})
    ids, mask = prompts(48, seed=2)
    eos = [FIRST_EOS, SECOND_EOS]
    settings = SETTINGS[name]
    theirs = generate(model, ids, mask, 8, temperature, eos, seed=11, **settings)
    assert same_tokens(
        sampled(model, ids, mask, 8, temperature, eos, seed=11, **settings).completion_ids, theirs
    )
    assert not same_tokens(sampled(model, ids, mask, 8, temperature, eos, seed=11).completion_ids, theirs)


def test_top_k_1_is_greedy_whatever_the_seed():
    model = biased_model({})
    ids, mask = prompts(16, seed=4)
    greedy = decode(model, ids, mask, 8, 0.0, [FIRST_EOS], PAD).completion_ids
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        out = decode(model, ids, mask, 8, 1.0, [FIRST_EOS], PAD, sampling=SamplingSettings(top_k=1))
        assert torch.equal(out.completion_ids, greedy)


def _generates_processors(model, ids, mask, temperature: float, **settings) -> LogitsProcessorList:  # noqa: ANN001
    """The processors `generate` itself builds for these settings (transformers' private builder)."""
    config = GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_k=settings.get("top_k", 0),
        top_p=settings.get("top_p", 1.0),
        min_p=settings.get("min_p"),
        repetition_penalty=settings.get("repetition_penalty", 1.0),
        max_new_tokens=1,
        pad_token_id=PAD,
        eos_token_id=FIRST_EOS,
    )
    config, _ = model._prepare_generation_config(config)
    model._prepare_special_tokens(config, device=ids.device)
    return model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=ids.shape[1],
        encoder_input_ids=ids,
        prefix_allowed_tokens_fn=None,
        logits_processor=LogitsProcessorList(),
        device=ids.device,
        model_kwargs={"attention_mask": mask},
    )


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_processors_are_generates_in_generates_order(name):
    model = biased_model({})
    ids, mask = prompts(4)
    settings = SETTINGS[name]
    ours = SamplingSettings(**settings).processors(0.7, mask)
    theirs = _generates_processors(model, ids, mask, 0.7, **settings)
    assert [type(p) for p in ours] == [type(p) for p in theirs]
    for a, b in zip(ours, theirs, strict=True):
        for key in ("penalty", "temperature", "top_k", "top_p", "min_p", "min_tokens_to_keep"):
            assert getattr(a, key, None) == getattr(b, key, None), key
        if hasattr(b, "prompt_ignore_length"):
            assert torch.equal(a.prompt_ignore_length, b.prompt_ignore_length)


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value of `counts` against `probs`, pooling categories expected fewer
    than 5 times into one (a category of probability 0 must have count 0: checked by the caller)."""
    from scipy.stats import chisquare

    total = float(counts.sum())
    expected = probs.double() * total
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    if float(exp[-1]) == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs.numpy(), exp.numpy() * float(obs.sum()) / float(exp.sum())).pvalue)


@pytest.mark.parametrize("name", ["top_k", "top_p", "min_p", "repetition_penalty"])
def test_first_token_distribution_is_generates(name):
    """20000 independent draws of the first token from one prompt, from the sampler's own generator and
    from `generate`: each fits the distribution `generate`'s own processors give (p > 1e-3), tokens that
    distribution excludes are never drawn, and the unfiltered softmax(z / T) is rejected (p < 1e-6), so a
    sampler that ignored the setting would fail."""
    pytest.importorskip("scipy")
    temperature, rows = 0.8, 20000
    model = biased_model({}, sharpen=8.0)
    prompt = torch.tensor([[4, 16, 16, 16, 16, 16]])  # greedy's own tokens: the penalty has work to do
    ids, mask = prompt.expand(rows, -1).contiguous(), torch.ones(rows, prompt.shape[1], dtype=torch.long)
    settings = SETTINGS[name]
    with torch.no_grad():
        logits = model(input_ids=prompt).logits[:, -1].float()
    target = torch.softmax(
        _generates_processors(model, prompt, mask[:1], temperature, **settings)(prompt, logits.clone()),
        dim=-1,
    )[0]
    plain = torch.softmax(logits / temperature, dim=-1)[0]
    gen = torch.Generator().manual_seed(123)
    ours = decode(
        model,
        ids,
        mask,
        1,
        temperature,
        [FIRST_EOS],
        PAD,
        generator=gen,
        sampling=SamplingSettings(**settings),
    ).completion_ids[:, 0]
    theirs = generate(model, ids, mask, 1, temperature, [FIRST_EOS], seed=7, **settings)[:, 0]
    vocab = logits.shape[-1]
    for draws in (ours, theirs):
        counts = torch.bincount(draws, minlength=vocab)
        assert int(counts[target == 0].sum()) == 0
        assert _chi_square_p(counts, target) > 1e-3
    assert float((target - plain).abs().sum()) / 2 > 0.15  # total variation: the setting matters here
    assert _chi_square_p(torch.bincount(ours, minlength=vocab), plain) < 1e-6


# ----------------------------------------------------------------------------------------------------------
# what the sampler returns with each token
# ----------------------------------------------------------------------------------------------------------


def test_logprobs_and_energy_stay_on_the_unfiltered_softmax():
    """With filters and a penalty on, each token's log-prob and energy are those of softmax(z / T) of the
    model's own full-context logits (float64 loops): the policy TRL's loss differentiates."""
    temperature = 0.7
    model = biased_model({SECOND_EOS: 1.0})
    ids, mask = prompts(8, seed=6)
    torch.manual_seed(0)
    settings = SamplingSettings(top_k=4, top_p=0.9, repetition_penalty=1.8)
    out = decode(model, ids, mask, 6, temperature, [FIRST_EOS, SECOND_EOS], PAD, sampling=settings)
    width = out.completion_ids.shape[1]
    full = torch.cat([ids, out.completion_ids], dim=1)
    attention = torch.cat([mask, out.completion_mask], dim=1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=attention).logits.double()
    for i in range(ids.shape[0]):
        for t in range(width):
            if not out.completion_mask[i, t]:
                assert out.logprobs[i, t] == 0 and out.energy[i, t] == 0
                continue
            z = logits[i, ids.shape[1] + t - 1] / temperature
            p = [math.exp(float(v)) for v in z - z.max()]
            total = sum(p)
            y = int(out.completion_ids[i, t])
            logp = math.log(p[y] / total)
            energy = sum((float(k == y) - p[k] / total) ** 2 for k in range(len(p)))
            assert float(out.logprobs[i, t]) == pytest.approx(logp, abs=2e-5)
            assert float(out.energy[i, t]) == pytest.approx(energy, abs=2e-5)


@pytest.mark.skipif(not half_supported(torch.bfloat16), reason="no bf16 autocast on this CPU")
def test_float32_head_under_bf16_autocast():
    """Under bf16 autocast the head runs in bf16; inside `float32_head` (and with `head_in_float32`) it
    runs in float32 on the float32 hidden states, exactly `F.linear` in float32, and is restored after."""
    model = biased_model({SECOND_EOS: 1.0})
    head = model.get_output_embeddings()
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hook = head.register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
    ids, mask = prompts(4)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            decode(model, ids, mask, 3, 1.0, [FIRST_EOS], PAD)
            assert seen and all(out.dtype == torch.bfloat16 for _, out in seen)
            seen.clear()
            decode(model, ids, mask, 3, 1.0, [FIRST_EOS], PAD, head_in_float32=True)
    finally:
        hook.remove()
    assert seen and all(out.dtype == torch.float32 for _, out in seen)
    for hidden, out in seen:
        expected = torch.nn.functional.linear(hidden.float(), head.weight.float(), head.bias.float())
        assert torch.equal(out, expected)
    assert "forward" not in head.__dict__  # restored: the class's own forward again

    def own(hidden):  # noqa: ANN001, ANN202 -- an instance-level forward (as TRL's cast installs) survives
        return torch.zeros(1)

    head.forward = own
    with float32_head(model):
        assert head.forward is not own
    assert head.forward is own


def test_decoding_on_cuda_leaves_out_cudnn_attention_and_only_there(monkeypatch):
    """On CUDA the loop runs with every SDPA backend but cuDNN's (whose per-length graph builds made
    1,024-token decoding 3x slower on an H100); the flags come back afterwards, and on the CPU the loop
    runs under whatever the caller set. `decode` enters the context for the model's device."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with attention_for_decoding(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with attention_for_decoding(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before

    import otbrl.rollout.sampler as sampler

    seen = []

    def spy(device):  # noqa: ANN001, ANN202
        seen.append(device)
        return attention_for_decoding(torch.device("cuda"))  # the CUDA context, on CPU tensors

    monkeypatch.setattr(sampler, "attention_for_decoding", spy)
    ids, mask = prompts(4)
    model = family_model("qwen2", seed=0).eval()
    g = torch.Generator().manual_seed(0)
    out = decode(model, ids, mask, 5, 1.0, [FIRST_EOS], PAD, generator=g)
    g = torch.Generator().manual_seed(0)
    monkeypatch.undo()
    ref = decode(model, ids, mask, 5, 1.0, [FIRST_EOS], PAD, generator=g)
    assert seen == [ids.device]
    assert torch.equal(out.completion_ids, ref.completion_ids)  # CPU kernels: the same numbers


def test_settings_are_checked():
    for kwargs, name in [
        ({"top_k": -1}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop_strings": ("",)}, "stop_strings"),
    ]:
        with pytest.raises(ValueError, match=f"^{name}:"):
            SamplingSettings(**kwargs)
    assert SamplingSettings(stop_strings="ab").stop_strings == ("ab",)
    ids, mask = prompts(2)
    with pytest.raises(ValueError, match="^tokenizer:"):
        decode(
            biased_model({}), ids, mask, 2, 1.0, [FIRST_EOS], PAD, sampling=SamplingSettings(stop_strings="a")
        )


def test_a_progress_observer_sees_every_step_and_changes_nothing():
    """evaluate(progress=True) draws a bar through sample's on_step: one call per decoding step, and the
    same completions as without it (same generator stream)."""
    from otbrl.rollout import evaluate
    from otbrl.rollout.sampler import sample

    model, tok = biased_model({}), char_tokenizer()
    texts = ["12+3=", "7+70=", "5+5="]
    steps = []
    seen = sample(
        model, tok, texts, 2, 8, 1.0, torch.Generator().manual_seed(3), on_step=lambda: steps.append(1)
    )
    plain = sample(model, tok, texts, 2, 8, 1.0, torch.Generator().manual_seed(3))
    assert torch.equal(seen.completion_ids, plain.completion_ids) and seen.texts == plain.texts
    assert 1 <= len(steps) <= 8 and len(steps) == seen.completion_mask.sum(1).max().item()
    rows = [{"prompt": t, "answer": "1"} for t in texts]
    score = lambda p, c, a: [float(len(x) % 2) for x in c]  # noqa: E731
    assert evaluate(model, tok, rows, score, 8, progress=True) == evaluate(model, tok, rows, score, 8)


def test_several_samples_per_prompt_score_their_mean():
    """evaluate(samples=k) scores k completions of each prompt (the mean over all of them); k = 1 is
    the one-sample evaluation unchanged."""
    from otbrl.rollout import evaluate

    model, tok = biased_model({}), char_tokenizer()
    rows = [{"prompt": t, "answer": "1"} for t in ("12+3=", "7+70=", "5+5=", "9+1=")]
    seen: list[list[str]] = []

    def score(p, c, a):  # noqa: ANN001, ANN202
        seen.append(list(p))
        return [float(len(x) % 2) for x in c]

    one = evaluate(model, tok, rows, score, 8, seed=4)
    assert seen[-1] == [r["prompt"] for r in rows]
    many = evaluate(model, tok, rows, score, 8, seed=4, samples=3)
    assert seen[-1] == [r["prompt"] for r in rows for _ in range(3)]
    assert 0.0 <= many <= 1.0 and one == evaluate(model, tok, rows, score, 8, seed=4, samples=1)
    with pytest.raises(ValueError, match="samples"):
        evaluate(model, tok, rows, score, 8, samples=0)


def test_a_compact_evaluation_decodes_compacted_and_scores_the_same_completions(monkeypatch):
    """evaluate(compact=True) asks `decode` to drop ended rows and, on this model (rows that end at
    different steps, the same draws), scores exactly the completions of the plain evaluation."""
    import otbrl.rollout.sampler as sampler
    from otbrl.rollout import evaluate

    model, tok = biased_model({FIRST_EOS: 1.5}), char_tokenizer()
    rows = [{"prompt": t, "answer": "1"} for t in ("12+3=", "7+70=", "5+5=", "9+1=", "40+2=", "3+3=")]
    texts: list[list[str]] = []
    real, asked = sampler.decode, []

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        asked.append(kwargs.get("compact"))
        return real(*args, **kwargs)

    def score(p, c, a):  # noqa: ANN001, ANN202
        texts.append(list(c))
        return [float(len(x) % 2) for x in c]

    monkeypatch.setattr(sampler, "decode", spy)
    plain = evaluate(model, tok, rows, score, 12, seed=5, samples=4)
    compact = evaluate(model, tok, rows, score, 12, seed=5, samples=4, compact=True)
    assert asked == [False, True]
    assert len({len(t) for t in texts[0]}) > 1, "every row ended together: nothing was compacted"
    assert texts[0] == texts[1] and plain == compact


def test_a_chunked_evaluation_bounds_the_batch_and_scores_every_completion(monkeypatch):
    """evaluate(batch_size=k) decodes at most k completions at a time (the KV cache's bound), scores all
    of them in order, is reproducible, and equals the one-batch evaluation where nothing is random
    (greedy) or where k covers every row."""
    from otbrl.rollout import evaluate

    model, tok = biased_model({}), char_tokenizer()
    rows = [{"prompt": t, "answer": "1"} for t in ("12+3=", "7+70=", "5+5=", "9+1=", "40+2=")]
    seen: list[list[str]] = []

    def score(p, c, a):  # noqa: ANN001, ANN202
        seen.append(list(p))
        return [float(len(x) % 2) + 0.1 * i for i, x in enumerate(c)]  # depends on order too

    module = __import__("otbrl.rollout.evaluate", fromlist=["sample_texts"])
    real, sizes = module.sample_texts, []

    def spy(model, tokenizer, prompts, *args, **kwargs):  # noqa: ANN001, ANN202
        sizes.append(len(prompts))
        return real(model, tokenizer, prompts, *args, **kwargs)

    monkeypatch.setattr(module, "sample_texts", spy)
    chunked = evaluate(model, tok, rows, score, 8, seed=2, samples=2, batch_size=3)
    assert sizes == [3, 3, 3, 1] and seen[-1] == [r["prompt"] for r in rows for _ in range(2)]
    assert chunked == evaluate(model, tok, rows, score, 8, seed=2, samples=2, batch_size=3)
    sizes.clear()
    whole = evaluate(model, tok, rows, score, 8, seed=2, batch_size=5)
    assert sizes == [5] and whole == evaluate(model, tok, rows, score, 8, seed=2)
    greedy = evaluate(model, tok, rows, score, 8, temperature=0.0, batch_size=2)
    assert greedy == evaluate(model, tok, rows, score, 8, temperature=0.0)
    with pytest.raises(ValueError, match="batch_size"):
        evaluate(model, tok, rows, score, 8, batch_size=0)
