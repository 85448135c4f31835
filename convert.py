"""Published checkpoints (Hugging Face safetensors) of Flint and Mistral Large 4 <-> the native
checkpoint, one tensor at a time.

    python convert.py to-native HF_DIR OUT      # published -> native (DCP directory + config.json)
    python convert.py to-hf IN HF_DIR  # native (model-only or a training checkpoint) -> published
    python convert.py to-peft IN ADAPTER_DIR  # a LoRA run's checkpoint -> PEFT's adapter directory

IN is a checkpoint directory or, as for sample.py's --checkpoint, a run's checkpoint directory (its
newest intact step_*).

to-hf on a LoRA run's checkpoint (adapters only, lora.py) writes the merged model: the base it
names, each adapted weight plus its scaled update; to-peft writes its adapters in PEFT's format.
Both exports and the in-memory merge (sample.py) are here, below; lora.py holds the adapters and the
run's record.

The native checkpoint is what train.py saves and resumes from: a torch.distributed.checkpoint
directory whose state dict holds {"model": <native state dict>, optional "optimizer", "train"}, plus
config.json. config.json's model_type picks the model family; each family declares its published key
table beside the model (Flint: flint_model.py and SPEC.md; Mistral Large 4: large4_config.py and
LARGE4.md), reached through registry.py. Published tensors outside the model (Large 4's vision tower
and draft head) are "extras": to-native keeps them under "extra" in the DCP checkpoint, to-hf and
save_hf write them back, never dropped. FP8 block-scaled weights (the Large 4 release) are
dequantized on import; exports are BF16/FP16/FP32.

Every published tensor is a `Part` of one native tensor: native[index] == published, transposed or
not. That single table drives both directions, the key accounting and the shape checks. Renames and
transposes never change a dtype, so both round trips are bit-exact; only loading into a model (whose
sinks, routers and head are FP32) or an explicit `dtype` casts. Conversions stream: each native
tensor is built from (or split into) its parts and written before the next one is read, so peak
memory is about two native tensors, never the model. Output goes to a temporary directory that is
renamed into place at the end, and pickle checkpoints (.bin) are refused, never loaded.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from checkpoint_files import is_hf_checkpoint, load_dcp, resolve_checkpoint, write_checksums
from files import read_config_json
from hf_io import (
    SAFETENSORS_DTYPES,
    Entry,
    Layout,
    NativeDir,
    Part,
    SafetensorsDir,
    Source,
    StateSource,
    atomic_directory,
    dcp_call,
    parse_size,
    published_view,
    read_json,
    write_safetensors,
)
from lora import (
    RUN_FILE,
    LoraConfig,
    adapter_state,
    base_changes,
    base_identity,
    base_key,
    delta_weight,
    read_run_record,
    warn_unrecorded_weights,
)
from registry import ModelConfig, config_from_hf, family_of, model_class
from tokenizer import Tokenizer, TokenizerError, load_tokenizer, write_hf_tokenizer

Log = Callable[[str], None]
Config = ModelConfig


def layout_of(config: Config) -> Layout:
    """The published layout of the config's model family (registry.py)."""
    return family_of(config).layout


def published_table(config: Config, present: set[str] | None = None) -> dict[str, list[Part]]:
    """Native key -> its published parts; with `present` (a source's keys), in the form that source
    uses."""
    return layout_of(config).table(config, native_meta(config), present or set())


def read_config(directory: str | Path) -> tuple[Config, dict]:
    """config.json of a checkpoint directory -> (the model's config, the raw JSON)."""
    path = Path(directory) / "config.json"
    return config_from_hf(path), read_json(path)


def native_meta(config: Config) -> dict[str, torch.Tensor]:
    """Every native parameter as a meta tensor (shape only), in model order; builds nothing real."""
    with torch.device("meta"):
        return model_class(config)(config).state_dict()


def open_published(path: str | Path, dtype: torch.dtype | None = None) -> tuple[Config, Source]:
    """A published checkpoint directory -> (config, source). FP8 weights read dequantized, as
    `dtype` (default BF16); other tensors keep their dtype unless the checkpoint holds FP8."""
    config, raw = read_config(path)
    layout = layout_of(config)
    source = SafetensorsDir(path, layout.quantized_dtypes)
    if not any(stored in layout.quantized_dtypes.values() for _, stored in source.meta.values()):
        return config, source
    keep = {
        part.key
        for key, parts in published_table(config).items()
        for part in parts
        if key.endswith(layout.published_fp32_suffixes)
    }
    return config, layout.dequantize(
        source, raw, str(Path(path) / "config.json"), dtype or torch.bfloat16, keep.__contains__
    )


# ============================================================================= checks


def check_layers(
    source: Source, config: Config, skip: Callable[[str], bool] = lambda key: False
) -> None:
    """Layer indices in the keys must be exactly 0 .. num_hidden_layers - 1 of config.json."""
    count, seen = config.num_hidden_layers, set()
    for key in (k for k in source.meta if not skip(k)):
        match = re.search(r"(?:^|\.)layers\.(\d+)\.", key)
        if match:
            seen.add(int(match.group(1)))
            if int(match.group(1)) >= count:
                raise ValueError(
                    f"{source.where(key)}: key {key!r} is for layer {match.group(1)}, "
                    "but "
                    f"config.json has num_hidden_layers={count}"
                )
    missing = sorted(set(range(count)) - seen)
    if missing:
        raise ValueError(
            f"{source.name}: no keys for layer {missing[0]} (e.g. "
            f"'layers.{missing[0]}."
            f"input_layernorm.weight'), but config.json has num_hidden_layers={count}"
        )


def check_keys(
    source: Source,
    expected: dict[str, tuple[int, ...]],
    skip: Callable[[str], bool] = lambda key: False,
) -> None:
    """Strict accounting: every expected key present once with its shape, and nothing else but
    `skip` keys."""
    for key, shape in expected.items():
        if key not in source.meta:
            raise ValueError(f"{source.name}: missing key {key!r} (shape {list(shape)})")
        if source.meta[key][0] != shape:
            raise ValueError(
                f"{source.where(key)}: key {key!r} has shape "
                f"{list(source.meta[key][0])}, "
                f"expected {list(shape)}"
            )
    unexpected = [k for k in source.meta if k not in expected and not skip(k)]
    if unexpected:
        raise ValueError(f"{source.where(unexpected[0])}: unexpected key {unexpected[0]!r}")


def check_dtypes(
    source: Source, layout: dict[str, list[Part]], fp32_suffixes: tuple[str, ...]
) -> dict[str, torch.dtype]:
    """One bulk dtype (that of the embedding); FP32 also allowed where the model keeps FP32 ->
    native dtypes."""
    first = layout["embed_tokens.weight"][0].key
    bulk = source.meta[first][1]
    if bulk not in SAFETENSORS_DTYPES.values():
        raise ValueError(
            f"{source.where(first)}: key {first!r} has dtype {bulk}, expected one of "
            f"{list(SAFETENSORS_DTYPES.values())}"
        )
    dtypes = {}
    for native_key, parts in layout.items():
        allowed = {bulk, torch.float32} if native_key.endswith(fp32_suffixes) else {bulk}
        dtypes[native_key] = source.meta[parts[0].key][1]
        for part in parts:
            dtype = source.meta[part.key][1]
            if dtype not in allowed or dtype != dtypes[native_key]:
                expected = " or ".join(sorted({str(d) for d in allowed}))
                raise ValueError(
                    f"{source.where(part.key)}: key {part.key!r} has dtype {dtype}, "
                    f"expected {expected}"
                    f" like the rest of the checkpoint ({first!r} is {bulk})"
                )
    return dtypes


def check_source(
    source: Source, config: Config, published: bool
) -> tuple[dict[str, list[Part]], dict]:
    """Check a published or native source against config.json -> (native key -> parts, native key ->
    dtype). A published source may also hold the family's extras (see `extras_of`)."""
    spec, meta = layout_of(config), native_meta(config)
    skip = spec.is_extra if published else lambda key: False
    check_layers(source, config, skip)
    layout = (
        published_table(config, set(source.meta))
        if published
        else {k: [Part(k, (), False)] for k in meta}
    )
    check_keys(
        source,
        {p.key: tuple(published_view(meta[k], p).shape) for k, ps in layout.items() for p in ps},
        skip,
    )
    return layout, check_dtypes(source, layout, spec.fp32_suffixes)


def extras_of(source: Source, config: Config) -> Source | None:
    """The published tensors of `source` outside the model (vision tower, draft head), or None."""
    keys = [k for k in source.meta if layout_of(config).is_extra(k)]
    return ExtrasView(source, keys) if keys else None


class ExtrasView(Source):
    """Some keys of a source, e.g. the extras of a published checkpoint."""

    def __init__(self, source: Source, keys: list[str]):
        self.source, self.name = source, source.name
        self.meta = {k: source.meta[k] for k in keys}

    def where(self, key: str) -> str:
        return self.source.where(key)

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        return self.source.read(keys)


def build_native(source: Source, parts: list[Part], out: torch.Tensor) -> torch.Tensor:
    tensors = source.read([p.key for p in parts])
    for part in parts:
        published_view(out, part).copy_(tensors.pop(part.key))
    return out


# ============================================================================= state-dict API


def hf_to_native(hf_state: dict[str, torch.Tensor], config: Config) -> dict[str, torch.Tensor]:
    """Published state dict (either expert form) -> native state dict, same dtypes, new tensors."""
    source = StateSource(hf_state, "hf_state")
    layout, dtypes = check_source(source, config, published=True)
    extras = extras_of(source, config)
    if extras is not None:
        raise ValueError(
            f"hf_state: key {next(iter(extras.meta))!r} is not part of the text model, "
            "and a native "
            "state dict cannot keep it; convert the directory (to-native, load_hf), "
            "which carries it"
        )
    meta = native_meta(config)
    return {
        k: build_native(source, parts, torch.empty(meta[k].shape, dtype=dtypes[k]))
        for k, parts in layout.items()
    }


def native_to_hf(native_state: dict[str, torch.Tensor], config: Config) -> dict[str, torch.Tensor]:
    """Native state dict -> published state dict (per-expert, softmax_offset form), same dtypes.

    Tensors that need no transpose share memory with `native_state`.
    """
    check_source(StateSource(native_state, "native_state"), config, published=False)
    layout = published_table(config)
    return {
        p.key: published_view(native_state[k], p).contiguous()
        for k, parts in layout.items()
        for p in parts
    }


# ============================================================================= output directories


def _write_config(
    directory: Path, config: Config, dtype: torch.dtype | None = None, published: bool = False
) -> None:
    """config.json: the family's published form for an export (published_config), else the config's
    own."""
    writer = layout_of(config).published_config if published else None
    # never a quantization_config: nothing is FP8
    hf_config = (writer or type(config).to_hf_config)(config)
    if dtype is not None:
        hf_config["dtype"] = str(dtype).removeprefix("torch.")
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")


# ==================================================================== writing published checkpoints


def refuse_selection_bias(config: Config, name: str) -> None:
    """A ValueError for a model whose experts are chosen with the aux-loss-free selection bias."""
    bias_rate = config.router_bias_update_rate
    if bias_rate:
        raise ValueError(
            f"{name}: this model chooses experts with a per-expert selection bias "
            f"(router_bias_update_rate = {bias_rate}), which the published format has "
            "no place "
            f"for: the export would route differently from the trained model"
        )


def export_published(
    source: Source,
    config: Config,
    out: str | Path,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    log: Log = lambda line: None,
    extras: Source | None = None,
    tokenizer: Tokenizer | None = None,
) -> tuple[int, int]:
    """Write a native source, and `extras` (published tensors outside the model) as they are or cast
    to `dtype`, as a published checkpoint directory -> (tensors, bytes); with `tokenizer`, its files
    in transformers' format beside them (tokenizer.hf_tokenizer_files)."""
    refuse_selection_bias(config, source.name)
    spec, dtypes = layout_of(config), check_source(source, config, published=False)[1]
    meta, limit = native_meta(config), parse_size(max_shard_size)
    entries = []
    for native_key, parts in published_table(config).items():
        cast = (
            dtype
            if dtype is not None and not native_key.endswith(spec.published_fp32_suffixes)
            else None
        )
        entries += [
            Entry(
                native_key,
                p,
                tuple(published_view(meta[native_key], p).shape),
                cast or dtypes[native_key],
            )
            for p in parts
        ]
    for key, (shape, stored) in (extras.meta if extras is not None else {}).items():
        entries.append(
            Entry(
                None,
                Part(key, (), False),
                shape,
                dtype if dtype and stored.is_floating_point else stored,
            )
        )
    shards: list[list[Entry]] = [[]]
    filled = 0
    for entry in entries:  # greedy in model order, so each native tensor is read once
        if shards[-1] and filled + entry.nbytes > limit:
            shards.append([])
            filled = 0
        shards[-1].append(entry)
        filled += entry.nbytes

    current: dict[str, torch.Tensor] = {}  # the one native tensor being split

    def tensor_of(entry: Entry) -> torch.Tensor:
        if entry.native_key is None:
            current.clear()
            return extras.read([entry.part.key])[entry.part.key].to("cpu", entry.dtype)
        if entry.native_key not in current:
            current.clear()
            current.update(source.read([entry.native_key]))
        return published_view(current[entry.native_key], entry.part).to("cpu", entry.dtype)

    with atomic_directory(out) as tmp:
        weight_map = {}
        for number, shard in enumerate(shards, 1):
            start, name = (
                time.perf_counter(),
                f"model-{number:05d}-of-{len(shards):05d}.safetensors",
            )
            write_safetensors(tmp / name, shard, tensor_of)
            weight_map.update({e.part.key: name for e in shard})
            log(
                f"shard {number}/{len(shards)} {name}: {len(shard)} tensors, "
                f"{sum(e.nbytes for e in shard) / 1e9:.3f} GB, {time.perf_counter() - start:.1f} s"
            )
        total = sum(e.nbytes for e in entries)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        _write_config(tmp, config, dtype or dtypes["embed_tokens.weight"], published=True)
        if tokenizer is not None:
            write_hf_tokenizer(tokenizer, tmp)
    written = sorted({str(e.dtype).removeprefix("torch.") for e in entries})
    log(
        f"wrote {' and '.join(written)} tensors, {len(extras.meta) if extras else 0} of them "
        "extras "
        f"(nothing is FP8: an FP8 source was dequantized on import and is not re-quantized)"
    )
    return len(entries), total


def save_hf(
    model: nn.Module,
    path: str | Path,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
) -> None:
    """Write config.json, safetensors shards and model.safetensors.index.json in the published
    layout.

    dtype None keeps each tensor's dtype; otherwise every tensor is cast to it except those the
    published layout keeps in FP32 (Flint: sinks and routers; Large 4: routers and LeRoPE alpha). A
    model from load_hf / load_native also writes the extras of the checkpoint it came from (vision
    tower, draft head)."""
    export_published(
        StateSource(model.state_dict(), "model"),
        model.config,
        path,
        dtype,
        max_shard_size,
        extras=getattr(model, "published_extras", None),
    )


# ============================================================================= native checkpoints


class _LazySavePlanner(DefaultSavePlanner):
    """Plans from meta tensors and produces each tensor only when the writer asks for it.

    FileSystemWriter calls `resolve_data` per item while writing; with one file per tensor it keeps
    nothing once that tensor's file is written, so memory stays at about two tensors.
    """

    def __init__(self, produce: Callable[[str], torch.Tensor], extras: Source | None = None):
        super().__init__()
        self.produce, self.extras = produce, extras

    def resolve_data(self, write_item: WriteItem):
        fqn = write_item.index.fqn
        if write_item.type != WriteItemType.BYTE_IO and fqn.startswith("model."):
            return self.produce(fqn.removeprefix("model."))
        if write_item.type != WriteItemType.BYTE_IO and fqn.startswith("extra."):
            key = fqn.removeprefix("extra.")
            return self.extras.read([key])[key]
        return super().resolve_data(write_item)


def write_native(
    out: str | Path,
    config: Config,
    shapes: dict[str, tuple[torch.Size, torch.dtype]],
    produce: Callable[[str], torch.Tensor],
    extras: Source | None = None,
) -> None:
    """Write a model-only native checkpoint whose tensors `produce(native_key)` makes one at a time;
    `extras` (published tensors outside the model) go under "extra", copied one at a time."""
    state = {
        "model": {
            k: torch.empty(shape, dtype=dtype, device="meta")
            for k, (shape, dtype) in shapes.items()
        }
    }
    if extras is not None:
        state["extra"] = {
            k: torch.empty(shape, dtype=dtype, device="meta")
            for k, (shape, dtype) in extras.meta.items()
        }
    with atomic_directory(out) as tmp:
        writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=False)
        dcp_call(dcp.save, state, storage_writer=writer, planner=_LazySavePlanner(produce, extras))
        _write_config(tmp, config)
        write_checksums(tmp)


def import_native(
    source: Source, config: Config, out: str | Path, log: Log = lambda line: None
) -> tuple[int, int]:
    """Write a published source as a native checkpoint -> (tensors, bytes)."""
    layout, dtypes = check_source(source, config, published=True)
    meta = native_meta(config)
    # keys not yet read, for a line per finished shard
    left = Counter(source.where(key) for key in source.meta)
    started = time.perf_counter()

    def produce(native_key: str) -> torch.Tensor:
        out = torch.empty(meta[native_key].shape, dtype=dtypes[native_key])
        tensor = build_native(source, layout[native_key], out)
        for part in layout[native_key]:
            left[source.where(part.key)] -= 1
            if left[source.where(part.key)] == 0:
                log(
                    f"read shard {source.where(part.key)}: all its tensors converted "
                    f"({time.perf_counter() - started:.1f} s)"
                )
        return tensor

    write_native(
        out,
        config,
        {k: (meta[k].shape, dtypes[k]) for k in layout},
        produce,
        extras_of(source, config),
    )
    return len(layout), sum(meta[k].numel() * dtypes[k].itemsize for k in layout)


def save_native(
    model_or_state: nn.Module | dict[str, torch.Tensor], config: Config, path: str | Path
) -> None:
    """Write a model-only native checkpoint (DCP "model" entry + config.json) from a model or a
    native state dict."""
    state = model_or_state.state_dict() if isinstance(model_or_state, nn.Module) else model_or_state
    source = StateSource(state, "native_state")
    check_source(source, config, published=False)
    write_native(
        path,
        config,
        {k: (torch.Size(s), d) for k, (s, d) in source.meta.items()},
        lambda key: state[key].detach().cpu(),
    )


# ============================================================================= loading models


def _empty_model(config: Config, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    with torch.device("meta"):
        model = model_class(config)(config, dtype)
    model.to_empty(device=device)
    for buffer in model.buffers():  # buffers hold statistics, not checkpoint state
        buffer.zero_()
    return model


def load_hf(
    path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> nn.Module:
    """Build the model config.json names from a published checkpoint directory. dtype None: the
    checkpoint's bulk dtype (BF16 for FP8 weights, which are dequantized). The checkpoint's extras
    (Large 4's vision tower and draft head) stay on disk; `model.published_extras` lets save_hf
    write them back."""
    config, source = open_published(path, dtype)
    layout, dtypes = check_source(source, config, published=True)
    model = _empty_model(config, dtype or dtypes["embed_tokens.weight"], device)
    params = model.state_dict()
    with torch.no_grad():
        for native_key, parts in layout.items():
            build_native(source, parts, params[native_key])
    _keep_extras(model, extras_of(source, config))
    return model


def load_native(
    path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> nn.Module:
    """Build the model from a native checkpoint (model-only or training). dtype None: the
    checkpoint's bulk dtype."""
    config = read_config(path)[0]
    source = NativeDir(path)
    dtypes = check_source(source, config, published=False)[1]
    model = _empty_model(config, dtype or dtypes["embed_tokens.weight"], device)
    # NativeDir verified it
    load_dcp({"model": model.state_dict()}, Path(path), alone=True, verified=True)
    _keep_extras(model, native_extras(path))
    return model


def native_extras(path: str | Path) -> Source | None:
    """The published extras a native checkpoint written by to-native keeps under "extra", or
    None."""
    extras = NativeDir(path, prefix="extra")
    return extras if extras.meta else None


def published_extras(path: str | Path, config: Config) -> Source | None:
    """The extras a checkpoint directory holds, native (written by to-native) or published, or
    None."""
    if (Path(path) / ".metadata").exists():
        return native_extras(path)
    return extras_of(open_published(path)[1], config)


def _keep_extras(model: nn.Module, extras: Source | None) -> None:
    if extras is not None:  # read again, tensor by tensor, only when save_hf writes them
        model.published_extras = extras


# ====================================================== LoRA checkpoints: merged and PEFT exports


def merge_lora(state: dict[str, torch.Tensor], config: LoraConfig) -> dict[str, torch.Tensor]:
    """An adapted model's state dict -> the base's keys only, each adapted weight plus its scaled
    update (added in FP32, cast back to the weight's dtype): the published model again."""
    adapters = adapter_state(state)
    merged = {key: value for key, value in state.items() if key not in adapters}
    for a_key in (key for key in adapters if key.endswith(".A")):
        weight_key = base_key(a_key)
        weight = merged[weight_key]
        update = delta_weight(adapters[a_key], adapters[a_key[:-1] + "B"], config.scale)
        merged[weight_key] = (weight.float() + update.to(weight.device)).to(weight.dtype)
    return merged


def peft_state(
    adapters: dict[str, torch.Tensor], published: dict[str, list[Part]]
) -> dict[str, torch.Tensor]:
    """Adapter tensors (native keys) -> PEFT's keys and layouts. `published`: the model's published
    table (native key -> its published parts, as published_table gives it). Keys are named
    after the published module, as the published checkpoint names its weights (transformers renames
    both alike on loading).

    A Linear's adapter keeps its layout: X.weight -> base_model.model.X.lora_A.weight [r, in] and
    lora_B.weight [out, r]. Grouped experts, published one weight per expert (M.{e}.{proj}.weight)
    or fused (M.gate_up_proj), follow peft's ParamWrapper (target_parameters) on transformers' fused
    [E, out, in] weights: it wraps the experts module M once per parameter, gate_up_proj innermost,
    so gate_up_proj -> M.base_layer.lora_{A,B}.weight and down_proj -> M.lora_{A,B}.weight, with
    lora_A.weight [E * r, in] (expert e's A^T in rows e*r..(e+1)*r) and lora_B.weight [out, r * E]
    (column j*E + e: rank j of expert e's B^T)."""
    tensors = {}
    for a_key in sorted(key for key in adapters if key.endswith(".A")):
        A, B = adapters[a_key], adapters[a_key[:-1] + "B"]
        stem = "base_model.model." + published_module(
            base_key(a_key), published[base_key(a_key)], A.dim() == 3
        )
        if A.dim() == 2:
            tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"] = A, B
            continue
        num_experts, _, rank = A.shape
        stem += ".base_layer" if a_key.endswith("gate_up_lora.A") else ""
        # [E, in, r] -> [E*r, in]
        tensors[f"{stem}.lora_A.weight"] = A.transpose(1, 2).reshape(num_experts * rank, -1)
        # [E, r, out] -> [out, r, E] -> [out, r*E]
        tensors[f"{stem}.lora_B.weight"] = B.permute(2, 1, 0).reshape(-1, rank * num_experts)
    return {key: value.detach().to("cpu").contiguous() for key, value in tensors.items()}


def published_module(native_key: str, parts: list[Part], grouped: bool) -> str:
    """The published name of the module holding native weight `native_key`: X.weight -> X; the
    experts' per-expert M.{e}.{proj}.weight or fused M.gate_up_proj -> M."""
    if not grouped:
        if len(parts) != 1 or parts[0].index:
            raise ValueError(
                f"{native_key}: published as {len(parts)} parts; a Linear's adapter needs one"
            )
        return parts[0].key.removesuffix(".weight")
    if not all(part.transposed for part in parts):
        raise ValueError(
            f"{native_key}: PEFT's expert adapters need the published [out, in] layout "
            "of each expert"
        )
    modules = {part.key.rsplit(".", 3 if part.index else 1)[0] for part in parts}
    if len(modules) != 1:
        raise ValueError(
            f"{native_key}: its published parts lie in {len(modules)} modules, expected one"
        )
    return modules.pop()


def peft_config(
    config: LoraConfig,
    adapters: dict[str, torch.Tensor],
    module_name: Callable[[str], str],
    base_model: str | None = None,
) -> dict:
    """adapter_config.json for `adapters`. module_name: a native module name -> the name
    transformers' model gives that module (peft matches its targets against those names when it
    wraps the model, before the weights' names are converted). The adapted Linear maps go to
    target_modules, the experts' weights to target_parameters. Dropout is written as 0 when experts
    are adapted: peft refuses dropout on a target parameter (it only acts in training, so no output
    changes)."""
    modules, parameters = set(), set()
    for a_key in (key for key in adapters if key.endswith(".A")):
        owner, _, weight = base_key(a_key).rpartition(".")
        if adapters[a_key].dim() == 2:
            modules.add(module_name(owner))
        else:
            parameters.add(f"{module_name(owner)}.{weight}")
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": 0.0 if parameters else config.dropout,
        "target_modules": sorted(modules),
        "target_parameters": sorted(parameters),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def write_peft_adapter(
    directory: str | Path,
    adapters: dict[str, torch.Tensor],
    config: LoraConfig,
    published: dict[str, list[Part]],
    module_name: Callable[[str], str],
    base_model: str | None = None,
) -> None:
    """Write `directory` (whole or not at all): adapter_config.json and
    adapter_model.safetensors."""
    from safetensors.torch import save_file

    with atomic_directory(directory) as tmp:
        save_file(
            peft_state(adapters, published),
            str(tmp / "adapter_model.safetensors"),
            {"format": "pt"},
        )
        text = json.dumps(peft_config(config, adapters, module_name, base_model), indent=2)
        (tmp / "adapter_config.json").write_text(text + "\n")


class PublishedAsNative(Source):
    """A published checkpoint read under native keys and layouts, one native tensor at a time."""

    def __init__(self, path: str | Path):
        config, self.source = open_published(path)
        self.layout, dtypes = check_source(self.source, config, published=True)
        shapes = native_meta(config)
        self.name = self.source.name
        self.meta = {key: (tuple(shapes[key].shape), dtypes[key]) for key in self.layout}

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        return {
            key: build_native(
                self.source,
                self.layout[key],
                torch.empty(self.meta[key][0], dtype=self.meta[key][1]),
            )
            for key in keys
        }


def base_source(checkpoint: Path) -> tuple[Source, LoraConfig, str]:
    """A LoRA checkpoint's base (native or published), checked against the identity the run recorded
    -> (its tensors under native keys, the run's [lora] settings, its path)."""
    saved = read_run_record(checkpoint)
    if saved is None:
        raise ValueError(f"{checkpoint}: not the checkpoint of a LoRA run (it has no {RUN_FILE})")
    path = saved.base["path"]
    if not (Path(path) / "config.json").is_file():
        raise ValueError(
            f"{checkpoint / RUN_FILE}: its base {path} is not there any more; the adapters need it"
        )
    changes = base_changes(saved.base, base_identity(path))
    if changes:
        raise ValueError(
            f"{checkpoint / RUN_FILE}: the base {path} is not the one the adapters "
            f"were trained on: its {changes} changed since the run started"
        )
    if "weights_sha256" not in saved.base:
        warn_unrecorded_weights(checkpoint, path)
    source = NativeDir(path) if (Path(path) / ".metadata").exists() else PublishedAsNative(path)
    return source, saved.lora, path


class MergedSource(Source):
    """A LoRA checkpoint's model merged, under native keys: each base tensor, plus its scaled update
    where adapted (in FP32, cast back to the base's dtype), read one at a time, so that
    convert.export_published streams the merged model as it streams any native checkpoint."""

    def __init__(self, checkpoint: Path):
        self.base, self.config, self.base_path = base_source(checkpoint)
        self.adapters = NativeDir(checkpoint)
        self.name, self.meta = self.base.name, self.base.meta
        # the adapted weight -> its adapter's prefix: q_proj.weight -> q_proj.lora.
        self.adapted = {base_key(key): key[:-1] for key in self.adapters.meta if key.endswith(".A")}

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        tensors = self.base.read(keys)
        for key in (key for key in keys if key in self.adapted):
            prefix = self.adapted[key]
            pair = self.adapters.read([prefix + "A", prefix + "B"])
            update = delta_weight(pair[prefix + "A"], pair[prefix + "B"], self.config.scale)
            tensors[key] = (tensors[key].float() + update).to(tensors[key].dtype)
        return tensors


@torch.no_grad()
def load_merged(
    checkpoint: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> nn.Module:
    """A LoRA checkpoint's model merged, in one process (sampling), read a tensor at a time. dtype
    None: FP32."""
    source = MergedSource(Path(checkpoint))
    model = _empty_model(read_config(checkpoint)[0], dtype or torch.float32, device)
    for key, value in model.state_dict().items():
        value.copy_(source.read([key])[key])
    return model


def transformers_module_name(config: ModelConfig, native: str) -> str:
    """The name transformers' model gives the native module `native` (the family's Layout declares
    it)."""
    layout = family_of(config).layout
    name = layout.transformers_prefix + native
    for old, new in layout.transformers_renames.items():
        name = name.replace(old, new)
    return name


def peft_base(base_path: str, base_hf: str | None, config: ModelConfig) -> str:
    """The base_model_name_or_path a PEFT adapter names: a published directory transformers
    loads (absolute, so the adapter loads from any working directory). A published base is named
    as it is; a native one needs `base_hf`, its to-hf export (checked by family and tensor
    shapes; its weights are not read)."""
    refuse_selection_bias(config, base_path)
    if base_hf is None:
        if is_hf_checkpoint(Path(base_path)):
            return str(Path(base_path).resolve())
        raise ValueError(
            f"{base_path}: the adapters' base is a native checkpoint, which "
            f"transformers cannot load; export it (python3 convert.py to-hf "
            f"{base_path} BASE_HF) and pass --base-hf BASE_HF"
        )
    if not is_hf_checkpoint(Path(base_hf)):
        raise ValueError(
            f"--base-hf {base_hf}: not a published checkpoint (config.json and *.safetensors)"
        )
    published = PublishedAsNative(base_hf)
    native = (
        PublishedAsNative(base_path) if is_hf_checkpoint(Path(base_path)) else NativeDir(base_path)
    )
    shapes = {key: shape for key, (shape, _) in native.meta.items()}
    if (
        family_of(read_config(base_hf)[0]) is not family_of(config)
        or {key: shape for key, (shape, _) in published.meta.items()} != shapes
    ):
        raise ValueError(
            f"--base-hf {base_hf}: not an export of the adapters' base {base_path} "
            f"(another family or other tensor shapes)"
        )
    return str(Path(base_hf).resolve())


def export_peft(checkpoint: Path, out: str | Path, base_hf: str | None = None) -> int:
    """A LoRA checkpoint's adapters as a PEFT adapter directory `out` -> the tensors written. Its
    base is the run's, or `base_hf`, that base's to-hf export, when the run's is native
    (peft_base)."""
    _, config, base_path = base_source(checkpoint)
    model_config = read_config(checkpoint)[0]
    base_model = peft_base(base_path, base_hf, model_config)
    adapters = NativeDir(checkpoint)
    tensors = adapters.read(list(adapters.meta))
    write_peft_adapter(
        out,
        tensors,
        config,
        published_table(model_config),
        lambda native: transformers_module_name(model_config, native),
        base_model,
    )
    return len(tensors)


# ============================================================================= command line


def report_defaults(path: Path, config: ModelConfig, log: Callable[[str], None]) -> None:
    """Name the published fields that config.json leaves out, and the defaults used for them (for
    the families whose layout lists them)."""
    listed = layout_of(config).missing_fields
    missing = listed(config, read_json(path)) if listed else []
    if missing:
        values = ", ".join(f"{k} = {str(getattr(config, k))[:40]}" for k in missing)
        log(f"{path}: {len(missing)} field(s) missing, using the defaults: {values}")


def transformers_note(directory: Path, extras: Source | None) -> str | None:
    """One line on what transformers will report, harmlessly, when it loads the export `directory`
    (its load report and rope validation print them with no explanation), or None."""
    written = read_json(directory / "config.json")
    text, notes = written.get("text_config", written), []
    has_vision = extras is not None and any("vision_tower" in key for key in extras.meta)
    if "vision_config" in written and not has_vision:  # Large 4: a placeholder vision config
        notes.append(
            "its load report lists the vision tower and projector as MISSING: this "
            "export is the text model only, so it initializes them fresh, and text "
            "generation never runs them (--extras-from a release checkpoint writes "
            "real ones)"
        )
    rope = text.get("rope_parameters") or {}
    if rope.get("rope_type") == "yarn" and rope.get("original_max_position_embeddings"):
        implicit = text["max_position_embeddings"] / rope["original_max_position_embeddings"]
        if implicit != rope["factor"]:  # a preset shorter than the release's 512 x 2048 positions
            notes.append(
                f"it warns that the YaRN factor {rope['factor']:g} is not "
                f"max_position_embeddings / original_max_position_embeddings = "
                f"{implicit:g} and uses the explicit factor, as flint does: the same "
                f"rotary frequencies"
            )
    return f"note, transformers loading {directory}: " + "; ".join(notes) if notes else None


def run_tokenizer(checkpoint: Path) -> Tokenizer:
    """The tokenizer a checkpoint was trained with: the run's (train_config.json next to the
    weights), else the checkpoint's tokenizer.json, else the byte tokenizer. sample.py and the
    export read it here."""
    run_config = checkpoint / "train_config.json"
    if run_config.is_file():
        saved = read_config_json(run_config)[0]
        data, model = saved.get("data", {}), saved.get("model", {})
        settings = [
            ("data", data, "tokenizer", "byte"),
            ("data", data, "eos_token", "<|endoftext|>"),
            ("model", model, "init_from", ""),
        ]
        for section, table, key, default in settings:
            if not isinstance(table, dict) or not isinstance(table.get(key, default), str):
                raise TokenizerError(
                    f"{run_config}: expected {section} to be an object whose {key} is "
                    "a string (as train.py writes it), got "
                    f"{section} = {table!r:.60}; use --tokenizer"
                )
        return load_tokenizer(
            data.get("tokenizer", "byte"),
            data.get("eos_token", "<|endoftext|>"),
            model.get("init_from", ""),
        )
    if (checkpoint / "tokenizer.json").is_file():
        return load_tokenizer(str(checkpoint))
    return load_tokenizer("byte")


def recorded_tokenizer(checkpoint: Path, log: Log) -> Tokenizer | None:
    """The tokenizer the run trained with, as sample.py picks it (its train_config.json, else the
    directory's tokenizer.json), or None, said in one line, when the checkpoint records neither."""
    if not any((checkpoint / name).is_file() for name in ("train_config.json", "tokenizer.json")):
        log(
            f"no tokenizer written: {checkpoint} records none "
            f"(no train_config.json or tokenizer.json)"
        )
        return None
    tokenizer = run_tokenizer(checkpoint)
    log(
        f"tokenizer: the run's, {tokenizer.vocab_size} tokens, end-of-text id {tokenizer.eos_id} "
        f"(tokenizer.json, tokenizer_config.json)"
    )
    return tokenizer


def checkpoint_of(path: Path, command: str) -> Path:
    """A checkpoint directory as it is (a bad one is named by the reader's own checks), or, as
    sample.py's --checkpoint takes it, a run's checkpoint directory -> its newest intact step_*
    (named when chosen)."""
    if (path / ".metadata").exists() or (path / "config.json").exists():
        return path
    step = resolve_checkpoint(path, command)
    print(
        f"{command}: {path} is a run's checkpoint directory; converting its newest intact "
        f"step {step}"
    )
    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    to_native = commands.add_parser("to-native", help="published HF_DIR -> native checkpoint OUT")
    to_native.add_argument("hf_dir")
    to_native.add_argument("out")
    to_native.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        help="dtype of dequantized FP8 weights (default bfloat16); ignored without FP8",
    )
    to_hf = commands.add_parser(
        "to-hf", help="native checkpoint IN (model-only or training) -> published HF_DIR"
    )
    to_hf.add_argument("native_dir")
    to_hf.add_argument("hf_dir")
    to_hf.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        help="cast to this dtype (sinks and routers stay FP32); default: keep the checkpoint's",
    )
    to_hf.add_argument(
        "--max-shard-size", default="5GB", help="bytes per shard, e.g. 5GB or 500MiB"
    )
    to_hf.add_argument(
        "--extras-from",
        metavar="HF_DIR",
        help="copy the tensors outside the model (vision tower, draft head) from "
        "this published or "
        "native checkpoint; default: those IN keeps (to-native output keeps "
        "them, training not)",
    )
    to_peft = commands.add_parser(
        "to-peft", help="a LoRA run's checkpoint IN -> PEFT adapter directory ADAPTER_DIR"
    )
    to_peft.add_argument("native_dir")
    to_peft.add_argument("adapter_dir")
    to_peft.add_argument(
        "--base-hf",
        metavar="HF_DIR",
        help="the base's to-hf export, named in adapter_config.json for "
        "transformers to load; needed when the run's base is native "
        "(default: the run's base, when published)",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.command in ("to-hf", "to-peft"):
        try:
            args.native_dir = str(checkpoint_of(Path(args.native_dir), args.command))
        except ValueError as error:
            sys.exit(f"error: {error}")
    if args.command == "to-peft":
        try:
            tensors = export_peft(Path(args.native_dir), args.adapter_dir, args.base_hf)
        except (ValueError, OSError) as error:
            sys.exit(f"error: {error}")
        print(
            f"wrote {tensors} adapter tensors to {args.adapter_dir} in "
            f"{time.perf_counter() - started:.1f} s"
        )
        return
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        if args.command == "to-native":
            config, source = open_published(args.hf_dir, dtype)
            report_defaults(Path(args.hf_dir) / "config.json", config, print)
            tensors, size = import_native(source, config, args.out, log=print)
        else:
            # first: a directory without .metadata is not native
            source = NativeDir(args.native_dir)
            # adapters only: merge them into their base
            if read_run_record(Path(args.native_dir)) is not None:
                source = MergedSource(Path(args.native_dir))
                args.extras_from = args.extras_from or source.base_path
            config = read_config(args.native_dir)[0]
            report_defaults(Path(args.native_dir) / "config.json", config, print)
            extras = published_extras(args.extras_from or args.native_dir, config)
            tokenizer = recorded_tokenizer(Path(args.native_dir), print)
            tensors, size = export_published(
                source, config, args.hf_dir, dtype, args.max_shard_size, print, extras, tokenizer
            )
    except (ValueError, OSError) as error:
        sys.exit(f"error: {error}")
    out = args.out if args.command == "to-native" else args.hf_dir
    note = transformers_note(Path(out), extras) if args.command == "to-hf" else None
    if note:
        print(note)
    print(
        f"wrote {tensors} tensors, {size / 1e9:.3f} GB to {out} in "
        f"{time.perf_counter() - started:.1f} s"
    )


if __name__ == "__main__":
    main()
