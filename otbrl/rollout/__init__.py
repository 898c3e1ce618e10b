"""Generation for RL: a KV-cache sampler that returns the log-probs of the sampled tokens
(`sampler`), multi-turn rollouts with tool calls between turns (`multiturn`) and held-out evaluation
(`evaluate`). Needs transformers (the `trl` extra).
"""

from otbrl.rollout.evaluate import evaluate
from otbrl.rollout.multiturn import ToolRollouts, resolve_tools, sample_texts, sample_with_tools
from otbrl.rollout.sampler import (
    RowCache,
    Samples,
    SamplingSettings,
    decode,
    eos_token_ids,
    float32_head,
    sample,
)

__all__ = [
    "RowCache",
    "Samples",
    "SamplingSettings",
    "ToolRollouts",
    "decode",
    "eos_token_ids",
    "evaluate",
    "float32_head",
    "resolve_tools",
    "sample",
    "sample_texts",
    "sample_with_tools",
]
