"""The README's code blocks run as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_examples_run(capsys):
    blocks = python_blocks()
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
