"""Dataset rewards, loading a local model directory, and the TRL version guard."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from otbrl.app.rewards import get_reward, last_number


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
    from otbrl.app.train import load_model
    from otbrl.tasks import char_tokenizer, tiny_model

    model, tokenizer = tiny_model("tiny", seed=3), char_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, tok = load_model({"model": str(tmp_path)}, log=lambda *_: None)
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert tok.decode(tok("12+3=")["input_ids"]) == "12+3="
    # A name that is neither a directory nor a Hub id (a Hub id is fetched: tests/test_hub.py)
    with pytest.raises(ValueError, match=r"model: './nowhere' is not warm:<preset>, random:<preset>, a loc"):
        load_model({"model": "./nowhere"}, log=lambda *_: None)


def test_untested_trl_version_is_refused(monkeypatch):
    import trl

    monkeypatch.setattr(trl, "__version__", "1.99.0")
    monkeypatch.delitem(sys.modules, "otbrl.integrations.trl", raising=False)
    with pytest.raises(ImportError, match=r"tested with trl>=1.16,<1.17 .* found trl 1.99.0"):
        importlib.import_module("otbrl.integrations.trl")
    monkeypatch.undo()
    importlib.import_module("otbrl.integrations.trl")
