"""`OTBGRPOConfig`: TRL's GRPOConfig plus the advantage estimator, its options, and the stability settings
(grad-norm surge detector, length-surge LR decay)."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

from trl import GRPOConfig

import otbrl
from otbrl.estimators import resolve
from otbrl.stability import LengthSurgeDecay


@dataclass
class OTBGRPOConfig(GRPOConfig):
    """GRPOConfig plus the advantage estimator. `estimator_options` holds the estimator's keywords
    (e.g. {"leave_one_out": true}); a JSON string is accepted, as from a command line."""

    advantage_estimator: str = field(
        default="otb", metadata={"help": "an otbrl estimator: " + ", ".join(sorted(otbrl.ESTIMATORS))}
    )
    estimator_options: dict | str | None = field(
        default=None, metadata={"help": 'options of the estimator, e.g. {"leave_one_out": true}'}
    )
    energy_from_logits: bool = field(
        default=False,
        metadata={
            "help": "energy from the model's own logits (tiled over rows), for an output head otbrl does "
            "not recognise; otherwise from the sampler, TRL's old-log-prob pass, or hidden states"
        },
    )
    surge_factor: float = field(
        default=3.0, metadata={"help": "grad-norm surge: factor over the running median"}
    )
    surge_window: int = field(default=50, metadata={"help": "grad-norm surge: steps in the running median"})
    # Length-surge LR decay: otbrl.stability.LengthSurgeDecay (its docstring has the rule) under
    # length_decay_<its argument>. Counted in logging steps: it sees one mean length per log.
    length_decay: bool = field(default=False, metadata={"help": "decay the LR when completion length surges"})
    length_decay_factor: float = field(default=0.5, metadata={"help": "LR multiplier per trigger"})
    length_decay_threshold: float = field(default=1.25, metadata={"help": "high: smoothed length/median >"})
    length_decay_zscore: float = field(default=3.0, metadata={"help": "high: and (length-median)/noise >"})
    length_decay_smoothing: float = field(default=0.2, metadata={"help": "EMA weight of the newest length"})
    length_decay_window: int = field(default=50, metadata={"help": "steps in the baseline (median, noise)"})
    length_decay_warmup: int = field(default=20, metadata={"help": "lengths seen before any trigger"})
    length_decay_patience: int = field(default=3, metadata={"help": "consecutive high steps that fire"})
    length_decay_cooldown: int = field(default=20, metadata={"help": "steps with no trigger after one"})
    length_decay_min_factor: float = field(default=0.1, metadata={"help": "floor of the LR multiplier"})
    length_decay_on_grad_surge: bool = field(default=False, metadata={"help": "a grad-norm surge fires too"})
    # transformers leaves stateful callbacks (here the surge detector) at their initial state on resume
    # unless asked; a resumed run should continue where it stopped.
    restore_callback_states_from_checkpoint: bool = field(
        default=True, metadata={"help": "restore stateful callbacks (the surge detector) on resume"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.estimator_options, str):
            try:
                self.estimator_options = json.loads(self.estimator_options)
            except json.JSONDecodeError as err:
                raise ValueError(f"estimator_options: not valid JSON ({err})") from None
        self.estimator_options = dict(self.estimator_options or {})
        try:
            resolve(self.advantage_estimator, self.estimator_options, from_rollouts=True)
        except ValueError as err:
            text = str(err)
            if text.startswith("estimator: "):
                raise ValueError("advantage_estimator: " + text.removeprefix("estimator: ")) from None
            raise ValueError(f"estimator_options: {text}") from None
        if "is_weights" in self.estimator_options:
            raise ValueError(
                "estimator_options: is_weights are per-token data of each batch, not an option: with vLLM "
                "generation, TRL's importance-sampling ratios reach the estimator by themselves"
            )
        self._check_trl_options()
        try:  # checked even when off, so that a bad value does not wait for the day it is switched on
            LengthSurgeDecay(**self.length_decay_options())
        except ValueError as err:
            raise ValueError(f"length_decay_{err}") from None  # LengthSurgeDecay names the argument first

    def _check_trl_options(self) -> None:
        """GRPOConfig options that shape TRL's own sequence-level advantages, which a (B, T) estimator
        replaces: one that would change what is trained raises, one that merely does nothing warns."""
        if self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                f"multi_objective_aggregation: {self.multi_objective_aggregation!r} normalises each reward "
                "function within its group before summing, which OTBGRPOTrainer does not do (the estimator "
                "receives the reward_weights-weighted sum of raw rewards); normalise inside a reward "
                "function instead, or leave the default 'sum_then_normalize'"
            )
        if self.scale_rewards != "group":  # the default is not a choice; anything else is
            warnings.warn(
                f"scale_rewards={self.scale_rewards!r} has no effect in OTBGRPOTrainer: the advantage "
                f"estimator ({self.advantage_estimator!r}) decides any scaling (grpo divides by the group "
                "std; otb, dr_grpo, rloo do not)",
                UserWarning,
                stacklevel=3,
            )

    def length_decay_options(self) -> dict[str, Any]:
        """The length_decay_* fields as LengthSurgeDecay's keyword arguments."""
        prefix = "length_decay_"
        return {
            f.name[len(prefix) :]: getattr(self, f.name) for f in fields(self) if f.name.startswith(prefix)
        }
