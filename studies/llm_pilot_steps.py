"""Second real-model pilot: a reasoning task whose answer lengths keep varying while the model learns.

Why: on chat_rows (one product, "6 rows of 9 eggs") the model learned within 40 steps to answer with the
product alone; completions shrank from ~100 to ~15 tokens and the within-group length CV fell from 0.40 to
0.07 (docs/results/llm-rows.md), so OTB had little length variation left to act on. These candidates pose
two operations, so that writing the intermediate result keeps paying, and the reference chat_rows row is
sampled again beside them.

Rule, fixed before this pilot ran: a candidate qualifies when its starting accuracy lies between 10% and
60% at T=0.7, its within-group length CV is >= 0.3 and at most a quarter of its answers hit the cap; of
those, the one with the highest length CV is the reasoning task (its training run then tests whether the
variation lasts).

    .venv/bin/python -m studies.llm_pilot_steps          # ~6 min, writes docs/results/llm-pilot-steps.md
    .venv/bin/python -m studies.llm_pilot_steps --quick  # 4 prompts per candidate, to a temp file
"""

from __future__ import annotations

import random

import torch
from llm_pilot import Make, probe

from otbrl.app.recipe import load_recipe
from otbrl.app.sources import choose_model, load_model, load_tokenizer
from otbrl.tasks.chat import make_rows
from studies.pages import command_line, markdown_table, write_result


def rows_left(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    c = rng.randint(1, min(9, a * b - 1))
    return f"A box holds {a} rows of {b} eggs. {c} eggs break. How many eggs are left?", str(a * b - c)


def rows_plus(rng: random.Random) -> tuple[str, str]:
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 9)
    question = f"A box holds {a} rows of {b} eggs, and {c} more eggs lie next to it. How many eggs in all?"
    return question, str(a * b + c)


def two_shelves(rng: random.Random) -> tuple[str, str]:
    a, b, c, d = (rng.randint(2, 6) for _ in range(4))
    question = (
        f"One shelf has {a} rows of {b} books and another shelf has {c} rows of {d} books. "
        "How many books are there in all?"
    )
    return question, str(a * b + c * d)


def change(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 9), rng.randint(2, 5)
    question = f"Pens cost {a} dollars each. Sam buys {b} pens and pays with a 50 dollar note. Change?"
    return question, str(50 - a * b)


CANDIDATES: dict[str, tuple[Make, int]] = {
    "chat_rows: a rows of b (reference)": (make_rows, 160),
    "rows_left: a rows of b, c break": (rows_left, 160),
    "rows_plus: a rows of b, c more": (rows_plus, 160),
    "two_shelves: a x b + c x d": (two_shelves, 160),
    "change: 50 - a x b": (change, 160),
}


def qualifies(r: dict) -> bool:
    return 0.10 <= r["accuracy"] <= 0.60 and r["cv"] >= 0.3 and r["capped"] <= 0.25


def main() -> None:
    quick, out, _ = command_line("Multi-step task pilot", "4 prompts per candidate", "llm-pilot-steps.md")
    torch.set_num_threads(1)
    recipe = choose_model(load_recipe("smollm2-sums"), print)
    model, tokenizer = load_model(recipe, print, load_tokenizer(recipe))
    model.eval()
    prompts = 4 if quick else 16
    results = {}
    for name, (make, max_new) in CANDIDATES.items():
        results[name] = r = probe(model, tokenizer, make, max_new, 0.7, prompts)
        print(f"{name}: {r}", flush=True)
    passing = [n for n, r in results.items() if qualifies(r)]
    pick = max(passing, key=lambda n: results[n]["cv"]) if passing else None
    rows = [
        [
            name,
            f"{r['accuracy']:.2f}",
            f"{r['spread']:.2f}",
            f"{r['median']:.0f}",
            f"{r['cv']:.2f}",
            f"{r['capped']:.2f}",
            f"{r['seconds']:.0f}",
            "yes" if qualifies(r) else "no",
            "**picked**" if name == pick else "",
            f"`{r['example']}`",
        ]
        for name, r in results.items()
    ]
    table = markdown_table(
        [
            "candidate",
            "accuracy",
            "groups with spread",
            "median length",
            "length CV in group",
            "at the cap",
            "CPU s",
            "qualifies",
            "pick",
            "first answer",
        ],
        rows,
    )
    verdict = (
        f"Picked by the rule in the script's docstring (fixed before this ran): **{pick}**."
        if pick
        else "No candidate qualified: no reasoning task is picked from this pilot."
    )
    description = (
        f"SmolLM2-135M-Instruct from `{recipe['model']}`, untrained; {prompts} prompts x 4 samples per "
        "candidate at T=0.7, max 160 new tokens, chat template, otbrl's sampler under bf16 autocast; "
        "accuracy = final number correct. Rule (fixed before the run): 10-60% accuracy, length CV >= 0.3, "
        "at most 25% of answers at the cap; the highest length CV among those qualifying is picked."
    )
    write_result(
        out,
        "Real-model multi-step task pilot: SmolLM2-135M-Instruct",
        "-m studies.llm_pilot_steps",
        quick,
        1,
        description,
        table,
        verdict,
    )


if __name__ == "__main__":
    main()
