"""Tests for otbrl.tasks: tokenizer round trips, task rewards and datasets, tiny models, the KV-cache
sampler (against a full forward pass) and the cached warm start.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch  # noqa: E402

from otbrl.rollout.sampler import sample  # noqa: E402
from otbrl.tasks import TASKS, char_tokenizer, dataset, get_task, running_sum_dense  # noqa: E402
from otbrl.tasks.models import PRESETS, tiny_model  # noqa: E402
from otbrl.tasks.tokenizer import CHARS, SPECIAL_TOKENS, VOCAB_SIZE  # noqa: E402
from otbrl.tasks.warmstart import _earliest_passing, warm_start  # noqa: E402

GARBAGE = ["", " ", "<eos>", "<pad><pad>", ";", ";;;", "x" * 300, "12;", "<unk>", "\n\t", "::::;9x"]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def _corrupt(answer: str) -> str:
    """Change the last character to a different one of the same kind."""
    last = answer[-1]
    new = str((int(last) + 1) % 10) if last.isdigit() else chr((ord(last) - 97 + 1) % 26 + 97)
    return answer[:-1] + new


# ----------------------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------------------


def test_tokenizer_round_trips_every_task(tok):
    for name in TASKS:
        for row in dataset(name, 50, seed=3):
            text = row["prompt"] + row["answer"]
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert len(ids) == len(text)  # one token per character, nothing added
            assert tok.unk_token_id not in ids
            assert tok.decode(ids) == text
    every = CHARS + CHARS[::-1]
    assert tok.decode(tok(every)["input_ids"]) == every


def test_tokenizer_special_tokens_and_trl_attributes(tok, tmp_path):
    assert len(tok) == VOCAB_SIZE
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3]
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert tok.padding_side == "left" and tok.model_max_length >= 128
    ids = tok("12<eos><pad>", add_special_tokens=False)["input_ids"]
    assert ids[2:] == [tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "12"
    assert tok.decode(ids) == "12<eos><pad>"
    assert tok("A!")["input_ids"] == [tok.unk_token_id] * 2
    batch = tok(["1", "123"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0].tolist() == [
        tok.pad_token_id,
        tok.pad_token_id,
        tok.convert_tokens_to_ids("1"),
    ]
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again("ab c;9")["input_ids"] == tok("ab c;9")["input_ids"]
    assert again.decode(again("ab c;9")["input_ids"]) == "ab c;9"
    assert again.padding_side == "left" and again.eos_token_id == tok.eos_token_id


def test_task_modules_do_not_import_transformers():
    code = (
        "import sys, otbrl.tasks; otbrl.tasks.dataset('reverse', 2); assert 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------------------------------------
# tasks
# ----------------------------------------------------------------------------------------------------------


def test_examples_match_the_documented_formats():
    add = dataset("add_reversed", 200, seed=1)
    for row in add:
        a, b = row["prompt"][:-1].split("+")
        assert row["prompt"].endswith("=") and len(a) == len(b) == 3
        assert int(row["answer"][::-1]) == int(a) + int(b)
    for row in dataset("reverse", 200, seed=1):
        word = row["prompt"][:-1]
        assert row["prompt"].endswith(":") and 6 <= len(word) <= 10 and word.isalpha()
        assert row["answer"] == word[::-1]
    for n in (16, 48):
        for row in dataset(f"running_sum{n}", 50, seed=1):
            digits = row["prompt"][:-1]
            assert len(digits) == n and digits.isdigit() and row["prompt"].endswith(":")
            chain, final = row["answer"].split(";")
            assert len(chain) == n and final == chain[-1]
            assert all(int(chain[i]) == sum(map(int, digits[: i + 1])) % 10 for i in range(n))
    assert len(dataset("running_sum48", 1)[0]["answer"]) + 1 >= 48


@pytest.mark.parametrize("name", sorted(TASKS))
def test_reward_is_exact_and_robust(name):
    task = TASKS[name]
    for row in dataset(name, 30, seed=2):
        answer = row["answer"]
        assert len(answer) + 1 <= task.max_completion_tokens
        assert task.reward(answer, answer) == 1.0
        assert task.reward(f" {answer}\n", answer) == 1.0  # surrounding whitespace is stripped
        assert task.reward(answer + "<eos><pad><pad>", answer) == 1.0  # special tokens kept by the caller
        assert task.reward(_corrupt(answer), answer) == 0.0
        assert task.reward(answer + "7", answer) == 0.0
        for junk in GARBAGE:
            assert task.reward(junk, answer) in (0.0, 1.0)


def test_running_sum_rewards_only_the_end():
    task = TASKS["running_sum16"]
    answer = dataset(task, 1, seed=5)[0]["answer"]
    chain, final = answer.split(";")
    wrong_chain = "".join(str((int(c) + 1) % 10) for c in chain)
    assert task.reward(f"{wrong_chain};{final}", answer) == 1.0
    assert task.reward(f";{final}", answer) == 1.0
    assert task.reward(chain, answer) == 0.0  # no ';'
    assert running_sum_dense(answer, answer) == 1.0
    assert running_sum_dense(f"{wrong_chain};{final}", answer) == pytest.approx(2 / len(answer))
    assert running_sum_dense("", answer) == 0.0
    assert 0.0 < running_sum_dense(answer + "123", answer) < 1.0


def test_dataset_is_deterministic():
    for name in TASKS:
        assert dataset(name, 20, seed=7) == dataset(name, 20, seed=7)
        assert dataset(name, 20, seed=7) != dataset(name, 20, seed=8)
        assert dataset(name, 5, seed=7) == dataset(name, 20, seed=7)[:5]
        assert set(dataset(name, 1)[0]) == {"prompt", "answer"}
    with pytest.raises(ValueError, match="task"):
        get_task("nope")


# ----------------------------------------------------------------------------------------------------------
# models and sampling
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_tiny_model_shapes(preset):
    model = tiny_model(preset, seed=1)
    ids = torch.randint(4, VOCAB_SIZE, (3, 11))
    assert model(input_ids=ids).logits.shape == (3, 11, VOCAB_SIZE)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.max_position_embeddings >= 128
    again = tiny_model(preset, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))


@pytest.fixture(scope="module")
def rollouts(tok):
    model = tiny_model("tiny", seed=0)
    prompts = ["964+494=", "abcdefghij:", "1:", "0123456789012345:"]
    gen = torch.Generator().manual_seed(0)
    out = sample(model, tok, prompts, num_samples=16, max_new_tokens=40, temperature=0.7, generator=gen)
    return model, out


def test_sample_shapes_and_layout(rollouts, tok):
    _, out = rollouts
    B, T = out.completion_ids.shape
    assert B == 64 and T <= 40
    assert out.prompt_ids.shape == out.prompt_mask.shape == (64, 17)
    assert out.completion_mask.shape == out.logprobs.shape == (B, T)
    assert out.group_ids.tolist() == [i for i in range(4) for _ in range(16)]
    assert (out.prompt_ids[:16, :9] == tok.pad_token_id).all()  # left padding: "964+494=" has 8 tokens
    assert (out.prompt_mask[:16].sum(-1) == 8).all()
    assert len(out.texts) == B


def test_sample_mask_ends_at_eos_and_pads_after(rollouts, tok):
    _, out = rollouts
    eos, pad = tok.eos_token_id, tok.pad_token_id
    ended = 0
    for ids, mask, lp, text in zip(
        out.completion_ids, out.completion_mask, out.logprobs, out.texts, strict=True
    ):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()  # one run of ones from the start
        assert (ids[n:] == pad).all() and (lp[n:] == 0).all()
        assert (lp[:n] <= 0).all()
        hits = (ids[:n] == eos).nonzero().flatten().tolist()
        assert hits in ([], [n - 1])  # eos, if any, is the last generated token
        ended += bool(hits)
        assert text == tok.decode(ids[:n].tolist(), skip_special_tokens=True)
    assert 0 < ended < len(out.texts)  # both cases are exercised


def test_sample_logprobs_match_a_full_forward_pass(rollouts):
    model, out = rollouts
    ids = torch.cat([out.prompt_ids, out.completion_ids], dim=1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.double()
    P = out.prompt_ids.shape[1]
    ref = torch.log_softmax(logits[:, P - 1 : -1] / 0.7, dim=-1)
    ref = ref.gather(-1, out.completion_ids[..., None]).squeeze(-1) * out.completion_mask
    torch.testing.assert_close(out.logprobs.double(), ref, atol=1e-4, rtol=0)


def test_sample_is_reproducible_and_greedy_is_deterministic(tok):
    model = tiny_model("tiny", seed=2)

    def run(temperature, seed):
        gen = torch.Generator().manual_seed(seed)
        return sample(model, tok, ["12+34=", "abc:"], 3, 8, temperature=temperature, generator=gen)

    a, b = run(1.0, 5), run(1.0, 5)
    assert torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts
    g = run(0.0, 0).completion_ids
    assert torch.equal(g[0], g[1]) and torch.equal(g[3], g[5])
    with pytest.raises(ValueError, match="temperature"):
        run(-1.0, 0)


# ----------------------------------------------------------------------------------------------------------
# warm start
# ----------------------------------------------------------------------------------------------------------


def test_warm_start_caches_and_reloads(tmp_path):
    kwargs = dict(
        target_reward=2.0, max_seconds=1.5, cache_dir=tmp_path, eval_every=5, eval_size=32, log=None
    )
    t0 = time.perf_counter()
    model, tok, info = warm_start("add_reversed", "tiny", **kwargs)
    first = time.perf_counter() - t0
    assert not info["cached"] and not info["reached"] and info["steps"] >= 1
    assert 0.0 <= info["reward"] <= 1.0 and info["history"]
    saved = list(tmp_path.iterdir())
    assert len(saved) == 1 and {"model.safetensors", "info.json", "tokenizer.json"} <= {
        p.name for p in saved[0].iterdir()
    }

    t0 = time.perf_counter()
    again, tok2, info2 = warm_start("add_reversed", "tiny", **kwargs)
    assert info2["cached"] and time.perf_counter() - t0 < first / 2
    assert info2["steps"] == info["steps"] and info2["reward"] == info["reward"]
    for (k, a), (k2, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b)
    assert tok2.decode(tok2("964+494=")["input_ids"]) == "964+494="

    # a bigger budget than the stored run had retrains, unless the stored run reached its target
    _, _, info3 = warm_start("add_reversed", "tiny", **{**kwargs, "max_seconds": 2.0})
    assert not info3["cached"]
    # target 0 passes at the first evaluation (step 4): the rewind goes back to the earliest passing state
    done = dict(kwargs, target_reward=0.0, eval_every=4, max_seconds=60.0)
    _, _, info4 = warm_start("add_reversed", "tiny", **done)
    assert info4["reached"] and info4["steps"] == 1 and info4["history"][-1]["rewound"]
    _, _, info5 = warm_start("add_reversed", "tiny", **{**done, "max_seconds": 100.0})
    assert info5["cached"]


def test_rewind_finds_the_earliest_passing_state():
    model = torch.nn.Linear(1, 1, bias=False)
    snapshots = [(s, {"weight": torch.full((1, 1), float(s))}) for s in range(1, 10)]
    model.weight.data.fill_(10.0)
    calls = []

    def reward_of_model():
        calls.append(model.weight.item())
        return float(model.weight.item() >= 6)

    assert _earliest_passing(model, snapshots, 10, 1.0, reward_of_model, target=0.5) == (6, 1.0)
    assert model.weight.item() == 6.0 and len(calls) <= 4


def test_shipped_checkpoint_stands_in_for_the_cache(tmp_path, monkeypatch):
    from otbrl.tasks import warmstart

    kwargs = dict(target_reward=2.0, max_seconds=1.0, eval_every=5, eval_size=16, log=None)
    shipped, cache = tmp_path / "shipped", tmp_path / "cache"
    warm_start("add_reversed", "tiny", cache_dir=shipped, **kwargs)  # what the README's command builds
    monkeypatch.setattr(warmstart, "SHIPPED", shipped)
    monkeypatch.setenv("OTBRL_CACHE", str(cache))
    _, _, info = warm_start("add_reversed", "tiny", **kwargs)
    assert info["cached"] and not cache.exists()  # loaded from the package, nothing rebuilt
    before = sorted(p.name for p in shipped.rglob("*"))
    _, _, info = warm_start(
        "add_reversed", "tiny", **{**kwargs, "max_seconds": 1.5}
    )  # a bigger budget rebuilds
    assert not info["cached"] and (cache / next(shipped.iterdir()).name / "info.json").is_file()
    assert sorted(p.name for p in shipped.rglob("*")) == before  # ... into the cache, never the package
