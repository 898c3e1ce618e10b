"""Dataset rewards, loading a local model directory, and the TRL version guard."""

from __future__ import annotations

import importlib
import math
import sys

import pytest
import torch

from otbrl.app.answers import get_reward, last_number


def test_exact_numeric_and_math_rewards():
    exact, numeric, math_reward = get_reward("exact"), get_reward("numeric"), get_reward("math")
    kw = dict(prompts=["q"] * 4)
    assert exact(completions=[" 42 ", "42.0", "x", ""], answer=["42"] * 4, **kw) == [1.0, 0.0, 0.0, 0.0]
    got = numeric(
        completions=["so 41 then 42", "42.0", "1,234", "none"], answer=["42", "42", "1234", "1"], **kw
    )
    assert got == [1.0, 1.0, 1.0, 0.0]
    assert math_reward(
        completions=["$\\frac{1}{2}$", "0.5", "1/3"], answer=["0.5", "\\frac{1}{2}", "0.5"], prompts=["q"] * 3
    ) == [1.0, 1.0, 0.0]
    assert last_number("a -3.5e2 b") == -350.0 and last_number("no digits") is None
    with pytest.raises(ValueError, match="reward: unknown reward 'fuzzy'; known: exact, math, numeric"):
        get_reward("fuzzy")


def test_local_model_directory_loads(tmp_path):
    from otbrl.app.sources import load_model
    from otbrl.tasks import char_tokenizer, tiny_model

    model, tokenizer = tiny_model("tiny", seed=3), char_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, tok = load_model({"model": str(tmp_path)}, log=lambda *_: None)
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert tok.decode(tok("12+3=")["input_ids"]) == "12+3="
    # A name that is neither a directory nor a Hub id (a Hub id is fetched: tests/app/test_sources_hub.py)
    with pytest.raises(ValueError, match=r"model: './nowhere' is not warm:<preset>, random:<preset>, a loc"):
        load_model({"model": "./nowhere"}, log=lambda *_: None)


def test_newer_trl_warns_and_older_trl_is_refused(monkeypatch):
    """A TRL newer than the tested range imports with one warning naming the range; an older one, which
    lacks what the adapter uses, is refused."""
    import trl

    monkeypatch.setattr(trl, "__version__", "1.18.2")
    monkeypatch.delitem(sys.modules, "otbrl.integrations.trl", raising=False)
    with pytest.warns(UserWarning, match=r"tested with trl>=1.16,<1.17 .* found trl 1.18.2, not tested"):
        module = importlib.import_module("otbrl.integrations.trl")
    assert module.OTBGRPOTrainer is not None
    monkeypatch.setattr(trl, "__version__", "1.15.0")
    monkeypatch.delitem(sys.modules, "otbrl.integrations.trl", raising=False)
    with pytest.raises(ImportError, match=r"needs trl>=1\.16,<2 .* found trl 1\.15\.0"):
        importlib.import_module("otbrl.integrations.trl")
    monkeypatch.undo()
    monkeypatch.delitem(sys.modules, "otbrl.integrations.trl", raising=False)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        importlib.import_module("otbrl.integrations.trl")  # the tested version says nothing


def test_rewards_read_chat_completions_boxed_answers_and_gsm8k_solutions():
    from otbrl.app.answers import answer_number, completion_text, final_answer, last_boxed

    said = ["so it is \\boxed{12} (not 13)", "I think 7", "no idea"]
    chat = [[{"role": "assistant", "content": c}] for c in said]
    kw = dict(prompts=[[{"role": "user", "content": "q"}]] * 3, answer=["3+9 is 12.\n#### 12", "7", "1"])
    assert get_reward("numeric")(completions=chat, **kw) == [1.0, 1.0, 0.0]
    assert get_reward("math")(completions=chat, **kw) == [1.0, 1.0, 0.0]
    assert get_reward("exact")(
        completions=[[{"role": "assistant", "content": " 12"}]], prompts=["q"], answer=["#### 12"]
    ) == [1.0]
    assert completion_text({"role": "assistant", "content": "x"}) == "x" and completion_text([]) == ""
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{3}") == "3" and last_boxed("\\boxed{1") is None
    assert last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}" and last_boxed("none") is None
    assert answer_number("steps 4, 5 then \\boxed{1,234}") == 1234.0 and answer_number("x 2 y 3") == 3.0
    assert final_answer("work\n#### 72 ") == "72" and final_answer(" 5 ") == "5"


def test_guarded_reward_stops_on_a_signature_that_cannot_take_trls_keywords():
    from otbrl.integrations.trl.rewards import GuardedReward, RewardFailure

    calls = []

    def reward(prompts, completions):
        calls.append(1)
        return [1.0] * len(prompts)

    guarded = GuardedReward(reward)
    with pytest.raises(
        RewardFailure,
        match=r"reward\(prompts, completions\) cannot take the keyword .*answer"
        r".*unexpected keyword argument.*\*\*kwargs",
    ):
        guarded(prompts=["a", "b"], completions=["1", "2"], answer=["1", "2"])
    assert calls == []  # not called once per sample just to fail each time


def test_guarded_reward_logs_the_first_failure_and_retries_each_sample_once(caplog):
    from otbrl.integrations.trl.rewards import GuardedReward

    seen: list[int] = []

    def reward(prompts, completions, **kwargs):
        seen.append(len(prompts))
        if "bad" in completions:
            raise KeyError("no answer in " + completions[completions.index("bad")])
        return [float(len(c)) for c in completions]

    guarded = GuardedReward(reward)
    assert GuardedReward(guarded) is guarded  # the trainer's own wrapping keeps these settings and counts
    with caplog.at_level("WARNING", logger="otbrl.rewards"):
        got = guarded(prompts=["p"] * 4, completions=["ab", "bad", "abc", "a"], answer=["x"] * 4)
        assert got == [2.0, None, 3.0, 1.0]  # a failed sample is left unscored, never given 0
        assert guarded.last_failed == [1]
        assert seen == [4, 1, 1, 1, 1]  # the batch, then each sample once
        assert guarded.failures == 1 and guarded.scored == 4
        got = guarded(prompts=["p"] * 4, completions=["bad", "ab", "ab", "ab"], answer=["x"] * 4)
        assert got == [None, 2.0, 2.0, 2.0] and guarded.last_failed == [0]
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1, logged  # the first failure only; later ones are counted
    assert "KeyError: 'no answer in bad'" in logged[0] and "completion 'bad'" in logged[0]
    assert guarded.failures == 2 and guarded.scored == 8


def test_guarded_reward_stops_the_run_when_a_whole_batch_or_too_many_samples_fail():
    from otbrl.integrations.trl.rewards import GuardedReward, RewardFailure

    def always(prompts, completions, **kwargs):
        raise ValueError("math_verify exploded")

    with pytest.raises(
        RewardFailure,
        match=r"always failed on every sample of a batch \(3\): ValueError: "
        r"math_verify exploded; sample: prompt 'p'",
    ):
        GuardedReward(always)(prompts=["p"] * 3, completions=["1", "2", "3"])

    def nan_half(prompts, completions, **kwargs):
        return [math.nan if c == "x" else 1.0 for c in completions]

    guarded = GuardedReward(nan_half, max_failure_fraction=0.3)
    assert guarded(prompts=["p"] * 4, completions=["x", "y", "y", "y"]) == [None, 1.0, 1.0, 1.0]
    with pytest.raises(
        RewardFailure,
        match=r"failed on 3 of 8 samples \(more than max_failure_fraction 0.3\)"
        r"; first failure: returned nan",
    ):
        guarded(prompts=["p"] * 4, completions=["x", "x", "y", "y"])
    with pytest.raises(ValueError, match="max_failure_fraction: must be in"):
        GuardedReward(nan_half, max_failure_fraction=0)
    none = GuardedReward(lambda prompts, completions, **kw: [None] * len(prompts))
    assert none(prompts=["p"], completions=["c"]) == [None] and none.failures == 0
    assert none.last_failed == []  # not applicable is no failure
