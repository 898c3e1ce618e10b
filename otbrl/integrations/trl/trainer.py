"""`OTBGRPOTrainer`: TRL's GRPOTrainer whose loss receives (B, T) advantages from any otbrl estimator.

After TRL generates and scores a batch, the trainer computes each completion token's energy in a no-grad
pass (final hidden states through `otbrl.fused_token_stats`, never the full logits), gathers what the
estimator needs from every process (a prompt's group may span ranks), and hands TRL's loss (B, T)
advantages from `otbrl.compute_advantages`. Every registered estimator runs through the same path, so
GRPO, RLOO, OPO and OTB runs differ only in `advantage_estimator`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from trl import GRPOTrainer

import otbrl
from otbrl.integrations.trl.callbacks import LengthDecayCallback, SurgeCallback
from otbrl.integrations.trl.config import OTBGRPOConfig
from otbrl.integrations.trl.rewards import GuardedReward
from otbrl.lm import predicting
from otbrl.stability import batch_diagnostics


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
        width = completion_ids.shape[1]
        rows = self.args.per_device_train_batch_size
        out = []
        for r in range(0, ids.shape[0], rows):
            with self.accelerator.autocast():
                hidden = decoder(
                    input_ids=ids[r : r + rows], attention_mask=attention[r : r + rows]
                ).last_hidden_state
            stats = otbrl.fused_token_stats(
                predicting(hidden, width), head.weight, completion_ids[r : r + rows],
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
