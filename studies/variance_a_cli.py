"""`python -m studies variance-a [--study NAME]`: measure a registered study of claim (a) (resuming) and write
its page. The study itself is `studies.variance_a`, its page `studies.variance_a_page`."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from studies.pages import RESULTS, write_record
from studies.variance_a import (
    NAME,
    STUDIES,
    Study,
    check_power,
    help_cell,
    load_policy,
    load_records,
    power_plan,
    protocol_path,
    record_path,
    register_stage,
    run_cell,
)
from studies.variance_a_page import write_registered_page


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--study", default=NAME, choices=STUDIES, help=f"the registered study (default {NAME})"
    )
    parser.add_argument("--pilot", action="store_true", help="run the pilot and print its power calculation")
    parser.add_argument("--no-run", action="store_true", help="measure nothing: the page from committed data")
    parser.add_argument("--quick", action="store_true", help="a smoke run (one cell, a few batches, runs/)")
    parser.add_argument(
        "--cells", help="measure only these cells (comma-separated names): one machine's share"
    )
    parser.add_argument("--results", type=Path, help="where the data and page go (default docs/results)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--store-gb",
        type=float,
        help="disk a cell's stored gradients may take (default: all but 10 GB of the free space); the "
        "batches beyond it are measured again for their sums (same numbers, more time)",
    )
    parser.add_argument(
        "--amend", metavar="REASON", help="go on although the protocol changed since it was registered"
    )
    parser.add_argument(
        "--helper",
        action="store_true",
        help="help the process measuring the one cell of --cells on this machine with its second pass "
        "(start it once that process's first pass is done, with the same --threads): the same sums in "
        "less wall time",
    )


def main(args: argparse.Namespace, log: Callable[[str], Any] = print) -> Path:
    """Run the stage asked for (resuming), then write the page from the committed data."""
    study = Study.load(protocol_path(getattr(args, "study", NAME)), quick=args.quick)
    results = args.results or (Path(f"runs/{study.name}-quick/results") if args.quick else RESULTS)
    data = results / study.name
    scratch = Path(f"runs/{study.name}-quick" if args.quick else f"runs/{study.name}")
    stage = "pilot" if args.pilot else "main"
    if stage == "pilot" and study.raw.get("pilot_from"):
        raise ValueError(
            f"{study.name}: its pilot is {study.raw['pilot_from']}'s (pilot_from): nothing to run"
        )
    if getattr(args, "helper", False):
        return _help(study, stage, args, data, scratch, log)
    if not args.no_run:
        stamp = register_stage(study, data, stage, args.amend)
        if stage == "main" and not args.quick:
            check_power(study, data)
        wanted = set(args.cells.split(",")) if args.cells else None
        torch.set_num_threads(args.threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
        todo = [
            c
            for c in study.cells()
            if (wanted is None or c.name in wanted) and not record_path(data, stage, c).is_file()
        ]
        policies: dict[tuple[str, str], Any] = {}
        for cell in todo:
            key = (cell.task, cell.checkpoint)
            if key not in policies:
                policies.clear()  # one policy in memory at a time
                policies[key] = load_policy(study, cell.task, cell.checkpoint, data, scratch, log)
            record = run_cell(
                study, stage, cell, policies[key], stamp, scratch, args.threads, log, args.store_gb
            )
            write_record(record_path(data, stage, cell), record)
            shutil.rmtree(scratch / stage / cell.name, ignore_errors=True)
            log(f"wrote {record_path(data, stage, cell)}")
    if stage == "pilot" and not args.quick and len(load_records(study, data, "pilot")) == len(study.cells()):
        plan = power_plan(study, load_records(study, data, "pilot"))
        log("power calculation (write into the YAML's power section, commit, then run the main stage):")
        log("power: " + json.dumps({"k": plan["k"]}))
    page = write_registered_page(study, results, data)
    log(f"wrote {page}")
    return page


def _help(
    study: Study, stage: str, args: argparse.Namespace, data: Path, scratch: Path, log: Callable[[str], Any]
) -> Path:
    """`--helper`: one cell's second pass shared with its main process; writes no record and no page."""
    cells = [c for c in study.cells() if args.cells and c.name in args.cells.split(",")]
    if len(cells) != 1 or args.no_run:
        raise ValueError("--helper: name exactly one cell with --cells (the one its main process measures)")
    stamp = register_stage(study, data, stage, args.amend)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    (cell,) = cells
    policy = load_policy(study, cell.task, cell.checkpoint, data, scratch, log)
    help_cell(study, stage, cell, policy, stamp, scratch, args.threads, log)
    return scratch / stage / cell.name
