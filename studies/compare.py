"""`python -m studies compare`: an experiment's training runs (arms x seeds, see `experiment`), each one
`otbrl train` run in its own process, analysed (`outcomes`) into one results page with a table, the runs'
events and a plot of what the arms bought."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otbrl.app.recipe import load_recipe
from otbrl.tasks import get_task
from studies.compare_page import pilot_seeds_text, report, table
from studies.experiment import (
    Experiment,
    experiment_names,
    load_experiment,
    pilot_plan,
    piloted,
    plan,
    variance_plan,
)
from studies.outcomes import analyse
from studies.pilot import gate_problems, picks_and_gate, pilot_page
from studies.runs import (
    ProtocolChanged,
    Run,
    execute,
    has_record,
    protocol,
    protocol_hash,
    register,
    registration,
)

# experiment_names: for otbrl.app.cli
__all__ = ["ProtocolChanged", "compare", "experiment_names", "pilot", "select"]

RESULTS = Path("docs/results")


def _stamp(
    exp: Experiment,
    records: Path,
    kind: str,
    amend: str | None,
    quick: bool,
    registered: Callable[[Path], Any] | None = None,
) -> dict[str, Any]:
    """Register the protocol (at the first run) or check it against the registered one; the stamp every
    run of this invocation records. `registered(path)` is called when protocol.json was written anew (a
    first registration or an amendment), before any run under it starts."""
    proto = protocol(exp.raw, kind)
    if quick:  # a smoke run: its own protocol, never compared with the real one
        proto = {**proto, "quick": {"forced": exp.forced, "seeds": exp.seeds, "arms": list(exp.arms)}}
    path = records / "protocol.json"
    before = path.read_bytes() if path.is_file() else None
    register(records, proto, exp.source, amend)
    if registered is not None and path.read_bytes() != before:
        registered(path)
    return {"hash": protocol_hash(proto), "kind": kind}


def _heldout_split(exp: Experiment) -> dict[str, Any] | None:
    """The held-out side the runs' evaluations drew from (built-in tasks: `load_rows` splits them)."""
    task = load_recipe(exp.recipe, {**exp.common, **exp.forced}).get("task")
    if not task:
        return None
    return {"task": task, "fraction": get_task(task).heldout_fraction, "salt": task}


def select(exp: Experiment, runs: list[Run], seeds: list[int] | None, arms: list[str] | None) -> list[Run]:
    """The runs of `seeds` and `arms` (None: all): the share of an experiment one machine trains while
    others train the rest; their records merge in the experiment's folder. Seeds and arms outside the
    protocol are an error, not an empty share."""
    extra = sorted(set(seeds or ()) - set(exp.seeds))
    if extra:
        raise ValueError(f"{exp.name}: seeds {extra} are not among the protocol's seeds {exp.seeds}")
    unknown = sorted(set(arms or ()) - set(exp.arms))
    if unknown:
        raise ValueError(f"{exp.name}: arms {unknown} are not among the protocol's arms {list(exp.arms)}")
    return [r for r in runs if (seeds is None or r.seed in seeds) and (arms is None or r.arm in arms)]


def _execute(
    exp: Experiment,
    label: str,
    runs: list[Run],
    jobs: int,
    log: Any,
    records: Path,
    stamp: dict[str, Any],
    stop_at: float | None = None,
    commit: bool = False,
    same_machine: bool | None = None,
    pages: Callable[[], list[Path]] | None = None,
) -> list[str]:
    """`execute` with what every stage of an experiment shares: its recipe and machine rule (`same_machine`
    overrides the experiment's for one stage)."""
    return execute(
        label,
        exp.recipe,
        runs,
        jobs=jobs,
        log=log,
        records=records,
        stamp=stamp,
        same_machine=exp.same_machine if same_machine is None else same_machine,
        stop_at=stop_at,
        commit=commit,
        pages=pages,
    )


def compare(
    spec: str,
    *,
    quick: bool = False,
    jobs: int = 2,
    runs_dir: Path | None = None,
    results: Path | None = None,
    log: Any = print,
    amend: str | None = None,
    train: bool = True,
    seeds: list[int] | None = None,
    arms: list[str] | None = None,
    stop_at: float | None = None,
    commit: bool = False,
    registered: Callable[[Path], Any] | None = None,
    pages: Callable[[], list[Path]] | None = None,
) -> tuple[Path, list[str]]:
    """Plan, run (resuming from committed records; `train=False`: nothing, the page from the committed
    records alone), analyse and report one experiment. Returns (results
    page, failures). Quick runs go to runs/compare-quick/ and leave docs/results alone unless `results`
    says otherwise. The protocol is registered at the first run and checked at every later invocation
    (`amend`: the reason for a change, recorded; `registered`: told of a registration written anew, see
    `_stamp`; `pages`: with `commit`, rebuilt after each record and committed with it, see `execute`); with a
    pilot gate, no reported run starts until the
    pilot's committed runs pass it and the YAML holds its picks (and its power calculation). `seeds` and
    `arms` train only that share of the runs (`select`); the page reads every run that has a record."""
    exp = load_experiment(spec, quick)
    root = Path("runs/compare-quick" if quick else "runs/compare")
    runs_dir = runs_dir or root / exp.name
    results = results or (root / "results" if quick else RESULTS)
    records = results / "runs" / exp.name
    runs = plan(exp, runs_dir)
    share = select(exp, runs, seeds, arms)  # a share outside the protocol fails before anything else
    if not quick and train:
        problems = gate_problems(exp, results)
        if problems:
            raise RuntimeError(
                f"{exp.name}: the pilot's gate is not passed, so no reported run starts:\n- "
                + "\n- ".join(problems)
            )
    start = time.perf_counter()
    failures: list[str] = []
    if train:
        stamp = _stamp(exp, records, "main", amend, quick, registered)
        log(
            f"{exp.name}: {len(runs)} runs ({len(exp.arms)} arms, seeds {exp.seeds}) in {runs_dir}; records "
            f"in {records}; protocol {stamp['hash']}"
        )
        if len(share) < len(runs):
            log(
                f"{exp.name}: this share is {len(share)} of the {len(runs)} runs (seeds {seeds or 'all'}, "
                f"arms {arms or 'all'}); the page reads every run with a record"
            )
        failures = _execute(exp, exp.name, share, jobs, log, records, stamp, stop_at, commit, None, pages)
    else:
        runs = [r for r in runs if has_record(r, records)]
        log(f"{exp.name}: {len(runs)} runs with committed records in {records} (none trained)")
        if not runs:  # e.g. only step-0 scores committed ahead of the runs: nothing to build a page from
            raise RuntimeError(f"{exp.name}: no committed run record in {records} to build a page from")
    result = analyse(exp, runs, records)
    if not result["arms"]:
        raise RuntimeError(f"{exp.name}: every run failed:\n" + "\n".join(failures))
    result["registration"], result["heldout_split"] = registration(records), _heldout_split(exp)
    command = f"python -m studies compare {spec}" + (" --quick" if quick else "") + f" --jobs {jobs}"
    seconds = time.perf_counter() - start if train else None  # a rebuild's seconds say nothing: not shown
    page = report(exp, result, results, command, seconds, failures)
    unrecorded = sum(not has_record(r, records) for r in runs) if train else 0
    if unrecorded:  # a plan still running: whoever runs it stays blind to the interim numbers
        log(
            f"{exp.name}: {len(runs) - unrecorded} of {len(runs)} runs recorded; the interim page is {page}, "
            "its numbers are not printed here (`--no-run` prints them)"
        )
    else:
        log(table(exp, result))
    return page, failures


def pilot(
    spec: str,
    *,
    jobs: int = 2,
    runs_dir: Path | None = None,
    results: Path | None = None,
    log: Any = print,
    amend: str | None = None,
    train: bool = True,
    arms: list[str] | None = None,
    stop_at: float | None = None,
    commit: bool = False,
    registered: Callable[[Path], Any] | None = None,
    pages: Callable[[], list[Path]] | None = None,
) -> tuple[Path, dict[str, float]]:
    """Run the experiment's pilot (`train=False`: nothing; its page from the committed records alone):
    every arm at each pilot learning rate on the pilot seed, each arm's pick by `pilot_score` and the
    gate (held-out gain at the pick); if every arm passed and the pilot has `variance_seeds`, the picks
    on those seeds and the power calculation from their paired differences. Writes
    `<results>/<name>-pilot.md`; its runs' records go to `<results>/runs/<name>-pilot/`. The picks and
    the power calculation go into the experiment's YAML by hand, before its reported runs (which
    `compare` checks); the pilot's seeds are never reported ones. `arms` trains only those arms' runs
    of the first stage (the gap's arms first, say: if the gap fails, the others need not run); the page
    reads every run with a record, and the second stage waits for the whole first. `pages`: as in
    `compare`."""
    exp = load_experiment(spec)
    runs_dir = runs_dir or Path("runs/compare") / exp.name / "pilot"
    results = results or RESULTS
    records = results / "runs" / f"{exp.name}-pilot"
    runs = pilot_plan(exp, runs_dir)
    unknown = sorted(set(arms or ()) - set(piloted(exp)))
    if unknown:
        raise ValueError(f"{exp.name} pilot: arms {unknown} are not among its arms {piloted(exp)}")
    share = [r for r in runs if arms is None or r.arm.split("@")[0] in arms]
    stamp: dict[str, Any] = {}
    failures: list[str] = []
    if train:
        stamp = _stamp(exp, records, "pilot", amend, False, registered)
        log(
            f"{exp.name} pilot: {len(share)} of {len(runs)} runs ({pilot_seeds_text(exp)}; arms "
            f"{arms or 'all'}) in {runs_dir}; protocol {stamp['hash']}"
        )
        # the first stage's pick and gate read arm by arm, each run against its own step-0 score, so its
        # seeds may span machines where the protocol says so; the variance stage's pairs may not
        anywhere = exp.pilot.get("first_stage_any_machine", False)
        failures = _execute(
            exp,
            f"{exp.name} pilot",
            share,
            jobs,
            log,
            records,
            stamp,
            stop_at,
            commit,
            exp.same_machine and not anywhere,
            pages,
        )
    if failures:
        raise RuntimeError(f"{exp.name} pilot: failed runs:\n" + "\n".join(failures))
    picks, _, _, ok = picks_and_gate(exp, runs, records)
    stage2: list[Run] = []
    if ok and exp.pilot.get("variance_seeds") and not train:
        stage2 = [r for r in variance_plan(exp, runs_dir, picks) if has_record(r, records)]
    elif ok and exp.pilot.get("variance_seeds") and arms is not None:
        log(f"{exp.name} pilot: gate passed; its second stage runs without --arms (every arm at its pick)")
    elif ok and exp.pilot.get("variance_seeds"):
        stage2 = variance_plan(exp, runs_dir, picks)
        log(
            f"{exp.name} pilot: gate passed; {len(stage2)} runs at the picks on seeds "
            f"{exp.pilot['variance_seeds']}"
        )
        failures = _execute(
            exp, f"{exp.name} pilot variance", stage2, jobs, log, records, stamp, stop_at, commit, None, pages
        )
        if failures:
            raise RuntimeError(f"{exp.name} pilot: failed runs:\n" + "\n".join(failures))
    command = f"python -m studies compare {spec} --pilot --jobs {jobs}"
    return pilot_page(exp, runs, results, command, log, records=records, stage2=stage2)
