"""otbrl.integrations.trl inside TRL's GRPOTrainer, on the CPU with a tiny model: short training runs for
several estimators, the (B, T) advantages reaching TRL's loss, two processes (torchrun, gloo) against one,
checkpoint resume, configuration errors and failing reward functions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")
pytest.importorskip("otbrl.integrations.trl")  # also skips a TRL version the adapter was not tested with

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import otbrl  # noqa: E402
from otbrl.integrations.trl import OTBGRPOConfig, OTBGRPOTrainer  # noqa: E402
from tests.integrations.processes import run_on_two_processes  # noqa: E402
from tests.trl_dist_worker import GROUP, RUNS, answer_reward, make_config, make_trainer  # noqa: E402

ESTIMATORS = sorted(set(otbrl.ESTIMATORS) - {"otb_exact"})


pytestmark = pytest.mark.usefixtures("one_thread")


def _logged(trainer: OTBGRPOTrainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


def _policy_rows(advantages: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the max and min advantage over policy tokens (rows with no policy token: 0, 0)."""
    m = mask.bool()
    hi = advantages.masked_fill(~m, -math.inf).amax(dim=1)
    lo = advantages.masked_fill(~m, math.inf).amin(dim=1)
    keep = m.any(dim=1)
    return hi.where(keep, 0.0), lo.where(keep, 0.0)


# ----------------------------------------------------------------------------------------------------------
# short runs
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_short_run(tmp_path, estimator):
    trainer = make_trainer(make_config(tmp_path, advantage_estimator=estimator, max_steps=2))
    trainer.train()
    assert trainer.state.global_step == 2
    losses = _logged(trainer, "loss")
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert _logged(trainer, "otb/reward_failures") == [0.0, 0.0]
    for key in ("otb/adv/mean", "otb/adv/abs_max", "otb/grad_norm_surge"):
        assert len(_logged(trainer, key)) == 2, key
    energy = _logged(trainer, "otb/energy/mean")
    if otbrl.ESTIMATORS[estimator].needs_energy:
        assert len(energy) == 2 and all(0 < e <= 2 for e in energy)
    else:  # no energy pass ran: logging zeros would mislead
        assert energy == []
    adv = trainer.last_advantages
    assert adv is not None and adv.dim() == 2 and adv.shape[0] == 8 and torch.isfinite(adv).all()


# ----------------------------------------------------------------------------------------------------------
# the (B, T) advantages reach TRL's loss
# ----------------------------------------------------------------------------------------------------------


class LossProbe(OTBGRPOTrainer):
    """Records what TRL's loss received and returned, and the energy of each scoring step next to the
    energy of the same tokens from the model's full logits."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[dict] = []
        self.energies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def token_energy(self, prompt_ids, prompt_mask, completion_ids, completion_mask):  # noqa: ANN001, ANN201
        energy = super().token_energy(prompt_ids, prompt_mask, completion_ids, completion_mask)
        model = self.accelerator.unwrap_model(self.model)
        with torch.no_grad():
            logits = model(
                input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
                attention_mask=torch.cat([prompt_mask, completion_mask], dim=1),
            ).logits
        start, width = prompt_ids.shape[1] - 1, completion_ids.shape[1]
        full = otbrl.token_energy(
            logits[:, start : start + width], completion_ids, temperature=self.temperature
        )
        self.energies.append((energy, full * completion_mask))
        return energy

    def _compute_loss(self, model, inputs):  # noqa: ANN001, ANN202
        loss = super()._compute_loss(model, inputs)
        self.calls.append(
            {
                "advantages": inputs["advantages"].detach().clone(),
                "mask": inputs["completion_mask"].clone(),
                "num_items_in_batch": inputs["num_items_in_batch"].clone(),
                "old_logps": inputs.get("old_per_token_logps"),
                "loss": loss.detach().clone(),
                "accumulation": self.current_gradient_accumulation_steps,
                "steps_per_generation": self.args.steps_per_generation,
                "processes": self.accelerator.num_processes,
            }
        )
        return loss


@pytest.mark.parametrize("steps_per_generation", [1, 2])
@pytest.mark.parametrize("estimator", ["otb", "grpo"])
def test_token_advantages_reach_the_loss(tmp_path, estimator, steps_per_generation):
    """On policy (beta=0, one iteration, steps_per_generation dividing gradient_accumulation_steps) every
    importance ratio is exactly 1, so TRL's "dapo" loss is -sum(A * mask) / normaliser with
    normaliser = num_items_in_batch / processes * accumulation / steps_per_generation (trl 1.16,
    GRPOTrainer._compute_loss)."""
    args = make_config(
        tmp_path,
        advantage_estimator=estimator,
        max_steps=2,
        loss_type="dapo",
        beta=0.0,
        num_iterations=1,
        gradient_accumulation_steps=2,
        steps_per_generation=steps_per_generation,
    )
    trainer = make_trainer(args, cls=LossProbe)
    trainer.train()
    assert len(trainer.calls) == 4  # 2 optimiser steps x 2 accumulated micro-batches
    generations = 4 // steps_per_generation  # a generation batch feeds steps_per_generation micro-batches
    assert len(trainer.energies) == (generations if estimator == "otb" else 0)

    varies = False
    for call in trainer.calls:
        adv, mask = call["advantages"], call["mask"]
        assert adv.dim() == 2 and adv.shape == mask.shape and adv.shape[0] == 8
        assert (adv[mask == 0] == 0).all()
        assert call["old_logps"] is None  # on policy: TRL uses per_token_logps.detach() as the old ones
        hi, lo = _policy_rows(adv, mask)
        if estimator == "grpo":
            assert (hi == lo).all(), "grpo advantages must be constant along T"
        varies |= bool(((hi - lo) > 1e-7).any())

        assert call["processes"] == 1 and call["accumulation"] == 2
        assert call["steps_per_generation"] == steps_per_generation
        normaliser = call["num_items_in_batch"].clamp(min=1.0) / 1 * 2 / steps_per_generation
        expected = -(adv * mask).sum() / normaliser
        torch.testing.assert_close(call["loss"], expected, rtol=1e-5, atol=1e-8)
    assert varies == (estimator == "otb"), "otb advantages must vary along T within some row"

    # num_items_in_batch counts the policy tokens of the whole generation batch
    for k in range(0, 4, steps_per_generation):
        group = trainer.calls[k : k + steps_per_generation]
        total = sum(int(c["mask"].sum()) for c in group)
        assert all(int(c["num_items_in_batch"]) == total for c in group)

    for energy, full in trainer.energies:  # the fused energy equals the energy from full logits
        torch.testing.assert_close(energy, full, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# two processes
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dist_records(tmp_path_factory):
    """Runs tests/trl_dist_worker.py on 2 processes; returns its output dir."""
    out = tmp_path_factory.mktemp("trl_dist")
    run_on_two_processes(str(out))
    return out


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


@pytest.mark.parametrize("run", sorted(RUNS))
def test_two_processes_match_one(dist_records, run):
    """Each rank's local advantages equal the matching slice of one single-process compute_advantages over
    the global batch rebuilt from both ranks (rows in rank order, padded to the widest completion)."""
    steps = sorted({p.name.split("_rank")[0] for p in dist_records.glob(f"{run}_step*_rank0.pt")})
    assert len(steps) == 2
    widths_differ = spans = False
    for step in steps:
        ranks = [_load(dist_records / f"{step}_rank{r}.pt") for r in range(2)]
        assert all(r["num_processes"] == 2 and r["estimator"] == "otb" and r["last_is_out"] for r in ranks)
        options = ranks[0]["options"]
        assert options == ({"leave_one_out": True} if run == "otb_loo" else {})
        rows = [r["mask"].shape[0] for r in ranks]
        assert rows[0] == rows[1] == RUNS[run]["per_device_train_batch_size"]
        widths = [r["mask"].shape[1] for r in ranks]
        widths_differ |= widths[0] != widths[1]
        width = max(widths)

        mask = torch.cat([_pad(r["mask"], width) for r in ranks]).bool()
        energy = torch.cat([_pad(r["energy"], width) for r in ranks]).float()
        for r in ranks:
            assert (r["energy"][r["mask"] == 0] == 0).all() and (r["energy"][r["mask"] == 1] > 0).all()
        per_func = ranks[0]["rewards_per_func"]
        torch.testing.assert_close(ranks[1]["rewards_per_func"], per_func, rtol=0, atol=0, equal_nan=True)
        assert per_func.shape == (sum(rows), 3) and not torch.isnan(per_func[:, :2]).any()
        # the verifier (third function) fails on some rank-1 rows: those rows are unscored, in no group
        failed = torch.isnan(per_func[:, 2])
        assert not failed[: rows[0]].any()
        rewards = (per_func * ranks[0]["reward_weights"][None, :]).nansum(dim=1)
        mask &= ~failed[:, None]

        group_ids = torch.arange(sum(rows)) // GROUP
        prompts = ranks[0]["prompts"] + ranks[1]["prompts"]
        for g in group_ids.unique().tolist():  # the RepeatSampler layout: a group is GROUP consecutive rows
            assert len({prompts[i] for i in range(len(prompts)) if group_ids[i] == g}) == 1
        rank_of_row = torch.arange(sum(rows)) // rows[0]
        spans |= any(rank_of_row[group_ids == g].unique().numel() == 2 for g in group_ids.unique().tolist())

        expected = otbrl.compute_advantages(
            "otb", rewards=rewards, mask=mask, group_ids=group_ids, energy=energy, **options
        ).advantages
        for r, rec in enumerate(ranks):
            local = expected[r * rows[0] : (r + 1) * rows[0]]
            torch.testing.assert_close(rec["advantages"], local[:, : widths[r]], rtol=0, atol=1e-6)
            assert (local[:, widths[r] :] == 0).all()
    assert spans, "no group had rows on both ranks"
    if run == "otb":  # with 2 rows a rank, the seeds give the ranks different completion widths once
        assert widths_differ


@pytest.mark.parametrize("run", sorted(RUNS))
def test_two_processes_count_reward_failures_of_every_rank(dist_records, run):
    ranks = [_load(dist_records / f"{run}_log_rank{r}.pt") for r in range(2)]
    assert ranks[0]["is_main"]
    last = max(
        int(p.name.split("_step")[1].split("_")[0]) for p in dist_records.glob(f"{run}_step*_rank0.pt")
    )
    failures = [_load(dist_records / f"{run}_step{last}_rank{r}.pt")["failures"] for r in range(2)]
    assert failures[0] == 0 and failures[1] > 0  # the setup: the verifier fails on rank 1 only
    assert ranks[0]["logged_failures"][-1] == sum(failures)


# ----------------------------------------------------------------------------------------------------------
# resume
# ----------------------------------------------------------------------------------------------------------


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def _surge_state(trainer: OTBGRPOTrainer) -> dict:
    callback = next(c for c in trainer.callback_handler.callbacks if type(c).__name__ == "SurgeCallback")
    return callback.detector.state_dict()


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory):
    """4 steps in one go; 2 of 4 steps then a stop; new trainers resuming from that checkpoint-2 to step 4,
    with TrainingArguments' defaults and with restore_callback_states_from_checkpoint=True."""
    tmp = tmp_path_factory.mktemp("trl_resume")

    def config(name: str, **overrides) -> OTBGRPOConfig:
        return make_config(
            tmp / name,
            max_steps=4,
            save_strategy="steps",
            save_steps=2,
            learning_rate=1e-2,
            seed=0,
            data_seed=0,
            **overrides,
        )

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # Trainer.__init__ seeds torch and train() draws from it: build each trainer just before training
        runs = {"whole": make_trainer(config("whole"))}
        runs["whole"].train()
        runs["cut"] = make_trainer(config("cut"), callbacks=[StopAt(2)])
        runs["cut"].train()
        checkpoint = tmp / "cut" / "checkpoint-2"
        runs["resumed"] = make_trainer(config("resumed"))
        runs["resumed"].train(resume_from_checkpoint=str(checkpoint))
        runs["restoring"] = make_trainer(config("restoring", restore_callback_states_from_checkpoint=True))
        runs["restoring"].train(resume_from_checkpoint=str(checkpoint))
        runs["initial"] = make_trainer(config("initial"))  # the same seeded initial weights, untrained
    finally:
        torch.set_num_threads(threads)
    runs["checkpoint"] = checkpoint
    return runs


@pytest.mark.parametrize("resumed", ["resumed", "restoring"])
def test_resume_matches_uninterrupted(resumed_runs, resumed):
    """Steps 3-4 after a resume equal steps 3-4 of the uninterrupted run: same weights, same logs (the
    Trainer restores each process's torch RNG from rng_state.pth, which TRL's sampling draws from)."""
    whole, cut, run = resumed_runs["whole"], resumed_runs["cut"], resumed_runs[resumed]
    assert cut.state.global_step == 2 and (resumed_runs["checkpoint"] / "rng_state.pth").exists()
    assert run.state.global_step == 4

    moved = 0.0
    params = zip(
        whole.model.named_parameters(),
        run.model.named_parameters(),
        resumed_runs["initial"].model.parameters(),
        strict=True,
    )
    for (name, p), (_, q), p0 in params:
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5, msg=name)
        moved = max(moved, (p - p0).abs().max().item())
    assert moved > 1e-4  # training changed the weights

    def by_step(trainer: OTBGRPOTrainer, key: str) -> dict[int, float]:
        return {h["step"]: h[key] for h in trainer.state.log_history if key in h}

    for key in ("loss", "reward", "otb/energy/mean", "otb/adv/mean_sq", "grad_norm", "otb/grad_norm_surge"):
        a, b = by_step(whole, key), by_step(run, key)
        assert [a[s] for s in (3, 4)] == pytest.approx([b[s] for s in (3, 4)], rel=1e-5, abs=1e-8), key


def _assert_surge_restored(resumed_runs, resumed: str) -> None:
    surge, expected = _surge_state(resumed_runs[resumed]), _surge_state(resumed_runs["whole"])
    assert surge.pop("history") == pytest.approx(expected.pop("history"), rel=1e-5)
    assert surge == expected


def test_resume_restores_surge_detector_when_asked(resumed_runs):
    _assert_surge_restored(resumed_runs, "restoring")


def test_resume_restores_surge_detector_by_default(resumed_runs):
    _assert_surge_restored(resumed_runs, "resumed")


# ----------------------------------------------------------------------------------------------------------
# configuration errors
# ----------------------------------------------------------------------------------------------------------


def test_unknown_estimator(tmp_path):
    with pytest.raises(ValueError, match="advantage_estimator") as err:
        make_config(tmp_path, advantage_estimator="nope")
    message = str(err.value)
    assert "'nope'" in message
    for name in ESTIMATORS:
        assert name in message
    with pytest.raises(ValueError, match="otb_exact"):  # needs a model and input ids per batch
        make_config(tmp_path, advantage_estimator="otb_exact")


def test_unknown_estimator_option(tmp_path):
    with pytest.raises(ValueError, match="leave_one_ot") as err:
        make_config(tmp_path, estimator_options={"leave_one_ot": True})
    assert "leave_one_out" in str(err.value)  # the options it does take
    with pytest.raises(ValueError, match="eps"):
        make_config(tmp_path, advantage_estimator="dr_grpo", estimator_options={"eps": 1e-6})


def test_estimator_options_json(tmp_path):
    args = make_config(tmp_path, estimator_options=json.dumps({"leave_one_out": True, "eps": 1e-6}))
    assert args.estimator_options == {"leave_one_out": True, "eps": 1e-6}
    assert make_config(tmp_path).estimator_options == {}
    with pytest.raises(ValueError, match="JSON"):
        make_config(tmp_path, estimator_options="{leave_one_out: true")
    with pytest.raises(ValueError, match="leave_one_ot"):
        make_config(tmp_path, estimator_options='{"leave_one_ot": true}')


def test_trainer_needs_otb_config(tmp_path):
    from trl import GRPOConfig

    plain = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, gradient_checkpointing=False)
    with pytest.raises(ValueError, match="OTBGRPOConfig"):
        make_trainer(plain)


# ----------------------------------------------------------------------------------------------------------
# failing reward functions
# ----------------------------------------------------------------------------------------------------------


class RewardProbe(OTBGRPOTrainer):
    """Records each scoring step's completions, per-function rewards and local advantages."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scored: list[tuple[list[str], torch.Tensor]] = []
        self.advantages: list[torch.Tensor] = []

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):  # noqa: ANN001, ANN202
        per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self.scored.append((list(completions), per_func.clone()))
        return per_func

    def _generate_and_score_completions(self, inputs):  # noqa: ANN001, ANN202
        out = super()._generate_and_score_completions(inputs)
        self.advantages.append(out["advantages"].clone())
        return out


def _bad_sum(c: str) -> bool:
    return sum(map(ord, c)) % 3 == 0


def _bad_len(c: str) -> bool:
    return len(c) % 3 == 1


def test_failing_reward_functions(tmp_path):
    counts = {"raised": 0, "nan": 0}

    def raises_sometimes(prompts, completions, answer, **kwargs):  # noqa: ANN001, ANN201
        for c in completions:
            if _bad_sum(c):
                counts["raised"] += len(completions) == 1  # the one-by-one retry of a failing sample
                raise ValueError(f"cannot score {c!r}")
        return [1.0 + r for r in answer_reward(prompts, completions, answer)]

    def nan_sometimes(prompts, completions, **kwargs):  # noqa: ANN001, ANN201
        counts["nan"] += sum(_bad_len(c) for c in completions)
        return [math.nan if _bad_len(c) else 0.5 + len(c) / 16 for c in completions]

    # Failures here are frequent on purpose (about a third to a half of the samples): raise the stopping
    # threshold so the run goes on and each failure costs only its sample.
    from otbrl.integrations.trl.rewards import GuardedReward

    funcs = [GuardedReward(f, max_failure_fraction=1.0) for f in (raises_sometimes, nan_sometimes)]
    args = make_config(tmp_path, max_steps=3)
    trainer = make_trainer(args, reward_funcs=funcs, cls=RewardProbe)
    trainer.train()
    assert trainer.state.global_step == 3
    assert all(math.isfinite(x) for x in _logged(trainer, "loss"))

    completions = [c for cs, _ in trainer.scored for c in cs]
    per_func = torch.cat([r for _, r in trainer.scored])
    bad_sum = torch.tensor([_bad_sum(c) for c in completions])
    bad_len = torch.tensor([_bad_len(c) for c in completions])
    assert bad_sum.any() and bad_len.any() and (~bad_sum).any() and (~bad_len).any()
    # a failed sample is left unscored (NaN in TRL's table), never given reward 0
    assert per_func[bad_sum, 0].isnan().all() and (per_func[~bad_sum, 0] >= 1).all()
    assert per_func[bad_len, 1].isnan().all() and (per_func[~bad_len, 1] > 0).all()
    # and a row where any function failed is in no group: zero advantages
    advantages = torch.cat([torch.nn.functional.pad(a, (0, 8 - a.shape[1])) for a in trainer.advantages])
    assert (advantages[bad_sum | bad_len] == 0).all()
    assert counts["raised"] == int(bad_sum.sum()) and counts["nan"] == int(bad_len.sum())

    logged = _logged(trainer, "otb/reward_failures")  # a running total, logged once per step
    assert len(logged) == 3 and logged[-1] == counts["raised"] + counts["nan"] > 0
    assert logged == sorted(logged)


def test_not_applicable_rewards_give_zero_advantage(tmp_path):
    """A reward function returning None (TRL: not applicable) is no failure; a row no function scores
    gets zero advantage."""

    def some_none(prompts, completions, answer, **kwargs):  # noqa: ANN001, ANN201
        return [
            None if _bad_sum(c) else r
            for c, r in zip(completions, answer_reward(prompts, completions, answer), strict=True)
        ]

    trainer = make_trainer(make_config(tmp_path, max_steps=2), reward_funcs=some_none, cls=RewardProbe)
    trainer.train()
    assert _logged(trainer, "otb/reward_failures") == [0.0, 0.0]
    seen = 0
    for (completions, per_func), adv in zip(trainer.scored, trainer.advantages, strict=True):
        unscored = torch.isnan(per_func[:, 0])
        assert unscored.tolist() == [_bad_sum(c) for c in completions]
        assert (adv[unscored] == 0).all()
        seen += int(unscored.sum())
    assert seen > 0
