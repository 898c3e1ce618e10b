"""Trainer callbacks of the `otbrl train` application: one metrics.jsonl line per logged step (with
cumulative generated tokens and train seconds, continued across a resume, held-out evaluations at token
budgets and the stop at a token budget) and a compact progress line.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from transformers import TrainerCallback

from otbrl.app.metrics import append_metrics, read_metrics, write_metrics


@dataclass
class TokenBudgets:
    """Held-out evaluations at budgets of generated tokens (each at the first logged step that reaches
    it) and the stop at `stop_at` tokens. `evaluate()` returns the held-out reward of the model now."""

    evaluate: Callable[[], float] | None = None
    eval_at: list[int] = field(default_factory=list)
    stop_at: int | None = None
    done: set[int] = field(default_factory=set)

    def due(self, generated: float) -> list[int]:
        return [b for b in sorted(self.eval_at) if b <= generated and b not in self.done]

    def resume(self, rows: list[dict[str, Any]]) -> None:
        self.done = {b for r in rows for b in r.get("heldout_budgets", [])}


class PromptLedger:
    """Wraps a reward function and remembers the prompts it scored since the last `digest()`: the digest
    logged per step lets a study check that every arm of a seed saw the same prompts at each step."""

    def __init__(self, reward: Callable[..., Any]) -> None:
        self.reward, self.seen = reward, set()
        self.__name__ = getattr(reward, "__name__", "reward")

    def __call__(self, prompts: list[Any], *args: Any, **kwargs: Any) -> Any:
        self.seen.update(str(p) for p in prompts)
        return self.reward(prompts, *args, **kwargs)

    def digest(self) -> str | None:
        if not self.seen:
            return None
        text = "\x00".join(sorted(self.seen))
        self.seen = set()
        return hashlib.sha1(text.encode()).hexdigest()[:12]


def metrics_callback(
    path: Path,
    tokens_per_step: int,
    budgets: TokenBudgets | None = None,
    ledger: PromptLedger | None = None,
) -> Any:
    """Also, per row: `clipped` (the pre-clip grad norm exceeded max_grad_norm), `prompts_sha` (the
    ledger's digest) and, at a budget, `heldout_reward` with the budgets it answers (`heldout_budgets`)."""
    budgets = budgets or TokenBudgets()

    class MetricsJsonl(TrainerCallback):
        """One JSON line per logged step, plus the cumulative counts of generated tokens and train
        seconds (both continued across a resume)."""

        generated = 0.0
        seconds = 0.0
        clock = 0.0

        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            # On resume keep the lines up to the checkpoint's step and continue its counts.
            self.clock = time.perf_counter()
            if path.is_file():
                kept = [r for r in read_metrics(path) if r.get("step", 0) <= state.global_step]
                write_metrics(path, kept)
                budgets.resume(kept)
                self.generated = kept[-1].get("generated_tokens", 0.0) if kept else 0.0
                self.seconds = kept[-1].get("train_seconds", 0.0) if kept else 0.0

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN201
            logs = dict(logs or {})
            now = time.perf_counter()
            self.seconds, self.clock = self.seconds + now - self.clock, now
            if "completions/mean_length" in logs:
                self.generated += logs["completions/mean_length"] * tokens_per_step
            if "loss" in logs or "reward" in logs:
                row = {
                    "step": state.global_step,
                    "generated_tokens": self.generated,
                    "train_seconds": round(self.seconds, 3),
                    **logs,
                }
                if "grad_norm" in logs and args.max_grad_norm:
                    row["clipped"] = bool(logs["grad_norm"] > args.max_grad_norm)
                if ledger is not None:
                    row["prompts_sha"] = ledger.digest()
                due = budgets.due(self.generated)
                if due and budgets.evaluate is not None:
                    model = kwargs.get("model")
                    row["heldout_reward"], row["heldout_budgets"] = budgets.evaluate(), due
                    budgets.done.update(due)
                    if model is not None:
                        model.train()
                    self.clock = time.perf_counter()  # evaluation is not train time
                append_metrics(path, row)
                if budgets.stop_at is not None and self.generated >= budgets.stop_at:
                    control.should_training_stop = True
            return control

    return MetricsJsonl()


def progress_callback(
    tokens_per_step: int, bar: bool, budget: int | None = None, metrics: Path | None = None
) -> Any:
    """A progress bar (or, with disable_tqdm, one line per log) that counts what the run stops at:
    generated tokens against `budget` when the run stops at a token budget (its ETA is then a true one),
    steps against max_steps otherwise. `metrics`: the run's metrics.jsonl, where a resumed run's tokens so
    far are read."""

    class CompactProgress(TrainerCallback):
        """Step, reward, grad norm and generated tokens/s, in place of transformers' per-step dict of
        every metric."""

        def __init__(self) -> None:
            self.bar: Any = None
            self.clock, self.step, self.generated = 0.0, 0, 0.0

        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            self.clock, self.step = time.perf_counter(), state.global_step
            if budget is not None and metrics is not None and metrics.is_file():
                kept = [r for r in read_metrics(metrics) if r.get("step", 0) <= state.global_step]
                self.generated = kept[-1].get("generated_tokens", 0.0) if kept else 0.0
            if bar and state.is_world_process_zero:
                if budget is not None:
                    self.bar = tqdm(
                        total=budget, initial=int(self.generated), desc="train", unit="tok", unit_scale=True
                    )
                else:
                    self.bar = tqdm(
                        total=state.max_steps, initial=state.global_step, desc="train", unit="step"
                    )

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN201
            if not state.is_world_process_zero or not logs or ("loss" not in logs and "reward" not in logs):
                return
            now = time.perf_counter()
            tokens = logs.get("completions/mean_length", 0.0) * tokens_per_step
            self.generated += tokens
            parts = [
                f"step {state.global_step}" if budget is not None else None,
                f"reward {logs['reward']:.3f}" if "reward" in logs else None,
                f"grad norm {logs['grad_norm']:.3g}" if "grad_norm" in logs else None,
                f"{tokens / max(now - self.clock, 1e-9):,.0f} tok/s",
            ]
            text = "  ".join(p for p in parts if p)
            if self.bar is not None:
                self.bar.update(round(tokens) if budget is not None else state.global_step - self.step)
                self.bar.set_postfix_str(text, refresh=True)
            elif budget is not None:
                print(f"{self.generated:,.0f}/{budget:,} tokens  {text}", flush=True)
            else:
                print(f"step {state.global_step}/{state.max_steps}  {text}", flush=True)
            self.clock, self.step = now, state.global_step

        def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    return CompactProgress()
