"""Write tests/fixtures/flint_aux/: the reference implementation's loss with the load-balancing
term.

    python3 tests/make_flint_aux_fixture.py [--venv DIR]

Not run by the test suite, which must not need transformers: run once, by hand, and commit the small
output. It builds a tiny random FlintForCausalLM in transformers (the published reference
implementation), with output_router_logits true and a large router_aux_loss_coef so the balancing
term shows in every gradient, and saves
    model/                 config.json and model.safetensors (Hugging Face layout)
    inputs.safetensors     input_ids, labels, attention_mask (the second row right-padded)
    <case>.safetensors     for case "masked" (with attention_mask) and "unmasked" (without):
                           loss (cross-entropy + coef * aux), aux_loss, ce_loss, and grad.<name> of
                           every parameter under its Hugging Face name
tests/test_flint_model.py loads the model with convert.load_hf and compares.

Without transformers in this Python, the script creates a virtual environment (default
.venv-flint-hf) with torch, transformers 5.24.0 and safetensors, and runs itself there.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_venv import rerun_with_transformers

OUT = Path(__file__).resolve().parent / "fixtures" / "flint_aux"
# Small but complete: full and sliding layers, one dense and three MoE layers (aggregated over
# layers by the reference), padding in the vocabulary (96 rows).
CONFIG = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    sliding_window=5,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    num_experts=8,
    num_experts_per_tok=2,
    mlp_only_layers=[0],
    output_router_logits=True,
    router_aux_loss_coef=0.25,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--venv", default=".venv-flint-hf", help="virtual environment to create if needed"
    )
    rerun_with_transformers(__file__, Path(parser.parse_args().venv))

    import torch
    from safetensors.torch import save_file
    from transformers import FlintConfig, FlintForCausalLM

    torch.manual_seed(0)
    model = FlintForCausalLM(FlintConfig(**CONFIG, attn_implementation="eager")).float()
    # visible weights: routers that prefer some experts, norms and sinks not at 1 and 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("router.weight") or name.endswith("sinks"):
                param.normal_(0.0, 0.5)
            else:
                param.normal_(0.0, 0.1)
    model.save_pretrained(OUT / "model", safe_serialization=True)

    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 90, (2, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 9:] = 0  # the second row ends in three padding tokens
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    save_file(
        {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask},
        OUT / "inputs.safetensors",
    )

    for case, mask in (("masked", attention_mask), ("unmasked", None)):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        ce = out.loss.detach() - model.config.router_aux_loss_coef * out.aux_loss.detach()
        tensors = {"loss": out.loss.detach(), "aux_loss": out.aux_loss.detach(), "ce_loss": ce}
        tensors.update(
            {f"grad.{name}": p.grad.contiguous() for name, p in model.named_parameters()}
        )
        save_file(tensors, OUT / f"{case}.safetensors")
        print(
            f"{case}: loss {out.loss.item():.6f} = ce {ce.item():.6f} + "
            f"{CONFIG['router_aux_loss_coef']} x aux "
            f"{out.aux_loss.item():.6f}"
        )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
