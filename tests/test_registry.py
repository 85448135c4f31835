"""registry.py: the one list of families, how a config and a config.json find their family, and the
declared interface (ModelConfig, Model) that every registered family's config and model satisfy."""

import inspect
import subprocess
import sys
import tomllib
import typing

import pytest
import torch

import registry
from helpers import ROOT, debug_configs, tiny_preset
from registry import (
    FAMILIES,
    Model,
    ModelConfig,
    config_from_hf,
    family,
    family_of,
    family_of_hf_config,
    model_class,
)


def tiny(name: str):
    return family(name).config.from_name(tiny_preset(name))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_is_found_from_its_config_and_its_config_json(name):
    config = tiny(name)
    assert family_of(config) is family(name) and model_class(config) is family(name).model
    hf = config.to_hf_config()
    assert hf["model_type"] == family(name).model_type
    assert family_of_hf_config(hf) == name and config_from_hf(hf).to_hf_config() == hf


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_has_a_debug_config_that_trains_its_smallest_preset(name):
    """What the tests train of each family (tests/helpers.py finds a family's configs/*debug.toml by
    the family it names); tools.bench --quick times the same preset."""
    model = tomllib.loads(debug_configs()[name].read_text())["model"]
    assert model["preset"] == family(name).smallest_preset


def test_an_unknown_model_type_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(
        ValueError,
        match=rf"{tmp_path / 'config.json'}: model_type 'llama' is not "
        r"one of",
    ):
        family_of_hf_config(tmp_path)


def test_an_unknown_family_is_refused_naming_the_registered_ones():
    with pytest.raises(
        ValueError,
        match=r"unknown model family 'llama'; choose one of "
        rf"{', '.join(FAMILIES)}$",
    ):
        family("llama")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_familys_layout_and_timed_modules_fit_its_model(name):
    """What the registry says of a family holds for the model it names: its key table covers every
    native tensor, each FP32 suffix names some of them, and each timed module kind is in the
    model."""
    fam, config = family(name), tiny(name)
    with torch.device("meta"):
        model = fam.model(config)
    native = model.state_dict()
    assert set(fam.layout.table(config, native, set())) == set(native)
    assert set(fam.layout.published_fp32_suffixes) <= set(fam.layout.fp32_suffixes)
    for suffix in fam.layout.fp32_suffixes:
        assert any(key.endswith(suffix) for key in native), (
            f"{name}: FP32 suffix {suffix!r} names no tensor"
        )
    kinds = {type(module) for module in model.modules()}
    assert fam.timed_modules and all(kind in kinds for kind, _ in fam.timed_modules), name


def declared(protocol: type) -> dict[str, object]:
    """The members a protocol declares: attribute annotations and methods, by name."""
    members = {
        name: None
        for name in typing.get_type_hints(
            protocol,
            globalns=vars(registry),
            localns={
                "nn": torch.nn,
                "torch": torch,
                "Layout": object,
                "RouterLosses": object,
                "StageContext": object,
            },
        )
    }
    members.update(
        {
            name: value
            for name, value in vars(protocol).items()
            if not name.startswith("_")
            and (inspect.isfunction(value) or isinstance(value, classmethod))
        }
    )
    return members


def check_against(obj: object, protocol: type) -> list[str]:
    """What `obj` lacks of `protocol`, or declares with other parameters: [] when it conforms."""
    problems = []
    for name, member in declared(protocol).items():
        if not hasattr(obj, name):
            problems.append(f"no {name}")
            continue
        if member is None:
            continue
        wanted = inspect.signature(member.__func__ if isinstance(member, classmethod) else member)
        got = inspect.signature(getattr(obj, name))
        wanted_names = [p for p in wanted.parameters if p not in ("self", "cls")]
        got_names = [p for p in got.parameters if p not in ("self", "cls")]
        if got_names[: len(wanted_names)] != wanted_names or any(
            got.parameters[p].default is inspect.Parameter.empty
            for p in got_names[len(wanted_names) :]
        ):
            problems.append(f"{name}{got} is not {name}{wanted}")
    return problems


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_satisfies_the_declared_interface(name):
    """Each config and model has every member of ModelConfig and Model, methods with the declared
    parameters (extra ones only with defaults): what parallel.py, train.py and convert.py read."""
    config = tiny(name)
    with torch.device("meta"):
        model = family(name).model(config)
    assert isinstance(config, ModelConfig) and isinstance(model, Model)
    assert check_against(config, ModelConfig) == [], name
    assert check_against(model, Model) == [], name


def test_the_interface_check_finds_a_missing_or_changed_member():
    """The check above fails on a model that lacks a member or changes a method's parameters."""

    class Partial:
        config = None

        def num_params(self, everything: bool = False) -> int:
            return 0

    problems = check_against(Partial(), Model)
    assert "no layers" in problems and any(p.startswith("num_params(everything") for p in problems)


def test_importing_the_registry_loads_no_model():
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, registry; print(' '.join(sys.modules))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert not {"flint_model", "large4", "large4_config"} & set(loaded)
