"""One documented configuration: every recipe key is a RecipeKeys or OTBGRPOConfig field documented in its
class's docstring (TRL's style), the recipe defaults of TRL fields are documented with their values, the
YAML loader exists because the libraries' readers get recipe values wrong, and the estimator option rules
live in `otbrl.estimators.resolve` alone, giving one message through every path."""

from __future__ import annotations

import dataclasses
import re

import pytest

pytest.importorskip("otbrl.integrations.trl")

import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import HfArgumentParser  # noqa: E402
from trl import GRPOConfig, TrlParser  # noqa: E402

import otbrl  # noqa: E402
from otbrl.app.config import TRAINER_DEFAULTS, RecipeKeys  # noqa: E402
from otbrl.app.recipe import load_recipe  # noqa: E402
from otbrl.integrations.trl import OTBGRPOConfig  # noqa: E402


def documented(cls: type) -> dict[str, str]:
    """name -> the type-and-default line of each `name (`type`, ...):` entry of a TRL-style docstring."""
    return dict(re.findall(r"^ {8}(\w+) \((.+)\):$", cls.__doc__, flags=re.M))


@pytest.mark.parametrize(
    ("cls", "own"),
    [
        (RecipeKeys, lambda names: names),
        # OTBGRPOConfig documents its own fields, and the one transformers field it gives another default
        (OTBGRPOConfig, lambda names: names - {f.name for f in dataclasses.fields(GRPOConfig)}),
    ],
)
def test_every_field_is_documented_with_its_default(cls, own):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    docs = documented(cls)
    names = own(set(fields)) | (set(docs) & set(fields))
    assert names - set(docs) == set(), "fields without an entry in the docstring"
    assert set(docs) - set(fields) == set(), "entries for fields that do not exist"
    for name in names:
        default = fields[name].default
        shown = f'"{default}"' if isinstance(default, str) else str(default)
        assert docs[name].endswith(f"defaults to `{shown}`"), (name, docs[name], default)


def test_trainer_defaults_are_documented_and_used(tmp_path):
    section = RecipeKeys.__doc__.split("(`TRAINER_DEFAULTS`)", 1)[1]
    for key, value in TRAINER_DEFAULTS.items():
        shown = yaml.safe_dump(value, default_flow_style=True).removesuffix("...\n").strip()
        assert f"`{key}: {shown}`" in section, key
    path = tmp_path / "r.yaml"
    path.write_text("task: running_sum16\n")
    recipe = load_recipe(str(path))
    assert {k: recipe[k] for k in TRAINER_DEFAULTS} == TRAINER_DEFAULTS


@pytest.mark.parametrize(
    ("given", "on"),
    [({}, False), ({"gradient_checkpointing": "true"}, True), ({"activation_checkpointing": "true"}, True)],
)
def test_checkpointing_is_the_recipes_and_builds_without_transformers_deprecation_warning(
    tmp_path, recwarn, given, on
):
    """The recipe key keeps TRL's name (`gradient_checkpointing`); the config gets it under transformers'
    current one, so a run does not warn about a setting its user never gave, and the value is the recipe's."""
    from otbrl.app.recipe import make_config
    from otbrl.integrations.trl.config import checkpointing_key

    path = tmp_path / "r.yaml"
    path.write_text("task: running_sum16\n")
    config = make_config(load_recipe(str(path), given))
    assert config.gradient_checkpointing is on
    assert getattr(config, checkpointing_key()) is on
    deprecated = [w for w in recwarn if "gradient_checkpointing" in str(w.message)]
    assert deprecated == [], [str(w.message) for w in deprecated]


def test_the_libraries_yaml_readers_get_recipe_values_wrong(tmp_path):
    """Why otbrl.app.recipe has its own YAML 1.2 loader: TRL's and transformers' readers are YAML 1.1 (`no`
    is false, so `save_strategy: no` is refused) and transformers' leaves `1e-4` a string. When this test
    fails, the libraries read recipes right and the loader can go."""
    path = tmp_path / "r.yaml"
    common = f"output_dir: {tmp_path}\nbf16: false\nuse_cpu: true\n"
    path.write_text("save_strategy: no\n" + common)
    for parse in (
        lambda: HfArgumentParser([RecipeKeys, OTBGRPOConfig]).parse_yaml_file(str(path)),
        lambda: TrlParser([RecipeKeys, OTBGRPOConfig]).parse_args_and_config(["--config", str(path)]),
    ):
        with pytest.raises(ValueError, match="False is not a valid SaveStrategy"):
            parse()
    path.write_text("learning_rate: 1e-4\n" + common)
    _, config = HfArgumentParser([RecipeKeys, OTBGRPOConfig]).parse_yaml_file(str(path))
    assert config.learning_rate == "1e-4"
    recipe = tmp_path / "ours.yaml"
    recipe.write_text("task: running_sum16\nsave_strategy: no\nlearning_rate: 1e-4\n")
    typed = load_recipe(str(recipe))
    assert typed["save_strategy"] == "no" and typed["learning_rate"] == 1e-4


def rollouts() -> dict:
    return {
        "rewards": torch.rand(4),
        "mask": torch.ones(4, 3),
        "group_ids": [0, 0, 1, 1],
        "energy": torch.rand(4, 3),
    }


BAD_OPTIONS = [
    ({"leave_one_out": "false"}, "leave_one_out must be true or false (like False), got 'false'"),
    ({"zero_tail": 0}, "zero_tail must be true or false (like True), got 0"),
    ({"eps": "1e-8"}, "eps must be a number (like 1e-08), got '1e-8'"),
    ({"eps": True}, "eps must be a number (like 1e-08), got True"),
    ({"align": 1}, "align must be a string (like 'position'), got 1"),
    ({"leave_one_ot": True}, "leave_one_ot: not an option of estimator 'otb'"),
]


@pytest.mark.parametrize(("options", "message"), BAD_OPTIONS)
def test_estimator_option_rules_are_resolves_on_every_path(tmp_path, options, message):
    batch = dict(
        rewards=torch.rand(4), mask=torch.ones(4, 3), group_ids=[0, 0, 1, 1], energy=torch.rand(4, 3)
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        otbrl.compute_advantages("otb", **batch, **options)
    with pytest.raises(ValueError, match=f"^estimator_options: {re.escape(message)}"):
        OTBGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, estimator_options=options)
    with pytest.raises(ValueError, match=f"^estimator_options: {re.escape(message)}"):
        load_recipe("demo", {"estimator_options": options, "output_dir": str(tmp_path)})


def test_good_options_pass_every_path(tmp_path):
    options = {"leave_one_out": True, "zero_tail": False, "eps": 1e-6, "align": "generated"}
    batch = dict(
        rewards=torch.rand(4), mask=torch.ones(4, 3), group_ids=[0, 0, 1, 1], energy=torch.rand(4, 3)
    )
    otbrl.compute_advantages("otb", **batch, **options)
    config = OTBGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, estimator_options=options)
    assert config.estimator_options == options
    assert load_recipe("demo", {"estimator_options": options})["estimator_options"] == options
