"""Where a real-model run's time goes (issue 34, item 5): a few steps of `otbrl train` on a SmolLM2 recipe,
with timers around each phase, and the held-out evaluation timed at two batch sizes.

Timers wrap the existing functions from outside (no library code changes): the held-out evaluation
(`otbrl.app.train.evaluate`), TRL's training step and inside it the generation (otbrl's sampler: its
decoding loop, the model forwards it makes, the per-token energy), the rewards, the advantages, the loss
forward and the backward pass; the optimizer step; saving. Each timer is attributed to the path of timers
it runs inside ("training step / generate / sampler loop / model forward"), and each row reports its
inclusive time and its own time (less the timed phases inside it). Wall time and the process's CPU time are
both reported: on a shared machine, wall time includes waiting for a core.

    .venv/bin/python -m studies.llm_time --recipe smollm2-addlist          # writes docs/results/llm-time.md
    .venv/bin/python -m studies.llm_time --recipe smollm2-addlist --quick  # 1 step, 8 held-out prompts

Each precision (float32, then bf16 autocast where the CPU computes bf16 natively) trains `--steps` steps
from the same start, with a held-out evaluation of `--eval-size` prompts before and after; then the
float32 held-out evaluation is timed on 4 x eval-size prompts as one batch (the library's evaluation
today) and as 4 chunks of eval-size (a cut that keeps the protocol's meaning but not its exact samples).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


class Clock:
    """Inclusive wall and CPU seconds per path of nested timers, and call counts."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.stack: list[str] = []
        self.undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        """Time every call of `owner.attr` (a module function or a class's method) as `name`."""
        if isinstance(inspect.getattr_static(owner, attr), staticmethod | classmethod):
            raise ValueError(f"{owner}.{attr}: static and class methods are not wrapped")
        original = getattr(owner, attr)  # a class's own or inherited function, or a module's
        own = not isinstance(owner, type) or attr in owner.__dict__
        clock = self

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            clock.stack.append(name)
            path = " / ".join(clock.stack)
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                clock.wall[path] += time.perf_counter() - wall
                clock.cpu[path] += time.process_time() - cpu
                clock.calls[path] += 1
                clock.stack.pop()

        setattr(owner, attr, timed)
        self.undo.append(lambda: setattr(owner, attr, original) if own else delattr(owner, attr))

    def restore(self) -> None:
        while self.undo:
            self.undo.pop()()

    def rows(self) -> list[tuple[str, int, float, float, float, float]]:
        """(path, calls, wall, own wall, cpu, own cpu), own = inclusive less the direct children."""
        out = []
        for path in sorted(self.wall):
            kids = [
                p for p in self.wall if p.startswith(path + " / ") and p.count(" / ") == path.count(" / ") + 1
            ]
            own_wall = self.wall[path] - sum(self.wall[k] for k in kids)
            own_cpu = self.cpu[path] - sum(self.cpu[k] for k in kids)
            out.append((path, self.calls[path], self.wall[path], own_wall, self.cpu[path], own_cpu))
        return out


def instrument(clock: Clock) -> None:
    """Wrap the phases of a run (see the module docstring)."""
    import accelerate
    import transformers
    import trl

    import otbrl
    import otbrl.app.train as train
    import otbrl.rollout.sampler as sampler
    from otbrl.integrations.trl import OTBGRPOTrainer

    clock.wrap(train, "load_model", "load model")
    clock.wrap(train, "evaluate", "held-out evaluation")
    clock.wrap(transformers.Trainer, "train", "trainer.train")
    clock.wrap(trl.GRPOTrainer, "training_step", "training step")
    clock.wrap(OTBGRPOTrainer, "_generate", "generate")
    clock.wrap(sampler, "_loop", "sampler loop")
    clock.wrap(sampler, "token_energy", "energy")
    clock.wrap(transformers.LlamaForCausalLM, "forward", "model forward")
    clock.wrap(OTBGRPOTrainer, "_calculate_rewards", "rewards")
    clock.wrap(otbrl, "compute_advantages", "advantages")
    clock.wrap(trl.GRPOTrainer, "compute_loss", "loss forward")
    clock.wrap(accelerate.Accelerator, "backward", "backward")
    clock.wrap(torch.optim.AdamW, "step", "optimizer step")
    clock.wrap(transformers.Trainer, "save_model", "save model")


def train_once(recipe_name: str, bf16: bool, steps: int, eval_size: int, seed: int) -> dict[str, Any]:
    """A short `otbrl train` run of the recipe, timed; its phases, steps and generated tokens."""
    from otbrl.app.recipe import load_recipe
    from otbrl.app.train import run

    clock = Clock()
    instrument(clock)
    out = Path(tempfile.mkdtemp(prefix="llm-time-"))
    overrides = {
        "max_steps": steps,
        "save_steps": 10_000,
        "eval_before": True,
        "eval_size": eval_size,
        "eval_at_tokens": None,
        "max_generated_tokens": None,
        "bf16": bf16,
        "threads": 1,
        "seed": seed,
        "plot": False,
        "output_dir": str(out),
        "disable_tqdm": True,
    }
    recipe = load_recipe(recipe_name, overrides)
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        run(recipe, log=print)
    finally:
        clock.restore()
    total = (time.perf_counter() - wall, time.process_time() - cpu)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "bf16": bf16,
        "total_wall": total[0],
        "total_cpu": total[1],
        "steps": len(metrics),
        "tokens": metrics[-1].get("generated_tokens", 0) if metrics else 0,
        "phases": clock.rows(),
        "out": str(out),
    }


def eval_batching(recipe_name: str, prompts: int, chunk: int, seed: int) -> list[dict[str, Any]]:
    """The float32 held-out evaluation's sampling, timed on `prompts` prompts as one batch (today's
    `evaluate`) and as chunks of `chunk` rows, from the same model."""
    from otbrl.app.recipe import load_recipe, make_config
    from otbrl.app.sources import choose_model, load_model, load_rows, load_tokenizer, shape_prompts
    from otbrl.rollout.sampler import sample

    recipe = load_recipe(recipe_name, {"eval_size": prompts, "bf16": False, "threads": 1})
    config = make_config(recipe)
    _, rows = load_rows(recipe)
    recipe = choose_model(recipe, print)
    tokenizer = load_tokenizer(recipe)
    _, rows, _ = shape_prompts(recipe, tokenizer, [], rows, config)
    model, tokenizer = load_model(recipe, print, tokenizer)
    model.eval()
    texts = [r["prompt"] for r in rows]
    out = []
    for size in (prompts, chunk):
        gen = torch.Generator().manual_seed(seed)
        wall, cpu, generated = time.perf_counter(), time.process_time(), 0
        for i in range(0, len(texts), size):
            s = sample(
                model,
                tokenizer,
                texts[i : i + size],
                1,
                config.max_completion_length,
                config.temperature,
                gen,
            )
            generated += int(s.completion_mask.sum())
        out.append(
            {
                "batch": size,
                "prompts": len(texts),
                "wall": time.perf_counter() - wall,
                "cpu": time.process_time() - cpu,
                "tokens": generated,
            }
        )
        print(f"evaluation of {len(texts)} prompts in batches of {size}: {out[-1]}", flush=True)
    return out


def _sum(phases: list[list[Any]], test: Callable[[str], bool], own: bool, cpu: bool) -> float:
    column = (5 if own else 4) if cpu else (3 if own else 2)
    return sum(p[column] for p in phases if test(p[0]))


def breakdown(run: dict[str, Any], cpu: bool) -> list[tuple[str, float]]:
    """(phase, seconds) of a run's training (inside trainer.train), split as the page reports it."""
    ph = run["phases"]
    under = lambda end: lambda p: p.startswith("trainer.train") and p.endswith(end)  # noqa: E731
    parts = [
        ("sampling: model forwards", _sum(ph, under("sampler loop / model forward"), True, cpu)),
        (
            "sampling: the loop's own work (softmax, draw, log-probs)",
            _sum(ph, under("sampler loop"), True, cpu),
        ),
        ("energy (in the sampler, per token)", _sum(ph, under("sampler loop / energy"), False, cpu)),
        ("generation outside the loop (tokenize, decode, TRL)", _sum(ph, under("/ generate"), True, cpu)),
        ("rewards", _sum(ph, under("rewards"), False, cpu)),
        ("advantages (OTB)", _sum(ph, under("advantages"), False, cpu)),
        ("loss forward (with grad)", _sum(ph, under("loss forward"), False, cpu)),
        ("backward", _sum(ph, under("backward"), False, cpu)),
        ("optimizer step", _sum(ph, under("optimizer step"), False, cpu)),
        ("held-out evaluation inside training", _sum(ph, under("held-out evaluation"), False, cpu)),
    ]
    total = _sum(ph, lambda p: p == "trainer.train", False, cpu)
    parts.append(("other (TRL's step bookkeeping, callbacks, logging)", total - sum(v for _, v in parts)))
    return parts


def page(record: dict[str, Any]) -> str:
    """The results page (docs/results/llm-time.md) from the measurement record."""
    from studies.pages import markdown_table

    flags, why = set(record["cpu_flags"]), record["bf16_support"]
    runs = record["runs"]
    lines = [
        "# Where a real-model run's time goes: SmolLM2-135M-Instruct on this CPU",
        "",
        f"Machine: {record['machine']}.",
        "",
        f"CPU capability: {why} (avx512_bf16 {'yes' if 'avx512_bf16' in flags else 'no'}, amx_bf16 "
        f"{'yes' if 'amx_bf16' in flags else 'no'}). On a CPU without them bf16 autocast is emulated and "
        "several times slower (CPU_NOTES: 338 s against 48 s a step); these times do not carry over there.",
        "",
        "Regenerate (from the repo root): `.venv/bin/python -m studies.llm_time --recipe "
        + f"{record['recipe']} --steps {record['steps']} --eval-size {record['eval_size']}`"
        + (" (--quick)" if record.get("quick") else ""),
        "",
        f"Recipe `{record['recipe']}`: otbrl's sampler, OTB, N=4, 4 prompts x 4 completions a step, "
        f"{record['steps']} steps from the untrained model, a held-out evaluation of {record['eval_size']} "
        "prompts before and after, one torch thread, seed 0. Timers wrap the phases from outside "
        "(studies/llm_time.py); wall time includes waiting for a core on this shared machine, CPU time is "
        "the process's own. The steps ran at the untrained model's completion lengths; a step's cost moves "
        "with the lengths as training changes them.",
        "",
    ]
    header = ["phase"]
    rows: dict[str, list[str]] = {}
    for run in runs:
        name = "bf16 autocast" if run["bf16"] else "float32"
        header += [f"{name}: wall s/step", f"{name}: CPU s/step", f"{name}: share (CPU)"]
        steps = max(run["steps"], 1)
        wall, cpu = dict(breakdown(run, False)), dict(breakdown(run, True))
        total_cpu = sum(cpu.values())
        for phase in wall:
            rows.setdefault(phase, [phase])
            rows[phase] += [
                f"{wall[phase] / steps:.2f}",
                f"{cpu[phase] / steps:.2f}",
                f"{cpu[phase] / total_cpu:.0%}",
            ]
    totals = ["training step, all"]
    for run in runs:
        steps = max(run["steps"], 1)
        wall = sum(v for _, v in breakdown(run, False))
        cpu = sum(v for _, v in breakdown(run, True))
        totals += [f"{wall / steps:.2f}", f"{cpu / steps:.2f}", "100%"]
    lines += ["## One training step", "", markdown_table(header, [*rows.values(), totals]), ""]
    ev_rows = []
    for run in runs:
        name = "bf16 autocast" if run["bf16"] else "float32"
        ph = run["phases"]
        calls = sum(p[1] for p in ph if p[0] == "held-out evaluation")
        wall = _sum(ph, lambda p: p == "held-out evaluation", False, False)
        cpu = _sum(ph, lambda p: p == "held-out evaluation", False, True)
        per = max(calls * record["eval_size"], 1)
        ev_rows.append(
            [
                name,
                str(calls),
                f"{wall / max(calls, 1):.1f}",
                f"{cpu / max(calls, 1):.1f}",
                f"{cpu / per:.3f}",
            ]
        )
        tokens = run["tokens"] / max(run["steps"], 1)
        ev_rows[-1].append(f"{tokens:.0f}")
    lines += [
        "## Held-out evaluation and tokens",
        "",
        markdown_table(
            [
                "precision",
                "evaluations",
                "wall s each",
                "CPU s each",
                "CPU s per prompt",
                "generated tokens/step",
            ],
            ev_rows,
        ),
        "",
    ]
    b = record["eval"]
    lines += [
        f"## Evaluation batching (float32, {b[0]['prompts']} held-out prompts, one sample each)",
        "",
        markdown_table(
            ["batch (rows)", "wall s", "CPU s", "generated tokens", "CPU s per prompt"],
            [
                [
                    str(e["batch"]),
                    f"{e['wall']:.0f}",
                    f"{e['cpu']:.0f}",
                    str(e["tokens"]),
                    f"{e['cpu'] / e['prompts']:.3f}",
                ]
                for e in b
            ],
        ),
        "",
    ]
    lines += cost_section(record)
    lines += cuts_section(record)
    return "\n".join(lines) + "\n"


def cuts_section(record: dict[str, Any]) -> list[str]:
    """Which cuts keep the protocol's numbers, with the measured cost of what they remove."""
    fp32 = next(r for r in record["runs"] if not r["bf16"])
    ph = fp32["phases"]
    evals = max(sum(p[1] for p in ph if p[0] == "held-out evaluation"), 1)
    ev_cpu = _sum(ph, lambda p: p == "held-out evaluation", False, True) / evals
    ev_energy = _sum(
        ph, lambda p: p.startswith("held-out evaluation") and p.endswith("/ energy"), False, True
    )
    ev_loop_own = _sum(ph, lambda p: p == "held-out evaluation / sampler loop", True, True)
    saves = _sum(ph, lambda p: p.endswith("save model"), False, False)
    save_calls = sum(p[1] for p in ph if p[0].endswith("save model"))
    bf16 = next((r for r in record["runs"] if r["bf16"]), None)
    ratio = ""
    if bf16 is not None:
        a = sum(v for _, v in breakdown(fp32, True)) / max(fp32["steps"], 1)
        b = sum(v for _, v in breakdown(bf16, True)) / max(bf16["steps"], 1)
        ea = _sum(ph, lambda p: p == "held-out evaluation", False, True)
        eb = _sum(bf16["phases"], lambda p: p == "held-out evaluation", False, True)
        ratio = (
            f" Here bf16 autocast took {b / a:.2f}x float32's CPU time a training step and "
            f"{eb / max(ea, 1e-9):.2f}x its held-out evaluation."
        )
    return [
        "## Cuts, and whether they keep the protocol's numbers",
        "",
        "Keep every number (the same tokens drawn, the same scores and updates):",
        "",
        f"- The held-out evaluation computes each sampled token's energy and log-prob and never uses them: "
        f"{ev_energy / evals:.1f} CPU s of energy and {ev_loop_own / evals:.1f} s of the loop's own work "
        f"(log-softmax, draw, bookkeeping) per evaluation of {record['eval_size']} prompts, out of "
        f"{ev_cpu:.1f}. Skipping the energy and log-prob there draws the same tokens (they are computed "
        "beside the draw, not for it). It needs an option in `otbrl.rollout` (not in this issue's files).",
        f"- Saving: {save_calls} `save_model` calls took {saves:.0f} s of wall time in this run (a 540 MB "
        "float32 checkpoint each). The scores come from the evaluation, not from saved weights.",
        "- Already in place: the step-0 evaluation is computed once per seed and shared by its arms "
        "(`otbrl.app.heldout_cache`), and runs go as one-thread processes side by side.",
        "",
        "Keep the protocol's meaning but not its exact samples (so fixed in the protocol before its first "
        "run, never switched mid-experiment):",
        "",
        "- Evaluating in chunks instead of all held-out prompts in one batch (table above): the random "
        "stream is consumed in another order.",
        "- Dropping finished rows from the decoding batch: the loop decodes every row until the longest ends "
        "(up to the 128-token cap), so a batch costs about rows x its longest completion, not the sum of the "
        "lengths; dropping rows changes which random numbers each row draws.",
        "- bf16 autocast where every machine of the protocol computes bf16 natively (AMX or AVX-512 BF16); "
        "float32 where any machine lacks it (emulated bf16 is several times slower)." + ratio,
        "- A static KV cache instead of one that grows by concatenation every step: the same arithmetic, "
        "but other kernels, whose float rounding may differ.",
        "",
    ]


# The draft smollm2b protocol's shape (studies/experiments/smollm2b.yaml): what a seed costs
PROTOCOL_TOKENS = 20_000  # generated tokens per arm
PROTOCOL_EVAL = (
    1024  # held-out prompts per evaluation: one at step 0 (shared by a seed's arms), one at the end
)
PROTOCOL_ARMS = 3


def cost_section(record: dict[str, Any]) -> list[str]:
    """CPU minutes of one seed of the draft protocol (3 arms x 20k tokens, 1 + 3 evaluations of 1,024
    prompts), from this page's float32 measurements at the two evaluation batch sizes measured, and in
    bf16 autocast (its measured ratios to float32) where the CPU computes bf16 natively."""
    fp32 = next(r for r in record["runs"] if not r["bf16"])
    steps = max(fp32["steps"], 1)
    step_cpu = sum(v for _, v in breakdown(fp32, True)) / steps
    tokens = fp32["tokens"] / steps
    train = PROTOCOL_TOKENS / max(tokens, 1) * step_cpu
    whole, chunked = record["eval"][0], record["eval"][1]
    rows = []
    for label, e in (
        (f"float32, batches of {whole['batch']}", whole),
        (f"float32, batches of {chunked['batch']}", chunked),
    ):
        ev = e["cpu"] / e["prompts"] * PROTOCOL_EVAL
        seed = PROTOCOL_ARMS * train + (1 + PROTOCOL_ARMS) * ev
        rows.append(
            [label, f"{train / 60:.0f}", f"{ev / 60:.0f}", f"{seed / 60:.0f}", f"{2 * 3600 / seed:.2f}"]
        )
    bf16 = next((r for r in record["runs"] if r["bf16"]), None)
    if bf16 is not None:  # bf16's training step as measured; its evaluation at float32's ratio in-run
        b_train = PROTOCOL_TOKENS / max(bf16["tokens"] / max(bf16["steps"], 1), 1)
        b_train *= sum(v for _, v in breakdown(bf16, True)) / max(bf16["steps"], 1)
        ratio = _sum(bf16["phases"], lambda p: p == "held-out evaluation", False, True) / max(
            _sum(fp32["phases"], lambda p: p == "held-out evaluation", False, True), 1e-9
        )
        ev = whole["cpu"] / whole["prompts"] * PROTOCOL_EVAL * ratio
        seed = PROTOCOL_ARMS * b_train + (1 + PROTOCOL_ARMS) * ev
        rows.append(
            [
                f"bf16 autocast, batches of {whole['batch']} (native-bf16 machines only)",
                f"{b_train / 60:.0f}",
                f"{ev / 60:.0f}",
                f"{seed / 60:.0f}",
                f"{2 * 3600 / seed:.2f}",
            ]
        )
    from studies.pages import markdown_table

    return [
        "## What a seed of the draft protocol costs here (estimated)",
        "",
        f"From the float32 rows above: {step_cpu:.0f} CPU s and {tokens:.0f} generated tokens a "
        f"training step; a seed is {PROTOCOL_ARMS} arms x {PROTOCOL_TOKENS:,} tokens plus "
        f"{1 + PROTOCOL_ARMS} held-out evaluations of {PROTOCOL_EVAL:,} prompts (step 0, shared by the "
        "arms, and each arm's last). Seeds an hour assume two one-thread processes with a core each; on "
        f"this loaded machine expect less. Per prompt, one batch of {whole['batch']} cost "
        f"{whole['cpu'] / whole['prompts']:.2f} CPU s and chunks of {chunked['batch']} "
        f"{chunked['cpu'] / chunked['prompts']:.2f}; the table applies each to 1,024 prompts "
        + (
            "(one batch of 1,024, today's evaluation, costs at least as much per prompt as the measured "
            "batch: the per-prompt cost grew with the batch here)."
            if whole["cpu"] / whole["prompts"] > chunked["cpu"] / chunked["prompts"]
            else "(here the larger batch was not dearer per prompt)."
        )
        + " One batch of 1,024 was not measured: SmolLM2-135M's KV cache takes 46 KB a token in float32 "
        "(30 layers x keys and values x 3 KV heads x 64 x 4 bytes), about 9 GB for 1,024 rows of ~190 "
        "tokens, beside the other runs on this 24 GiB machine; today's `evaluate` samples all its prompts in "
        "one batch, so a 1,024-prompt protocol needs the evaluation chunked.",
        "",
        markdown_table(
            [
                "precision, evaluation batching",
                "train CPU min/arm",
                "CPU min/evaluation",
                "CPU min/seed",
                "seeds/hour, 2 cores",
            ],
            rows,
        ),
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True, help="a SmolLM2 recipe (otbrl/app/recipes/)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--eval-size", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="1 step, 8 held-out prompts, to a temp file")
    parser.add_argument("--out", type=Path, help="markdown output path")
    parser.add_argument("--page-only", type=Path, help="rewrite the page from this measurement record")
    args = parser.parse_args()
    steps, eval_size = (1, 8) if args.quick else (args.steps, args.eval_size)
    out = args.out or (Path(tempfile.gettempdir()) if args.quick else RESULTS) / "llm-time.md"
    if args.page_only:
        record = json.loads(args.page_only.read_text())
    else:
        from studies.pages import machine

        torch.set_num_threads(1)
        from otbrl.app.precision import NATIVE_BF16_FLAGS, bf16_support, cpu_flags

        native, why = bf16_support(use_cpu=True)
        runs = [train_once(args.recipe, False, steps, eval_size, 0)]
        if native:
            runs.append(train_once(args.recipe, True, steps, eval_size, 0))
        batching = eval_batching(args.recipe, 4 * eval_size, eval_size, 0)
        record = {
            "recipe": args.recipe,
            "quick": args.quick,
            "steps": steps,
            "eval_size": eval_size,
            "machine": machine(1),
            "bf16_support": why,
            "cpu_flags": sorted(
                f for f in cpu_flags() if f in NATIVE_BF16_FLAGS or f.startswith(("avx", "amx"))
            ),
            "runs": runs,
            "eval": batching,
        }
        out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    out.write_text(page(record))
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
