"""tools/flint_baselines.py: what tools/bench.py measures Flint against computes Flint itself (the
same loss and every gradient over the same weights). The sweep's layer runs in tests/test_bench.py's
whole runs."""

import pytest
import torch

from flint_model import FlintConfig, build_model
from helpers import assert_close_to_scale
from tools.flint_baselines import plain_eager_loss, transformers_loss, transformers_reference


def test_plain_eager_baseline_computes_the_same_network():
    """The baseline must be the same architecture over the same weights, or comparing speed means
    nothing."""
    # large weights: differences would show
    config = FlintConfig.from_name("tiny", initializer_range=0.3)
    model = build_model(config, seed=0)
    ids = torch.randint(0, config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    ours = model(ids[:, :-1], ids[:, 1:])
    baseline = plain_eager_loss(model, ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(baseline, ours, rtol=1e-5, atol=1e-5)
    for p, g_ours, g_base in zip(
        model.parameters(),
        torch.autograd.grad(ours, list(model.parameters())),
        torch.autograd.grad(baseline, list(model.parameters())),
    ):
        assert_close_to_scale(g_base, g_ours, rtol=1e-4)


def test_transformers_reference_computes_the_same_network():
    """Only where transformers can be imported (it is not a dependency): its FlintForCausalLM,
    loaded from our export, gives our loss and gradients on our weights."""
    pytest.importorskip("transformers")
    config = FlintConfig.from_name("tiny", initializer_range=0.3)
    model = build_model(config, seed=0)
    reference = transformers_reference(model)
    ids = torch.randint(0, config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    ours = model(ids[:, :-1], ids[:, 1:])
    theirs = transformers_loss(reference, ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    # Every gradient, tensor by tensor: each published tensor's gradient is the view of ours that
    # the published layout maps it to (convert.py's table: renames, per-expert splits, transposes).
    from convert import published_table
    from hf_io import published_view

    names = dict(model.named_parameters())
    our_grads = dict(zip(names, torch.autograd.grad(ours, list(names.values()))))
    theirs_by_name = dict(reference.named_parameters())
    their_grads = dict(
        zip(theirs_by_name, torch.autograd.grad(theirs, list(theirs_by_name.values())))
    )
    compared = set()
    for native_key, parts in published_table(config, set(theirs_by_name)).items():
        for part in parts:
            expected = published_view(our_grads[native_key], part)
            assert_close_to_scale(their_grads[part.key], expected, rtol=1e-4, what=part.key)
            compared.add(part.key)
    assert compared == set(their_grads)
