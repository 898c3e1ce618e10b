"""How far the trainer's per-token energy is from the distribution each token was sampled from.

    .venv/bin/python benchmarks/energy_accuracy.py          # ~1 min, writes docs/results/energy_accuracy.md
    .venv/bin/python benchmarks/energy_accuracy.py --quick  # fewer rows, to a temp file

Reference: float64 ||e_y - softmax(z / T)||^2 from the model's own full-context logits, T = 0.7.
  Model families: tiny random models (hidden 32, one layer, vocabulary 52) with the output head multiplied
  by 20 so that soft-capping and logit scales matter; random prompts (one left-padded), then tokens sampled
  from the model. "plain head" is softmax(hidden @ W.T / T), the energy the TRL trainer computed before
  `otbrl.lm`; "otbrl.lm" is `completion_energy`, the trainer's forward now.
  Multi-turn: the shipped tir_product3 warm start sampling with the calculator; "tool output hidden"
  scores every token with the tool output masked out of attention (the trainer's pass before), "sampler"
  is the energy the sampler returns with each token, "otbrl.lm" the full-context forward.
Errors are the largest relative error over policy tokens, |w - w_ref| / max(w_ref, 1e-6).
"""

from __future__ import annotations

import torch
import transformers
from common import command_line, markdown_table, write_result

from otbrl.fused import fused_token_stats
from otbrl.lm import completion_energy, final_hidden, predicting
from otbrl.rollout import resolve_tools, sample_with_tools

T = 0.7
FAMILIES = {
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "Llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "Gemma-2 (softcap 5)": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"final_logit_softcapping": 5.0, "head_dim": 16},
    ),
    "Granite (logits_scaling 8)": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 8.0}),
    "Cohere (logit_scale 4)": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 4.0}),
}
COMMON = dict(
    vocab_size=52,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


@torch.no_grad()
def reference(model, ids: torch.Tensor, attention: torch.Tensor, n: int) -> torch.Tensor:  # noqa: ANN001
    """(B, n) float64 energy of the last n tokens from the model's own full-context logits."""
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    logits = predicting(model(input_ids=ids, attention_mask=attention, position_ids=positions).logits, n)
    p = torch.softmax(logits.double() / T, dim=-1)
    onehot = torch.nn.functional.one_hot(ids[:, -n:], p.shape[-1]).double()
    return ((onehot - p) ** 2).sum(-1)


def worst(energy: torch.Tensor, ref: torch.Tensor, keep: torch.Tensor) -> float:
    return ((energy.double() - ref).abs() / ref.clamp_min(1e-6))[keep].max().item()


@torch.no_grad()
def families(rows: int, n: int) -> list[list[str]]:
    out = []
    for name, (config_cls, model_cls, extra) in FAMILIES.items():
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **extra)).eval()
        model.lm_head.weight.mul_(20.0)
        g = torch.Generator().manual_seed(0)
        ids, attention = torch.randint(3, 52, (rows, 8), generator=g), torch.ones(rows, 8, dtype=torch.long)
        ids[0, :3], attention[0, :3] = 0, 0
        for _ in range(n):
            logits = model(
                input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0)
            ).logits[:, -1]
            nxt = torch.multinomial(torch.softmax(logits.double() / T, -1), 1, generator=g)
            ids, attention = torch.cat([ids, nxt], 1), torch.cat([attention, torch.ones_like(nxt)], 1)
        ref = reference(model, ids, attention, n)
        hidden, _ = final_hidden(model, ids, attention)
        plain = fused_token_stats(predicting(hidden, n), model.lm_head.weight, ids[:, -n:], T).energy
        ours = completion_energy(model, ids, attention, n, T)
        keep = torch.ones_like(ref, dtype=torch.bool)
        out.append([name, f"{worst(plain, ref, keep):.2g}", f"{worst(ours, ref, keep):.2g}"])
    return out


@torch.no_grad()
def multiturn(prompts: int) -> list[list[str]]:
    from otbrl.tasks import dataset, warm_start

    model, tokenizer, _ = warm_start("tir_product3", log=None)
    rows = dataset("tir_product3", prompts, seed=1)
    prompt_ids = tokenizer([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]
    g = torch.Generator().manual_seed(0)
    out = sample_with_tools(model, tokenizer, prompt_ids, resolve_tools(["calc"]), 40, 3, T, generator=g)
    width = max(map(len, out.completion_ids))
    left = max(map(len, out.prompt_ids))
    ids = torch.zeros(len(rows), left + width, dtype=torch.long)
    attention, policy, sampled = (torch.zeros(len(rows), x) for x in (left + width, width, width))
    parts = zip(out.prompt_ids, out.completion_ids, out.model_mask, out.energy, strict=True)
    for i, (p, c, m, e) in enumerate(parts):
        ids[i, left - len(p) : left + len(c)] = torch.tensor(p + c)
        attention[i, left - len(p) : left + len(c)] = 1
        policy[i, : len(c)], sampled[i, : len(c)] = torch.tensor(m, dtype=torch.float), torch.tensor(e)
    attention = attention.long()
    ref = reference(model, ids, attention, width)
    after_tool = (1 - policy).cumsum(-1).gt(0) & policy.bool()
    before_tool = policy.bool() & ~after_tool
    hidden_tools = attention.clone()
    hidden_tools[:, left:] *= policy.long()  # the old attention mask: completion mask x tool mask
    old = completion_energy(model, ids, hidden_tools, width, T)
    ours = completion_energy(model, ids, attention, width, T)
    table = []
    for label, keep in (("before the first tool output", before_tool), ("after a tool output", after_tool)):
        table.append(
            [
                f"tir_product3, tokens {label} ({int(keep.sum())})",
                f"{worst(old, ref, keep):.2g}",
                f"{worst(ours, ref, keep):.2g}",
                f"{worst(sampled, ref, keep):.2g}",
            ]
        )
    return table


def main() -> None:
    quick, out, threads = command_line(__doc__.splitlines()[0], "fewer rows", "energy_accuracy.md")
    fam = families(rows=4 if quick else 16, n=4 if quick else 8)
    turns = multiturn(prompts=8 if quick else 32)
    table = markdown_table(["model family", "plain head (before)", "otbrl.lm (after)"], fam) + "\n\n"
    header = ["multi-turn", "tool output hidden (before)", "otbrl.lm (after)", "sampler"]
    table += markdown_table(header, turns)
    print(table)
    title = "Energy accuracy: the trainer's energy against the sampled distribution"
    description = __doc__.split("\n\n", 2)[2].strip()
    write_result(out, title, "energy_accuracy.py", quick, threads, description, table, "")


if __name__ == "__main__":
    main()
