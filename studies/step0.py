"""`python -m studies step0`: seeds' step-0 held-out scores, computed ahead of their runs.

Every run of a seed starts from the same step-0 evaluation (smollm2c: 1,024 multi-turn samples, 28 CPU
minutes). The runs share it through a cache keyed by everything the score depends on
(`otbrl/app/heldout_cache.py`), kept beside the records per kind of machine (`runs.step0_file`) so that a
new checkout reuses it. A machine whose next run could not finish before it is taken away (a session's
last hour) can compute the scores of seeds still to run instead: each is a run with `eval_before_only`,
the path a run takes to its score, stopped there (tests/app/test_eval_before_only.py: the same key and
number, and a run reusing it trains the same steps).

    python -m studies step0 smollm2c --pilot --seeds 103-105   # the pilot's variance seeds
    python -m studies step0 smollm2c --seeds 0-15              # reported seeds (at least 16 will run)
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from otbrl.app.heldout_cache import EVAL_BEFORE_FILE
from studies.experiment import _run, load_experiment, pilot_plan, pilot_seeds
from studies.pages import RESULTS
from studies.runs import (
    Run,
    _train,
    commit_files,
    environment,
    keep_step0_scores,
    missing_models,
    seed_step0_cache,
    step0_file,
)


def step0_run(exp: Any, runs_dir: Path, seed: int, pilot: bool) -> Run:
    """A run of `seed` with the settings the experiment's runs of it get (a pilot's: its first planned
    run's, the pilot's own eval settings included; the score depends on neither arm nor rate unless an arm
    changes what it reads, and then the key differs and the score is not found), set to stop after its
    step-0 score, in `runs_dir/step0/seed<seed>`."""
    arm = next(iter(exp.arms))
    template = pilot_plan(exp, runs_dir)[0] if pilot else _run(exp, runs_dir, arm, seed)
    folder = runs_dir / "step0" / f"seed{seed}"
    overrides = {**template.overrides, "seed": seed, "output_dir": str(folder), "eval_before_only": True}
    return Run("step0", seed, folder, overrides)


def ahead(
    spec: str,
    seeds: list[int],
    *,
    pilot: bool = False,
    jobs: int = 2,
    runs_dir: Path | None = None,
    results: Path | None = None,
    log: Callable[[str], Any] = print,
    commit: bool = False,
) -> list[str]:
    """Compute (or find) the step-0 held-out score of each of `seeds` on this machine, `jobs` at a time,
    into the runs' shared cache and beside the records (`runs.keep_step0_scores`). A pilot's seeds must be
    among its own (first stage and variance seeds). `commit`: the scores file is committed as each lands.
    Returns one line per failed seed."""
    exp = load_experiment(spec)
    if pilot:
        known = [*pilot_seeds(exp), *[int(s) for s in exp.pilot.get("variance_seeds", [])]]
        if not set(seeds) <= set(known):
            raise ValueError(
                f"{exp.name} pilot: seeds {sorted(set(seeds) - set(known))} are not its seeds {known}"
            )
    seeds = sorted(set(seeds))  # one process a seed: two in one folder would tear each other's files
    if not seeds or min(seeds) < 0:
        raise ValueError(f"step0: give the seeds (non-negative), got {seeds}")
    base = Path("runs/compare") / exp.name
    runs_dir = runs_dir or (base / "pilot" if pilot else base)
    records = (results or RESULTS) / "runs" / (f"{exp.name}-pilot" if pilot else exp.name)
    cache = runs_dir / ".heldout-before"  # the folder the experiment's own runs share
    env = environment()
    seed_step0_cache(cache, records, env)
    todo = [step0_run(exp, runs_dir, s, pilot) for s in seeds]
    missing = missing_models(exp.recipe, todo)
    if missing:
        raise RuntimeError("; ".join(missing))
    log(f"{exp.name}: step-0 held-out scores of seeds {seeds} into {step0_file(records, env)}")
    failures: list[str] = []
    lock = threading.Lock()

    def one(run: Run) -> None:
        code, failure = _train(exp.recipe, run, cache)
        if failure:
            failures.append(failure)
            return
        summary = json.loads((run.dir / EVAL_BEFORE_FILE).read_text())
        found = " (found: computed before)" if summary.get("reused") else ""
        log(f"seed {run.seed}: step-0 held-out score {summary['held-out reward before']:.3f}{found}")
        with lock:
            keep_step0_scores(cache, records, env)
            if commit:
                commit_files([step0_file(records, env)], f"{exp.name}: step-0 score of seed {run.seed}", log)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(one, todo))
    return failures
