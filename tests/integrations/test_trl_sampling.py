"""OTBGRPOTrainer gives TRL's numbers where TRL fixes them:

- otbrl's sampler (`sampler_rollout_func`, recipes' `sampler: otbrl`) draws the completions TRL's own
  `generate` draws, from the same seed, with the trainer's top_k, top_p, min_p and repetition_penalty and a
  model that declares two eos ids; a setting it would not apply is refused when the trainer is built;
- a group left with fewer than two scored rows gets zero advantage in every estimator, as TRL's GRPO and
  RLOO give it;
- `advantage_estimator="grpo"` divides by std + 1e-4, TRL's eps, unless the user sets another;
- with `cast_lm_head_to_fp32`, the sampler's head runs in float32, as TRL's.
"""

from __future__ import annotations

import math
import os

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")
pytest.importorskip("otbrl.integrations.trl")

import torch  # noqa: E402
from transformers import GenerationConfig, LogitsProcessorList  # noqa: E402

import otbrl  # noqa: E402
from otbrl.integrations.trl import OTBGRPOTrainer, rollout_func, sampler_rollout_func  # noqa: E402
from otbrl.integrations.trl.rewards import GuardedReward  # noqa: E402
from otbrl.integrations.trl.rollout import sampling_settings  # noqa: E402
from otbrl.tasks.tokenizer import VOCAB  # noqa: E402
from tests.models import half_supported  # noqa: E402
from tests.references import otb_ref, sequence_ref  # noqa: E402
from tests.trl_dist_worker import GROUP, eos_biased_model, make_config, make_trainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
EOS, PAD, SECOND_EOS = VOCAB["<eos>"], VOCAB["<pad>"], VOCAB[";"]
FILTERS = {"top_k": 5, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.3}


class Probe(OTBGRPOTrainer):
    """Records per scoring step TRL's output, TRL's own (B,) advantages (before ours), the gathered
    per-function rewards, and the trainer's (B, T) advantages and energy."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.records: list[dict] = []

    def _local_batch(self, out):  # noqa: ANN001, ANN202
        self.records.append({"trl_advantages": out["advantages"].clone()})
        return super()._local_batch(out)

    def _generate_and_score_completions(self, inputs):  # noqa: ANN001, ANN202
        out = super()._generate_and_score_completions(inputs)
        self.records[-1].update(
            out=out,
            advantages=out["advantages"].clone(),
            energy=self.last_energy.clone(),
            per_func=self._scoring.rewards_per_func.clone(),
        )
        return out


def two_eos_model() -> torch.nn.Module:
    """The eos-biased tiny model that also declares `;` an eos id (as chat models declare an end-of-turn
    token) and samples it often."""
    model = eos_biased_model(eos_bias=0.5)
    model.generation_config.eos_token_id = [EOS, SECOND_EOS]
    with torch.no_grad():
        model.lm_head.bias[SECOND_EOS] = 1.5
    return model


def first_end(ids: list[int]) -> int:
    for t, tok in enumerate(ids):
        if tok in (EOS, SECOND_EOS):
            return t + 1
    return len(ids)


# ----------------------------------------------------------------------------------------------------------
# otbrl's sampler draws what TRL's generate draws
# ----------------------------------------------------------------------------------------------------------


def _one_step(tmp_path, rollout, **overrides) -> tuple[Probe, list[str]]:  # noqa: ANN001
    """One step, learning rate 0, of the two-eos model; returns the trainer and the completions the reward
    function saw."""
    seen: list[str] = []

    def reward(prompts, completions, **kwargs):  # noqa: ANN001, ANN202
        seen.extend(completions)
        return [len(c) / 10 for c in completions]

    args = make_config(
        tmp_path,
        max_steps=1,
        per_device_train_batch_size=16,
        max_completion_length=10,
        learning_rate=0.0,
        **overrides,
    )
    kwargs = {} if rollout is None else {"rollout_func": rollout}
    trainer = make_trainer(
        args, reward_funcs=reward, model=two_eos_model(), cls=Probe, n_prompts=16, **kwargs
    )
    trainer.train()
    return trainer, seen


@pytest.mark.parametrize("settings", ["defaults", "filters"])
def test_sampler_draws_trls_completions_and_ends_them_at_the_first_eos(tmp_path, settings):
    """From the same seed, sampler_rollout_func gives exactly the completions TRL's own generate gives
    (prompt ids, completion ids and masks), with the trainer's filters too. Every completion ends at the
    first of the two eos ids, its reward saw its text up to there, and TRL counts it as finished."""
    overrides = FILTERS if settings == "filters" else {}
    ours, texts = _one_step(tmp_path / "ours", sampler_rollout_func(), **overrides)
    trls, trl_texts = _one_step(tmp_path / "trl", None, **overrides)
    (mine,), (theirs,) = ours.records, trls.records
    for key in ("prompt_ids", "completion_ids", "completion_mask"):
        assert torch.equal(mine["out"][key], theirs["out"][key]), key
    assert texts == trl_texts
    second = 0
    for i, (row, keep) in enumerate(
        zip(mine["out"]["completion_ids"].tolist(), mine["out"]["completion_mask"].tolist(), strict=True)
    ):
        n = first_end(row)
        assert sum(keep) == n and all(keep[:n])
        assert texts[i] == ours.processing_class.decode(row[:n], skip_special_tokens=True)
        second += row[n - 1] == SECOND_EOS
    assert second >= 4, "the model's second eos id should end several completions"
    logged = [
        h["completions/clipped_ratio"] for h in ours.state.log_history if "completions/clipped_ratio" in h
    ]
    lengths = mine["out"]["completion_mask"].sum(dim=1)
    ended = [
        row[int(n) - 1] in (EOS, SECOND_EOS)
        for row, n in zip(mine["out"]["completion_ids"].tolist(), lengths.tolist(), strict=True)
    ]
    assert logged == [pytest.approx(1 - sum(ended) / len(ended))]  # TRL's truncation flag: not at an eos


def test_tool_rollout_ends_at_every_eos_id(tmp_path):
    """The multi-turn rollout_func stops at the model's second eos id too."""
    trainer, _ = _one_step(tmp_path, rollout_func(("calc",), max_turns=1, workers=1))
    (record,) = trainer.records
    for row, keep in zip(
        record["out"]["completion_ids"].tolist(), record["out"]["completion_mask"].tolist(), strict=True
    ):
        assert sum(keep) == first_end(row)
    assert any(SECOND_EOS in row for row in record["out"]["completion_ids"].tolist())


def _generates_processors(trainer: OTBGRPOTrainer) -> LogitsProcessorList:
    """The processors transformers' `generate` builds from TRL's own generation config for this trainer,
    merged with the model's generation config (transformers' private builders)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    config, _ = model._prepare_generation_config(GenerationConfig(**trainer.generation_kwargs))
    model._prepare_special_tokens(config, device=model.device)
    ids, mask = torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
    return model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=3,
        encoder_input_ids=ids,
        prefix_allowed_tokens_fn=None,
        logits_processor=LogitsProcessorList(),
        device=model.device,
        model_kwargs={"attention_mask": mask},
    )


@pytest.mark.parametrize(
    "config, declared",
    [
        ({}, {"min_p": 0.2}),  # TRL leaves min_p at None: generate takes the model's
        (
            {"top_k": 4, "generation_kwargs": {"top_p": 0.7, "no_repeat_ngram_size": 0}},
            {"no_repeat_ngram_size": 3},
        ),
        ({"top_k": None, "repetition_penalty": 1.2, "temperature": 0.7}, {}),  # top_k None: generate's 50
    ],
)
def test_sampling_settings_are_the_ones_generate_would_apply(tmp_path, config, declared):
    model = two_eos_model()
    for key, value in declared.items():
        setattr(model.generation_config, key, value)
    args = make_config(tmp_path, **config)
    trainer = make_trainer(args, model=model, n_prompts=8, rollout_func=sampler_rollout_func())
    settings = sampling_settings(trainer)
    ours = settings.processors(trainer.temperature, torch.ones(2, 3, dtype=torch.long))
    theirs = _generates_processors(trainer)
    assert [type(p) for p in ours] == [type(p) for p in theirs]
    for a, b in zip(ours, theirs, strict=True):
        for key in ("penalty", "temperature", "top_k", "top_p", "min_p"):
            assert getattr(a, key, None) == getattr(b, key, None), key


@pytest.mark.parametrize(
    "config, declared, named",
    [
        ({"generation_kwargs": {"no_repeat_ngram_size": 2}}, {}, "no_repeat_ngram_size"),
        ({"generation_kwargs": {"typical_p": 0.5}}, {}, "typical_p"),
        ({"generation_kwargs": {"temperature": 0.5}}, {}, "temperature"),
        ({"generation_kwargs": {"stop": ["x"]}}, {}, "stop"),
        ({"generation_kwargs": {"num_beams": 2}}, {}, "num_beams"),
        ({}, {"no_repeat_ngram_size": 3}, "no_repeat_ngram_size"),
        ({}, {"suppress_tokens": [5]}, "suppress_tokens"),
    ],
)
@pytest.mark.parametrize("rollout", ["single", "tools"])
def test_a_setting_the_sampler_would_not_apply_is_refused_at_start_up(
    tmp_path, config, declared, named, rollout
):
    model = two_eos_model()
    for key, value in declared.items():
        setattr(model.generation_config, key, value)
    func = sampler_rollout_func() if rollout == "single" else rollout_func(("calc",))
    with pytest.raises(ValueError, match=rf"{named}.*`sampler: trl`"):
        make_trainer(make_config(tmp_path, **config), model=model, n_prompts=8, rollout_func=func)
    make_trainer(make_config(tmp_path, **config), model=model, n_prompts=8)  # TRL's own generation: fine


# ----------------------------------------------------------------------------------------------------------
# groups with fewer than two scored rows
# ----------------------------------------------------------------------------------------------------------

FAILS = [0, 1, 2, 3]  # failed rows in groups 0, 1, 2, 3 of 4 (16 rows)


def patterned_reward(kind: str):  # noqa: ANN201
    """Fails (NaN, which GuardedReward leaves unscored) or is not applicable (None) on the first k rows
    of group g, k = FAILS[g]; the other rows get rewards that depend on their place only, so that TRL's
    RLOOTrainer sees the same ones."""

    def reward(prompts, completions, **kwargs):  # noqa: ANN001, ANN202
        out = []
        for i in range(len(completions)):
            group, place = divmod(i, GROUP)
            missing = math.nan if kind == "nan" else None
            out.append(
                missing if place < FAILS[group % 4] else 0.3 * place + 0.1 * group + 0.05 * (place == 3)
            )
        return out

    return GuardedReward(reward, max_failure_fraction=1.0)


def _failing_run(tmp_path, estimator: str, kind: str = "nan", **overrides) -> dict:  # noqa: ANN001
    args = make_config(
        tmp_path, max_steps=1, per_device_train_batch_size=16, advantage_estimator=estimator, **overrides
    )
    trainer = make_trainer(args, reward_funcs=patterned_reward(kind), cls=Probe, n_prompts=16)
    trainer.train()
    (record,) = trainer.records
    return record


def _scored(per_func: torch.Tensor) -> torch.Tensor:
    return ~torch.isnan(per_func[:, 0])


@pytest.mark.parametrize("kind", ["nan", "none"])
@pytest.mark.parametrize("estimator, scale", [("grpo", "group"), ("dr_grpo", "none")])
def test_lone_scored_row_gets_trls_zero_in_grpo(tmp_path, estimator, scale, kind):
    """Groups with 0, 1, 2, 3 failed rows of 4: grpo (TRL's eps by default) and dr_grpo equal TRL's own
    GRPO advantages (scale_rewards "group" and "none") on every row: the lone survivor of 3 failures
    gets 0, not its raw reward. The rows stay in TRL's loss mask."""
    record = _failing_run(tmp_path, estimator, kind, scale_rewards=scale)
    out, scored = record["out"], _scored(record["per_func"])
    assert scored.tolist() == [place >= FAILS[g] for g in range(4) for place in range(GROUP)]
    mask = out["completion_mask"].double()
    assert (mask.sum(dim=1) > 0).all()  # failed and lone rows stay in TRL's loss mask, as TRL keeps them
    expected = record["trl_advantages"].double()[:, None] * mask
    torch.testing.assert_close(record["advantages"].double(), expected, rtol=1e-5, atol=1e-6)
    lone = 3 * GROUP + 3  # group 3: three failures
    assert record["trl_advantages"][lone] == 0 and (record["advantages"][lone] == 0).all()
    assert (record["advantages"][GROUP + 1 :].abs().sum(dim=1) > 0).sum() >= 5  # the others train


def test_lone_scored_row_gets_trls_zero_in_rloo(tmp_path):
    """rloo equals TRL's own RLOOTrainer on the same rewards: groups of 4, 3 and 2 scored rows get the
    leave-one-out advantage over the scored ones, the lone survivor 0."""
    from trl import RLOOConfig, RLOOTrainer

    record = _failing_run(tmp_path / "otb", "rloo")

    class RLOOProbe(RLOOTrainer):
        def _generate_and_score_completions(self, inputs):  # noqa: ANN001, ANN202
            out = super()._generate_and_score_completions(inputs)
            self.advantages = out["advantages"].clone()
            return out

    base = make_config(tmp_path / "trl", max_steps=1, per_device_train_batch_size=16)
    keys = (
        "output_dir",
        "use_cpu",
        "bf16",
        "gradient_checkpointing",
        "report_to",
        "save_strategy",
        "max_steps",
        "per_device_train_batch_size",
        "num_generations",
        "max_completion_length",
        "seed",
        "disable_tqdm",
    )
    args = RLOOConfig(**{k: getattr(base, k) for k in keys}, beta=0.0, learning_rate=0.0)
    trl = make_trainer(args, reward_funcs=patterned_reward("nan"), cls=RLOOProbe, n_prompts=16)
    trl.train()
    mask = record["out"]["completion_mask"].double()
    torch.testing.assert_close(record["advantages"].double(), trl.advantages.double()[:, None] * mask)
    assert trl.advantages[3 * GROUP + 3] == 0


@pytest.mark.parametrize("estimator", ["opo", "sob", "reinforce_pp_baseline", "otb"])
def test_lone_scored_row_gets_zero_in_every_estimator(tmp_path, estimator):
    """Every other estimator: zero on failed rows and on the lone survivor; on the other rows, its float64
    reference over the groups with at least two scored rows."""
    record = _failing_run(tmp_path, estimator)
    per_func, mask = record["per_func"], record["out"]["completion_mask"].double()
    scored = _scored(per_func)
    groups = torch.arange(scored.numel()) // GROUP
    counts = torch.bincount(groups, weights=scored.double())
    members = scored & (counts[groups] >= 2)
    assert not members[3 * GROUP + 3] and members[2 * GROUP + 3]
    rewards = torch.nan_to_num(per_func[:, 0].double(), nan=0.0)
    energy = record["energy"].double()
    keep = mask * members[:, None]
    if estimator == "otb":
        expected, _ = otb_ref(rewards, keep, groups, energy)
    else:
        expected = sequence_ref(estimator, rewards, keep, groups, energy, eps=1e-8)
    torch.testing.assert_close(record["advantages"].double(), expected, rtol=1e-5, atol=1e-5)
    assert (record["advantages"][~members] == 0).all()
    assert (record["advantages"][members].abs().sum(dim=1) > 0).all()


def test_core_estimators_keep_their_own_rule_for_a_group_of_one():
    """The core is unchanged: a group of one member has no baseline, A = R (documented); the adapter
    decides TRL's zero."""
    adv = otbrl.compute_advantages(
        "rloo", rewards=torch.tensor([1.0, 2.0]), mask=torch.ones(2, 3), group_ids=torch.tensor([0, 1])
    ).advantages
    assert adv[:, 0].tolist() == [1.0, 2.0]


# ----------------------------------------------------------------------------------------------------------
# grpo's eps: TRL's
# ----------------------------------------------------------------------------------------------------------


def _near_tie(prompts, completions, **kwargs):  # noqa: ANN001, ANN202
    return [1.0 + 1e-5 if i % GROUP == 3 else 1.0 for i in range(len(completions))]


@pytest.mark.parametrize("options, expected", [(None, 0.0715), ({"eps": 1e-6}, 1.25)])
def test_grpo_defaults_to_trls_eps(tmp_path, options, expected):
    """Rewards [1, 1, 1, 1 + 1e-5] in every group: through the adapter grpo gives TRL's own number,
    (R - mean) / (std + 1e-4) = 0.0715 on the odd row (TRL's advantages, compared directly); the core's
    eps 1e-6, set by hand, gives 1.25."""
    args = make_config(
        tmp_path,
        max_steps=1,
        per_device_train_batch_size=8,
        advantage_estimator="grpo",
        estimator_options=options,
    )
    trainer = make_trainer(args, reward_funcs=_near_tie, cls=Probe, n_prompts=8)
    trainer.train()
    (record,) = trainer.records
    ours = record["advantages"][3::GROUP, 0]
    assert ours.tolist() == pytest.approx([expected, expected], rel=2e-3)
    if options is None:
        torch.testing.assert_close(ours, record["trl_advantages"][3::GROUP], rtol=1e-5, atol=1e-7)
    else:
        assert float(record["trl_advantages"][3]) == pytest.approx(0.0715, rel=2e-3)


# ----------------------------------------------------------------------------------------------------------
# cast_lm_head_to_fp32: the sampler's head in float32
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not half_supported(torch.bfloat16), reason="no bf16 autocast on this CPU")
@pytest.mark.parametrize("cast", [True, False])
def test_sampler_head_precision_follows_cast_lm_head_to_fp32(tmp_path, cast):
    """bf16 training (autocast over float32 weights): the sampler's head output is float32 with
    cast_lm_head_to_fp32, as TRL's head, and bf16 without."""
    model = two_eos_model()
    dtypes: list[torch.dtype] = []
    inner = sampler_rollout_func()

    def rollout(prompts, trainer):  # noqa: ANN001, ANN202
        hook = trainer.accelerator.unwrap_model(trainer.model).lm_head.register_forward_hook(
            lambda m, a, out: dtypes.append(out.dtype)
        )
        try:
            return inner(prompts, trainer)
        finally:
            hook.remove()

    args = make_config(tmp_path, max_steps=1, bf16=True, cast_lm_head_to_fp32=cast, learning_rate=0.0)
    trainer = make_trainer(args, model=model, n_prompts=8, rollout_func=rollout)
    trainer.train()
    assert dtypes and set(dtypes) == {torch.float32 if cast else torch.bfloat16}


def test_tool_rollout_with_an_episode_gives_each_completion_its_own_seeded_toolbox(tmp_path):
    """rollout_func(episode): one fresh toolbox per completion, built from the completion's prompt and a
    seed of (run seed, step, rollout within the step, process, row): distinct within a step and the same
    when the run is repeated."""
    from otbrl.integrations.trl.rollout import prompt_text

    def run(where) -> list[tuple[int, str]]:  # noqa: ANN001
        built: list[tuple[int, str]] = []

        def episode(seed: int, prompt: str) -> dict:
            built.append((seed, prompt))
            return {"calc": lambda arguments: "1"}

        _, seen = _one_step(where, rollout_func(episode, max_turns=1, workers=1))
        assert len(seen) == len(built)  # one toolbox per completion
        return built

    first = run(tmp_path / "a")
    assert len({seed for seed, _ in first}) == len(first) == 16
    assert all(isinstance(p, str) and p for _, p in first)
    assert run(tmp_path / "b") == first
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Start with 3."}]
    assert prompt_text(chat) == "Be brief.\n\nStart with 3." and prompt_text("1+1=") == "1+1="
