"""Generation for RL: a KV-cache sampler that returns the log-probs of the sampled tokens
(`sampler`), multi-turn rollouts with tool calls between turns (`multiturn`) and held-out evaluation
(`evaluate`). Needs transformers (the `trl` extra).
"""

from otbrl.rollout.evaluate import evaluate
from otbrl.rollout.multiturn import ToolRollouts, resolve_tools, sample_texts, sample_with_tools
from otbrl.rollout.sampler import Samples, decode, sample

__all__ = [
    "Samples",
    "ToolRollouts",
    "decode",
    "evaluate",
    "resolve_tools",
    "sample",
    "sample_texts",
    "sample_with_tools",
]
