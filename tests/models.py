"""Tiny random models of real families whose output heads differ (plain, soft-capped, scaled), with their
heads sharpened so that the head transform matters; one family otbrl does not know; whether this CPU runs
them under half-precision autocast. Shared by tests/core/test_lm.py, the TRL tests and their two-process
worker.
"""

from __future__ import annotations

import torch
import transformers

VOCAB = 52  # the character tokenizer's size, so the same models serve the TRL tests
SHARPEN = 20.0  # head weight multiplier: logits of tens, where capping and scaling change the softmax

COMMON = dict(
    vocab_size=VOCAB,
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
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"final_logit_softcapping": 5.0, "head_dim": 16}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 8.0}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 4.0}),
}


def family_model(name: str, seed: int = 0, sharpen: float = SHARPEN) -> torch.nn.Module:
    """A tiny random model of one family, its output head multiplied by `sharpen`, in eval mode."""
    config_cls, model_cls, extra = FAMILIES[name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **extra))
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model.eval()


class ScaledQwen2(transformers.Qwen2ForCausalLM):
    """A family otbrl does not know: it multiplies its logits by 3 in its forward, with no config field."""

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 3.0
        return out


def half_supported(dtype: torch.dtype) -> bool:
    """Whether this CPU runs a matmul under autocast to `dtype`."""
    try:
        with torch.autocast("cpu", dtype=dtype):
            return (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == dtype
    except (RuntimeError, ValueError):
        return False
