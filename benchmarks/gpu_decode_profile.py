"""Where a long decode's time goes on a GPU (issue 38): per-step times of otbrl's `decode` and of `generate`,
in 128-step buckets, each after a 128-token warm-up (Qwen2.5-0.5B's configuration, random weights, bf16,
batch 16, 32-token prompts, 1,024 tokens), and the profiler's top operators over ten of decode's steps
near the end. Both loops call SDPA with the same shapes, so an attention backend that builds a plan per
key length (cuDNN's) pays for a length once per process: the loop that runs second finds them built.

    python3 benchmarks/gpu_decode_profile.py [TOKENS]   # a CUDA machine, ~2.5 min; also runs on the CPU
"""

import sys
import time
from pathlib import Path

import torch
from transformers import LogitsProcessor

sys.path.insert(0, str(Path(__file__).parent))
from bench_gpu_step import make_model  # noqa: E402

from otbrl.rollout.sampler import decode  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SYNC = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
ACTIVITIES = [torch.profiler.ProfilerActivity.CPU]
if DEV == "cuda":
    ACTIVITIES.append(torch.profiler.ProfilerActivity.CUDA)
B, P, L = 16, 32, int(sys.argv[1]) if len(sys.argv) > 1 else 1024
stamps: list[float] = []
prof = torch.profiler.profile(activities=ACTIVITIES)


def buckets(name: str) -> None:
    d = torch.tensor(stamps).diff() * 1e3
    means = " ".join(f"{d[a : a + 128].mean():.1f}" for a in range(0, len(d), 128))
    print(name, means, "ms/step by 128", flush=True)


def clock(tok: torch.Tensor, profile: bool = False) -> torch.Tensor:
    SYNC()
    stamps.append(time.perf_counter())
    if profile and len(stamps) == L - 30:
        prof.start()
    if profile and len(stamps) == L - 20:
        prof.stop()
    return torch.zeros_like(tok, dtype=torch.bool)


class Clock(LogitsProcessor):
    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        SYNC()
        stamps.append(time.perf_counter())
        return scores


def main() -> None:
    model = make_model("Qwen2.5-0.5B" if DEV == "cuda" else "tiny", DEV).eval()
    print(DEV, torch.__version__, "attention", model.config._attn_implementation, flush=True)
    ids = torch.randint(3, model.config.vocab_size - 10, (B, P), device=DEV)
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, do_sample=True, top_k=0, top_p=1.0, eos_token_id=1, pad_token_id=0)
    with torch.no_grad():
        decode(model, ids, mask, 128, 1.0, [1], 0, stop=clock)
        stamps.clear()
        t = time.perf_counter()
        decode(model, ids, mask, L, 1.0, [1], 0, stop=lambda tok: clock(tok, True))
        print(f"decode {time.perf_counter() - t:.1f} s", flush=True)
        buckets("decode")
        model.generate(ids, max_new_tokens=128, min_new_tokens=128, logits_processor=[Clock()], **kw)
        stamps.clear()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=L, min_new_tokens=L, logits_processor=[Clock()], **kw)
        print(f"generate {time.perf_counter() - t:.1f} s", flush=True)
        buckets("generate")
    for key in ("cuda_time_total" if DEV == "cuda" else "self_cpu_time_total", "cpu_time_total"):
        print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=50))


if __name__ == "__main__":
    main()
