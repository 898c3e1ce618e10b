"""Experiment files for `otbrl compare`: arms (estimator, group size, learning rate, ...) x seeds over one
base recipe, the roles their arms play in the paper's claims, and the plan of `otbrl train` runs.

An experiment is a YAML file (packaged ones live in `otbrl/app/experiments/`):

    recipe: running_sum48          # base recipe for every run
    common: {max_steps: 100}       # overrides for every arm
    prompts_per_step: 8            # same prompt budget per step: batch = prompts_per_step x num_generations
    seeds: [0, 1, 2]
    reference: grpo-N32            # arm whose final reward sets the target (the claims' `reference` role)
    roles: {candidate: otb-N4, same_n_baseline: dr_grpo-N4}   # arms otbrl claims reads, by role
    arms:
      grpo-N4: {advantage_estimator: grpo, num_generations: 4}
      ...
    quick: {common: {max_steps: 3}, seeds: [0], arms: [grpo-N4, otb-N4]}   # what --quick changes
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from otbrl.app.studies.runs import Run

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


@dataclass
class Experiment:
    name: str
    recipe: str
    arms: dict[str, dict[str, Any]]
    seeds: list[int]
    reference: str | None = None
    # role -> an arm, a list of arms, or a mapping to more of them (see `arm_names`); read by otbrl claims
    roles: dict[str, Any] = field(default_factory=dict)
    common: dict[str, Any] = field(default_factory=dict)
    # --quick's overrides: they win over every arm's own (an arm's max_steps must not undo a smoke run)
    forced: dict[str, Any] = field(default_factory=dict)
    prompts_per_step: int | None = None
    target_fraction: float = 0.9
    collapse_fraction: float = 0.5
    smooth: int = 9  # steps in the centred moving average of the train reward ...
    smooth_samples: int | None = None  # ... or as many steps as hold this many samples (per arm)
    description: str = ""

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
    known = {f for f in Experiment.__dataclass_fields__ if f != "name"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"experiment {path}: unknown key {unknown[0]!r} (keys: {', '.join(sorted(known))})")
    for key in ("recipe", "arms", "seeds"):
        if key not in raw:
            raise ValueError(f"experiment {path}: missing key {key!r}")
    exp = Experiment(name=path.stem, **raw)
    _check_roles(path, exp)  # against every arm: a quick run drops some, the roles stay
    if quick:
        _apply_quick(path, exp, quick_section)
    if exp.reference is not None and exp.reference not in exp.arms:
        raise ValueError(f"experiment {path}: reference {exp.reference!r} is not an arm")
    return exp


def plan(exp: Experiment, out: Path) -> list[Run]:
    """One Run per (arm, seed), with the overrides that make it (recipe keys, as `otbrl train` takes)."""
    from otbrl.app.recipe import load_recipe

    runs = []
    for arm, arm_overrides in exp.arms.items():
        for seed in exp.seeds:
            overrides = {**exp.common, **(arm_overrides or {}), **exp.forced}
            if exp.prompts_per_step and "per_device_train_batch_size" not in overrides:
                n = overrides.get("num_generations") or load_recipe(exp.recipe)["num_generations"]
                overrides["per_device_train_batch_size"] = exp.prompts_per_step * int(n)
            run_dir = out / arm / f"seed{seed}"
            overrides.update(seed=seed, output_dir=str(run_dir), plot=False)
            overrides.setdefault("threads", 1)  # parallel runs: one thread each gets more done
            load_recipe(exp.recipe, overrides)  # a bad key fails now, not after an hour of runs
            runs.append(Run(arm, seed, run_dir, overrides))
    return runs
