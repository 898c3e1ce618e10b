"""OTB inside TRL's GRPOTrainer: swap `GRPOConfig, GRPOTrainer` for `OTBGRPOConfig, OTBGRPOTrainer`.

After TRL generates and scores a batch, the trainer computes each completion token's energy in a no-grad
pass (final hidden states through `otbrl.fused_token_stats`, never the full logits), gathers what the
estimator needs from every process (a prompt's group may span ranks), and hands TRL's loss (B, T)
advantages from `otbrl.compute_advantages`. Every registered estimator runs through the same path, so
GRPO, RLOO, OPO and OTB runs differ only in `advantage_estimator`.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch

import otbrl
from otbrl.diagnostics import SurgeDetector, batch_diagnostics
from otbrl.schedules import LengthSurgeDecay

TESTED_TRL = ("1.16", "1.17")  # [low, high): the range this adapter was tested with


def _check_trl_version() -> None:
    import trl
    from packaging.version import Version

    low, high = TESTED_TRL
    if not Version(low) <= Version(trl.__version__) < Version(high):
        raise ImportError(
            f"otbrl.integrations.trl was tested with trl>={low},<{high} and relies on its GRPOTrainer "
            f"internals; found trl {trl.__version__}. Install a tested version: pip install 'otbrl[trl]'"
        )


_check_trl_version()

from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_callback import ExportableState  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402


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
    surge_factor: float = field(
        default=3.0, metadata={"help": "grad-norm surge: factor over the running median"}
    )
    surge_window: int = field(default=50, metadata={"help": "grad-norm surge: steps in the running median"})
    # Length-surge LR decay: otbrl.schedules.LengthSurgeDecay (its docstring has the rule) under
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
        spec = otbrl.ESTIMATORS.get(self.advantage_estimator)
        if spec is None or self.advantage_estimator == "otb_exact":
            known = ", ".join(sorted(set(otbrl.ESTIMATORS) - {"otb_exact"}))
            raise ValueError(
                f"advantage_estimator: unknown or unsupported {self.advantage_estimator!r}; known: {known}"
            )
        unknown = sorted(set(self.estimator_options) - set(spec.options))
        if unknown:
            raise ValueError(
                f"estimator_options: {unknown[0]!r} is not an option of {self.advantage_estimator!r} "
                f"(its options: {', '.join(spec.options) or 'none'})"
            )
        try:  # checked even when off, so that a bad value does not wait for the day it is switched on
            LengthSurgeDecay(**self.length_decay_options())
        except ValueError as err:
            raise ValueError(f"length_decay_{err}") from None  # LengthSurgeDecay names the argument first

    def length_decay_options(self) -> dict[str, Any]:
        """The length_decay_* fields as LengthSurgeDecay's keyword arguments."""
        prefix = "length_decay_"
        return {
            f.name[len(prefix) :]: getattr(self, f.name) for f in fields(self) if f.name.startswith(prefix)
        }


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
        return {"args": {"factor": d.factor, "window": d.window, "warmup": d.warmup},
                "attributes": {"detector_state": d.state_dict()}}  # fmt: skip


class LengthDecayCallback(TrainerCallback, ExportableState):
    """Length-surge LR decay (otbrl.schedules.LengthSurgeDecay) for transformers' Trainer; saved in
    checkpoints and restored on resume. OTBGRPOTrainer adds it when `length_decay` is on and logs
    otb/lr_decay_factor (the LR multiplier) and otb/lr_decay_trigger (1 on a step that fired).

    With TRL's plain GRPOTrainer pass it in `callbacks=[LengthDecayCallback(...)]` (and set
    restore_callback_states_from_checkpoint=True): it reads completions/mean_length in `on_log`, after
    the Trainer has recorded the logs, so its entries reach later callbacks but not state.log_history.
    The decay itself lives in the optimizer's and scheduler's state (otbrl.schedules.scale_learning_rate),
    so a resumed run keeps its decayed LR even without this callback."""

    def __init__(self, **options: Any) -> None:
        self.decay = LengthSurgeDecay(**options)
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
        return {"args": dict(self.decay.config), "attributes": {"decay_state": self.decay_state}}

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
        if logs is not None and "completions/mean_length" in logs and optimizer is not None:
            logs.update(self.observe(
                state.global_step, logs["completions/mean_length"], bool(logs.get("otb/grad_norm_surge")),
                optimizer, lr_scheduler,
            ))  # fmt: skip


class _GuardedReward:
    """A reward function whose failures cost one sample, not the run: an exception or a NaN/inf value
    gives that sample reward 0 and is counted (`failures`). None passes through (TRL: not applicable)."""

    def __init__(self, fn: Any) -> None:
        functools.update_wrapper(self, fn)
        self.fn, self.failures = fn, 0

    def _value(self, v: Any) -> float | None:
        if v is None:
            return None
        try:
            v = float(v)
        except (TypeError, ValueError):
            v = math.nan
        if math.isfinite(v):
            return v
        self.failures += 1
        return 0.0

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float | None]:
        try:
            values = list(self.fn(prompts=prompts, completions=completions, **kwargs))
            if len(values) != len(prompts):
                raise ValueError(f"reward function returned {len(values)} values for {len(prompts)} samples")
        except Exception:  # noqa: BLE001  -- find the failing samples one by one
            values = [self._one(i, prompts, completions, kwargs) for i in range(len(prompts))]
        return [self._value(v) for v in values]

    def _one(self, i: int, prompts: list, completions: list, kwargs: dict) -> Any:
        n = len(prompts)
        single = {k: (v[i : i + 1] if isinstance(v, list) and len(v) == n else v) for k, v in kwargs.items()}
        try:
            return list(self.fn(prompts=prompts[i : i + 1], completions=completions[i : i + 1], **single))[0]
        except Exception:  # noqa: BLE001
            return math.nan


class OTBGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose loss receives (B, T) advantages from any otbrl estimator."""

    def __init__(self, *args: Any, reward_funcs: Any = None, **kwargs: Any) -> None:
        funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        self._guarded = [
            _GuardedReward(f) if callable(f) and not isinstance(f, torch.nn.Module) else f for f in funcs
        ]
        super().__init__(*args, reward_funcs=self._guarded, **kwargs)
        if not isinstance(self.args, OTBGRPOConfig):
            raise ValueError("args: OTBGRPOTrainer needs an OTBGRPOConfig")
        self.add_callback(SurgeCallback(self.args.surge_factor, self.args.surge_window))
        if self.args.length_decay:
            self.add_callback(LengthDecayCallback(**self.args.length_decay_options()))
        self._rewards_per_func: torch.Tensor | None = None
        self._failures_seen, self._failures_total = 0, 0.0
        self.last_advantages: torch.Tensor | None = None  # (B_local, T_local) of the latest batch
        self.last_energy: torch.Tensor | None = None  # (B_local, T_local) w_t of the latest batch

    # TRL computes and gathers per-function rewards but does not return them from the scoring step.
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):  # noqa: ANN001, ANN202
        self._rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._rewards_per_func

    @torch.no_grad()
    def token_energy(self, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:  # noqa: ANN001
        """(B, T) energy of each completion token at the sampling temperature, from the decoder's final
        hidden states and the output head (otbrl.fused_token_stats: no (tokens x vocab) logits)."""
        model = self.accelerator.unwrap_model(self.model)
        if hasattr(model, "get_base_model"):  # PEFT
            model = model.get_base_model()
        decoder = getattr(model, model.base_model_prefix)
        head = model.get_output_embeddings()
        ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention = torch.cat([prompt_mask, completion_mask], dim=1)
        start, width = prompt_ids.shape[1] - 1, completion_ids.shape[1]  # position t predicts token t + 1
        rows = self.args.per_device_train_batch_size
        out = []
        for r in range(0, ids.shape[0], rows):
            with self.accelerator.autocast():
                hidden = decoder(
                    input_ids=ids[r : r + rows], attention_mask=attention[r : r + rows]
                ).last_hidden_state
            stats = otbrl.fused_token_stats(
                hidden[:, start : start + width], head.weight, completion_ids[r : r + rows],
                temperature=self.temperature, bias=getattr(head, "bias", None),
            )  # fmt: skip
            out.append(stats.energy)
        return torch.cat(out) * completion_mask

    def _gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(B_local, T_local) on every rank -> (B_global, T_max), rows in rank order, padded with 0."""
        return self.accelerator.gather(self.accelerator.pad_across_processes(x, dim=1, pad_index=0))

    def _generate_and_score_completions(self, inputs):  # noqa: ANN001, ANN202
        out = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
        rows, length = mask.shape
        spec = otbrl.ESTIMATORS[self.args.advantage_estimator]
        options = dict(self.args.estimator_options)
        if "tool_mask" in out and "align" in spec.options:
            options.setdefault("align", "generated")  # tool output shifts positions between trajectories
        energy = (
            self.token_energy(out["prompt_ids"], out["prompt_mask"], out["completion_ids"], mask)
            if spec.needs_energy
            else torch.zeros(mask.shape, device=mask.device)
        )
        all_mask = self._gather_rows(mask.int()).bool()
        all_energy = self._gather_rows(energy.float())
        per_func = self._rewards_per_func  # (B_global, functions), gathered by TRL
        rewards = (per_func * self.reward_weights.to(per_func.device)[None, :]).nansum(dim=1)
        unscored = torch.isnan(per_func).all(dim=1)  # every function said "not applicable": no signal
        all_mask &= ~unscored[:, None]
        group_ids = torch.arange(rewards.numel(), device=rewards.device) // group_size  # RepeatSampler layout
        res = otbrl.compute_advantages(
            self.args.advantage_estimator, rewards=rewards.masked_fill(unscored, 0.0), mask=all_mask,
            group_ids=group_ids, energy=all_energy if spec.needs_energy else None, **options,
        )  # fmt: skip
        rank = self.accelerator.process_index
        local = res.advantages[rank * rows : (rank + 1) * rows, :length].to(mask.device)
        out["advantages"] = local  # TRL's loss keeps 2-D advantages as they are
        self.last_advantages, self.last_energy = local, energy

        metrics = self._metrics[mode]
        diag = batch_diagnostics(res.advantages, all_energy, all_mask)
        for key, value in diag.items():
            if spec.needs_energy or key.startswith("adv/"):  # no energy was computed: it would read 0
                metrics[f"otb/{key}"].append(value)
        # Reward functions ran on each rank's own completions: add this batch's failures on all ranks to
        # the run's total (logged as a running count).
        failures = sum(getattr(f, "failures", 0) for f in self._guarded)
        new = torch.tensor([failures - self._failures_seen], dtype=torch.float32, device=mask.device)
        self._failures_seen = failures
        self._failures_total += self.accelerator.gather(new).sum().item()
        metrics["otb/reward_failures"].append(self._failures_total)
        if all("tool_calls" in x for x in inputs):  # multi-turn rollouts (otbrl.multiturn) report calls
            calls = torch.tensor([float(x["tool_calls"]) for x in inputs], device=mask.device)
            metrics["otb/tool_calls"].append(self.accelerator.gather(calls).mean().item())
        # TRL's completions table shows one advantage per sequence: show the mean over its tokens.
        per_seq = res.advantages.sum(dim=1) / all_mask.sum(dim=1).clamp_min(1)
        table = self._logs["advantages"]  # a deque: drop TRL's entries for this batch, then add ours
        for _ in range(min(per_seq.numel(), len(table))):
            table.pop()
        table.extend(per_seq.tolist())
        return out

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "grad_norm" in logs:
            callback = next(c for c in self.callback_handler.callbacks if isinstance(c, SurgeCallback))
            logs["otb/grad_norm_surge"] = float(callback.detector.update(logs["grad_norm"]))
        if self.args.length_decay and self.model.training and "loss" in logs:
            decay = next(c for c in self.callback_handler.callbacks if isinstance(c, LengthDecayCallback))
            # TRL puts completions/mean_length (their mean since the last log) in the logs after this point
            metric = self._metrics["train"].get("completions/mean_length", [])
            lengths = [x for x in metric if not math.isnan(x)]
            logs.update(decay.observe(
                self.state.global_step, sum(lengths) / len(lengths) if lengths else None,
                bool(logs.get("otb/grad_norm_surge")), self.optimizer, self.lr_scheduler,
            ))  # fmt: skip
        super().log(logs, start_time)
