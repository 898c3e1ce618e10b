"""The README and the manual pages in docs/ say what is true: their code runs, their commands exist and
parse, their links resolve, and the numbers they quote match what they cite."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MANUAL = sorted((ROOT / "docs").glob("*.md"))  # the manual; docs/results/ holds generated pages
PAGES = [README, *MANUAL]


def text(page: Path) -> str:
    return page.read_text()


def blocks(page: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text(page), flags=re.S)


def run_blocks(page: Path) -> dict:
    """Run a page's python blocks in order in one namespace, as a reader would."""
    namespace: dict = {}
    for block in blocks(page, "python"):
        exec(compile(block, str(page), "exec"), namespace)
    return namespace


def test_the_manual_pages_exist():
    names = {p.name for p in MANUAL}
    assert {"training.md", "integrations.md", "library.md", "experiments.md"} <= names
    for page in MANUAL:  # every manual page is reachable from the README
        assert f"(docs/{page.name})" in text(README), page.name


def test_readme_quick_example_runs(capsys):
    # The TRL block needs a model and data of the reader's; tests/test_trl.py runs that path.
    runnable = [b for b in blocks(README, "python") if "OTBGRPOTrainer" not in b]
    assert len(runnable) == 1
    namespace: dict = {}
    exec(compile(runnable[0], str(README), "exec"), namespace)
    assert namespace["res"].advantages.shape == (8, 16)
    assert "torch.Size([8, 16])" in capsys.readouterr().out


def test_library_page_runs_top_to_bottom(capsys):
    page = ROOT / "docs" / "library.md"
    assert len(blocks(page, "python")) >= 3  # quick example, fused statistics, diagnostics
    namespace = run_blocks(page)
    assert namespace["res"].advantages.shape == (8, 16)
    out = capsys.readouterr().out
    assert "torch.Size([8, 16])" in out
    assert "torch.Size([8, 16]) torch.float32" in out  # the fused statistics block's print
    # the diagnostics block runs last and rebinds `stats` to the diagnostics dict
    assert set(namespace["stats"]) >= {"energy/mean", "update_energy/mean"}
    # The detector as the block builds it (factor 3, warmup 10) does what the page says: quiet while it
    # warms up and on steady norms, a flag on a norm above 3x the median, always a flag on a non-finite one.
    surge = namespace["surge"]
    assert not any(surge.update(1.0) for _ in range(10))
    assert surge.update(10.0) is True
    assert surge.update(2.9) is False
    assert surge.update(float("nan")) is True


def test_every_python_block_compiles_and_its_imports_resolve():
    count = 0
    for page in PAGES:
        for block in blocks(page, "python"):
            tree = ast.parse(block, str(page))
            count += 1
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    module = importlib.import_module(node.module)
                    for alias in node.names:
                        assert hasattr(module, alias.name), f"{page.name}: {node.module}.{alias.name}"
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        importlib.import_module(alias.name)
    assert count >= 8


def test_every_otbgrpoconfig_keyword_is_a_field():
    from otbrl.integrations.trl import OTBGRPOConfig

    fields = {f.name for f in dataclasses.fields(OTBGRPOConfig)}
    seen = 0
    for page in PAGES:
        for block in blocks(page, "python"):
            for node in ast.walk(ast.parse(block)):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "OTBGRPOConfig":
                    for kw in node.keywords:
                        seen += 1
                        assert kw.arg in fields, f"{page.name}: OTBGRPOConfig({kw.arg}=...)"
    assert seen >= 6


def test_trl_snippets():
    from otbrl.integrations import trl
    from otbrl.integrations.trl import rollout_func

    assert len([b for b in blocks(README, "python") if "OTBGRPOTrainer" in b]) == 1  # the drop-in swap
    manual = [b for p in MANUAL for b in blocks(p, "python") if "OTBGRPOTrainer" in b]
    assert any("rollout_func(" in b for b in manual)  # the multi-turn rollout_func, in docs/training.md
    assert callable(rollout_func(["calc", "py"], max_turns=3))
    args = trl.OTBGRPOConfig(
        output_dir="/tmp/otbrl-readme",
        advantage_estimator="otb",
        estimator_options={"leave_one_out": False},
        num_generations=4,
        use_cpu=True,
        bf16=False,
    )
    assert args.estimator_options == {"leave_one_out": False}


def test_every_estimator_is_listed():
    import otbrl

    table = text(ROOT / "docs" / "library.md")
    for name in otbrl.ESTIMATORS:
        if not name.startswith("test_"):
            assert f"`{name}`" in text(README), name
            assert f"| `{name}` |" in table, name


# ----------------------------------------------------------------------------------------------------
# Commands


def _split(line: str) -> list[list[str]]:
    """Shell words of one command line, comments dropped, split into commands at `;`."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";")
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for word in lexer:
        if word == ";":
            commands.append([])
        else:
            commands[-1].append(word)
    return [c for c in commands if c]


def _commands(page: Path) -> list[list[str]]:
    """Commands in the page's bash blocks, and inline `otbrl ...`, `make ...`, `python ...` spans."""
    found = []
    for block in blocks(page, "bash"):
        pending = ""
        for line in block.replace("\\\n", " ").splitlines():
            pending += line + "\n"
            try:
                commands = _split(pending)
            except ValueError:  # a quote that closes on a later line
                continue
            found += commands
            pending = ""
        assert not pending, f"{page.name}: unclosed quote in {pending!r}"
    body = re.sub(r"```.*?```", "", text(page), flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", body):
        if re.match(r"(otbrl [a-z]|make [a-z]|(\.venv/bin/)?python3? (-m )?[\w./]+)", span):
            found += _split(span)
    return found


PLACEHOLDER = re.compile(r"\[|\.\.\.|RECIPE|EXPERIMENT|\bDIR\b|<")


def _help(sub: str, capsys) -> str:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, func = scripts["otbrl"].split(":")
    main = getattr(importlib.import_module(module), func)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main([sub, "--help"])
    assert exit_.value.code == 0, sub
    return capsys.readouterr().out


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


def test_the_setup_is_two_commands_and_ci_runs_the_test_one():
    (setup,) = blocks(README, "bash")[:1]
    lines = [shlex.split(line, comments=True) for line in setup.strip().splitlines()]
    assert lines == [["make", "demo"], ["make", "test"]]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:.*\n\t.*otbrl demo$", makefile, flags=re.M)  # the embedded default run
    assert re.search(r"^test:.*\n\t.*pytest (-n auto )?tests studies/tests$", makefile, flags=re.M)  # all
    assert "make test\n" in (ROOT / ".ci" / "run").read_text()
    assert "`make demo-llm`" in text(README) and "demo-llm" in _make_targets()


def test_every_command_exists_and_parses(capsys):
    from otbrl.app.recipe import load_recipe

    targets, helps, checked = _make_targets(), {}, 0
    for page in PAGES:
        for argv in _commands(page):
            command = shlex.join(argv)
            if PLACEHOLDER.search(command):
                continue
            where = f"{page.name}: {command}"
            if argv[0] == "make":  # targets, and NAME=value for variables the Makefile defines
                makefile = (ROOT / "Makefile").read_text()
                for arg in argv[1:]:
                    name, is_variable, _ = arg.partition("=")
                    defined = re.search(rf"^{re.escape(name)}\s*[:?]?=", makefile, flags=re.M)
                    assert defined if is_variable else arg in targets, where
            elif argv[0] in ("python", "python3", ".venv/bin/python"):
                if argv[1] == "-m":
                    assert importlib.util.find_spec(argv[2]) is not None, where
                else:
                    assert (ROOT / argv[1]).is_file(), where
            elif argv[0] == "otbrl":
                sub, rest = argv[1], argv[2:]
                if sub == "demo" or (sub == "train" and rest):  # recipe + overrides, checked as a run would
                    config = "demo" if sub == "demo" else rest[rest.index("--config") + 1]
                    pairs = [a for a in rest if a not in ("--config", config, "--resume")]
                    assert len(pairs) % 2 == 0, where
                    keys, values = pairs[::2], pairs[1::2]
                    overrides = {k.removeprefix("--"): v for k, v in zip(keys, values, strict=True)}
                    load_recipe(str(ROOT / config) if (ROOT / config).is_file() else config, overrides)
                else:
                    helps.setdefault(sub, _help(sub, capsys))
                    for arg in rest:
                        if arg.startswith("--"):
                            assert re.search(rf"{arg}\b", helps[sub]), where
                        elif sub == "compare" and arg == rest[0]:
                            assert re.search(rf"\b{arg}\b", helps[sub].split("experiment", 2)[-1]), where
            else:
                continue  # pip, verl's own entry point, torchrun: not this project's commands
            checked += 1
    assert checked >= 30


# ----------------------------------------------------------------------------------------------------
# Links and numbers


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_resolves():
    checked = 0
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", text(page)):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.name}: {target}"
            if anchor:
                headings = re.findall(r"^#+ (.*)$", dest.read_text(), flags=re.M)
                assert anchor in {_slug(h) for h in headings}, f"{page.name}: {target}"
            checked += 1
    assert checked >= 40


def _quoted(page: str, *phrases: str) -> None:
    body = " ".join(text(ROOT / page).split())
    for phrase in phrases:
        assert phrase in body, f"{page}: {phrase!r}"


def test_quoted_numbers_match_their_result_pages():
    results = ROOT / "docs" / "results"
    sums = " ".join((results / "llm-sums.md").read_text().split())
    assert "held-out reward before | 0.2 |" in sums and "held-out reward after | 0.57 |" in sums
    assert "in 7.0 min of training" in sums
    _quoted("README.md", "0.200 -> 0.570 in 40 steps and 7.0 min of training")
    _quoted("docs/training.md", "0.200 -> 0.570 in 40 steps and 7.0 min of training")

    trl_step = (results / "trl_step.md").read_text()
    assert "0.922x with TRL generating" in trl_step and "0.943x with otbrl's sampler" in trl_step
    _quoted("docs/integrations.md", "0.92x a `dr_grpo` step when TRL generates and 0.94x with `rollout_func`")

    llm_step = (results / "llm_step.md").read_text()
    assert all(r in llm_step for r in ("0.852x", "0.978x", "1.102x"))
    _quoted("docs/training.md", "costs 0.85x TRL's own GRPOTrainer step (0.98x grpo", "and 1.10x when TRL")

    advantages = (results / "advantages.md").read_text()
    assert "| 1024 | 4096 |   token |" in advantages and "1.47x" in advantages and "1.87x" in advantages
    _quoted("docs/library.md", "`otb` costs 1.47x `grpo`", "and 1.87x with outcome rewards at T = 8192")

    energy = (results / "sum_pi_squared.md").read_text()
    row = "| 151936 | 4096 |   token_energy |      823.4 |   7717.5 |               64 |           7122 |"
    assert row in energy
    _quoted("docs/library.md", "takes 0.82 s and 64 MiB extra", "7.7 s and 7.0 GiB (7122 MiB)")


def test_the_toy_table_is_what_the_toy_study_prints():
    command = [sys.executable, "-m", "studies.toy"]  # the command docs/library.md gives
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=120, env=env).stdout
    rows = re.findall(
        r"^\| ([a-z_ ()-]+?) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$",
        text(ROOT / "docs" / "library.md"),
        flags=re.M,
    )
    assert len(rows) == 7
    for name, *numbers in rows:
        printed = re.search(rf"^{re.escape(name)}\s+(.*)$", out, flags=re.M)
        assert printed, name
        variance, vs_mean, nsr, mse, _cosine, bias = printed.group(1).split()
        assert numbers == [variance, vs_mean, nsr, mse, bias], name
