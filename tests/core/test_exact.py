"""otbrl.exact: exact per-token squared score norms against a per-token backward loop written here,
the proxy's exactness for the output layer, and the otb_exact estimator."""

from __future__ import annotations

import pytest
import torch

import otbrl
from otbrl.exact import score_sq_norms


class TinyLM(torch.nn.Module):
    """Causal toy LM: embeddings, running mean over the prefix, MLP, bias-free output head."""

    def __init__(self, vocab: int = 11, hidden: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.embed(ids)
        prefix_mean = e.cumsum(1) / torch.arange(1, ids.shape[1] + 1)[None, :, None]
        return torch.tanh(self.mix(prefix_mean))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(ids))


def reference(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, temperature: float
) -> torch.Tensor:
    offset = ids.shape[1] - mask.shape[1]
    out = torch.zeros(mask.shape, dtype=torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    for b in range(ids.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                c = t + offset
                logits = model(ids[b : b + 1, :c])[0, -1] / temperature
                grads = torch.autograd.grad(torch.log_softmax(logits, -1)[ids[b, c]], params)
                out[b, t] = sum(g.double().square().sum() for g in grads)
    return out


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = TinyLM().double()
    ids = torch.randint(0, 11, (3, 9))
    mask = torch.tensor(
        [[0, 0, 0, 1, 1, 1, 0, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0, 0]]
    )
    return model, ids, mask


@pytest.mark.parametrize("method", ["vmap", "loop"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_score_norms_match_per_token_backward(setup, method, temperature):
    model, ids, mask = setup
    got = score_sq_norms(model, ids, mask, temperature=temperature, method=method)
    torch.testing.assert_close(got, reference(model, ids, mask, temperature))
    assert (got[mask == 0] == 0).all()


def test_mask_aligned_with_last_columns(setup):
    model, ids, mask = setup
    full = score_sq_norms(model, ids, mask)
    tail = score_sq_norms(model, ids, mask[:, 3:])
    torch.testing.assert_close(tail, full[:, 3:])


def test_proxy_is_exact_for_the_output_layer(setup):
    # Only the head trains: grad_W log pi_y = (e_y - pi) h^T, so ||.||^2 = w_t ||h_{t-1}||^2 / T^2.
    model, ids, mask = setup
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("head"))
    temperature = 1.3
    exact = score_sq_norms(model, ids, mask, temperature=temperature)
    with torch.no_grad():
        h = model.hidden(ids)
        logits = model.head(h)
    w = otbrl.token_energy(logits[:, :-1], ids[:, 1:], temperature=temperature)
    proxy = w * h[:, :-1].square().sum(-1) / temperature**2
    torch.testing.assert_close(exact[:, 1:] * mask[:, 1:], proxy * mask[:, 1:])


def test_otb_exact_equals_otb_on_exact_energy(setup):
    model, ids, mask = setup
    kw = dict(rewards=torch.tensor([1.0, 0.0, 1.0]), mask=mask, group_ids=[0, 0, 0])
    got = otbrl.compute_advantages("otb_exact", model=model, input_ids=ids, leave_one_out=True, **kw)
    ref = otbrl.compute_advantages("otb", energy=score_sq_norms(model, ids, mask), leave_one_out=True, **kw)
    torch.testing.assert_close(got.advantages, ref.advantages)
    assert got.advantages[0].abs().sum() > 0


def test_model_training_mode_is_restored(setup):
    model, ids, mask = setup
    model.train()
    score_sq_norms(model, ids, mask)
    assert model.training


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m, i, k: score_sq_norms(m, i, k, method="fast"), "method"),
        (lambda m, i, k: score_sq_norms(m, i, k, temperature=0), "temperature"),
        (lambda m, i, k: score_sq_norms(m, i, torch.ones(3, 12)), "mask: has more columns"),
        (lambda m, i, k: score_sq_norms(m, i, torch.ones(2, 9)), "mask: shape"),
        (lambda m, i, k: score_sq_norms(m, i, torch.ones(3, 9)), "first token"),
        (
            lambda m, i, k: otbrl.compute_advantages(
                "otb_exact", rewards=torch.ones(3), mask=k, group_ids=[0, 0, 0]
            ),
            "model: otb_exact needs",
        ),
    ],
)
def test_bad_input(setup, call, match):
    model, ids, mask = setup
    with pytest.raises(ValueError, match=match):
        call(model, ids, mask)


# ----------------------------------------------------------------------------------------------------
# Padded input (issue 15 item 9c): the model must not read padding as text.


def test_left_padding_is_cut_off_with_the_attention_mask(setup):
    model, ids, mask = setup
    pads = [2, 0, 3]
    # The same rows with padding in front: each row's scores must equal those of the unpadded row.
    padded_ids = torch.cat([torch.full((3, 3), 7), ids], dim=1)
    attention = torch.ones_like(padded_ids)
    for b, p in enumerate(pads):
        attention[b, : 3 - p] = 0
        attention[b, 3 - p : 3] = 1  # real tokens: the row's own prompt continues there
    real_ids = [padded_ids[b, 3 - p :] for b, p in enumerate(pads)]
    got = score_sq_norms(model, padded_ids, mask, attention_mask=attention)
    for b in range(3):
        expected = reference(model, real_ids[b][None], mask[b : b + 1], 1.0)
        torch.testing.assert_close(got[b : b + 1], expected)
    # Without the attention mask the padding is read as text: a different (wrong) answer.
    unmasked = score_sq_norms(model, padded_ids, mask)
    assert (unmasked[0] - got[0]).abs().max() > 1e-6


def test_otb_exact_takes_the_attention_mask(setup):
    model, ids, mask = setup
    padded_ids = torch.cat([torch.full((3, 2), 4), ids], dim=1)
    attention = torch.ones_like(padded_ids)
    attention[:, :2] = 0
    kw = dict(rewards=torch.tensor([1.0, 0.0, 1.0]), mask=mask, group_ids=[0, 0, 0])
    padded = dict(model=model, input_ids=padded_ids, attention_mask=attention)
    got = otbrl.compute_advantages("otb_exact", **padded, **kw)
    ref = otbrl.compute_advantages("otb_exact", model=model, input_ids=ids, **kw)
    torch.testing.assert_close(got.advantages, ref.advantages)


@pytest.mark.parametrize(
    ("attention", "match"),
    [
        ([[1, 1, 0, 1, 1, 1, 1, 1, 1]] * 3, "attention_mask: padding must sit at either end"),
        ([[0, 0, 0, 0, 1, 1, 1, 1, 1]] * 3, "mask: a policy token sits where attention_mask is 0"),
        ([[1] * 8] * 3, "attention_mask: shape"),
        ([[0, 0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9], "first token"),
    ],
)
def test_bad_attention_mask(setup, attention, match):
    model, ids, mask = setup
    with pytest.raises(ValueError, match=match):
        score_sq_norms(model, ids, mask, attention_mask=torch.tensor(attention))


def test_right_padding_after_the_response_changes_nothing(setup):
    model, ids, mask = setup
    padded_ids = torch.cat([ids, torch.full((3, 2), 3)], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(3, 2, dtype=mask.dtype)], dim=1)
    attention = torch.ones_like(padded_ids)
    attention[:, -2:] = 0
    got = score_sq_norms(model, padded_ids, padded_mask, attention_mask=attention)
    torch.testing.assert_close(got[:, :-2], score_sq_norms(model, ids, mask))
