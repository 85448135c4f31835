"""Mistral Large 4 against the published reference implementation (transformers 5.24, eager, FP32).

The fixtures in tests/fixtures/large4/ were written once by tests/make_large4_fixture.py: a
`save_pretrained` checkpoint of the parity config (Mistral-native names, per-expert weights, a tiny
vision tower and an mtp_dspark tensor) and what the reference computed on it. Everything here goes
through `convert.load_hf` and the model's own forward; transformers is needed only by the live test.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import convert
import large4

FIXTURES = Path(__file__).parent / "fixtures" / "large4"
LOGITS_TOL, LOSS_TOL, GRAD_REL_TOL = 1e-4, 1e-5, 1e-4


@pytest.fixture(scope="module")
def expected() -> dict:
    return load_file(FIXTURES / "expected.safetensors")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return convert.load_hf(FIXTURES)


def test_the_fixture_is_the_published_layout_of_the_parity_config(model):
    config = model.config
    assert type(model).__name__ == "MistralLarge4" and config.num_hidden_layers == 8
    assert config.kv_source_layers == [0, 1, 1, 3, 4, 4, 6, 3] and config.no_rope_layers[3] == 0
    assert config.indexer_types == [
        "full",
        "full",
        "shared",
        "full",
        "shared",
        "full",
        "shared",
        "full",
    ]
    assert "vision_config" in config.composite
    extras = set(model.published_extras.meta)
    assert {"mtp_dspark.norm.weight", "vision_language_adapter.w_in.weight"} <= extras


@pytest.mark.parametrize("prefix", ["", "short."])
def test_logits_and_loss_match_the_reference(model, expected, prefix):
    ids, targets = expected[prefix + "input_ids"], expected[prefix + "targets"]
    with torch.no_grad():
        logits, loss = model(ids), model(ids, targets)
    assert logits.dtype == torch.float32 and logits.shape == expected[prefix + "logits"].shape
    assert (logits - expected[prefix + "logits"]).abs().max().item() <= LOGITS_TOL
    assert abs(loss.item() - expected[prefix + "loss"].item()) <= LOSS_TOL


def test_every_gradient_matches_the_reference(model, expected):
    model.zero_grad(set_to_none=True)
    model(expected["input_ids"], expected["targets"]).backward()
    layout = convert.published_table(model.config)
    params, compared = dict(model.named_parameters()), set()
    for native_key, parts in layout.items():
        param = params[native_key]
        if ".indexer." in native_key:  # frozen in both implementations: no gradient, not trained
            assert not param.requires_grad and param.grad is None, native_key
            continue
        for part in parts:  # the fixture names gradients as the published checkpoint names weights
            got, want = convert.published_view(param.grad, part), expected["grad." + part.key]
            error = (got - want).abs().max() / want.abs().max()
            assert error.item() <= GRAD_REL_TOL, (
                f"{native_key} ({part.key}): relative error {error.item():.2e}"
            )
            compared.add(part.key)
    assert compared == {k.removeprefix("grad.") for k in expected if k.startswith("grad.")}
    model.zero_grad(set_to_none=True)


def test_the_indexers_select_the_reference_keys(model, expected):
    """Per query, the selected keys it may see; slots the reference fills with future keys and ours
    marks -1 (fewer than index_topk visible keys) select nothing."""
    selected = {}
    hooks = [
        layer.self_attn.indexer.register_forward_hook(
            lambda module, args, out, i=int(name): selected.__setitem__(i, out)
        )
        for name, layer in model.layers.items()
        if hasattr(layer.self_attn, "indexer")
    ]
    try:
        with torch.no_grad():
            model(expected["input_ids"])
    finally:
        for hook in hooks:
            hook.remove()
    reference = {int(k.split(".")[1]): v for k, v in expected.items() if k.startswith("indices.")}
    assert sorted(selected) == sorted(reference) == [0, 1, 3, 5, 7]
    batch, length, _ = reference[0].shape
    for layer, ours in selected.items():
        for b in range(batch):
            for t in range(length):
                want = {int(s) for s in reference[layer][b, t] if s <= t}
                got = {int(s) for s in ours[b, t] if 0 <= s <= t}
                assert got == want, (
                    f"layer {layer}, row {b}, query {t}: {sorted(got)} != {sorted(want)}"
                )


def test_the_index_scores_match_the_reference(model, expected, monkeypatch):
    """The scores top-k chooses from, where the query may see the key (elsewhere both mask them)."""
    scores = []

    class Capture(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.topk:
                scores.append(args[0].detach().clone())  # [B, chunk, S]
            return func(*args, **(kwargs or {}))

    def capturing(*args):
        with Capture():
            return top_keys(*args)

    top_keys = large4.top_keys
    monkeypatch.setattr(large4, "top_keys", capturing)
    with torch.no_grad():
        model(expected["input_ids"])
    # the full-indexer layers, in order
    reference = [expected[f"index_scores.{i}"] for i in (0, 1, 3, 5, 7)]
    assert len(scores) == len(reference)  # one chunk per layer at T = 40
    for ours, want in zip(scores, reference):
        visible = want > torch.finfo(torch.float32).min / 2
        assert torch.equal(ours > float("-inf"), visible)
        error = (ours[visible] - want[visible]).abs().max() / want[visible].abs().max()
        assert error.item() <= 1e-5


def test_live_reference_reads_what_save_hf_writes(model, expected, tmp_path):
    """With transformers installed: the published loader reads save_hf's output with nothing missing
    and computes our logits."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "MistralLarge4ForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no Mistral Large 4 (5.24 has)")
    convert.save_hf(model, tmp_path / "hf")
    reference, info = transformers.MistralLarge4ForConditionalGeneration.from_pretrained(
        tmp_path / "hf",
        attn_implementation="eager",
        experts_implementation="eager",
        output_loading_info=True,
    )
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(k.startswith("mtp_dspark.") for k in info["unexpected_keys"]), info
    with torch.no_grad():
        got, want = reference(input_ids=expected["input_ids"]).logits, model(expected["input_ids"])
    assert (got - want).abs().max().item() <= LOGITS_TOL
