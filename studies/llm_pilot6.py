"""The sixth round of issue 34's task pilot: a task whose lengths the environment sets, measured at the
warm start and again while RL trains.

Why: pilot 5 picked chat_addlist_work after a supervised warm start (within-group length CV 0.375 at
the warm start), and smollm2b's first two pilot runs (OTB N=4 at 1e-5) showed what RL does to it: the CV
averaged over each run's steps was 0.040 and 0.061, against the protocol's floor of 0.3. Each sum has one
right working, and RL learned to write it within three steps. Pilots 1-5 measured the CV only at the
start; this one also measures it while RL trains, which is where the floor applies.

The candidate task, chat_draws (otbrl.tasks.chat_draws), is multi-turn: the model calls draw() until a
draw is large enough, keeping a running total, and each completion meets its own deck (the task's
episode). How many draws an answer takes is the environment's, so no policy can make the answers to one
prompt alike. 1,080 problems, 317 held out by the problem (never in any warm start or RL draw). (This
said 313 when it was committed: a count from before the rules were final; the page counts them.)

Candidates, fixed before this pilot ran: chat_draws after a supervised warm start (`otbrl sft`:
demonstrations of the training side only, tool output not trained, learning rate 2e-5 constant, 8 a
step, seed 0, float32, 1 thread) of 32 or 96 steps of SmolLM2-135M-Instruct (the registry's GGUF).

Measurement, per candidate:
1. the warm start on 64 distinct held-out problems x 4 samples at T=1 (each sample its own deck, seeded),
   the chat template, otbrl's multi-turn sampler in float32, at most 192 new tokens and 8 calls, 1
   thread: accuracy (its SE over problems), the share of groups with reward spread, the within-group CV
   of the model's own tokens (tool output excluded: what OTB's energy sums over; population SD / mean
   over a group's 4), and the share of completions at the token cap;
2. RL from that warm start: `otbrl train --config smollm2-draws` with OTB at N=4, 4 prompts x 4 answers
   a step, learning rate 1e-5 constant (the lower of smollm2b's two), T=1, 16 steps, seed 0, 1 thread:
   the trainer's within-group length CV per step (`otb/horizon/length_cv`), and the train reward.

Rule and pick, fixed before this pilot ran: a candidate qualifies when its space has >= 1,000 problems
and >= 250 held out, its warm-start accuracy lies in [0.15, 0.50], its warm-start CV is >= 0.30, at most
30% of its completions hit the cap, and the CV averaged over its 16 RL steps and over the last 8 of them
are both >= 0.30. Of the candidates that qualify, the pick is the one with the higher CV over the last 8
RL steps. No fallback stage: if none qualifies, the page says so and names what failed.

    OMP_NUM_THREADS=1 .venv/bin/python -m studies.llm_pilot6 --candidate 32   # one candidate (~1 h)
    OMP_NUM_THREADS=1 .venv/bin/python -m studies.llm_pilot6 --candidate 96   # beside it, one core each
    .venv/bin/python -m studies.llm_pilot6 --page     # docs/results/llm-pilot6.md from both results
    OMP_NUM_THREADS=1 .venv/bin/python -m studies.llm_pilot6 --quick   # 1 sft step, 4 problems, 1 RL step
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from otbrl.app.precision import bf16_support, cpu_flags
from otbrl.app.recipe import load_recipe
from otbrl.app.sft import warm_start_chat
from otbrl.app.sources import as_chat, choose_model, load_model
from otbrl.tasks import get_task
from studies.llm_pilot2 import distinct_problems, group_cv, space
from studies.pages import RESULTS, machine, markdown_table, write_result

RECIPE = "smollm2-draws"
LEARNING_RATE, BATCH, SEED = 2e-5, 8, 0  # the warm start's
PROBLEMS, GROUP, TEMPERATURE, CHUNK = 64, 4, 1.0, 16  # the probe: held-out problems x samples, 16 a batch
RL = {"learning_rate": 1e-5, "max_steps": 16, "seed": 0}
RULE = {"problems": 1000, "heldout": 250, "accuracy": (0.15, 0.50), "cv": 0.30, "capped": 0.30, "rl_cv": 0.30}


@dataclasses.dataclass(frozen=True)
class Pilot:
    """One round of this design: its number, task and candidate warm-start lengths (pilot 7 reuses it)."""

    number: int
    task: str
    candidates: tuple[int, ...]
    title: str
    # candidates not run, with the reason, decided after the pilot started (the page says so)
    skipped: tuple[tuple[int, str], ...] = ()
    notes: str = ""  # what happened while it ran (a crash and its rerun, say), for the page

    def scratch(self, quick: bool) -> Path:
        return Path(f"runs/llm-pilot{self.number}" + ("-quick" if quick else ""))


PILOT6 = Pilot(
    6,
    "chat_draws",
    (32, 96),
    "a task whose lengths the environment sets",
    notes="The 96-step candidate's first run was killed by the kernel's out-of-memory killer after its 15th "
    "RL step (four SmolLM2 processes at once in 24 GiB); it ran again from its saved warm start, with the "
    "same probe and RL seeds, two processes at a time.",
)


def warm(task: str, steps: int, where: Path) -> tuple[Any, Any, dict[str, Any], Path]:
    """The candidate's warm start (built once in `where`), loaded; its summary and folder."""
    recipe = choose_model(load_recipe(RECIPE, {"task": task}), print)
    final = where / "final"
    if not (where / "sft-summary.json").is_file():  # written last: a killed build has none
        warm_start_chat(recipe, steps, where, learning_rate=LEARNING_RATE, batch_size=BATCH, seed=SEED)
    model, tokenizer = load_model({**recipe, "model": str(final)}, print)
    summary = json.loads((where / "sft-summary.json").read_text())
    digest = hashlib.sha256((final / "model.safetensors").read_bytes()).hexdigest()[:16]
    return model.eval(), tokenizer, {**summary, "weights": digest}, final


def probe(pilot: Pilot, model: Any, tokenizer: Any, problems: int) -> dict[str, Any]:
    """GROUP samples of `problems` distinct held-out problems, each sample with its own seeded deck."""
    from otbrl.integrations.trl.rollout import prompt_ids
    from otbrl.rollout.multiturn import episode_seed, episode_toolboxes, sample_with_tools

    task = get_task(pilot.task)
    cap = task.max_completion_tokens
    rows = distinct_problems(pilot.task, problems, SEED, heldout=True)
    gen = torch.Generator().manual_seed(SEED)
    samples: list[dict[str, Any]] = []
    start = time.perf_counter()
    for b in range(0, len(rows), CHUNK):
        batch = [r for r in rows[b : b + CHUNK] for _ in range(GROUP)]
        ids = [prompt_ids(tokenizer, as_chat(p, None)) for p, _, _ in batch]
        seeds = [episode_seed(f"pilot{pilot.number}", SEED, b + i) for i in range(len(batch))]
        boxes = episode_toolboxes(task.episode, seeds, [p for p, _, _ in batch])
        out = sample_with_tools(model, tokenizer, ids, boxes, cap, task.max_turns, TEMPERATURE, generator=gen)
        for i, text in enumerate(out.texts):
            prompt, answer, key = batch[i]
            samples.append(
                {
                    "problem": key,
                    "answer": answer,
                    "text": text,
                    "length": sum(out.model_mask[i]),  # the model's own tokens
                    "tokens": len(out.completion_ids[i]),  # with the tool's output
                    "calls": out.calls[i],
                    "reward": task.reward(text, answer),
                }
            )
        print(f"  probe: {min(b + CHUNK, len(rows))}/{len(rows)} problems", flush=True)
    groups = [samples[i : i + GROUP] for i in range(0, len(samples), GROUP)]
    per_problem = [statistics.fmean(s["reward"] for s in g) for g in groups]
    return {
        "samples": samples,
        "seconds": round(time.perf_counter() - start, 1),
        "accuracy": statistics.fmean(per_problem),
        "accuracy_se": statistics.stdev(per_problem) / len(per_problem) ** 0.5 if len(groups) > 1 else 0.0,
        "spread": statistics.fmean(0 < sum(s["reward"] for s in g) < GROUP for g in groups),
        "median": statistics.median(s["length"] for s in samples),
        "cv": statistics.fmean(group_cv([s["length"] for s in g]) for g in groups),
        "capped": statistics.fmean(s["tokens"] >= cap for s in samples),
        "calls": statistics.fmean(s["calls"] for s in samples),
    }


def train(task: str, final: Path, out: Path, steps: int) -> dict[str, Any]:
    """RL from the warm start (`otbrl train --config smollm2-draws`); its per-step metrics."""
    from otbrl.app.train import run

    overrides = {
        **RL,
        "task": task,
        "max_steps": steps,
        "model": str(final),
        "model_fallback": None,
        "eval_before": False,
        "eval_size": 16,
        "save_strategy": "no",
        "report_to": [],
        "plot": False,
        "disable_tqdm": True,
        "output_dir": str(out),
    }
    started = time.perf_counter()
    run(load_recipe(RECIPE, overrides), log=print)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_ = [m for m in lines if "otb/horizon/length_cv" in m]
    keep = ("step", "reward", "otb/horizon/length_cv", "otb/horizon/energy_cv", "completions/mean_length")
    return {
        "overrides": overrides,
        "seconds": round(time.perf_counter() - started, 1),
        "steps": [{k: m.get(k) for k in (*keep, "otb/tool_calls", "entropy")} for m in steps_],
    }


def measure(pilot: Pilot, steps: int, quick: bool) -> Path:
    """One candidate, both stages; its result JSON in the scratch folder."""
    torch.set_num_threads(1)
    folder = pilot.scratch(quick) / f"sft{steps}"
    model, tokenizer, about, final = warm(pilot.task, 1 if quick else steps, folder / "warm")
    total, heldout = space(pilot.task)
    result = {"steps": steps, "problems": total, "heldout": heldout, "warm_start": about}
    result["probe"] = probe(pilot, model, tokenizer, 4 if quick else PROBLEMS)
    p = result["probe"]
    print(f"sft {steps}: accuracy {p['accuracy']:.3f} ± {p['accuracy_se']:.3f}, CV {p['cv']:.3f}", flush=True)
    del model
    result["rl"] = train(pilot.task, final, folder / "rl", 1 if quick else RL["max_steps"])
    result["machine"] = machine(1)
    path = folder / "result.json"
    path.write_text(json.dumps(result))
    print(f"wrote {path}")
    return path


def rl_cv(result: dict[str, Any]) -> tuple[float, float]:
    """Mean within-group length CV over all RL steps and over the last half of them."""
    cvs = [s["otb/horizon/length_cv"] for s in result["rl"]["steps"]]
    return statistics.fmean(cvs), statistics.fmean(cvs[len(cvs) // 2 :])


def failures(result: dict[str, Any]) -> list[str]:
    """What of the rule a candidate fails (empty: it qualifies)."""
    p, (every, last) = result["probe"], rl_cv(result)
    low, high = RULE["accuracy"]
    checks = [
        (result["problems"] >= RULE["problems"], "fewer than 1,000 problems"),
        (result["heldout"] >= RULE["heldout"], "fewer than 250 held out"),
        (low <= p["accuracy"] <= high, f"accuracy {p['accuracy']:.3f} outside [{low}, {high}]"),
        (p["cv"] >= RULE["cv"], f"warm-start CV {p['cv']:.3f} < {RULE['cv']}"),
        (p["capped"] <= RULE["capped"], f"{p['capped']:.2f} at the cap > {RULE['capped']}"),
        (every >= RULE["rl_cv"], f"RL CV {every:.3f} < {RULE['rl_cv']}"),
        (last >= RULE["rl_cv"], f"RL CV over the last half {last:.3f} < {RULE['rl_cv']}"),
    ]
    return [why for ok, why in checks if not ok]


def page(pilot: Pilot, out: Path, quick: bool) -> None:
    where = pilot.scratch(quick)
    skipped = dict(pilot.skipped)
    run = [s for s in pilot.candidates if s not in skipped]
    results = {s: json.loads((where / f"sft{s}" / "result.json").read_text()) for s in run}
    qualified = [s for s, r in results.items() if not failures(r)]
    chosen = max(qualified, key=lambda s: rl_cv(results[s])[1]) if qualified else None
    rows = []
    for s, r in results.items():
        p, (every, last) = r["probe"], rl_cv(r)
        rl = r["rl"]["steps"]
        rows.append(
            [
                f"{pilot.task} + sft {s}",
                f"{r['problems']:,} / {r['heldout']:,}",
                f"{p['accuracy']:.3f} ± {p['accuracy_se']:.3f}",
                f"{p['spread']:.2f}",
                f"{p['calls']:.2f}",
                f"{p['median']:.0f}",
                f"{p['cv']:.3f}",
                f"{p['capped']:.2f}",
                f"{every:.3f}",
                f"{last:.3f}",
                f"{statistics.fmean(x['reward'] for x in rl[:4]):.2f} -> "
                f"{statistics.fmean(x['reward'] for x in rl[-4:]):.2f}",
                "yes" if not failures(r) else "no: " + "; ".join(failures(r)),
                "**picked**" if s == chosen else "",
            ]
        )
    table = markdown_table(
        [
            "candidate",
            "problems / held out",
            "accuracy ± SE",
            "groups with spread",
            "draws",
            "median model tokens",
            "CV in group (warm)",
            "at the cap",
            "RL CV (all steps)",
            "RL CV (last half)",
            "train reward (first 4 -> last 4 steps)",
            "qualifies",
            "pick",
        ],
        rows,
    )
    per_step = markdown_table(
        ["candidate", "step", "train reward", "length CV in group", "energy CV", "mean length", "tool calls"],
        [
            [
                f"sft {s}",
                str(x["step"]),
                f"{x['reward']:.2f}",
                f"{x['otb/horizon/length_cv']:.3f}",
                f"{x['otb/horizon/energy_cv']:.3f}",
                f"{x['completions/mean_length']:.1f}",
                "" if x.get("otb/tool_calls") is None else f"{x['otb/tool_calls']:.2f}",
            ]
            for s, r in results.items()
            for x in r["rl"]["steps"]
        ],
    )
    starts = "; ".join(
        f"sft {s}: {r['warm_start']['seconds']:.0f} s, loss {r['warm_start']['loss_first']:.2f} -> "
        f"{r['warm_start']['loss_last']:.2f}, weights {r['warm_start']['weights']}, draws per demonstration "
        f"{r['warm_start']['tool_outputs']}"
        for s, r in results.items()
    )
    flags = cpu_flags()
    _, why = bf16_support(use_cpu=True)
    description = (
        "The rule, the candidates and the measurement are in the script's docstring (committed before it "
        f"ran). Warm starts: {starts}. Probe wall time: "
        + ", ".join(f"sft {s} {r['probe']['seconds']:.0f} s" for s, r in results.items())
        + "; RL (16 steps, including loading and a 16-prompt final evaluation): "
        + ", ".join(f"sft {s} {r['rl']['seconds']:.0f} s" for s, r in results.items())
        + ". Each candidate ran on one thread, float32, beside other jobs on this 2-core machine (wall times "
        "are not comparable between candidates)." + (f" {pilot.notes}" if pilot.notes else "") + "\n\n"
        f"CPU capability: {why}; avx512_bf16 {'yes' if 'avx512_bf16' in flags else 'no'}, amx_bf16 "
        f"{'yes' if 'amx_bf16' in flags else 'no'}.\n\nReading: 'draws' = tool calls per completion; lengths "
        "count the model's own tokens (tool output excluded); CV = population SD / mean of a group's 4 "
        "lengths, averaged over groups (the probe) or the trainer's per-step value averaged over steps (RL)."
    )
    verdict = (
        f"Picked by the rule: **{pilot.task} + sft {chosen}**."
        if chosen
        else "No candidate qualified: no task is picked by this pilot."
    )
    for s, why in skipped.items():
        verdict += (
            f"\n\n**Not run: {pilot.task} + sft {s}**, a change to this pilot made after its other "
            f"candidate's result was seen: {why}"
        )
    verdict += "\n\nPer RL step:\n\n" + per_step
    write_result(
        out,
        f"Real-model task pilot {pilot.number} (issue 34): {pilot.title}",
        f"-m studies.llm_pilot{pilot.number} --page",
        quick,
        1,
        description,
        table,
        verdict,
    )
    blob = out.with_suffix(".json.gz")
    with blob.open("wb") as raw, gzip.GzipFile("", "wb", 9, raw, mtime=0) as f:
        f.write(json.dumps({"pick": chosen, "candidates": results}, separators=(",", ":")).encode())
    print(f"wrote {blob}")


def main(pilot: Pilot = PILOT6) -> None:
    parser = argparse.ArgumentParser(description=f"Real-model task pilot {pilot.number} of issue 34")
    parser.add_argument("--candidate", type=int, choices=pilot.candidates, help="measure one candidate")
    parser.add_argument("--page", action="store_true", help="write the page from both candidates' results")
    parser.add_argument("--quick", action="store_true", help="1 sft step, 4 problems, 1 RL step; temp page")
    parser.add_argument("--out", type=Path, help="markdown output path")
    args = parser.parse_args()
    name = f"llm-pilot{pilot.number}.md"
    out = args.out or (Path(tempfile.gettempdir()) if args.quick else RESULTS) / name
    if args.candidate is not None:
        measure(pilot, args.candidate, args.quick)
    elif args.quick and not args.page:
        for s in pilot.candidates:
            measure(pilot, s, True)
        page(pilot, out, True)
    elif args.page:
        page(pilot, out, args.quick)
    else:
        parser.error("give --candidate N (then --page), or --quick")


if __name__ == "__main__":
    main()
