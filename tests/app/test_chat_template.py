"""`chat_template_path`: a chat template for a tokenizer that has none (a base model's GGUF file carries
none, e.g. Gemma 3 270M's), or in place of its own. Without one a base model gets no chat prompts, no tool
turns and no warm start; with one it gets all three, and the warm start's key says which template."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("trl")

from otbrl.app.recipe import check_recipe, load_recipe  # noqa: E402
from otbrl.app.sft import sft_key_parts, warm_start_chat  # noqa: E402
from otbrl.app.sources import TEMPLATES, chat_template_text, load_tokenizer, shipped_templates  # noqa: E402
from otbrl.tasks import char_tokenizer, tiny_model  # noqa: E402

TURNS = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


@pytest.fixture
def base_model(tmp_path):
    """A model folder whose tokenizer has no chat template, as a base model's."""
    folder = tmp_path / "base"
    tokenizer = char_tokenizer()
    assert not tokenizer.chat_template
    tiny_model("tiny", seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_template_is_a_jinja_file_or_a_shipped_name(tmp_path) -> None:
    assert "gemma" in shipped_templates()
    assert chat_template_text("gemma") == (TEMPLATES / "gemma.jinja").read_text()
    own = tmp_path / "turns.j2"
    own.write_text(TURNS)
    assert chat_template_text(str(own)) == TURNS
    with pytest.raises(
        ValueError, match=r"'llama' is neither a \.jinja/\.j2 file nor one of otbrl's .*gemma"
    ):
        chat_template_text("llama")
    with pytest.raises(ValueError, match="no such file"):
        chat_template_text(str(tmp_path / "missing.jinja"))
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        chat_template_text(str(tmp_path / "empty.jinja"))


def test_the_gemma_template_writes_gemmas_turns() -> None:
    """user/model turns between <start_of_turn> and <end_of_turn>, the system message opening the first
    user turn (Gemma has no system turn), the generation prompt opening a model turn."""
    tokenizer = char_tokenizer()
    tokenizer.chat_template = chat_template_text("gemma")
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 3+4?"},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "And 2+2?"},
    ]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is 3+4?<end_of_turn>\n"
        "<start_of_turn>model\n7<end_of_turn>\n"
        "<start_of_turn>user\nAnd 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    closed = tokenizer.apply_chat_template(chat[1:3], tokenize=False)
    assert (
        closed
        == "<bos><start_of_turn>user\nWhat is 3+4?<end_of_turn>\n<start_of_turn>model\n7<end_of_turn>\n"
    )


def test_the_recipe_gives_the_tokenizer_its_template_and_checks_it(tmp_path, base_model) -> None:
    assert not load_tokenizer({"model": str(base_model)}).chat_template
    tokenizer = load_tokenizer({"model": str(base_model), "chat_template_path": "gemma"})
    assert tokenizer.chat_template == chat_template_text("gemma")
    recipe = load_recipe("dataset-example", {"model": str(base_model), "chat_template_path": "gemma"})
    assert recipe["chat_template_path"] == "gemma"  # a good one passes
    with pytest.raises(ValueError, match="chat_template_path: 'nope'"):
        load_recipe("dataset-example", {"model": str(base_model), "chat_template_path": "nope"})
    with pytest.raises(ValueError, match="chat_template_path: warm:/random: models"):
        check_recipe({**recipe, "model": "random:tiny"})


def test_a_base_model_warm_starts_with_a_template_and_is_refused_clearly_without(
    tmp_path, base_model
) -> None:
    recipe = {"model": str(base_model), "task": "chat_draws", "max_completion_length": 192}
    with pytest.raises(ValueError, match="sft: the tokenizer of .* has no chat template.*chat_template_path"):
        warm_start_chat(recipe, 1, tmp_path / "none", batch_size=2, log=lambda _: None)
    templated = {**recipe, "chat_template_path": "gemma"}
    final = warm_start_chat(
        templated, 2, tmp_path / "sft", learning_rate=3e-3, batch_size=4, log=lambda _: None
    )
    summary = json.loads((tmp_path / "sft" / "sft-summary.json").read_text())
    assert summary["rows"] == 8 and len(summary["losses"]) == 2
    # the warm start's tokenizer keeps the template, so a run from it renders the same prompts
    saved = load_tokenizer({"model": str(final)})
    assert saved.chat_template == chat_template_text("gemma")


def test_the_warm_start_key_names_the_template_only_when_one_is_given(tmp_path) -> None:
    recipe = {
        "model": "some/model",
        "task": "chat_draws",
        "sft_steps": 2,
        "sft_learning_rate": 2e-5,
        "sft_batch_size": 8,
        "sft_seed": 0,
    }
    plain = sft_key_parts(recipe)
    assert "chat_template" not in plain  # warm starts built before the key existed keep their names
    assert sft_key_parts({**recipe, "chat_template_path": None}) == plain
    own = tmp_path / "turns.jinja"
    own.write_text(TURNS)
    gemma = sft_key_parts({**recipe, "chat_template_path": "gemma"})
    other = sft_key_parts({**recipe, "chat_template_path": str(own)})
    assert gemma["chat_template"] != other["chat_template"]
    assert {k: v for k, v in gemma.items() if k != "chat_template"} == plain
