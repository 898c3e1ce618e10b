"""Experiment files for `python -m studies compare`: arms (estimator, group size, learning rate, ...) x seeds
over one base recipe, the roles their arms play in the paper's claims, and the plan of `otbrl train` runs.

An experiment is a YAML file (packaged ones live in `studies/experiments/`):

    recipe: running_sum48          # base recipe for every run
    common: {max_steps: 100}       # overrides for every arm
    prompts_per_step: 8            # same prompt budget per step: batch = prompts_per_step x num_generations
    seeds: [0, 1, 2]
    reference: grpo-N32            # the arm the others are measured against (the `reference` role)
    roles: {candidate: otb-N4, same_n_baseline: dr_grpo-N4}   # arms python -m studies claims reads, by role
    arms:
      grpo-N4: {advantage_estimator: grpo, num_generations: 4}
      ...
    quick: {common: {max_steps: 3}, seeds: [0], arms: [grpo-N4, otb-N4]}   # what --quick changes

The fair protocol's keys, fixed before the runs:

    arms: {grpo-N32: {..., seeds: [0, 1, 2]}}     # an arm's own seeds (a subset of `seeds`)
    pilot: {seed: 100, learning_rates: [1.0e-4, 3.0e-4]}   # `studies compare NAME --pilot` picks each
                                                   # arm's learning rate on this seed (never reported);
                                                   # an arm's `pilot_learning_rates` replace the list;
                                                   # `token_factor` scales each arm's token budget
    ladder: [3.0e-4, 1.0e-3]                       # every arm at every learning rate (arm@lr); an
                                                   # arm's own `ladder: [...]` climbs part of it
    thresholds: [0.45, 0.55]                       # absolute train rewards for tokens-to-threshold
    comparisons:                                   # paired per-seed differences with CIs (see verdicts)
      - {name: n4, candidate: otb-N4, baseline: grpo-N4, budgets: [100000, 200000],
         primary: 200000}                          # the one endpoint the verdict is read from (held-out
                                                   # reward at this budget); the others are secondary
    pilot: {..., gate: {heldout_gain: 0.05, arms: {grpo-N32: 0.15}},   # every arm must learn: held-out
            variance_seeds: [101, 102, 103]}       # gain at its picked rate; then the picked rates on
                                                   # these seeds give the variance the power needs
    pilot: {..., gate: {..., phenomenon: true}}    # and each comparison's `phenomenon` floors over its
                                                   # two arms' first-stage runs at their picks
    pilot: {..., first_stage_any_machine: true}    # with same_machine: the first stage's seeds may span
                                                   # machines (its pick and gate read arm by arm); the
                                                   # variance seeds and reported seeds keep one a seed
    power: {power: 0.8, effect: 0.03, sd: ..., seeds: ...}   # filled from the pilot's page, checked
    power: {min_seeds: 16}                         # a floor fixed before the pilot: `seeds` must meet it
    dropped: {"N=4 vs N=32": "why"}                # comparisons left out of the claims before the runs

The protocol (the whole file but `description` and `quick`) is registered when the first run starts and
every run records its hash (`runs`); a later change needs `python -m studies compare NAME --amend REASON`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from otbrl.app.recipe import load_recipe
from studies.runs import Run

EXPERIMENTS = Path(__file__).resolve().parent / "experiments"
# An arm's keys that are the experiment's, not recipe overrides: its own seeds, ladder rungs and pilot rates
ARM_KEYS = ("seeds", "ladder", "pilot_learning_rates")
# A pilot's keys that are the experiment's; any other key of `pilot:` is a recipe override for its runs
PILOT_KEYS = (
    "seed",
    "seeds",
    "pick",
    "learning_rates",
    "token_factor",
    "gate",
    "variance_seeds",
    "power",
    "first_stage_any_machine",
)


@dataclass
class Experiment:
    name: str
    recipe: str
    arms: dict[str, dict[str, Any]]
    seeds: list[int]
    reference: str | None = None
    # role -> an arm, a list of arms, or a mapping to more of them (see `arm_names`); read by studies claims
    roles: dict[str, Any] = field(default_factory=dict)
    common: dict[str, Any] = field(default_factory=dict)
    # --quick's overrides: they win over every arm's own (an arm's max_steps must not undo a smoke run)
    forced: dict[str, Any] = field(default_factory=dict)
    prompts_per_step: int | None = None
    collapse_fraction: float = 0.5
    smooth: int = 9  # steps in the centred moving average of the train reward ...
    smooth_samples: int | None = None  # ... or as many steps as hold this many samples (per arm)
    description: str = ""
    pilot: dict[str, Any] | None = None
    ladder: list[float] | None = None
    thresholds: list[float] = field(default_factory=list)
    comparisons: list[dict[str, Any]] = field(default_factory=list)
    confidence: float = 0.95
    # collapse: the trailing mean reward below collapse_fraction x its starting level for this many
    # consecutive steps (a window that the run's end truncates does not count)
    collapse_steps: int = 10
    surge_factor: float = 3.0  # surge: smoothed pre-clip grad norm > factor x its trailing median
    # the power calculation (from the pilot's variance): `seeds` per compared arm, filled in by hand from the
    # pilot's page; `min_seeds`, a floor fixed before the pilot (issue 34: at least 16) that `seeds` must meet
    power: dict[str, Any] | None = None
    # what the protocol leaves out of its claims, decided before its runs: {what: why}, on the page and in
    # claims.md (smollm2c: the N=32 comparison, out of reach here)
    dropped: dict[str, str] = field(default_factory=dict)
    # the phenomenon the claims are about, as it must show in the compared runs, e.g. {length_cv_run: 0.3}
    # (each run's mean of the within-group length CV over its steps, averaged over the compared arms' runs:
    # `outcomes.phenomenon_missing`; runs of unequal step counts weigh alike); a verdict needs it
    phenomenon: dict[str, float] = field(default_factory=dict)
    # whole seeds on one kind of machine (issue 34): an arm of a seed trains only where the seed's other
    # arms did (device, CPU's native bf16, architecture, torch/transformers/trl), so every pair starts from
    # the same step-0 score
    same_machine: bool = False
    # not YAML keys: the parsed file (its protocol is hashed) and where it came from
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    source: Path | None = None

    def arm_seeds(self, arm: str) -> list[int]:
        """The seeds arm `arm` runs: its own `seeds` (kept within the experiment's), else the experiment's."""
        own = (self.arms[arm] or {}).get("seeds")
        return [s for s in self.seeds if own is None or s in own]

    def role(self, name: str) -> Any:
        """The arm(s) cast in claim role `name`; `reference` is the experiment's reference arm."""
        value = self.reference if name == "reference" else self.roles.get(name)
        if value is None:
            given = ", ".join(["reference"] * bool(self.reference) + list(self.roles)) or "none"
            raise ValueError(
                f"experiment {self.name}: no arm has the role {name!r} (roles named: {given}); "
                f"add it under `roles:` in {self.name}.yaml"
            )
        return value


def arm_names(value: Any) -> Iterator[str]:
    """Every arm named in a role's value: an arm, a list of them, or a mapping whose values are either."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from arm_names(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from arm_names(item)
    else:
        raise ValueError(f"roles: {value!r} is not an arm name, a list or a mapping")


def experiment_names() -> list[str]:
    return sorted(p.stem for p in EXPERIMENTS.glob("*.yaml"))


def _check_roles(path: Path, exp: Experiment) -> None:
    if not isinstance(exp.roles, dict):
        raise ValueError(f"experiment {path}: roles must map role names to arms")
    if "reference" in exp.roles:
        raise ValueError(f"experiment {path}: roles: give the reference arm as the top-level `reference`")
    for role, value in exp.roles.items():
        for arm in arm_names(value):
            if arm not in exp.arms:
                raise ValueError(f"experiment {path}: role {role!r} names {arm!r}, which is not an arm")


def _expand_ladder(path: Path, exp: Experiment) -> None:
    """Every arm at every learning rate of the ladder, named arm@lr."""
    if not exp.ladder:
        return
    arms = {}
    for arm, overrides in exp.arms.items():
        overrides = dict(overrides or {})
        if "learning_rate" in overrides:
            raise ValueError(f"experiment {path}: arm {arm!r} sets learning_rate; the ladder sets it")
        rungs = overrides.pop("ladder", exp.ladder)  # an arm may climb only part of the ladder
        for lr in rungs:
            arms[f"{arm}@{float(lr):g}"] = {**overrides, "learning_rate": float(lr)}
    exp.arms = arms


def _check_protocol(path: Path, exp: Experiment) -> None:
    for arm, overrides in exp.arms.items():
        own = (overrides or {}).get("seeds")
        if own is not None and not set(own) <= set(exp.seeds):
            raise ValueError(f"experiment {path}: arm {arm!r}: seeds {own} are not all among {exp.seeds}")
    for i, c in enumerate(exp.comparisons):
        for key in ("name", "candidate", "baseline"):
            if key not in c:
                raise ValueError(f"experiment {path}: comparisons[{i}] needs {key!r}")
        for key in ("candidate", "baseline"):
            if c[key] not in exp.arms:
                raise ValueError(f"experiment {path}: comparisons[{i}]: {c[key]!r} is not an arm")
        if "primary" in c and int(c["primary"]) not in [int(b) for b in c.get("budgets", [])]:
            raise ValueError(
                f"experiment {path}: comparisons[{i}]: primary {c['primary']} is not one of "
                f"its budgets {c.get('budgets', [])}"
            )
    if not 0 < exp.confidence < 1:
        raise ValueError(f"experiment {path}: confidence must be in (0, 1), got {exp.confidence}")
    if exp.pilot is not None:
        if not isinstance(exp.pilot, dict) or "seed" not in exp.pilot or not exp.pilot.get("learning_rates"):
            raise ValueError(f"experiment {path}: pilot needs a seed and learning_rates")
        seeds = exp.pilot.get("seeds", [exp.pilot["seed"]])
        if exp.pilot["seed"] not in seeds or len(set(seeds)) != len(seeds):
            raise ValueError(f"experiment {path}: pilot: seeds must be distinct and hold the pilot seed")
        if exp.pilot.get("pick", "train") not in ("train", "heldout"):
            raise ValueError(f"experiment {path}: pilot: pick must be train or heldout")
        if not isinstance(exp.pilot.get("first_stage_any_machine", False), bool):
            raise ValueError(f"experiment {path}: pilot: first_stage_any_machine must be true or false")
        pilot_seeds = [*seeds, *exp.pilot.get("variance_seeds", [])]
        if set(pilot_seeds) & set(exp.seeds):
            both = ", ".join(map(str, sorted(set(pilot_seeds) & set(exp.seeds))))
            raise ValueError(f"experiment {path}: the pilot seed {both} is also a reported seed")
        gate = exp.pilot.get("gate")
        if gate is not None:
            if not isinstance(gate, dict) or "heldout_gain" not in gate:
                raise ValueError(f"experiment {path}: pilot: gate needs heldout_gain (and optional arms)")
            for arm in gate.get("arms", {}) or {}:
                if arm not in exp.arms:
                    raise ValueError(f"experiment {path}: pilot: gate names {arm!r}, which is not an arm")
            gap = gate.get("gap")
            if gap is not None:
                if not isinstance(gap, dict) or set(gap) != {"larger", "smaller", "margin"}:
                    raise ValueError(f"experiment {path}: pilot: gate gap needs larger, smaller and margin")
                for role in ("larger", "smaller"):
                    if gap[role] not in exp.arms:
                        raise ValueError(
                            f"experiment {path}: pilot: gate gap {role} {gap[role]!r} is not an arm"
                        )
            if not isinstance(gate.get("phenomenon", False), bool):
                raise ValueError(f"experiment {path}: pilot: gate phenomenon must be true or false")
            if gate.get("phenomenon") and not (exp.phenomenon and exp.comparisons):
                raise ValueError(
                    f"experiment {path}: pilot: gate phenomenon needs the protocol's phenomenon floors "
                    "and comparisons to read them over"
                )
            unpiloted = {
                a
                for c in exp.comparisons
                for a in (c["candidate"], c["baseline"])
                if (exp.arms.get(a) or {}).get("pilot_learning_rates") == []
            }
            if gate.get("phenomenon") and unpiloted:
                raise ValueError(
                    f"experiment {path}: pilot: gate phenomenon reads every compared arm's pilot runs, and "
                    f"{', '.join(sorted(unpiloted))} has none (pilot_learning_rates: [])"
                )
    if not isinstance(exp.dropped, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in exp.dropped.items()
    ):
        raise ValueError(f"experiment {path}: dropped maps what the claims leave out to why (text)")
    if exp.power is not None:
        if not isinstance(exp.power, dict) or not {"seeds", "min_seeds"} & set(exp.power):
            raise ValueError(f"experiment {path}: power needs seeds (the seeds per arm it calls for)")
        floor = int(exp.power.get("min_seeds", 0))
        seeds = int(exp.power.get("seeds", 0))
        # a floor alone: the pilot's calculation is not written in yet, so no reported seed may be planned
        if "seeds" not in exp.power and exp.seeds:
            raise ValueError(
                f"experiment {path}: power has a floor ({floor} seeds) but no seeds from the pilot's "
                "power calculation, and the experiment plans reported seeds"
            )
        if "seeds" in exp.power and seeds < floor:
            raise ValueError(
                f"experiment {path}: power calls for {seeds} seeds, under the protocol's floor of {floor} "
                "(min_seeds)"
            )
        few = [a for a in exp.arms if len(exp.arm_seeds(a)) < seeds]
        compared = {c[k] for c in exp.comparisons for k in ("candidate", "baseline")}
        few = [a for a in few if a in compared]
        if few:
            raise ValueError(
                f"experiment {path}: power calls for {seeds} seeds per compared "
                f"arm; {', '.join(few)} {'has' if len(few) == 1 else 'have'} fewer"
            )


def _apply_quick(path: Path, exp: Experiment, section: dict[str, Any]) -> None:
    exp.forced = dict(section.get("common", {}))
    exp.seeds = list(section.get("seeds", exp.seeds[:1]))
    keep = section.get("arms")
    if keep:
        missing = [a for a in keep if a not in exp.arms]
        if missing:
            raise ValueError(f"experiment {path}: quick arm {missing[0]!r} is not an arm")
        exp.arms = {a: exp.arms[a] for a in keep}
    if exp.reference not in exp.arms:
        exp.reference = None
    exp.smooth, exp.smooth_samples = section.get("smooth", 1), None


def load_experiment(spec: str, quick: bool = False) -> Experiment:
    """An experiment file (or a packaged experiment by name); `quick` applies its `quick` section."""
    path = Path(spec)
    if not path.is_file():
        path = EXPERIMENTS / f"{spec}.yaml"
        if not path.is_file():
            raise ValueError(
                f"experiment: no file {spec!r} and no packaged experiment of that name "
                f"({', '.join(experiment_names())})"
            )
    raw = yaml.safe_load(path.read_text()) or {}
    quick_section = raw.pop("quick", {}) or {}
    known = {f for f in Experiment.__dataclass_fields__ if f not in ("name", "raw", "source")}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"experiment {path}: unknown key {unknown[0]!r} (keys: {', '.join(sorted(known))})")
    for key in ("recipe", "arms", "seeds"):
        if key not in raw:
            raise ValueError(f"experiment {path}: missing key {key!r}")
    exp = Experiment(name=path.stem, **raw, raw=copy.deepcopy(raw), source=path)
    _check_roles(path, exp)  # against every arm (before a ladder): a quick run drops some, roles stay
    _expand_ladder(path, exp)
    _check_protocol(path, exp)
    if quick:
        _apply_quick(path, exp, quick_section)
    if exp.reference is not None and exp.reference not in exp.arms:
        raise ValueError(f"experiment {path}: reference {exp.reference!r} is not an arm")
    return exp


def plan(exp: Experiment, out: Path) -> list[Run]:
    """One Run per (arm, seed), with the overrides that make it (recipe keys, as `otbrl train` takes).
    Seed by seed, so that an experiment stopped part way holds complete pairs to compare."""
    return [_run(exp, out, arm, seed) for seed in exp.seeds for arm in exp.arms if seed in exp.arm_seeds(arm)]


def piloted(exp: Experiment) -> list[str]:
    """The arms the pilot runs and gates: all but those with `pilot_learning_rates: []`, whose rate an
    amendment fixed after the pilot (listed in the YAML with its reason)."""
    return [arm for arm in exp.arms if (exp.arms[arm] or {}).get("pilot_learning_rates") != []]


def pilot_plan(exp: Experiment, out: Path) -> list[Run]:
    """The pilot: every arm at each of the pilot's learning rates, on each pilot seed (arm@lr)."""
    if not exp.pilot:
        raise ValueError(f"experiment {exp.name}: no `pilot:` section")
    runs = []
    extra = {k: v for k, v in exp.pilot.items() if k not in PILOT_KEYS}
    for arm in exp.arms:
        budget = {**exp.common, **(exp.arms[arm] or {})}.get("max_generated_tokens")
        if budget and "token_factor" in exp.pilot:  # the pilot's budget, as a multiple of the arm's
            extra = {**extra, "max_generated_tokens": round(budget * exp.pilot["token_factor"])}
        for lr in (exp.arms[arm] or {}).get("pilot_learning_rates", exp.pilot["learning_rates"]):
            name = f"{arm}@{float(lr):g}"
            for seed in pilot_seeds(exp):
                runs.append(_run(exp, out, arm, seed, {"learning_rate": float(lr), **extra}, name))
    return runs


def pilot_seeds(exp: Experiment) -> list[int]:
    """The seeds each pilot rate runs on: `pilot.seeds` (issue 33: at least 3, so that a pick is not one
    seed's luck), else the one `pilot.seed` of older protocols."""
    pilot = exp.pilot or {}
    return [int(s) for s in pilot.get("seeds", [pilot.get("seed")])]


def variance_plan(exp: Experiment, out: Path, picks: dict[str, float]) -> list[Run]:
    """The pilot's second stage: every arm at its picked rate on each of the pilot's `variance_seeds`
    (named arm@lr like the first stage), whose paired differences give the power calculation its SD."""
    extra = {k: v for k, v in exp.pilot.items() if k not in PILOT_KEYS}
    return [
        _run(
            exp, out, arm, seed, {"learning_rate": float(picks[arm]), **extra}, f"{arm}@{float(picks[arm]):g}"
        )
        for arm in piloted(exp)
        for seed in exp.pilot.get("variance_seeds", [])
    ]


def _run(
    exp: Experiment,
    out: Path,
    arm: str,
    seed: int,
    extra: dict[str, Any] | None = None,
    name: str | None = None,
) -> Run:
    name = name or arm
    arm_overrides = {k: v for k, v in (exp.arms[arm] or {}).items() if k not in ARM_KEYS}
    overrides = {**exp.common, **arm_overrides, **(extra or {}), **exp.forced}
    if exp.prompts_per_step and "per_device_train_batch_size" not in overrides:
        n = overrides.get("num_generations") or load_recipe(exp.recipe)["num_generations"]
        overrides["per_device_train_batch_size"] = exp.prompts_per_step * int(n)
    run_dir = out / name / f"seed{seed}"
    overrides.update(seed=seed, output_dir=str(run_dir), plot=False)
    overrides.setdefault("threads", 1)  # parallel runs: one thread each gets more done
    load_recipe(exp.recipe, overrides)  # a bad key fails now, not after an hour of runs
    return Run(name, seed, run_dir, overrides)
