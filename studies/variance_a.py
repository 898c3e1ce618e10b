"""`python -m studies variance-a`: claim (a), the mechanism, decided under a registered protocol.

Does OTB's policy gradient carry less noise relative to its signal than the group mean's, on the same
samples? The protocol is `studies/experiments/variance/variance-a.yaml` (its comments give the design and
the rules); this module runs it and reads its data:

1. `--pilot`: registers the pilot's protocol (everything but the `power:` section the pilot decides, in
   docs/results/variance-a/pilot/protocol.json), builds the RL checkpoints the YAML names if they are not
   committed yet, measures every cell at the pilot's K and prints the power calculation, whose K per cell
   goes into the YAML's `power:` by hand (committed before the main runs).
2. no flag: registers the whole protocol (docs/results/variance-a/main/protocol.json), checks that `power:`
   holds what the rule gives on the committed pilot data, measures every cell at its K, writes the page.
3. `--no-run`: the page, the power calculation and the verdict from the committed data alone.

A cell is one (task, checkpoint, N). Its batches have their own seeds, so a stopped cell resumes from its
scratch folder (runs/variance-a/, not committed; `cell_sums` bounds its disk); a finished cell's record (gzip
JSON: per-batch descriptions and, per estimator and position bucket, the per-batch sums `gradstats.RowSums`
that every interval is recomputed from) is written at once and committed. `mechanism_claim` gives the
verdict row of claim (a) for claims.md from the committed data.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from studies.cell_sums import BUCKETS, CellSums, Measure, batches_that_fit
from studies.experiment import EXPERIMENTS
from studies.gradstats import RatioInterval, RowSums, sums_nsr, sums_nsr_ratio, sums_variance_ratio
from studies.inference import HELD, INCONCLUSIVE, NOT_HELD, NOT_TESTED, power, scipy_stats
from studies.pages import RESULTS, machine, read_record
from studies.runs import ProtocolChanged, Run, _train, environment, protocol, protocol_hash, register

PROTOCOL = EXPERIMENTS / "variance" / "variance-a.yaml"
NAME = "variance-a"
STUDIES = ("variance-a", "variance-b")  # registered studies of claim (a), in order: a later one re-measures


def protocol_path(name: str) -> Path:
    """The YAML of a registered study of claim (a) (`STUDIES`)."""
    if name not in STUDIES:
        raise ValueError(f"study: one of {', '.join(STUDIES)}, got {name!r}")
    return EXPERIMENTS / "variance" / f"{name}.yaml"


STAGES = ("pilot", "main")
CLAIM = "(a) OTB lowers the policy gradient's noise (against the group-mean baseline, same samples)."


@dataclass(frozen=True)
class Cell:
    """One measurement: a task's checkpoint sampled in groups of n."""

    task: str
    checkpoint: str
    n: int

    @property
    def name(self) -> str:
        """File stem of its record and key in the YAML's `power.k`."""
        return f"{self.task}-{self.checkpoint}-N{self.n}"


@dataclass
class Study:
    """The parsed protocol (see the YAML's comments for what each part means)."""

    raw: dict[str, Any]
    source: Path | None
    seed: int
    candidate: str
    baseline: str
    group_sizes: list[int]
    tasks: dict[str, dict[str, Any]]
    checkpoints: dict[str, dict[str, Any]]
    pilot: dict[str, Any]
    verdict: dict[str, Any]
    power: dict[str, Any] | None = None
    quick: bool = False

    @classmethod
    def load(cls, path: Path = PROTOCOL, quick: bool = False) -> Study:
        raw = yaml.safe_load(path.read_text())
        known = {
            "description",
            "seed",
            "estimators",
            "group_sizes",
            "tasks",
            "checkpoints",
            "pilot",
            "pilot_from",
        }
        unknown = sorted(set(raw) - known - {"verdict", "power", "quick"})
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}")
        study = cls(
            raw=raw,
            source=path,
            seed=int(raw["seed"]),
            candidate=raw["estimators"]["candidate"],
            baseline=raw["estimators"]["baseline"],
            group_sizes=[int(n) for n in raw["group_sizes"]],
            tasks=raw["tasks"],
            checkpoints=raw["checkpoints"],
            pilot=raw["pilot"],
            verdict=raw["verdict"],
            power=raw.get("power"),
            quick=quick,
        )
        from studies.variance import SETTINGS  # torch-heavy module: only when a study is loaded

        for label in (study.candidate, study.baseline):
            if label not in SETTINGS or SETTINGS[label][2] == "exact":
                raise ValueError(f"{path}: estimators: {label!r} is not a proxy or energy-free setting")
        if quick:  # the smoke run: warm starts only (no training), a few batches, never the real data
            study.checkpoints = {k: v for k, v in study.checkpoints.items() if v["source"] == "shipped"}
            study.tasks = {t: study.tasks[t] for t in list(study.tasks)[:1]}
            study.group_sizes = study.group_sizes[:1]
            study.pilot = {**study.pilot, "k": {t: 4 for t in study.tasks}}
            study.power = {"k": {c.name: 5 for c in study.cells()}}
        return study

    @property
    def name(self) -> str:
        """The study's name: its YAML's stem (variance-a, variance-b)."""
        return self.source.stem

    def home(self, data: Path) -> Path:
        """Where the pilot records and trained checkpoints live: the study named by `pilot_from` (a study
        that re-measures with a larger K reuses its predecessor's pilot and checkpoints), else `data`."""
        source = self.raw.get("pilot_from")
        return data.parent / source if source else data

    def cells(self) -> list[Cell]:
        return [Cell(t, c, n) for t in self.tasks for c in self.checkpoints for n in self.group_sizes]

    def k(self, stage: str, cell: Cell) -> int:
        if stage == "pilot":
            return int(self.pilot["k"][cell.task])
        if not self.power or cell.name not in self.power.get("k", {}):
            raise ValueError(
                f"power: no K for {cell.name}: run the pilot (`python -m studies variance-a --pilot`), "
                "write its power calculation into the YAML's power section and commit it first"
            )
        return int(self.power["k"][cell.name])

    def protocol(self, stage: str) -> dict[str, Any]:
        """What the stage's results depend on (`runs.protocol`: all but description, quick and comments;
        the pilot's leaves out `power`, which it decides)."""
        proto = protocol(self.raw, "pilot" if stage == "pilot" else "main")
        return {**proto, "quick": True} if self.quick else proto


def batch_seed(seed: int, stage: str, cell: Cell, j: int) -> int:
    """The seed of batch j of a cell: prompts and samples of every batch independent of every other's
    (and of the other stage's), and the same on every machine."""
    return int(hashlib.sha256(f"{seed}:{stage}:{cell.name}:{j}".encode()).hexdigest()[:15], 16)


def cpu_flags() -> str:
    """The vector extensions of this CPU that decide its speed (AVX2, AVX-512 and its bf16/vnni parts):
    not every machine of this project has the same, so a record names them beside its times."""
    info = Path("/proc/cpuinfo")
    flags = set()
    for line in info.read_text().splitlines() if info.is_file() else []:
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    kept = sorted(f for f in flags if f == "avx2" or f.startswith(("avx512", "amx")))
    return " ".join(kept) or "no AVX2 or AVX-512"


def weights_digest(model: torch.nn.Module) -> str:
    """16 hex digits of sha256 over the parameters' bytes in name order: which policy a record measured."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------
# Checkpoints


def checkpoint_dir(data: Path, task: str, checkpoint: str) -> Path:
    return data / "checkpoints" / f"{task}-{checkpoint}"


def train_overrides(study: Study, task: str, checkpoint: str, out: Path) -> dict[str, Any]:
    spec = study.checkpoints[checkpoint]
    return {**spec.get("common", {}), **spec.get("tasks", {}).get(task, {}), "output_dir": str(out)}


def build_checkpoint(study: Study, task: str, checkpoint: str, data: Path, scratch: Path, log: Any) -> Path:
    """Train the checkpoint the YAML names (`otbrl train`, its own process, as `studies compare` runs
    do) and copy its final model, summary and command into the data folder (committed)."""
    spec = study.checkpoints[checkpoint]
    out = scratch / "checkpoints" / f"{task}-{checkpoint}"
    overrides = train_overrides(study, task, checkpoint, out)
    log(f"training checkpoint {task}/{checkpoint} in {out} (log: {out / 'train.log'})")
    code, failure = _train(spec["recipe"], Run(checkpoint, int(overrides.get("seed", 0)), out, overrides))
    if code:
        raise RuntimeError(f"checkpoint {task}/{checkpoint}: {failure}")
    dest = checkpoint_dir(data, task, checkpoint)
    dest.mkdir(parents=True, exist_ok=True)
    for f in (out / "final").iterdir():
        if f.suffix in (".json", ".safetensors"):
            shutil.copy2(f, dest / f.name)
    shutil.copy2(out / "summary.json", dest / "train-summary.json")
    command = [
        f"--{k} {json.dumps(v) if isinstance(v, list | dict | bool) else v}" for k, v in overrides.items()
    ]
    (dest / "command.txt").write_text(
        f"python -m otbrl.app.cli train --config {spec['recipe']} " + " ".join(command) + "\n"
    )
    return dest


def load_policy(
    study: Study, task: str, checkpoint: str, data: Path, scratch: Path, log: Any
) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, description) of a cell's policy: the shipped warm start, or the committed
    trained checkpoint (built first if it is missing)."""
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    from studies.variance import load_checkpoint

    preset = study.tasks[task].get("preset", "small")
    source = study.checkpoints[checkpoint]["source"]
    if source == "shipped":
        model, tokenizer, info = load_checkpoint(task, preset, log)
        about = {"source": "shipped warm start", "reward": info.get("reward"), "steps": info.get("steps")}
    elif source == "train":
        where = checkpoint_dir(study.home(data), task, checkpoint)
        if not (where / "model.safetensors").is_file():
            where = build_checkpoint(study, task, checkpoint, data, scratch, log)
        model = Qwen2ForCausalLM.from_pretrained(where).eval()
        tokenizer = PreTrainedTokenizerFast.from_pretrained(where)
        summary = json.loads((where / "train-summary.json").read_text())
        about = {
            "source": f"`otbrl train` ({(where / 'command.txt').read_text().strip()})",
            "reward": summary.get("train reward, last 10% of steps"),
            "steps": summary.get("steps"),
            "generated_tokens": summary.get("generated tokens"),
        }
    else:
        raise ValueError(f"checkpoints: {checkpoint}: source must be shipped or train, got {source!r}")
    model.set_attn_implementation("eager")  # the same function; faster than SDPA for these tiny models
    return model, tokenizer, {**about, "weights": weights_digest(model)}


# ----------------------------------------------------------------------------------------------------
# Measurement


def measure_batch(
    model: Any, tokenizer: Any, study: Study, cell: Cell, seed: int
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """One batch: `prompts` fresh prompts x N samples, both estimators' advantages on the same samples,
    and the gradient of each restricted to each position bucket (4 flat vectors). Returns them and the
    batch's description (reward, length, tokens per bucket, within-group horizon statistics)."""
    from otbrl.stability import group_horizons
    from otbrl.tasks import dataset, get_task
    from studies.variance import (
        SETTINGS,
        draw,
        estimator_advantages,
        policy_gradients,
        position_buckets,
        token_logprobs,
    )

    task, spec = get_task(cell.task), study.tasks[cell.task]
    rows = dataset(task, int(spec["prompts"]), seed=seed)
    r = draw(model, tokenizer, task, rows, cell.n, torch.Generator().manual_seed(seed))
    logp, proxy = token_logprobs(model, r)
    # the teacher-forced pass must reproduce what was sampled (catches misaligned columns)
    torch.testing.assert_close(logp.detach().float(), r.logprobs, atol=1e-3, rtol=0)
    labels = (study.candidate, study.baseline)
    advantages = estimator_advantages(r, {e: SETTINGS[e] for e in labels}, {"proxy": proxy})
    buckets = position_buckets(r.mask, int(spec["late_from"]))
    masked = {f"{e}/{b}": advantages[e] * buckets[b] for e in labels for b in BUCKETS}
    grads = {k: g.detach().float() for k, g in policy_gradients(model, logp, masked).items()}
    horizon = group_horizons(r.mask, proxy.detach(), r.rewards, r.group_ids)
    about = {
        "seed": seed,
        "reward": r.rewards.float().mean().item(),
        "length": r.mask.sum(-1).double().mean().item(),
        **{f"tokens_{b}": int(buckets[b].sum().item()) for b in BUCKETS},
        **{k.removeprefix("horizon/"): v for k, v in horizon.items()},
    }
    return grads, about


def vector_labels(study: Study) -> list[str]:
    return [f"{e}/{b}" for e in (study.candidate, study.baseline) for b in BUCKETS]


def _cell_work(
    study: Study,
    stage: str,
    cell: Cell,
    policy: tuple[Any, Any, dict[str, Any]],
    stamp: str,
    scratch: Path,
    threads: int,
    store_gb: float | None,
) -> tuple[CellSums, Measure]:
    """One cell's unfinished work in its scratch folder and the measurement of its batch j."""
    model, tokenizer, about = policy
    k, labels = study.k(stage, cell), vector_labels(study)
    dim = sum(p.numel() for p in model.parameters() if p.requires_grad)
    header = {
        "protocol": stamp,
        "k": k,
        "dim": dim,
        "labels": labels,
        "weights": about["weights"],
        "threads": threads,  # another thread count may sum in another order: a recomputed batch must repeat
    }
    folder = scratch / stage / cell.name
    if store_gb is None:
        folder.mkdir(parents=True, exist_ok=True)
        # a resumed cell's own file counts, as the blocks it holds (a fresh memory map is sparse)
        held = sum(f.stat().st_blocks * 512 for f in folder.glob("grads.npy"))
        store_gb = max(0.0, (shutil.disk_usage(folder).free + held) / 1e9 - 10.0)

    def measure(j: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        cpu, wall = time.process_time(), time.perf_counter()
        vectors, info = measure_batch(model, tokenizer, study, cell, batch_seed(study.seed, stage, cell, j))
        info["cpu_seconds"] = round(time.process_time() - cpu, 3)
        info["wall_seconds"] = round(time.perf_counter() - wall, 3)
        return vectors, info

    return CellSums(folder, header, batches_that_fit(k, len(labels), dim, store_gb)), measure


def run_cell(
    study: Study,
    stage: str,
    cell: Cell,
    policy: tuple[Any, Any, dict[str, Any]],
    stamp: str,
    scratch: Path,
    threads: int,
    log: Any = print,
    store_gb: float | None = None,
) -> dict[str, Any]:
    """Measure one cell at its K (resuming its scratch) and return its record. `store_gb`: the disk its
    batches' gradients may take (default: all but 10 GB of what is free); the batches beyond it are
    measured again for their sums (`cell_sums`), which changes no number, only the time."""
    work, measure = _cell_work(study, stage, cell, policy, stamp, scratch, threads, store_gb)
    started, load = time.perf_counter(), round(os.getloadavg()[0], 2)
    batches, sums, storage = work.run(measure, (study.candidate, study.baseline), log, f"{stage} {cell.name}")
    return {
        "study": study.name,
        "stage": stage,
        "cell": {"task": cell.task, "checkpoint": cell.checkpoint, "n": cell.n},
        "protocol": stamp,
        "k": work.header["k"],
        "prompts": int(study.tasks[cell.task]["prompts"]),
        "late_from": int(study.tasks[cell.task]["late_from"]),
        "estimators": [study.candidate, study.baseline],
        "checkpoint": policy[2],
        "machine": machine(threads).split("; 1-minute load")[0],
        "cpu_flags": cpu_flags(),
        "load_average": [load, round(os.getloadavg()[0], 2)],  # 1-minute, when the cell started and ended
        "environment": environment(),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds_this_session": round(time.perf_counter() - started, 1),
        "storage": storage,
        "batches": batches,
        "sums": sums,
    }


def help_cell(
    study: Study,
    stage: str,
    cell: Cell,
    policy: tuple[Any, Any, dict[str, Any]],
    stamp: str,
    scratch: Path,
    threads: int,
    log: Any = print,
) -> int:
    """A second process's share of a cell's second pass, beside the `run_cell` measuring it on this machine
    (`CellSums.help`): the same numbers, in less wall time. Returns the batches it measured."""
    work, measure = _cell_work(study, stage, cell, policy, stamp, scratch, threads, None)
    return work.help(measure, (study.candidate, study.baseline), log, f"{stage} {cell.name} (helper)")


# ----------------------------------------------------------------------------------------------------
# Reading the data


def record_path(data: Path, stage: str, cell: Cell) -> Path:
    return data / stage / f"{cell.name}.json.gz"


def load_records(study: Study, data: Path, stage: str) -> dict[Cell, dict[str, Any]]:
    """The committed records of a stage, by cell (cells without one are missing); the pilot's come from
    `study.home(data)`."""
    data = study.home(data) if stage == "pilot" else data
    out = {}
    for cell in study.cells():
        path = record_path(data, stage, cell)
        if path.is_file():
            out[cell] = read_record(path)
    return out


def sums(record: dict[str, Any], label: str) -> RowSums:
    s = record["sums"][label]
    return RowSums(tuple(s["d"]), tuple(s["r"]))


def cell_stats(record: dict[str, Any], level: float = 0.95) -> dict[str, Any]:
    """Every statistic of a cell from its per-batch sums: per bucket (early, late, all) the paired NSR ratio
    candidate / baseline with its interval, each estimator's NSR with its interval, the raw variance ratio;
    and the batches' means (reward, length, tokens per bucket, horizon statistics, CPU seconds)."""
    cand, base = record["estimators"]
    buckets = {}
    for b in ("all", *BUCKETS):
        a, z = sums(record, f"{cand}/{b}"), sums(record, f"{base}/{b}")
        buckets[b] = {
            "ratio": sums_nsr_ratio(a, z, level),
            "nsr": {cand: sums_nsr(a, level), base: sums_nsr(z, level)},
            "variance_ratio": sums_variance_ratio(a, z, level),
        }
    batches = record["batches"]
    means = {key: sum(x[key] for x in batches) / len(batches) for key in batches[0] if key != "seed"}
    return {"buckets": buckets, "means": means, "k": len(batches)}


def determined(iv: RatioInterval) -> bool:
    return math.isfinite(iv.lo) and math.isfinite(iv.hi)


def power_plan(study: Study, pilot: dict[Cell, dict[str, Any]]) -> dict[str, Any]:
    """The YAML's power rule on the pilot's records: K per cell (see the YAML's comments), with what it
    rests on and the power it reaches. Deterministic in the committed pilot data."""
    rule = study.pilot["power"]
    cells = study.cells()
    missing = [c.name for c in cells if c not in pilot]
    if missing:
        raise ValueError(f"pilot: no record yet for {', '.join(missing)}")
    per_cell_target = float(rule["target"]) ** (1 / len(cells))
    delta, level = -math.log(float(rule["planned_ratio"])), float(rule["confidence"])
    rows: dict[str, dict[str, Any]] = {}
    for cell in cells:
        rec = pilot[cell]
        iv = cell_stats(rec, level)["buckets"]["all"]["ratio"]
        k0 = len(rec["batches"])
        sd = iv.log_se * math.sqrt(k0) if determined(iv) else math.nan
        cpu = sum(b["cpu_seconds"] for b in rec["batches"]) / k0
        rows[cell.name] = {
            "ratio": iv,
            "pilot_k": k0,
            "sd": sd,
            "sd_planned": sd_upper_limit(sd, k0, float(rule["sd_level"])),
            "cpu_per_batch": cpu,
            "borrowed": False,
        }
    for cell in cells:  # an undetermined pilot interval plans with its task's largest determined SD
        row = rows[cell.name]
        if math.isfinite(row["sd_planned"]):
            continue
        finite = {c: rows[c.name]["sd_planned"] for c in cells if math.isfinite(rows[c.name]["sd_planned"])}
        pool = [v for c, v in finite.items() if c.task == cell.task] or list(finite.values())
        row["sd_planned"], row["borrowed"] = (max(pool) if pool else math.nan), True
    for row in rows.values():
        row["k_needed"] = _k_needed(row["sd_planned"], delta, level, per_cell_target, row["pilot_k"])
    needed_cpu = sum(r["k_needed"] * r["cpu_per_batch"] for r in rows.values())
    budget = float(rule["budget_cpu_seconds"])
    scale = min(1.0, budget / needed_cpu) if needed_cpu > 0 else 1.0
    joint = 1.0
    for row in rows.values():
        row["k"] = max(row["pilot_k"], math.floor(row["k_needed"] * scale))
        row["power"] = power(row["k"], row["sd_planned"], 0.0, delta, level)
        joint *= row["power"]
    return {
        "cells": rows,
        "per_cell_target": per_cell_target,
        "planned_ratio": float(rule["planned_ratio"]),
        "needed_cpu_seconds": needed_cpu,
        "budget_cpu_seconds": budget,
        "scale": scale,
        "planned_cpu_seconds": sum(r["k"] * r["cpu_per_batch"] for r in rows.values()),
        "joint_power": joint,
        "k": {name: row["k"] for name, row in rows.items()},
    }


def sd_upper_limit(sd: float, k: int, level: float) -> float:
    """The one-sided upper `level` confidence limit of an SD estimated with k - 1 degrees of freedom
    (normal, chi-squared), as `inference.sd_upper` computes it from the values themselves."""
    if not math.isfinite(sd) or k < 2:
        return math.nan
    return sd * math.sqrt((k - 1) / scipy_stats().chi2.ppf(1 - level, k - 1))


def _k_needed(sd: float, delta: float, level: float, target: float, floor: int, most: int = 100_000) -> int:
    """The fewest batches (at least `floor`) whose power reaches `target` (bisection: power rises with K)."""
    if not math.isfinite(sd):
        return most
    if power(floor, sd, 0.0, delta, level) >= target:
        return floor
    lo, hi = floor, floor
    while power(hi, sd, 0.0, delta, level) < target:
        lo, hi = hi, hi * 2
        if hi > most:
            return most
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if power(mid, sd, 0.0, delta, level) >= target else (mid, hi)
    return hi


def rule_text(study: Study) -> str:
    level = int(round(100 * float(study.verdict["confidence"])))
    return (
        f"held if the {level}% interval of NSR({study.candidate})/NSR({study.baseline}) lies below 1 "
        f"in every primary cell ({len(study.tasks)} tasks x {len(study.checkpoints)} checkpoints x N in "
        f"{{{', '.join(map(str, study.group_sizes))}}}, all policy tokens); did not hold if it lies above 1 "
        "in any; inconclusive otherwise; fixed before any run"
    )


def decide(study: Study, main: dict[Cell, dict[str, Any]]) -> tuple[str, dict[Cell, RatioInterval]]:
    """The registered verdict from the main records: not tested until every primary cell has one."""
    level = float(study.verdict["confidence"])
    ivs = {c: cell_stats(main[c], level)["buckets"]["all"]["ratio"] for c in study.cells() if c in main}
    if len(ivs) < len(study.cells()):
        return NOT_TESTED, ivs
    if any(determined(iv) and iv.lo > 1 for iv in ivs.values()):
        return NOT_HELD, ivs
    if all(determined(iv) and iv.hi < 1 for iv in ivs.values()):
        return HELD, ivs
    return INCONCLUSIVE, ivs


def reading(study: Study, main: dict[Cell, dict[str, Any]]) -> tuple[str, dict[Cell, RatioInterval]]:
    """`decide`'s verdict, with the progress of an unfinished study: how many cells are in, and whether a
    finished cell already rules "held" out (the rule's consequence, not a new rule)."""
    verdict, ivs = decide(study, main)
    if len(main) < len(study.cells()):
        verdict = f"{verdict}, interim: {len(main)} of {len(study.cells())} cells measured"
        open_cells = [
            f"{c.task} {c.checkpoint} N={c.n}" for c, iv in ivs.items() if not (determined(iv) and iv.hi < 1)
        ]
        if open_cells:
            verdict += f"; held is out of reach ({', '.join(open_cells)} not below 1)"
    return verdict, ivs


@dataclass(frozen=True)
class Claim:
    """Claim (a)'s verdict row for claims.md, from the committed data (`mechanism_claim`)."""

    claim: str
    measured: str
    verdict: str
    rule: str
    command: str
    protocol: str

    def row(self) -> tuple[str, str, str, str]:
        """(claim, measurement, verdict, command): the shape of `claims.Row`."""
        return (self.claim, self.measured, f"**{self.verdict}** (rule: {self.rule})", self.command)


def interval_text(iv: RatioInterval) -> str:
    if not math.isfinite(iv.ratio):
        return "no signal"
    if not determined(iv):
        return f"{iv.ratio:.2f} [undetermined]"
    return f"{iv.ratio:.2f} [{iv.lo:.2f}, {iv.hi:.2f}]"


def mechanism_claim(results: Path = RESULTS, source: Path = PROTOCOL) -> Claim | None:
    """Claim (a) from the committed data of a registered study (`python -m studies variance-a [--study
    NAME]`) under results/NAME/: the registered verdict, each primary cell's ratio with its interval and
    K, and the protocol's hash (with its amendments). None before the study has registered a protocol."""
    data = results / source.stem
    reg = _registration(data / "main") or _registration(data / "pilot")
    if reg is None:
        return None
    study = Study.load(source)
    main = load_records(study, data, "main")
    verdict, ivs = reading(study, main)
    cells = "; ".join(
        f"{c.task} {c.checkpoint} N={c.n}: {interval_text(iv)} (K={iv.k})" for c, iv in ivs.items()
    )
    amended = len(reg["amendments"])
    proto = reg["hash"] + (f", {amended} amendment(s)" if amended else "")
    measured = (
        f"`{study.name}`: NSR(OTB)/NSR(group mean, {study.baseline}) of the policy gradient, paired on the "
        f"same batches, 95% interval, per task, checkpoint (shipped warm start; after a short GRPO run) and "
        f"N; protocol {proto}: {cells or 'no main run recorded yet'}."
    )
    return Claim(
        CLAIM,
        measured,
        verdict,
        rule_text(study),
        study_command(study.name, "--no-run"),
        reg["hash"],
    )


def study_command(name: str, flags: str = "") -> str:
    """The command line of a registered study (variance-a is the default study)."""
    study = "" if name == NAME else f" --study {name}"
    return f"python -m studies variance-a{study}" + (f" {flags}" if flags else "")


def _registration(folder: Path) -> dict[str, Any] | None:
    path = folder / "protocol.json"
    return json.loads(path.read_text()) if path.is_file() else None


# ----------------------------------------------------------------------------------------------------
# Command line


def register_stage(study: Study, data: Path, stage: str, amend: str | None) -> str:
    """Register (first run) or check the stage's protocol; returns its hash, stamped on every record."""
    proto = study.protocol(stage)
    try:
        register(data / stage, proto, study.source, amend)
    except ProtocolChanged as err:
        raise ValueError(str(err).replace("--amend", f"`{study_command(study.name, '--amend')}`")) from None
    return protocol_hash(proto)


def check_power(study: Study, data: Path) -> None:
    """The main runs start only when the YAML's power section holds what the rule gives on the pilot."""
    pilot = load_records(study, data, "pilot")
    plan = power_plan(study, pilot)
    have = (study.power or {}).get("k")
    if have != plan["k"]:
        raise ValueError(
            f"power: the pilot's power calculation gives k {json.dumps(plan['k'])}; the YAML's power section "
            f"says {json.dumps(have)}: write it in and commit it before the main runs"
        )
