"""The pilot that picks the real-model task of issue 34: a task with room to generalise (>= 1,000 problems,
>= 250 held out, never trained on in any wording) whose starting accuracy leaves room to learn and whose
answer lengths vary within a group. SmolLM2-135M-Instruct, untrained, sampled on each candidate before any
training.

Candidates (otbrl.tasks.chat_problems), fixed before this pilot ran:
    chat_addlist       two to five numbers 1-9 to add, four wordings
    chat_addlist_work  the same problems, asking for the working ("Add the numbers one at a time, ...")
    chat_basket        the same sums told as a story ("Mia picks 3 apples, then 8 more, ...")
    chat_units         unit conversions, one step or two ("How many minutes are in 3 hours and 15 minutes?")
    chat_story         a start and one to three gains or losses ("Tom has 7 apples. He buys 5 more. ...")

Measurement, fixed before this pilot ran: for each candidate, 64 distinct problems (distinct split keys,
drawn from the whole space with seed 0), 4 samples each (one group of 4 per problem), temperature 1 (the
policy itself: no filter), the chat template, otbrl's KV-cache sampler in float32 (the precision the draft
protocol fixes for every machine), at most the task's max_completion_tokens (128) new tokens, 1 torch
thread, batches of 16 problems; reward = the task's reward (final number correct).

Rule, fixed before this pilot ran:
    qualifies   the whole problem space has >= 1,000 problems and >= 250 held-out ones (counted from the
                task's enumeration); starting accuracy (mean reward of the 256 samples) in [0.15, 0.50];
                mean within-group length CV (population SD / mean of a group's 4 lengths, averaged over the
                64 groups) >= 0.30; at most 30% of the samples at the token cap
    pick        of those that qualify, the one with the highest mean within-group length CV (the
                variation OTB acts on, which the experiment needs to last)
    fallback    the same pick among candidates with accuracy in [0.10, 0.60], CV >= 0.25 and at most 40%
                at the cap, marked provisional; if none of those either, no task is picked

Stage 2, added after a smoke run of this script (`--quick`: 4 problems x 4 samples per candidate at T=1,
16 samples each) and before the full pilot ran: at T=1 that smoke run scored 0-1 of 16 per candidate and
the answers read as off-topic text (as llm_pilot.py saw at T=1: "this 4-bit-derived model often writes
off-topic text"). So, if no candidate qualifies under the rule at T=1, the same candidates are measured
again, everything else equal, at T=0.7 (the temperature of the smollm2 recipes and experiment). The order
of the pick is: the rule at T=1, the rule at T=0.7, the fallback at T=1, the fallback at T=0.7; the picked
task is then trained at the temperature it was picked at.

    .venv/bin/python -m studies.llm_pilot2          # ~20 min on 1 thread, writes docs/results/llm-pilot2.md
    .venv/bin/python -m studies.llm_pilot2 --quick  # 4 problems x 4 per candidate, to a temp file
"""

from __future__ import annotations

import gzip
import json
import random
import statistics
import time
from typing import Any

import torch

from otbrl.app.precision import bf16_support, cpu_flags
from otbrl.app.recipe import load_recipe
from otbrl.app.sources import as_chat, choose_model, load_model, load_tokenizer
from otbrl.rollout.sampler import sample
from otbrl.tasks import get_task
from otbrl.tasks.split import held_out
from studies.pages import command_line, markdown_table, write_result

CANDIDATES = ("chat_addlist", "chat_addlist_work", "chat_basket", "chat_units", "chat_story")
PROBLEMS = 64  # distinct problems per candidate
GROUP = 4  # samples per problem
BATCH = 16  # problems per sampling batch
TEMPERATURES = (1.0, 0.7)  # stage 1, stage 2 (only when stage 1 qualifies no candidate under RULE)
SEED = 0

MIN_PROBLEMS, MIN_HELDOUT = 1000, 250
RULE = {"accuracy": (0.15, 0.50), "cv": 0.30, "capped": 0.30}
FALLBACK = {"accuracy": (0.10, 0.60), "cv": 0.25, "capped": 0.40}


def space(name: str) -> tuple[int, int]:
    """(problems, held-out problems) of a task, from its enumeration and its hash split."""
    task = get_task(name)
    if task.problems is None:
        raise ValueError(f"{name}: the task does not enumerate its problems")
    keys = task.problems()
    return len(keys), sum(held_out(k, task.heldout_fraction, task.name) for k in keys)


def distinct_problems(name: str, n: int, seed: int, heldout: bool = False) -> list[tuple[str, str, str]]:
    """`n` (prompt, answer, key) of distinct problems, drawn from the whole space (`heldout`: from its
    held-out side only) in the task's own distribution (duplicates of a problem already drawn are skipped)."""
    task = get_task(name)
    if task.problems is not None:
        keys = task.problems()
        have = sum(held_out(k, task.heldout_fraction, task.name) for k in keys) if heldout else len(keys)
        if n > have:
            side = "held-out side" if heldout else "space"
            raise ValueError(f"{name}: {n} distinct problems asked, its {side} has {have}")
    rng = random.Random(f"{name}:pilot2:{seed}")
    rows, seen = [], set()
    while len(rows) < n:
        prompt, answer = task.make(rng)
        key = task.split_key(prompt) if task.split_key else prompt
        if heldout and not held_out(key, task.heldout_fraction, task.name):
            continue
        if key not in seen:
            seen.add(key)
            rows.append((prompt, answer, key))
    return rows


def group_cv(lengths: list[int]) -> float:
    """Population SD / mean of one group's completion lengths (tokens)."""
    return statistics.pstdev(lengths) / statistics.mean(lengths)


def probe(
    model: Any, tokenizer: Any, name: str, problems: int, temperature: float, heldout: bool = False
) -> dict[str, Any]:
    """Sample GROUP completions of `problems` distinct problems of task `name` (`heldout`: held-out ones
    only); the per-sample record and the summary statistics the rule reads."""
    task = get_task(name)
    cap = task.max_completion_tokens
    rows = distinct_problems(name, problems, SEED, heldout)
    gen = torch.Generator().manual_seed(SEED)
    samples: list[dict[str, Any]] = []
    start = time.perf_counter()
    for b in range(0, len(rows), BATCH):
        batch = rows[b : b + BATCH]
        texts = [
            tokenizer.apply_chat_template(as_chat(p, None), tokenize=False, add_generation_prompt=True)
            for p, _, _ in batch
        ]
        out = sample(model, tokenizer, texts, GROUP, cap, temperature, generator=gen)
        lengths = out.completion_mask.sum(1).tolist()
        for i, text in enumerate(out.texts):
            prompt, answer, key = batch[i // GROUP]
            samples.append(
                {
                    "problem": key,
                    "prompt": prompt,
                    "answer": answer,
                    "text": text,
                    "length": int(lengths[i]),
                    "reward": task.reward(text, answer),
                }
            )
        print(f"  {name} T={temperature}: {min(b + BATCH, len(rows))}/{len(rows)} problems", flush=True)
    seconds = time.perf_counter() - start
    return {"samples": samples, "seconds": seconds, **summarise(samples, cap)}


def summarise(samples: list[dict[str, Any]], cap: int) -> dict[str, Any]:
    """Accuracy (with its SE over problems: the 4 samples of a problem are not independent), length
    median, mean within-group CV, share at the cap, share of groups with reward spread."""
    groups = [samples[i : i + GROUP] for i in range(0, len(samples), GROUP)]
    per_problem = [statistics.fmean(s["reward"] for s in g) for g in groups]
    lengths = [s["length"] for s in samples]
    return {
        "accuracy": statistics.fmean(per_problem),
        "accuracy_se": statistics.stdev(per_problem) / len(per_problem) ** 0.5 if len(groups) > 1 else 0.0,
        "spread": statistics.fmean(0 < sum(s["reward"] for s in g) < GROUP for g in groups),
        "median": statistics.median(lengths),
        "cv": statistics.fmean(group_cv([s["length"] for s in g]) for g in groups),
        "capped": statistics.fmean(n >= cap for n in lengths),
    }


def qualifies(r: dict[str, Any], bounds: dict[str, Any]) -> bool:
    low, high = bounds["accuracy"]
    return (
        r["problems"] >= MIN_PROBLEMS
        and r["heldout"] >= MIN_HELDOUT
        and low <= r["accuracy"] <= high
        and r["cv"] >= bounds["cv"]
        and r["capped"] <= bounds["capped"]
    )


def pick(results: dict[tuple[str, float], dict[str, Any]]) -> tuple[tuple[str, float] | None, str]:
    """The committed rule over (task, temperature) results: (the pick or None, which tier picked it).
    Tiers in order: the rule at T=1, the rule at T=0.7, the fallback at T=1, the fallback at T=0.7."""
    for tier, bounds in (("rule", RULE), ("fallback (provisional)", FALLBACK)):
        for temperature in TEMPERATURES:
            passing = [k for k, r in results.items() if k[1] == temperature and qualifies(r, bounds)]
            if passing:
                return max(passing, key=lambda k: results[k]["cv"]), f"{tier}, T={temperature}"
    return None, "none"


def by_numbers(samples: list[dict[str, Any]]) -> dict[int, tuple[int, float, float]]:
    """Per count of numbers in the prompt (a proxy for the steps a problem takes): (samples, accuracy,
    median length)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for s in samples:
        out.setdefault(len(s["problem"].split(":")[-1].split(",")), []).append(s)
    return {
        k: (len(v), statistics.fmean(s["reward"] for s in v), statistics.median(s["length"] for s in v))
        for k, v in sorted(out.items())
    }


def measure(
    model: Any, tokenizer: Any, problems: int, candidates: tuple[str, ...] = CANDIDATES
) -> dict[tuple[str, float], dict[str, Any]]:
    """Stage 1 at T=1; stage 2 at T=0.7 only when no candidate qualifies under the rule at T=1."""
    results: dict[tuple[str, float], dict[str, Any]] = {}
    for temperature in TEMPERATURES:
        if any(qualifies(r, RULE) for r in results.values()):
            break
        for name in candidates:
            total, heldout = space(name)
            r = {
                "problems": total,
                "heldout": heldout,
                **probe(model, tokenizer, name, problems, temperature),
            }
            results[name, temperature] = r
            print(
                f"{name} T={temperature}: accuracy {r['accuracy']:.3f} ± {r['accuracy_se']:.3f}, median "
                f"{r['median']}, CV {r['cv']:.3f}, capped {r['capped']:.2f}, {r['seconds']:.0f} s",
                flush=True,
            )
    return results


def main(
    candidates: tuple[str, ...] = CANDIDATES,
    number: int = 2,
) -> None:
    """Run the pilot on `candidates` and write docs/results/llm-pilot{number}.md (and .json.gz)."""
    quick, out, _ = command_line(
        "Real-model task pilot of issue 34", "4 problems per candidate", f"llm-pilot{number}.md"
    )
    torch.set_num_threads(1)
    recipe = choose_model(load_recipe("smollm2-rows"), print)
    model, tokenizer = load_model(recipe, print, load_tokenizer(recipe))
    model.eval()
    problems = 4 if quick else PROBLEMS
    results = measure(model, tokenizer, problems, candidates)
    chosen, tier = pick(results)
    description = (
        f"SmolLM2-135M-Instruct from `{recipe['model']}`, untrained; {problems} distinct problems x {GROUP} "
        "samples per candidate and temperature (stage 2 at T=0.7 only when no candidate qualified at T=1), "
        "chat template (no system prompt), otbrl's sampler in float32, at most 128 new tokens, 1 thread. "
        + READING
    )
    write_page(out, number, quick, description, results, chosen, tier)


READING = (
    "Accuracy = final number correct, its SE over problems; 'groups with spread' = share of problems "
    "whose 4 answers were not all scored alike; length CV = population SD / mean of a group's 4 "
    "completion lengths (tokens, eos included), averaged over groups. Problems and held-out problems "
    "are counted from each task's enumeration. 'wall s' is wall-clock time on a shared, loaded "
    "machine."
)


def write_page(
    out: Any,
    number: int,
    quick: bool,
    description: str,
    results: dict[tuple[str, float], dict[str, Any]],
    chosen: tuple[str, float] | None,
    tier: str,
) -> None:
    """docs/results/llm-pilot{number}.md (and .json.gz): the candidates' table, the pick, the CPU."""
    rows = [
        [
            name,
            f"{temperature}",
            f"{r['problems']:,}",
            f"{r['heldout']:,}",
            f"{r['accuracy']:.3f} ± {r['accuracy_se']:.3f}",
            f"{r['spread']:.2f}",
            f"{r['median']:.0f}",
            f"{r['cv']:.3f}",
            f"{r['capped']:.2f}",
            f"{r['seconds']:.0f}",
            "yes" if qualifies(r, RULE) else "fallback" if qualifies(r, FALLBACK) else "no",
            "**picked**" if (name, temperature) == chosen else "",
            "`" + r["samples"][0]["text"].replace("\n", " ").replace("`", "'")[:90] + "`",
        ]
        for (name, temperature), r in results.items()
    ]
    table = markdown_table(
        [
            "candidate",
            "T",
            "problems",
            "held out",
            "accuracy ± SE",
            "groups with spread",
            "median length",
            "length CV in group",
            "at the cap",
            "wall s",
            "qualifies",
            "pick",
            "first answer",
        ],
        rows,
    )
    steps = markdown_table(
        ["candidate", "T", "numbers in the problem", "samples", "accuracy", "median length"],
        [
            [name, f"{temperature}", str(k), str(n), f"{acc:.2f}", f"{med:.0f}"]
            for (name, temperature), r in results.items()
            for k, (n, acc, med) in by_numbers(r["samples"]).items()
        ],
    )
    flags = cpu_flags()
    _, why = bf16_support(use_cpu=True)
    capability = (
        f"CPU capability: {why}; avx512_bf16 {'yes' if 'avx512_bf16' in flags else 'no'}, amx_bf16 "
        f"{'yes' if 'amx_bf16' in flags else 'no'}. This pilot sampled in float32 regardless."
    )
    description += "\n\n" + capability
    if chosen is None:
        verdict = "No candidate qualified, not even under the fallback: no task is picked by this pilot."
    else:
        verdict = (
            f"Picked by the rule in the script's docstring (committed before this ran; tier: {tier}): "
            f"**{chosen[0]} at T={chosen[1]}**."
        )
    verdict += (
        "\n\nAccuracy and median length by how many numbers the problem poses (sums: terms; units: one "
        "step has 1, two steps 2; stories: start plus changes):\n\n" + steps
    )
    write_result(
        out,
        f"Real-model task pilot {number} (issue 34): SmolLM2-135M-Instruct",
        f"-m studies.llm_pilot{number}",
        quick,
        1,
        description,
        table,
        verdict,
    )
    data = [{"task": name, "temperature": temperature, **r} for (name, temperature), r in results.items()]
    blob = out.with_suffix(".json.gz")
    with blob.open("wb") as raw, gzip.GzipFile("", "wb", 9, raw, mtime=0) as f:
        record = {"pick": chosen, "tier": tier, "candidates": data}
        f.write(json.dumps(record, separators=(",", ":")).encode())
    print(f"wrote {blob}")


if __name__ == "__main__":
    main()
