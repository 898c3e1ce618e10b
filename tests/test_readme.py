"""The README's code blocks run as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_examples_run(capsys):
    # The TRL block needs a model and data of the reader's; tests/test_trl.py runs that path.
    blocks = [b for b in python_blocks() if "OTBGRPOTrainer" not in b]
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:  # later blocks use names from earlier ones, as a reader would
        exec(compile(block, str(README), "exec"), namespace)
    assert namespace["res"].advantages.shape == (8, 16)
    assert "torch.Size([8, 16])" in capsys.readouterr().out
    assert set(namespace["stats"]) >= {"energy/mean", "update_energy/mean"}  # the diagnostics block, run last
    assert len(blocks) >= 3


def test_readme_lists_every_estimator():
    import otbrl

    text = README.read_text()
    for name in otbrl.ESTIMATORS:
        if not name.startswith("test_"):
            assert f"`{name}`" in text, name


def test_readme_trl_snippet_names_exist():
    from otbrl.integrations import trl

    blocks = [b for b in python_blocks() if "OTBGRPOTrainer" in b]
    assert len(blocks) == 2  # the drop-in swap and the multi-turn rollout_func
    for block in blocks:
        compile(block, str(README), "exec")
    from otbrl.integrations.trl import rollout_func

    assert callable(rollout_func(["calc", "py"], max_turns=3))
    assert hasattr(trl, "OTBGRPOConfig") and hasattr(trl, "OTBGRPOTrainer")
    args = trl.OTBGRPOConfig(
        output_dir="/tmp/otbrl-readme",
        advantage_estimator="otb",
        estimator_options={"leave_one_out": False},
        num_generations=4,
        use_cpu=True,
        bf16=False,
    )
    assert args.estimator_options == {"leave_one_out": False}
