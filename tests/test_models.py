"""models.py: the registry that names each family, and how a config.json finds its family."""

import pytest
import torch

from large4 import Large4Config, MistralLarge4
from model import Flint, FlintConfig
from models import FAMILIES, MODEL_TYPES, config_from_hf, family_of, family_of_hf_config, model_class


@pytest.mark.parametrize("name, config", [("flint", FlintConfig.from_name("tiny")),
                                          ("large4", Large4Config.from_name("large4-tiny"))])
def test_each_family_is_found_from_its_config_and_its_config_json(name, config):
    family = FAMILIES[name]
    assert family_of(config) is family and model_class(config) is family.model
    hf = config.to_hf_config()
    assert hf["model_type"] == family.model_type and MODEL_TYPES[family.model_type] == name
    assert family_of_hf_config(hf) == name and config_from_hf(hf).to_hf_config() == hf


def test_the_registry_is_complete():
    assert {family.model for family in FAMILIES.values()} == {Flint, MistralLarge4}
    assert all(family.layout.fp32_suffixes and family.timed_modules for family in FAMILIES.values())


def test_an_unknown_model_type_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'}: model_type 'llama' is not one of"):
        family_of_hf_config(tmp_path)


TINY = {"flint": FlintConfig.from_name("tiny"), "large4": Large4Config.from_name("large4-tiny")}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_familys_layout_and_timed_modules_fit_its_model(name):
    """What the registry says of a family holds for the model it names: its key table covers every
    native tensor, each FP32 suffix names some of them, and each timed module kind is in the model."""
    family, config = FAMILIES[name], TINY[name]
    with torch.device("meta"):
        model = family.model(config)
    native = model.state_dict()
    assert set(family.layout.table(config, native, set())) == set(native)
    assert set(family.layout.published_fp32_suffixes) <= set(family.layout.fp32_suffixes)
    for suffix in family.layout.fp32_suffixes:
        assert any(key.endswith(suffix) for key in native), f"{name}: FP32 suffix {suffix!r} names no tensor"
    kinds = {type(module) for module in model.modules()}
    assert all(kind in kinds for kind, _ in family.timed_modules), name
    baselines = ("plain_eager_loss", "transformers_reference", "transformers_loss", "attention_layer_step")
    assert family.baselines is None or all(callable(getattr(family.baselines, b)) for b in baselines)
