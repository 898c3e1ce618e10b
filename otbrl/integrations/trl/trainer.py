"""`OTBGRPOTrainer`: TRL's GRPOTrainer whose loss receives (B, T) advantages from any otbrl estimator.

It follows TRL's own subclass pattern (override `_generate_and_score_completions`, as GFPOTrainer does):
TRL generates and scores a batch, then the trainer takes each completion token's energy from a pass that
already happened, gathers what the estimator needs from every process (a prompt's group may span ranks),
and hands TRL's loss (B, T) advantages from `otbrl.compute_advantages`. Every registered estimator runs
through the same path, so GRPO, RLOO, OPO and OTB runs differ only in `advantage_estimator`.

Where the energy comes from (`energy_source`), first that applies:
  "sampler"    otbrl's sampler generated (`otbrl.integrations.trl.rollout_func`): each token's energy
               from the logits it was sampled from, handed over in the rollout's `otb_energy` field.
  "old_logps"  TRL computes old log-probs (num_iterations > 1, steps_per_generation not dividing
               gradient_accumulation_steps, or vLLM importance-sampling correction): its fused head also
               returns log sum pi^2 in that same forward (`tap.LogSumSqTap`), at the sampling temperature
               with the model's logit scale and soft-capping; energy = otbrl.token_energy_from_logprobs.
  "forward"    otherwise one no-grad forward (`otbrl.lm.completion_energy`), tool output visible.
With vLLM importance-sampling correction, TRL's ratios reach OTB as `is_weights`.

Group membership follows TRL's own statistics: a completion that `mask_truncated_completions` keeps out
of the loss still counts in its group with its reward (its tokens get no loss); a completion no reward
function scored, or one whose reward failed, belongs to no group; a group left with fewer than two scored
completions has no baseline, and every estimator gives its completions zero advantage, as TRL does (their
tokens stay in TRL's loss mask, as TRL keeps them). Estimator defaults that TRL fixes differently take
TRL's value unless the user sets the option (`config.TRL_DEFAULTS`: grpo's eps is 1e-4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from trl import GRPOTrainer

import otbrl
from otbrl.integrations.trl.callbacks import LengthDecayCallback, SurgeCallback
from otbrl.integrations.trl.config import TRL_DEFAULTS, OTBGRPOConfig
from otbrl.integrations.trl.rewards import GuardedReward
from otbrl.integrations.trl.rollout import ENERGY_FIELD, SAMPLER_MARK, sampling_settings
from otbrl.integrations.trl.tap import LogSumSqTap
from otbrl.lm import HeadTransform, base_model, check_head, completion_energy
from otbrl.stability import batch_diagnostics, group_horizons

# Inputs TRL hands a vision-language model next to the ids (its multimodal forward takes them).
VISION_INPUTS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes")
# Head-config fields otbrl reads (`otbrl.lm.head_transform`) that TRL 1.16's fused head does not: with
# one of them set, log sum pi^2 from TRL's pass would be another distribution's, so the energy takes the
# trainer's own forward instead.
NOT_IN_TRL_HEAD = ("logits_soft_cap",)


@dataclass
class ScoringStep:
    """What one scoring step carries between TRL's hooks. TRL 1.16 calls them in this order inside
    `_generate_and_score_completions`: `_generate`, the old-log-prob pass
    (`_get_per_token_logps_and_entropies`, no grad), `_calculate_rewards`. A fresh one starts each step;
    the latest stays readable until the next (`trainer._scoring`)."""

    tap_old_logps: bool = False  # tap the old-log-prob pass for log sum pi^2 (decided before TRL runs)
    sampled_energy: list[list[float]] | None = None  # _generate: the rollout's otb_energy, per row
    lengths: list[int] | None = None  # _generate: completion lengths, before any truncation mask
    tool_masks: list[list[int]] | None = None  # _generate: tool masks (1 model token), likewise
    log_sum_sq: torch.Tensor | None = None  # old-log-prob pass: (B, L) log sum pi^2
    rewards_per_func: torch.Tensor | None = None  # _calculate_rewards: (B_global, F), gathered by TRL
    failed: torch.Tensor | None = None  # _calculate_rewards: (B_global,) a reward function failed


@dataclass
class LocalBatch:
    """This rank's completions, (B_local, T_local) each: `loss` the policy tokens TRL's loss reads;
    `members` the policy tokens as sampled (truncated completions included); `attention` the completion's
    attention mask as sampled (tool output included); `energy` w_t, zero off `members`."""

    loss: torch.Tensor
    members: torch.Tensor
    attention: torch.Tensor
    energy: torch.Tensor | None = None


@dataclass
class GlobalBatch:
    """Every rank's completions, gathered in rank order: what the estimator receives."""

    mask: torch.Tensor  # (B, T) bool, member rows' policy tokens; unscored rows all False
    energy: torch.Tensor  # (B, T) float32, zero without an energy estimator
    rewards: torch.Tensor  # (B,) reward_weights-weighted sum of the functions' rewards
    group_ids: torch.Tensor  # (B,) RepeatSampler layout: consecutive rows of one prompt
    options: dict[str, Any]  # the estimator's keyword options for this batch


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
        if getattr(self.rollout_func, SAMPLER_MARK, False):
            sampling_settings(self)  # at start-up: refuses a setting otbrl's sampler would not apply
        self.add_callback(SurgeCallback(self.args.surge_factor, self.args.surge_window))
        if self.args.length_decay:
            self.add_callback(LengthDecayCallback(**self.args.length_decay_options(), driven=True))
        self._spec = otbrl.ESTIMATORS[self.args.advantage_estimator]
        self._scoring = ScoringStep()
        self._head: HeadTransform | None = None  # verified by check_head at the first hidden-state energy
        self._failures_seen, self._failures_total = 0, 0.0
        self.last_advantages: torch.Tensor | None = None  # (B_local, T_local) of the latest batch
        self.last_energy: torch.Tensor | None = None  # (B_local, T_local) w_t of the latest batch
        self.energy_source: str | None = None  # "sampler", "old_logps" or "forward" (module docstring)
        self._tap = None
        if self._spec.needs_energy and not self.args.energy_from_logits:
            # the model TRL gave its fused head, with the same temperature and head precision
            model = base_model(self.model)
            self._tap = LogSumSqTap(model, self.temperature, self.args.cast_lm_head_to_fp32)

    # ------------------------------------------------------------------------------------------------------
    # One scoring step, in data-flow order
    # ------------------------------------------------------------------------------------------------------

    def _generate_and_score_completions(self, inputs):  # noqa: ANN001, ANN202
        self._scoring = ScoringStep(tap_old_logps=self._tap_wanted())
        out = super()._generate_and_score_completions(inputs)
        local = self._local_batch(out)
        local.energy = self._batch_energy(out, local) if self._spec.needs_energy else None
        batch = self._global_batch(out, local)
        res = otbrl.compute_advantages(
            self.args.advantage_estimator,
            rewards=batch.rewards,
            mask=batch.mask,
            group_ids=batch.group_ids,
            energy=batch.energy if self._spec.needs_energy else None,
            **batch.options,
        )
        out["advantages"] = self._local_advantages(res.advantages, local)  # TRL's loss keeps (B, T) as is
        self._log_step(inputs, local, batch, res.advantages)
        return out

    def _tap_wanted(self) -> bool:
        """Whether this step's energy comes out of TRL's old-log-prob pass: that pass runs (trl 1.16's
        condition), and TRL's fused head applies the whole head transform otbrl reads."""
        if self._tap is None:
            return False
        every = self.args.steps_per_generation * self.num_iterations
        vllm_is = self.use_vllm and self.vllm_importance_sampling_correction
        runs = self.args.gradient_accumulation_steps % every != 0 or bool(vllm_is)
        text = base_model(self.model).config.get_text_config()
        return runs and all(getattr(text, name, None) is None for name in NOT_IN_TRL_HEAD)

    def _local_batch(self, out: dict[str, Any]) -> LocalBatch:
        """This rank's masks. With mask_truncated_completions TRL zeroes a truncated completion's masks
        (attention and loss); its members and attention are rebuilt as sampled, from `_generate`."""
        loss = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
        if not self.mask_truncated_completions:
            return LocalBatch(loss=loss, members=loss, attention=out["completion_mask"])
        width, device = loss.shape[1], loss.device
        lengths = torch.tensor(self._scoring.lengths, device=device)
        attention = (torch.arange(width, device=device)[None, :] < lengths[:, None]).to(loss.dtype)
        members = attention
        if self._scoring.tool_masks is not None:
            tools = torch.ones_like(attention)
            for i, row in enumerate(self._scoring.tool_masks):
                tools[i, : len(row)] = torch.tensor(row, dtype=tools.dtype, device=device)
            members = attention * tools
        return LocalBatch(loss=loss, members=members, attention=attention)

    def _batch_energy(self, out: dict[str, Any], local: LocalBatch) -> torch.Tensor:
        """(B, T) energy of this rank's completions, zero off member tokens, from the first source that
        applies (module docstring)."""
        if self._scoring.sampled_energy is not None:
            energy, self.energy_source = self._sampled_energy(local.members), "sampler"
        elif self._scoring.log_sum_sq is not None and "old_per_token_logps" in out:
            energy, self.energy_source = self._old_logps_energy(out, local), "old_logps"
        else:
            energy, self.energy_source = self._forward_energy(out, local.attention), "forward"
        return torch.where(local.members.bool(), energy, 0.0)  # padding may hold anything, NaN included

    def _sampled_energy(self, members: torch.Tensor) -> torch.Tensor:
        """The rollout's per-token energies as (B, T), zero-padded."""
        rows, width = members.shape
        energy = torch.zeros(rows, width, device=members.device)
        for i, values in enumerate(self._scoring.sampled_energy):
            if len(values) > width:
                raise ValueError(f"{ENERGY_FIELD}: row {i} has {len(values)} values for {width} tokens")
            energy[i, : len(values)] = torch.tensor(values, dtype=torch.float32, device=members.device)
        return energy

    def _old_logps_energy(self, out: dict[str, Any], local: LocalBatch) -> torch.Tensor:
        """Energy from TRL's old log-probs and the tapped log sum pi^2. TRL scored a truncated completion
        with its completion hidden from attention (mask_truncated_completions): those rows take the
        trainer's own forward, as sampled."""
        self._verified_head()
        width = local.members.shape[1]
        log_sum_sq = self._scoring.log_sum_sq[:, -width:].float()
        energy = otbrl.token_energy_from_logprobs(out["old_per_token_logps"].float(), log_sum_sq.exp())
        hidden = (local.loss.sum(dim=1) == 0) & (local.members.sum(dim=1) > 0)
        if hidden.any():
            rows = {k: out[k][hidden] for k in ("prompt_ids", "prompt_mask", "completion_ids")}
            energy[hidden] = self.token_energy(**rows, completion_mask=local.attention[hidden])
        return energy

    def _forward_energy(self, out: dict[str, Any], attention: torch.Tensor) -> torch.Tensor:
        """Energy from one no-grad forward of the whole model (ids and masks only)."""
        images = sorted(k for k in VISION_INPUTS if out.get(k) is not None)
        if images:  # the energy forward takes ids and masks only: the images would be missing
            raise ValueError(
                f"OTBGRPOTrainer: this batch has vision inputs ({', '.join(images)}), which the energy "
                "forward does not pass to the model; set num_iterations > 1 so that the energy comes "
                "from TRL's old-log-prob pass, which sees them"
            )
        return self.token_energy(out["prompt_ids"], out["prompt_mask"], out["completion_ids"], attention)

    def _verified_head(self) -> HeadTransform | None:
        """The model's head transform, checked against its own logits the first time the energy comes
        from hidden states and the output head (otbrl.lm.check_head): never a different distribution.
        None with energy_from_logits (the model's own logits need no check)."""
        if self._head is None and not self.args.energy_from_logits:
            self._head = check_head(self.accelerator.unwrap_model(self.model))
        return self._head

    @torch.no_grad()
    def token_energy(self, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:  # noqa: ANN001
        """(B, T) energy of each completion token at the sampling temperature, in one no-grad forward of
        the model (`otbrl.lm.completion_energy`), zero where completion_mask is 0. completion_mask is
        the attention mask of the completion: keep tool output in it (1), so that every token is scored
        in the context it was sampled in; mask the energy of tool tokens afterwards."""
        model = self.accelerator.unwrap_model(self.model)
        ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention = torch.cat([prompt_mask, completion_mask], dim=1)
        transform = self._verified_head()
        with self.accelerator.autocast():
            return completion_energy(
                model,
                ids,
                attention,
                completion_ids.shape[1],
                self.temperature,
                rows=self.args.per_device_train_batch_size,
                from_logits=self.args.energy_from_logits,
                transform=transform,
            )

    def _global_batch(self, out: dict[str, Any], local: LocalBatch) -> GlobalBatch:
        """Gather every rank's masks and energy; weigh the gathered rewards; take rows that no function
        scored, or whose reward failed, out of their groups, and the rows of a group left with fewer than
        two scored rows too: a baseline over one row is undefined, so TRL gives them zero advantage (its
        GRPO and RLOO turn the NaN of that baseline into 0), and so does every estimator here."""
        mode = "train" if self.model.training else "eval"
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        per_func = self._scoring.rewards_per_func  # (B_global, functions), gathered by TRL
        rewards = (per_func * self.reward_weights.to(per_func.device)[None, :]).nansum(dim=1)
        unscored = torch.isnan(per_func).all(dim=1) | self._scoring.failed.to(per_func.device)
        group_ids = torch.arange(rewards.numel(), device=rewards.device) // group_size
        scored = torch.zeros(int(group_ids.max()) + 1 if group_ids.numel() else 0, device=rewards.device)
        scored = scored.index_add_(0, group_ids, (~unscored).float())  # scored rows per group
        no_baseline = unscored | (scored[group_ids] < 2)
        mask = self._gather_rows(local.members.int()).bool() & ~no_baseline[:, None]
        energy = local.energy if local.energy is not None else torch.zeros(local.members.shape)
        return GlobalBatch(
            mask=mask,
            energy=self._gather_rows(energy.float().to(mask.device)),
            rewards=rewards.masked_fill(unscored, 0.0),
            group_ids=group_ids,
            options=self._estimator_options(out, local),
        )

    def _estimator_options(self, out: dict[str, Any], local: LocalBatch) -> dict[str, Any]:
        """The configured options, TRL's defaults for those left unset (`TRL_DEFAULTS`), and this batch's:
        generated-token alignment when tool output shifts positions (unless set), and TRL's vLLM
        importance ratios as (B, T) is_weights, which TRL's loss multiplies in per token, or one per
        sequence ((B, 1), spread over its tokens)."""
        options = TRL_DEFAULTS.get(self.args.advantage_estimator, {}) | dict(self.args.estimator_options)
        if "tool_mask" in out and "align" in self._spec.options:
            options.setdefault("align", "generated")
        ratio = out.get("importance_sampling_ratio")
        if ratio is not None and "is_weights" in self._spec.options:
            weights = (ratio.float().expand(local.members.shape) * local.members).contiguous()
            options["is_weights"] = self._gather_rows(weights)
        return options

    def _gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(B_local, T_local) on every rank -> (B_global, T_max), rows in rank order, padded with 0."""
        return self.accelerator.gather(self.accelerator.pad_across_processes(x, dim=1, pad_index=0))

    def _local_advantages(self, advantages: torch.Tensor, local: LocalBatch) -> torch.Tensor:
        """This rank's rows of the (B_global, T_max) advantages, zero where TRL's loss does not read
        (a truncated completion's tokens, under mask_truncated_completions)."""
        rows, width = local.loss.shape
        rank = self.accelerator.process_index
        mine = advantages[rank * rows : (rank + 1) * rows, :width].to(local.loss.device)
        self.last_advantages = mine * local.loss if self.mask_truncated_completions else mine
        self.last_energy = local.energy if local.energy is not None else torch.zeros_like(mine)
        return self.last_advantages

    # ------------------------------------------------------------------------------------------------------
    # TRL's hooks inside one scoring step: each hands its part to `self._scoring`
    # ------------------------------------------------------------------------------------------------------

    def _generate(self, prompts: list):  # noqa: ANN202
        """TRL's generation; keeps the rollout's energy (out of the reward functions' inputs) and the
        completions' lengths and tool masks as sampled."""
        result = list(super()._generate(prompts))
        completion_ids, tool_masks, extra = result[1], result[2], result[5]
        self._scoring.sampled_energy = extra.pop(ENERGY_FIELD, None) if isinstance(extra, dict) else None
        self._scoring.lengths = [len(ids) for ids in completion_ids]
        self._scoring.tool_masks = tool_masks
        return tuple(result)

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        # The first no-grad pass of the policy in a scoring step is the old-log-prob pass (TRL runs it
        # before the reference pass); it is tapped only when it runs at all, so a PEFT reference pass (the
        # same model with its adapter off) is never mistaken for it. The sampler's energy needs no tap.
        step = self._scoring
        if not (step.tap_old_logps and not torch.is_grad_enabled() and model is self.model):
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        step.tap_old_logps = False
        if step.sampled_energy is not None:
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        with self._tap.capture() as seen:
            result = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        step.log_sum_sq = torch.cat(seen) if seen else None
        return result

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):  # noqa: ANN001, ANN202
        """TRL's rewards (gathered); keeps them, and which rows' reward failed on any rank."""
        for f in self._guarded:
            if isinstance(f, GuardedReward):
                f.last_failed = []
        per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        failed = torch.zeros(len(prompts), dtype=torch.bool, device=per_func.device)
        for f in self._guarded:
            failed[getattr(f, "last_failed", [])] = True
        self._scoring.rewards_per_func, self._scoring.failed = per_func, self.accelerator.gather(failed)
        return per_func

    # ------------------------------------------------------------------------------------------------------
    # The loss: TRL options that read one advantage per sequence
    # ------------------------------------------------------------------------------------------------------

    @staticmethod
    def get_off_policy_mask(advantages: torch.Tensor, mask: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """OPSM (off_policy_mask_threshold) keeps or drops a whole sequence by its advantage's sign: it
        reads the sequence's advantage (`sequence_advantages`), not each token's."""
        summary = sequence_advantages(advantages, mask)
        return GRPOTrainer.get_off_policy_mask(advantages=summary, mask=mask, **kwargs)

    @staticmethod
    def get_gamma_weights(advantages: torch.Tensor, mask: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """VESPO picks its k and lambda per sequence by the advantage's sign: it reads the sequence's
        advantage (`sequence_advantages`), not each token's."""
        summary = sequence_advantages(advantages, mask)
        return GRPOTrainer.get_gamma_weights(advantages=summary, mask=mask, **kwargs)

    # ------------------------------------------------------------------------------------------------------
    # Logging
    # ------------------------------------------------------------------------------------------------------

    def _log_step(
        self, inputs: list, local: LocalBatch, batch: GlobalBatch, advantages: torch.Tensor
    ) -> None:
        """otb/* metrics of this batch, the run's reward failures, and TRL's completions table."""
        metrics = self._metrics["train" if self.model.training else "eval"]
        for key, value in self._diagnostics(batch, advantages).items():
            metrics[f"otb/{key}"].append(value)
        metrics["otb/reward_failures"].append(self._count_failures(local.loss.device))
        if all("tool_calls" in x for x in inputs):  # tool rollouts (otbrl.rollout) report calls
            calls = torch.tensor([float(x["tool_calls"]) for x in inputs], device=local.loss.device)
            metrics["otb/tool_calls"].append(self.accelerator.gather(calls).mean().item())
        # TRL's completions table shows one advantage per sequence: show the mean over its tokens.
        per_seq = advantages.sum(dim=1) / batch.mask.sum(dim=1).clamp_min(1)
        table = self._logs["advantages"]  # a deque: drop TRL's entries for this batch, then add ours
        for _ in range(min(per_seq.numel(), len(table))):
            table.pop()
        table.extend(per_seq.tolist())

    def _diagnostics(self, batch: GlobalBatch, advantages: torch.Tensor) -> dict[str, float]:
        """batch_diagnostics and group_horizons; without an energy estimator, only what needs no energy
        (its statistics would read 0)."""
        diag = batch_diagnostics(advantages, batch.energy, batch.mask)
        diag |= group_horizons(batch.mask, batch.energy, batch.rewards, batch.group_ids)
        if self._spec.needs_energy:  # 1: the energy took a forward pass of its own (a cost the others lack)
            diag["energy_own_pass"] = float(self.energy_source == "forward")
            return diag
        return {k: v for k, v in diag.items() if k.startswith(("adv/", "horizon/")) and "energy" not in k}

    def _count_failures(self, device: torch.device) -> float:
        """Reward functions ran on each rank's own completions: add this batch's failures on all ranks to
        the run's total (logged as a running count)."""
        failures = sum(getattr(f, "failures", 0) for f in self._guarded)
        new = torch.tensor([failures - self._failures_seen], dtype=torch.float32, device=device)
        self._failures_seen = failures
        self._failures_total += self.accelerator.gather(new).sum().item()
        return self._failures_total

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """otbrl's stability callbacks are driven here, the one path for both, before the Trainer
        records the logs (so their entries reach state.log_history): the surge detector sees the grad
        norm, then the length decay sees the mean completion length since the last log (TRL adds it to
        the logs only inside its own log) and the surge flag."""
        if "grad_norm" in logs:
            surge = self._callback(SurgeCallback)
            logs["otb/grad_norm_surge"] = float(surge.detector.update(logs["grad_norm"]))
        if self.args.length_decay and self.model.training and "loss" in logs:
            metric = self._metrics["train"].get("completions/mean_length", [])
            lengths = [x for x in metric if not math.isnan(x)]
            logs.update(
                self._callback(LengthDecayCallback).observe(
                    self.state.global_step,
                    sum(lengths) / len(lengths) if lengths else None,
                    bool(logs.get("otb/grad_norm_surge")),
                    self.optimizer,
                    self.lr_scheduler,
                )
            )
        super().log(logs, start_time)

    def _callback(self, kind: type) -> Any:
        """The trainer's callback of that class (looked up each time: a resume restoring callback states
        replaces the instances)."""
        return next(c for c in self.callback_handler.callbacks if isinstance(c, kind))


def sequence_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) per-token advantages -> (B, 1): each sequence's mean advantage over its policy tokens (the
    value TRL's completions table shows), for TRL options that decide per sequence. A sequence-level
    estimator's advantage is constant along T, so this is that advantage; (B, 1) input passes through."""
    if advantages.dim() == 2 and advantages.shape[1] == 1:
        return advantages
    keep = mask.to(advantages.dtype)
    return (advantages * keep).sum(dim=-1, keepdim=True) / keep.sum(dim=-1, keepdim=True).clamp(min=1.0)
