"""Tiny randomly initialised Qwen2 causal LMs for the synthetic tasks: small enough to train and sample on
a CPU in seconds, and the same architecture TRL and verl expect from a real model.
"""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from otbrl.tasks.tokenizer import MODEL_MAX_LENGTH, VOCAB, VOCAB_SIZE

# name -> (hidden size, layers, attention heads); the MLP is 4x the hidden size.
PRESETS: dict[str, tuple[int, int, int]] = {
    "tiny": (64, 2, 4),  # ~0.14 M parameters
    "small": (128, 2, 4),  # ~0.53 M
    "medium": (128, 4, 4),  # ~1.06 M
}


def tiny_config(preset: str = "small", vocab_size: int = VOCAB_SIZE) -> Qwen2Config:
    """The `Qwen2Config` of a preset (see `PRESETS`), with tied embeddings and the char tokenizer's ids."""
    if preset not in PRESETS:
        raise ValueError(f"preset: unknown {preset!r}; known: {sorted(PRESETS)}")
    hidden, layers, heads = PRESETS[preset]
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=MODEL_MAX_LENGTH,
        tie_word_embeddings=True,
        pad_token_id=VOCAB["<pad>"],
        bos_token_id=VOCAB["<bos>"],
        eos_token_id=VOCAB["<eos>"],
        attn_implementation="sdpa",
    )


def tiny_model(preset: str = "small", vocab_size: int = VOCAB_SIZE, seed: int = 0) -> Qwen2ForCausalLM:
    """A freshly initialised float32 `Qwen2ForCausalLM` (eval mode), deterministic given `seed`."""
    config = tiny_config(preset, vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.eval()
