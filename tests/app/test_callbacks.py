"""The `otbrl train` callbacks: held-out evaluations at token budgets, the stop at a token budget, the
clip flag and the per-step prompt digest, driven through the callback as the Trainer would drive it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from transformers import TrainerControl  # noqa: E402

from otbrl.app.callbacks import PromptLedger, TokenBudgets, metrics_callback  # noqa: E402
from otbrl.app.metrics import read_metrics  # noqa: E402


class FakeModel:
    def __init__(self) -> None:
        self.training = False

    def train(self) -> None:
        self.training = True


def _drive(path, budgets, ledger=None, steps=6, length=25.0, start=0):  # noqa: ANN001, ANN202
    """Log `steps` steps of 4 samples x `length` tokens (100 tokens a step) through the callback."""
    cb = metrics_callback(path, tokens_per_step=4, budgets=budgets, ledger=ledger)
    args = SimpleNamespace(max_grad_norm=1.0)
    state = SimpleNamespace(global_step=start)
    control = TrainerControl()
    cb.on_train_begin(args, state, control)
    model = FakeModel()
    stopped_at = None
    for step in range(start + 1, start + steps + 1):
        state.global_step = step
        if ledger is not None:
            ledger(prompts=[f"p{step}", f"p{step}"], completions=["a", "b"])
        logs = {"loss": 0.1, "reward": 0.5, "completions/mean_length": length, "grad_norm": 0.5 * step}
        control = cb.on_log(args, state, control, logs=logs, model=model)
        if control.should_training_stop:
            stopped_at = step
            break
    return stopped_at, model


def test_held_out_at_each_budget_once_and_the_stop(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    calls = []
    evaluate = lambda: calls.append(1) or 0.25 * len(calls)  # noqa: E731
    budgets = TokenBudgets(evaluate, eval_at=[150, 300, 301], stop_at=400)
    stopped_at, model = _drive(path, budgets)
    assert stopped_at == 4  # 400 tokens after step 4
    rows = read_metrics(path)
    evaluated = [
        (r["step"], r["heldout_reward"], r["heldout_budgets"]) for r in rows if "heldout_budgets" in r
    ]
    assert evaluated == [(2, 0.25, [150]), (3, 0.5, [300]), (4, 0.75, [301])]  # 301 first reached at 400
    assert model.training  # back to training mode after an evaluation
    assert [r["clipped"] for r in rows] == [False, False, True, True]  # grad norm 0.5 x step > 1.0


def test_a_resumed_run_does_not_evaluate_a_budget_twice(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    calls = []
    _drive(path, TokenBudgets(lambda: calls.append(1) or 0.5, eval_at=[150, 500]), steps=3)
    assert len(calls) == 1
    resumed = TokenBudgets(lambda: calls.append(1) or 0.5, eval_at=[150, 500])
    _drive(path, resumed, steps=3, start=3)  # resumed from a checkpoint at step 3: 300 tokens so far
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert len(calls) == 2
    assert [r["heldout_budgets"] for r in rows if "heldout_budgets" in r] == [[150], [500]]


def test_the_prompt_digest_names_the_prompts_not_their_order(tmp_path) -> None:
    seen = []
    ledger = PromptLedger(lambda prompts, completions, **kw: seen.append(prompts) or [1.0] * len(prompts))
    assert ledger(prompts=["b", "a"], completions=["x", "y"]) == [1.0, 1.0] and seen == [["b", "a"]]
    first = ledger.digest()
    ledger(prompts=["a", "b", "a"], completions=["x", "y", "z"])
    assert ledger.digest() == first and ledger.digest() is None  # read once per step
    ledger(prompts=["a", "c"], completions=["x", "y"])
    assert ledger.digest() != first
    path = tmp_path / "metrics.jsonl"
    _drive(path, TokenBudgets(), ledger=PromptLedger(lambda prompts, completions, **kw: [0.0]), steps=2)
    digests = [r["prompts_sha"] for r in read_metrics(path)]
    assert len(set(digests)) == 2 and all(len(d) == 12 for d in digests)


def test_a_token_budget_run_counts_its_progress_in_tokens(tmp_path, capsys) -> None:
    """The bar counts what the run stops at: generated tokens against the budget (so its ETA is true),
    continuing a resumed run's count; without a budget it counts steps against max_steps."""
    from otbrl.app.callbacks import progress_callback
    from otbrl.app.metrics import write_metrics

    metrics = tmp_path / "metrics.jsonl"
    write_metrics(metrics, [{"step": 1, "generated_tokens": 100.0}, {"step": 2, "generated_tokens": 200.0}])
    cb = progress_callback(tokens_per_step=4, bar=True, budget=1000, metrics=metrics)
    args, control = SimpleNamespace(), TrainerControl()
    state = SimpleNamespace(global_step=2, max_steps=5000, is_world_process_zero=True)
    cb.on_train_begin(args, state, control)  # resumed at step 2: 200 tokens done
    assert (cb.bar.total, cb.bar.n, cb.bar.unit) == (1000, 200, "tok")
    for step in (3, 4):
        state.global_step = step
        cb.on_log(args, state, control, logs={"reward": 0.5, "completions/mean_length": 25.0})
    assert cb.bar.n == 400 and cb.generated == 400.0
    cb.on_train_end(args, state, control)
    lines = progress_callback(tokens_per_step=4, bar=False, budget=1000)
    state.global_step = 1
    lines.on_train_begin(args, state, control)
    lines.on_log(args, state, control, logs={"reward": 0.5, "completions/mean_length": 25.0})
    assert capsys.readouterr().out.startswith("100/1,000 tokens  step 1  reward 0.500")
    steps = progress_callback(tokens_per_step=4, bar=True)
    state.global_step = 0
    steps.on_train_begin(args, state, control)
    assert (steps.bar.total, steps.bar.unit) == (5000, "step")
    steps.on_train_end(args, state, control)
