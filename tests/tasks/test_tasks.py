"""Tests for otbrl.tasks: tokenizer round trips, task rewards and datasets, tiny models, the KV-cache
sampler (against a full forward pass) and the cached warm start.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch  # noqa: E402

from otbrl.rollout.sampler import sample  # noqa: E402
from otbrl.tasks import TASKS, char_tokenizer, dataset, get_task  # noqa: E402
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
    for name in [n for n, t in TASKS.items() if t.vocabulary == "char"]:
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


@pytest.mark.parametrize("name", sorted(n for n in TASKS if TASKS[n].episode is None))
def test_reward_is_exact_and_robust(name):
    """The answer is itself a right completion (a task with an episode has a rule for its answer)."""
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


@pytest.mark.parametrize("name", sorted(n for n in TASKS if TASKS[n].episode is not None))
def test_episode_task_rewards_are_robust(name):
    """A demonstration is right, with whitespace or special tokens around it too; junk never raises."""
    import random

    task, rng = TASKS[name], random.Random(0)
    for row in dataset(name, 30, seed=2):
        text = "".join(t for t, _ in task.demonstrate(row["prompt"], row["answer"], rng))
        assert task.reward(text, row["answer"]) == 1.0
        assert task.reward(f" {text}\n", row["answer"]) == 1.0
        assert task.reward(text + "<eos><pad><pad>", row["answer"]) == 1.0
        assert task.reward(text + "7", row["answer"]) == 0.0
        for junk in GARBAGE:
            assert task.reward(junk, row["answer"]) in (0.0, 1.0)


def test_running_sum_rewards_only_the_end():
    task = TASKS["running_sum16"]
    answer = dataset(task, 1, seed=5)[0]["answer"]
    chain, final = answer.split(";")
    wrong_chain = "".join(str((int(c) + 1) % 10) for c in chain)
    assert task.reward(f"{wrong_chain};{final}", answer) == 1.0
    assert task.reward(f";{final}", answer) == 1.0
    assert task.reward(chain, answer) == 0.0  # no ';'


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


# ----------------------------------------------------------------------------------------------------------
# walk: a horizon the policy chooses
# ----------------------------------------------------------------------------------------------------------


def _walk_ok(text: str, start: int, target: int) -> bool:
    """Reference judge of a walk, written out by hand: two-digit positions, ',' between, '.' at the end,
    first = start, last = target, every step exactly 1."""
    if not text.endswith("."):
        return False
    parts = text[:-1].split(",")
    for p in parts:
        if len(p) != 2 or p[0] not in "0123456789" or p[1] not in "0123456789":
            return False
    positions = [int(p) for p in parts]
    if positions[0] != start or positions[-1] != target:
        return False
    for i in range(1, len(positions)):
        if abs(positions[i] - positions[i - 1]) != 1:
            return False
    return True


def test_walk_examples_match_the_documented_format():
    for row in dataset("walk", 300, seed=1):
        start, target = (int(x) for x in row["prompt"][:-1].split(" to "))
        assert row["prompt"] == f"{start:02d} to {target:02d}:" and 8 <= abs(target - start) <= 28
        positions = [int(p) for p in row["answer"][:-1].split(",")]
        step = 1 if target > start else -1
        assert positions == list(range(start, target + step, step))  # the direct walk
        assert row["answer"] == ",".join(f"{p:02d}" for p in positions) + "."


def test_walk_demonstrations_earn_reward_and_fit_the_budget():
    import random

    task, rng = TASKS["walk"], random.Random(0)
    for row in dataset(task, 200, seed=3):
        start, target = (int(x) for x in row["prompt"][:-1].split(" to "))
        for _ in range(5):
            segments = task.demonstrate(row["prompt"], row["answer"], rng)
            assert len(segments) == 1 and segments[0][1]  # all of it is the model's own text
            text = segments[0][0]
            assert _walk_ok(text, start, target) and task.reward(text, row["answer"]) == 1.0
            assert len(text) + 1 <= task.max_completion_tokens  # eos included
            positions = [int(p) for p in text[:-1].split(",")]
            assert all(0 <= p <= 99 for p in positions)
            assert target not in positions[:-1]  # a demonstration stops at its first visit


def test_walk_demonstration_lengths_vary_within_a_prompt():
    import random
    import statistics

    task, rng = TASKS["walk"], random.Random(1)
    lengths_all, cvs = [], []
    for row in dataset(task, 40, seed=4):
        lengths = [len(task.demonstrate(row["prompt"], row["answer"], rng)[0][0]) + 1 for _ in range(32)]
        cvs.append(statistics.pstdev(lengths) / statistics.fmean(lengths))
        lengths_all += lengths
        assert min(lengths) == len(row["answer"]) + 1  # the direct walk is among them ...
    assert statistics.fmean(cvs) >= 0.3  # ... and wandering ones, much longer
    assert statistics.median(lengths_all) >= 64 and max(lengths_all) > 150


def test_walk_reward_rejects_wrong_walks():
    task = TASKS["walk"]
    answer = "37,38,39,40."
    assert task.reward("37,38,39,40.", answer) == 1.0
    assert task.reward("37,36,37,38,39,40,41,40.", answer) == 1.0  # detours and overshoots are fine
    for wrong in [
        "37,38,39,40",  # cut off: no final '.'
        "37,38,39,41.",  # ends off target
        "38,39,40.",  # does not begin at the start
        "37,39,40.",  # a step of 2
        "37,38,38,39,40.",  # standing still
        "37,38,39,40.40.",
        "37,38,39,4.",  # one-digit position
        "37,38,39,040.",
        "37, 38,39,40.",
        "37,38,39,40,.",
        "40.",
        ".",
    ]:
        assert task.reward(wrong, answer) == 0.0, wrong
    with pytest.raises(ValueError, match="answer"):
        task.reward("37.", "not a walk")


@settings(max_examples=300, deadline=None)
@given(
    start=st.integers(0, 99),
    target=st.integers(0, 99),
    steps=st.lists(st.sampled_from([-2, -1, -1, 0, 1, 1, 2]), max_size=12),
    end=st.sampled_from([".", "", ",", ".."]),
)
def test_walk_reward_matches_a_hand_written_judge(start, target, steps, end):
    positions = [start]
    for s in steps:
        positions.append(positions[-1] + s)
    if any(not 0 <= p <= 99 for p in positions):
        return
    text = ",".join(f"{p:02d}" for p in positions) + end
    answer = ",".join(f"{p:02d}" for p in (start, target)) + "."  # only its ends matter
    assert TASKS["walk"].reward(text, answer) == float(_walk_ok(text, start, target))


def test_length_chunks_give_the_one_batch_gradient_step():
    """Warm-start steps on rows of very different lengths run as length-sorted chunks: the update must be
    the one-padded-batch update. Reference: one row at a time in float64, summed by hand."""
    import copy
    import random

    from otbrl.tasks.warmstart import _length_chunks, _train_step, supervised_batch

    tok, task, rng = char_tokenizer(), TASKS["walk"], random.Random(2)
    rows = []
    for row in dataset(task, 16, seed=5):
        rows.append({**row, "segments": task.demonstrate(row["prompt"], row["answer"], rng)})
    chunks = _length_chunks(tok, rows)
    assert len(chunks) > 1 and sorted(map(id, sum(chunks, []))) == sorted(map(id, rows))
    fixed = [{"prompt": "12+34=", "answer": "64"}] * 16
    assert _length_chunks(tok, fixed) == [fixed]  # fixed-format rows: one batch, as before

    model = tiny_model("tiny", vocab_size=len(tok), seed=3).double()
    reference = copy.deepcopy(model).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = _train_step(model, opt, tok, rows)

    total_nll, total_trained = 0.0, 0.0
    for row in rows:  # each row alone: no padding at all
        ids, attn, target = supervised_batch(tok, [row])
        logits = reference(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        total_nll = total_nll + (nll * target).sum()
        total_trained += float(target.sum())
    ref_loss = total_nll / total_trained
    ref_loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    # _train_step takes the loss in float32 (`.float()` on the logits): agreement to float32 rounding
    assert loss == pytest.approx(ref_loss.item(), rel=1e-6)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_shipped_walk_warm_start_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("OTBRL_CACHE", str(tmp_path))  # an empty cache: only the shipped one can answer
    start = time.perf_counter()
    model, tok, info = warm_start("walk", log=None)
    assert info["cached"] and info["reached"] and info["reward"] >= 0.3
    assert time.perf_counter() - start < 30 and not any(tmp_path.iterdir())  # loaded, nothing trained
    assert model.config.vocab_size == len(tok)
