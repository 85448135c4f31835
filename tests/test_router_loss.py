"""The load-balancing loss against fixtures from the published reference implementation.

tests/make_flint_aux_fixture.py wrote tests/fixtures/flint_aux/ once with transformers'
FlintForCausalLM (output_router_logits true, router_aux_loss_coef 0.25): a tiny random model, a
batch with a right-padded row, and the reference's losses and gradients with and without its
attention_mask. Here the same weights, loaded with convert.load_hf, must give the same numbers.
"""

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import convert
from moe import load_balancing_loss

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "flint_aux"


@pytest.fixture(scope="module")
def batch():
    inputs = load_file(FIXTURE / "inputs.safetensors")
    targets = torch.full_like(inputs["labels"], -100)  # the reference shifts its labels inside the loss
    targets[:, :-1] = inputs["labels"][:, 1:]
    doc_ids = torch.where(inputs["attention_mask"] == 1, 0, -1)  # padding: doc id -1
    return inputs["input_ids"], targets, doc_ids


@pytest.mark.parametrize("case", ["masked", "unmasked"])
def test_loss_and_gradients_equal_the_reference(case, batch):
    model = convert.load_hf(FIXTURE / "model", dtype=torch.float32)
    assert model.config.output_router_logits and model.config.router_aux_loss_coef == 0.25
    expected = load_file(FIXTURE / f"{case}.safetensors")
    input_ids, targets, doc_ids = batch
    loss = model(input_ids, targets, doc_ids=doc_ids if case == "masked" else None)
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected["loss"], rtol=1e-6, atol=1e-6)
    reference_grads = convert.hf_to_native({k[5:]: v for k, v in expected.items() if k.startswith("grad.")},
                                           model.config)
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert grads.keys() == reference_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_without_output_router_logits_the_loss_is_the_cross_entropy(batch):
    """The released default: the coefficient is carried but unused, as in the reference."""
    expected = load_file(FIXTURE / "masked.safetensors")
    model = convert.load_hf(FIXTURE / "model", dtype=torch.float32)
    input_ids, targets, doc_ids = batch
    with_term = model(input_ids, targets, doc_ids=doc_ids).detach()
    model.config = dataclasses.replace(model.config, output_router_logits=False)
    without = model(input_ids, targets, doc_ids=doc_ids).detach()
    torch.testing.assert_close(without, expected["ce_loss"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close((with_term - without) / 0.25, expected["aux_loss"], rtol=1e-5, atol=1e-6)


def test_balancing_term_by_hand():
    """Two layers, four tokens, E = 4, k = 1, the last token padding: f and P counted by hand."""
    big = 30.0  # softmax of a one-hot logit row of this size is one-hot to FP32 precision
    first = torch.tensor([[big, 0, 0, 0], [big, 0, 0, 0], [0, big, 0, 0], [0, 0, 0, big]])
    second = torch.tensor([[0, 0, big, 0], [0, 0, big, 0], [0, 0, big, 0], [big, 0, 0, 0]])
    mask = torch.tensor([True, True, True, False])
    # real assignments over both layers: expert 0 twice, 1 once, 2 three times, of 6 -> f = P
    share = torch.tensor([2, 1, 3, 0]) / 6
    expected = 4 * (share * share).sum()
    torch.testing.assert_close(load_balancing_loss([first, second], 1, mask), expected)
    balanced = torch.eye(4) * big  # every expert once: f = P = 1/4 -> E * 4 / 16 = 1 = k
    torch.testing.assert_close(load_balancing_loss([balanced], 1), torch.tensor(1.0))
