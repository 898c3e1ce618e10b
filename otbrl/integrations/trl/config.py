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

# Estimator options whose otbrl default gives another number than TRL's own computation: through the
# adapter an estimator takes TRL's value unless `estimator_options` sets it. grpo divides by the group std
# plus eps: TRL uses 1e-4, the core 1e-6 (rewards [1, 1, 1, 1 + 1e-5]: TRL 0.0715, the core's 1.25).
# dr_grpo and rloo have no such constant (TRL's scale_rewards="none" and RLOOTrainer compute the same).
TRL_DEFAULTS: dict[str, dict[str, Any]] = {"grpo": {"eps": 1e-4}}


def checkpointing_key() -> str:
    """The TrainingArguments field that switches activation (gradient) checkpointing. transformers 5.x
    calls it `activation_checkpointing` and warns whenever only the old name `gradient_checkpointing` is
    set, as TRL's configs set it by default: code that builds a config uses this name, so that a run does
    not warn about a setting its user never gave."""
    names = {f.name for f in fields(GRPOConfig)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


@dataclass
class OTBGRPOConfig(GRPOConfig):
    r"""
    TRL's `GRPOConfig` (every field of it documented there) plus otbrl's advantage estimator and stability
    settings. GRPOConfig options that shape TRL's own sequence-level advantages either raise (when they would
    change what is trained) or warn (when they merely do nothing under a (B, T) estimator): see
    `_check_trl_options`.

    Parameters:
        > Advantage estimator

        advantage_estimator (`str`, *optional*, defaults to `"otb"`):
            A registered otbrl estimator (`otbrl.ESTIMATORS`) that a trainer can feed from rollouts (not
            `otb_exact`, which needs a model of its own).
        estimator_options (`dict`, `str` or `None`, *optional*, defaults to `None`):
            The estimator's keyword options, e.g. `{"leave_one_out": true}`; a JSON string is accepted, as
            from a command line. Names and value types are checked by `otbrl.estimators.resolve`, the one
            place of these rules (recipes and verl use it too). `is_weights` is no option: with vLLM
            generation, TRL's importance-sampling ratios reach the estimator by themselves. Options left
            unset whose otbrl default would give another number than TRL take TRL's value
            (`TRL_DEFAULTS`: grpo's `eps` is 1e-4 here, TRL's, against the core's 1e-6).
        energy_from_logits (`bool`, *optional*, defaults to `False`):
            Per-token energy from the model's own logits (tiled over rows), for an output head otbrl does not
            recognise. Otherwise it comes from the sampler, TRL's old-log-prob pass, or hidden states and the
            output head.

        > Grad-norm surge detector (`otbrl.stability.SurgeDetector`)

        surge_factor (`float`, *optional*, defaults to `3.0`):
            A step whose grad norm exceeds this factor times the running median is a surge.
        surge_window (`int`, *optional*, defaults to `50`):
            Steps in the running median.

        > Length-surge LR decay (`otbrl.stability.LengthSurgeDecay`, whose docstring has the rule)

        length_decay (`bool`, *optional*, defaults to `False`):
            Decay the learning rate when the completion length surges. Counted in logging steps: the rule sees
            one mean length per log. The `length_decay_*` values are checked even when this is off.
        length_decay_factor (`float`, *optional*, defaults to `0.5`):
            Learning-rate multiplier per trigger.
        length_decay_threshold (`float`, *optional*, defaults to `1.25`):
            A step is high when the smoothed length exceeds this times the median of the window ...
        length_decay_zscore (`float`, *optional*, defaults to `3.0`):
            ... and the median plus this many times the series' step-to-step noise.
        length_decay_smoothing (`float`, *optional*, defaults to `0.2`):
            EMA weight of the newest length.
        length_decay_window (`int`, *optional*, defaults to `50`):
            Steps in the baseline (median and noise).
        length_decay_warmup (`int`, *optional*, defaults to `20`):
            Lengths seen before any trigger.
        length_decay_patience (`int`, *optional*, defaults to `3`):
            Consecutive high steps that fire a trigger.
        length_decay_cooldown (`int`, *optional*, defaults to `20`):
            Steps with no trigger after one.
        length_decay_min_factor (`float`, *optional*, defaults to `0.1`):
            Floor of the cumulative learning-rate multiplier.
        length_decay_on_grad_surge (`bool`, *optional*, defaults to `False`):
            A grad-norm surge fires a trigger too.

        > Resuming

        restore_callback_states_from_checkpoint (`bool`, *optional*, defaults to `True`):
            transformers' field, with otbrl's default: restore stateful callbacks (the surge detector) on
            resume, so that a resumed run continues where it stopped (transformers leaves them at their
            initial state unless asked).
    """

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
    # Length-surge LR decay: otbrl.stability.LengthSurgeDecay's arguments under length_decay_<argument>.
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
