"""The `otbrl` command.

otbrl train --config recipes/NAME.yaml [--resume] [--key value ...]   train with a recipe
otbrl demo [--key value ...]                                          the embedded default run
otbrl recipes                                                         list the packaged recipes
otbrl compare --config RECIPE --arms otb,grpo [--seeds 0-2] [--key value ...]   your arms x seeds

A bad recipe, value or input ends in one line starting `otbrl:` and exit code 2, before any model is
loaded; a run stopped by failing reward functions ends the same way with exit code 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

from otbrl.app import sft
from otbrl.app.compare import compare
from otbrl.app.config import keys_epilog
from otbrl.app.recipe import load_recipe, parse_value, recipe_names
from otbrl.app.train import run, summary_table, written
from otbrl.integrations.trl.rewards import RewardFailure


class CliError(SystemExit):
    """A SystemExit whose text is the message (printed once by `fail`) and whose code is the exit
    status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def fail(message: str, code: int = 2) -> CliError:
    """Print `otbrl: message` (one line) to stderr and return the exception that exits with `code`."""
    text = message if message.startswith("otbrl") else f"otbrl: {message}"
    print(text, file=sys.stderr)
    return CliError(text, code)


def _show_warnings() -> None:
    """otbrl's warnings (a reward function's first failure) on stderr, whatever the libraries did to
    logging; left alone when the root logger already has a handler (pytest, an application's own)."""
    root, ours = logging.getLogger(), logging.getLogger("otbrl")
    if not root.handlers and not ours.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        ours.addHandler(handler)


# transformers 5.x renamed gradient checkpointing to activation checkpointing and warns on each use of an
# old name; TRL's generation path calls the old methods around every step (dozens of warnings a run) and
# nothing a user sets can change that. Only these renames are hidden, and only in otbrl's own commands.
RENAMED_CHECKPOINTING = r"`(is_)?gradient_checkpointing(_enable|_disable)?` is deprecated"


def _hide_library_renames() -> None:
    warnings.filterwarnings("ignore", message=RENAMED_CHECKPOINTING, category=FutureWarning)


def parse_overrides(items: list[str], raw: bool = False) -> dict:
    """["--learning_rate", "1e-4", "--estimator-options", '{"leave_one_out": true}'] -> a dict of values
    read as YAML 1.2 (or, with `raw`, the strings as given: load_recipe reads them as their fields'
    types)."""
    out, i = {}, 0
    while i < len(items):
        key = items[i]
        if not key.startswith("--") or len(key) < 3:
            raise fail(f"expected --key value, got {key!r}")
        name, eq, value = key[2:].partition("=")
        if not eq:
            if i + 1 >= len(items):
                raise fail(f"{key} needs a value")
            value, i = items[i + 1], i + 1
        out[name.replace("-", "_")] = value if raw else parse_value(value)
        i += 1
    return out


# ----------------------------------------------------------------------------------------------------------
# One function per subcommand, `(args, rest)`: rest holds what its parser did not read.


def train_command(args: argparse.Namespace, rest: list[str]) -> None:
    """`otbrl train` and `otbrl demo`: a recipe with --key value overrides, then its summary."""
    _show_warnings()
    try:
        recipe = load_recipe(args.config, parse_overrides(rest, raw=True))
        summary = run(recipe, resume=args.resume)
    except ValueError as err:  # bad recipe or input: one clear line, no traceback
        raise fail(str(err)) from None
    except RewardFailure as err:  # the reward function's own exception text, not a traceback
        raise fail(f"run stopped: {err}", code=1) from None
    print()
    print(summary_table(summary))
    print(f"\nwrote to {recipe['output_dir']}: {', '.join(written(Path(recipe['output_dir'])))}")


def compare_command(args: argparse.Namespace, rest: list[str]) -> None:
    """`otbrl compare`: the recipe under each arm (estimator) and seed, then the paired table."""
    _show_warnings()
    out = args.out or Path("runs") / f"compare-{Path(args.config).stem}"
    try:
        page = compare(args.config, args.arms, args.seeds, out, parse_overrides(rest, raw=True))
    except ValueError as err:
        raise fail(str(err)) from None
    except RewardFailure as err:
        raise fail(f"run stopped: {err}", code=1) from None
    print()
    print(page.read_text())
    print(f"wrote {page} and {page.with_suffix('.png').name}")


def recipes_command(args: argparse.Namespace, rest: list[str]) -> None:
    print("\n".join(recipe_names()))


# ----------------------------------------------------------------------------------------------------------
# Their command lines.

Subparsers = Any  # what ArgumentParser.add_subparsers returns (its class is private to argparse)


def int_list(text: str) -> list[int]:
    """'3,5,9-11' -> [3, 5, 9, 10, 11]."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"integers or ranges like 3,9-14, got {text!r}") from None
    return out


def add_recipes(sub: Subparsers) -> argparse.ArgumentParser:
    return sub.add_parser("recipes", help="list the packaged recipes")


def add_train(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train",
        help="train with a recipe; any recipe key can be overridden as --key value",
        epilog=keys_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config", required=True, help=f"a recipe file, or a packaged recipe: {', '.join(recipe_names())}"
    )
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    return p


def add_demo(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="warm start (cached) + OTB training on a built-in task, then a summary")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    p.set_defaults(config="demo")
    return p


def add_compare(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "compare",
        help="train a recipe under several estimators x seeds: held-out table with paired intervals, plot",
    )
    p.add_argument("--config", required=True, help="a recipe file, or a packaged recipe (as for train)")
    p.add_argument(
        "--arms",
        required=True,
        type=lambda s: s.split(","),
        help="estimators, comma-separated; the first is the reference (e.g. otb,grpo)",
    )
    p.add_argument("--seeds", type=int_list, default=[0, 1, 2], help="seeds, e.g. 0-4 or 1,3 (default 0-2)")
    p.add_argument("--out", type=Path, help="where runs and the page go (default runs/compare-RECIPE)")
    return p


SUBCOMMANDS = {
    "train": (add_train, train_command),
    "demo": (add_demo, train_command),
    "recipes": (add_recipes, recipes_command),
    "compare": (add_compare, compare_command),
    "sft": (sft.add_parser, sft.command),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="otbrl", description="RL for language models with the Optimal Token Baseline."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add, command in SUBCOMMANDS.values():
        add(sub).set_defaults(command_fn=command, parser=parser)
    args, rest = parser.parse_known_args(argv)
    _hide_library_renames()
    args.command_fn(args, rest)


if __name__ == "__main__":
    main(sys.argv[1:])
