"""`otbrl train` on a multi-turn task whose tools hold an environment (chat_draws and its episode): a chat
model (a tiny random one here, under a chat template) trains through otbrl's multi-turn rollout, every
training completion and every held-out completion gets its own toolbox from the task's episode, and the
rollout pauses at the task's tool calls."""

from __future__ import annotations

import dataclasses
import json

import pytest

pytest.importorskip("trl")

from otbrl.app.recipe import load_recipe  # noqa: E402
from otbrl.app.train import run  # noqa: E402
from otbrl.tasks import TASKS, char_tokenizer, tiny_model  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }};{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def test_a_chat_model_trains_on_chat_draws_with_an_episode_per_completion(tmp_path, monkeypatch):
    folder = tmp_path / "tiny-chat"
    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tiny_model("tiny", seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)

    task = TASKS["chat_draws"]
    built: list[tuple[int, str]] = []

    def episode(seed: int, prompt: str) -> dict:
        built.append((seed, prompt))
        return task.episode(seed, prompt)

    monkeypatch.setitem(TASKS, "chat_draws", dataclasses.replace(task, episode=episode))
    out = tmp_path / "run"
    recipe = load_recipe(
        "smollm2-draws",
        {
            "model": str(folder),
            "model_fallback": None,
            "max_steps": 1,
            "per_device_train_batch_size": 8,
            "max_completion_length": 24,
            "eval_size": 4,
            "eval_before": True,
            "train_size": 64,
            "save_strategy": "no",
            "report_to": [],
            "plot": False,
            "disable_tqdm": True,
            "output_dir": str(out),
        },
    )
    run(recipe, log=lambda *_: None)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1
    # 4 held-out completions before and after training, 8 training completions: each its own episode
    assert len(built) == 4 + 8 + 4 and len({s for s, _ in built}) == len(built) - 4
    assert built[:4] == built[-4:]  # the held-out evaluation's episodes repeat from its seed
    assert all("draw()" in prompt for _, prompt in built)  # the episode reads the prompt it answers
