"""Sampling throughput on a CUDA GPU: otbrl's KV-cache sampler (`otbrl.rollout.sampler.sample`, which also
returns each token's log-prob and energy) against transformers' `generate` at the same settings (plain
sampling at temperature 1: top_k 0, top_p 1), Qwen2.5-0.5B's configuration with random weights in bf16.

    python3 benchmarks/bench_gpu_sampler.py --out docs/results/gpu-sampler.md   # a CUDA machine, ~2 min
    .venv/bin/python benchmarks/bench_gpu_sampler.py --quick                    # a tiny Qwen2 on the CPU

Each cell: one untimed warm-up call of the same shape (the whole length), then the mean of `--repeats`
timed calls (GPU synchronised). Tokens counted are the completion tokens each call returned (a random
model rarely samples eos, so nearly all rows run to the length asked for); prompts are 32 tokens.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from bench_gpu_step import make_model, word_tokenizer
from common import RESULTS, machine, markdown_table

from otbrl.rollout.sampler import sample


def timed(call) -> tuple[float, int]:  # noqa: ANN001
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = call()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def write_page(out: Path, rows: list[list[str]], gpu: str, size: str, cuda: bool, repeats: int) -> None:
    import transformers

    header = ["batch", "completion tokens", "otbrl sampler tok/s", "generate tok/s", "sampler / generate"]
    description = (
        f"GPU: {gpu}; torch {torch.__version__}, transformers {transformers.__version__}. {size} "
        f"configuration, random weights, {'bf16' if cuda else 'float32'}; 32-token prompts; plain "
        f"sampling at temperature 1; {repeats} timed call(s) per cell after one warm-up of the whole length. "
        "The sampler "
        "also returns each token's log-prob and OTB energy; generate returns tokens only."
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        f"# Sampling throughput on a GPU: otbrl's sampler against generate\n\n"
        f"Machine: {machine(torch.get_num_threads())}.\n\n"
        f"Regenerate on a CUDA machine (from the repo root): `python3 benchmarks/bench_gpu_sampler.py`\n\n"
        f"{description}\n\n{markdown_table(header, rows)}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a tiny Qwen2, short completions, to a temp file"
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--cells", help="BATCHxTOKENS,... (default 16x256,64x256,16x1024,64x1024)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    size = "tiny" if args.quick else "Qwen2.5-0.5B"
    cells = [(4, 8), (8, 16)] if args.quick else [(16, 256), (64, 256), (16, 1024), (64, 1024)]
    if args.cells:
        cells = [(int(b), int(t)) for b, t in (c.split("x") for c in args.cells.split(","))]
    out = args.out or (Path(tempfile.gettempdir()) if args.quick else RESULTS) / "gpu-sampler.md"
    gpu = torch.cuda.get_device_name() if cuda else "no GPU (CPU)"
    print(machine(torch.get_num_threads()), "|", gpu, flush=True)
    model = make_model(size, device).eval()
    vocab = model.config.vocab_size
    tok = word_tokenizer(vocab)
    g = torch.Generator().manual_seed(0)

    rows = []
    for batch, length in cells:
        texts = [
            " ".join(f"t{i}" for i in torch.randint(3, vocab, (32,), generator=g).tolist())
            for _ in range(batch)
        ]
        enc = tok(texts, return_tensors="pt").to(device)

        def otbrl_call(texts=texts, length=length) -> int:
            gen = torch.Generator(device).manual_seed(0)
            with torch.no_grad():
                s = sample(model, tok, texts, 1, length, temperature=1.0, generator=gen)
            return int(s.completion_mask.sum())

        def generate_call(enc=enc, length=length) -> int:
            with torch.no_grad():
                ids = model.generate(
                    **enc,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=length,
                    pad_token_id=tok.pad_token_id,
                    eos_token_id=tok.eos_token_id,
                )
            new = ids[:, enc["input_ids"].shape[1] :]
            ended = (new == tok.eos_token_id).cumsum(1) - (new == tok.eos_token_id).int()  # tokens after eos
            return int((ended == 0).sum())

        speeds = {}
        for name, call in (("otbrl sampler", otbrl_call), ("generate", generate_call)):
            # A whole-length warm-up: attention backends that build a plan per key length (cuDNN's, which
            # `generate` may use on an H100) have then built every plan, as they have after a few training
            # steps; a short warm-up left them to whichever contender ran first (gpu-decode-profile.md).
            timed(call)
            runs = [timed(call) for _ in range(args.repeats)]
            seconds = sum(t for t, _ in runs) / len(runs)
            tokens = sum(n for _, n in runs) / len(runs)
            speeds[name] = tokens / seconds
            print(f"batch {batch} length {length} {name}: {tokens:.0f} tokens in {seconds:.2f} s", flush=True)
        rows.append(
            [
                str(batch),
                str(length),
                f"{speeds['otbrl sampler']:,.0f}",
                f"{speeds['generate']:,.0f}",
                f"{speeds['otbrl sampler'] / speeds['generate']:.2f}x",
            ]
        )
        write_page(out, rows, gpu, size, cuda, args.repeats)  # after every cell: a stop keeps them
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
