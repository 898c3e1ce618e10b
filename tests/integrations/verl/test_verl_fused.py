"""Σπ² with verl's fused kernels on: otbrl's head leaves verl's log-probs and entropy untouched and adds
Σπ² of the same tokens; verl's real FSDP engine post-processing then returns it laid out like the entropy,
where unpatched verl refuses. The model forward and FSDP wrapping themselves need GPUs and are not run."""

from __future__ import annotations

import inspect

import pytest
import torch
from tensordict import TensorDict
from verl.models.transformers import dense_common
from verl.models.transformers.dense_common import CausalLMOutputForPPO
from verl.utils import tensordict_utils as tu
from verl.utils.experimental import torch_functional as verl_fused_module
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from otbrl.integrations.verl import fused as verl_fused

VERL_HEAD = verl_fused._VerlFusedLinear


@pytest.fixture
def installed(monkeypatch):
    # Record the originals so monkeypatch restores them after install() replaces them.
    monkeypatch.setattr(verl_fused_module, "FusedLinearForPPO", verl_fused_module.FusedLinearForPPO)
    for name in ("forward_step", "prepare_model_outputs"):
        monkeypatch.setattr(FSDPEngineWithLMHead, name, FSDPEngineWithLMHead.__dict__[name])
    originals = {n: FSDPEngineWithLMHead.__dict__[n] for n in ("forward_step", "prepare_model_outputs")}
    verl_fused.install()
    verl_fused.install()  # idempotent: wraps once
    yield originals
    verl_fused._state.armed, verl_fused._state.stash = False, None


def head_inputs(tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, tokens, 16, generator=gen)
    weight = torch.randn(97, 16, generator=gen) * 0.5
    ids = torch.randint(0, 97, (1, tokens), generator=gen)
    return hidden, weight, ids


def test_verls_fused_forward_looks_the_head_up_at_call_time():
    source = inspect.getsource(dense_common.forward_with_torch_backend)
    assert "from verl.utils.experimental.torch_functional import FusedLinearForPPO" in source


def test_fused_head_keeps_verls_outputs_and_adds_sum_pi_squared(installed):
    assert verl_fused_module.FusedLinearForPPO is verl_fused.FusedLinearWithSumPiSquared
    hidden, weight, ids = head_inputs(11)
    expected = VERL_HEAD().forward(hidden, weight, ids, temperature=0.7)
    head = verl_fused.FusedLinearWithSumPiSquared()
    unarmed = head.forward(hidden, weight, ids, temperature=0.7)
    assert getattr(verl_fused._state, "stash", None) is None
    verl_fused._state.armed = True
    armed = head.forward(hidden, weight, ids, temperature=0.7)
    for mine, theirs in zip((*unarmed, *armed), (*expected, *expected), strict=True):
        torch.testing.assert_close(mine, theirs)
    reference = ((hidden.double() @ weight.double().T) / 0.7).softmax(-1).square().sum(-1)
    torch.testing.assert_close(verl_fused._state.stash.double(), reference, rtol=1e-5, atol=1e-7)


def engine_call(engine_prepare, lengths: list[int], pad: int, sum_pi_sq: bool, entropy: bool):
    total = sum(lengths)
    hidden, weight, ids = head_inputs(total + pad, seed=3)
    micro_batch = TensorDict(
        {"input_ids": torch.nested.nested_tensor(list(ids[0, :total].split(lengths)), layout=torch.jagged)},
        batch_size=[len(lengths)],
    )
    tu.assign_non_tensor(
        micro_batch,
        use_remove_padding=True,
        use_fused_kernels=True,
        calculate_entropy=entropy,
        calculate_sum_pi_squared=sum_pi_sq,
    )
    verl_fused._state.armed = sum_pi_sq
    log_probs, ent = verl_fused_module.FusedLinearForPPO().forward(hidden, weight, ids, temperature=1.0)
    output = CausalLMOutputForPPO(log_probs=log_probs, entropy=ent)
    args = {"pad_size": pad, "input_ids_rmpad_rolled": ids[0], "temperature_rmpad": torch.ones(total + pad)}
    engine = object.__new__(FSDPEngineWithLMHead)
    engine.use_ulysses_sp = False
    result = engine_prepare(engine, output, args, micro_batch, None)
    reference = (hidden[0, :total].double() @ weight.double().T).softmax(-1).square().sum(-1)
    return result, micro_batch, reference


def test_engine_returns_sum_pi_squared_like_the_entropy(installed):
    lengths = [5, 3, 7]
    with pytest.raises(NotImplementedError):  # what verl does on its own
        engine_call(installed["prepare_model_outputs"], lengths, 2, sum_pi_sq=True, entropy=True)
    result, micro_batch, reference = engine_call(
        FSDPEngineWithLMHead.prepare_model_outputs, lengths, 2, sum_pi_sq=True, entropy=True
    )
    plain, _, _ = engine_call(installed["prepare_model_outputs"], lengths, 2, sum_pi_sq=False, entropy=True)
    got = result["sum_pi_squared"]
    assert got.is_nested and [len(t) for t in got.unbind()] == lengths
    torch.testing.assert_close(torch.cat(got.unbind()).double(), reference, rtol=1e-5, atol=1e-7)
    for key in ("log_probs", "entropy"):  # verl's own outputs are what they would have been
        torch.testing.assert_close(torch.cat(result[key].unbind()), torch.cat(plain[key].unbind()))
    # The request's flags are as the caller set them.
    assert tu.get_non_tensor_data(data=micro_batch, key="calculate_sum_pi_squared", default=None) is True
    assert tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=None) is True


def test_engine_without_entropy_request_returns_no_entropy(installed):
    result, micro_batch, _ = engine_call(
        FSDPEngineWithLMHead.prepare_model_outputs, [4, 6], 0, sum_pi_sq=True, entropy=False
    )
    assert "sum_pi_squared" in result and "entropy" not in result
    assert tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=None) is False


def test_no_stash_means_a_clear_error(installed):
    verl_fused._state.stash = None
    batch = TensorDict({}, batch_size=[0])
    tu.assign_non_tensor(batch, use_fused_kernels=True, calculate_sum_pi_squared=True)
    with pytest.raises(RuntimeError, match="use_fused_kernels=False"):
        FSDPEngineWithLMHead.prepare_model_outputs(object(), None, {}, batch, None)


def test_forward_step_arms_only_for_fused_sum_pi_squared_requests():
    seen = []

    def step(engine, micro_batch, loss_function, forward_only):
        seen.append(getattr(verl_fused._state, "armed", False))
        return "done"

    wrapped = verl_fused._wrap_forward_step(step)
    for fused, wants in ((True, True), (True, False), (False, True)):
        batch = TensorDict({}, batch_size=[0])
        tu.assign_non_tensor(batch, use_fused_kernels=fused, calculate_sum_pi_squared=wants)
        assert wrapped(None, batch, None, True) == "done"
        assert getattr(verl_fused._state, "armed", False) is False
    assert seen == [True, False, False]
