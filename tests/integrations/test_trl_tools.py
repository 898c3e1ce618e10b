"""OTB through TRL's own tool calling: GRPOTrainer's `tools=` and `environment_factory=` (TRL generates,
parses the tool calls with its response template, runs the tools and marks their output with
`tool_mask`). A tiny Qwen2 under Qwen2.5's chat template writes tool calls (its head favours a token that
spells a whole call, and `<|im_end|>`), so groups mix rows with and without tool output. Checked on the
real rollout: tool-result tokens carry no energy and no advantage, W_t sums the model's tokens only, and
the advantages equal a float64 reference (the energy from the model's own full-context logits, tool
output in context; OTB aligned by generated token).
"""

from __future__ import annotations

import os
import string

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")
pytest.importorskip("otbrl.integrations.trl")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

from otbrl.integrations.trl import OTBGRPOTrainer  # noqa: E402
from tests.references import otb_ref, reference_energy  # noqa: E402
from tests.trl_dist_worker import make_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
GROUP, TEMPERATURE = 4, 0.9
CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'


def chat_tokenizer():  # noqa: ANN201
    """One token per printable character, Qwen2.5's special tokens and tool markers, Qwen2.5's chat
    template (TRL adds its response template), and one token that spells a whole tool call."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen2_5_chat_template

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {t: i for i, t in enumerate([*specials, *sorted(set(string.printable))])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    markers = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", CALL]
    tokenizer.add_tokens([AddedToken(m, special=False, normalized=False) for m in markers])
    tokenizer.chat_template = qwen2_5_chat_template
    return tokenizer


def calling_model(tokenizer, seed: int = 0) -> torch.nn.Module:  # noqa: ANN001
    """A tiny Qwen2 whose head (with a bias) favours the tool-call token and `<|im_end|>`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    head = torch.nn.Linear(32, len(tokenizer), bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight * 20)  # logits that depend on the context
        head.bias.zero_()
        head.bias[tokenizer.convert_tokens_to_ids(CALL)] = 6.0
        head.bias[tokenizer.eos_token_id] = 5.0
    model.lm_head = head
    return model


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


class Calculator:
    """An environment: its public methods are the tools; it owns a reward (the calls it served)."""

    def __init__(self) -> None:
        self.calls = 0

    def reset(self, **kwargs) -> None:  # noqa: ANN003
        self.calls = 0

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a * b

    def get_reward(self) -> float:
        return 0.25 * self.calls


def tool_reward(prompts, completions, **kwargs):  # noqa: ANN001, ANN003, ANN201
    """Tool results seen, and a little for the final answer's length: rows of a group differ."""
    out = []
    for messages in completions:
        tools = sum(m["role"] == "tool" for m in messages)
        out.append(0.5 * tools + 0.05 * len(messages[-1].get("content") or ""))
    return out


class Probe(OTBGRPOTrainer):
    """Records each scoring step's rollout, rewards, energy and advantages, and the float64 reference
    energy of the same rollout from the model's own full-context logits, before the update."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.records: list[dict] = []

    def _generate_and_score_completions(self, inputs):  # noqa: ANN001, ANN202
        out = super()._generate_and_score_completions(inputs)
        model = self.accelerator.unwrap_model(self.model)
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)  # tool output visible
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attention).logits
        n, width = out["completion_ids"].shape[1], ids.shape[1]
        reference = reference_energy(
            logits[:, width - n - 1 : width - 1], out["completion_ids"], self.temperature
        )
        rewards = (self._scoring.rewards_per_func * self.reward_weights[None, :]).nansum(dim=1)
        self.records.append(
            {
                "out": out,
                "rewards": rewards.double(),
                "energy": self.last_energy.clone(),
                "advantages": out["advantages"].clone(),
                "reference": reference,
                "source": self.energy_source,
            }
        )
        return out


def _train(tmp_path, num_iterations: int, **kwargs) -> Probe:  # noqa: ANN001, ANN003
    tokenizer = chat_tokenizer()
    rows = [{"prompt": [{"role": "user", "content": f"What is 3 times {4 + i}?"}]} for i in range(4)]
    args = make_config(
        tmp_path,
        max_steps=1,
        per_device_train_batch_size=16,
        num_generations=GROUP,
        max_completion_length=64,
        temperature=TEMPERATURE,
        advantage_estimator="otb",
        num_iterations=num_iterations,
        max_tool_calling_iterations=2,
        learning_rate=1e-3,
    )
    trainer = Probe(
        model=calling_model(tokenizer),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        **kwargs,
    )
    trainer.train()
    return trainer


def _check(trainer: Probe, source: str) -> None:
    (record,) = trainer.records
    out = record["out"]
    tool = (out["tool_mask"] == 0) & out["completion_mask"].bool()
    policy = (out["tool_mask"] * out["completion_mask"]).bool()
    groups = torch.arange(policy.shape[0]) // GROUP
    called = tool.any(dim=1)
    assert record["source"] == source
    assert called.sum() >= 3 and (~called).sum() >= 3, "groups should mix rows with and without tool output"
    assert any(called[groups == g].any() and (~called[groups == g]).any() for g in range(4))
    energy, advantages = record["energy"].double(), record["advantages"].double()
    assert (energy[tool] == 0).all() and (energy[policy] > 0).all()
    assert (advantages[tool] == 0).all()
    reference = record["reference"] * policy
    torch.testing.assert_close(energy, reference, rtol=1e-4, atol=1e-6)
    expected, _ = otb_ref(record["rewards"], policy.double(), groups, reference, align="generated")
    torch.testing.assert_close(advantages, expected, rtol=1e-4, atol=1e-5)
    # W_t sums the model's tokens only: counting the tool tokens' energy too (each tool output's energy
    # carried onto the next model token, which is where a W_t over every token would take it in) differs.
    with_tools = record["reference"] * out["completion_mask"]
    shifted = with_tools.clone()
    for i in range(policy.shape[0]):  # move each tool output's energy onto the next model token
        carry = 0.0
        for t in range(policy.shape[1]):
            if tool[i, t]:
                carry += float(with_tools[i, t])
            elif policy[i, t]:
                shifted[i, t] = with_tools[i, t] + carry
                carry = 0.0
    wrong, _ = otb_ref(record["rewards"], policy.double(), groups, shifted * policy, align="generated")
    assert not torch.allclose(advantages, wrong, rtol=1e-4, atol=1e-5)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 1 and torch.isfinite(torch.tensor(losses)).all()


@pytest.mark.parametrize("num_iterations, source", [(1, "forward"), (2, "old_logps")])
def test_otb_trains_through_trls_tools(tmp_path, num_iterations, source):
    trainer = _train(tmp_path, num_iterations, reward_funcs=tool_reward, tools=[multiply])
    _check(trainer, source)


def test_otb_trains_through_trls_environment_factory(tmp_path):
    """The environment's method is the tool; its get_reward is a second reward column, next to ours."""
    trainer = _train(tmp_path, 1, reward_funcs=tool_reward, environment_factory=Calculator)
    assert trainer.reward_func_names[-1] == "Calculator"
    _check(trainer, "forward")
