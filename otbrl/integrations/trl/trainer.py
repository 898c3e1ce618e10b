"""`OTBGRPOTrainer`: TRL's GRPOTrainer whose loss receives (B, T) advantages from any otbrl estimator.

After TRL generates and scores a batch, the trainer takes each completion token's energy from a pass that
already happened, gathers what the estimator needs from every process (a prompt's group may span ranks),
and hands TRL's loss (B, T) advantages from `otbrl.compute_advantages`. Every registered estimator runs
through the same path, so GRPO, RLOO, OPO and OTB runs differ only in `advantage_estimator`.

Where the energy comes from (`energy_source`), first that applies:
  "sampler"    otbrl's sampler generated (`otbrl.integrations.trl.rollout_func`): each token's energy
               from the logits it was sampled from, handed over in the rollout's `otb_energy` field.
  "old_logps"  TRL computes old log-probs (num_iterations > 1, steps_per_generation not dividing
               gradient_accumulation_steps, or vLLM importance-sampling correction): its fused head also
               returns log sum pi^2 in that same forward, at the sampling temperature with the model's
               logit scale and soft-capping; energy = otbrl.token_energy_from_logprobs.
  "forward"    otherwise one no-grad forward (`otbrl.lm.completion_energy`), tool output visible.
With vLLM importance-sampling correction, TRL's ratios reach OTB as `is_weights`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from trl import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

import otbrl
from otbrl.integrations.trl.callbacks import LengthDecayCallback, SurgeCallback
from otbrl.integrations.trl.config import OTBGRPOConfig
from otbrl.integrations.trl.rewards import GuardedReward
from otbrl.integrations.trl.rollout import ENERGY_FIELD
from otbrl.lm import base_model, check_head, completion_energy
from otbrl.stability import batch_diagnostics, group_horizons


class _Tap:
    """Where the patched forward drops log sum pi^2 while a pass is tapped (`sink` is a list then)."""

    sink: list[torch.Tensor] | None = None


def _tap_log_sum_sq(model: Any, temperature: float, cast_lm_head_to_fp32: bool, tap: _Tap) -> None:
    """Give `model` (the one TRL patched with its fused head) a second fused head that also returns
    log sum pi^2, used only while `tap.sink` is a list: the training forward keeps TRL's own head."""
    trl_forward = model.forward
    add_fused_lm_head(
        model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32,
        outputs=("log_probs", "entropy", "log_sum_sq_probs"),
    )  # fmt: skip
    with_sq = model.forward

    @functools.wraps(trl_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if tap.sink is None or not kwargs.get("fused_lm_head"):
            return trl_forward(*args, **kwargs)
        out = with_sq(*args, **kwargs)
        tap.sink.append(out.log_sum_sq_probs)
        return out

    model.forward = forward


# Inputs TRL hands a vision-language model next to the ids (its multimodal forward takes them).
VISION_INPUTS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes")


class OTBGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose loss receives (B, T) advantages from any otbrl estimator."""

    def __init__(self, *args: Any, reward_funcs: Any = None, **kwargs: Any) -> None:
        funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        self._guarded = [
            GuardedReward(f) if callable(f) and not isinstance(f, torch.nn.Module) else f for f in funcs
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
        self.energy_source: str | None = None  # "sampler", "old_logps" or "forward" (module docstring)
        self._sampled_energy: list[list[float]] | None = None
        self._tap, self._tap_armed, self._tapped = _Tap(), False, None
        self._head_checked = False
        self._spec = otbrl.ESTIMATORS[self.args.advantage_estimator]
        if self._spec.needs_energy and not self.args.energy_from_logits:
            # the same model TRL gave its fused head, with the same temperature and head precision
            _tap_log_sum_sq(
                base_model(self.model), self.temperature, self.args.cast_lm_head_to_fp32, self._tap
            )

    # TRL computes and gathers per-function rewards but does not return them from the scoring step.
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):  # noqa: ANN001, ANN202
        self._rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._rewards_per_func

    # otbrl's rollout_func hands over the sampled tokens' energy; keep it out of the reward functions' inputs.
    def _generate(self, prompts: list):  # noqa: ANN202
        result = list(super()._generate(prompts))
        extra = result[5]
        self._sampled_energy = extra.pop(ENERGY_FIELD, None) if isinstance(extra, dict) else None
        return tuple(result)

    def _old_logps_pass_runs(self) -> bool:
        """Whether TRL computes old log-probs in _generate_and_score_completions (trl 1.16's condition)."""
        every = self.args.steps_per_generation * self.num_iterations
        vllm_is = self.use_vllm and self.vllm_importance_sampling_correction
        return self.args.gradient_accumulation_steps % every != 0 or bool(vllm_is)

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        # The first no-grad pass of the policy in a scoring step is the old-log-prob pass (TRL runs it
        # before the reference pass); tap it only when it runs at all, so a PEFT reference pass (the same
        # model with its adapter off) is never mistaken for it.
        if not (self._tap_armed and not torch.is_grad_enabled() and model is self.model):
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        self._tap_armed = False
        if self._sampled_energy is not None:  # the sampler's energy is already there
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        self._tap.sink = []
        try:
            result = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
            self._tapped = torch.cat(self._tap.sink) if self._tap.sink else None
        finally:
            self._tap.sink = None
        return result

    def _check_head_once(self) -> None:
        """The first time the energy is computed from hidden states and the output head, make sure the
        logits rebuilt from them are the model's own (otbrl.lm.check_head): never a different distribution."""
        if not self._head_checked:
            check_head(self.accelerator.unwrap_model(self.model))
            self._head_checked = True

    @torch.no_grad()
    def token_energy(self, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:  # noqa: ANN001
        """(B, T) energy of each completion token at the sampling temperature, in one no-grad forward of
        the model (`otbrl.lm.completion_energy`), zero where completion_mask is 0. completion_mask is
        the attention mask of the completion: keep tool output in it (1), so that every token is scored
        in the context it was sampled in; mask the energy of tool tokens afterwards."""
        model = self.accelerator.unwrap_model(self.model)
        ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention = torch.cat([prompt_mask, completion_mask], dim=1)
        with self.accelerator.autocast():
            return completion_energy(
                model, ids, attention, completion_ids.shape[1], self.temperature,
                rows=self.args.per_device_train_batch_size, from_logits=self.args.energy_from_logits,
            )  # fmt: skip

    def _batch_energy(self, out: dict[str, Any], policy: torch.Tensor) -> torch.Tensor:
        """(B, T) energy of this rank's batch, zero off policy tokens, from the first source that applies."""
        rows, width = policy.shape
        if self._sampled_energy is not None:
            energy = torch.zeros(rows, width, device=policy.device)
            for i, values in enumerate(self._sampled_energy):
                if len(values) > width:
                    raise ValueError(f"{ENERGY_FIELD}: row {i} has {len(values)} values for {width} tokens")
                energy[i, : len(values)] = torch.tensor(values, dtype=torch.float32, device=policy.device)
            self.energy_source = "sampler"
        elif self._tapped is not None and "old_per_token_logps" in out:
            self._check_head_once()
            log_sum_sq = self._tapped[:, -width:].float()
            energy = otbrl.token_energy_from_logprobs(out["old_per_token_logps"].float(), log_sum_sq.exp())
            self.energy_source = "old_logps"
        else:
            images = sorted(k for k in VISION_INPUTS if out.get(k) is not None)
            if images:  # the energy forward takes ids and masks only: the images would be missing
                raise ValueError(
                    f"OTBGRPOTrainer: this batch has vision inputs ({', '.join(images)}), which the energy "
                    "forward does not pass to the model; set num_iterations > 1 so that the energy comes "
                    "from TRL's old-log-prob pass, which sees them"
                )
            if not self.args.energy_from_logits:
                self._check_head_once()
            energy = self.token_energy(
                out["prompt_ids"], out["prompt_mask"], out["completion_ids"], out["completion_mask"]
            )
            self.energy_source = "forward"
        return torch.where(policy.bool(), energy, 0.0)  # padding may hold anything, NaN included

    def _importance_weights(self, out: dict[str, Any], policy: torch.Tensor) -> torch.Tensor | None:
        """TRL's vLLM importance-sampling ratios as (B, T) per-token weights: per token, or one per
        sequence ((B, 1), spread over its tokens), as TRL's loss multiplies them in."""
        ratio = out.get("importance_sampling_ratio")
        if ratio is None:
            return None
        return (ratio.float().expand(policy.shape) * policy).contiguous()

    def _gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(B_local, T_local) on every rank -> (B_global, T_max), rows in rank order, padded with 0."""
        return self.accelerator.gather(self.accelerator.pad_across_processes(x, dim=1, pad_index=0))

    def _generate_and_score_completions(self, inputs):  # noqa: ANN001, ANN202
        spec = self._spec
        self._sampled_energy, self._tapped, self.energy_source = None, None, None
        self._tap_armed = (
            spec.needs_energy and not self.args.energy_from_logits and self._old_logps_pass_runs()
        )
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            self._tap_armed = False
        mode = "train" if self.model.training else "eval"
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
        rows, length = mask.shape
        options = dict(self.args.estimator_options)
        if "tool_mask" in out and "align" in spec.options:
            options.setdefault("align", "generated")  # tool output shifts positions between trajectories
        zero = torch.zeros(mask.shape, device=mask.device)
        energy = self._batch_energy(out, mask) if spec.needs_energy else zero
        self._sampled_energy, self._tapped = None, None
        weights = self._importance_weights(out, mask) if "is_weights" in spec.options else None
        if weights is not None:
            options["is_weights"] = self._gather_rows(weights)
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
        diag |= group_horizons(all_mask, all_energy, rewards, group_ids)
        if spec.needs_energy:  # 1: the energy took a forward pass of its own (a cost the others lack)
            diag["energy_own_pass"] = float(self.energy_source == "forward")
        for key, value in diag.items():
            # no energy was computed: its statistics would read 0
            if spec.needs_energy or (key.startswith(("adv/", "horizon/")) and "energy" not in key):
                metrics[f"otb/{key}"].append(value)
        # Reward functions ran on each rank's own completions: add this batch's failures on all ranks to
        # the run's total (logged as a running count).
        failures = sum(getattr(f, "failures", 0) for f in self._guarded)
        new = torch.tensor([failures - self._failures_seen], dtype=torch.float32, device=mask.device)
        self._failures_seen = failures
        self._failures_total += self.accelerator.gather(new).sum().item()
        metrics["otb/reward_failures"].append(self._failures_total)
        if all("tool_calls" in x for x in inputs):  # tool rollouts (otbrl.rollout) report calls
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
