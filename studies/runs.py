"""Training runs of an experiment: `otbrl train` runs launched in their own processes, their committed
records, and the protocol stamp that pre-registration is checked by.

A run resumes what is already done: a run with a committed record is never trained again, on any machine.
A record is one finished run in compact form: its arm, seed and recipe overrides, the hash of its
experiment's protocol, when it started and finished, its summary and the metrics every analysis reads
(gzip-compressed JSON, `<results>/runs/<experiment>/<arm>/seed<k>.json.gz`). Pages, claims and the
benchmarks that read runs are rebuilt from records alone, on any machine; an experiment stopped at any
point resumes by training only the runs that have no record yet.

The protocol is everything in the experiment's YAML that decides its results (seeds, budgets, arms,
thresholds, comparisons and verdict rules, pilot and gate, power calculation): the whole file but its
`description`, `quick` section and comments. Its hash is fixed in `<results>/runs/<experiment>/
protocol.json` when the first run starts (with whether the YAML was committed then). A later change to
it stops `python -m studies compare` until it is recorded there as an amendment with a reason (`--amend`), and
claims.md lists every amendment and every result made under a protocol other than its first.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from otbrl.app.checkpoints import checkpoint_step, resume_checkpoint
from otbrl.app.config import RECIPE_DEFAULTS
from otbrl.app.gpu_memory import ENV as GPU_SHARE_ENV
from otbrl.app.gpu_memory import share_env, sized_shares
from otbrl.app.heldout_cache import ENV as HELDOUT_CACHE_ENV
from otbrl.app.metrics import read_metrics
from otbrl.app.recipe import read_recipe
from otbrl.app.sources import model_problem
from studies.pages import cpu_name, read_record, write_record

try:  # a progress bar where tqdm is installed (it comes with otbrl[trl]); plain log lines otherwise
    from tqdm.auto import tqdm
except ImportError:
    tqdm = None


@dataclass
class Run:
    """One `otbrl train` run: an experiment's arm at one seed, its directory and its recipe overrides."""

    arm: str
    seed: int
    dir: Path
    overrides: dict[str, Any]


# What the analyses read from each logged step (the rest of metrics.jsonl is TRL's bookkeeping).
KEEP = (
    "step",
    "generated_tokens",
    "train_seconds",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "grad_norm",
    "clipped",
    "learning_rate",
    "entropy",
    "completions/mean_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "prompts_sha",
    "heldout_reward",
    "heldout_budgets",
    "otb/lr_decay_trigger",
    "otb/grad_norm_surge",
    "otb/energy_own_pass",
)
KEEP_PREFIXES = ("otb/horizon/",)
# Keys of an experiment's YAML that are not its protocol.
NOT_PROTOCOL = ("description", "quick")
# Keys a pilot's protocol leaves out: what the pilot itself decides (rates), or what is decided after it.
PILOT_LEAVES_OUT = (
    "seeds",
    "reference",
    "roles",
    "comparisons",
    "dropped",
    "power",
    "thresholds",
    "confidence",
)
ARM_KEYS_PILOT_LEAVES_OUT = ("learning_rate", "seeds")


def _digits(value: Any) -> Any:
    """Floats to 6 significant digits (metrics are float32 at best): smaller records, the same analysis."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, list):
        return [_digits(v) for v in value]
    return value


def compact(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl with only the keys the analyses read."""
    return [{k: _digits(v) for k, v in r.items() if k in KEEP or k.startswith(KEEP_PREFIXES)} for r in rows]


def protocol(raw: dict[str, Any], kind: str = "main") -> dict[str, Any]:
    """The protocol part of an experiment's parsed YAML; kind "pilot": what its pilot runs depend on."""
    out = {k: v for k, v in raw.items() if k not in NOT_PROTOCOL}
    if kind == "pilot":
        out = {k: v for k, v in out.items() if k not in PILOT_LEAVES_OUT}
        out["arms"] = {
            arm: {k: v for k, v in (o or {}).items() if k not in ARM_KEYS_PILOT_LEAVES_OUT}
            for arm, o in raw.get("arms", {}).items()
        }
    elif kind != "main":
        raise ValueError(f"kind: 'main' or 'pilot', got {kind!r}")
    return out


def protocol_hash(proto: dict[str, Any]) -> str:
    """16 hex digits of sha256 over the protocol as canonical JSON."""
    blob = json.dumps(proto, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _git_committed(path: Path) -> dict[str, Any]:
    """Whether `path` is committed unchanged in the checkout it lies in (and at which commit)."""
    try:
        cwd = path.resolve().parent
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", path.name],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=20,
        )
        head = subprocess.run(
            ["git", "log", "-1", "--format=%H", "--", path.name],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return {"committed": None, "commit": None}
    if status.returncode or head.returncode:
        return {"committed": None, "commit": None}
    return {
        "committed": not status.stdout.strip() and bool(head.stdout.strip()),
        "commit": head.stdout.strip() or None,
    }


class ProtocolChanged(RuntimeError):
    """The experiment's protocol differs from the one registered when its first run started."""


def register(
    folder: Path, proto: dict[str, Any], source: Path | None, amend: str | None = None
) -> dict[str, Any]:
    """The registration of `folder`'s experiment (its protocol.json), written at the first run. A protocol
    that differs from the registered one (and from its last amendment) raises ProtocolChanged, unless
    `amend` gives the reason: then it is recorded as an amendment and runs go on."""
    path = folder / "protocol.json"
    digest = protocol_hash(proto)
    git = _git_committed(source) if source is not None else {"committed": None, "commit": None}
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        reg = {"hash": digest, "registered": now(), **git, "protocol": proto, "amendments": []}
        path.write_text(json.dumps(reg, indent=1, default=str) + "\n")
        return reg
    reg = json.loads(path.read_text())
    current = reg["amendments"][-1]["hash"] if reg["amendments"] else reg["hash"]
    if digest == current:
        return reg
    before = reg["amendments"][-1]["protocol"] if reg["amendments"] else reg["protocol"]
    changed = sorted(k for k in set(before) | set(proto) if before.get(k) != proto.get(k))
    if not amend:
        raise ProtocolChanged(
            f"{path}: the protocol changed since it was registered ({reg['registered']}): keys "
            f"{', '.join(changed)}. Undo the change, or record it with --amend 'REASON' (claims.md then "
            "lists it as a change after the first run started)"
        )
    reg["amendments"].append(
        {"hash": digest, "at": now(), "reason": amend, "changed": changed, **git, "protocol": proto}
    )
    path.write_text(json.dumps(reg, indent=1, default=str) + "\n")
    return reg


def registration(folder: Path) -> dict[str, Any] | None:
    path = folder / "protocol.json"
    return json.loads(path.read_text()) if path.is_file() else None


def record_path(folder: Path, arm: str, seed: int) -> Path:
    return folder / arm / f"seed{seed}.json.gz"


# Overrides that say where a run wrote, how often it saved a checkpoint and whether it recomputed its
# activations in the backward: no number it reports depends on them (tests/app/test_resume.py; on
# SmolLM2, docs/results/step-memory.md), so runs that differ only there are the same run.
NOT_COMPARED = ("output_dir", "save_steps", "save_total_limit", "gradient_checkpointing")


def comparable(overrides: dict[str, Any]) -> dict[str, Any]:
    """A run's overrides without where it ran and when it saved (the same run on another machine has
    another output_dir; a record made before checkpoints were kept stays the same run)."""
    return {k: v for k, v in overrides.items() if k not in NOT_COMPARED}


def environment() -> dict[str, Any]:
    """Where a run is trained, for its record: the device `otbrl train` picks in this environment (CUDA when
    it is visible) and the versions that shape its numbers. An experiment split over machines says so."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    from otbrl.app.precision import NATIVE_BF16_FLAGS, cpu_flags

    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "cpus": os.cpu_count(),
        "cpu_bf16": sorted(f for f in NATIVE_BF16_FLAGS if f in cpu_flags()),
        "cpu_capability": None if cuda else torch.backends.cpu.get_cpu_capability(),  # AVX2, AVX512, ...
        "cpu_name": cpu_name(),  # times are named with the CPU they ran on
        "code": code_version(),  # which code trained it: a change between sessions shows
        "machine": platform.machine(),
        "python": platform.python_version(),
        **{name: ver(name) for name in ("torch", "transformers", "trl", "otbrl")},
    }


def code_version() -> str | None:
    """The commit of the checkout otbrl runs from (12 hex digits), "+changes" when its otbrl/ or studies/
    differ from it; None outside a git checkout (an installed wheel)."""
    import otbrl

    root = Path(otbrl.__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=20
        )
        changes = subprocess.run(
            ["git", "status", "--porcelain", "--", "otbrl", "studies"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode or changes.returncode:
        return None
    return head.stdout.strip()[:12] + ("+changes" if changes.stdout.strip() else "")


def environment_label(env: dict[str, Any] | None) -> str:
    """One line per environment for a page: device and torch version (records from before environments
    were recorded say so)."""
    if not env:
        return "not recorded"
    device = env.get("device")
    if device == "cpu" and env.get("cpu_name"):  # records from before it was kept name the device alone
        device = f"cpu ({env['cpu_name']})"
    return f"{device}, {env.get('cpus')} CPUs, torch {env.get('torch')}"


MACHINE_KEYS = ("device", "machine", "cpu_bf16", "torch", "transformers", "trl")


def machine_kind(env: dict[str, Any] | None) -> tuple | None:
    """What must be equal for two runs' numbers to start from the same step-0 score: the device, the
    architecture, the CPU's native bf16, and the versions that shape the numbers (not the core count)."""
    if not env:
        return None
    return tuple(json.dumps(env.get(k), sort_keys=True) for k in MACHINE_KEYS)


def kind_labels(envs: Iterable[dict[str, Any] | None]) -> dict[tuple | None, str]:
    """One label a kind of machine (`machine_kind`), for every kind among `envs`: a label that names the
    CPU wins, because early records of a kind may not name the CPU that later ones name. Kinds whose
    labels would read alike (they differ only in a key the label leaves out, e.g. transformers) get the
    keys that tell them apart, so a page never shows two kinds as one."""
    labels: dict[tuple | None, str] = {}
    envs = list(envs)
    for env in envs:
        kind = machine_kind(env)
        if kind not in labels or (env and env.get("cpu_name")):
            labels[kind] = environment_label(env)
    alike: dict[str, list[tuple]] = {}
    for kind, label in labels.items():
        if kind is not None:
            alike.setdefault(label, []).append(kind)
    for label, kinds in alike.items():
        if len(kinds) > 1:
            differ = [i for i in range(len(MACHINE_KEYS)) if len({k[i] for k in kinds}) > 1]
            for kind in kinds:
                labels[kind] = label + " (" + ", ".join(f"{MACHINE_KEYS[i]} {kind[i]}" for i in differ) + ")"
    return labels


STEP0_SCORES = "step0-scores"  # a folder beside the records: one file per kind of machine


def step0_file(records: Path, env: dict[str, Any]) -> Path:
    """Where the step-0 scores of `env`'s kind of machine are kept beside `records`: its `machine_kind`
    and CPU vector level (two CPUs of one kind by flags may still sample differently), hashed. One file a
    kind, so that machines sharing an experiment never edit the same file."""
    kind = [*(machine_kind(env) or ()), env.get("cpu_capability")]
    return records / STEP0_SCORES / f"{hashlib.sha256(json.dumps(kind).encode()).hexdigest()[:12]}.json"


def _read_scores(path: Path) -> dict[str, Any]:
    try:
        known = json.loads(path.read_text())
        return known if isinstance(known, dict) and isinstance(known.get("scores"), dict) else {}
    except (OSError, ValueError):
        return {}  # absent or torn: the runs compute their scores again


def seed_step0_cache(cache: Path, records: Path | None, env: dict[str, Any]) -> int:
    """Put the step-0 held-out scores committed beside `records` by earlier runs on this kind of machine
    into the runs' shared cache folder (`otbrl.app.heldout_cache`), so that a seed's first run in a new
    checkout reuses its step-0 score instead of sampling 1,024 completions again (28 CPU minutes for
    smollm2c). A score is found only under its key, which hashes the weights' bytes, the prompts, the
    sampling settings, threads and versions; scores from another kind of machine are not offered. As with
    the arms of a seed in one checkout, a reused score is the one every arm of the seed is paired on.
    The key names otbrl's version, not its code: a change to the evaluation, reward or tools that moves
    the score is a protocol change, and its amendment deletes the experiment's step0-scores/ with it.
    Returns how many were added."""
    if records is None:
        return 0
    cache.mkdir(parents=True, exist_ok=True)
    added = 0
    known = _read_scores(step0_file(records, env))
    labels = known.get("seeds", {}) if isinstance(known.get("seeds"), dict) else {}
    for key, score in known.get("scores", {}).items():
        if not (cache / f"{key}.json").is_file():
            seed = {"seed": labels[key]} if key in labels else {}
            (cache / f"{key}.json").write_text(json.dumps({"score": float(score), **seed}))
            added += 1
    return added


def keep_step0_scores(cache: Path, records: Path, env: dict[str, Any]) -> bool:
    """Add the step-0 scores in the runs' cache folder (this checkout's, under runs/, computed here) to
    this kind of machine's file beside `records` (`step0_file`), for later checkouts of the experiment
    (`seed_step0_cache`), with the seed of each score whose entry names it (under "seeds": a label that
    `late_line` reads; the key already hashes the seed). The file is replaced whole (a kill leaves the
    old one). Returns whether it changed."""
    path = step0_file(records, env)
    known = _read_scores(path) or {"machine": {k: env.get(k) for k in (*MACHINE_KEYS, "cpu_capability")}}
    scores = dict(known.get("scores", {}))
    seeds = dict(known["seeds"]) if isinstance(known.get("seeds"), dict) else {}
    for entry in sorted(cache.glob("*.json")) if cache.is_dir() else []:
        try:
            content = json.loads(entry.read_text())
            scores[entry.stem] = float(content["score"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # torn by a killed run: its run computes it again
        if isinstance(content.get("seed"), int):
            seeds[entry.stem] = content["seed"]
    if scores and (scores != known.get("scores") or seeds != known.get("seeds", {})):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        kept = {**known, "scores": scores, **({"seeds": seeds} if seeds else {})}
        tmp.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
        return True
    return False


STEP0_WATCH_SECONDS = 60.0  # how often a runner looks for step-0 scores its runs have just computed


def watch_step0_scores(
    cache: Path,
    records: Path,
    env: dict[str, Any],
    lock: threading.Lock,
    stop: threading.Event,
    commit_as: str | None = None,
    log: Callable[[str], Any] = print,
) -> None:
    """Until `stop` is set, and once more then: keep the step-0 scores that runs in flight have written
    to `cache` beside `records` (`keep_step0_scores`) and, with `commit_as` (a commit message), commit them
    at once. A seed's step-0 evaluation is a third of its first run (smollm2c: 28 CPU minutes); kept only
    when the run ends, it was lost with a run cut off mid-training, and the next checkout computed it
    again."""
    while True:
        stopping = stop.wait(STEP0_WATCH_SECONDS)
        with lock:
            if keep_step0_scores(cache, records, env) and commit_as:
                commit_files([step0_file(records, env)], f"{commit_as} ({now()})", log)
        if stopping:
            return


def seed_elsewhere(run: Run, records: Path | None, here: dict[str, Any]) -> str:
    """Why `run` must not train here: a committed record of another arm of its seed was trained on
    another kind of machine (`machine_kind`); "" when none was, or none is known."""
    if records is None or not records.is_dir():
        return ""
    for path in sorted(records.glob(f"*/seed{run.seed}.json.gz")):
        if path.parent.name == run.arm:
            continue
        env = read_record(path).get("environment")
        if machine_kind(env) not in (None, machine_kind(here)):
            return (
                f"{run.arm} seed {run.seed}: not trained here: the seed's arm {path.parent.name} trained "
                f"on {environment_label(env)} (same_machine: every arm of a seed on one kind of machine; "
                "train this seed there with --seeds)"
            )
    return ""


def measured_peaks(records: Path | None, arms: set[str], device: str) -> dict[str, float]:
    """Each arm's largest peak GPU memory (GiB) over its committed records trained on `device`."""
    peaks: dict[str, float] = {}
    for arm in sorted(arms) if records is not None else []:
        for path in sorted((records / arm).glob("seed*.json.gz")):
            rec = read_record(path)
            gib = rec["summary"].get("peak GPU memory (GiB)")
            if gib is not None and (rec.get("environment") or {}).get("device") == device:
                peaks[arm] = max(peaks.get(arm, 0.0), float(gib))
    return peaks


def gpu_shares(
    todo: list[Run], jobs: int, records: Path | None, env: dict[str, Any] | None, log: Callable[[str], Any]
) -> tuple[dict[int, dict[str, str]], int]:
    """Each run's cap on the GPU's memory when runs share one (no number changes; see gpu_memory), and how
    many may run at once. Sized from the arms' measured peaks on this GPU when every arm has one
    (`sized_shares`); else an equal share, which starves the larger arms when the arms differ in size."""
    if not todo or not torch.cuda.is_available() or jobs <= 1 or os.environ.get(GPU_SHARE_ENV):
        return {}, jobs
    device = (env or {}).get("device")
    peaks = measured_peaks(records, {r.arm for r in todo}, device) if device else {}
    if all(r.arm in peaks for r in todo):
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        caps, fit = sized_shares([peaks[r.arm] for r in todo], jobs, total)
        if fit < min(jobs, len(todo)):
            log(f"GPU memory: {fit} runs at a time, not {jobs}: the largest measured peaks fit no more")
        return {id(r): {GPU_SHARE_ENV: f"{c:.4f}"} for r, c in zip(todo, caps, strict=True)}, fit
    missing = sorted({r.arm for r in todo} - set(peaks))
    if len({r.arm for r in todo}) > 1:
        log(
            f"GPU memory: no measured peak on {device or 'this GPU'} for {', '.join(missing)}: an equal "
            "share each (0.9/jobs), which fails arms that need more than the others (gpu-crowd.md, try 3)"
        )
    return {id(r): share_env(jobs) for r in todo}, jobs


def make_record(run: Run, stamp: dict[str, Any]) -> dict[str, Any]:
    """The record of a finished run, from its directory."""
    started = run.dir / "started.json"
    start = json.loads(started.read_text()) if started.is_file() else {}
    return {
        "arm": run.arm,
        "seed": run.seed,
        "overrides": comparable(run.overrides),
        # the stamp the run started under; a run that finished before it was stamped stays unstamped
        "protocol": start.get("protocol") or ({} if not started.is_file() else stamp),
        "started": start.get("started"),
        # this attempt's start: what the run's wall time is measured from (`started` stays the first)
        "attempt_started": start.get("attempt_started") or start.get("started"),
        # earlier attempts this one continued from their last checkpoint, with the wall time each kept
        **({"resumed": start["resumed"]} if start.get("resumed") else {}),
        "finished": now(),
        "environment": start.get("environment"),
        "summary": json.loads((run.dir / "summary.json").read_text()),
        "metrics": compact(read_metrics(run.dir / "metrics.jsonl")),
    }


def attempt_span(record: dict[str, Any]) -> tuple[float, float] | None:
    """(start, finish) of the attempt that finished, as POSIX seconds; None when the record lacks either."""
    try:
        start = datetime.datetime.fromisoformat(record.get("attempt_started") or record["started"])
        end = datetime.datetime.fromisoformat(record["finished"])
    except (KeyError, TypeError, ValueError):
        return None
    return start.timestamp(), end.timestamp()


def wall_seconds(record: dict[str, Any]) -> float:
    """A run's wall time from its record's start and finish stamps (its evaluations included): from the
    start of the attempt that finished (a run started again from scratch loses the attempts before), or
    from its first start in records made before attempts were stamped, plus the time each earlier attempt
    spent up to the checkpoint the run continued from (`resumed`); NaN when the record lacks either."""
    span = attempt_span(record)
    if span is None:
        return math.nan
    earlier = sum(float(r.get("kept_seconds", math.nan)) for r in record.get("resumed", []))
    return span[1] - span[0] + earlier


def expected_seconds(records: Path | None, env: dict[str, Any]) -> float | None:
    """What a run of this experiment takes here: the median wall time of its recorded runs trained on this
    kind of machine (None: none yet)."""
    times = [wall for rec in records_here(records, env) if (wall := wall_seconds(rec)) == wall]
    return statistics.median(times) if times else None


def records_here(records: Path | None, env: dict[str, Any] | None) -> Iterable[dict[str, Any]]:
    """The committed records in `records` (none if absent) trained on `env`'s kind of machine."""
    kind = machine_kind(env)
    for path in sorted(records.glob("*/seed*.json.gz")) if records is not None and records.is_dir() else []:
        rec = read_record(path)
        if machine_kind(rec.get("environment")) == kind:
            yield rec


def is_done(run: Run) -> bool:
    """A run counts as done when it wrote its summary with the same recipe it would be run with now."""
    recipe = run.dir / "run.json"
    return (
        (run.dir / "summary.json").is_file()
        and recipe.is_file()
        and comparable(json.loads(recipe.read_text())) == comparable(run.overrides)
    )


def has_record(run: Run, records: Path | None) -> bool:
    """The run's committed record exists and was made with the overrides it would run with now."""
    if records is None:
        return False
    path = record_path(records, run.arm, run.seed)
    return path.is_file() and comparable(read_record(path)["overrides"]) == comparable(run.overrides)


def _train(
    recipe: str,
    run: Run,
    heldout_cache: Path | None = None,
    extra_env: dict[str, str] | None = None,
    resume: bool = False,
) -> tuple[int, str]:
    """Run `otbrl train` for one run in its own process, its output in the run's train.log; runs given
    the same `heldout_cache` folder share step-0 held-out scores that would be equal (`heldout_cache`);
    `extra_env` is added to its environment; `resume`: from the run's newest complete checkpoint.
    Returns (exit code, a line that says why it failed, or "")."""
    run.dir.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "otbrl.app.cli", "train", "--config", recipe, *(["--resume"] * resume)]
    for key, value in run.overrides.items():
        args += [f"--{key}", json.dumps(value) if isinstance(value, dict | list | bool) else str(value)]
    env = {**os.environ, "OMP_NUM_THREADS": str(run.overrides["threads"]), **(extra_env or {})}
    if heldout_cache is not None:
        env[HELDOUT_CACHE_ENV] = str(heldout_cache)
    log_path = run.dir / "train.log"
    with log_path.open("a" if resume else "w") as out:  # a resumed run's log keeps its earlier attempts
        code = subprocess.call(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    if code == 0:
        (run.dir / "run.json").write_text(json.dumps(run.overrides))
        return code, ""
    tail = log_path.read_text().strip().splitlines()[-1:] or ["(no output)"]
    return code, f"{run.arm} seed {run.seed}: exit {code}: {tail[0]} (log: {log_path})"


# A run killed by SIGKILL (the OOM killer when runs side by side peak together) is started again this many
# times; with checkpoints it continues from its newest one, so a kill costs a few steps (SmolLM2 runs peak
# at 10-13 GB each, transiently, in the loss forward and backward: two peaks together pass 23 GiB).
KILLED_RETRIES = 5


def resume_point(run: Run, before: dict[str, Any], here: dict[str, Any] | None, log: Callable) -> Path | None:
    """The checkpoint a stopped run continues from: its newest complete one, when the attempt that wrote
    it (`before`, its started.json) ran on this kind of machine; a run never mixes machines. Checkpoints
    it cannot continue from are deleted, so that a run started again cannot later resume from them."""
    found = resume_checkpoint(run.dir, log) if run.dir.is_dir() else None
    if found is not None and machine_kind(before.get("environment")) != machine_kind(here):
        log(
            f"{run.arm} seed {run.seed}: {found.name} was written on another kind of machine "
            f"({environment_label(before.get('environment'))}): training again from the start"
        )
        found = None
    if found is None:
        drop_checkpoints(run.dir)
    return found


def drop_checkpoints(folder: Path) -> None:
    """Delete a run's checkpoint-* directories (about 1.6 GB each for SmolLM2: weights and Adam's state)."""
    for path in folder.glob("checkpoint-*") if folder.is_dir() else []:
        if path.is_dir():
            shutil.rmtree(path)


def kept_seconds(checkpoint: Path, before: dict[str, Any]) -> float:
    """The wall time an earlier attempt spent up to the checkpoint it leaves (the rest of it is lost)."""
    try:
        start = datetime.datetime.fromisoformat(before.get("attempt_started") or before["started"])
    except (KeyError, TypeError, ValueError):
        return math.nan
    saved = datetime.datetime.fromtimestamp((checkpoint / "trainer_state.json").stat().st_mtime, datetime.UTC)
    return max(0.0, (saved - start).total_seconds())


MODEL_KEYS = ("model", "model_fallback", "model_revision")


def missing_models(recipe: str, runs: list[Run]) -> dict[str, list[Run]]:
    """The runs whose model this machine cannot load, by the reason (`model_problem`, asked once per model
    the runs name): a missing model package would otherwise fail every run in turn, each after its start."""
    found: dict[tuple, str | None] = {}
    out: dict[str, list[Run]] = {}
    for run in runs:
        model = {k: run.overrides[k] for k in MODEL_KEYS if k in run.overrides}
        key = tuple(sorted((k, str(v)) for k, v in model.items()))
        if key not in found:
            found[key] = model_problem({"model": RECIPE_DEFAULTS["model"], **read_recipe(recipe, model)})
        if found[key]:
            out.setdefault(found[key], []).append(run)
    return out


def commit_files(paths: list[Path], message: str, log: Callable[[str], Any] = print) -> bool:
    """Commit these files (those that exist) and nothing else in the git checkout that holds them, even
    with other changes staged there; a busy index (another commit under way) is tried again. A failure is
    said, not raised: the files stay written for a commit by hand."""
    paths = [p for p in paths if p.exists()]
    if not paths:
        return False
    cwd = paths[0].resolve().parent
    names = [str(p.resolve()) for p in paths]
    for attempt in range(5):
        try:
            add = subprocess.run(
                ["git", "add", "--", *names], cwd=cwd, capture_output=True, text=True, timeout=60
            )
            done = add.returncode == 0 and subprocess.run(
                ["git", "commit", "-q", "-m", message, "--", *names],
                cwd=cwd,
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.SubprocessError) as err:
            log(f"commit of {', '.join(p.name for p in paths)} failed: {err}")
            return False
        if done and done.returncode == 0:
            return True
        why = (add.stderr if add.returncode else done.stderr if done else "").strip()
        if "index.lock" not in why or attempt == 4:
            log(
                f"commit of {', '.join(p.name for p in paths)} failed: {why.splitlines()[-1] if why else '?'}"
            )
            return False
        time.sleep(2 + 2 * attempt)
    return False


def seed_ranges(seeds: Iterable[int]) -> str:
    """[15, 16, 17, 20] -> "15-17,20": what `--seeds` reads (otbrl.app.cli.int_list), in its shortest form."""
    spans: list[list[int]] = []
    for s in sorted(set(seeds)):
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def seeds_scored_here(records: Path | None, env: dict[str, Any] | None) -> set[int]:
    """Seeds whose step-0 score is known on `env`'s kind of machine: those with a committed record trained
    on it, and those its step-0 scores file names (a score computed ahead of the seed's runs)."""
    seeds = {int(rec["seed"]) for rec in records_here(records, env)}
    if records is not None and env is not None:
        labels = _read_scores(step0_file(records, env)).get("seeds")
        seeds |= {int(s) for s in labels.values()} if isinstance(labels, dict) else set()
    return seeds


def late_line(
    name: str, late: list[Run], expected: float, records: Path | None, env: dict[str, Any] | None, jobs: int
) -> str:
    """The line that says which runs --stop-at kept from starting (each arm's seeds, as ranges) and which
    step-0 scores could fill the time left: those of the first `jobs` late seeds whose score is not known
    on this kind of machine yet (`seeds_scored_here`)."""
    arms: dict[str, list[int]] = {}
    for r in late:
        arms.setdefault(r.arm, []).append(r.seed)
    which = "; ".join(
        f"{arm} seed{'s' if len(seeds) > 1 else ''} {seed_ranges(seeds)}" for arm, seeds in arms.items()
    )
    line = (
        f"{len(late)} runs not started: at {expected / 60:.0f} min a run (the median here) they would end "
        f"after the stop time ({which})"
    )
    todo = sorted({r.seed for r in late} - seeds_scored_here(records, env))[: max(jobs, 1)]
    if not todo:
        return line + "; each of their seeds has its step-0 score on this kind of machine already"
    step0 = f"python -m studies step0 {name.split()[0]}{' --pilot' if ' pilot' in name else ''}"
    return (
        line + f"; the next seeds' step-0 scores can fill the time left: {step0} --seeds {seed_ranges(todo)}"
    )


def next_run(pending: list[Run], in_flight: Counter[int]) -> Run:
    """The run to start next: the first pending one whose seed has no run in flight, else the first.
    A seed's arms share one step-0 held-out score (`otbrl.app.heldout_cache`); a second arm of a seed
    started beside the first before that score is cached computes it again (smollm2c: 28 CPU minutes),
    so another seed's run goes first when there is one. The order changes no number."""
    return next((r for r in pending if not in_flight[r.seed]), pending[0])


def execute(
    name: str,
    recipe: str,
    runs: list[Run],
    jobs: int = 2,
    log: Callable[[str], Any] = print,
    records: Path | None = None,
    stamp: dict[str, Any] | None = None,
    same_machine: bool = False,
    stop_at: float | None = None,
    commit: bool = False,
    pages: Callable[[], list[Path]] | None = None,
) -> list[str]:
    """Run what is not done yet of experiment `name` (base recipe `recipe`), `jobs` at a time. With
    `records` (a folder of committed run records), a run with a record is done, a finished run directory
    without one gets one, and each run that finishes writes its record at once, stamped with `stamp` (the
    protocol's hash), so a stop at any point loses at most the runs in flight. `same_machine`: a run whose
    seed has another arm's record from another kind of machine is not trained here (a failure line says
    where it belongs). `stop_at` (a time.time()): a run that would end after it, at the median wall time
    of the experiment's recorded runs on this kind of machine (read again as each record lands), is not
    started (a machine taken away at a known time would lose it). `commit`: each record (with this
    machine's step-0 scores) is committed in the git checkout that holds `records` as soon as it is
    written, alone (`commit_files`); with `pages` (rebuilds the pages that read the records, returns their
    files), those pages in the same commit, so no commit holds a record that its pages do not show.
    Returns one line per failed, refused or unstarted run (nothing is dropped silently)."""

    def keep(run: Run) -> None:
        if records is not None:
            write_record(record_path(records, run.arm, run.seed), make_record(run, stamp or {}))

    recorded = [r for r in runs if has_record(r, records)]
    for r in runs:
        if r not in recorded and is_done(r) and records is not None:
            keep(r)
            recorded.append(r)
    todo = [r for r in runs if r not in recorded and not is_done(r)]
    if len(todo) < len(runs):
        log(
            f"{len(runs) - len(todo)} of {len(runs)} runs already done"
            + (f" ({len(recorded)} with a record in {records})" if records is not None else "")
            + " (delete a run's record and directory to redo it)"
        )
    refused: list[str] = []
    if same_machine and todo:  # a seed's arms on one kind of machine: the others wait for theirs
        here = environment()
        why = {id(r): seed_elsewhere(r, records, here) for r in todo}
        refused = [w for w in why.values() if w]
        todo = [r for r in todo if not why[id(r)]]
    missing = missing_models(recipe, todo)
    if missing:  # each would fail on its first line: said once, before any starts
        refused += [
            f"{problem}: not started: {', '.join(f'{r.arm} seed {r.seed}' for r in which)}"
            for problem, which in missing.items()
        ]
        todo = [r for r in todo if not any(r in which for which in missing.values())]
        log("\n".join(refused[-len(missing) :]))
    failures: list[str] = []
    bar = tqdm(total=len(todo), desc=f"{name} runs", unit="run") if tqdm is not None else None

    # the arms of a seed start from one model and score the same prompts: one step-0 score for them all
    shared = Path(os.path.commonpath([str(r.dir) for r in todo])) / ".heldout-before" if todo else None

    env = environment() if todo else None
    gpu, jobs = gpu_shares(todo, jobs, records, env, log)
    if shared is not None and env is not None:
        reused = seed_step0_cache(shared, records, env)
        if reused:
            log(
                f"{name}: {reused} step-0 held-out scores of this kind of machine "
                f"from {step0_file(records, env)}"
            )
    lock = threading.Lock()
    expected = expected_seconds(records, env) if stop_at is not None and env is not None else None
    late: list[Run] = []

    def attempt(run: Run) -> tuple[int, str]:
        """One attempt at a run. A run started again keeps the stamp and time it first started under
        (when the protocol was registered); it continues from its last checkpoint when one was written on
        this kind of machine, else it trains from scratch, here."""
        started = run.dir / "started.json"
        first = {"protocol": stamp or {}, "started": now()}
        if started.is_file():
            first = json.loads(started.read_text())
        checkpoint = resume_point(run, first, env, log)
        if checkpoint is not None:
            kept = {
                "at": now(),
                "from_step": checkpoint_step(checkpoint),
                "kept_seconds": kept_seconds(checkpoint, first),
            }
            first["resumed"] = [*first.get("resumed", []), kept]
            log(f"{run.arm} seed {run.seed}: continues from {checkpoint.name}")
        else:
            first.pop("resumed", None)
        started.write_text(json.dumps({**first, "attempt_started": now(), "environment": env}))
        return _train(recipe, run, shared, gpu.get(id(run), {}), resume=checkpoint is not None)

    def one(run: Run) -> None:
        nonlocal expected
        start = time.perf_counter()
        if expected is not None and time.time() + expected > stop_at:
            late.append(run)
            if bar is not None:
                bar.update()
            return
        run.dir.mkdir(parents=True, exist_ok=True)
        code, failure = attempt(run)
        for _ in range(KILLED_RETRIES):
            if code != -signal.SIGKILL:
                break
            # SIGKILL from outside: on a machine whose memory two runs' peaks can exceed, the OOM killer
            log(f"{run.arm} seed {run.seed} was killed (SIGKILL: out of memory?): starting it again")
            code, failure = attempt(run)
        if failure:
            failures.append(failure)
        else:
            keep(run)
            if records is not None:  # its record holds what the analyses read; checkpoints only resume
                drop_checkpoints(run.dir)
                with lock:  # written beside the records, committed with them
                    keep_step0_scores(shared, records, env)
                    if expected is not None:  # the median moves as this machine's records land
                        expected = expected_seconds(records, env)
                    if commit:
                        where = [record_path(records, run.arm, run.seed), step0_file(records, env)]
                        where += pages() if pages is not None else []
                        commit_files(where, f"{name}: record {run.arm} seed {run.seed} ({now()})", log)
        if bar is not None:
            bar.set_postfix_str(f"{run.arm} s{run.seed} {time.perf_counter() - start:.0f}s")
            bar.update()
        else:
            log(f"done {run.arm} seed {run.seed} ({time.perf_counter() - start:.0f}s, exit {code})")

    pending, in_flight = list(todo), Counter()

    def worker() -> None:
        while True:
            with lock:
                if not pending:
                    return
                run = next_run(pending, in_flight)
                pending.remove(run)
                in_flight[run.seed] += 1
            try:
                one(run)
            finally:
                with lock:
                    in_flight[run.seed] -= 1

    stop_watching = threading.Event()
    watcher = None
    if records is not None and shared is not None and env is not None:  # a step-0 score outlives its run
        message = f"{name}: step-0 scores of runs in flight" if commit else None
        watcher = threading.Thread(
            target=watch_step0_scores,
            args=(shared, records, env, lock, stop_watching, message, log),
            daemon=True,
        )
        watcher.start()
    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for worker_done in [pool.submit(worker) for _ in range(max(1, jobs))]:
                worker_done.result()
    finally:
        stop_watching.set()
        if watcher is not None:
            watcher.join()
    if bar is not None:
        bar.close()
    if late:
        failures.append(late_line(name, late, expected, records, env, jobs))
        log(failures[-1])
    return refused + failures
