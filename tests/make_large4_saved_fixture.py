"""Generate tests/fixtures/large4_saved/: a flint export of a tiny Mistral Large 4 as transformers
loads it and writes it back, for tests/test_convert_large4.py.

    python3 tests/make_large4_saved_fixture.py  # re-runs itself under a venv that has transformers

Not part of the test suite, which needs neither this script nor transformers. Steps, all on the CPU
in FP32:
1. flint builds the large4-tiny model (seed 0) and exports it (convert.save_hf): config.json with no
   vision part of its own, so the export writes large4_config.PLACEHOLDER_VISION.
2. transformers 5.24 loads it with MistralLarge4ForConditionalGeneration (the class that reads this
   config.json; AutoModelForCausalLM refuses it), which must count under 100,000 vision parameters
   (the default tower would be 1.65B) and miss no text weight.
3. Its save_pretrained writes the directory this fixture is: Mistral's names for the text model,
   transformers' own (`model.vision_tower.*`, `model.multi_modal_projector.*`) for the tower it
   initialised.
4. expected.safetensors: `input_ids` [2, 12] and transformers' `logits` [2, 12, V] for them.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from hf_venv import rerun_with_transformers

VENV = Path(os.environ.get("FLINT_HF_VENV", Path.home() / ".cache" / "flint" / "hfvenv"))
OUT = Path(__file__).resolve().parent / "fixtures" / "large4_saved"
ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    rerun_with_transformers(__file__, VENV)
    sys.path.insert(0, str(ROOT))
    import torch
    from safetensors.torch import save_file
    from transformers import MistralLarge4ForConditionalGeneration

    import convert
    from large4 import Large4Config, MistralLarge4
    from layers import build

    config = Large4Config.from_name("large4-tiny")
    ours = build(MistralLarge4, config, seed=0)
    with tempfile.TemporaryDirectory() as scratch:
        convert.save_hf(ours, Path(scratch) / "export")
        theirs, info = MistralLarge4ForConditionalGeneration.from_pretrained(
            Path(scratch) / "export", dtype=torch.float32, output_loading_info=True
        )
        text_missing = [
            k
            for k in info["missing_keys"]
            if "vision_tower" not in k and "multi_modal_projector" not in k
        ]
        vision = sum(
            p.numel()
            for n, p in theirs.named_parameters()
            if "vision_tower" in n or "projector" in n
        )
        assert not text_missing and not info["unexpected_keys"], info
        assert vision < 100_000, (
            f"{vision} vision parameters: the placeholder vision config was not used"
        )
        shutil.rmtree(OUT, ignore_errors=True)
        theirs.save_pretrained(OUT)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = theirs(input_ids=ids).logits.float()
        assert torch.allclose(logits, ours(ids), rtol=1e-4, atol=1e-4), (
            "transformers and flint disagree"
        )
    save_file({"input_ids": ids, "logits": logits.contiguous()}, OUT / "expected.safetensors")
    keys = (
        json.loads((OUT / "model.safetensors.index.json").read_text())["weight_map"]
        if (OUT / "model.safetensors.index.json").exists()
        else None
    )
    print(f"wrote {OUT}: {vision} vision parameters, {len(keys) if keys else 'one file of'} keys")


if __name__ == "__main__":
    main()
