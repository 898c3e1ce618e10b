"""Σπ² in verl's FSDP actor when its fused kernels are on, where verl itself refuses.

verl's fused forward computes log-probs and entropy from the hidden states and the output head without
forming logits, so its engine cannot compute Σπ². Installed in every verl process (see
`otbrl.integrations.verl.use_chunked_sum_pi_squared`), this module (1) swaps verl's fused head for a
subclass that, while a Σπ² request is being served, also runs `otbrl.fused_token_stats` on the same
hidden states (one tile of logits at a time), and (2) routes that result through the engine's own
entropy post-processing (sequence-parallel gather, unpadding, nesting), so it comes out laid out
exactly like the entropy.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch
from verl.utils import tensordict_utils as tu
from verl.utils.experimental import torch_functional as verl_fused
from verl.workers.engine.fsdp import transformer_impl

from otbrl.fused import fused_token_stats

_VerlFusedLinear = verl_fused.FusedLinearForPPO
_state = threading.local()  # armed: a Σπ² request is being served; stash: what the forward produced


class FusedLinearWithSumPiSquared(_VerlFusedLinear):
    """verl's fused head, unchanged; while armed it also keeps Σπ² of the same tokens."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        vocab_weights: torch.Tensor,
        input_ids: torch.Tensor,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = super().forward(hidden_states, vocab_weights, input_ids, temperature)
        if getattr(_state, "armed", False):
            t = float(temperature)
            _state.stash = fused_token_stats(hidden_states, vocab_weights, input_ids.long(), t).sum_pi_sq
        return out


def _fused_request(micro_batch: Any) -> bool:
    def flag(key: str) -> bool:
        return bool(tu.get_non_tensor_data(data=micro_batch, key=key, default=False))

    return flag("calculate_sum_pi_squared") and flag("use_fused_kernels")


def _wrap_forward_step(original: Callable) -> Callable:
    def forward_step(self: Any, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
        if not _fused_request(micro_batch):
            return original(self, micro_batch, loss_function, forward_only)
        _state.armed, _state.stash = True, None
        try:
            return original(self, micro_batch, loss_function, forward_only)
        finally:
            _state.armed, _state.stash = False, None

    forward_step.otbrl_wrapped = original
    return forward_step


def _wrap_prepare_model_outputs(original: Callable) -> Callable:
    def prepare_model_outputs(
        self: Any, output: Any, output_args: dict, micro_batch: Any, logits_processor_func: Any
    ) -> dict:
        if not _fused_request(micro_batch):
            return original(self, output, output_args, micro_batch, logits_processor_func)
        stash = getattr(_state, "stash", None)
        if stash is None:
            raise RuntimeError(
                "sum_pi_squared: the fused forward produced no Σπ² (this model's fused forward does not "
                "use verl's FusedLinearForPPO); set actor_rollout_ref.model.use_fused_kernels=False"
            )
        wants_entropy = tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)
        # verl refuses Σπ² with fused kernels: serve the rest of the request without it...
        tu.assign_non_tensor(micro_batch, calculate_sum_pi_squared=False)
        try:
            result = original(self, output, output_args, micro_batch, logits_processor_func)
            # ...then pass Σπ² through the entropy slot: same layout, same gather and unpadding.
            twin = copy.copy(output)
            twin.entropy = stash
            tu.assign_non_tensor(micro_batch, calculate_entropy=True)
            result["sum_pi_squared"] = original(self, twin, output_args, micro_batch, logits_processor_func)[
                "entropy"
            ]
        finally:
            tu.assign_non_tensor(micro_batch, calculate_sum_pi_squared=True, calculate_entropy=wants_entropy)
        return result

    prepare_model_outputs.otbrl_wrapped = original
    return prepare_model_outputs


def install() -> None:
    """Patch verl's fused head and FSDP LM engine in this process (idempotent)."""
    verl_fused.FusedLinearForPPO = FusedLinearWithSumPiSquared
    engine = transformer_impl.FSDPEngineWithLMHead
    for name, wrap in (
        ("forward_step", _wrap_forward_step),
        ("prepare_model_outputs", _wrap_prepare_model_outputs),
    ):
        method = engine.__dict__[name]
        if not hasattr(method, "otbrl_wrapped"):
            setattr(engine, name, wrap(method))
