"""Hub model ids and Hub dataset names through the real loaders, offline: a Hugging Face cache written
here (the layout a download leaves) holds a tiny chat model and a tiny math dataset; `otbrl train`
runs under HF_HUB_OFFLINE=1 on them, and names missing from the cache fail in one line that says what
could not be fetched and how to use a local copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("otbrl.integrations.trl")

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the snapshot a download of `main` would leave
# A chat template over the character tokenizer's alphabet (the tiny model has no special chat tokens).
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }};{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def write_hub_cache(home: Path) -> None:
    """$HF_HOME with model tiny-org/tiny-chat (hub/models--ORG--NAME/snapshots/<commit>, refs/main) and
    dataset tiny-org/tiny-math prepared as `datasets` caches a Hub dataset
    (datasets/ORG___NAME/<config>/<version>/<hash>/ with dataset_info.json and NAME-<split>.arrow)."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    from otbrl.tasks import char_tokenizer, tiny_model

    repo = home / "hub" / "models--tiny-org--tiny-chat"
    snapshot = repo / "snapshots" / COMMIT
    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tiny_model("tiny", seed=0).save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)

    rows = [{"question": f"{i}+{i}=", "answer": f"{i}+{i} is {2 * i}. #### {2 * i}"} for i in range(24)]
    data = datasets.Dataset.from_list(rows)
    prepared = home / "datasets" / "tiny-org___tiny-math" / "default" / "0.0.0" / ("0" * 16)
    prepared.mkdir(parents=True)
    with ArrowWriter(path=str(prepared / "tiny-math-train.arrow")) as writer:
        writer.write_table(data.data.table)
        writer.finalize()
    split = datasets.SplitInfo("train", num_examples=len(rows), dataset_name="tiny-math")
    datasets.DatasetInfo(
        dataset_name="tiny-math",
        config_name="default",
        features=data.features,
        splits=datasets.SplitDict({"train": split}),
    ).write_to_directory(str(prepared))


RECIPE = {
    "dataset": "tiny-org/tiny-math",
    "dataset_config": "default",
    "prompt_column": "question",
    "answer_column": "answer",
    "model": "tiny-org/tiny-chat",
    "system_prompt": "answer with a number",
    "reward": "numeric",
    "output_dir": "run",
    "max_steps": 1,
    "per_device_train_batch_size": 4,
    "num_generations": 2,
    "max_completion_length": 4,
    "eval_size": 2,
    "report_to": "none",
    "threads": 1,
    "plot": False,
    "disable_tqdm": True,
}


def otbrl_train(tmp_path: Path, home: Path, recipe: dict, extra: str = "") -> subprocess.CompletedProcess:
    """`otbrl train` in its own process (the offline switch is read when huggingface_hub is imported),
    from a directory of its own, with the recipe as a YAML file."""
    path = tmp_path / "recipe.yaml"
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in recipe.items()) + extra)
    env = {
        **os.environ,
        "HF_HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "TRL_EXPERIMENTAL_SILENCE": "1",
    }
    env.pop("HF_DATASETS_CACHE", None)
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, "-m", "otbrl.app.cli", "train", "--config", str(path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("hf_home")
    write_hub_cache(home)
    return home


def test_hub_model_and_dataset_train_offline_with_chat_prompts(tmp_path, hub_home):
    # `save_strategy: no` written plainly in YAML: YAML 1.1 would read it as False.
    got = otbrl_train(tmp_path, hub_home, RECIPE, extra="save_strategy: no\nlearning_rate: 1e-4\n")
    assert got.returncode == 0, got.stderr[-3000:]
    assert "prompts: chat messages" in got.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["generated tokens"] > 0
    recipe = (tmp_path / "run" / "recipe.yaml").read_text()
    assert "save_strategy: 'no'" in recipe and "learning_rate: 0.0001" in recipe
    assert not list((tmp_path / "run").glob("checkpoint-*"))
    closing = got.stdout.strip().splitlines()[-1]
    assert closing.startswith("wrote to run:") and "summary.json" in closing
    assert "checkpoint" not in closing and "TensorBoard" not in closing  # neither was written


@pytest.mark.parametrize(
    ("key", "missing", "what"),
    [
        ("model", "tiny-org/absent-model", "model: could not fetch the tokenizer of tiny-org/absent-model"),
        ("dataset", "tiny-org/absent-data", "dataset: could not load tiny-org/absent-data"),
    ],
)
def test_offline_names_missing_from_the_cache_fail_in_one_line(tmp_path, hub_home, key, missing, what):
    got = otbrl_train(tmp_path, hub_home, {**RECIPE, key: missing})
    assert got.returncode == 2, got.stderr[-3000:]
    assert "Traceback" not in got.stderr
    line = got.stderr.strip().splitlines()[-1]
    assert line.startswith(f"otbrl: {what}"), line
    assert "HF_HUB_OFFLINE=1" in line and ("save_pretrained" in line or "save_to_disk" in line)
    assert not (tmp_path / "run").exists()  # nothing was started


def test_chat_prompts_carry_the_system_prompt_and_render_for_evaluation():
    from otbrl.app.recipe import load_recipe, make_config
    from otbrl.app.sources import shape_prompts
    from otbrl.tasks import char_tokenizer

    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    rows = [{"prompt": "1+1=", "answer": "2"}]
    recipe = load_recipe("dataset-example", {"model": "some/model", "system_prompt": "be brief"})
    config = make_config(recipe)
    train_rows, eval_rows, chat = shape_prompts(recipe, tokenizer, rows, rows, config)
    assert chat is True  # chat: None and the tokenizer has a template
    assert train_rows == [
        {
            "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="}],
            "answer": "2",
        }
    ]
    assert eval_rows == [{"prompt": "system: be brief;user: 1+1=;assistant: ", "answer": "2"}]
    plain, plain_eval, chat = shape_prompts({**recipe, "chat": False}, tokenizer, rows, rows, config)
    assert chat is False and plain == plain_eval == [{"prompt": "be brief\n\n1+1=", "answer": "2"}]
    with pytest.raises(ValueError, match="chat: the tokenizer of some/model has no chat template"):
        shape_prompts({**recipe, "chat": True}, char_tokenizer(), rows, rows, config)
