"""A whole OTB update in plain PyTorch: sample a group -> energy -> advantages -> loss -> optimizer step.

A small GRU over otbrl's character vocabulary learns, from scratch, to repeat a letter n times
("k3:" -> "kkk"), scored with partial credit (the fraction of characters right, position by position).
torch and otbrl only; well under a minute on one CPU thread:

    python examples/minimal_loop.py --steps 300 --group-size 8 --estimator otb --seed 0
"""

from __future__ import annotations

import argparse
import random
import string
import time
from collections.abc import Callable

import torch
from torch import nn

import otbrl
from otbrl.tasks.builtin import Task, exact_match, get_task, running_sum_dense
from otbrl.tasks.tokenizer import BOS, EOS, PAD, VOCAB, VOCAB_SIZE

CHARS = {i: c for c, i in VOCAB.items()}
partial_credit = running_sum_dense  # any task: fraction of the answer's characters matched in place


def make_repeat(rng: random.Random) -> tuple[str, str]:
    letter, n = rng.choice(string.ascii_lowercase), rng.randint(1, 8)
    return f"{letter}{n}:", letter * n


# In otbrl's Task form. The built-in tasks (--task add_reversed, reverse, ...) want a supervised warm start:
# from scratch, RL alone leaves them near chance for minutes (measured).
REPEAT = Task("repeat", "'k3:' -> 'kkk'", max_completion_tokens=9, make=make_repeat, reward=exact_match)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    usable = sorted(name for name, spec in otbrl.ESTIMATORS.items() if not spec.needs_model)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--group-size", type=int, default=8, help="completions sampled per prompt (N)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--estimator", default="otb", choices=usable, help="advantage estimator")
    p.add_argument("--aggregation", default="token-mean", choices=["token-mean", "sequence-mean", "constant"])
    p.add_argument("--task", default="repeat", help="'repeat' or a name in otbrl.tasks.TASKS")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class Policy(nn.Module):
    """Character-level GRU language model: (B, L) token ids -> (B, L, V) next-token logits (+ state)."""

    def __init__(self, vocab: int = VOCAB_SIZE, hidden: int = 128):
        super().__init__()
        self.embed, self.rnn = nn.Embedding(vocab, hidden), nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(
        self, ids: torch.Tensor, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, state = self.rnn(self.embed(ids), state)
        return self.head(out), state


def encode(prompts: list[str]) -> torch.Tensor:
    """(B, P) ids: <bos> + characters, padded on the left so every prompt ends where sampling starts."""
    rows = [[VOCAB[BOS], *(VOCAB[c] for c in text)] for text in prompts]
    width = max(map(len, rows))
    return torch.tensor([[VOCAB[PAD]] * (width - len(row)) + row for row in rows])


def decode(tokens: torch.Tensor) -> list[str]:
    return ["".join(map(CHARS.get, row)).split(EOS)[0] for row in tokens.tolist()]


@torch.no_grad()
def sample(
    policy: Policy, prompt_ids: torch.Tensor, max_tokens: int, temperature: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns tokens (B, T); mask (B, T), True up to and including <eos> (what the policy chose); and the
    logits (B, T, V) each token was sampled from."""
    logits, state = policy(prompt_ids)
    alive = torch.ones(len(prompt_ids), dtype=torch.bool)
    tokens, mask, seen = [], [], []
    for _ in range(max_tokens):
        z = logits[:, -1]
        y = torch.multinomial(torch.softmax(z / temperature, -1), 1, generator=gen).squeeze(-1)
        tokens.append(y)
        mask.append(alive.clone())
        seen.append(z)
        alive &= y != VOCAB[EOS]
        logits, state = policy(y[:, None], state)
    return torch.stack(tokens, 1), torch.stack(mask, 1), torch.stack(seen, 1)


def token_logprobs(
    policy: Policy, prompt_ids: torch.Tensor, tokens: torch.Tensor, temperature: float
) -> torch.Tensor:
    """(B, T) log pi(y_t) under the current policy, with gradient: one teacher-forced pass over prompt +
    completion, where the logits at column P - 1 + t predict completion token t."""
    logits, _ = policy(torch.cat([prompt_ids, tokens[:, :-1]], dim=1))
    logits = logits[:, prompt_ids.shape[1] - 1 :] / temperature
    return torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)


def train(
    args: argparse.Namespace, log: Callable[[str], object] = print
) -> tuple[Policy, list[dict[str, float]]]:
    torch.manual_seed(args.seed)
    rng, gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    task = REPEAT if args.task == "repeat" else get_task(args.task)
    policy = Policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    history, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        # 1. Sample a group: N completions per prompt; the rows of one prompt share a group id.
        pairs = [task.make(rng) for _ in range(args.prompts)]
        prompts = [p for p, _ in pairs for _ in range(args.group_size)]
        answers = [a for _, a in pairs for _ in range(args.group_size)]
        group_ids = torch.arange(args.prompts).repeat_interleave(args.group_size)
        prompt_ids = encode(prompts)
        tokens, mask, logits = sample(policy, prompt_ids, task.max_completion_tokens, args.temperature, gen)
        completions = decode(tokens)
        rewards = torch.tensor(list(map(partial_credit, completions, answers)))

        # 2. Energy w_t = ||e_y - softmax(z_t / T)||^2 from the logits that sampled each token.
        energy = otbrl.token_energy(logits, tokens, args.temperature)

        # 3. Advantages A_t = G_t - B_t; OTB's B_t = sum_i G_t W_t / sum_i W_t over the group, W_t = cumsum w.
        advantages = otbrl.compute_advantages(
            args.estimator, rewards=rewards, mask=mask, group_ids=group_ids, energy=energy
        ).advantages

        # 4. Loss -A_t log pi(y_t) over policy tokens (one step per batch: on-policy, so no clipping).
        logprobs = token_logprobs(policy, prompt_ids, tokens, args.temperature)
        loss = otbrl.policy_gradient_loss(logprobs, advantages, mask, aggregation=args.aggregation)

        # 5. Optimizer step.
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        row = {
            "step": step,
            "reward": rewards.mean().item(),
            "solved": sum(map(task.reward, completions, answers)) / len(answers),
            "loss": loss.item(),
            "length": mask.sum(1).float().mean().item(),
            "seconds": time.perf_counter() - start,
        }
        history.append(row)
        if step == 1 or step % 20 == 0 or step == args.steps:
            log("step {step:4d}  reward {reward:.3f}  solved {solved:.3f}  loss {loss:+.4f}  "
                "length {length:4.1f}  {seconds:5.1f}s".format(**row))  # fmt: skip
    return policy, history


if __name__ == "__main__":
    train(parse_args())
