"""layers.py: the shared parameter count, a model's units by name (FP32, frozen, inside) and the
token-id checks. The head and its loss: tests/test_head.py."""

import pytest
import torch

from helpers import FAMILY_NAMES, build, moe_layers, tiny_config
from layers import count_params, fp32_units, frozen_modules, inside
from registry import model_class

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_active_parameters_leave_out_the_unchosen_experts(family):
    """Flint's tiny: 2 MoE layers of 8 experts, top 2: 6 experts x 3 matrices of hidden x
    moe_intermediate idle (Large 4's: 7 MoE layers of 8 experts, top 3)."""
    config = tiny_config(family)
    model = build(config, plain=True)
    idle = (
        len(moe_layers(config))
        * (config.num_experts - config.num_experts_per_tok)
        * 3
        * config.hidden_size
        * config.moe_intermediate_size
    )
    assert count_params(model) == sum(p.numel() for p in model.parameters())
    assert count_params(model, active=True) == count_params(model) - idle


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_token_ids_are_checked_unless_data_checked_them_at_load(family):
    from layers import token_ids_checked_at_load

    model = build(tiny_config(family), plain=True)
    # 300 is outside the vocabulary (Flint's tiny: 256, Large 4's: 160)
    ids = torch.tensor([[1, 2, 300]])
    with pytest.raises(ValueError, match="input_ids holds token id 300, outside the vocabulary"):
        model(ids)
    with token_ids_checked_at_load():
        with pytest.raises(IndexError):  # no check: the embedding's own error
            model(ids)
    with pytest.raises(ValueError, match="input_ids holds token id 300"):
        model(ids)


def test_inside_means_the_module_or_below_it_by_whole_name_parts():
    owners = {"layers.1.mlp.router", "lm_head"}
    assert inside("layers.1.mlp.router", owners) and inside("layers.1.mlp.router.gate", owners)
    assert inside("lm_head", owners)
    assert not inside("layers.1.mlp", owners)  # above an owner, not inside it
    assert not inside("layers.1.mlp.router_bias", owners)  # a longer name part, not a child
    assert not inside("layers.11.mlp.router", owners)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_fp32_units_hold_exactly_the_parameters_kept_in_fp32_under_a_bf16_bulk(family):
    """Built in BF16 (on the meta device), a parameter is FP32 exactly when it lies inside one of
    the model's declared FP32 units (sinks, routers, the head; Large 4's indexer parts too)."""
    config = tiny_config(family)
    with torch.device("meta"):
        model = model_class(config)(config, torch.bfloat16)
    units = fp32_units(model)
    assert "lm_head" in units and any(name.endswith(".mlp.router") for name in units)
    fp32 = {name for name, p in model.named_parameters() if p.dtype == torch.float32}
    assert fp32 and fp32 == {
        name for name, _ in model.named_parameters() if inside(name.rsplit(".", 1)[0], units)
    }


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_frozen_modules_are_those_with_every_parameter_frozen(family):
    config = tiny_config(family)
    with torch.device("meta"):
        model = model_class(config)(config, torch.float32)
    for param in model.parameters():
        param.requires_grad_(True)
    assert frozen_modules(model) == set()
    model.lm_head.requires_grad_(False)
    # its block and attention: partly frozen
    model.layers["0"].self_attn.q_proj.weight.requires_grad_(False)
    assert frozen_modules(model) == {"lm_head", "layers.0.self_attn.q_proj"}
