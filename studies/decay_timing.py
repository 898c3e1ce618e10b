"""When would the length-surge LR decay have fired, relative to the collapses the ladder recorded?

The ladder's LR-decay arms run exactly as their base arms until the detector's first trigger, so replaying
`otbrl.stability.LengthSurgeDecay` on a base run's recorded mean lengths gives the step it would have
fired at, for the ladder's own settings and for more sensitive ones, without training again. Counted over
the base runs (every arm that is not an LR-decay variant): among the runs that collapsed, how many the
detector would have caught in time (a trigger at or before the collapse step), late, or never; among
those that did not, how many it would have fired on anyway. This measures the detector's timing only: a
trigger in time is necessary, not sufficient, for the decay to prevent a collapse.

Regenerate (from the repo root, after `python -m studies compare ladder`):
    python -m studies.decay_timing    # reads the committed run records (docs/results/runs/ladder/),
                                         # else runs/compare/ladder; writes docs/results/decay_timing.md
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from otbrl.stability import LengthSurgeDecay
from studies.experiment import load_experiment, plan
from studies.outcomes import analyse, split
from studies.pages import markdown_table

ROOT = Path(__file__).resolve().parents[1]
# (label, overrides of the ladder's own detector settings): its own first, then more sensitive ones
SETTINGS = [
    ("the ladder's (zscore 3, threshold 1.25)", {}),
    ("zscore 2", {"zscore": 2.0}),
    ("zscore 1.5", {"zscore": 1.5}),
    ("zscore 0 (threshold alone)", {"zscore": 0.0}),
    ("zscore 0, threshold 1.1", {"zscore": 0.0, "threshold": 1.1}),
]


def first_trigger(lengths: list[float], settings: dict[str, Any]) -> int | None:
    """The 1-based step at which a fresh detector first fires on this series of mean lengths, or None."""
    detector = LengthSurgeDecay(**settings)
    for step, length in enumerate(lengths, start=1):
        detector.step(length)
        if detector.triggers:
            return step
    return None


def detector_settings(exp: Any, variant: str) -> dict[str, Any]:
    """The LengthSurgeDecay arguments a decay arm of the experiment trained with: its length_decay_* keys
    over the trainer config's defaults, read the way the trainer reads them."""
    from otbrl.integrations.trl.config import OTBGRPOConfig

    own = next(options for arm, options in exp.arms.items() if split(arm)[0] == variant)
    keys = {k: v for k, v in {**exp.common, **own}.items() if k.startswith("length_decay")}
    with tempfile.TemporaryDirectory() as tmp:
        options = OTBGRPOConfig(output_dir=tmp, use_cpu=True, report_to=[], **keys).length_decay_options()
    options.pop("on_grad_surge")  # the replay sees lengths only
    return options


def timing(runs: dict[str, list[dict[str, Any]]], settings: dict[str, Any]) -> dict[str, Any]:
    """Counts over runs ({arm: [analysed run]}, each with steps, length, collapse)."""
    caught, late, never, false, quiet, leads = 0, 0, 0, 0, 0, []
    for arm_runs in runs.values():
        for r in arm_runs:
            fired = first_trigger(r["length"], settings)
            step = None if fired is None else r["steps"][fired - 1]
            if r["collapse"] is None:
                false, quiet = false + (step is not None), quiet + (step is None)
            elif step is not None and step <= r["collapse"]:
                caught += 1
                leads.append(r["collapse"] - step)
            else:
                late, never = late + (step is not None), never + (step is None)
    return {
        "caught": caught,
        "late": late,
        "never": never,
        "false": false,
        "quiet": quiet,
        "lead": statistics.median(leads) if leads else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="ladder")
    parser.add_argument("--runs", type=Path, default=None, help="default runs/compare/EXPERIMENT")
    parser.add_argument(
        "--records",
        type=Path,
        default=None,
        help="committed run records (default docs/results/runs/EXPERIMENT)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "decay_timing.md")
    args = parser.parse_args()
    exp = load_experiment(args.experiment)
    variants = set((exp.roles.get("lr_decay") or {}).values())
    if not variants:
        raise SystemExit(f"{args.experiment}: no lr_decay role, nothing to replay")
    runs_dir = args.runs or Path("runs") / "compare" / exp.name
    records = args.records or ROOT / "docs" / "results" / "runs" / exp.name
    result = analyse(exp, plan(exp, runs_dir), records)
    base_runs = {arm: rs for arm, rs in result["runs"].items() if split(arm)[0] not in variants}
    if not base_runs:
        raise SystemExit(
            f"no finished runs under {runs_dir}: run `python -m studies compare {args.experiment}` first"
        )
    own = detector_settings(exp, sorted(variants)[0])
    rows = []
    for label, overrides in SETTINGS:
        t = timing(base_runs, {**own, **overrides})
        collapsed = t["caught"] + t["late"] + t["never"]
        lead = "—" if t["lead"] is None else f"{t['lead']:g}"
        rows.append(
            [
                label,
                f"{t['caught']}/{collapsed}",
                t["late"],
                t["never"],
                f"{t['false']}/{t['false'] + t['quiet']}",
                lead,
            ]
        )
    n = sum(len(rs) for rs in base_runs.values())
    text = "\n".join(
        [
            "# Would the length-surge LR decay have fired before the collapses?",
            "",
            __doc__.split("\n\n")[1].replace("\n", " "),
            "",
            f"Regenerate: `python -m studies.decay_timing` (from the committed run records in "
            f"`docs/results/runs/{exp.name}/`, after `python -m studies compare {exp.name}`). Replayed on "
            f"the {n} base runs of `{exp.name}` (arms {', '.join(sorted(base_runs))}); detector settings of "
            f"the decay arms: {', '.join(f'{k} {v}' for k, v in sorted(own.items()))}, with the overrides "
            "named in each row.",
            "",
            markdown_table(
                [
                    "detector",
                    "collapsed runs caught in time",
                    "fired late",
                    "never fired",
                    "fired without a collapse",
                    "median lead (steps)",
                ],
                rows,
                aligned=False,
            ),
            "",
        ]
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
