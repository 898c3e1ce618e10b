"""otbrl.stability: the length-surge detector on synthetic series (surges against noise of the same
variance), cooldown, floor and saved state; the LR cut surviving a LambdaLR scheduler and a checkpoint;
and in TRL (tiny model, CPU): the LR the optimizer uses drops after a trigger and stays dropped across a
checkpoint resume.
"""

from __future__ import annotations

import json
import logging
import math
import types

import pytest
import torch

from otbrl.stability import LengthSurgeDecay, scale_learning_rate

ONSET, LENGTH = 150, 200  # synthetic series: 150 steps at a steady level, then 50 steps of surge
SEEDS = range(50)


@pytest.fixture(autouse=True)
def _quiet_triggers():
    logging.getLogger("otbrl.stability").setLevel(logging.ERROR)
    yield
    logging.getLogger("otbrl.stability").setLevel(logging.NOTSET)


def surge_series(kind: str, rise: float, seed: int) -> torch.Tensor:
    """Mean lengths around 100 (noise std 5); from ONSET a step up by `rise`, or a ramp up by `rise` over
    the last 50 steps."""
    g = torch.Generator().manual_seed(seed)
    x = 100 + 5 * torch.randn(LENGTH, generator=g, dtype=torch.float64)
    t = torch.arange(LENGTH, dtype=torch.float64)
    up = (t >= ONSET).double() if kind == "step" else (t - ONSET).clamp(min=0) / (LENGTH - ONSET)
    return x + rise * up


def matched_noise(reference: torch.Tensor, seed: int) -> torch.Tensor:
    """i.i.d. normal noise with the reference series' mean and variance (so the surge's variance)."""
    g = torch.Generator().manual_seed(10_000 + seed)
    z = torch.randn(reference.numel(), generator=g, dtype=torch.float64)
    return (reference.mean() + reference.std() * z).clamp(min=0)  # a length; clamps a few of 10^4 draws


def trigger_steps(series: torch.Tensor, **options) -> list[int]:
    decay = LengthSurgeDecay(**{"cooldown": 1000, **options})
    for x in series.tolist():
        decay.step(x)
    return [t["step"] for t in decay.triggers]


# ----------------------------------------------------------------------------------------------------------
# the detector
# ----------------------------------------------------------------------------------------------------------


# (kind, rise, whether the relative rules alone fire on the matched noise of some seeds)
SURGES = [("step", 60, False), ("step", 100, True), ("ramp", 100, False), ("ramp", 150, True)]


@pytest.mark.parametrize("kind, rise, _", SURGES)
def test_fires_on_a_surge(kind, rise, _):
    """Every seed fires after the onset (a step within 8 steps, a ramp of +2 or +3% a step within 30),
    never before."""
    latest = 8 if kind == "step" else 30
    for seed in SEEDS:
        steps = trigger_steps(surge_series(kind, rise, seed))
        assert steps, f"seed {seed}: no trigger"
        assert ONSET <= steps[0] <= ONSET + latest, f"seed {seed}: fired at {steps[0]}"


@pytest.mark.parametrize("kind, rise, relative_rules_fire", SURGES)
def test_quiet_on_noise_of_the_same_variance(kind, rise, relative_rules_fire):
    """No seed fires on i.i.d. noise with a surge series' mean and variance. Single steps of the noise do
    pass threshold * median; for the larger rises the relative rules alone (zscore=0) fire on some seeds,
    so the noise rule is what keeps them quiet."""
    relative_only = 0
    for seed in SEEDS:
        surge = surge_series(kind, rise, seed)
        noise = matched_noise(surge, seed)
        assert noise.var().item() == pytest.approx(surge.var().item(), rel=0.35)
        assert (noise > 1.25 * noise.median()).sum() >= 10
        assert trigger_steps(noise) == [], f"seed {seed}"
        relative_only += bool(trigger_steps(noise, zscore=0.0))
    assert relative_only >= 3 if relative_rules_fire else True


def test_one_outlier_does_not_fire():
    """A single 10x spike holds the smoothed length up for several steps; patience and the raw-length
    rule keep it from firing, while the same spike held for `patience` steps does fire."""
    base = [100.0, 102.0, 98.0, 101.0, 99.0] * 8
    assert trigger_steps(torch.tensor(base + [1000.0] + base[:10])) == []
    assert trigger_steps(torch.tensor(base + [1000.0] * 3 + base[:10])) == [len(base) + 2]


def _exponential_surge(n: int = 150) -> list[float]:
    """40 steady steps, then +5% per step: a surge that keeps going."""
    return [100.0 + (i % 3) for i in range(40)] + [100.0 * 1.05**k for k in range(1, n - 39)]


def test_cooldown_and_floor():
    decay = LengthSurgeDecay(factor=0.5, min_factor=0.1, cooldown=10, patience=3)
    multipliers = [decay.step(x) for x in _exponential_surge()]
    steps = [t["step"] for t in decay.triggers]
    assert len(steps) >= 5
    # a surge that goes on fires again as soon as the cooldown lets it, never sooner
    assert all(b - a == 11 for a, b in zip(steps, steps[1:], strict=False))
    assert [t["multiplier"] for t in decay.triggers][:5] == [0.5, 0.25, 0.125, 0.1, 0.1]
    assert min(multipliers) == 0.1  # the floor holds, triggers past it are still recorded
    for i, m in enumerate(multipliers):  # the multiplier changes only on a trigger step
        before = multipliers[i - 1] if i else 1.0
        assert (m != before) == (i in steps and before > 0.1)


def test_grad_surge_trigger():
    quiet = [100.0] * 30
    off = LengthSurgeDecay(cooldown=5)
    on = LengthSurgeDecay(cooldown=5, on_grad_surge=True)
    flags = [i in (3, 6, 7, 20) for i in range(30)]
    for x, flag in zip(quiet, flags, strict=True):
        off.step(x, grad_surge=flag)
        on.step(x, grad_surge=flag)
    assert off.triggers == []
    # no warmup for the flag (the grad-norm detector has its own); 6 and 7 fall in the cooldown after 3
    assert [(t["step"], t["reason"]) for t in on.triggers] == [(3, "grad_norm"), (20, "grad_norm")]
    assert on.multiplier == 0.25


def test_missing_lengths_count_as_steps():
    decay = LengthSurgeDecay(warmup=5, window=10)
    for x in [100.0, None, math.nan, math.inf, 100.0]:
        decay.step(x)
    assert decay.steps == 5 and list(decay.history) == [100.0, 100.0]
    with pytest.raises(ValueError, match="mean_length"):
        decay.step(-1.0)


@pytest.mark.parametrize(
    "name, value",
    [
        ("factor", 1.0),
        ("factor", 0.0),
        ("threshold", 0.9),
        ("zscore", -1.0),
        ("smoothing", 0.0),
        ("smoothing", 1.5),
        ("window", 0),
        ("warmup", 0),
        ("warmup", 51),
        ("patience", 0),
        ("cooldown", -1),
        ("min_factor", 0.0),
        ("min_factor", 1.5),
    ],
)
def test_bad_arguments(name, value):
    with pytest.raises(ValueError, match=f"^{name}: must be"):
        LengthSurgeDecay(**{name: value})


@pytest.mark.parametrize("cut", [49, 55])  # in a streak before the first trigger (step 49); in its cooldown
def test_state_dict_round_trip_continues_identically(cut):
    series = _exponential_surge()
    whole = LengthSurgeDecay(cooldown=10)
    first = LengthSurgeDecay(cooldown=10)
    for x in series[:cut]:
        whole.step(x)
        first.step(x)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps (trainer_state.json)
    assert (state["streak"], len(state["triggers"])) == (2, 0) if cut == 49 else state["cooldown_left"] > 0
    resumed = LengthSurgeDecay(factor=0.9, window=5, warmup=1)  # the saved configuration wins
    resumed.load_state_dict(state)
    for x in series[cut:]:
        assert resumed.step(x) == whole.step(x)
    assert resumed.state_dict() == whole.state_dict()
    assert len(whole.triggers) > 2


# ----------------------------------------------------------------------------------------------------------
# applying the multiplier to a torch optimizer and scheduler
# ----------------------------------------------------------------------------------------------------------


def _linear(total: int):
    return lambda step: max(0.0, 1 - step / total)


def _setup(lr: float = 1.0, total: int = 20):
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=lr)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, _linear(total))


def _train(optimizer, scheduler, steps: int, at: int | None, apply) -> list[float]:  # noqa: ANN001
    """The lr each optimizer step used; `apply(optimizer, scheduler)` runs after step `at`'s schedule."""
    used = []
    for k in range(steps):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
        if k == at:
            apply(optimizer, scheduler)
    return used


def test_lambda_lr_keeps_the_cut():
    """The pitfall first: scaling param_group lr alone lasts one step under LambdaLR."""
    expected = [1 - k / 20 for k in range(12)]
    expected = expected[:6] + [0.5 * e for e in expected[6:]]

    def naive(optimizer, scheduler):  # noqa: ANN001, ANN202
        for g in optimizer.param_groups:
            g["lr"] *= 0.5

    used = _train(*_setup(), 12, 5, naive)
    assert used[6] == pytest.approx(expected[6]) and used[7] == pytest.approx(1 - 7 / 20)  # undone

    optimizer, scheduler = _setup()
    used = _train(optimizer, scheduler, 12, 5, lambda o, s: scale_learning_rate(o, s, 0.5))
    assert used == pytest.approx(expected)
    assert scheduler.get_last_lr() == pytest.approx([0.5 * (1 - 12 / 20)])  # what the Trainer logs


def test_the_cut_survives_a_checkpoint_once():
    """Optimizer and scheduler state carry the cut: restored, it is neither lost nor applied twice."""
    optimizer, scheduler = _setup()
    _train(optimizer, scheduler, 6, 2, lambda o, s: scale_learning_rate(o, s, 0.5))
    saved = optimizer.state_dict(), scheduler.state_dict()
    reference = _train(optimizer, scheduler, 6, None, None)
    restored_opt, restored_sched = _setup()
    restored_opt.load_state_dict(saved[0])
    restored_sched.load_state_dict(saved[1])
    assert _train(restored_opt, restored_sched, 6, None, None) == pytest.approx(reference)
    assert reference[0] == pytest.approx(0.5 * (1 - 6 / 20))


def test_update_in_a_plain_loop_and_other_schedulers():
    """LengthSurgeDecay.update in a torch loop: with LambdaLR, StepLR (chainable), a wrapped scheduler
    (accelerate's AcceleratedScheduler keeps it in .scheduler) and none, the lr used after the trigger is
    the schedule's times the multiplier."""
    lengths = [100.0] * 10 + [300.0] * 10

    def run(make):  # noqa: ANN001, ANN202
        param = torch.nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.SGD([param], lr=1.0)
        scheduler, wrapped = make(optimizer)
        decay = LengthSurgeDecay(warmup=5, window=10, patience=2, smoothing=1.0, cooldown=100)
        used, multipliers = [], []
        for x in lengths:
            used.append(optimizer.param_groups[0]["lr"])
            multipliers.append(decay.multiplier)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            decay.update(x, optimizer, wrapped)
        return used, multipliers

    schedules = {
        "lambda": (lambda o: torch.optim.lr_scheduler.LambdaLR(o, _linear(40)), lambda k: 1 - k / 40),
        "step": (lambda o: torch.optim.lr_scheduler.StepLR(o, 4, gamma=0.9), lambda k: 0.9 ** (k // 4)),
        "none": (lambda o: None, lambda k: 1.0),
    }
    for name, (build, schedule) in schedules.items():
        for wrap in (False, True):

            def make(o, build=build, wrap=wrap):  # noqa: ANN001, ANN202
                s = build(o)
                return s, (types.SimpleNamespace(scheduler=s) if wrap and s is not None else s)

            used, multipliers = run(make)
            assert multipliers[-1] == 0.5 and multipliers.index(0.5) == 12, name  # fired on step 11
            assert used == pytest.approx([schedule(k) * m for k, m in enumerate(multipliers)]), (name, wrap)


def test_bad_ratio():
    optimizer, scheduler = _setup()
    for ratio in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="ratio"):
            scale_learning_rate(optimizer, scheduler, ratio)


# ----------------------------------------------------------------------------------------------------------
# in TRL: OTBGRPOTrainer (length_decay=True) and the callback in TRL's plain GRPOTrainer
# ----------------------------------------------------------------------------------------------------------

LR0 = 1e-3
SCRIPT = {1: 10.0, 2: 10.0, 3: 40.0, 4: 40.0, 5: 40.0, 6: 40.0}  # mean length logged at each step
DECAY = dict(warmup=2, window=10, patience=1, smoothing=1.0, threshold=1.5, zscore=0.0, cooldown=100)


def _schedule(step: int, total: int = 6) -> float:
    """The lr step `step` (1-based) uses under transformers' linear schedule without warmup."""
    return LR0 * (total - step + 1) / total


def _scripted(base: type) -> type:
    """A trainer whose logged mean completion length follows SCRIPT (replacing the tiny model's), and
    that records the length-decay callback's state at its first log (right after any resume)."""

    class Scripted(base):
        first_state: dict | None = None

        def log(self, logs, start_time=None):  # noqa: ANN001, ANN202
            if self.model.training and "loss" in logs:
                self._metrics["train"]["completions/mean_length"] = [SCRIPT[self.state.global_step]]
                if self.first_state is None:
                    self.first_state = json.loads(json.dumps(_decay_callback(self).decay_state))
            super().log(logs, start_time)

    return Scripted


def _decay_callback(trainer):  # noqa: ANN001, ANN202
    return next(c for c in trainer.callback_handler.callbacks if type(c).__name__ == "LengthDecayCallback")


@pytest.fixture(scope="module")
def trl_runs(tmp_path_factory):
    """Six steps in one go; four steps and a checkpoint, resumed to six; four steps of TRL's plain
    GRPOTrainer with the callback. Each records the lr its optimizer used at every step."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    pytest.importorskip("otbrl.integrations.trl")
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from otbrl.integrations.trl import LengthDecayCallback, OTBGRPOTrainer
    from tests.trl_dist_worker import GROUP, make_config, make_trainer

    class UsedLR(TrainerCallback):
        """Records the lr the optimizer uses at each step; stops training after step `stop`."""

        def __init__(self, stop: int) -> None:
            self.stop, self.used = stop, {}

        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):  # noqa: ANN001, ANN201
            self.used[state.global_step + 1] = optimizer.param_groups[0]["lr"]

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            control.should_training_stop |= state.global_step >= self.stop
            return control

    tmp = tmp_path_factory.mktemp("length_decay")
    options = {f"length_decay_{k}": v for k, v in DECAY.items()}

    def config(name: str):  # noqa: ANN202
        return make_config(
            tmp / name,
            max_steps=6,
            learning_rate=LR0,
            lr_scheduler_type="linear",
            save_strategy="steps",
            save_steps=4,
            length_decay=True,
            **options,
        )

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runs = {}
    try:
        plan = [("whole", 6, None), ("cut", 4, None), ("resumed", 6, tmp / "cut" / "checkpoint-4")]
        for name, stop, resume in plan:
            r = UsedLR(stop)
            trainer = make_trainer(config(name), cls=_scripted(OTBGRPOTrainer), callbacks=[r])
            trainer.train(resume_from_checkpoint=str(resume) if resume else None)
            runs[name] = (trainer, r.used)
        plain_args = GRPOConfig(
            output_dir=str(tmp / "plain"),
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            max_steps=4,
            learning_rate=LR0,
            lr_scheduler_type="linear",
            per_device_train_batch_size=8,
            num_generations=GROUP,
            max_completion_length=8,
            beta=0.0,
            seed=0,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        r = UsedLR(4)
        trainer = make_trainer(
            plain_args, cls=_scripted(GRPOTrainer), callbacks=[r, LengthDecayCallback(**DECAY)]
        )
        trainer.train()
        runs["plain"] = (trainer, r.used)
    finally:
        torch.set_num_threads(threads)
    runs["checkpoint"] = tmp / "cut/checkpoint-4"
    return runs


def _by_step(trainer, key: str) -> dict[int, float]:  # noqa: ANN001
    return {h["step"]: h[key] for h in trainer.state.log_history if key in h}


def test_trl_lr_drops_after_a_trigger_and_stays(trl_runs):
    """The surge logged at step 3 halves the lr the optimizer uses from step 4 on, under the linear
    schedule's LambdaLR; the logged learning_rate is that lr, and otb/lr_decay_* record the trigger."""
    trainer, used = trl_runs["whole"]
    expected = {k: _schedule(k) * (0.5 if k >= 4 else 1.0) for k in range(1, 7)}
    assert used == pytest.approx(expected, rel=1e-6)
    assert _by_step(trainer, "learning_rate") == pytest.approx(expected, rel=1e-6)
    assert _by_step(trainer, "otb/lr_decay_factor") == {1: 1.0, 2: 1.0, 3: 0.5, 4: 0.5, 5: 0.5, 6: 0.5}
    assert _by_step(trainer, "otb/lr_decay_trigger") == {1: 0.0, 2: 0.0, 3: 1.0, 4: 0.0, 5: 0.0, 6: 0.0}
    assert [(t["step"], t["reason"]) for t in _decay_callback(trainer).decay.triggers] == [(2, "length")]


def test_trl_resume_keeps_the_scheduler_state(trl_runs):
    """Resumed from checkpoint-4, the callback starts from the saved state and the run continues like the
    uninterrupted one: the same decayed lr (neither lost nor applied twice) and the same final state."""
    whole, used_whole = trl_runs["whole"]
    resumed, used_resumed = trl_runs["resumed"]
    saved = json.loads((trl_runs["checkpoint"] / "trainer_state.json").read_text())
    saved = saved["stateful_callbacks"]["LengthDecayCallback"]["attributes"]["decay_state"]
    assert saved["multiplier"] == 0.5 and saved["last_step"] == 4 and len(saved["triggers"]) == 1
    assert resumed.first_state == saved
    assert sorted(used_resumed) == [5, 6]
    assert used_resumed == pytest.approx({k: used_whole[k] for k in (5, 6)}, rel=1e-6)
    assert _decay_callback(resumed).decay_state == _decay_callback(whole).decay_state


def test_trl_callback_in_plain_grpo_trainer(trl_runs):
    trainer, used = trl_runs["plain"]
    expected = {k: _schedule(k, total=4) * (0.5 if k >= 4 else 1.0) for k in range(1, 5)}
    assert used == pytest.approx(expected, rel=1e-6)
    assert [t["step"] for t in _decay_callback(trainer).decay.triggers] == [2]


def test_trl_config_checks_length_decay_options(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("otbrl.integrations.trl")
    from tests.trl_dist_worker import make_config

    with pytest.raises(ValueError, match="^length_decay_factor: must be in"):
        make_config(tmp_path, length_decay_factor=1.5)  # checked even with length_decay off
    with pytest.raises(ValueError, match="^length_decay_warmup"):
        make_config(tmp_path, length_decay=True, length_decay_window=10, length_decay_warmup=20)
    assert make_config(tmp_path).length_decay is False
    args = make_config(tmp_path, length_decay=True, length_decay_cooldown=7)
    assert args.length_decay_options() == {**LengthSurgeDecay().config, "cooldown": 7}


def test_recipes_take_the_length_decay_keys():
    pytest.importorskip("yaml")
    pytest.importorskip("otbrl.integrations.trl")
    from otbrl.app.recipe import load_recipe, recipe_names

    recipe = load_recipe("demo", {"length_decay": True, "length_decay_factor": 0.7})
    assert recipe["length_decay"] is True and recipe["length_decay_factor"] == 0.7
    assert not any(load_recipe(name).get("length_decay") for name in recipe_names())  # off by default
    with pytest.raises(ValueError, match="length_decay_factor"):  # the suggestion for a typo
        load_recipe("demo", {"length_decay_facter": 0.7})
