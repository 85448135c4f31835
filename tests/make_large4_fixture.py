"""Generate the Mistral Large 4 parity fixtures in tests/fixtures/large4/ with the published
reference.

    python3 tests/make_large4_fixture.py  # re-runs itself under a venv that has transformers

Not part of the test suite, which needs neither this script nor transformers: the committed fixtures
are what tests/test_large4_parity.py compares against. The reference is transformers 5.24's
`MistralLarge4ForConditionalGeneration` (eager attention, FP32) on the parity config (the
`large4-parity` preset of large4_config.py): every width distinct, KV sharing with two producers of
one slot, index sharing, T > index_topk.

Writes, in tests/fixtures/large4/:
- config.json, model.safetensors: `save_pretrained` output (the composite config, Mistral-native key
  names at the root, experts per expert, a tiny vision tower), plus two small `mtp_dspark.*` tensors
  that this script adds because transformers writes none (it ignores them on load), so conversions
  must carry them through.
- expected.safetensors: `input_ids` [2, 40] and `targets` [2, 40] (the next token, -100 where
  ignored), `logits` [2, 40, 160] (soft-capped, FP32), `loss` (mean over targets != -100),
  `hidden_states.{i}` (input of layer i; i = num_layers is the final-norm input), `indices.{i}` [2,
  40, 8] the top-k of each full-indexer layer i, sorted, `index_scores.{i}` [2, 40, 40] its scores
  (masked keys -inf), and `grad.{KEY}` the loss gradient of every text parameter that has one, under
  its ON-DISK name KEY (written by transformers' own save_pretrained, so per expert); the indexer is
  frozen in the reference (no gradient), so it has no entry. `short.*`: the same inputs, logits and
  loss for T = 7 <= index_topk, where DSA equals dense causal attention.

Parameters are random and non-trivial (LeRoPE alpha, SSMax, LayerNorm biases, norms, router), and
the seed is advanced until no top-k choice is a near tie (index scores or router probabilities
within TIE_GAP at the k-th place), since ties make the selection implementation-defined (LARGE4.md
1.8)."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path

from hf_venv import rerun_with_transformers

VENV = Path(os.environ.get("FLINT_HF_VENV", Path.home() / ".cache" / "flint" / "hfvenv"))
OUT = Path(__file__).resolve().parent / "fixtures" / "large4"
TIE_GAP = 1e-4  # smallest allowed gap between the k-th and (k+1)-th score of any top-k choice
SEEDS = range(1000)

TEXT_CONFIG = dict(  # LARGE4.md section 2, parity config
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=40,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=24,
    qk_nope_head_dim=12,
    qk_rope_head_dim=4,
    v_head_dim=20,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_shared_experts=1,
    first_k_dense_replace=1,
    index_topk=8,
    index_n_heads=3,
    index_head_dim=16,
    kv_source_layers=[0, 1, 1, 3, 4, 4, 6, 3],
    indexer_types=["full", "full", "shared", "full", "shared", "full", "shared", "full"],
)
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
BATCH, LENGTH, SHORT = 2, 40, 7


# ============================================================================= the reference model


def build_reference(seed: int):
    """The reference model with every parameter random; vision tower tiny and also random."""
    import torch
    from transformers import MistralLarge4Config, MistralLarge4ForConditionalGeneration

    config = MistralLarge4Config(text_config=dict(TEXT_CONFIG), vision_config=dict(VISION_CONFIG))
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    config.text_config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = MistralLarge4ForConditionalGeneration(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(random_value(name, param, generator))
    return model


def random_value(name: str, param, generator):
    """A random value that keeps the network well-conditioned: norms near 1, matrices ~
    fan_in^-1/2."""
    import torch

    def normal(std: float, mean: float = 0.0):
        return mean + std * torch.randn(param.shape, generator=generator, dtype=torch.float32)

    if name.endswith("rotary_emb.alpha"):
        return normal(0.3)
    if name.endswith("softmax_scaling.scale"):
        return normal(0.15)
    if name.endswith("softmax_scaling.bias"):
        return normal(0.2, 1.0)
    # The indexer's ReLU gives exact-zero scores (ties) whenever all index heads are negative, so
    # its queries and keys get a common positive offset on the channels RoPE leaves alone: q.k is
    # then mostly positive.
    if name.endswith("indexer.q_input_norm.bias"):
        return normal(0.1, 1.0)
    # q_input_norm's bias (~1 per channel) times this mean: +1 per channel
    if name.endswith("indexer.wq_b.weight"):
        return normal(1.0 / math.sqrt(param.shape[-1]), 1.0 / param.shape[-1])
    if name.endswith("indexer.k_norm.bias"):
        offset = torch.ones(param.shape)
        offset[: TEXT_CONFIG["qk_rope_head_dim"]] = 0
        return normal(0.1) + offset
    if name.endswith(".bias"):
        return normal(0.1)
    if param.ndim == 1:  # RMSNorm and LayerNorm weights
        return normal(0.15, 1.0)
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    # logits of a few units, so the soft-cap (30) bends them measurably
    if name == "lm_head.weight":
        return normal(2.5 / math.sqrt(param.shape[-1]))
    fan_in = param.shape[-1]
    return normal(1.0 / math.sqrt(fan_in))


def make_inputs(seed: int, length: int):
    import torch

    generator = torch.Generator().manual_seed(10_000 + seed)
    vocab = TEXT_CONFIG["vocab_size"]
    ids = torch.randint(0, vocab, (BATCH, length), generator=generator)
    targets = torch.cat([ids[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    targets[0, length // 3] = -100  # an ignored position inside the sequence
    return ids, targets


class TopkRecorder:
    """Records, per top-k call inside indexers and routers, the scores it chose from."""

    def __init__(self):
        import torch
        from transformers.models.mistral_large4 import modeling_mistral_large4 as reference

        self.index_scores, self.indices, self.router_gaps = {}, {}, []
        recorder = self

        class Capture(torch.overrides.TorchFunctionMode):
            def __init__(self):
                super().__init__()
                self.calls = []

            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func in (torch.Tensor.topk, torch.topk):
                    self.calls.append(
                        (args[0].detach().clone(), args[1] if len(args) > 1 else kwargs["k"])
                    )
                return func(*args, **(kwargs or {}))

        def indexer_forward(module, *args, **kwargs):
            with Capture() as capture:
                indices = original_indexer(module, *args, **kwargs)
            ((scores, _),) = capture.calls
            recorder.index_scores[module.layer_idx] = scores
            recorder.indices[module.layer_idx] = indices
            return indices

        def router_forward(module, hidden_states):
            with Capture() as capture:
                result = original_router(module, hidden_states)
            # the last call picks the experts; the first is the group limit
            scores, k = capture.calls[-1]
            top = scores.topk(k + 1, dim=-1).values
            recorder.router_gaps.append((top[:, k - 1] - top[:, k]).min().item())
            return result

        original_indexer = reference.MistralLarge4TextIndexer.forward
        original_router = reference.MistralLarge4TextTopkRouter.forward
        self.patches = [
            (reference.MistralLarge4TextIndexer, "forward", original_indexer, indexer_forward),
            (reference.MistralLarge4TextTopkRouter, "forward", original_router, router_forward),
        ]

    def __enter__(self):
        for owner, name, _, patched in self.patches:
            setattr(owner, name, patched)
        return self

    def __exit__(self, *exc):
        for owner, name, original, _ in self.patches:
            setattr(owner, name, original)

    def index_gap(self, k: int) -> float:
        """Smallest gap at the k-th place over the rows that see more than k keys (others take every
        key)."""
        import torch

        gaps = [math.inf]
        for scores in self.index_scores.values():  # [B, S, T], masked keys -inf
            # masks add -inf or dtype min
            visible = (scores > torch.finfo(scores.dtype).min / 2).sum(-1)
            top = scores.topk(k + 1, dim=-1).values
            rows = visible > k
            if rows.any():
                gaps.append((top[..., k - 1] - top[..., k])[rows].min().item())
        return min(gaps)


# ============================================================================= fixture files


def disk_gradients(model) -> dict:
    """Every text parameter's gradient under its on-disk name, as transformers' save_pretrained
    writes it."""
    import torch
    from safetensors.torch import load_file

    frozen = [n for n, p in model.named_parameters() if ".indexer." in n and p.grad is not None]
    if frozen:
        raise RuntimeError(
            f"the reference indexer is expected to be frozen, but {frozen[0]} has a gradient"
        )
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
        for name, param in model.named_parameters():
            param.copy_(param.grad if param.grad is not None else torch.full_like(param, math.nan))
        model.save_pretrained(tmp)
        for name, param in model.named_parameters():
            param.copy_(saved[name])
        grads = load_file(Path(tmp) / "model.safetensors")
    text = {
        k: g for k, g in grads.items() if not k.startswith(VISION_PREFIXES) and ".indexer." not in k
    }
    missing = [k for k, g in text.items() if g.isnan().any()]
    if missing:
        raise RuntimeError(f"text parameter {missing[0]} got no gradient from the loss")
    return text


VISION_PREFIXES = (
    "vision_encoder.",
    "patch_merger.",
    "pre_mm_projector_norm.",
    "vision_language_adapter.",
)


def add_mtp_tensors(path: Path) -> list[str]:
    """transformers writes no mtp_dspark head; add two small tensors so conversions must carry
    them."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    generator = torch.Generator().manual_seed(7)
    extra = {
        "mtp_dspark.layers.0.attention.wq.weight": torch.randn(48, 64, generator=generator),
        "mtp_dspark.norm.weight": torch.randn(64, generator=generator),
    }
    tensors.update(extra)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return list(extra)


def check_reload(directory: Path, model, ids) -> None:
    """The published loader must read the directory back (ignoring mtp_dspark) with identical
    logits."""
    import torch
    from transformers import MistralLarge4ForConditionalGeneration

    loaded, info = MistralLarge4ForConditionalGeneration.from_pretrained(
        directory,
        attn_implementation="eager",
        experts_implementation="eager",
        output_loading_info=True,
    )
    problems = {k: v for k, v in info.items() if v and k != "unexpected_keys"}
    if problems or any(not k.startswith("mtp_dspark.") for k in info["unexpected_keys"]):
        raise RuntimeError(f"save_pretrained output does not reload cleanly: {info}")
    with torch.no_grad():
        if not torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits):
            raise RuntimeError("reloaded model gives different logits")


def generate(seed: int) -> dict | None:
    """Fixture tensors for one seed, or None if a top-k choice is a near tie."""
    import torch

    model = build_reference(seed)
    k = TEXT_CONFIG["index_topk"]
    ids, targets = make_inputs(seed, LENGTH)
    with TopkRecorder() as recorder:
        out = model(input_ids=ids, labels=targets, shift_labels=targets, output_hidden_states=True)
    index_gap, router_gap = recorder.index_gap(k), min(recorder.router_gaps)
    if index_gap < TIE_GAP or router_gap < TIE_GAP:
        print(
            f"seed {seed}: near tie (index gap {index_gap:.2e}, router gap {router_gap:.2e}), "
            "next seed"
        )
        return None
    out.loss.backward()
    tensors = {
        "input_ids": ids,
        "targets": targets,
        "logits": out.logits.detach(),
        "loss": out.loss.detach(),
    }
    tensors.update({f"hidden_states.{i}": h.detach() for i, h in enumerate(out.hidden_states)})
    for layer, indices in recorder.indices.items():
        tensors[f"indices.{layer}"] = indices.sort(dim=-1).values
        tensors[f"index_scores.{layer}"] = recorder.index_scores[layer]
    tensors.update({f"grad.{key}": g for key, g in disk_gradients(model).items()})

    short_ids, short_targets = make_inputs(seed, SHORT)
    with torch.no_grad():
        short = model(input_ids=short_ids, labels=short_targets, shift_labels=short_targets)
    tensors.update(
        {
            "short.input_ids": short_ids,
            "short.targets": short_targets,
            "short.logits": short.logits,
            "short.loss": short.loss,
        }
    )
    model.zero_grad(set_to_none=True)
    tensors["_model"] = model
    tensors["_gaps"] = (index_gap, router_gap)
    return tensors


def main() -> None:
    rerun_with_transformers(__file__, VENV)
    import torch
    import transformers
    from safetensors.torch import save_file

    torch.set_num_threads(2)
    for seed in SEEDS:
        tensors = generate(seed)
        if tensors is not None:
            break
    else:
        sys.exit(f"no seed in {SEEDS} avoids near ties; lower TIE_GAP")
    model, (index_gap, router_gap) = tensors.pop("_model"), tensors.pop("_gaps")
    OUT.mkdir(parents=True, exist_ok=True)
    for stale in OUT.iterdir():
        stale.unlink()
    model.save_pretrained(OUT)
    (OUT / "generation_config.json").unlink()  # sampling defaults: nothing a conversion reads
    mtp = add_mtp_tensors(OUT / "model.safetensors")
    check_reload(OUT, model, tensors["input_ids"])
    metadata = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "seed": str(seed),
        "index_gap": f"{index_gap:.3e}",
        "router_gap": f"{router_gap:.3e}",
        "mtp_added": ",".join(mtp),
    }
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(OUT / "expected.safetensors"), metadata
    )
    for path in OUT.iterdir():
        path.chmod(0o644)
    sizes = {p.name: p.stat().st_size for p in sorted(OUT.iterdir())}
    print(
        json.dumps(
            {
                "seed": seed,
                "loss": tensors["loss"].item(),
                "short_loss": tensors["short.loss"].item(),
                "index_gap": index_gap,
                "router_gap": router_gap,
                "bytes": sizes,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
