"""models.py: the registry that names each family, and how a config.json finds its family."""

import pytest

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
