"""A whole OTB update in plain PyTorch: sample a group -> energy -> advantages -> loss -> optimizer step.
A small GRU learns from scratch to repeat a letter n times ("k3:" -> "kkk"), scored with partial credit.
torch and otbrl's core only; under a minute on one thread: `python examples/minimal_loop.py --steps 300`.
"""

import argparse
import random
import string

import torch
from torch import Tensor, nn

import otbrl

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
# otbrl's character vocabulary (same ids and size as otbrl.tasks', so the same seed gives the same run)
TOKENS = [PAD, BOS, EOS, "<unk>", *string.digits, *string.ascii_lowercase, *"+=;,.:()?*- "]
VOCAB, CHARS = {t: i for i, t in enumerate(TOKENS)}, dict(enumerate(TOKENS))


def make_repeat(rng: random.Random) -> tuple[str, str]:
    letter, n = rng.choice(string.ascii_lowercase), rng.randint(1, 8)
    return f"{letter}{n}:", letter * n


def partial_credit(completion: str, answer: str) -> float:
    """The fraction of the answer's characters matched in place; extra characters count against."""
    text = completion.strip()
    return sum(a == b for a, b in zip(text, answer, strict=False)) / max(len(answer), len(text))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """--steps: optimizer steps; --group-size: completions per prompt (N); --prompts: prompts per step."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = {"steps": 300, "group-size": 8, "prompts": 16, "lr": 2e-3, "temperature": 1.0, "seed": 0}
    for flag, default in defaults.items():
        p.add_argument(f"--{flag}", type=type(default), default=default)
    usable = sorted(name for name, spec in otbrl.ESTIMATORS.items() if not spec.needs_model)
    p.add_argument("--estimator", default="otb", choices=usable, help="advantage estimator")
    return p.parse_args(argv)


class Policy(nn.Module):
    """Character-level GRU language model: (B, L) token ids -> (B, L, V) next-token logits (+ state)."""

    def __init__(self, vocab: int = len(VOCAB), hidden: int = 128) -> None:
        super().__init__()
        self.embed, self.rnn = nn.Embedding(vocab, hidden), nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor]:
        out, state = self.rnn(self.embed(ids), state)
        return self.head(out), state


def encode(prompts: list[str]) -> Tensor:
    """(B, P) ids: <bos> + characters, padded on the left so every prompt ends where sampling starts."""
    rows = [[VOCAB[BOS], *(VOCAB[c] for c in text)] for text in prompts]
    return torch.tensor([[VOCAB[PAD]] * (max(map(len, rows)) - len(row)) + row for row in rows])


def decode(tokens: Tensor) -> list[str]:
    return ["".join(map(CHARS.get, row)).split(EOS)[0] for row in tokens.tolist()]


@torch.no_grad()
def sample(policy: Policy, prompt_ids: Tensor, steps: int, temperature: float, gen: torch.Generator) -> tuple:
    """Tokens (B, T); mask (B, T), True up to and including <eos> (what the policy chose); and the logits
    (B, T, V) each token was sampled from."""
    logits, state = policy(prompt_ids)
    alive, taken = torch.ones(len(prompt_ids), dtype=torch.bool), []
    for _ in range(steps):
        z = logits[:, -1]
        y = torch.multinomial(torch.softmax(z / temperature, -1), 1, generator=gen).squeeze(-1)
        taken.append((y, alive.clone(), z))
        alive &= y != VOCAB[EOS]
        logits, state = policy(y[:, None], state)
    return tuple(torch.stack(column, 1) for column in zip(*taken, strict=True))


def token_logprobs(policy: Policy, prompt_ids: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    """(B, T) log pi(y_t) with gradient, from one teacher-forced pass: column P - 1 + t predicts token t."""
    logits, _ = policy(torch.cat([prompt_ids, tokens[:, :-1]], dim=1))
    logits = logits[:, prompt_ids.shape[1] - 1 :] / temperature
    return torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)


def train(args: argparse.Namespace, log=print) -> tuple[Policy, list[dict]]:
    torch.manual_seed(args.seed)
    rng, gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    policy = Policy()
    optimizer, history = torch.optim.Adam(policy.parameters(), lr=args.lr), []
    for step in range(1, args.steps + 1):
        # 1. Sample a group: N completions per prompt; the rows of one prompt share a group id.
        pairs = [make_repeat(rng) for _ in range(args.prompts)]
        prompts, answers = zip(*(pair for pair in pairs for _ in range(args.group_size)), strict=True)
        prompt_ids, group_ids = encode(prompts), torch.arange(args.prompts).repeat_interleave(args.group_size)
        tokens, mask, logits = sample(policy, prompt_ids, 9, args.temperature, gen)
        rewards = torch.tensor(list(map(partial_credit, decode(tokens), answers)))
        # 2. Energy w_t = ||e_y - softmax(z_t / T)||^2 from the logits that sampled each token.
        energy = otbrl.token_energy(logits, tokens, args.temperature)
        # 3. Advantages A_t = G_t - B_t; OTB's B_t = sum_i G_t W_t / sum_i W_t over the group, W_t = cumsum w.
        advantages = otbrl.compute_advantages(
            args.estimator, rewards=rewards, mask=mask, group_ids=group_ids, energy=energy
        ).advantages
        # 4. Loss -A_t log pi(y_t) over policy tokens (one step per batch: on-policy, so no clipping).
        logprobs = token_logprobs(policy, prompt_ids, tokens, args.temperature)
        loss = otbrl.policy_gradient_loss(logprobs, advantages, mask)
        # 5. Optimizer step.
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append({"step": step, "reward": rewards.mean().item(), "loss": loss.item()})
        if step == 1 or step % 20 == 0 or step == args.steps:
            log("step {step:4d}  reward {reward:.3f}  loss {loss:+.4f}".format(**history[-1]))
    return policy, history


if __name__ == "__main__":
    train(parse_args())
