"""parallel.py on the CPU with gloo: every layout must reproduce the single-process run.

Each test spawns 2 or 4 processes; each process builds the same seeded model, computes the
single-process reference itself, runs its layout on its share of the batch and compares the loss,
every gradient, the clipped gradient norm and a few optimizer steps. Larger combinations run with
FLINT_SLOW=1 python -m pytest tests/test_parallel.py.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from helpers import (
    FAMILY_NAMES,
    FIRST_FAMILY_THEN_SECOND_TIER,
    LR,
    MAX_NORM,
    PLAIN_INIT_OVERRIDES,
    SEQ,
    STEPS,
    adamw_matches_plain,
    build,
    check_layouts,
    close,
    full,
    in_process_group,
    make_batch,
    only,
    reference_run,
    rows_of_this_rank,
    slow,
    spawn,
    stops_with_one_line,
    tiny_config,
)
from parallel import (
    LayoutError,
    ParallelConfig,
    build_mesh,
    close_distributed,
    cp_token_index,
    init_weights,
    parallelize,
)
from registry import FAMILIES, family, model_class

# ----------------------------------------------------------------------------- configuration


def test_config_errors_name_the_key():
    with pytest.raises(
        ValueError, match=r"\[parallel\] pp \* dp_replicate \* dp_shard \* ep \* cp"
    ):
        ParallelConfig(dp_shard=3).resolve(4)
    with pytest.raises(ValueError, match=r"ep = 3 must divide the model's num_experts = 8"):
        ParallelConfig(ep=3).resolve(3, num_experts=8)
    with pytest.raises(ValueError, match=r"does not divide the world size 4"):
        ParallelConfig(pp=3).resolve(4)
    with pytest.raises(ValueError, match=r"unknown key 'tp'"):
        ParallelConfig.from_dict({"tp": 2})
    with pytest.raises(ValueError, match=r"pp_schedule must be one of"):
        ParallelConfig(pp_schedule="zigzag").resolve(1)
    for chunks in (0, 1.5, True):
        stops_with_one_line(
            lambda: ParallelConfig(ep_overlap=chunks).validate(),
            LayoutError,
            "ep_overlap",
            r"\[parallel\] ep_overlap must be an integer >= 1 .*, got",
        )
    assert ParallelConfig(ep=2, cp=2).resolve(8).dp_shard == 2


# ---------------------------------------------------------------------- every layout vs one process


@pytest.mark.slow
@only("flint")
def test_data_parallel_layouts_match_single_process():
    """FSDP, HSDP, full activation checkpointing, context parallel (the window of 9 crosses the cp
    chunks of 4 tokens; two documents and padding), and FSDP with CPU offload (its shards and the
    AdamW step in host memory: the same losses and gradients as without)."""
    spawn(
        2,
        check_layouts,
        [
            {"dp_shard": 2},
            {"dp_shard": 1, "dp_replicate": 2},
            {"dp_shard": 2, "activation_checkpointing": "full"},
            {"cp": 2, "dp_shard": 1},
            {"dp_shard": 2, "offload": True},
            {"ep": 2, "dp_shard": 1, "offload": True},
        ],
        {},
        "flint",
    )


@pytest.mark.slow
@only("flint")
def test_experts_fewer_than_their_shards_split_along_dim_1_and_match_single_process():
    """Two experts over 4 FSDP ranks, and one local expert over 2 expert-data-parallel ranks: dim 0
    is shorter than the shards, so FSDP splits dim 1 (least_padding); the same losses and gradients.
    Top 1 with norm_topk_prob off: renormalised, a single weight is 1 and the router's gradient only
    rounding noise."""
    from torch.distributed.tensor import Shard

    from parallel import least_padding

    placement = least_padding(4)
    assert placement(torch.nn.Parameter(torch.empty(2, 8, 16))) == Shard(1)
    assert placement(torch.nn.Parameter(torch.empty(8, 8, 16))) is None
    spawn(
        4,
        check_layouts,
        [{"dp_shard": 4}, {"ep": 2, "dp_shard": 2}],
        {"num_experts": 2, "num_experts_per_tok": 1, "norm_topk_prob": False},
        "flint",
    )


def check_overlapped_expert_layouts(family: str, four: bool) -> None:
    """Each layout with the exchange in one chunk and in 3 (ep_overlap) against one process."""
    layouts = (
        [{"ep": 2, "dp_shard": 2}]
        if four
        else [{"ep": 2, "dp_shard": 1, "activation_checkpointing": "full"}]
    )
    check_layouts(
        [{**layout, "ep_overlap": chunks} for layout in layouts for chunks in (1, 3)], {}, family
    )


@pytest.mark.slow
@pytest.mark.parametrize("family", FIRST_FAMILY_THEN_SECOND_TIER)
def test_overlapped_expert_exchange_matches_one_process(family):
    """ep 2 with every block recomputed (activation checkpointing full: the recompute runs the
    chunks' exchanges again, with the forward's split sizes) in 1 and 3 chunks (the default 2 runs
    in every other expert-parallel layout)."""
    spawn(2, check_overlapped_expert_layouts, family, False)


@slow
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_overlapped_expert_exchange_matches_one_process_on_four_ranks(family):
    """ep 2 x dp_shard 2 (the experts' FSDP over 2 expert-data-parallel ranks) in 1 and 3 chunks."""
    spawn(4, check_overlapped_expert_layouts, family, True)


@pytest.mark.slow
@only("flint")
def test_expert_and_pipeline_layouts_match_single_process():
    """Expert parallel (with selective checkpointing) and each pipeline schedule (4 stages of
    one layer for the interleaved one)."""
    spawn(
        2,
        check_layouts,
        [
            {"ep": 2, "dp_shard": 1},
            {"ep": 2, "dp_shard": 1, "activation_checkpointing": "selective"},
        ]
        + [
            {"pp": 2, "dp_shard": 1, "pp_schedule": s} for s in ("GPipe", "1F1B", "Interleaved1F1B")
        ],
        {},
        "flint",
    )


@pytest.mark.slow
@pytest.mark.parametrize("family", FIRST_FAMILY_THEN_SECOND_TIER)
def test_zero_bubble_pipelines_match_single_process(family):
    """ZB-V and DualPipeV: two stages per rank in a V (rank 0 holds stages 0 and 3, rank 1 stages 1
    and 2), the backward split into input and weight gradients; Large 4's stages carry latents,
    rotated keys and selections across all three boundaries."""
    spawn(
        2,
        check_layouts,
        [{"pp": 2, "dp_shard": 1, "pp_schedule": s} for s in ("ZBVZeroBubble", "DualPipeV")],
        {},
        family,
    )


def test_v_schedules_place_two_stages_per_rank_in_a_v():
    v = ParallelConfig(pp=4, pp_schedule="ZBVZeroBubble")
    assert [v.stage_ids(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert ParallelConfig(pp=2, pp_schedule="Interleaved1F1B").stage_ids(1) == [1, 3]
    with pytest.raises(
        ValueError,
        match="pp_stages_per_rank = 3 does not fit pp_schedule 'DualPipeV', which takes n = 2",
    ):
        ParallelConfig(pp=2, pp_schedule="DualPipeV", pp_stages_per_rank=3).validate()


@slow
@only("flint")
def test_combined_layouts_four_processes():
    spawn(
        4,
        check_layouts,
        [
            {"pp": 2, "dp_shard": 2},
            {"dp_replicate": 2, "ep": 2, "dp_shard": 1},
            {"cp": 2, "ep": 2, "dp_shard": 1},
            {"pp": 2, "cp": 2, "dp_shard": 1},
            {"pp": 2, "ep": 2, "dp_shard": 1, "pp_schedule": "GPipe"},
        ],
        {},
        "flint",
    )


def check_large4_layouts(layouts: list[dict]) -> None:
    """Large 4 (two producers of one KV slot, sparse selection) in each layout against one process;
    layouts[1] is layouts[0] with full activation checkpointing: its gradients are bit-identical."""
    grads = check_layouts(layouts, {}, "large4")
    assert layouts[1] == {**layouts[0], "activation_checkpointing": "full"}
    for name, grad in grads[0].items():
        assert (grad is None and grads[1][name] is None) or torch.equal(grad, grads[1][name]), (
            f"AC changed {name}"
        )


@pytest.mark.slow
@only("large4")
def test_large4_layouts_match_single_process():
    """FSDP, FSDP with full activation checkpointing (bit-exact), expert parallel, a pipeline of 2
    stages (1F1B; see tests/test_large4.py's test_pipeline_stage_boundaries for what crosses), and
    context parallel (the documents cross the cp chunks of 4 tokens; latents and indexer keys are
    gathered)."""
    spawn(
        2,
        check_large4_layouts,
        [
            {"dp_shard": 2},
            {"dp_shard": 2, "activation_checkpointing": "full"},
            {"ep": 2, "dp_shard": 1},
            {"pp": 2, "dp_shard": 1},
            {"cp": 2, "dp_shard": 1},
        ],
    )


def flex_layouts(layouts: list[dict], overrides: dict) -> None:
    """check_layouts for Large 4 with the flex backend, whose backward the CPU refuses by a device
    check only (lifted here, as tests/test_large4.py does), in the single process too."""
    import torch.nn.attention.flex_attention as flex_module

    flex_module._validate_device = lambda *tensors: None
    check_layouts(layouts, {"attention_backend": "flex", **overrides}, "large4")


@slow
@only("large4")
def test_large4_context_parallel_variants_match_single_process():
    """Context parallel with full checkpointing; dense (index_topk = SEQ); with the flex backend
    (selection bitmaps of this rank's queries; the document mask of its positions), and a flex
    pipeline."""
    spawn(
        2,
        check_layouts,
        [{"cp": 2, "dp_shard": 1, "activation_checkpointing": "full"}],
        {},
        "large4",
    )
    spawn(2, check_layouts, [{"cp": 2, "dp_shard": 1}], {"index_topk": SEQ}, "large4")
    spawn(2, flex_layouts, [{"cp": 2, "dp_shard": 1}, {"pp": 2, "dp_shard": 1}], {})
    spawn(2, flex_layouts, [{"cp": 2, "dp_shard": 1}], {"index_topk": SEQ})


@slow
@only("large4")
def test_large4_pipeline_schedules_match_single_process():
    """Interleaved1F1B (2 stages of 2 layers per rank) and GPipe, with sparse (SEQ > index_topk)
    and dense (index_topk = SEQ: the empty selection crosses) attention, and 1F1B with full
    activation checkpointing."""
    spawn(
        2,
        check_layouts,
        [{"pp": 2, "dp_shard": 1, "pp_schedule": s} for s in ("Interleaved1F1B", "GPipe")]
        + [{"pp": 2, "dp_shard": 1, "activation_checkpointing": "full"}],
        {},
        "large4",
    )
    spawn(
        2,
        check_layouts,
        [{"pp": 2, "dp_shard": 1, "pp_schedule": s} for s in ("1F1B", "Interleaved1F1B")],
        {"index_topk": SEQ},
        "large4",
    )


@slow
@only("large4")
def test_large4_layouts_four_processes():
    """HSDP (replicate 2 x shard 2), FSDP 2 x EP 2 with selective checkpointing, PP 2 x FSDP 2,
    PP 2 x CP 2 (1F1B and Interleaved1F1B: gathered latents cross stage boundaries), CP 2 x EP 2."""
    spawn(
        4,
        check_layouts,
        [
            {"dp_replicate": 2, "dp_shard": 2},
            {"dp_shard": 2, "ep": 2, "activation_checkpointing": "selective"},
            {"pp": 2, "dp_shard": 2},
            {"pp": 2, "cp": 2, "dp_shard": 1},
            {"pp": 2, "cp": 2, "dp_shard": 1, "pp_schedule": "Interleaved1F1B"},
            {"cp": 2, "ep": 2, "dp_shard": 1},
        ],
        {},
        "large4",
    )


def test_pipeline_and_context_parallel_need_a_forward_that_serves_them():
    """Every family's forward serves them (parallel_dims); a model whose forward does not is refused
    before any work, with the key named. No class is ever swapped: the forward that trains is the
    one a reader reads."""
    from parallel import unsupported_layout

    for name in FAMILIES:
        assert unsupported_layout(ParallelConfig(pp=2, cp=2), family(name).model) is None, name

    class Plain(torch.nn.Module):
        """A model that declares no parallel_dims."""

    assert str(unsupported_layout(ParallelConfig(pp=2), Plain)) == (
        "[parallel] pp = 2: pipeline parallelism is not implemented for Plain; use pp = 1"
    )
    assert str(unsupported_layout(ParallelConfig(cp=2), Plain)).startswith(
        "[parallel] cp = 2: context"
    )


def dtypes_in_use(pm, batch) -> dict[str, set]:
    """Forward and backward on `batch`, recording what each kind of module computes with.

    Weights and inputs are read in forward pre-hooks, which run after FSDP's own pre-hook has
    gathered the weights in their policy's dtype: after forward FSDP reshards them to the FP32
    master shards, so a forward (post) hook would see FP32 whatever the policy."""
    from flint_model import DecoderLayer, Sinks
    from head import Head
    from moe import Router

    kinds = {Sinks: "sinks", Router: "router", Head: "head", torch.nn.Linear: "linear"}
    seen: dict[str, set] = {}

    def record(kind):
        def hook(module, args):
            inputs = tuple(a.dtype for a in args if torch.is_tensor(a) and a.is_floating_point())
            seen.setdefault(kind, set()).add((module.weight.dtype, inputs))

        return hook

    def record_block(module, args):  # the residual stream and the RoPE tables it receives
        seen.setdefault("block", set()).add((args[0].dtype, args[1][0].dtype))

    for module in pm.module.modules():
        kind = next((k for cls, k in kinds.items() if isinstance(module, cls)), None)
        if kind is not None:
            module.register_forward_pre_hook(record(kind))
        if isinstance(module, DecoderLayer):
            module.register_forward_pre_hook(record_block)
    pm.forward_backward(*batch)
    return seen


def check_fp32_units_under_bf16(layout: dict) -> None:
    """With a BF16 bulk policy Flint's sinks, routers and head are gathered and computed in FP32."""
    config = tiny_config("flint")
    cfg = ParallelConfig.from_dict(layout)
    mesh = build_mesh(cfg, "cpu", config.num_experts)
    pm = parallelize(build(config), cfg, mesh)
    seen = dtypes_in_use(pm, rows_of_this_rank(mesh, make_batch()))
    f32, bf16 = torch.float32, torch.bfloat16
    expected = {
        "sinks": {(f32, (bf16, bf16, bf16))},  # FP32 sinks; q, k, v in BF16
        "router": {(f32, (bf16,))},  # FP32 weights; it casts its input itself
        "head": {(f32, (f32,))},
        "linear": {(bf16, (bf16,))},
    }  # the bulk runs in BF16
    wrong = {kind: seen[kind] for kind, dtypes in expected.items() if seen[kind] != dtypes}
    assert not wrong, f"(weight, inputs) dtypes at use differ from {expected}: {wrong}"
    for param in pm.module.parameters():  # FP32 master weights and gradients everywhere
        assert param.dtype == f32 and param.grad.dtype == f32


@only("flint")
def test_fp32_units_under_bf16_policy():
    spawn(2, check_fp32_units_under_bf16, {"dp_shard": 2, "param_dtype": "bfloat16"})


def shard_with_the_bulk_policy(unit: str, monkeypatch) -> None:
    """Make parallel.py shard the FP32 unit holding a module of class `unit` with a BF16 policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import parallel

    real_fully_shard = parallel.fully_shard

    def bulk_for_unit(module, **kwargs):
        if any(
            type(m).__name__ == unit for m in (module if isinstance(module, list) else [module])
        ):
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        return real_fully_shard(module, **kwargs)

    monkeypatch.setattr(parallel, "fully_shard", bulk_for_unit)


@only("flint")
@pytest.mark.parametrize("unit", ["Sinks", "Router"])
def test_fp32_unit_check_fails_when_a_unit_gets_the_bulk_policy(unit, monkeypatch):
    """The Flint check above can fail: shard one kind of FP32 unit with the bulk policy instead."""
    shard_with_the_bulk_policy(unit, monkeypatch)
    with pytest.raises(AssertionError, match=f"dtypes at use differ .*'{unit.lower()}': "):
        in_process_group(check_fp32_units_under_bf16, {"param_dtype": "bfloat16"})


@pytest.mark.slow
@only("flint")
def test_fp32_residual_stream_under_bf16_policy():
    """residual_dtype = "float32" under the BF16 bulk policy: every block receives the residual
    stream in FP32 (the policy casts no block inputs), and the RoPE tables stay FP32 either way."""
    f32, bf16 = torch.float32, torch.bfloat16

    def residual_dtypes(residual_dtype):
        config, cfg = (
            tiny_config("flint", residual_dtype=residual_dtype),
            ParallelConfig(param_dtype="bfloat16"),
        )
        pm = parallelize(build(config), cfg, build_mesh(cfg, "cpu", config.num_experts))
        return dtypes_in_use(pm, make_batch())["block"]

    assert in_process_group(residual_dtypes, "float32") == {(f32, f32)}
    assert in_process_group(residual_dtypes, None) == {(bf16, f32)}


@only("flint")
def test_a_bf16_step_raises_no_fsdp_warning():
    """FSDP2 warns when a unit's forward returns a view (an in-place op on it would skip the unit's
    backward all-gather). A dense block's FP32 unit, Sinks alone, returned banded attention's
    output, a view, until the block's hooks gathered it (parallel.gather_with_block): its own
    hooks, which warned, no longer run."""
    import warnings

    def fsdp_warnings() -> list[str]:
        # Layer 1 is dense and sliding; 20 tokens > 2 x (window 9 - 1) take the banded path.
        config = tiny_config(
            "flint",
            layer_types=[
                "full_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ],
        )
        cfg = ParallelConfig(param_dtype="bfloat16")
        pm = parallelize(build(config), cfg, build_mesh(cfg, "cpu", config.num_experts))
        ids = torch.randint(
            0, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0)
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pm.forward_backward(ids, ids.roll(-1, 1))
        return [str(w.message) for w in caught if "FSDP2" in str(w.message)]

    assert in_process_group(fsdp_warnings) == []


def weight_dtypes_at_use(family: str, layout: dict) -> dict[str, set]:
    """Forward and backward under `layout`, recording the dtypes of each module's own parameters
    when the module is called -> {module name: dtypes}; the master weights and gradients stay FP32.

    Forward pre-hooks run after FSDP's pre-hooks (registered earlier) have gathered the weights in
    their policy's dtype; after forward FSDP reshards to the FP32 master shards, so a later look
    would see FP32 whatever the policy."""
    config = tiny_config(family)
    cfg = ParallelConfig.from_dict(layout)
    mesh = build_mesh(cfg, "cpu", config.num_experts)
    pm = parallelize(build(config), cfg, mesh)
    seen: dict[str, set] = {}

    def record(name):
        def hook(module, args):
            seen.setdefault(name, set()).update(p.dtype for p in module.parameters(recurse=False))

        return hook

    owners = [
        (n, m)
        for n, m in pm.module.named_modules()
        if any(True for _ in m.parameters(recurse=False))
    ]
    for name, module in owners:
        module.register_forward_pre_hook(record(name))
    pm.forward_backward(*rows_of_this_rank(mesh, make_batch(vocab=min(256, config.vocab_size))))
    assert sorted(seen) == sorted(n for n, _ in owners), "a module with parameters was never called"
    for param in pm.module.parameters():
        assert param.dtype == torch.float32 and (
            param.grad is None or param.grad.dtype == torch.float32
        )
    return seen


def check_large4_fp32_units(layout: dict) -> None:
    """Under a BF16 bulk policy, Large 4's routers, indexer weights_proj and k_norm, LeRoPE alpha
    (the rotary) and head are FP32 when used (LARGE4.md's precision table), every other weight (the
    frozen indexer's too) BF16."""
    seen = weight_dtypes_at_use("large4", layout)
    fp32 = {
        n: d
        for n, d in seen.items()
        if n.endswith(("router", "weights_proj", "k_norm", "rotary", "lm_head"))
    }
    bulk = {n: d for n, d in seen.items() if n not in fp32}
    assert {n.rpartition(".")[2] for n in fp32} == {
        "router",
        "weights_proj",
        "k_norm",
        "rotary",
        "lm_head",
    }
    assert any(".indexer.wq_b" in n for n in bulk) and any(".experts" in n for n in bulk)
    assert all(dtypes == {torch.float32} for dtypes in fp32.values()), f"fp32: {fp32}"
    assert all(dtypes == {torch.bfloat16} for dtypes in bulk.values()), f"bulk: {bulk}"


@only("large4")
def test_large4_fp32_units_under_bf16_policy():
    in_process_group(check_large4_fp32_units, {"param_dtype": "bfloat16"})


@only("large4")
@pytest.mark.parametrize("unit", ["Router", "FP32LayerNorm", "LeRoPE", "Head"])
def test_large4_fp32_unit_check_fails_under_the_bulk_policy(unit, monkeypatch):
    """The check above can fail: the FP32 unit holding a `unit` module is sharded with the bulk
    policy."""
    shard_with_the_bulk_policy(unit, monkeypatch)
    with pytest.raises(AssertionError, match="^fp32: "):
        in_process_group(check_large4_fp32_units, {"param_dtype": "bfloat16"})


@only("large4")
@pytest.mark.parametrize("unit", ["router", "weights_proj", "k_norm", "rotary"])
def test_large4_fp32_unit_check_fails_when_a_unit_is_not_declared(unit, monkeypatch):
    """... and fails when the model leaves `unit` out of its FP32 modules (it joins a bulk unit)."""
    from large4 import MistralLarge4

    declared_blocks, declared_root = MistralLarge4.fp32_modules, MistralLarge4.fp32_root_modules

    def without(declared):
        def fp32_modules(self, *args):
            left_out = {id(m) for name, m in self.named_modules() if name.endswith(unit)}
            return [m for m in declared(self, *args) if id(m) not in left_out]

        return fp32_modules

    monkeypatch.setattr(MistralLarge4, "fp32_modules", without(declared_blocks))
    monkeypatch.setattr(MistralLarge4, "fp32_root_modules", without(declared_root))
    with pytest.raises(AssertionError, match="^fp32: "):
        in_process_group(check_large4_fp32_units, {"param_dtype": "bfloat16"})


# ------------------------------------------------------------ initialisation without the full model


def meta_built(config, layout: dict, seed: int):
    """What train.py does: build on meta, parallelize, then materialise this rank's shards."""
    cfg = ParallelConfig.from_dict({"param_dtype": "float32", **layout})
    mesh = build_mesh(cfg, "cpu", config.num_experts)
    with torch.device("meta"):
        model = model_class(config)(config)
    pm = parallelize(model, cfg, mesh)
    init_weights(pm, torch.device("cpu"), seed)
    return pm, mesh


def check_meta_init(layouts: list[dict], family: str) -> None:
    """Every parameter, gathered, equals the single-process build_model init bit for bit; under
    pp the stages' parameters together are all of them. vocab 263 shards unevenly (FSDP pads)."""
    config = tiny_config(family, vocab_size=263)
    expected = build(config, seed=5, plain=True).state_dict()
    for layout in layouts:
        pm, mesh = meta_built(config, layout, seed=5)
        names = [n for n, _ in pm.module.named_parameters()]
        for name, param in pm.module.named_parameters():
            # sharded on dim 0, or on dim 1 where dim 0 is shorter than the shards
            if isinstance(param, DTensor):
                dim = param.placements[-1].dim
                assert param.to_local().shape[dim] < param.shape[dim], (
                    f"{layout}: {name} is not sharded"
                )
            assert torch.equal(full(param), expected[name]), (
                f"{layout}: {name} differs from one process"
            )
        everyone = [None] * mesh["pp"].size()
        dist.all_gather_object(everyone, names, group=mesh["pp"].get_group())
        assert sorted(sum(everyone, [])) == sorted(expected), layout
        assert all(not b.is_meta and not b.any() for b in pm.module.buffers())


@pytest.mark.slow
@only("flint")
def test_meta_init_matches_one_process():
    """A group of one (no sharding), then FSDP 2, EP 2 and PP 2."""
    from parallel import init_distributed

    init_distributed("gloo")
    try:
        check_meta_init([{}], "flint")
    finally:
        close_distributed()
    spawn(
        2,
        check_meta_init,
        [{"dp_shard": 2}, {"ep": 2, "dp_shard": 1}, {"pp": 2, "dp_shard": 1}],
        "flint",
    )


@only("large4")
def test_large4_meta_init_matches_one_process():
    """Large 4 built on meta in a group of one (HSDP and FSDP x EP: the slow checkpoint test; PP 2:
    the slow test below)."""
    in_process_group(check_meta_init, [{}], "large4")


@slow
@only("large4")
def test_large4_pipeline_meta_init_matches_one_process():
    """PP 2 (alpha and the embedding on the first stage only) and PP 2 x 2 stages per rank."""
    spawn(
        2,
        check_meta_init,
        [{"pp": 2, "dp_shard": 1}, {"pp": 2, "dp_shard": 1, "pp_schedule": "Interleaved1F1B"}],
        "large4",
    )


# -------------------------------------------------------------------------- the optimizer on shards


def check_optimizer_on_shards(layouts: list[dict]) -> None:
    config = tiny_config("flint")  # a model without frozen parameters, which plain AdamW would step
    for layout in layouts:
        cfg = ParallelConfig.from_dict({"param_dtype": "float32", **layout})
        pm = parallelize(build(config), cfg, build_mesh(cfg, "cpu", config.num_experts))
        assert all(p.dtype == torch.float32 for p in pm.module.parameters()), layout
        assert all(isinstance(p, DTensor) for p in pm.module.parameters()), layout
        adamw_matches_plain(pm.module, build(config))


@only("flint")
def test_the_optimizer_steps_like_plain_adamw_on_shards():
    """train.build_optimizer's fused AdamW on FSDP DTensors (FP32 master weights of a BF16 policy,
    in a group of one) gives the weights of a plain AdamW on plain tensors."""
    in_process_group(check_optimizer_on_shards, [{"param_dtype": "bfloat16"}])


@slow
@only("flint")
def test_the_optimizer_steps_like_plain_adamw_on_two_ranks():
    """... and on FSDP and expert-parallel shards of two ranks (Shard and _StridedShard)."""
    spawn(2, check_optimizer_on_shards, [{"dp_shard": 2}, {"ep": 2, "dp_shard": 1}])


# ----------------------------------------------------------------------- checkpoints across layouts


def save_training_state(pm, optimizer, path: str) -> None:
    """Model and optimizer state as DCP, each rank writing its shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    dcp.save(
        {
            "model": get_model_state_dict(pm.module),
            "optimizer": get_optimizer_state_dict(pm.module, optimizer),
        },
        checkpoint_id=path,
    )


def load_training_state(pm, optimizer, path: str) -> None:
    """save_training_state's checkpoint into this layout's model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {
        "model": get_model_state_dict(pm.module),
        "optimizer": get_optimizer_state_dict(pm.module, optimizer),
    }
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(pm.module, state["model"])
    set_optimizer_state_dict(pm.module, optimizer, state["optimizer"])


def check_checkpoint_across_layouts(path: str, family: str) -> None:
    """FSDP 2 x EP 2 matches one process, saves after one step; FSDP 4 loads it (model and
    optimizer) and its next steps track the single-process losses. Models built on meta."""
    check_layouts([{"dp_shard": 2, "ep": 2}], {}, family)
    # 2-D expert and HSDP placements
    check_meta_init([{"dp_shard": 2, "ep": 2}, {"dp_replicate": 2, "dp_shard": 2}], family)
    config = tiny_config(family, **PLAIN_INIT_OVERRIDES[family])
    batch = make_batch(vocab=min(256, config.vocab_size))
    ref_losses, _, _ = reference_run(config, batch, plain=True)

    def layout(parallel: dict, seed: int):
        pm, mesh = meta_built(config, parallel, seed)
        return (
            pm,
            torch.optim.AdamW(pm.module.parameters(), lr=LR, foreach=False),
            rows_of_this_rank(mesh, batch),
        )

    def step(pm, optimizer, local):
        loss = pm.forward_backward(*local)
        pm.clip_grad_norm_(MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    pm, optimizer, local = layout({"dp_shard": 2, "ep": 2}, seed=0)
    step(pm, optimizer, local)
    save_training_state(pm, optimizer, path)
    pm, optimizer, local = layout({"dp_shard": 4}, seed=1)  # different weights until loaded
    load_training_state(pm, optimizer, path)
    for index in range(1, STEPS):
        close(
            step(pm, optimizer, local), ref_losses[index], f"resumed with FSDP 4, step {index} loss"
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "family",
    [name if name == FAMILY_NAMES[0] else pytest.param(name, marks=slow) for name in FAMILY_NAMES],
)
def test_checkpoint_resumes_across_layouts(tmp_path, family):
    """The first family in the suite, the others with FLINT_SLOW=1 (4 processes, about a minute
    each)."""
    spawn(4, check_checkpoint_across_layouts, str(tmp_path / "ckpt"), family)
    check_single_process_load(str(tmp_path / "ckpt"), family)


def check_pipeline_checkpoint(path: str, family: str) -> None:
    """PP 2 (meta build, one clipped AdamW step) saves model and optimizer, each pp rank its stage's
    share (alpha from the first); CP 2 loads it and its next steps track the single-process
    losses."""
    config = tiny_config(family, **PLAIN_INIT_OVERRIDES[family])
    batch = make_batch(vocab=min(256, config.vocab_size))
    ref_losses, _, _ = reference_run(config, batch, plain=True)
    for index, (layout, seed) in enumerate(
        [({"pp": 2, "dp_shard": 1}, 0), ({"cp": 2, "dp_shard": 1}, 1)]
    ):
        pm, mesh = meta_built(config, layout, seed)
        optimizer = torch.optim.AdamW(pm.module.parameters(), lr=LR, foreach=False)
        # different weights until loaded (the optimizer state dict's lazy init steps)
        if index == 1:
            load_training_state(pm, optimizer, path)
        for step in range(index, STEPS if index else 1):
            loss = pm.forward_backward(*rows_of_this_rank(mesh, batch))
            pm.clip_grad_norm_(MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
            close(loss, ref_losses[step], f"{layout} step {step} loss")
        if index == 0:
            save_training_state(pm, optimizer, path)


@slow
@only("large4")
def test_large4_pipeline_checkpoint_resumes_in_context_parallel_and_one_process(tmp_path):
    spawn(2, check_pipeline_checkpoint, str(tmp_path / "ckpt"), "large4")
    check_single_process_load(str(tmp_path / "ckpt"), "large4")


def check_single_process_load(path: str, family: str) -> None:
    """A single process without a process group reads the checkpoint of one step from the plain
    init, as convert.py and sample.py do."""
    from checkpoint_files import load_dcp

    config = tiny_config(family, **PLAIN_INIT_OVERRIDES[family])
    batch = make_batch(vocab=min(256, config.vocab_size))
    expected = build(config, plain=True)
    optimizer = torch.optim.AdamW(expected.parameters(), lr=LR, foreach=False)
    expected(*batch).backward()
    torch.nn.utils.clip_grad_norm_(expected.parameters(), MAX_NORM)
    optimizer.step()
    model = build(config, seed=1, plain=True)
    state = {"model": model.state_dict()}
    load_dcp(state, Path(path))
    model.load_state_dict(state["model"])
    # Adam's first step is about lr * sign(grad): where a gradient is near zero, its last-bit
    # differences move the update, so compare to 1% of a step (a misplaced shard is off by ~0.02).
    for name, param in model.state_dict().items():
        torch.testing.assert_close(
            param,
            expected.state_dict()[name],
            rtol=0,
            atol=LR * 1e-2,
            msg=lambda m: f"single-process load of {name}: {m}",
        )


# ----------------------------------------------------------------------------- memory table

# ----------------------------------------------------------------------------- compile


def compiled_and_eager(layout: dict, batch) -> list[tuple]:
    """parallelize's eager, then compiled, blocks (torch.compile as the caller set it) in this
    process group -> [(loss, full gradients by name, graph breaks)] for each."""
    config = tiny_config("flint", num_hidden_layers=2, mlp_only_layers=[0])  # dense, MoE
    results = []
    for compile in (False, True):
        cfg = ParallelConfig.from_dict({**layout, "compile": compile})
        pm = parallelize(build(config), cfg, build_mesh(cfg, "cpu", config.num_experts))
        torch._dynamo.utils.counters.clear()
        loss = pm.forward_backward(*rows_of_this_rank(pm.mesh, batch))
        counters = torch._dynamo.utils.counters
        compiled = [is_compiled(layer) for layer in pm.module.layers.values()]
        assert compiled == [compile] * 2 and bool(counters["stats"]["unique_graphs"]) == compile
        assert is_compiled(pm.module.lm_head) == compile
        results.append(
            (
                loss,
                {n: full(p.grad) for n, p in pm.module.named_parameters()},
                sum(counters["graph_break"].values()),
            )
        )
    return results


def is_compiled(module: torch.nn.Module) -> bool:
    """parallel.apply_compile compiled this module's forward."""
    return hasattr(module.forward, "_torchdynamo_orig_callable")


def assert_compiled_matches_eager(results, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    (eager_loss, eager_grads, *_), (compiled_loss, compiled_grads, *_) = results
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=rtol, atol=atol)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(
            compiled_grads[name],
            grad,
            rtol=rtol,
            atol=atol,
            msg=lambda m: f"compiled grad {name}: {m}",
        )


@pytest.mark.slow
@only("flint")
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=slow)])
def test_compiled_blocks_match_eager(backend, monkeypatch):
    """parallelize's compile path (one process in a group of one, FP32): the loss and every gradient
    equal those of the eager blocks. Dynamo and AOT autograd (aot_eager, 3 s) run in the suite;
    inductor's code generation (about 45 s on 2 cores with a cold cache) with FLINT_SLOW=1."""
    from functools import partial

    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend=backend))
    results = in_process_group(compiled_and_eager, {}, make_batch())
    assert results[1][2] == 0
    assert_compiled_matches_eager(results)


def check_compiled_fp32_fsdp_is_whole() -> None:
    from functools import partial

    torch.compile = partial(torch.compile, backend="aot_eager")  # this spawned process only
    results = compiled_and_eager({"dp_shard": 2}, make_batch())  # fullgraph: a break would raise
    assert results[1][2] == 0
    assert_compiled_matches_eager(results)


@slow
@only("flint")
def test_compiled_blocks_under_fp32_fsdp_are_whole():
    """FSDP over 2 processes in FP32 has no nested FP32 units: each block compiles to one graph
    (fullgraph=True) and matches the eager blocks."""
    spawn(2, check_compiled_fp32_fsdp_is_whole)


def gradients_after_an_evaluation(evaluate: bool) -> dict[str, torch.Tensor]:
    """A BF16 FSDP model (a group of one): a step, optionally an evaluation, then the gradients of
    the next batch's forward and backward."""
    config = tiny_config("flint", num_hidden_layers=2, mlp_only_layers=[0])
    cfg = ParallelConfig(param_dtype="bfloat16")
    pm = parallelize(build(config), cfg, build_mesh(cfg, "cpu", config.num_experts))
    pm.forward_backward(*make_batch(0))
    if evaluate:
        pm.loss(*make_batch(0))
    pm.module.zero_grad(set_to_none=True)
    pm.forward_backward(*make_batch(1))
    return {name: full(param.grad) for name, param in pm.module.named_parameters()}


@pytest.mark.slow
@only("flint")
def test_an_evaluation_leaves_the_next_gradients_alone():
    """The head's FSDP unit stays gathered after forward (reshard_after_forward=False); after a
    forward under no_grad, FSDP2 once doubled its gradient in the next backward (train.py evaluates
    every eval_every steps, and check_compiled before step 1)."""
    expected = in_process_group(gradients_after_an_evaluation, False)
    for name, grad in in_process_group(gradients_after_an_evaluation, True).items():
        torch.testing.assert_close(
            grad, expected[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}"
        )


def test_cp_token_index_balances_causal_work():
    """Which positions each cp rank computes (the gather itself runs in every context-parallel
    layout above)."""
    chunks = [cp_token_index(16, 2, r, "cpu").tolist() for r in range(2)]
    assert chunks == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    assert sum(chunks, []) != list(range(16)) and sorted(sum(chunks, [])) == list(range(16))


# ----------------------------------------------------------------- evaluation under the V schedules


def check_evaluation_between_steps(layouts: list[dict]) -> None:
    """For each layout: an evaluation (ParallelModel.loss) before the first step, a step, another
    evaluation: the losses of one process, and the step's gradients unchanged by the evaluation
    before it."""
    config = tiny_config()
    batch = make_batch(vocab=min(256, config.vocab_size))
    reference = build(config)
    ref_loss = reference(*batch)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    for layout in layouts:
        cfg = ParallelConfig.from_dict({"param_dtype": "float32", **layout})
        mesh = build_mesh(cfg, "cpu", config.num_experts)
        pm = parallelize(build(config), cfg, mesh)
        local = rows_of_this_rank(mesh, batch)
        close(pm.loss(*local), ref_loss.detach(), f"{layout} evaluation before training")
        close(pm.forward_backward(*local), ref_loss.detach(), f"{layout} training loss")
        for name, param in pm.module.named_parameters():
            if param.requires_grad:  # not Large 4's frozen indexer
                close(
                    full(param.grad), ref_grads[name], f"{layout} grad {name} after an evaluation"
                )
        close(pm.loss(*local), ref_loss.detach(), f"{layout} evaluation after training")


@pytest.mark.slow
def test_zero_bubble_pipelines_evaluate_like_one_process():
    """torch's eval of a V schedule failed at the turn of the V ("can't steal_bwd_input"), so a run
    under ZBVZeroBubble or DualPipeV crashed at its final evaluation, before its final checkpoint;
    pipeline.ForwardOnlyEvaluation runs forwards only. GPipe as the plain pipeline beside them."""
    spawn(
        2,
        check_evaluation_between_steps,
        [
            {"pp": 2, "dp_shard": 1, "pp_schedule": s}
            for s in ("ZBVZeroBubble", "DualPipeV", "GPipe")
        ],
    )


def test_least_padding_splits_dim_1_only_where_it_divides_and_decides_from_the_local_shape():
    """FSDP2 refuses an uneven split of any dim but 0 ("uneven sharding on dim 1": Flint's [512,
    2048] k_proj on 768 ranks), so a parameter shorter than the shards splits dim 1 only where that
    divides; and an expert-parallel rank's experts are split by FSDP as it holds them (its local
    shape), not as all ranks do."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from parallel import least_padding
    from tools.rehearsal import fake_world

    placement = least_padding(4)
    assert placement(torch.nn.Parameter(torch.empty(2, 8, 16, device="meta"))) == Shard(1)
    # 6 rows over 4: pad dim 0
    assert placement(torch.nn.Parameter(torch.empty(2, 6, 16, device="meta"))) is None
    assert least_padding(768)(torch.nn.Parameter(torch.empty(512, 2048, device="meta"))) is None
    assert least_padding(768)(torch.nn.Parameter(torch.empty(256, 3072, device="meta"))) == Shard(1)
    with fake_world(4, 0):
        ep_mesh = init_device_mesh("cpu", (4,))
        # 4 experts, one on this rank
        experts = DTensor.from_local(torch.empty(1, 8, 16), ep_mesh, [Shard(0)])
        assert experts.shape == (4, 8, 16)
        assert least_padding(2)(torch.nn.Parameter(experts)) == Shard(1)


def sharded_matmul_mesh():
    """A weak reference to the mesh of a DTensor matmul, run and let go of: only torch's caches can
    hold it."""
    import weakref

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    x = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    (x @ x.T).redistribute(mesh, [Shard(1)]).full_tensor()
    return weakref.ref(mesh)


def test_close_distributed_lets_go_of_every_mesh():
    """DTensor's sharding caches (in Python and C++) keep each mesh they saw, and a mesh its process
    groups, whose gloo threads then outlive the run (see close_distributed). After close_distributed
    no mesh is left alive, though the caches saw one; the thread test alone passed without the
    clearing."""
    mesh = in_process_group(sharded_matmul_mesh)
    assert mesh() is None


def head_precision_of(layout: dict) -> list[str]:
    config = tiny_config()
    cfg = ParallelConfig.from_dict({"param_dtype": "float32", **layout})
    pm = parallelize(build(config), cfg, build_mesh(cfg, "cpu", config.num_experts))
    return [part.lm_head.precision for part in pm.parts if part.lm_head is not None]


def test_the_head_takes_its_precision_from_head_precision():
    """[parallel] head_precision reaches the head that parallelize lays out (it acts on GPUs only,
    so no CPU number can show it: test_head checks the CPU's head stays FP32 whatever it says)."""
    for precision in ("bf16x3", "bf16"):
        assert in_process_group(head_precision_of, {"head_precision": precision}) == [precision]
