"""OTB's cost per TRL step at a size people train, on a CUDA GPU: Qwen2.5-0.5B and Qwen2.5-1.5B built from
their public configurations (vocabulary 151,936, tied embeddings) with random weights, in bf16.

    python3 benchmarks/bench_gpu_step.py --out docs/results/gpu-step.md    # a CUDA machine, ~5 min
    .venv/bin/python benchmarks/bench_gpu_step.py --quick                  # a tiny Qwen2 on the CPU

Arms, every one on the same prompts and, with learning rate 0, the very same completions:
  grpo (TRL)   TRL's own GRPOTrainer, its default scale_rewards ("group"): the baseline a TRL user has
  grpo         OTBGRPOTrainer, advantage_estimator="grpo"
  dr_grpo      OTBGRPOTrainer, the group mean (no energy)
  otb          OTBGRPOTrainer, OTB
Two generation paths: `generate` (TRL generates with transformers; num_iterations=2, so TRL runs its
old-log-prob pass and OTB reads the energy from that same fused-head forward) and `rollout_func`
(otbrl's KV-cache sampler; the energy comes with the sampled tokens). A step is timed from the Trainer's
on_step_begin to on_step_end with the GPU synchronised at both ends; num_iterations=2 means a generation
every second step, so the mean is over whole pairs of steps. Peak memory is torch's max_memory_allocated
over the run (weights and optimizer state included). Arms alternate within a repeat, order reversed on
odd repeats. No download: the tokenizer is a word-level one with one token per id of the vocabulary.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import RESULTS, machine, markdown_table
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from otbrl.integrations.trl import OTBGRPOConfig, OTBGRPOTrainer, sampler_rollout_func

TARGET = 1.02
# Public configurations (the Hub's config.json of Qwen/Qwen2.5-0.5B and Qwen/Qwen2.5-1.5B)
SIZES = {
    "Qwen2.5-0.5B": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14
    ),
    "Qwen2.5-1.5B": dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12
    ),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
}
VOCAB = {"tiny": 1000}
ARMS = {"generate": ["grpo (TRL)", "grpo", "dr_grpo", "otb"], "rollout_func": ["grpo", "dr_grpo", "otb"]}


def word_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """One word per id, so any sampled id decodes: <pad>, <eos>, <unk>, then 't3' ... 't{vocab-1}' (special
    tokens named apart from the words: an added token matches inside longer words)."""
    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def make_model(size: str, device: str) -> Qwen2ForCausalLM:
    vocab = VOCAB.get(size, 151_936)
    config = Qwen2Config(
        vocab_size=vocab,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=1,
        **SIZES[size],
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(torch.bfloat16 if device == "cuda" else torch.float32)


def prompts(n: int, vocab: int, length: int = 32) -> Dataset:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (n, length), generator=g)
    return Dataset.from_list([{"prompt": " ".join(f"t{i}" for i in row.tolist())} for row in ids])


def reward(completions: list, **_: Any) -> list[float]:
    """Varies within a group (advantages are not all zero) and costs nothing."""
    return [float(hash(c) % 7) / 6 for c in completions]


class GPUClock(TrainerCallback):
    """Wall time of each optimizer step with the GPU synchronised at both ends."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self._start = 0.0

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        self._sync()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        self._sync()
        self.wall.append(time.perf_counter() - self._start)


def run(size: str, path: str, arm: str, steps: int, batch: int, length: int) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    os.environ["PYTHONHASHSEED"] = "0"
    vocab = VOCAB.get(size, 151_936)
    with tempfile.TemporaryDirectory() as out:
        common = dict(
            output_dir=out,
            use_cpu=not cuda,
            bf16=cuda,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            max_steps=steps,
            learning_rate=0.0,
            per_device_train_batch_size=batch,
            num_generations=4,
            max_completion_length=length,
            num_iterations=2,
            beta=0.0,
            seed=0,
            disable_tqdm=True,
            temperature=1.0,
        )
        clock = GPUClock()
        model = make_model(size, device)
        kwargs = dict(
            model=model,
            reward_funcs=reward,
            processing_class=word_tokenizer(vocab),
            train_dataset=prompts(64, vocab),
            callbacks=[clock],
        )
        if path == "rollout_func":
            kwargs["rollout_func"] = sampler_rollout_func()
        if arm == "grpo (TRL)":
            trainer = GRPOTrainer(args=GRPOConfig(**common), **kwargs)
        else:
            trainer = OTBGRPOTrainer(args=OTBGRPOConfig(**common, advantage_estimator=arm), **kwargs)
        generate = trainer._generate  # TRL's one entry to generation, rollout_func included (trl 1.16)
        generation: list[float] = []

        def timed_generate(prompts: list) -> Any:
            clock._sync()
            start = time.perf_counter()
            out = generate(prompts)
            clock._sync()
            generation.append(time.perf_counter() - start)
            return out

        trainer._generate = timed_generate
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        source = getattr(trainer, "energy_source", None)
        del trainer, model
        if cuda:
            torch.cuda.empty_cache()
    timed = clock.wall[2:]  # the first pair of steps (one generation) is warm-up: kernels compile there
    rest = (sum(timed) - sum(generation[1:])) / len(timed)  # the step without its generation
    # num_iterations=2: timed steps 0, 2, ... generate (then TRL's old-log-prob pass, rewards, advantages:
    # where OTB's work is); steps 1, 3, ... only train on those advantages, the same work in every arm
    generating, training = timed[0::2], timed[1::2]
    gen_rest = [s - g for s, g in zip(generating, generation[1:], strict=False)]
    return {
        "step": statistics.mean(timed),
        "each": timed,
        "rest": rest,
        "train_only": statistics.mean(training) if training else float("nan"),
        "gen_rest": statistics.mean(gen_rest) if len(gen_rest) == len(generating) else float("nan"),
        "peak": peak,
        "source": source,
    }


def verdict(ratios: list[tuple[str, str, float]], spread: dict[tuple[str, str], float]) -> str:
    """The target read against the noise: OTB's median ratio (step without generation, over grpo's) per
    size and path, and `spread`, the largest ratio between two arms' steps that only train (the same work
    in every arm) in that size and path. A ratio above the target is a cost only where it exceeds that
    spread; otherwise these runs cannot tell."""
    if not ratios:
        return "OTB / grpo: no pair of runs finished."
    worst = max(r for *_, r in ratios)
    parts = [
        f"{s} {p} {r:.3f}x (identical work differs by up to {spread.get((s, p), float('nan')):.3f}x)"
        for s, p, r in ratios
    ]
    if worst <= TARGET:
        result = "met"
    elif all(r <= spread.get((s, p), float("nan")) for s, p, r in ratios):  # nan: never excused
        result = "not resolved: every excess is within the spread between arms doing the same work"
    else:
        result = "NOT met"
    return (
        "OTB / grpo, step time without generation (same trainer, same completions; generation is the same "
        "work in every arm and its run-to-run spread would hide a 2% cost): "
        + "; ".join(parts)
        + f". Target <= {TARGET}x: {result} (worst {worst:.3f}x)."
    )


def write_page(out: Path, results: dict, gpu: str, steps: int, batch: int, length: int) -> None:
    """The page from the runs so far (rewritten after every run, so a stop at the time limit keeps them)."""
    rows, ratios = [], []
    spread: dict[tuple[str, str], float] = {}
    for size, path in {(s, p) for s, p, _ in results}:
        train = [
            statistics.median(r["train_only"] for r in rs)
            for (s, p, _), rs in results.items()
            if (s, p) == (size, path)
        ]
        spread[(size, path)] = max(train) / min(train) if len(train) > 1 and min(train) > 0 else float("nan")
    for (size, path, arm), rs in results.items():
        pairs = list(zip(rs, results.get((size, path, "grpo"), []), strict=False))  # both finished
        ratio = statistics.median(r["step"] / b["step"] for r, b in pairs) if pairs else float("nan")
        rest = statistics.median(r["rest"] / b["rest"] for r, b in pairs) if pairs else float("nan")
        if arm == "otb" and pairs:
            ratios.append((size, path, rest))
        rows.append(
            [
                size,
                path,
                arm,
                rs[0]["source"] or "none",
                " / ".join(f"{r['step']:.3f}" for r in rs),
                f"{ratio:.3f}x",
                " / ".join(f"{r['rest']:.3f}" for r in rs),
                f"{rest:.3f}x",
                " / ".join(f"{r['train_only']:.3f}" for r in rs),
                " / ".join(f"{r['gen_rest']:.3f}" for r in rs),
                f"{max(r['peak'] for r in rs):.2f}",
            ]
        )
    header = ["model", "generation", "arm", "energy from", "s/step (each repeat)", "vs grpo"]
    header += ["s/step without generating", "vs grpo", "a step that only trains (s)"]
    header += ["a generating step less generation (s)", "peak GiB"]
    line = verdict(ratios, spread)
    import transformers
    import trl

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}"
    description = (
        f"GPU: {gpu}; {versions}. Random weights in bf16 from the public configurations (no download), "
        f"{batch} completions per step (groups of 4) of {length} tokens at most after 32-token prompts "
        f"(a random model rarely samples eos, so nearly every completion is full length); "
        f"{steps} steps per run, the first 2 discarded; learning rate 0; num_iterations=2 (a generation "
        "every second step; the mean is over whole pairs). `vs grpo` is the median over repeats of the arm's "
        "step time over the grpo arm's in the same trainer and generation path; `without generating` "
        "subtracts the time spent in TRL's `_generate` (rollout_func included), GPU synchronised. Of the "
        "timed steps, every other one only trains on advantages already computed (the same work in every "
        "arm: its spread between arms is the runs' noise); the others generate, and what is left of them "
        "after generation holds TRL's old-log-prob pass, the rewards and the advantages (OTB's work)."
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        f"# OTB's cost per TRL step at real model size\n\nMachine: {machine(torch.get_num_threads())}.\n\n"
        f"Regenerate on a CUDA machine (from the repo root): `python3 benchmarks/bench_gpu_step.py`\n\n"
        f"{description}\n\n{markdown_table(header, rows)}\n\n{line}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny Qwen2, few steps, to a temp file")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--sizes", default="Qwen2.5-0.5B,Qwen2.5-1.5B")
    parser.add_argument("--repeats", default="2,1", help="repeats per size, comma-separated")
    parser.add_argument("--steps", type=int, default=6, help="steps per run; the first 2 are warm-up")
    parser.add_argument("--batch", type=int, default=32, help="completions per step (groups of 4)")
    parser.add_argument("--length", type=int, default=128, help="max_completion_length")
    args = parser.parse_args()
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    sizes = ["tiny"] if args.quick else args.sizes.split(",")
    repeats = [1] if args.quick else [int(r) for r in args.repeats.split(",")]
    steps, length = (4, 16) if args.quick else (args.steps, args.length)
    out = args.out or (Path(tempfile.gettempdir()) if args.quick else RESULTS) / "gpu-step.md"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (CPU)"
    print(machine(torch.get_num_threads()), "|", gpu, flush=True)

    results: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for size, reps in zip(sizes, repeats, strict=True):
        for rep in range(reps):
            for path, arms in ARMS.items():
                for arm in arms if rep % 2 == 0 else arms[::-1]:
                    r = run(size, path, arm, steps, args.batch, length)
                    results.setdefault((size, path, arm), []).append(r)
                    print(
                        f"{size} repeat {rep} {path:12s} {arm:10s} {r['step']:.3f} s/step "
                        f"(steps {', '.join(f'{t:.3f}' for t in r['each'])}), peak {r['peak']:.2f} GiB, "
                        f"energy from {r['source']}",
                        flush=True,
                    )
                    write_page(out, results, gpu, steps, args.batch, length)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
