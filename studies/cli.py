"""The evidence suite's command: `python -m studies SUBCOMMAND` from the repository's root.

python -m studies compare EXPERIMENT [--quick|--pilot] [--jobs 2] [--seeds 9-14]   registered experiments
python -m studies step0 EXPERIMENT [--pilot] --seeds 0-15 [--jobs 2]            step-0 scores ahead of runs
python -m studies progress EXPERIMENT [--seeds 20-21]                           runs' spending, no results
python -m studies claims [--results docs/results] [--readme README.md]           the claims page
python -m studies phenomenon EXPERIMENT [--results docs/results]                 its phenomenon, run by run
python -m studies variance [--quick] [--out DIR] [...]                           gradient noise per estimator
python -m studies variance-a [--pilot|--no-run] [--amend REASON]                 claim (a), registered

Each run of an experiment is an `otbrl train` run in its own process; the suite adds what a user's own
comparison (`otbrl compare`) does not need: registered protocols, pilots and gates, power, verdict rules.
A bad experiment or argument ends in one line starting `studies:` and exit code 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otbrl.app.cli import CliError, int_list
from studies import variance, variance_a_cli
from studies.claims import BEGIN, STUDIES, proxy_claim, sync_readme, variance_claim, write_claims
from studies.compare import RESULTS, compare, experiment_names, pilot
from studies.phenomenon import phenomenon
from studies.progress import progress, table
from studies.runs import commit_files
from studies.step0 import ahead


def fail(message: str, code: int = 2) -> CliError:
    """Print `studies: message` (one line) to stderr and return the exception that exits with `code`."""
    text = f"studies: {message}"
    print(text, file=sys.stderr)
    return CliError(text, code)


def stop_time(text: str, now: float | None = None) -> float:
    """`HH:MM` (UTC) as the time.time() of its next occurrence (today, else tomorrow)."""
    try:
        clock = datetime.datetime.strptime(text, "%H:%M").time()
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HH:MM (UTC), got {text!r}") from None
    current = datetime.datetime.fromtimestamp(time.time() if now is None else now, datetime.UTC)
    at = datetime.datetime.combine(current.date(), clock, datetime.UTC)
    return (at if at > current else at + datetime.timedelta(days=1)).timestamp()


def claims_files(results: Path) -> list[Path]:
    """claims.md and the README's copy of it (the checkout's README.md, when it has the markers), rebuilt
    from `results`; nothing while no study has results."""
    if not any((results / f"{name}.json").is_file() for name in STUDIES):
        return []
    claims = write_claims(results)
    readme = results.resolve().parent.parent / "README.md"  # docs/results -> the checkout's root
    if not (readme.is_file() and BEGIN in readme.read_text()):
        return [claims]
    sync_readme(readme, claims)
    return [claims, readme]


def commit_registration(results: Path) -> Callable[[Path], bool]:
    """--commit: a protocol registered or amended is committed before any run under it starts, with
    claims.md (it lists every amendment) and the README's copy of it rebuilt beside it, so no commit holds
    a registration that its pages do not show."""

    def commit(path: Path) -> bool:
        reg = json.loads(path.read_text())
        last = (reg["amendments"] or [reg])[-1]
        files = [path, *claims_files(results)]
        what = f"amendment {len(reg['amendments'])}" if reg["amendments"] else "protocol"
        return commit_files(
            files, f"{path.parent.name}: {what} registered ({last['hash']}) before its runs start"
        )

    return commit


def rebuild_pages(experiment: str, results: Path, pilot_stage: bool) -> Callable[[], list[Path]]:
    """--commit: after each record lands, the experiment's page (its pilot's, with `pilot_stage`), its
    phenomenon page where one is committed (`studies.phenomenon`), claims.md and the README's copy,
    rebuilt from the records as `--no-run` would, for the record's commit: a session cut off between a
    record and a rebuild by hand left pages that test_pages_regenerate refused. A rebuild that fails is
    said and commits no page; the record is committed all the same."""

    def quiet(_: str) -> None:
        pass

    def rebuild() -> list[Path]:
        try:
            if pilot_stage:
                page = pilot(experiment, results=results, train=False, log=quiet)[0]
                files = [page, page.with_suffix(".png")]
            else:
                page = compare(experiment, results=results, train=False, log=quiet)[0]
                files = [page, page.with_suffix(".png"), page.with_suffix(".json")]
            own = results / f"{experiment}-phenomenon.md"
            if own.is_file():  # committed once: kept current as the records land
                files += [phenomenon(experiment, results), own.with_suffix(".png")]
            return files + claims_files(results)
        except Exception as err:  # a page must not stop the runs: the record still lands
            print(f"studies: {experiment}: pages not rebuilt after a record: {err}", file=sys.stderr)
            return []

    return rebuild


def compare_command(args: argparse.Namespace, rest: list[str]) -> None:
    if rest:
        raise fail(f"compare: unexpected arguments {rest}")
    if args.pilot and args.quick:
        raise fail("compare: --pilot and --quick do not go together")
    where = dict(
        jobs=args.jobs,
        runs_dir=args.runs_dir,
        results=args.results,
        amend=args.amend,
        stop_at=args.stop_at,
        commit=args.commit,
        registered=commit_registration(args.results or RESULTS) if args.commit and not args.quick else None,
        pages=rebuild_pages(args.experiment, args.results or RESULTS, args.pilot)
        if args.commit and not args.quick
        else None,
    )
    if args.pilot and args.seeds:
        raise fail("compare: --seeds chooses reported runs; the pilot runs all its seeds")
    if args.no_run and (args.seeds or args.arms or args.stop_at or args.commit):
        raise fail(
            "compare: --seeds, --arms, --stop-at and --commit are about training; --no-run trains none"
        )
    try:
        if args.pilot:
            page, failures = pilot(args.experiment, **where, train=not args.no_run, arms=args.arms)[0], []
        else:
            page, failures = compare(
                args.experiment,
                quick=args.quick,
                **where,
                train=not args.no_run,
                seeds=args.seeds,
                arms=args.arms,
            )
    except (ValueError, RuntimeError) as err:
        raise fail(str(err)) from None
    if where["pages"] is not None:
        # --commit: the pages go back to what the records' commits hold. The page just written tells this
        # invocation's refusals and timing, which belong to this machine, not to the evidence; left in the
        # main checkout it was a change waiting to be committed by mistake.
        where["pages"]()
    print(f"\nwrote {page}" + ("" if args.pilot else " (+ .png, .json)"))
    if failures:
        raise SystemExit("studies compare: failed runs:\n" + "\n".join(failures))


def step0_command(args: argparse.Namespace, rest: list[str]) -> None:
    if rest:
        raise fail(f"step0: unexpected arguments {rest}")
    try:
        failures = ahead(
            args.experiment,
            args.seeds,
            pilot=args.pilot,
            jobs=args.jobs,
            runs_dir=args.runs_dir,
            results=args.results,
            commit=args.commit,
        )
    except (ValueError, RuntimeError) as err:
        raise fail(str(err)) from None
    if failures:
        raise SystemExit("studies step0: failed seeds:\n" + "\n".join(failures))


def add_step0(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "step0",
        help="seeds' step-0 held-out scores ahead of their runs (kept beside the records, per kind of "
        "machine, for the runs to reuse)",
    )
    p.add_argument("experiment", help=f"an experiment: {', '.join(experiment_names())}")
    p.add_argument("--seeds", type=int_list, required=True, help="e.g. 0-15 or 103,104")
    p.add_argument("--pilot", action="store_true", help="the pilot's seeds (its records folder)")
    p.add_argument("--jobs", type=int, default=2, help="seeds at a time, one thread each (default 2)")
    p.add_argument("--runs-dir", type=Path, help="the experiment's runs folder (default runs/compare/NAME)")
    p.add_argument("--results", type=Path, help="where the records are (default docs/results)")
    p.add_argument("--commit", action="store_true", help="commit the scores file as each seed's score lands")
    return p


def claims_command(args: argparse.Namespace, rest: list[str]) -> None:
    if not any((args.results / f"{name}.json").is_file() for name in STUDIES):
        raise fail(
            f"nothing to summarise: no study results ({', '.join(n + '.json' for n in STUDIES)}) in "
            f"{args.results}; run `python -m studies variance` or `python -m studies compare EXPERIMENT` "
            "first, or pass --results DIR (after `python -m studies compare walk --quick`: "
            "runs/compare-quick/results)"
        )
    page = write_claims(args.results)
    print(f"wrote {page}")
    if args.readme is not None:
        try:
            sync_readme(args.readme, page)
        except ValueError as err:
            raise fail(str(err)) from None
        print(f"updated the evidence section of {args.readme}")


def phenomenon_command(args: argparse.Namespace, rest: list[str]) -> None:
    if rest:
        args.parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        page = phenomenon(args.experiment, args.results)
    except ValueError as err:
        raise fail(str(err)) from None
    print(f"wrote {page}")


def add_phenomenon(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "phenomenon",
        help="an experiment's phenomenon (e.g. the length CV) in every committed run at the picks, and where "
        "its reported runs head for; shows no reward",
    )
    p.add_argument("experiment", help=f"a packaged experiment: {', '.join(experiment_names())}")
    p.add_argument(
        "--results", type=Path, default=RESULTS, help="where the records are (default docs/results)"
    )
    return p


def variance_command(args: argparse.Namespace, rest: list[str]) -> None:
    if rest:
        args.parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.out is None and args.quick:  # a smoke run's pages go under the current directory
        args.out = Path("runs/variance-quick")
    try:
        variance.main(args, verdicts=lambda res: [variance_claim(res), proxy_claim(res)])
    except ValueError as err:
        raise fail(str(err)) from None


def variance_a_command(args: argparse.Namespace, rest: list[str]) -> None:
    if rest:
        args.parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.no_run and args.cells:
        raise fail("variance-a: --cells chooses cells to measure; --no-run measures none")
    try:
        variance_a_cli.main(args)
    except (ValueError, RuntimeError) as err:
        raise fail(str(err)) from None


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
    p.add_argument(
        "--seeds",
        type=int_list,
        help="train only these of the protocol's seeds (e.g. 9-14 or "
        "3,5): one machine's share; records from every share merge",
    )
    p.add_argument("--arms", type=lambda s: s.split(","), help="train only these arms (comma-separated)")
    p.add_argument(
        "--no-run",
        action="store_true",
        help="train nothing: rebuild the page from the committed run records alone (docs/results/runs/)",
    )
    p.add_argument(
        "--stop-at",
        type=stop_time,
        metavar="HH:MM",
        help="the machine is taken away then (UTC, the next such time): a run that would end after it, at "
        "the median time of the runs recorded on this kind of machine, is not started",
    )
    p.add_argument(
        "--commit",
        action="store_true",
        help="commit each run's record in the git checkout that holds the records as soon as it is written "
        "(with --results pointing at the main checkout when the runs train in a worktree)",
    )
    p.add_argument(
        "--amend",
        metavar="REASON",
        help="go on although the protocol changed since its first run started: the change and REASON are "
        "recorded (claims.md lists them)",
    )
    return p


def progress_command(args: argparse.Namespace, rest: list[str]) -> None:
    if rest:
        raise fail(f"progress: unexpected arguments {rest}")
    try:
        rows, recorded, planned = progress(args.experiment, args.seeds, args.runs_dir, args.results)
    except ValueError as err:
        raise fail(str(err)) from None
    print(f"{Path(args.experiment).stem}: {recorded} of {planned} runs recorded")
    print(table(rows) if rows else "no run here without a record (--seeds shows recorded ones too)")


def add_progress(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "progress",
        help="how far an experiment's runs have got (steps, tokens, time, checkpoint); shows no result",
    )
    p.add_argument("experiment", help=f"an experiment: {', '.join(experiment_names())}")
    p.add_argument(
        "--seeds", type=int_list, help="every run of these seeds (default: runs here without a record)"
    )
    p.add_argument("--runs-dir", type=Path, help="the experiment's runs folder (default runs/compare/NAME)")
    p.add_argument("--results", type=Path, help="where the records are (default docs/results)")
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


def add_variance_a(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "variance-a", help="claim (a) under its registered protocol: OTB vs group-mean gradient noise"
    )
    variance_a_cli.add_arguments(p)
    return p


Subparsers = Any  # what ArgumentParser.add_subparsers returns (its class is private to argparse)

SUBCOMMANDS = {
    "compare": (add_compare, compare_command),
    "step0": (add_step0, step0_command),
    "progress": (add_progress, progress_command),
    "claims": (add_claims, claims_command),
    "phenomenon": (add_phenomenon, phenomenon_command),
    "variance": (add_variance, variance_command),
    "variance-a": (add_variance_a, variance_a_command),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m studies", description="otbrl's evidence suite.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add, command in SUBCOMMANDS.values():
        add(sub).set_defaults(command_fn=command, parser=parser)
    args, rest = parser.parse_known_args(argv)
    args.command_fn(args, rest)
