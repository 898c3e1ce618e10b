"""Supervised warm start: teach a tiny model a task by teacher forcing until its sampled reward passes a
target, so RL starts with signal. Checkpoints are cached on disk under a key of everything that
determines them; `python -m otbrl.tasks.warmstart TASK` builds one from the command line.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.resources
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm  # a dependency of transformers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from otbrl.rollout.evaluate import evaluate
from otbrl.tasks.builtin import TASKS, Task, dataset, get_task
from otbrl.tasks.models import PRESETS, tiny_model
from otbrl.tasks.split import draw
from otbrl.tasks.tokenizer import char_tokenizer

# Bump when a change to this module, the tasks or the models changes what a warm start produces.
WARM_START_VERSION = 1
SPLIT_CHOICES = ("all", "train")  # what the warm start draws from: the whole prompt space, or training's side


# Warm starts that ship inside the package, so a fresh machine need not rebuild them (read-only): package
# data beside the tasks that use them (otbrl/tasks/checkpoints, listed in pyproject's package-data).
SHIPPED = Path(str(importlib.resources.files("otbrl.tasks") / "checkpoints"))


def default_cache_dir() -> Path:
    """`$OTBRL_CACHE`, else `~/.cache/otbrl`."""
    return Path(os.environ.get("OTBRL_CACHE") or Path.home() / ".cache" / "otbrl")


def supervised_batch(
    tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, str]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forcing batch of `prompt + answer + <eos>` (or `prompt + segments + <eos>` for a row with
    "segments": [(text, trained), ...]), right-padded.

    Returns input_ids (B, L), attention_mask (B, L), loss_mask (B, L - 1): loss_mask[:, t] is 1 where
    input_ids[:, t + 1] is a trained answer token or eos (the target predicted at position t); tool
    output inside segments is read but not trained on.
    """
    seqs, trained = [], []
    for row in rows:
        prompt = tokenizer.encode(row["prompt"], add_special_tokens=False)
        parts = row.get("segments") or [(row["answer"], True)]
        ids, flags = list(prompt), [0] * len(prompt)
        for text, train in parts:
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            flags += [int(train)] * len(piece)
        seqs.append([*ids, tokenizer.eos_token_id])
        trained.append([*flags, 1])
    length = max(map(len, seqs))
    ids = torch.full((len(seqs), length), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    target = torch.zeros_like(ids)
    for i, (s, t) in enumerate(zip(seqs, trained, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        target[i, : len(s)] = torch.tensor(t)
    return ids, attn, target[:, 1:]


def draws(task: Task, rng: random.Random, n: int, split: str | None) -> list[tuple[str, str]]:
    """`n` supervised (prompt, answer) pairs: from the whole space (None) or the `"train"` side only."""
    if split is None:
        return [task.make(rng) for _ in range(n)]
    make = lambda: task.make(rng)  # noqa: E731
    return [draw(make, split, task.heldout_fraction, task.name, key=task.split_key) for _ in range(n)]


def _cache_key(spec: dict[str, Any]) -> str:
    blob = json.dumps(spec, sort_keys=True).encode()
    return f"{spec['task']}-{spec['preset']}-{hashlib.sha256(blob).hexdigest()[:12]}"


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hide transformers' per-file progress bars while saving or loading a tiny checkpoint."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _load(path: Path) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast, dict[str, Any]]:
    with _quiet_transformers():
        model = Qwen2ForCausalLM.from_pretrained(path).eval()
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    info = json.loads((path / "info.json").read_text())
    return model, tokenizer, {**info, "cached": True}


def _save(path: Path, model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase, info: dict) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with _quiet_transformers():
        model.save_pretrained(tmp)  # safetensors
        tokenizer.save_pretrained(tmp)
    (tmp / "info.json").write_text(json.dumps(info, indent=1))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def warm_start(
    task_name: str,
    preset: str = "small",
    *,
    target_reward: float = 0.3,
    max_seconds: float = 600.0,
    seed: int = 0,
    cache_dir: str | Path | bool | None = None,
    batch_size: int = 64,
    lr: float = 1e-3,
    weight_decay: float = 0.1,
    eval_every: int = 25,
    eval_size: int = 256,
    split: str = "all",
    log: Callable[[str], Any] | None = print,
) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast, dict[str, Any]]:
    """Train `tiny_model(preset, seed=seed)` on fresh `task_name` examples (AdamW, loss on answer and eos
    tokens only) until the sampled reward (temperature 1, `eval_size` fixed prompts, every `eval_every`
    steps) reaches `target_reward` or `max_seconds` pass.

    Returns (model in eval mode, tokenizer, info) where info holds steps, seconds, reward, reached, the
    eval history and `cached`. The result is stored under `cache_dir` (default `default_cache_dir()`);
    a later call with the same settings loads it instead of training, unless the stored run missed the
    target with a smaller time budget than asked for now. `cache_dir=False` disables caching. `log`
    gets progress lines (and a tqdm bar); `None` silences it.

    `split="train"` trains and picks its stopping point on the training side of the task's held-out
    split only (`otbrl.tasks.split`), so no stage before RL sees a held-out prompt; `"all"` (the
    checkpoints the registered experiments start from) draws from the whole prompt space.
    """
    if split not in SPLIT_CHOICES:
        raise ValueError(f"split: one of {SPLIT_CHOICES}, got {split!r}")
    task = get_task(task_name)
    spec = {
        "task": task.name,
        "preset": preset,
        "seed": seed,
        "target_reward": target_reward,
        "batch_size": batch_size,
        "lr": lr,
        "weight_decay": weight_decay,
        "eval_every": eval_every,
        "eval_size": eval_size,
        "version": WARM_START_VERSION,
        # only when set: the whole-space checkpoints keep their keys (and the experiments their starts)
        **({"split": split} if split != "all" else {}),
    }
    path = None
    if cache_dir is not False:
        path = Path(default_cache_dir() if cache_dir in (None, True) else cache_dir) / _cache_key(spec)
        # A checkpoint that ships with otbrl (built by the command in its README) stands in for the
        # default cache; a new build is always saved to the cache, never into the package.
        shipped = SHIPPED / _cache_key(spec)
        found = path
        if cache_dir in (None, True) and not (path / "info.json").is_file():
            found = shipped
        if (found / "info.json").is_file():
            info = json.loads((found / "info.json").read_text())
            if info["reached"] or info["max_seconds"] >= max_seconds:
                if log:
                    log(f"warm start: loaded {found} (reward {info['reward']:.3f}, {info['steps']} steps)")
                return _load(found)

    model, tokenizer, info = _train(task, preset, spec, max_seconds, log)
    if path is not None:
        _save(path, model, tokenizer, info)
        info["path"] = str(path)
    return model, tokenizer, info


def _train(
    task: Task, preset: str, spec: dict[str, Any], max_seconds: float, log: Callable[[str], Any] | None
) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast, dict[str, Any]]:
    tokenizer = char_tokenizer()
    model = tiny_model(preset, vocab_size=len(tokenizer), seed=spec["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))  # 20 warmup steps
    rng = random.Random(f"warm_start:{task.name}:{spec['seed']}")
    side = spec.get("split")  # None: the whole space
    eval_rows = dataset(task, spec["eval_size"], seed=10_000 + spec["seed"], split=side)
    bar = _progress(max_seconds, task.name) if log else None

    def eval_reward() -> float:
        return evaluate(
            model,
            tokenizer,
            eval_rows,
            task.score,
            task.max_completion_tokens,
            seed=spec["seed"],
            tools=task.tools,
            max_turns=task.max_turns,
        )

    start, step, reward, loss, history = time.perf_counter(), 0, 0.0, float("nan"), []
    snapshots: list[tuple[int, dict[str, torch.Tensor]]] = []  # states since the last evaluation

    def record(**entry: Any) -> None:
        history.append({"step": step, "seconds": round(time.perf_counter() - start, 2), **entry})

    while True:
        pairs = draws(task, rng, spec["batch_size"], side)
        batch = [{"prompt": p, "answer": a} for p, a in pairs]
        if task.demonstrate is not None:
            batch = [{**r, "segments": task.demonstrate(r["prompt"], r["answer"], rng)} for r in batch]
        loss = _train_step(model, opt, tokenizer, batch)
        sched.step()
        step += 1
        elapsed = time.perf_counter() - start
        out_of_time = elapsed >= max_seconds
        if step % spec["eval_every"] and not out_of_time:
            snapshots.append((step, {k: v.detach().clone() for k, v in model.state_dict().items()}))
        else:
            reward = eval_reward()
            record(loss=loss, reward=reward)
            if reward >= spec["target_reward"] and snapshots:  # rewind to where the jump passed the target
                target = spec["target_reward"]
                step, reward = _earliest_passing(model, snapshots, step, reward, eval_reward, target)
                record(reward=reward, rewound=True)
            snapshots.clear()
            elapsed = time.perf_counter() - start
            if bar is None and log:
                log(f"{task.name}: step {step} {elapsed:.0f}s loss {loss:.3f} reward {reward:.3f}")
            if reward >= spec["target_reward"] or out_of_time:
                break
        if bar is not None:
            bar.update(min(elapsed, max_seconds) - bar.n)
            bar.set_postfix(step=step, loss=f"{loss:.3f}", reward=f"{reward:.3f}", refresh=False)
    if bar is not None:
        bar.close()
    if log:
        log(f"warm start {task.name}/{preset}: reward {reward:.3f} after {step} steps, {elapsed:.0f}s")
    info = {
        **spec,
        "max_seconds": max_seconds,
        "steps": step,
        "seconds": round(elapsed, 2),
        "reward": reward,
        "reached": reward >= spec["target_reward"],
        "history": history,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": _command(spec, max_seconds),
        "cached": False,
    }
    return model.eval(), tokenizer, info


def _train_step(
    model: Qwen2ForCausalLM,
    opt: torch.optim.Optimizer,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, str]],
) -> float:
    """One AdamW step of teacher forcing, mean cross-entropy over answer and eos tokens; returns the loss.

    Rows of very different lengths run as length-sorted chunks with the gradient accumulated
    (`_length_chunks`): the same loss and gradient as one padded batch, up to rounding, at a fraction of
    the padded compute."""
    model.train()
    batches = [supervised_batch(tokenizer, chunk) for chunk in _length_chunks(tokenizer, rows)]
    trained = sum(target.sum() for _, _, target in batches)  # normaliser of the whole batch's mean
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for ids, attn, target in batches:
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()  # (b, L-1, V)
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * target).sum() / trained
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return total


def _length_chunks(
    tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, str]], chunks: int = 4
) -> list[list[dict[str, str]]]:
    """`rows` as one batch when padding to the longest wastes little (fixed-format tasks: unchanged),
    else sorted by length and cut into `chunks` parts, so short rows are not padded to the longest."""

    def length(row: dict[str, str]) -> int:
        parts = row.get("segments") or [(row["answer"], True)]
        return len(tokenizer.encode(row["prompt"] + "".join(t for t, _ in parts), add_special_tokens=False))

    lengths = [length(r) for r in rows]
    if len(rows) < 2 * chunks or max(lengths) * len(rows) <= 1.5 * sum(lengths):
        return [rows]
    order = sorted(range(len(rows)), key=lengths.__getitem__)
    size = -(-len(rows) // chunks)
    return [[rows[i] for i in order[k : k + size]] for k in range(0, len(rows), size)]


def _earliest_passing(
    model: Qwen2ForCausalLM,
    snapshots: list[tuple[int, dict[str, torch.Tensor]]],
    step: int,
    reward: float,
    reward_of_model: Callable[[], float],
    target: float,
) -> tuple[int, float]:
    """Warm starts jump suddenly, often far past the target within one evaluation interval. Bisect the
    states saved since the last (failing) evaluation for the earliest that passes `target`, load it into
    `model` and return its (step, reward); the current state (`step`, `reward`) passes by assumption."""
    current = {k: v.detach().clone() for k, v in model.state_dict().items()}
    candidates = [*snapshots, (step, current)]
    best, lo, hi = len(candidates) - 1, 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        model.load_state_dict(candidates[mid][1])
        r = reward_of_model()
        if r >= target:
            best, reward, hi = mid, r, mid
        else:
            lo = mid + 1
    model.load_state_dict(candidates[best][1])
    return candidates[best][0], reward


def _command(spec: dict[str, Any], max_seconds: float) -> str:
    """The command line that rebuilds this checkpoint."""
    opts = " ".join(
        f"--{key.replace('_', '-')} {spec[key]}"
        for key in (
            "preset",
            "seed",
            "target_reward",
            "batch_size",
            "lr",
            "weight_decay",
            "eval_every",
            "eval_size",
        )
    )
    split = f" --split {spec['split']}" if "split" in spec else ""
    return f"python -m otbrl.tasks.warmstart {spec['task']} {opts}{split} --max-seconds {max_seconds}"


def _progress(max_seconds: float, name: str) -> tqdm:
    fmt = "{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f}s {postfix}"
    return tqdm(total=max_seconds, desc=f"warm start {name}", bar_format=fmt, leave=False)


def main(argv: list[str] | None = None) -> None:
    """Command line: build (or load) a cached warm-start checkpoint and print its info."""
    p = argparse.ArgumentParser(prog="python -m otbrl.tasks.warmstart", description=main.__doc__)
    p.add_argument("task", choices=sorted(TASKS))
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-reward", type=float, default=0.3)
    p.add_argument("--max-seconds", type=float, default=600.0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-size", type=int, default=256)
    p.add_argument("--split", default="all", choices=SPLIT_CHOICES, help="train: the training side only")
    p.add_argument("--cache-dir", default=None, help="default: $OTBRL_CACHE or ~/.cache/otbrl")
    a = vars(p.parse_args(argv))
    _, _, info = warm_start(a.pop("task"), a.pop("preset"), **a)
    print(json.dumps({k: v for k, v in info.items() if k != "history"}, indent=1))


if __name__ == "__main__":
    main()
