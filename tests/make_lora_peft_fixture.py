"""Check lora.py's exports against transformers and peft, and write what the suite compares with.

    # re-runs itself under a venv with transformers and peft
    python3 tests/make_lora_peft_fixture.py

Not part of the test suite, which needs neither transformers nor peft. For each model family (a tiny
Flint, the Large 4 parity shape), with every parameter random and LoRA on every target (B random
too):
- the adapter directory that convert.write_peft_adapter writes is loaded by peft
  (PeftModel.from_pretrained) onto transformers' model, itself loaded from the base's published
  export (convert.save_hf); its logits must equal the adapted native model's, and peft must report
  no missing or unexpected key;
- the merged export (convert.merge_lora, then the published export) is loaded by transformers
  (from_pretrained); its logits must equal them too.
Each check runs for every case of CASES: each family with LoRA on every target, and cases that set
each option adapter_config.json carries to another value (a rank, an alpha, a dropout peft takes on
Linear maps only, targets naming Linear maps only or the experts only, base_model_name_or_path).
Writes, in tests/fixtures/lora_peft/CASE/: adapter_config.json (of the directory peft loaded),
expected.safetensors (input_ids, peft's and the merged export's logits) and result.json (versions,
largest differences, pass or fail per check, the SHA-256 of the adapter_model.safetensors peft
loaded, and the options as peft read them back: its LoraConfig and the adapted modules' scalings).
The suite (tests/test_lora.py) rebuilds the same adapted models, writes their adapter directory
again and checks it is byte for byte the one peft loaded, and that the native logits still equal
peft's.

One finding is recorded beside the checks (peft_reloads_its_own_save): peft 0.21.2 saves a loaded
Large 4 adapter under transformers' module names, which transformers 5.24's checkpoint renaming
(`.experts.` -> `.mlp.experts.`, `.shared_experts.` -> `.mlp.shared_experts.`) then misses on
loading: the experts' and shared experts' adapters of such a save are silently left at their initial
values. lora.py writes the published names, which peft renames exactly as transformers renames the
published checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from hf_venv import rerun_with_transformers  # noqa: E402

VENV = Path(os.environ.get("FLINT_HF_VENV", Path.home() / ".cache" / "flint" / "hfvenv"))
OUT = HERE / "fixtures" / "lora_peft"
LORA = dict(rank=8, alpha=16.0, dropout=0.0, targets=["all"])
# case -> (family, [lora] settings, base_model_name_or_path)
CASES = {
    "flint": ("flint", LORA, None),
    "large4": ("large4", LORA, None),
    # Linear maps only: the dropout written as set (peft takes it on nn.Linear)
    "flint_linear": (
        "flint",
        dict(rank=4, alpha=3.0, dropout=0.1, targets=["q_proj", "down_proj"]),
        "flint-base",
    ),
    # the routed experts only: no target_modules, the dropout written as 0 (peft refuses it there)
    "large4_experts": ("large4", dict(rank=8, alpha=4.0, dropout=0.2, targets=["experts"]), None),
}
# Large 4's reference is the multimodal model: a tiny vision tower (unused by text) keeps it small.
VISION_CONFIG = dict(
    model_type="pixtral",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    head_dim=16,
    image_size=28,
    patch_size=14,
    hidden_act="silu",
)
# largest |difference| / largest |logit| counted as equal (FP32, different op orders)
TOLERANCE = 1e-4


# ========================================================== the adapted models (also for the suite)


def transformers_module_name(family: str, native: str) -> str:
    """The name transformers' model gives a native module (peft's target_modules are matched against
    it): Flint's modules sit under `model.`; Large 4's text model under `model.language_model.`,
    where the shared expert is `shared_experts`."""
    if family == "flint":
        return "model." + native
    return "model.language_model." + native.replace(".shared_expert.", ".shared_experts.")


def native_config(family: str):
    if family == "flint":
        from flint_model import FlintConfig

        return FlintConfig.from_name("tiny", num_hidden_layers=3)  # layers 0-1 dense, 2 MoE
    from large4 import Large4Config

    return Large4Config.from_name("large4-parity")


def adapted_model(family: str, settings: dict = LORA):
    """The family's tiny native model, every parameter random, with LoRA `settings` (by default on
    every target) and B random."""
    import torch

    from lora import LoraConfig, apply_lora
    from registry import model_class

    config = native_config(family)
    with torch.device("meta"):
        model = model_class(config)(config)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(random_value(name, param, generator))
    apply_lora(model, LoraConfig(**settings), seed=1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".B"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    return model.eval()


def random_value(name: str, param, generator):
    """Norms and scales near 1, alpha and sinks small, matrices ~ fan_in^-1/2 (experts [E, in,
    out])."""
    import torch

    noise = torch.randn(param.shape, generator=generator)
    if param.dim() == 1:
        return 0.1 * noise if name.endswith(("alpha", "sinks.weight", ".bias")) else 1 + 0.1 * noise
    fan_in = param.shape[-2] if param.dim() == 3 else param.shape[-1]
    return noise * fan_in**-0.5


def inputs(family: str):
    """Token ids [2, 8]: with 8 tokens, Large 4's attention is dense (index_topk 8), so no near tie
    decides."""
    import torch

    return torch.randint(
        0, native_config(family).vocab_size, (2, 8), generator=torch.Generator().manual_seed(5)
    )


def adapter_directory(
    family: str, model, out: Path, settings: dict = LORA, base_model: str | None = None
) -> None:
    """What the suite and the check both write: convert.write_peft_adapter over the published
    table."""
    from convert import published_table, write_peft_adapter
    from lora import LoraConfig, adapter_state

    write_peft_adapter(
        out,
        adapter_state(model.state_dict()),
        LoraConfig(**settings),
        published_table(model.config),
        lambda native: transformers_module_name(family, native),
        base_model,
    )


# =========================================================== the check, under transformers and peft


def transformers_model(family: str, directory: Path):
    if family == "flint":
        from transformers import FlintForCausalLM

        return FlintForCausalLM.from_pretrained(
            directory, attn_implementation="eager", experts_implementation="eager"
        )
    from transformers import MistralLarge4ForConditionalGeneration

    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "vision_config": VISION_CONFIG}))
    return MistralLarge4ForConditionalGeneration.from_pretrained(
        directory, attn_implementation="eager", experts_implementation="eager"
    )


def exported(family: str, state, config, directory: Path):
    """transformers' model from the published export of a native state dict, in FP32, evaluating."""
    from convert import export_published
    from hf_io import StateSource

    export_published(StateSource(state, "native"), config, directory)
    return transformers_model(family, directory).float().eval()


def check(case: str, work: Path) -> tuple[dict, dict]:
    import torch
    from peft import PeftModel

    from convert import merge_lora
    from lora import LoraConfig, adapter_state

    family, settings, base_model = CASES[case]
    model = adapted_model(family, settings)
    ids = inputs(family)
    with torch.no_grad():
        native = model(ids)
    base_state = {
        k: v for k, v in model.state_dict().items() if k not in adapter_state(model.state_dict())
    }
    adapter_dir = work / "adapter"
    adapter_directory(family, model, adapter_dir, settings, base_model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = PeftModel.from_pretrained(
            exported(family, base_state, model.config, work / "base"), adapter_dir
        )
    key_warnings = [str(w.message)[:400] for w in caught if "keys" in str(w.message).lower()]
    merged = exported(
        family,
        merge_lora(model.state_dict(), LoraConfig(**settings)),
        model.config,
        work / "merged",
    )
    with torch.no_grad():
        peft_logits = peft_model(input_ids=ids).logits.float()
        merged_logits = merged(input_ids=ids).logits.float()

    def difference(logits):
        return ((logits - native).abs().max() / native.abs().max()).item()

    with peft_model.disable_adapter(), torch.no_grad():
        base_logits = peft_model(input_ids=ids).logits.float()
    result = {
        "peft_difference": difference(peft_logits),
        "merged_difference": difference(merged_logits),
        "adapters_change_logits_by": difference(base_logits),
        "peft_key_warnings": key_warnings,
        "adapted_linear_maps": sum(
            1 for m in peft_model.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A")
        ),
        "adapted_expert_weights": sum(
            1 for m in peft_model.modules() if type(m).__name__ == "ParamWrapper"
        ),
        "peft_reloads_its_own_save": resave_difference(
            family, peft_model, base_state, model.config, ids, work
        )
        < TOLERANCE,
        "peft_read": peft_read(peft_model),
    }
    result["peft_loads"] = result["peft_difference"] < TOLERANCE and not key_warnings
    result["merged_loads"] = result["merged_difference"] < TOLERANCE
    with (adapter_dir / "adapter_model.safetensors").open("rb") as file:
        result["adapter_sha256"] = hashlib.sha256(file.read()).hexdigest()
    return result, {"input_ids": ids, "peft_logits": peft_logits, "merged_logits": merged_logits}


def peft_read(peft_model) -> dict:
    """The options of adapter_config.json as peft holds them after loading, and the scalings of the
    modules it adapted (lora_alpha / r, as peft computes it)."""
    config = peft_model.peft_config["default"]
    scalings = {
        module.scaling["default"]
        for module in peft_model.modules()
        if isinstance(getattr(module, "scaling", None), dict) and "default" in module.scaling
    }
    return {
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": config.lora_dropout,
        "target_modules": sorted(config.target_modules or []),
        "target_parameters": sorted(config.target_parameters or []),
        "base_model_name_or_path": config.base_model_name_or_path,
        "use_rslora": config.use_rslora,
        "scalings": sorted(scalings),
    }


def resave_difference(family: str, peft_model, base_state, config, ids, work: Path) -> float:
    """Not a check of lora.py, a finding: peft saves the loaded adapters under transformers' module
    names and loads them again onto a fresh base -> the largest change of the logits, relative."""
    import torch
    from peft import PeftModel

    peft_model.save_pretrained(work / "resaved")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = PeftModel.from_pretrained(
            exported(family, base_state, config, work / "base_again"), work / "resaved"
        )
    with torch.no_grad():
        first, second = peft_model(input_ids=ids).logits, again(input_ids=ids).logits
    return ((second - first).abs().max() / first.abs().max()).item()


def main() -> None:
    rerun_with_transformers(__file__, VENV, extra=("peft",))
    import shutil

    import peft
    import torch
    import transformers
    from safetensors.torch import save_file

    torch.set_num_threads(2)
    results = {}
    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            result, tensors = check(case, Path(tmp))
            out = OUT / case
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            shutil.copy(Path(tmp) / "adapter" / "adapter_config.json", out / "adapter_config.json")
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(out / "expected.safetensors")
        )
        result.update(
            transformers=transformers.__version__, peft=peft.__version__, torch=torch.__version__
        )
        (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        for path in out.iterdir():
            path.chmod(0o644)
        results[case] = result
    print(json.dumps(results, indent=2))
    failed = [
        f"{case} {what}"
        for case, r in results.items()
        for what in ("peft_loads", "merged_loads")
        if not r[what]
    ]
    sys.exit(f"FAILED: {', '.join(failed)}" if failed else 0)


if __name__ == "__main__":
    main()
