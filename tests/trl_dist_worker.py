"""Shared pieces of tests/integrations/test_trl.py, and its two-process worker.

As a worker (run from the repository root):

    torchrun --standalone --nproc_per_node 2 -m tests.trl_dist_worker OUT_DIR
    torchrun --standalone --nproc_per_node 2 -m tests.trl_dist_worker --fsdp OUT_DIR

The second form shards tiny models with FSDP2 (`fully_shard`, gloo on the CPU: DTensor weights, the root's
hooks needed for embeddings and head) and saves, per family, otbrl.lm's energy next to the energy from
the unsharded model's own logits (`fsdp_<family>_rank<r>.pt`).

each rank trains two short OTB runs whose prompt groups span both ranks and saves, per scoring step,
what it saw (local mask, local energy, the gathered per-function rewards, its local advantages) to
OUT_DIR/<run>_step<k>_rank<r>.pt. The test rebuilds the global batch from those files and checks the
advantages against one single-process `otbrl.compute_advantages` call.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset

from otbrl.integrations.trl import OTBGRPOConfig, OTBGRPOTrainer
from otbrl.tasks import char_tokenizer, dataset, get_task, tiny_model
from otbrl.tasks.tokenizer import VOCAB

TASK = get_task("add_reversed")
GROUP = 4  # num_generations


def eos_biased_model(eos_bias: float = 2.5, seed: int = 0) -> torch.nn.Module:
    """The tiny preset with an untied output head whose bias favours <eos>: completions stop at varied
    lengths (a random model almost never emits <eos>), so masks have padding and widths differ per rank.
    The bias also exercises the head-bias path of the trainer's energy."""
    model = tiny_model("tiny", seed=seed)
    emb = model.get_input_embeddings().weight
    head = torch.nn.Linear(emb.shape[1], emb.shape[0], bias=True)
    with torch.no_grad():
        head.weight.copy_(emb)
        head.bias.zero_()
        head.bias[VOCAB["<eos>"]] = eos_bias
    model.lm_head = head
    model.config.tie_word_embeddings = False
    return model


def answer_reward(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float]:
    """Exact match plus a small dense term (the fraction of digits), so groups rarely tie."""
    return [
        TASK.reward(c, a) + 0.1 * sum(ch.isdigit() for ch in c) / max(len(c), 1)
        for c, a in zip(completions, answer, strict=True)
    ]


def length_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    return [-len(c) / 16 for c in completions]


_single_calls = 0


def unreachable_on_rank1(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """A verifier that works on rank 0 and, on rank 1, fails on a batch and then on every third sample
    scored alone (say, a flaky service one node reaches badly): failures on one rank only, never a whole
    batch nor half of the samples (either would stop the run)."""
    global _single_calls
    if os.environ.get("RANK") == "1":
        if len(prompts) > 1:
            raise ConnectionError("verifier unreachable")
        _single_calls += 1
        if _single_calls % 3 == 0:
            raise ConnectionError("verifier unreachable")
    return [0.0 for _ in completions]


def make_config(out_dir: str | Path, **overrides: Any) -> OTBGRPOConfig:
    """A small, deterministic CPU configuration; TRL defaults bf16 and gradient checkpointing to on."""
    base: dict[str, Any] = dict(
        output_dir=str(out_dir),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        max_steps=2,
        learning_rate=1e-3,
        per_device_train_batch_size=8,
        num_generations=GROUP,
        max_completion_length=8,
        beta=0.0,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    base.update(overrides)
    return OTBGRPOConfig(**base)


def make_trainer(
    args: OTBGRPOConfig,
    reward_funcs: Any = answer_reward,
    model: torch.nn.Module | None = None,
    cls: type[OTBGRPOTrainer] = OTBGRPOTrainer,
    n_prompts: int = 64,
    **kwargs: Any,
) -> OTBGRPOTrainer:
    return cls(
        model=model if model is not None else eos_biased_model(),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=Dataset.from_list(dataset(TASK, n_prompts)),
        processing_class=char_tokenizer(),
        **kwargs,
    )


class RecordingTrainer(OTBGRPOTrainer):
    """Saves, after every scoring step, what this rank fed to and got from the advantage computation."""

    def __init__(self, *args: Any, record_to: Path, run: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._record_to, self._run, self._scored = Path(record_to), run, 0
        self._energy: torch.Tensor | None = None

    def token_energy(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._energy = super().token_energy(*args, **kwargs)
        return self._energy

    def _generate_and_score_completions(self, inputs):  # noqa: ANN001, ANN202
        self._energy = None
        out = super()._generate_and_score_completions(inputs)
        rank = self.accelerator.process_index
        record = {
            "prompts": [x["prompt"] for x in inputs],
            "prompt_ids": out["prompt_ids"].cpu(),
            "mask": out["completion_mask"].cpu(),
            "energy": self._energy.cpu(),
            "rewards_per_func": self._scoring.rewards_per_func.cpu(),
            "reward_weights": self.reward_weights.cpu(),
            "advantages": out["advantages"].cpu(),
            "last_is_out": self.last_advantages is out["advantages"],
            "failures": sum(f.failures for f in self._guarded),
            "num_processes": self.accelerator.num_processes,
            "estimator": self.args.advantage_estimator,
            "options": dict(self.args.estimator_options),
        }
        torch.save(record, self._record_to / f"{self._run}_step{self._scored}_rank{rank}.pt")
        self._scored += 1
        return out


# run -> config overrides; per device 2 (one group over both ranks) and 6 (3 groups, the middle one split)
RUNS = {
    "otb": dict(per_device_train_batch_size=2),
    "otb_loo": dict(per_device_train_batch_size=6, estimator_options='{"leave_one_out": true}'),
}


def main(out_dir: str) -> list[OTBGRPOTrainer]:
    import faulthandler

    faulthandler.dump_traceback_later(90, exit=True)  # a hang prints every thread's stack, then exits
    torch.set_num_threads(1)
    out = Path(out_dir)
    trainers = []
    for run, overrides in RUNS.items():
        args = make_config(out / run, advantage_estimator="otb", reward_weights=[1.0, 0.5, 1.0], **overrides)
        trainer = make_trainer(
            args,
            reward_funcs=[answer_reward, length_reward, unreachable_on_rank1],
            cls=RecordingTrainer,
            record_to=out,
            run=run,
        )
        trainer.train()
        trainers.append(trainer)
        logged = [h["otb/reward_failures"] for h in trainer.state.log_history if "otb/reward_failures" in h]
        torch.save(
            {"logged_failures": logged, "is_main": trainer.accelerator.is_main_process},
            out / f"{run}_log_rank{trainer.accelerator.process_index}.pt",
        )
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return trainers


def _legacy_energy(model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor) -> Any:
    """The trainer's energy pass before otbrl.lm (the decoder called directly, head.weight read as is):
    its energy, or the error it raises, on a freshly sharded model."""
    import otbrl

    try:
        with torch.no_grad():
            hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
            return otbrl.fused_token_stats(hidden[:, -6:-1], model.lm_head.weight, ids[:, -5:], 0.7).energy
    except Exception as err:  # noqa: BLE001 -- what it raises is the record
        return f"{type(err).__name__}: {err}"[:300]


def fsdp_main(out_dir: str) -> None:
    """Each rank: the same seeded model, its reference energy before sharding (float64, from the model's
    own logits), then FSDP2 over both ranks and otbrl.lm.completion_energy on this rank's rows, called
    before any other forward (so nothing of the root is unsharded yet)."""
    import faulthandler

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from otbrl.lm import check_head, completion_energy
    from tests.models import family_model
    from tests.references import model_reference

    faulthandler.dump_traceback_later(90, exit=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for family in ("qwen2", "gemma2"):  # the fused path (full_tensor of the head) and the tiled, capped one
        model = family_model(family)
        g = torch.Generator().manual_seed(100 + rank)  # each rank scores its own rows
        ids = torch.randint(3, model.config.vocab_size, (3, 12), generator=g)
        attention = torch.ones_like(ids)
        attention[0, :2] = 0
        reference = model_reference(model, ids, attention, 5, 0.7)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sharded = type(model.lm_head.weight).__name__
        legacy = _legacy_energy(model, ids, attention)
        energy = completion_energy(model, ids, attention, 5, 0.7)
        check_head(model)
        torch.save(
            {"energy": energy, "reference": reference, "head_weight_type": sharded, "legacy": legacy},
            Path(out_dir) / f"fsdp_{family}_rank{rank}.pt",
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "--fsdp":
        fsdp_main(sys.argv[2])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    trainers = main(sys.argv[1])
    # Every file is written. Free nothing and skip the interpreter's teardown: about one run in ten hung
    # while main()'s trainers were freed after destroy_process_group (gloo on the CPU).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
