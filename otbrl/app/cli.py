"""The `otbrl` command.

otbrl train --config recipes/NAME.yaml [--resume] [--key value ...]   train with a recipe
otbrl demo [--key value ...]                                          the embedded default run
otbrl recipes                                                         list the packaged recipes
otbrl compare EXPERIMENT [--quick|--pilot] [--jobs 2] [--seeds 9-14]   runs over estimators x seeds
otbrl claims [--results docs/results] [--readme README.md]            the claims table from the studies
otbrl variance [--quick] [--out DIR] [...]                            estimators' gradient variance

A bad recipe, value or input ends in one line starting `otbrl:` and exit code 2, before any model is
loaded; a run stopped by failing reward functions ends the same way with exit code 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from otbrl.app.recipe import load_recipe, parse_value, recipe_names
from otbrl.app.studies import variance
from otbrl.app.studies.claims import STUDIES, sync_readme, write_claims
from otbrl.app.studies.compare import compare, experiment_names, pilot
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


def recipes_command(args: argparse.Namespace, rest: list[str]) -> None:
    print("\n".join(recipe_names()))


def compare_command(args: argparse.Namespace, rest: list[str]) -> None:
    if rest:
        raise SystemExit(f"otbrl compare: unexpected arguments {rest}")
    if args.pilot and args.quick:
        raise fail("compare: --pilot and --quick do not go together")
    where = dict(jobs=args.jobs, runs_dir=args.runs_dir, results=args.results, amend=args.amend)
    if args.pilot and (args.seeds or args.arms):
        raise fail("compare: --seeds and --arms choose reported runs; the pilot runs whole")
    if args.no_run and (args.seeds or args.arms):
        raise fail("compare: --seeds and --arms choose runs to train; --no-run trains none")
    try:
        if args.pilot:
            page, failures = pilot(args.experiment, **where, train=not args.no_run)[0], []
        else:
            page, failures = compare(args.experiment, quick=args.quick, **where, train=not args.no_run,
                                     seeds=args.seeds, arms=args.arms)  # fmt: skip
    except (ValueError, RuntimeError) as err:
        raise fail(str(err)) from None
    print(f"\nwrote {page}" + ("" if args.pilot else " (+ .png, .json)"))
    if failures:
        raise SystemExit("otbrl compare: failed runs:\n" + "\n".join(failures))


def claims_command(args: argparse.Namespace, rest: list[str]) -> None:
    if not any((args.results / f"{name}.json").is_file() for name in STUDIES):
        raise fail(
            f"nothing to summarise: no study results ({', '.join(n + '.json' for n in STUDIES)}) in "
            f"{args.results}; run `otbrl variance` or `otbrl compare EXPERIMENT` first, or pass "
            "--results DIR (after `otbrl compare walk --quick`: runs/compare-quick/results)"
        )
    page = write_claims(args.results)
    print(f"wrote {page}")
    if args.readme is not None:
        try:
            sync_readme(args.readme, page)
        except ValueError as err:
            raise fail(str(err)) from None
        print(f"updated the evidence section of {args.readme}")


def variance_command(args: argparse.Namespace, rest: list[str]) -> None:
    if rest:
        args.parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.out is None and args.quick:  # a smoke run's pages go under the current directory
        args.out = Path("runs/variance-quick")
    try:
        variance.main(args)
    except ValueError as err:
        raise fail(str(err)) from None


# ----------------------------------------------------------------------------------------------------------
# Their command lines.

Subparsers = Any  # what ArgumentParser.add_subparsers returns (its class is private to argparse)


def add_recipes(sub: Subparsers) -> argparse.ArgumentParser:
    return sub.add_parser("recipes", help="list the packaged recipes")


def add_train(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train with a recipe; any recipe key can be overridden as --key value")
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


def _int_list(text: str) -> list[int]:
    """'3,5,9-11' -> [3, 5, 9, 10, 11]."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"integers or ranges like 3,9-14, got {text!r}") from None
    return out


def add_compare(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "compare", help="training runs over arms (estimator, group size, ...) x seeds: table and plot"
    )
    p.add_argument(
        "experiment", help=f"an experiment file, or a packaged one: {', '.join(experiment_names())}"
    )
    p.add_argument("--quick", action="store_true", help="the experiment's short version (what CI runs)")
    p.add_argument(
        "--pilot", action="store_true", help="run the pilot seed's learning-rate choice (not reported)"
    )
    p.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each (default 2)")
    p.add_argument("--runs-dir", type=Path, help="where runs go (default runs/compare[-quick]/NAME)")
    p.add_argument("--results", type=Path, help="where the page goes (default docs/results; quick: runs/)")
    p.add_argument("--seeds", type=_int_list, help="train only these of the protocol's seeds (e.g. 9-14 or "
                   "3,5): one machine's share; records from every share merge")  # fmt: skip
    p.add_argument("--arms", type=lambda s: s.split(","), help="train only these arms (comma-separated)")
    p.add_argument(
        "--no-run",
        action="store_true",
        help="train nothing: rebuild the page from the committed run records alone (docs/results/runs/)",
    )
    p.add_argument(
        "--amend",
        metavar="REASON",
        help="go on although the protocol changed since its first run started: the change and REASON are "
        "recorded (claims.md lists them)",
    )
    return p


def add_claims(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("claims", help="write claims.md from the studies' results (verdicts by rule)")
    p.add_argument(
        "--results", type=Path, default=Path("docs/results"), help="where the studies wrote their JSON"
    )
    p.add_argument(
        "--readme", type=Path, help="also copy claims.md into this README's evidence section (its markers)"
    )
    return p


def add_variance(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("variance", help="gradient variance of each estimator at a fixed checkpoint")
    variance.add_arguments(p)
    return p


SUBCOMMANDS = {
    "train": (add_train, train_command),
    "demo": (add_demo, train_command),
    "recipes": (add_recipes, recipes_command),
    "compare": (add_compare, compare_command),
    "claims": (add_claims, claims_command),
    "variance": (add_variance, variance_command),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="otbrl", description="RL for language models with the Optimal Token Baseline."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add, command in SUBCOMMANDS.values():
        add(sub).set_defaults(command_fn=command, parser=parser)
    args, rest = parser.parse_known_args(argv)
    args.command_fn(args, rest)


if __name__ == "__main__":
    main(sys.argv[1:])
