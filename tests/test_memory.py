"""tools/memory.py: the per-GPU memory table counts sharded state as a person would by hand."""

import subprocess
import sys

import pytest
import torch

import tools.memory as memory
from config import ConfigError
from helpers import (
    ROOT,
    build,
    in_process_group,
    moe_layers,
    only,
    stops_with_one_line,
    tiny_config,
)
from parallel import ParallelConfig, build_mesh, parallelize
from tools.memory import GIB, memory_per_gpu, memory_table

# Counted by hand for Flint (no frozen parameters) and its configs; Large 4's below.
FLINT, LARGE4 = only("flint"), only("large4")


@FLINT
def test_memory_table_counts_sharded_state_by_hand():
    config = tiny_config("flint")
    total = build(config).num_params()
    row = memory_per_gpu(
        config, ParallelConfig(dp_shard=2, ep=2).resolve(4, 8), seq_len=16, batch_size=2
    )
    # every parameter is split 4 ways: experts over ep x dp_shard, the rest over dp_shard x ep
    assert (
        abs(row["params"] * GIB - 4 * total / 4) < 1
        and abs(row["optimizer"] * GIB - 8 * total / 4) < 1
    )
    full_ac = memory_per_gpu(
        config, ParallelConfig(dp_shard=4, activation_checkpointing="full").resolve(4), 16, 2
    )
    no_ac = memory_per_gpu(config, ParallelConfig(dp_shard=4).resolve(4), 16, 2)
    assert full_ac["activations"] < no_ac["activations"]
    assert "| mine: dp_shard=2 ep=2 ac=none |" in memory_table(
        config, [("mine", ParallelConfig(dp_shard=2, ep=2))], 16, 2
    )


@FLINT
def test_experts_states_are_sharded_over_ep_dp_shard_and_cp():
    """4 GPUs as ep 2 x cp 2 (dp_shard 1): the routed experts split over ep and FSDP-sharded over
    dp_shard x cp (parallel.build_mesh's efsdp), the rest over dp_shard x ep x cp: every trainable
    parameter's FP32 weight, gradient and two moments 4 ways."""
    config = tiny_config("flint")
    total = build(config).num_params()
    row = memory_per_gpu(
        config, ParallelConfig(ep=2, cp=2, dp_shard=1).resolve(4, 8), seq_len=16, batch_size=2
    )
    assert row["params"] * GIB == pytest.approx(4 * total / 4) and row[
        "grads"
    ] * GIB == pytest.approx(4 * total / 4)
    assert row["optimizer"] * GIB == pytest.approx(8 * total / 4)


def test_microbatches_each_schedule_holds_in_flight():
    """At a stage's peak: GPipe all of a call's micro-batches (pp_microbatches x grad_accum /
    calls), 1F1B, Interleaved1F1B and ZBVZeroBubble pp, DualPipeV pp + 1; no pipeline, one."""

    def held(schedule, pp=4, stages=0, microbatches=8, grad_accum=2, calls=1):
        cfg = ParallelConfig(
            pp=pp, pp_schedule=schedule, pp_stages_per_rank=stages, pp_microbatches=microbatches
        )
        return memory.microbatches_in_flight(cfg, grad_accum, calls)

    assert held("GPipe") == 16 and held("GPipe", calls=2) == 8
    assert (
        held("1F1B") == 4
        and held("Interleaved1F1B", stages=2) == 4
        and held("ZBVZeroBubble", stages=2) == 4
    )
    assert held("DualPipeV", stages=2) == 5 and held("DualPipeV", pp=2, stages=2) == 3
    assert memory.microbatches_in_flight(ParallelConfig(), 4) == 1


@FLINT
def test_dualpipev_activations_by_hand():
    """pp 2 under DualPipeV (2 stages per rank, 4 micro-batches of one row each): the busiest rank
    holds pp + 1 = 3 micro-batches' activations of its half of the blocks, no checkpointing, plus
    two FP32 chunks of logits and the unsharded FP32 head gradient."""
    config = tiny_config("flint")
    layout = ParallelConfig(pp=2, dp_shard=2, pp_schedule="DualPipeV", pp_microbatches=4).resolve(4)
    row = memory_per_gpu(config, layout, seq_len=16, batch_size=4)
    tokens = 4 * 16 / 4  # one pipeline micro-batch
    blocks = config.num_hidden_layers // 2 * build(config).block_activation_bytes(16)
    logits = 2 * 4 * tokens * config.vocab_size + 4 * config.vocab_size * config.hidden_size
    assert row["activations"] * GIB == pytest.approx(3 * tokens * blocks + logits)


@FLINT
def test_lora_counts_the_frozen_base_without_gradients_or_optimizer_states():
    """Under [lora] the base keeps its FP32 weights, split 4 ways like everything else, and only the
    adapters have gradients and AdamW moments."""
    from lora import LoraConfig, apply_lora

    config = tiny_config("flint")
    lora = LoraConfig(rank=8, targets=["all"])
    model = build(config)
    base = model.num_params()
    apply_lora(model, lora)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    row = memory_per_gpu(config, ParallelConfig(dp_shard=4).resolve(4), 16, 2, lora=lora)
    assert row["params"] * GIB == pytest.approx(4 * (base + adapters) / 4, abs=1)
    assert row["grads"] * GIB == pytest.approx(4 * adapters / 4, abs=1)
    assert row["optimizer"] * GIB == pytest.approx(8 * adapters / 4, abs=1)


@FLINT
def test_offload_moves_the_sharded_states_to_host_memory():
    """[parallel] offload: weights, gradients and AdamW states (16 B per trainable parameter's
    shard) leave the GPU's total for `host`; what FSDP gathers and the activations stay."""
    config = tiny_config("flint")
    on_gpu = memory_per_gpu(config, ParallelConfig(dp_shard=4).resolve(4), 16, 2)
    offloaded = memory_per_gpu(config, ParallelConfig(dp_shard=4, offload=True).resolve(4), 16, 2)
    states = on_gpu["params"] + on_gpu["grads"] + on_gpu["optimizer"]
    assert offloaded["host"] == pytest.approx(states) and on_gpu["host"] == 0
    assert offloaded["total"] == pytest.approx(offloaded["gathered"] + offloaded["activations"])
    assert (offloaded["gathered"], offloaded["activations"]) == (
        on_gpu["gathered"],
        on_gpu["activations"],
    )


@FLINT
def test_activations_and_gradients_peak_together_only_under_accumulation_or_a_pipeline():
    """One micro-batch: the peak is at the head (activations, no block gradient yet) or at the end
    of the backward (every gradient, the last block's recompute), whichever is larger; otherwise
    their sum."""
    config = tiny_config("flint")
    layout = ParallelConfig(
        dp_shard=4, activation_checkpointing="full", accumulation="sync_each"
    ).resolve(4)
    one = memory_per_gpu(config, layout, 16, 2)
    accumulating = memory_per_gpu(config, layout, 16, 2, grad_accum=2)
    columns = ("params", "grads", "optimizer", "gathered", "activations")
    assert accumulating["held grads"] == 0 == one["held grads"]
    assert accumulating["total"] == pytest.approx(sum(accumulating[c] for c in columns))
    assert (
        one["params"] + one["optimizer"] + one["gathered"] + max(one["activations"], one["grads"])
        <= one["total"]
    )
    assert one["total"] < accumulating["total"]


@FLINT
def test_what_each_accumulation_holds_counted_by_hand():
    """Flint's tiny model (255,696 parameters, all trainable) on 4 FSDP ranks, 2 micro-batches:
    sync_last holds every unsharded FP32 gradient (4 B each) instead of the sharded ones through the
    step; gathered holds as well every weight gathered, in BF16 (2 B) but the head, the sinks and
    the routers (FP32 units, 4 B); with ep 2 a rank holds half of the experts. auto: gathered when
    both fit 25 % of the GPU, sync_last when the gradients do."""
    config = tiny_config("flint")
    total = 255_696
    experts = (
        len(moe_layers(config))
        * config.num_experts
        * 3
        * config.hidden_size
        * config.moe_intermediate_size
    )
    fp32 = (
        config.vocab_size * config.hidden_size
        + config.num_hidden_layers * config.num_attention_heads
        + len(moe_layers(config)) * config.num_experts * config.hidden_size
    )
    assert build(config).num_params() == total
    rows = {
        mode: memory_per_gpu(
            config, ParallelConfig(dp_shard=4, accumulation=mode).resolve(4), 16, 2, grad_accum=2
        )
        for mode in ("sync_each", "sync_last", "gathered")
    }
    each, last, gathered = rows["sync_each"], rows["sync_last"], rows["gathered"]
    assert (each["held grads"], last["held grads"], gathered["held grads"]) == (
        0,
        4 * total / GIB,
        4 * total / GIB,
    )
    assert (
        last["gathered"] == each["gathered"]
        and gathered["gathered"] * GIB == 2 * (total - fp32) + 4 * fp32
    )
    for row in rows.values():
        assert row["grads"] * GIB == pytest.approx(4 * total / 4)
    fixed = ("params", "optimizer", "activations")
    assert each["total"] == pytest.approx(sum(each[c] for c in (*fixed, "grads", "gathered")))
    # the sharded gradients come only as the last backward frees the unsharded ones
    for row in (last, gathered):
        assert row["total"] == pytest.approx(
            sum(row[c] for c in (*fixed, "held grads", "gathered"))
        )
    one = memory_per_gpu(
        config, ParallelConfig(dp_shard=4, accumulation="gathered").resolve(4), 16, 2
    )
    assert one == memory_per_gpu(
        config, ParallelConfig(dp_shard=4, accumulation="sync_each").resolve(4), 16, 2
    )
    assert one["held grads"] == 0  # one micro-batch: every mode is sync_each
    half = memory_per_gpu(
        config, ParallelConfig(dp_shard=2, ep=2, accumulation="sync_last").resolve(4, 8), 16, 2, 2
    )
    assert half["held grads"] * GIB == 4 * (total - experts / 2)
    gradients, weights = 4 * total, 2 * (total - fp32) + 4 * fp32
    auto = ParallelConfig(dp_shard=4).resolve(4)
    assert memory.accumulation_of(config, auto, 4 * (gradients + weights) / GIB) == "gathered"
    assert (
        memory.accumulation_of(config, auto, 4 * (gradients + weights) / GIB * 0.99) == "sync_last"
    )
    assert memory.accumulation_of(config, auto, 4 * gradients / GIB * 0.99) == "sync_each"
    assert (
        memory_per_gpu(config, auto, 16, 2, grad_accum=2, gpu_gib=4 * gradients / GIB)["held grads"]
        > 0
    )
    assert (
        memory_per_gpu(config, auto, 16, 2, grad_accum=2, gpu_gib=4 * gradients / GIB * 0.99)[
            "held grads"
        ]
        == 0
    )


@FLINT
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_a_pipeline_holds_its_stages_gradients_and_weights_through_each_call(schedule):
    """Under pp torch's stages hold their unsharded gradients, and (reshard_after_forward off) their
    gathered weights, through each schedule call, in every mode; sync_each calls it once per
    micro-batch, so the sharded gradients of the earlier calls are there too; sync_last calls it
    once for the step, which under GPipe holds the activations of twice the micro-batches
    (grad_accum 2)."""
    config = tiny_config("flint")
    rows = {
        mode: memory_per_gpu(
            config,
            ParallelConfig(pp=2, dp_shard=2, pp_schedule=schedule, accumulation=mode).resolve(4),
            16,
            2,
            grad_accum=2,
        )
        for mode in ("sync_each", "sync_last")
    }
    each, last = rows["sync_each"], rows["sync_last"]
    gradients, weights = memory.accumulation_bytes(
        config, ParallelConfig(pp=2, dp_shard=2).resolve(4)
    )
    for row in rows.values():
        assert (row["held grads"] * GIB, row["gathered"] * GIB) == (gradients, weights)
    columns = ("params", "optimizer", "held grads", "gathered", "activations")
    assert each["total"] == pytest.approx(sum(each[c] for c in (*columns, "grads")))
    assert last["total"] == pytest.approx(sum(last[c] for c in columns))
    assert (last["activations"] > each["activations"]) == (schedule == "GPipe")


@FLINT
def test_memory_counts_what_accumulation_holds_as_parallel_does():
    """tools/memory.py resolves "auto" from the bytes parallel.py's ParallelModel.accumulation_bytes
    counts on the FSDP units it made: the same bytes, for a one-rank BF16 layout."""
    config = tiny_config("flint")

    def counted():
        cfg = ParallelConfig(param_dtype="bfloat16")
        return parallelize(
            build(config), cfg, build_mesh(cfg, "cpu", config.num_experts)
        ).accumulation_bytes()

    assert in_process_group(counted) == memory.accumulation_bytes(
        config, ParallelConfig().resolve(1)
    )


@pytest.mark.slow
@FLINT
def test_command_prints_the_released_layouts_labelled(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    memory.main(["--config", "configs/flint-8gpu.toml", "--gpus", "8"])
    out = capsys.readouterr().out
    assert (
        "| config flint-8gpu.toml: dp_shard=2 ep=4 ac=none |" in out
        and "| candidate: dp_shard=8 ac=none |" in out
    )
    memory.main(
        [
            "--config",
            "configs/flint-8gpu.toml",
            "--parallel.ep=4",
            "--parallel.dp_shard=2",
            "--data.seq_len=8192",
        ]
    )
    out = capsys.readouterr().out
    assert "seq_len 8192" in out and "| config flint-8gpu.toml: dp_shard=2 ep=4 ac=none |" in out


@pytest.mark.slow
@FLINT
def test_command_errors_are_one_line(monkeypatch):
    monkeypatch.chdir(ROOT)
    for args, message in (
        (
            ["--gpus", "7"],
            r"configs/flint-8gpu.toml on --gpus 7: \[parallel\] pp "
            r"\* dp_replicate",
        ),
        (
            ["--parallel.ep=3"],
            r"command line --parallel.ep: \[parallel\] ep = 3 "
            r"must divide",
        ),
        (["--model.preset=huge"], "unknown model preset 'huge'"),
    ):
        with pytest.raises(ConfigError, match=message):
            memory.main(["--config", "configs/flint-8gpu.toml", *args])
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.memory",
            "--config",
            "configs/flint-8gpu.toml",
            "--gpus",
            "7",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert (
        result.returncode == 1
        and result.stderr.startswith("error: ")
        and "Traceback" not in result.stderr
    )


@LARGE4
def test_large4_released_layouts_and_what_fits():
    """configs/large4-256gpu.toml: 16 B per trainable parameter and 4 per frozen (indexer) one over
    256 GPUs (LARGE4.md section 6.1: 16.78 TB), and the fit marks for 141 GB and 80 GB GPUs."""
    from config import load_config

    cfg = load_config(ROOT / "configs" / "large4-256gpu.toml")
    config, layout = cfg.model_config, cfg.parallel.resolve(256, 128)
    assert (layout.dp_shard, layout.ep, layout.activation_checkpointing) == (8, 32, "full")
    row = memory_per_gpu(config, layout, cfg.data.seq_len, cfg.training.batch_size)
    states = (row["params"] + row["grads"] + row["optimizer"]) * GIB * 256
    assert abs(states / 16.78e12 - 1) < 0.005, states
    table = memory_table(
        config,
        [("config", layout), ("candidate", ParallelConfig(dp_shard=256).resolve(256, 128))],
        cfg.data.seq_len,
        cfg.training.batch_size,
    ).splitlines()
    assert table[1].endswith("| total | fits 141GB | fits 80GB |")
    assert table[3].startswith("| config: dp_shard=8 ep=32 ac=full |") and table[3].endswith(
        "| yes | NO |"
    )
    assert table[4].startswith("| candidate: dp_shard=256 ac=none |") and table[4].endswith(
        "| NO | NO |"
    )


@LARGE4
@pytest.mark.parametrize("index_topk", [128, 32])
def test_large4_activation_model_within_20_percent_of_measured(index_topk):
    """The per-block activation model (tools/memory.py, large4.block_activation_bytes) against the
    bytes the autograd graph of a tiny BF16 Large 4 really saves for backward (its 8 blocks, 4 x 128
    tokens; dense selection, then a sparse one), counted once per storage, parameters excluded."""
    from large4 import Large4Config, Visibility, build_large4
    from tools.memory import activation_bytes_per_token

    config = Large4Config.from_name(
        "large4-tiny",
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=8,
        index_head_dim=32,
        index_topk=index_topk,
        # the CPU's path, dense FP32 score rows
        attention_backend="sdpa",
    )
    batch, seq_len = 4, 128
    model = build_large4(config, dtype=torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    ids = torch.randint(
        0, config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0)
    )
    positions = torch.arange(seq_len).expand(batch, seq_len)
    visible = Visibility(None, batch, seq_len, seq_len, ids.device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.run_layers(model.embed_tokens(ids), positions, visible)
    estimate = (
        activation_bytes_per_token(config, config.num_hidden_layers, "none", seq_len)
        * batch
        * seq_len
    )
    assert 0.8 < estimate / sum(saved.values()) < 1.2, (estimate, sum(saved.values()))


@FLINT
@pytest.mark.parametrize(
    "argv, kind, named, pattern",
    [
        (["--gpus", "0"], SystemExit, "--gpus", r"must be >= 1, got 0$"),
        (["--gpus", "-8"], SystemExit, "--gpus", r"must be >= 1, got -8$"),
        (["--gpus", "eight"], SystemExit, "--gpus", r"expected an integer >= 1, got 'eight'"),
        (
            ["--config", "configs/missing.toml"],
            ConfigError,
            "configs/missing.toml",
            r"cannot read config file",
        ),
        (["--data.seq_len=-5"], ConfigError, "data.seq_len", r"seq_len"),
        (["--training.batch_size=0"], ConfigError, "training.batch_size", r"must be >= 1, got 0"),
    ],
)
def test_memory_refuses_each_bad_flag_in_one_line(monkeypatch, argv, kind, named, pattern):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(
        memory, "memory_table", lambda *args, **kwargs: pytest.fail("a table despite a bad flag")
    )
    stops_with_one_line(
        lambda: memory.main(["--config", "configs/flint-8gpu.toml", *argv]), kind, named, pattern
    )


@FLINT
def test_one_gpu_is_the_smallest_layout_it_sizes(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    memory.main(
        [
            "--config",
            "configs/flint-8gpu.toml",
            "--gpus",
            "1",
            "--parallel.dp_shard=1",
            "--parallel.ep=1",
        ]
    )
    out = capsys.readouterr().out
    assert "| config flint-8gpu.toml: one GPU ac=none |" in out
    assert "| candidate: one GPU ac=none |" in out


# ---------------------------------------------------------------- what a Flint block keeps, by mode
# A Flint with every block's attention full (the GPU's kind: no CPU banding), widths apart so that
# each term shows: H 256, 8 query heads and 2 KV heads of 32 (q 256, kv 64), 16 experts, top 4 of
# 128 wide, a shared expert 256 wide; blocks 2 onwards MoE.
WIDE = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=768,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=256,
    num_experts=16,
    num_experts_per_tok=4,
    router_aux_loss_coef=0.0,
    mlp_only_layers=[0, 1],
    loss_chunk_size=64,
)
# Bytes per token of one MoE block of WIDE, by hand (BF16 bulk: 2 bytes, FP32: 4, int64: 8).
# An RMSNorm over w channels in r rows: FP32 input 4w, FP32 normalised 4w, FP32 rsqrt 4r, BF16
# output 2w.
NORM_H, NORM_Q, NORM_KV = 10 * 256 + 4, 10 * 256 + 4 * 8, 10 * 64 + 4 * 2  # 2564, 2592, 648
ATTENTION = NORM_H + NORM_Q + NORM_KV + 2 * 64 + (2 * 256 + 4 * 8) + 2 * 256  # v, out + lse, o in
ROUTER = 4 * 256 + 4 * 16 + 4 * 4 + 4 + 3 * 8 * 4  # FP32 input, scores, weights, sum; int64 maps
ROUTED = 2 * 4 * 256 + 2 * 4 + 2 * 4 * (2 * 128 + 3 * 128)  # rows, weights; gate_up, silu, *, *w
SHARED = 2 * 4 * 256  # gate, up, silu(gate), silu(gate) * up
NONE_BYTES = ATTENTION + NORM_H + ROUTER + ROUTED + SHARED  # 6,988 + 12,992 = 19,980
# op: the input; q, k, v, o; FP32 router logits; shared gate, up, down; grouped gate_up, down;
# attention's output and lse; under ep > 1 the rows, weights and outputs received.
OP_BYTES = 2 * 256 + 2 * (256 + 2 * 64 + 256) + 4 * 16 + 2 * (2 * 256 + 256)
OP_BYTES += 2 * (2 * 4 * 128 + 4 * 256) + (2 * 256 + 4 * 8)  # 8,032
OP_EP_BYTES = OP_BYTES + 2 * (2 * 4 * 256 + 4)  # 12,136
FULL_BYTES = 2 * 256  # the BF16 input


@FLINT
def test_flint_block_activations_counted_by_hand():
    from tools.memory import activation_bytes_per_token

    config = tiny_config("flint", **WIDE)
    model = build(config)
    assert NONE_BYTES == 19_980 and OP_BYTES == 8_032
    assert model.block_activation_bytes(128) == NONE_BYTES
    assert model.op_block_activation_bytes(128) == OP_BYTES
    assert model.op_block_activation_bytes(128, ep=2) == OP_EP_BYTES
    assert model.checkpointed_block_bytes(128) == FULL_BYTES
    # 4 blocks, one recomputed at a time except under none
    per_token = {
        mode: activation_bytes_per_token(config, 4, mode, 128, ep=2)
        for mode in ("none", "selective", "op", "full")
    }
    assert per_token == {
        "none": 4 * NONE_BYTES,
        "selective": 2 * NONE_BYTES + 2 * FULL_BYTES + NONE_BYTES,
        "op": 4 * OP_EP_BYTES + NONE_BYTES,
        "full": 4 * FULL_BYTES + NONE_BYTES,
    }


def kept_per_token_per_block(layout: dict) -> float:
    """What autograd and checkpointing keep live after the forward of parallelize's BF16 model of
    WIDE (every attention full, forced-balance routing), per token of this rank per MoE block: the
    bytes of 6 blocks less those of 4, over 2 blocks (the embedding, head and loss cancel)."""
    from moe import set_balanced_routing
    from tools.rehearsal import PeakMemory

    batch, seq_len = 2, 128
    ids = torch.randint(0, 512, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    kept = []
    for layers in (4, 6):
        config = tiny_config(
            "flint", **WIDE, num_hidden_layers=layers, layer_types=["full_attention"] * layers
        )
        cfg = ParallelConfig.from_dict({"param_dtype": "bfloat16", **layout})
        pm = parallelize(build(config), cfg, build_mesh(cfg, "cpu", config.num_experts))
        set_balanced_routing(pm.module, True)
        memory = PeakMemory()
        with memory.watching():
            loss = pm.parts[0](ids, targets=torch.roll(ids, -1, 1))
            memory.settle()
            kept.append(memory.now)
            loss.backward()
    return (kept[1] - kept[0]) / (2 * batch * seq_len)


def check_kept_bytes_under_expert_parallelism() -> None:
    layout = {"ep": 2, "dp_shard": 1}
    # within a byte per token: the routers' token counts, buffers of 16 FP32 per block. The local
    # experts' own row map keeps 2 more int64 per choice, which the estimate leaves out (0.3 %).
    assert kept_per_token_per_block(layout) == pytest.approx(NONE_BYTES + 2 * 8 * 4, abs=1)
    op = kept_per_token_per_block({**layout, "activation_checkpointing": "op"})
    assert op == pytest.approx(OP_EP_BYTES, abs=1)


@pytest.mark.slow
@FLINT
def test_flint_block_activations_are_what_autograd_keeps():
    """The hand counts above are what the blocks really keep (measured, not estimated), one process
    (FSDP's BF16 policy) and expert parallel on 2 ranks; `full` keeps the input alone."""
    from helpers import spawn

    for mode, expected in (("none", NONE_BYTES), ("op", OP_BYTES), ("full", FULL_BYTES)):
        kept = in_process_group(kept_per_token_per_block, {"activation_checkpointing": mode})
        assert kept == pytest.approx(expected, abs=1), mode
    spawn(2, check_kept_bytes_under_expert_parallelism)


@LARGE4
def test_large4_op_level_bytes_are_refused_in_one_line():
    """Large 4 does not count what its op-level checkpointed blocks keep: memory.py says so, naming
    the setting, rather than price the mode with another mode's bytes."""
    from tools.memory import activation_bytes_per_token

    config = tiny_config("large4")
    with pytest.raises(
        ValueError, match=r"^\[parallel\] activation_checkpointing = 'op': MistralLarge4 does not"
    ):
        activation_bytes_per_token(config, 2, "op", 128)
