"""Who counts in a group inside OTBGRPOTrainer, and what TRL's loss reads per sequence.

- mask_truncated_completions=True: TRL keeps a truncated completion out of the loss but in its group's
  statistics; so does the trainer (it used to drop such rows from their groups). grpo equals TRL's own
  advantages, every estimator its float64 loop reference, on the same sampled batch.
- A reward function that fails on a row leaves that row unscored: no group, no loss.
- OPSM and VESPO decide per sequence by the advantage's sign: they receive each sequence's mean advantage.
References are float64 loops (tests/references.py, written independently of otbrl).
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")
pytest.importorskip("otbrl.integrations.trl")

import torch  # noqa: E402

import otbrl  # noqa: E402
from otbrl.integrations.trl import OTBGRPOTrainer  # noqa: E402
from otbrl.integrations.trl.rewards import GuardedReward  # noqa: E402
from otbrl.integrations.trl.trainer import sequence_advantages  # noqa: E402
from tests.references import otb_ref, reference_energy, sequence_ref  # noqa: E402
from tests.trl_dist_worker import GROUP, answer_reward, make_config, make_trainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
ESTIMATORS = ["grpo", "dr_grpo", "rloo", "opo", "sob", "reinforce_pp_baseline", "otb"]
EOS, PAD = 2, 0  # the character tokenizer's <eos> and <pad>


class Probe(OTBGRPOTrainer):
    """Records, per scoring step, TRL's output (its own (B,) advantages too), the per-function rewards
    and the trainer's (B, T) advantages and energy."""

    records: list[dict]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.records = []

    def _local_batch(self, out):  # noqa: ANN001, ANN202
        self.records.append({"trl_advantages": out["advantages"].clone()})  # TRL's own, before ours
        return super()._local_batch(out)

    def _generate_and_score_completions(self, inputs):  # noqa: ANN001, ANN202
        out = super()._generate_and_score_completions(inputs)
        self.records[-1].update(
            out=out,
            advantages=out["advantages"].clone(),
            energy=self.last_energy.clone(),
            per_func=self._rewards_per_func_seen,
        )
        return out

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):  # noqa: ANN001, ANN202
        seen = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rewards_per_func_seen = seen
        return seen


def sampled_rows(completion_ids: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) policy tokens as sampled (through the first <eos>, or every token of a completion that
    never ended) and (B,) truncated, read from the ids alone: TRL's rule, the last sampled token is
    neither <eos> nor <pad> (the model may sample <pad>)."""
    rows = completion_ids.shape[0]
    members = torch.zeros(rows, width, dtype=torch.float64)
    truncated = torch.zeros(rows, dtype=torch.bool)
    for i in range(rows):
        ids = completion_ids[i].tolist()
        end = ids.index(EOS) + 1 if EOS in ids else len(ids)
        truncated[i] = ids[end - 1] not in (EOS, PAD)
        members[i, :end] = 1.0
    return members, truncated


def _truncating_run(tmp_path, estimator: str, **overrides) -> Probe:  # noqa: ANN001
    """One step, max length 5: the eos-biased tiny model finishes some completions and runs out on others."""
    options = {"eps": 1e-4} if estimator == "grpo" else {}  # TRL's grpo divides by std + 1e-4
    args = make_config(
        tmp_path,
        max_steps=1,
        max_completion_length=5,
        mask_truncated_completions=True,
        advantage_estimator=estimator,
        estimator_options=options,
        per_device_train_batch_size=16,
        **overrides,
    )
    trainer = make_trainer(args, cls=Probe, n_prompts=16)
    trainer.train()
    return trainer


def test_truncated_rows_stay_in_their_groups_as_in_trls_grpo(tmp_path):
    """grpo with mask_truncated_completions equals TRL's own grpo advantages on every row TRL trains;
    a truncated row's tokens get none (TRL's loss reads none of them)."""
    (record,) = _truncating_run(tmp_path, "grpo").records
    out = record["out"]
    members, truncated = sampled_rows(out["completion_ids"], out["completion_mask"].shape[1])
    assert truncated.any() and (~truncated).any()
    groups = torch.arange(truncated.numel()) // GROUP
    assert any(truncated[groups == g].any() and (~truncated[groups == g]).any() for g in range(4))
    assert (out["completion_mask"][truncated] == 0).all()  # TRL keeps them out of the loss
    trl = record["trl_advantages"].double()
    expected = trl[:, None] * members * (~truncated)[:, None]
    torch.testing.assert_close(record["advantages"].double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_estimator_keeps_truncated_rows_as_members(tmp_path, estimator):
    """Each estimator's advantages equal its float64 reference over the batch as sampled (truncated rows
    are members with their rewards), zeroed on the truncated rows' tokens."""
    (record,) = _truncating_run(tmp_path, estimator).records
    out = record["out"]
    members, truncated = sampled_rows(out["completion_ids"], out["completion_mask"].shape[1])
    assert truncated.any() and (~truncated).any()
    rewards = record["per_func"].double().sum(dim=1)
    groups = torch.arange(rewards.numel()) // GROUP
    energy = record["energy"].double()
    if otbrl.ESTIMATORS[estimator].needs_energy:
        assert (energy[members.bool()] > 0).all()  # truncated rows' energy too
    if estimator == "otb":
        expected, _ = otb_ref(rewards, members, groups, energy)
    else:
        eps = 1e-4 if estimator == "grpo" else 1e-8
        expected = sequence_ref(estimator, rewards, members, groups, energy, eps=eps)
    # reinforce_pp_baseline whitens over every member token, truncated ones included, as its reference
    expected = expected * (~truncated)[:, None]
    torch.testing.assert_close(record["advantages"].double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_truncated_rows_energy_is_scored_with_their_completion_visible(tmp_path, num_iterations):
    """TRL scores a truncated completion with its completion hidden from attention (its old-log-prob pass,
    num_iterations=2); the energy of such a row, which enters its peers' OTB baselines, must be that of
    the completion as sampled: the float64 energy from the model's own logits, completion visible.
    Learning rate 0: the model after the step is the one that scored it."""
    trainer = _truncating_run(tmp_path, "otb", num_iterations=num_iterations, learning_rate=0.0)
    (record,) = trainer.records
    out = record["out"]
    members, truncated = sampled_rows(out["completion_ids"], out["completion_mask"].shape[1])
    assert truncated.any()
    assert trainer.energy_source == ("old_logps" if num_iterations == 2 else "forward")
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    attention = torch.cat([out["prompt_mask"], members.long()], dim=1)
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits
    n, width = out["completion_ids"].shape[1], ids.shape[1]
    reference = reference_energy(logits[:, width - n - 1 : width - 1], out["completion_ids"], 1.0) * members
    torch.testing.assert_close(record["energy"].double(), reference, rtol=1e-3, atol=1e-5)


def test_failed_reward_leaves_its_row_unscored(tmp_path):
    """A row whose reward failed (an exception, or NaN) is in no group: zero advantages, and its peers'
    baselines leave it out; the failures are counted as before."""

    def flaky(prompts, completions, answer, **kwargs):  # noqa: ANN001, ANN201
        scores = answer_reward(prompts, completions, answer)
        return [math.nan if len(c) % 3 == 1 else 1.0 + s for c, s in zip(completions, scores, strict=True)]

    reward = GuardedReward(flaky, max_failure_fraction=1.0)
    args = make_config(tmp_path, max_steps=1, advantage_estimator="dr_grpo", per_device_train_batch_size=16)
    trainer = make_trainer(args, reward_funcs=reward, cls=Probe, n_prompts=16)
    trainer.train()
    (record,) = trainer.records
    per_func, mask = record["per_func"], record["out"]["completion_mask"].double()
    failed = torch.isnan(per_func[:, 0])
    assert failed.any() and (~failed).any() and reward.failures == int(failed.sum())
    groups = torch.arange(failed.numel()) // GROUP
    rewards = torch.nan_to_num(per_func[:, 0].double(), nan=123.0)  # whatever: never read
    expected = sequence_ref("dr_grpo", rewards, mask * (~failed)[:, None], groups)
    torch.testing.assert_close(record["advantages"].double(), expected, rtol=1e-5, atol=1e-6)
    assert (record["advantages"][failed] == 0).all()


def test_a_failure_in_one_function_unscores_the_row_whatever_the_others_say(tmp_path):
    """With two functions, a row where one fails is unscored even though the other scored it (a
    function returning None, TRL's "not applicable", leaves the row to the others)."""

    def raises(prompts, completions, **kwargs):  # noqa: ANN001, ANN201
        if any(len(c) % 3 == 1 for c in completions):
            raise ValueError("cannot score")
        return [1.0] * len(completions)

    def length(prompts, completions, **kwargs):  # noqa: ANN001, ANN201
        return [len(c) / 8 for c in completions]

    funcs = [GuardedReward(raises, max_failure_fraction=1.0), length]
    args = make_config(tmp_path, max_steps=1, advantage_estimator="rloo", per_device_train_batch_size=16)
    trainer = make_trainer(args, reward_funcs=funcs, cls=Probe, n_prompts=16)
    trainer.train()
    (record,) = trainer.records
    per_func, mask = record["per_func"], record["out"]["completion_mask"].double()
    failed = torch.isnan(per_func[:, 0])
    assert failed.any() and not torch.isnan(per_func[:, 1]).any()
    rewards = torch.nan_to_num(per_func.double(), nan=0.0).sum(dim=1)
    groups = torch.arange(failed.numel()) // GROUP
    expected = sequence_ref("rloo", rewards, mask * (~failed)[:, None], groups)
    torch.testing.assert_close(record["advantages"].double(), expected, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# OPSM and VESPO read one advantage per sequence
# ----------------------------------------------------------------------------------------------------------


def _mixed_signs() -> tuple[torch.Tensor, torch.Tensor]:
    """(4, 5) advantages whose sign changes along rows 0 and 2, with padding; row 3 has no token."""
    adv = torch.tensor(
        [
            [0.5, -0.2, -0.1, 0.0, 0.0],  # mean +0.067
            [-0.3, -0.3, -0.3, -0.3, -0.3],  # constant: a sequence-level estimator's row
            [-0.9, 0.1, 0.2, 0.0, 0.0],  # mean -0.2
            [0.0, 0.0, 0.0, 0.0, 0.0],
        ]
    )
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    return adv, mask


def test_sequence_advantages_is_the_mean_over_policy_tokens():
    adv, mask = _mixed_signs()
    got = sequence_advantages(adv, mask)
    expected = []
    for i in range(adv.shape[0]):
        tokens = [float(adv[i, t]) for t in range(adv.shape[1]) if mask[i, t]]
        expected.append(sum(tokens) / len(tokens) if tokens else 0.0)
    assert got.shape == (4, 1)
    torch.testing.assert_close(got[:, 0].double(), torch.tensor(expected, dtype=torch.float64))
    assert sequence_advantages(adv[:, :1], mask) is not None  # (B, 1) passes through


def test_opsm_keeps_or_drops_whole_sequences_by_the_sequence_advantage():
    """TRL's OPSM keeps a sequence if its advantage >= 0 or its mean KL is low. With (B, T) advantages TRL
    would decide per token (row 0 partly dropped); the trainer decides per sequence, on its mean."""
    from trl import GRPOTrainer

    adv, mask = _mixed_signs()
    mask = mask.float()
    logps = torch.zeros(4, 5)
    sampling = torch.full((4, 5), 1.0)  # KL 1 everywhere: only the sign decides
    kw = dict(per_token_logps=logps, sampling_per_token_logps=sampling, mask=mask, off_policy_threshold=0.5)
    per_token = GRPOTrainer.get_off_policy_mask(advantages=adv, **kw)
    assert per_token.shape == (4, 5) and per_token[0, 0] == 1 and per_token[0, 1] == 0  # what TRL does
    got = OTBGRPOTrainer.get_off_policy_mask(advantages=adv, **kw)
    assert got.shape == (4, 1)
    assert got[:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]  # mean >= 0 kept; row 3 (no token): mean 0, kept


def test_vespo_picks_k_and_lambda_by_the_sequence_advantage():
    from trl import GRPOTrainer

    adv, mask = _mixed_signs()
    mask = mask.float()
    log_ratio = torch.full((4, 5), 0.1)
    kw = dict(log_ratio_per_token=log_ratio, mask=mask, importance_sampling_ratio=None)
    got = OTBGRPOTrainer.get_gamma_weights(advantages=adv, **kw)
    expected = GRPOTrainer.get_gamma_weights(advantages=sequence_advantages(adv, mask), **kw)
    assert got.shape == (4, 1)
    torch.testing.assert_close(got, expected)
    per_token = GRPOTrainer.get_gamma_weights(advantages=adv, **kw)
    assert per_token.shape == (4, 5) and not torch.allclose(per_token[0], per_token[0, :1])


@pytest.mark.parametrize(
    "options", [{"off_policy_mask_threshold": 0.1, "num_iterations": 2}, {"loss_type": "vespo"}]
)
def test_opsm_and_vespo_train_with_token_advantages(tmp_path, options):
    trainer = make_trainer(make_config(tmp_path, max_steps=2, **options))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
