"""Where OTBGRPOTrainer's energy comes from, and that it is the energy of the distribution the model
samples from: model families whose heads scale or soft-cap their logits (through TRL's old-log-prob pass
and through the trainer's own forward), multi-turn tool rollouts on the shipped tir_product3 warm start
(tool output visible to every later token), no extra forward when a pass already exists, TRL's
importance-sampling ratios as OTB's is_weights, and TRL options that have no effect under a (B, T)
estimator. References are float64 loops over the model's own full-context logits.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")
pytest.importorskip("otbrl.integrations.trl")

import torch  # noqa: E402

import otbrl  # noqa: E402
from otbrl.integrations.trl import OTBGRPOTrainer  # noqa: E402
from tests.integrations.processes import run_on_two_processes  # noqa: E402
from tests.models import COMMON, FAMILIES, ScaledQwen2, family_model, half_supported  # noqa: E402
from tests.references import reference_energy  # noqa: E402
from tests.trl_dist_worker import make_config, make_trainer  # noqa: E402

TEMPERATURE = 0.7


pytestmark = pytest.mark.usefixtures("one_thread")


def full_context_energy(model, out: dict, temperature: float) -> torch.Tensor:  # noqa: ANN001
    """(B, T) float64 energy of every completion token from one teacher-forced forward over prompt and
    completion (tool output included), as TRL's loss scores them; zero off policy tokens."""
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits
    n, width = out["completion_ids"].shape[1], ids.shape[1]
    energy = reference_energy(logits[:, width - n - 1 : width - 1], out["completion_ids"], temperature)
    policy = out["completion_mask"] * out.get("tool_mask", torch.ones_like(out["completion_mask"]))
    return energy * policy


class EnergyProbe(OTBGRPOTrainer):
    """Records, per scoring step, TRL's output, the trainer's energy and its source, the float64
    reference from the model's own logits, and the trainer's own forward on the same batch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.records: list[dict] = []

    def _generate_and_score_completions(self, inputs):  # noqa: ANN001, ANN202
        out = super()._generate_and_score_completions(inputs)
        model = self.accelerator.unwrap_model(self.model)
        policy = out["completion_mask"] * out.get("tool_mask", torch.ones_like(out["completion_mask"]))
        forward = self.token_energy(
            out["prompt_ids"], out["prompt_mask"], out["completion_ids"], out["completion_mask"]
        )
        self.records.append(
            {
                "out": out,
                "source": self.energy_source,
                "energy": self.last_energy.clone(),
                "reference": full_context_energy(model, out, self.temperature),
                "forward": forward * policy,
                "inputs": inputs,
            }
        )
        return out


def _relative_error(got: torch.Tensor, expected: torch.Tensor, floor: float = 1e-6) -> float:
    return ((got.double() - expected).abs() / expected.clamp_min(floor)).max().item()


# ----------------------------------------------------------------------------------------------------------
# model families: TRL's old-log-prob pass and the trainer's own forward
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_energy_is_the_sampled_distributions(tmp_path, family):
    """num_iterations=2: TRL computes old log-probs, and the energy comes out of that same forward
    (its fused head at the sampling temperature, with the family's scale and soft-capping). The trainer's
    fallback forward, run on the same batch, agrees too."""
    args = make_config(
        tmp_path,
        max_steps=1,
        num_iterations=2,
        temperature=TEMPERATURE,
        per_device_train_batch_size=8,
        max_completion_length=6,
    )
    trainer = make_trainer(args, model=family_model(family), cls=EnergyProbe, n_prompts=8)
    trainer.train()
    (record,) = trainer.records
    assert record["source"] == "old_logps"
    reference, policy = record["reference"], record["out"]["completion_mask"].bool()
    assert policy.any() and (reference[policy] > 0).all()
    # via log-probs and log sum pi^2 (float32 from TRL's kernel): the relative error grows as 1 - pi_y -> 0
    # (measured: at most 2.6e-6 absolute, on a token of energy 1e-7)
    torch.testing.assert_close(record["energy"].double(), reference, rtol=1e-3, atol=1e-5)
    # the trainer's own fused forward (otbrl.lm.completion_energy)
    torch.testing.assert_close(record["forward"].double(), reference, rtol=2e-5, atol=1e-7)


def test_no_extra_forward_when_trl_computes_old_logps(tmp_path, monkeypatch):
    import otbrl.integrations.trl.trainer as trainer_module

    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the trainer ran its own energy forward")

    monkeypatch.setattr(trainer_module, "completion_energy", refuse)
    args = make_config(tmp_path, max_steps=2, num_iterations=2, gradient_accumulation_steps=1)
    trainer = make_trainer(args)
    trainer.train()
    assert trainer.energy_source == "old_logps" and trainer.state.global_step == 2
    # on policy with one iteration, TRL computes no old log-probs: the trainer's own forward is the source
    monkeypatch.undo()
    trainer = make_trainer(make_config(tmp_path / "one", max_steps=1))
    trainer.train()
    assert trainer.energy_source == "forward"


def test_unknown_head_is_refused_in_training(tmp_path):
    torch.manual_seed(0)
    model = ScaledQwen2(__import__("transformers").Qwen2Config(**COMMON))
    trainer = make_trainer(make_config(tmp_path, max_steps=1), model=model)
    with pytest.raises(ValueError, match="ScaledQwen2.*energy_from_logits"):
        trainer.train()
    torch.manual_seed(0)
    model = ScaledQwen2(__import__("transformers").Qwen2Config(**COMMON))
    args = make_config(tmp_path / "logits", max_steps=1, energy_from_logits=True, temperature=TEMPERATURE)
    trainer = make_trainer(args, model=model, cls=EnergyProbe, n_prompts=8)
    trainer.train()
    (record,) = trainer.records
    assert record["source"] == "forward"
    torch.testing.assert_close(record["energy"].double(), record["reference"], rtol=2e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------------------------
# multi-turn: the shipped tir_product3 warm start, the real rollout_func
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory):
    """One step of the shipped tir_product3 warm start with otbrl's tool rollout_func (calc)."""
    from datasets import Dataset

    from otbrl.integrations.trl import rollout_func
    from otbrl.tasks import dataset, get_task
    from otbrl.tasks.warmstart import warm_start

    model, tokenizer, _ = warm_start("tir_product3", "small", log=None)
    task = get_task("tir_product3")

    def reward(prompts, completions, answer, **_):  # noqa: ANN001, ANN202
        return [task.reward(c, a) + 0.01 * len(c) for c, a in zip(completions, answer, strict=True)]

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = make_config(
            tmp_path_factory.mktemp("tir"),
            max_steps=1,
            per_device_train_batch_size=16,
            num_generations=8,
            max_completion_length=48,
            temperature=1.0,
            learning_rate=1e-6,
        )
        trainer = EnergyProbe(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=Dataset.from_list(dataset(task, 2)),
            processing_class=tokenizer,
            rollout_func=rollout_func(("calc",), max_turns=3, workers=2),
        )
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    return trainer


def _post_tool(out: dict) -> torch.Tensor:
    """(B, T) policy tokens that come after some tool output in their row."""
    tool = (out["tool_mask"] == 0) & out["completion_mask"].bool()
    policy = (out["tool_mask"] * out["completion_mask"]).bool()
    return policy & (tool.int().cumsum(dim=1) > 0)


def test_multiturn_energy_sees_the_tool_output(tool_run):
    (record,) = tool_run.records
    out, reference = record["out"], record["reference"]
    post = _post_tool(out)
    assert post.sum() >= 8, "the warm start should call the calculator and answer after it"
    assert record["source"] == "sampler"  # no second pass: each token's energy from its sampling logits
    assert (record["energy"][out["tool_mask"] == 0] == 0).all()
    torch.testing.assert_close(record["energy"].double(), reference, rtol=1e-4, atol=1e-6)
    # the fallback forward keeps the tool output in the attention mask too
    torch.testing.assert_close(record["forward"].double(), reference, rtol=2e-5, atol=1e-7)


def test_multiturn_rollout_hands_energy_to_the_trainer_not_to_rewards(tool_run):
    (record,) = tool_run.records
    assert all("otb_energy" not in x for x in record["inputs"])
    assert all("tool_calls" in x for x in record["inputs"])


# ----------------------------------------------------------------------------------------------------------
# importance-sampling ratios reach OTB
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_importance_ratios_become_is_weights(tmp_path, monkeypatch, level):
    """vLLM cannot run here: TRL's scoring step is wrapped to add ratios as TRL 1.16 shapes them ((B, T)
    per token, (B, 1) per sequence). The trainer's advantages must equal compute_advantages with those
    ratios as is_weights, and differ from the advantages without them."""
    from trl import GRPOTrainer

    original = GRPOTrainer._generate_and_score_completions
    injected: list[torch.Tensor] = []

    def with_ratios(self, inputs):  # noqa: ANN001, ANN202
        out = original(self, inputs)
        g = torch.Generator().manual_seed(len(injected))
        rows, width = out["completion_mask"].shape
        shape = (rows, width) if level == "token" else (rows, 1)
        out["importance_sampling_ratio"] = 0.5 + 1.5 * torch.rand(shape, generator=g)
        injected.append(out["importance_sampling_ratio"])
        return out

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", with_ratios)

    class Probe(OTBGRPOTrainer):
        seen: list = []

        def _generate_and_score_completions(self, inputs):  # noqa: ANN001, ANN202
            out = super()._generate_and_score_completions(inputs)
            rewards = self._scoring.rewards_per_func.clone()
            self.seen.append((out, rewards, self.last_energy, self.last_advantages))
            return out

    trainer = make_trainer(make_config(tmp_path, max_steps=1), cls=Probe)
    trainer.train()
    out, per_func, energy, adv = Probe.seen[0]
    mask = out["completion_mask"].bool()
    rewards = (per_func * trainer.reward_weights[None, :]).nansum(dim=1)
    groups = torch.arange(rewards.numel()) // 4
    weights = injected[0].expand(mask.shape)
    expected = otbrl.compute_advantages(
        "otb", rewards=rewards, mask=mask, group_ids=groups, energy=energy, is_weights=weights
    ).advantages
    torch.testing.assert_close(adv, expected)
    unweighted = otbrl.compute_advantages("otb", rewards=rewards, mask=mask, group_ids=groups, energy=energy)
    assert not torch.allclose(adv, unweighted.advantages)


# ----------------------------------------------------------------------------------------------------------
# TRL options that a (B, T) estimator replaces
# ----------------------------------------------------------------------------------------------------------


def test_options_without_effect_warn_or_raise(tmp_path):
    with pytest.warns(UserWarning, match="scale_rewards.*no effect"):
        make_config(tmp_path, scale_rewards="batch")
    with pytest.warns(UserWarning, match="scale_rewards"):
        make_config(tmp_path, scale_rewards=False)  # TRL reads False as "none"
    with pytest.raises(ValueError, match="multi_objective_aggregation"):
        make_config(tmp_path, multi_objective_aggregation="normalize_then_sum")
    with pytest.raises(ValueError, match="is_weights"):
        make_config(tmp_path, estimator_options={"is_weights": [1.0]})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        make_config(tmp_path)  # the defaults say nothing


# ----------------------------------------------------------------------------------------------------------
# sharded: FSDP2 on two CPU processes (gloo)
# ----------------------------------------------------------------------------------------------------------


def test_fsdp2_energy_matches_the_unsharded_model(tmp_path):
    """tests/trl_dist_worker.py --fsdp: Qwen2 (fused head, DTensor weight gathered) and Gemma2 (soft-capped,
    tiled) sharded over 2 processes; each rank's energy equals its unsharded model's, where the decoder
    called directly (the trainer's pass before otbrl.lm) fails on the sharded embedding."""
    run_on_two_processes("--fsdp", str(tmp_path))
    for family in ("qwen2", "gemma2"):
        for rank in range(2):
            record = torch.load(tmp_path / f"fsdp_{family}_rank{rank}.pt", weights_only=False)
            assert record["head_weight_type"] == "DTensor"
            torch.testing.assert_close(record["energy"].double(), record["reference"], rtol=2e-5, atol=1e-7)
            assert isinstance(record["legacy"], str) and "DTensor" in record["legacy"]


# ----------------------------------------------------------------------------------------------------------
# PEFT LoRA inside the trainer
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_peft_lora_energy_is_the_adapted_models(tmp_path, num_iterations):
    """A LoRA adapter (non-zero from the start, so that it matters) through TRL's peft_config, with a KL
    term: TRL's reference pass is the same model with the adapter off, after the old-log-prob pass. The
    energy must be the adapted policy's, from the old-log-prob pass (2 iterations) or the trainer's own
    forward (1)."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    args = make_config(
        tmp_path,
        max_steps=1,
        num_iterations=num_iterations,
        beta=0.04,
        temperature=TEMPERATURE,
        max_completion_length=6,
    )
    trainer = make_trainer(
        args, model=family_model("qwen2"), cls=EnergyProbe, n_prompts=8, peft_config=config
    )
    trainer.train()
    (record,) = trainer.records
    assert record["source"] == ("old_logps" if num_iterations == 2 else "forward")
    reference = record["reference"]
    model = trainer.accelerator.unwrap_model(trainer.model)
    with model.disable_adapter():
        without = full_context_energy(model, record["out"], TEMPERATURE)
    policy = record["out"]["completion_mask"].bool()
    assert ((without - reference).abs()[policy] / reference[policy]).max() > 1e-2  # the adapter matters
    torch.testing.assert_close(record["energy"].double(), reference, rtol=1e-3, atol=1e-5)


def test_vision_inputs_are_refused_on_the_forward_path():
    """The energy forward passes ids and masks only: a vision-language batch would lose its images, so
    it is refused with the way out (TRL's old-log-prob pass sees them)."""
    from types import SimpleNamespace

    trainer = SimpleNamespace()
    out = {"pixel_values": torch.zeros(1, 3, 4, 4), "completion_ids": torch.zeros(1, 2, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"vision inputs \(pixel_values\).*num_iterations > 1"):
        OTBGRPOTrainer._forward_energy(trainer, out, torch.ones(1, 2))


# ----------------------------------------------------------------------------------------------------------
# bf16=True (TRL's default) with float32 weights: the head check compares in the precision the model ran in
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_bf16_autocast_over_float32_weights_trains(tmp_path, num_iterations):
    """bf16=True wraps the model's forward in bf16 autocast; a plain float32 Llama was refused at its first
    step ("relative error 0.0059 > 0.0001" on SmolLM2-135M). Its energy is that of its bf16-autocast
    logits: within bf16 rounding of the float32 reference."""
    if not half_supported(torch.bfloat16):
        pytest.skip("this CPU has no bf16 autocast")
    args = make_config(
        tmp_path,
        max_steps=1,
        bf16=True,
        num_iterations=num_iterations,
        temperature=TEMPERATURE,
        max_completion_length=6,
    )
    trainer = make_trainer(args, model=family_model("llama", sharpen=3.0), cls=EnergyProbe, n_prompts=8)
    trainer.train()
    (record,) = trainer.records
    assert record["source"] == ("old_logps" if num_iterations == 2 else "forward")
    policy = record["out"]["completion_mask"].bool()
    assert policy.any() and torch.isfinite(record["energy"]).all()
    torch.testing.assert_close(record["energy"].double(), record["reference"], rtol=0.1, atol=2e-2)


# ----------------------------------------------------------------------------------------------------------
# single turn on otbrl's sampler (recipes' `sampler: otbrl`)
# ----------------------------------------------------------------------------------------------------------


def test_single_turn_sampler_rollout_gives_the_sampled_energy(tmp_path):
    """sampler_rollout_func: TRL takes the rollout, the trainer takes each token's energy from the logits
    it was sampled from (no own forward), and it equals the float64 full-context reference."""
    from otbrl.integrations.trl import sampler_rollout_func

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    args = make_config(
        tmp_path, max_steps=1, temperature=TEMPERATURE, per_device_train_batch_size=8, max_completion_length=6
    )
    trainer = make_trainer(args, cls=EnergyProbe, n_prompts=8, rollout_func=sampler_rollout_func())
    trainer.train()
    (record,) = trainer.records
    assert record["source"] == "sampler"
    policy = record["out"]["completion_mask"].bool()
    assert policy.any() and (record["reference"][policy] > 0).all()
    torch.testing.assert_close(record["energy"].double(), record["reference"], rtol=1e-4, atol=1e-6)


def test_sampler_rollout_applies_the_chat_template_and_the_trainers_autocast():
    """Chat prompts go through the tokenizer's template; sampling runs inside the accelerator's autocast
    (bf16 training samples in bf16); each row's lists have the completion's own length."""
    import contextlib
    from types import SimpleNamespace

    from otbrl.integrations.trl import sampler_rollout_func
    from otbrl.tasks import char_tokenizer
    from tests.trl_dist_worker import eos_biased_model

    tokenizer = char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    entered = []

    @contextlib.contextmanager
    def autocast():
        entered.append(torch.is_grad_enabled())
        yield

    model = eos_biased_model().train()
    trainer = SimpleNamespace(
        processing_class=tokenizer,
        model=model,
        max_completion_length=5,
        temperature=1.0,
        args=SimpleNamespace(chat_template_kwargs=None),
        accelerator=SimpleNamespace(unwrap_model=lambda m: m, autocast=autocast),
    )
    torch.manual_seed(0)
    out = sampler_rollout_func()([[{"role": "user", "content": "12+3"}], "45+6="], trainer)
    assert entered, "sampling ran outside the trainer's autocast"
    assert out["prompt_ids"] == [tokenizer("12+3=")["input_ids"], tokenizer("45+6=")["input_ids"]]
    for ids, logps, energy in zip(out["completion_ids"], out["logprobs"], out["otb_energy"], strict=True):
        assert 1 <= len(ids) <= 5 and len(logps) == len(ids) == len(energy)
        assert ids[-1] == tokenizer.eos_token_id or len(ids) == 5
        assert all(e >= 0 for e in energy)
    assert model.training  # back in the mode it was in
    torch.manual_seed(0)
    compact = sampler_rollout_func(compact=True)([[{"role": "user", "content": "12+3"}], "45+6="], trainer)
    assert compact["completion_ids"] == out["completion_ids"]  # same draws with ended rows dropped
    for a, b in zip(compact["logprobs"], out["logprobs"], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)
