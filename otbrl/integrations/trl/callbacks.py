"""Trainer callbacks that keep otbrl's stability state in checkpoints: the grad-norm surge detector and
the length-surge LR decay."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from otbrl.stability import LengthSurgeDecay, SurgeDetector


class SurgeCallback(TrainerCallback, ExportableState):
    """Holds the grad-norm surge detector so its history is saved in checkpoints and restored on resume
    (OTBGRPOConfig sets restore_callback_states_from_checkpoint=True for that)."""

    def __init__(self, factor: float = 3.0, window: int = 50, warmup: int = 10) -> None:
        self.detector = SurgeDetector(factor=factor, window=window, warmup=warmup)

    @property
    def detector_state(self) -> dict:
        return self.detector.state_dict()

    @detector_state.setter
    def detector_state(self, value: dict) -> None:
        self.detector.load_state_dict(value)

    def state(self) -> dict:
        d = self.detector
        return {
            "args": {"factor": d.factor, "window": d.window, "warmup": d.warmup},
            "attributes": {"detector_state": d.state_dict()},
        }


class LengthDecayCallback(TrainerCallback, ExportableState):
    """Length-surge LR decay (otbrl.stability.LengthSurgeDecay) for transformers' Trainer; saved in
    checkpoints and restored on resume. OTBGRPOTrainer adds it when `length_decay` is on and logs
    otb/lr_decay_factor (the LR multiplier) and otb/lr_decay_trigger (1 on a step that fired).

    With TRL's plain GRPOTrainer pass it in `callbacks=[LengthDecayCallback(...)]` (and set
    restore_callback_states_from_checkpoint=True): it reads completions/mean_length in `on_log`, after
    the Trainer has recorded the logs, so its entries reach later callbacks but not state.log_history.
    OTBGRPOTrainer creates it with `driven=True` and feeds it from its own `log()` instead, before the logs
    are recorded; `on_log` then does nothing, so each step is observed along one path only.
    The decay itself lives in the optimizer's and scheduler's state (otbrl.stability.scale_learning_rate),
    so a resumed run keeps its decayed LR even without this callback."""

    def __init__(self, driven: bool = False, **options: Any) -> None:
        self.decay = LengthSurgeDecay(**options)
        self.driven = driven  # a trainer calls `observe` itself (OTBGRPOTrainer.log)
        self.last_step = -1  # the global step last observed: one observation per step

    @property
    def decay_state(self) -> dict:
        return {**self.decay.state_dict(), "last_step": self.last_step}

    @decay_state.setter
    def decay_state(self, value: dict) -> None:
        value = dict(value)
        self.last_step = int(value.pop("last_step"))
        self.decay.load_state_dict(value)

    def state(self) -> dict:
        args = {**self.decay.config, "driven": self.driven}  # a resume rebuilds the callback from these
        return {"args": args, "attributes": {"decay_state": self.decay_state}}

    def observe(
        self, step: int, mean_length: float | None, grad_surge: bool, optimizer: Any, lr_scheduler: Any
    ) -> dict[str, float]:
        """Feed one step's mean length; apply any decay to the optimizer and scheduler; return log entries."""
        if step == self.last_step:
            return {}
        self.last_step = step
        self.decay.update(mean_length, optimizer, lr_scheduler, grad_surge=grad_surge)
        return {
            "otb/lr_decay_factor": self.decay.multiplier,
            "otb/lr_decay_trigger": float(bool(self.decay.fired)),
        }

    def on_log(self, args, state, control, logs=None, optimizer=None, lr_scheduler=None, **kwargs):  # noqa: ANN001, ANN201
        ready = logs is not None and "completions/mean_length" in logs and optimizer is not None
        if ready and not self.driven:
            logs.update(
                self.observe(
                    state.global_step,
                    logs["completions/mean_length"],
                    bool(logs.get("otb/grad_norm_surge")),
                    optimizer,
                    lr_scheduler,
                )
            )
