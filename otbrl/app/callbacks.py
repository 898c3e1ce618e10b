"""Trainer callbacks of the `otbrl train` application: one metrics.jsonl line per logged step (with
cumulative generated tokens and train seconds, continued across a resume) and a compact progress line.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from otbrl.app.studies.runs import append_metrics, read_metrics, write_metrics


def metrics_callback(path: Path, tokens_per_step: int) -> Any:
    from transformers import TrainerCallback

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
                self.generated = kept[-1].get("generated_tokens", 0.0) if kept else 0.0
                self.seconds = kept[-1].get("train_seconds", 0.0) if kept else 0.0

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN201
            logs = dict(logs or {})
            now = time.perf_counter()
            self.seconds, self.clock = self.seconds + now - self.clock, now
            if "completions/mean_length" in logs:
                self.generated += logs["completions/mean_length"] * tokens_per_step
            if "loss" in logs or "reward" in logs:
                row = {"step": state.global_step, "generated_tokens": self.generated,
                       "train_seconds": round(self.seconds, 3), **logs}  # fmt: skip
                append_metrics(path, row)

    return MetricsJsonl()


def progress_callback(tokens_per_step: int, bar: bool) -> Any:
    from transformers import TrainerCallback

    class CompactProgress(TrainerCallback):
        """A progress bar (or, with disable_tqdm, one line per log) showing step, reward, grad norm and
        generated tokens/s, in place of transformers' per-step dict of every metric."""

        def __init__(self) -> None:
            self.bar: Any = None
            self.clock, self.step = 0.0, 0

        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            self.clock, self.step = time.perf_counter(), state.global_step
            if bar and state.is_world_process_zero:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train", unit="step")

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN201
            if not state.is_world_process_zero or not logs or ("loss" not in logs and "reward" not in logs):
                return
            now = time.perf_counter()
            tokens = logs.get("completions/mean_length", 0.0) * tokens_per_step
            parts = [f"reward {logs['reward']:.3f}" if "reward" in logs else None,
                     f"grad norm {logs['grad_norm']:.3g}" if "grad_norm" in logs else None,
                     f"{tokens / max(now - self.clock, 1e-9):,.0f} tok/s"]  # fmt: skip
            text = "  ".join(p for p in parts if p)
            if self.bar is not None:
                self.bar.update(state.global_step - self.step)
                self.bar.set_postfix_str(text, refresh=True)
            else:
                print(f"step {state.global_step}/{state.max_steps}  {text}", flush=True)
            self.clock, self.step = now, state.global_step

        def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    return CompactProgress()
