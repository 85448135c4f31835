"""tools/planner.py: the traced FLOPs, the layout's collectives and the command, against counts made
by hand."""

import dataclasses
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import tools.planner as planner
from config import ConfigError, load_config
from helpers import only, stops_with_one_line
from parallel import ParallelConfig
from registry import family
from tools.op_trace import OpCost, trace_step
from tools.planner import (
    GPUS,
    Pass,
    Pricing,
    all_to_all_seconds,
    attention_flops_per_token,
    expert_parallel_item,
    fsdp_items,
    fsdp_passes,
    group_span,
    overlapped_exchange,
    tiled_pairs,
    unit_bytes,
)

ROOT = Path(__file__).resolve().parent.parent


# Counted by hand for Flint (its fields and configs); Large 4's attention core below.
FLINT = only("flint")


def tiny():
    # 6 layers (0, 1 dense), 8 experts top 2, window 9
    return family("flint").config.from_name("tiny")


def matrices_per_token(c) -> int:
    """Active matrix weights one token meets, from the config's fields: attention, dense MLP or
    router + top-k experts + shared expert, and the head (the embedding is a lookup, no FLOPs)."""
    attention = c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    dense = 3 * c.hidden_size * c.intermediate_size
    moe = c.hidden_size * (
        c.num_experts
        + 3 * c.num_experts_per_tok * c.moe_intermediate_size
        + 3 * c.shared_expert_intermediate_size
    )
    layers = sum(moe if i not in c.mlp_only_layers else dense for i in range(c.num_hidden_layers))
    return c.num_hidden_layers * attention + layers + c.vocab_size * c.hidden_size


@pytest.mark.slow
@FLINT
def test_traced_flops_of_a_tiny_flint_equal_the_hand_formula():
    """One FP32 step, no recompute, no padding: the matmuls outside attention are 6 FLOPs per active
    weight per token (2 forward, 4 backward; the head's three in its fused loss); the CPU attention
    kernel computes 4 * Hq * D per query per key it is given in forward and 10 in backward (torch's
    count: the flash backward recomputes the scores): every key on full layers (a dense mask), and
    on sliding layers blocks of window - 1 queries against two blocks of keys. Both are exact counts
    (tolerance 1e-9)."""
    c, batch, seq_len = tiny(), 2, 64
    costs = trace_step(c, batch, seq_len, torch.float32, "none")
    tokens = batch * seq_len
    matmuls = sum(cost.flops for cost in costs if not cost.attention_core)
    assert matmuls == pytest.approx(6 * matrices_per_token(c) * tokens, rel=1e-9)
    block = c.sliding_window - 1
    keys = sum(
        seq_len
        if kind == "full_attention"
        else math.ceil(seq_len / block) * block * 2 * block / seq_len
        # keys per query the kernel computes, summed over the layers
        for kind in c.layer_types
    )
    core = sum(cost.flops for cost in costs if cost.attention_core)
    assert core == pytest.approx(14 * c.num_attention_heads * c.head_dim * keys * tokens, rel=1e-9)


@FLINT
def test_model_attention_flops_are_the_keys_each_query_attends():
    """What a GPU's flex kernel computes per token: 12 * Hq * D per attended key, (i + 1) keys at
    position i on full layers, min(i + 1, window) on sliding ones."""
    c, seq_len = tiny(), 64
    attended = (
        sum(
            sum(
                i + 1 if kind == "full_attention" else min(i + 1, c.sliding_window)
                for i in range(seq_len)
            )
            for kind in c.layer_types
        )
        / seq_len
    )
    assert attention_flops_per_token(c, seq_len) == pytest.approx(
        12 * c.num_attention_heads * c.head_dim * attended
    )


@FLINT
def test_collectives_of_a_stated_layout_equal_the_hand_count():
    """4 GPUs of one H100 node, dp_shard = 2 x ep = 2, BF16. Per MoE block, FSDP gathers the
    non-expert weights (BF16; sinks and router FP32) over all 4 GPUs and this rank's half of the
    experts over its dp_shard group of 2; gradients are FP32, reduce-scattered once per micro-batch.
    The all-to-all sends each token's k rows of H BF16 values, half of them to the other rank, 6
    times per MoE layer with full recompute. Rings at NCCL's measured 80 % of NVLink, the all-to-all
    (moe.py's NCCL all_to_all_single) at its 24 %."""
    c = tiny()
    layout = ParallelConfig(
        dp_shard=2, ep=2, activation_checkpointing="full", ep_overlap=1
    ).resolve(4, c.num_experts)
    h, hq, hkv, d = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    attention = h * d * (2 * hq + 2 * hkv) + 2 * d  # projections, q/k norms
    bulk = attention + 2 * h + 3 * h * c.shared_expert_intermediate_size  # and the two block norms
    fp32 = hq + c.num_experts * h  # sinks, router
    experts = 3 * c.num_experts * h * c.moe_intermediate_size // 2
    block = unit_bytes(c, layout, bulk_bytes=2)[2]  # layer 2: the first MoE block
    assert block == (2 * bulk + 4 * fp32, 2 * experts, 4 * (bulk + fp32), 4 * experts)
    h100 = GPUS["H100"]
    ring = h100.nvlink * 0.80
    # no compute: nothing overlaps
    items = fsdp_items(c, layout, Pricing(h100), 2, layer_compute=0.0)
    units = unit_bytes(c, layout, 2)
    # blocks again in backward, the root units (embedding, head) once
    times = [2] * (len(units) - 1) + [1]
    gathers = (
        sum(n * (other * 3 / 4 + expert / 2) for n, (other, expert, _, _) in zip(times, units))
        / ring
    )
    scatters = sum(other * 3 / 4 + expert / 2 for _, _, other, expert in units) / ring
    assert items[0].seconds == pytest.approx(gathers) and items[1].seconds == pytest.approx(
        scatters
    )
    assert items[0].exposed + items[1].exposed == pytest.approx(gathers + scatters)
    tokens = 8 * 64
    a2a = expert_parallel_item(c, layout, Pricing(h100), tokens, 2, recomputed=1.0)
    moe_layers = c.num_hidden_layers - len(c.mlp_only_layers)
    one_way = tokens * c.num_experts_per_tok * h * 2 / 2 / (h100.nvlink * 0.24)
    # nothing to hide behind
    assert a2a.seconds == pytest.approx(moe_layers * 6 * one_way) == pytest.approx(a2a.exposed)


@FLINT
def test_groups_across_nodes_ride_the_network():
    """32 H100s, dp_shard 4 x ep 8 (mesh pp, dp_replicate, dp_shard, ep, cp; 8 consecutive ranks a
    node): the ep group is one node (NVLink); the experts' FSDP group (dp_shard) has one member per
    node, so its ring crosses nodes through one 50 GB/s NIC per GPU at 90 %; the FSDP group of 32
    has 8 members a node, 8 NICs, min(NVLink, 8 x NIC). An all-to-all over 2 nodes sends half its
    rows through the NIC."""
    c = tiny()
    layout = ParallelConfig(dp_shard=4, ep=8).resolve(32, c.num_experts)
    h100 = GPUS["H100"]
    assert group_span(layout, ("ep",), h100) == (8, 8)
    assert group_span(layout, ("dp_shard", "cp"), h100) == (4, 1)
    assert group_span(layout, ("dp_shard", "ep", "cp"), h100) == (32, 8)
    nic, ring = h100.network * 0.90, h100.nvlink * 0.80
    items = fsdp_items(c, layout, Pricing(h100), 2, layer_compute=0.0)
    units = unit_bytes(c, layout, 2)
    times = [2] * (len(units) - 1) + [1]
    gathers = sum(
        n * (other * 31 / 32 / min(ring, 8 * nic) + expert * 3 / 4 / nic)
        for n, (other, expert, _, _) in zip(times, units)
    )
    assert items[0].seconds == pytest.approx(gathers)
    sent = 1e9
    assert all_to_all_seconds(sent, 16, 8, Pricing(h100)) == pytest.approx(sent * 8 / 16 / nic)
    assert all_to_all_seconds(sent, 8, 8, Pricing(h100)) == pytest.approx(
        sent * 7 / 8 / (h100.nvlink * 0.24)
    )


@FLINT
@pytest.mark.parametrize("mode", ["sync_each", "sync_last", "gathered"])
def test_fsdp_collectives_per_accumulation_mode(mode):
    """4 micro-batches on 4 FSDP ranks of one node: sync_each gathers each block twice and the root
    units once per micro-batch and reduce-scatters every micro-batch; sync_last reduce-scatters
    once; gathered also gathers once, in the first forward
    (parallel.ParallelModel.accumulate_gradients). Under pp one schedule call per micro-batch
    (sync_each) or per step, each gathering and reduce-scattering once."""
    c, h100 = tiny(), GPUS["H100"]
    layout = ParallelConfig(dp_shard=4, accumulation=mode).resolve(4, c.num_experts)
    units = unit_bytes(c, layout, 2)
    ring = h100.nvlink * 0.80
    block = sum(o + e for o, e, _, _ in units[:-1]) * 3 / 4 / ring
    root = (units[-1][0] + units[-1][1]) * 3 / 4 / ring
    scatter = sum(o + e for _, _, o, e in units) * 3 / 4 / ring
    block_gathers, root_gathers, scatters = {
        "sync_each": (8, 4, 4),
        "sync_last": (8, 4, 1),
        "gathered": (1, 1, 1),
    }[mode]
    items = fsdp_items(
        c, layout, Pricing(h100), 2, layer_compute=0.0, microbatches=4, accumulation=mode
    )
    assert items[0].seconds == pytest.approx(block_gathers * block + root_gathers * root)
    assert items[1].seconds == pytest.approx(scatters * scatter)
    piped = ParallelConfig(pp=2, dp_shard=2).resolve(4, c.num_experts)
    assert fsdp_passes(piped, 4, mode) == (
        [Pass(1, 1, 1, 1)] * 4 if mode == "sync_each" else [Pass(1, 1, 1, 4)]
    )


def test_overlapped_exchange_by_hand():
    """moe.ExpertParallelExperts' schedule, one chunk's all-to-all taking 1 s one way: dispatch 0
    past the shared expert (0.25 s) is exposed, 0.75 s; with 3 chunks of 0.5 s of experts each,
    chunk 0 hides dispatch 1 but 0.5 s, chunk 1 combine 0 and dispatch 2 but 1.5 s, chunk 2 combine
    1 but 0.5 s; the last combine is waited for, 1 s. One chunk: its dispatch past the shared
    expert, then its combine."""
    assert overlapped_exchange(1.0, 3, 0.5, 0.25) == pytest.approx(0.75 + 0.5 + 1.5 + 0.5 + 1.0)
    assert overlapped_exchange(1.0, 1, 5.0, 0.25) == pytest.approx(0.75 + 1.0)
    # the experts hide every middle transfer
    assert overlapped_exchange(1.0, 3, 5.0, 5.0) == pytest.approx(1.0)


def test_flex_tiles_by_hand():
    """256 tokens in 128-token tiles. Window 128: query tile 0 computes key tile 0, query tile 1
    (queries 128..255 see keys from 1 on) tiles 0 and 1: 3 tiles of 128 x 128 against sum(min(i + 1,
    128)) attended pairs; causal: the same 3 tiles against 256 x 257 / 2."""
    assert tiled_pairs(256, 128) == (3 * 128 * 128, 128 * 129 // 2 + 128 * 128)
    assert tiled_pairs(256, None) == (3 * 128 * 128, 256 * 257 // 2)


def test_head_matmuls_run_at_the_head_precision():
    """An FP32 matmul of the head costs FLOPs / the peak [parallel] head_precision names; an FP32
    router matmul runs at torch's default, the CUDA cores' FP32 peak; calibrated, each at the GEMM's
    fraction."""
    h100 = GPUS["H100"]
    head = OpCost("forward", "lm_head", "mm", "float32", "", False, flops=1e12)
    router = OpCost("forward", "layers.*.mlp.router", "mm", "float32", "", False, flops=1e12)
    assert Pricing(h100, "tf32", calibrated=False).seconds(head)[0] == pytest.approx(
        1e12 / h100.tf32
    )
    assert Pricing(h100, "bf16x3", calibrated=False).seconds(head)[0] == pytest.approx(
        3e12 / h100.bf16
    )
    assert Pricing(h100, "tf32", calibrated=False).seconds(router)[0] == pytest.approx(
        1e12 / h100.fp32
    )
    assert Pricing(h100, "bf16").seconds(head)[0] == pytest.approx(1e12 / h100.bf16 / 0.70)
    with pytest.raises(ConfigError, match=r"\[parallel\] head_precision = 'fp64'"):
        planner.head_precision(SimpleNamespace(head_precision="fp64"))


@pytest.mark.slow
@FLINT
def test_plan_prices_the_head_at_the_layouts_head_precision():
    """The same step with [parallel] head_precision bf16 and float32 on a device whose memory and
    links cost nothing: the step differs by the head's three FP32 matmuls of the fused loss (6 x
    vocab x hidden FLOPs per token) at the two peaks, each at the GEMM's calibrated fraction."""
    from config import load_config

    cfg = load_config(
        ROOT / "configs" / "flint-8gpu.toml", ["--model.preset=tiny", "--data.seq_len=64"]
    )
    free = planner.Device("H100 free bytes", 989e12, 495e12, 67e12, 1e30, 1e30, 1e30)
    c = cfg.model_config

    def step(precision):
        layout = dataclasses.replace(cfg.parallel, head_precision=precision).resolve(
            8, c.num_experts
        )
        return planner.plan_step(cfg, layout, free).step_seconds

    head = 6 * c.vocab_size * c.hidden_size * 64 / 0.70
    assert step("float32") - step("bf16") == pytest.approx(
        head / free.fp32 - head / free.bf16, rel=1e-6
    )


@pytest.mark.slow
@FLINT
def test_command_prints_tokens_mfu_and_the_ten_costliest(capsys, monkeypatch):
    """A released config (4 layers, short sequences, to stay fast), then the CPU device on a tiny
    preset."""
    monkeypatch.chdir(ROOT)
    plan = planner.main(
        [
            "--config",
            "configs/flint-8gpu.toml",
            "--gpu",
            "h200",
            "--model.num_hidden_layers=4",
            "--data.seq_len=1024",
        ]
    )
    out = capsys.readouterr().out
    assert (
        "H200 SXM, dp_shard=2 ep=4 ac=none ep_overlap=4" in out and "tokens/s per GPU, MFU" in out
    )
    assert (
        any("expert-parallel all-to-all" in item.label for item in plan.items)
        and "100 % of peak (the bound)" in out
    )
    assert (
        len([line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()])
        == 10
    )
    assert 0 < plan.mfu < 1 and plan.step_seconds == pytest.approx(
        sum(item.exposed for item in plan.items)
    )
    assert out.splitlines()[-1].startswith("memory: fits, ")
    monkeypatch.setattr(
        planner,
        "measure_cpu",
        lambda: planner.Device("cpu (test)", 1e11, 1e11, 1e11, 1e10, 0, 0, 1),
    )
    cpu = planner.main(["--gpu", "cpu", "--preset", "tiny", "--data.seq_len=64"])
    assert "cpu (test), one GPU ac=none" in capsys.readouterr().out and cpu.step_seconds > 0


@pytest.mark.slow
@FLINT
def test_bad_gpu_and_missing_config_are_one_line_errors(monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(
        ConfigError,
        match=r"--gpu: unknown GPU 'A100'; choose one of H100, H200, "
        r"B200 or cpu",
    ):
        planner.main(["--config", "configs/flint-8gpu.toml", "--gpu", "A100"])
    with pytest.raises(ConfigError, match="give --config or --preset"):
        planner.main(["--gpu", "H100"])
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.planner",
            "--config",
            "configs/flint-8gpu.toml",
            "--gpu",
            "A100",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert (
        result.returncode == 1
        and result.stderr.startswith("error: --gpu")
        and "Traceback" not in result.stderr
    )


@pytest.mark.slow(beyond_ci=True)  # the released Flint's traces: about two minutes on 2 busy cores
@FLINT
def test_released_flint_step_is_its_model_flops_plus_at_most_one_recomputed_forward():
    """configs/flint-8gpu.toml in BF16 at 1,024 tokens: without checkpointing, the traced matmuls
    outside attention are 6 FLOPs per weight that model.flops_per_token counts beside attention;
    full checkpointing adds at most one forward of the blocks (2 per block weight) and at least 90 %
    of it (torch's checkpoint stops recomputing once the last tensor backward needs is back)."""
    from config import load_config

    config, seq_len = load_config(ROOT / "configs" / "flint-8gpu.toml").model_config, 1024
    weights = (
        planner.meta_model(config).flops_per_token(seq_len)
        - attention_flops_per_token(config, seq_len)
    ) / 6
    block_weights = weights - config.vocab_size * config.hidden_size  # the head is not checkpointed

    def traced(checkpointing):
        costs = trace_step(config, 1, seq_len, torch.bfloat16, checkpointing)
        return sum(cost.flops for cost in costs if not cost.attention_core) / seq_len

    assert traced("none") == pytest.approx(6 * weights, rel=1e-9)
    assert 0.9 * 2 * block_weights <= traced("full") - traced("none") <= 2 * block_weights


@pytest.mark.slow
@only("large4")
def test_large4_dense_scores_are_the_attention_core_a_gpu_replaces():
    """Mistral Large 4's CPU path materialises [B, H, T, S] scores: on a GPU those ops give way to
    the flex kernel, whose FLOPs (LARGE4.md section 6.3) are 6 * heads * (qk + v) per attended key
    per layer, plus the indexers' 2 * Hi * Di per scored key (T + 1) / 2 on full-indexer layers."""
    c, seq_len = family("large4").config.from_name("large4-tiny"), 48
    costs = trace_step(c, 2, seq_len, torch.bfloat16, "none")
    score_ops = {cost.op for cost in costs if cost.attention_core}
    assert {"bmm", "_softmax"} <= score_ops
    kept = [cost for cost in costs if not cost.attention_core and cost.op == "_softmax"]
    # every score softmax is in the core
    assert all(f"{seq_len}, {seq_len}]" not in cost.shapes for cost in kept)
    attended = sum(min(i + 1, c.index_topk) for i in range(seq_len)) / seq_len
    expected = (
        c.num_hidden_layers * 6 * c.num_attention_heads * (c.qk_head_dim + c.v_head_dim) * attended
        + c.indexer_types.count("full") * 2 * c.index_n_heads * c.index_head_dim * (seq_len + 1) / 2
    )
    assert attention_flops_per_token(c, seq_len) == pytest.approx(expected)


@only("large4")
def test_large4_context_parallel_gathers_its_latent():
    """Mistral Large 4 under cp 2 on one node: each layer all-gathers the whole sequence's latent
    and rotated key (kv_lora_rank + qk_rope_head_dim BF16 values a token) in forward and recompute,
    and reduce-scatters their gradients: 3 rings of (n - 1) / n of it at NCCL's 80 % of NVLink."""
    c = family("large4").config.from_name("large4-tiny")
    layout = ParallelConfig(cp=2, activation_checkpointing="full").resolve(2, c.num_experts)
    h100, tokens = GPUS["H100"], 64  # this rank's
    item = planner.context_parallel_item(c, layout, Pricing(h100), tokens, 2, recomputed=1.0)
    gathered = tokens * 2 * (c.kv_lora_rank + c.qk_rope_head_dim) * 2
    ring = gathered / 2 / (h100.nvlink * 0.80)
    assert item.seconds == pytest.approx(c.num_hidden_layers * 3 * ring)


def parameters_by_hand(c) -> int:
    """Every parameter of a Flint config, from its fields: per block the attention projections, the
    q/k norms, the sinks and the two block norms, then a dense MLP or router + experts + shared
    expert; the embedding, the final norm and the (untied) head."""
    h, d = c.hidden_size, c.head_dim
    attention = (
        h * d * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
        + 2 * d
        + c.num_attention_heads
        + 2 * h
    )
    dense = 3 * h * c.intermediate_size
    moe = (
        c.num_experts * h
        + 3 * c.num_experts * h * c.moe_intermediate_size
        + 3 * h * c.shared_expert_intermediate_size
    )
    blocks = sum(
        attention + (dense if i in c.mlp_only_layers else moe) for i in range(c.num_hidden_layers)
    )
    return blocks + 2 * c.vocab_size * h + h


@FLINT
def test_optimizer_traffic_is_adamws_bytes_per_parameter_by_hand():
    """AdamW's step over FP32 shards moves, once a step of 2 micro-batches, per trainable parameter:
    reads the weight, the gradient and the two moments (4 x 4 bytes), writes the weight and the two
    moments (3 x 4), and the gradient norm reads the gradient once more (4): 32 bytes, at HBM's
    calibrated 87 %. dp_shard 2 x ep 2 on 4 GPUs: each GPU holds a quarter of every parameter
    (experts over ep x dp_shard, the rest over dp_shard x ep)."""
    from config import load_config
    from helpers import build

    cfg = load_config(
        ROOT / "configs" / "flint-8gpu.toml",
        ["--model.preset=tiny", "--data.seq_len=64", "--training.grad_accum=2"],
    )
    c = cfg.model_config
    params = parameters_by_hand(c)
    assert params == build(c).num_params() == 404_504  # the hand count is the model's
    layout = ParallelConfig(dp_shard=2, ep=2, activation_checkpointing="full").resolve(
        4, c.num_experts
    )
    h100 = GPUS["H100"]
    plan = planner.plan_step(cfg, layout, h100)
    item = next(i for i in plan.items if i.label.startswith("AdamW"))
    read, written, norm = 4 + 4 + 4 + 4, 4 + 4 + 4, 4
    expected = (read + written + norm) * params / 4 / (h100.hbm * 0.87)
    assert item.seconds == pytest.approx(expected, rel=1e-12) and item.exposed == item.seconds
    tokens = (
        cfg.training.batch_size * 64 * 2
    )  # each GPU's rows of its 2 micro-batches (no pp, no cp)
    assert plan.tokens_per_gpu == tokens
    model_tflops = build(c).flops_per_token(64) * tokens / plan.step_seconds
    assert plan.mfu == pytest.approx(model_tflops / h100.bf16, rel=1e-12)


@FLINT
def test_every_parameter_is_reduce_scattered_once_in_fp32():
    """The FSDP units' gradient bytes (the reduce-scatters' third and fourth fields) cover the whole
    model once, 4 bytes per parameter: a unit left out or counted twice moves the collectives'
    time."""
    c = tiny()
    layout = ParallelConfig(dp_shard=4).resolve(4, c.num_experts)
    assert sum(o + e for _, _, o, e in unit_bytes(c, layout, 2)) == 4 * parameters_by_hand(c)


@pytest.fixture
def recorded_search(monkeypatch):
    """tools.search.search replaced by a recorder that finds nothing: what the planner's flags hand
    it, without a trace."""
    import tools.search

    calls = []
    monkeypatch.setattr(
        tools.search,
        "search",
        lambda cfg, gpus, device, tokens, modes: calls.append((gpus, tokens, modes)) or [],
    )
    monkeypatch.chdir(ROOT)
    return calls


SEARCH = [
    "--config",
    "configs/flint-8gpu.toml",
    "--model.preset=tiny",
    "--data.seq_len=64",
]


@FLINT
@pytest.mark.parametrize(
    "argv, kind, named, pattern",
    [
        (
            ["--checkpointing", "bogus"],
            SystemExit,
            "--checkpointing",
            r"unknown name 'bogus'; choose from none,full,sel",
        ),
        (["--checkpointing", "full,"], SystemExit, "--checkpointing", r"unknown name ''"),
        (["--checkpointing", "full,full"], SystemExit, "--checkpointing", r"given twice"),
        (["--tokens-per-step", "0"], SystemExit, "--tokens-per-step", r"must be >= 1, got 0$"),
        (
            ["--tokens-per-step", "-4096"],
            SystemExit,
            "--tokens-per-step",
            r"must be >= 1, got -4096$",
        ),
        (
            ["--tokens-per-step", "1e6"],
            SystemExit,
            "--tokens-per-step",
            r"expected an integer >= 1, got '1e6'",
        ),
        (["--gpus", "0"], SystemExit, "--gpus", r"must be >= 1, got 0$"),
        (["--gpus", "-8"], SystemExit, "--gpus", r"must be >= 1, got -8$"),
        (["--gpus", "7"], ConfigError, "--gpus 7", r"must equal the world size"),
        (["--gpu", "A100"], ConfigError, "--gpu", r"unknown GPU 'A100'"),
        (
            ["--config", "configs/missing.toml"],
            ConfigError,
            "configs/missing.toml",
            r"cannot read config file",
        ),
        (["--data.seq_len=0"], ConfigError, "data.seq_len", r"seq_len"),
        (
            ["--parallel.activation_checkpointing=sometimes"],
            ConfigError,
            "activation_checkpointing",
            r"sometimes",
        ),
        (["--preset", "tiny"], SystemExit, "--preset", r"not allowed with argument --config"),
    ],
)
def test_the_search_refuses_each_bad_flag_in_one_line(recorded_search, argv, kind, named, pattern):
    import tools.search

    stops_with_one_line(lambda: tools.search.main([*SEARCH, *argv]), kind, named, pattern)
    assert recorded_search == []


@FLINT
@pytest.mark.parametrize("flag", [["--tokens-per-step", "4096"], ["--checkpointing", "full"]])
def test_the_searchs_flags_given_to_the_planner_are_refused_not_ignored(recorded_search, flag):
    argv = ["--config", "configs/flint-8gpu.toml", *flag]
    stops_with_one_line(lambda: planner.main(argv), ConfigError, flag[0], r"")


@FLINT
def test_validate_refuses_the_flags_it_would_ignore(recorded_search):
    argv = ["--validate", *SEARCH]
    stops_with_one_line(
        lambda: planner.main(argv),
        ConfigError,
        "--validate",
        r"drop --config --model.preset=tiny --data.seq_len=64",
    )


@FLINT
def test_search_flags_at_their_boundaries_reach_the_search(recorded_search, capsys):
    """The smallest accepted values arrive unchanged; without --tokens-per-step the step is the
    config's global batch: rows x seq_len x grad_accum x the data-parallel ranks (dp_replicate x
    dp_shard x ep)."""
    import tools.search

    tools.search.main([*SEARCH, "--tokens-per-step", "1", "--checkpointing", "full"])
    assert recorded_search.pop() == (8, 1, ("full",))
    assert "1 tokens per step, 0 layouts fit" in capsys.readouterr().out
    tools.search.main(
        [
            *SEARCH,
            "--gpus",
            "1",
            "--parallel.dp_shard=1",
            "--parallel.ep=1",
            "--checkpointing",
            "none,full,selective",
        ]
    )
    cfg = load_config(
        ROOT / "configs" / "flint-8gpu.toml", ["--model.preset=tiny", "--data.seq_len=64"]
    )
    one_rank = cfg.training.batch_size * 64 * cfg.training.grad_accum  # one data-parallel rank
    assert recorded_search.pop() == (1, one_rank, ("none", "full", "selective"))
    tools.search.main(SEARCH)
    p = cfg.parallel
    assert p.dp_replicate * p.dp_shard * p.ep == 8  # flint-8gpu: dp_shard 2 x ep 4, one replica
    assert recorded_search.pop() == (8, 8 * one_rank, None)


@FLINT
def test_pipeline_sends_and_bubble_by_hand():
    """pp 2 x dp_shard 2 on one node, 256 tokens a micro-batch: each stage sends its [tokens, H]
    BF16 activations forward and their gradients back (2 transfers) at NCCL's 80 % of NVLink; the
    1F1B bubble is (pp - 1) / (pp micro-batches) of the compute, (pp - 1) / (4 x 2) when sync_last
    joins 4 micro-batches into a call (8 micro-batches); Interleaved1F1B with 2 stages a rank runs 4
    a call, bubble 1 / (4 x 2). pp 2 x dp_shard 8 on 16 GPUs: the stages are 8 ranks apart, on two
    nodes: the NIC at 90 %."""
    c, h100, tokens, compute = tiny(), GPUS["H100"], 256, 1.0
    one_f_one_b = ParallelConfig(pp=2, dp_shard=2).resolve(4, c.num_experts)
    sends, bubble = planner.pipeline_items(c, one_f_one_b, Pricing(h100), tokens, 2, compute)
    assert sends.seconds == pytest.approx(2 * tokens * c.hidden_size * 2 / (h100.nvlink * 0.80))
    assert bubble.seconds == pytest.approx(1 / 2) and bubble.exposed == bubble.seconds
    joined = planner.pipeline_items(c, one_f_one_b, Pricing(h100), tokens, 2, compute, joined=4)[1]
    assert joined.seconds == pytest.approx(1 / 8)
    interleaved = ParallelConfig(
        pp=2, dp_shard=2, pp_schedule="Interleaved1F1B", pp_stages_per_rank=2
    ).resolve(4, c.num_experts)
    assert planner.pipeline_items(c, interleaved, Pricing(h100), tokens, 2, compute)[
        1
    ].seconds == pytest.approx(1 / 8)
    two_nodes = ParallelConfig(pp=2, dp_shard=8).resolve(16, c.num_experts)
    sends = planner.pipeline_items(c, two_nodes, Pricing(h100), tokens, 2, compute)[0]
    assert sends.seconds == pytest.approx(2 * tokens * c.hidden_size * 2 / (h100.network * 0.90))
    assert (
        planner.pipeline_items(
            c,
            ParallelConfig(dp_shard=4).resolve(4, c.num_experts),
            Pricing(h100),
            tokens,
            2,
            compute,
        )
        == []
    )


@FLINT
def test_grouped_gemm_rows_and_their_tile_loss_by_hand():
    """512 tokens top-2 on ep 2 of 8 experts: each rank's 4 experts compute 512 x 2 x 2 / 8 = 256
    rows (balanced); a grouped GEMM at r rows per expert loses its half-empty last 128-row tile: 70
    % x r / (r + 64) of the BF16 peak; a dense matmul stays at 70 %."""
    c, h100 = tiny(), GPUS["H100"]
    layout = ParallelConfig(dp_shard=2, ep=2).resolve(4, c.num_experts)
    assert planner.expert_rows(c, layout, 512) == 512 * 2 * 2 / 8 == 256
    grouped = OpCost(
        "forward", "layers.*.mlp.experts", "_grouped_mm", "bfloat16", "", False, flops=1e12
    )
    dense = dataclasses.replace(grouped, op="mm")
    assert Pricing(h100, expert_rows=256).seconds(grouped)[0] == pytest.approx(
        1e12 / (h100.bf16 * 0.70 * 256 / 320)
    )
    assert Pricing(h100, expert_rows=256).seconds(dense)[0] == pytest.approx(
        1e12 / (h100.bf16 * 0.70)
    )


@FLINT
def test_flex_kernel_seconds_by_hand():
    """At 100 % of peak (no tile ratio): per attended key 2 of the model's 6 FLOPs in forward, 2
    more in a full recompute, 5 in backward; selective checkpointing recomputes ceil(6 / 2) = 3 of
    tiny's 6 blocks."""
    c, h100, tokens = tiny(), GPUS["H100"], 128
    unit = attention_flops_per_token(c, 64) * tokens / 6 / h100.bf16
    bound = Pricing(h100, calibrated=False)
    assert planner.attention_seconds(c, bound, 64, tokens, "none") == pytest.approx((2 + 5) * unit)
    assert planner.attention_seconds(c, bound, 64, tokens, "full") == pytest.approx(
        (2 + 2 + 5) * unit
    )
    selective = planner.attention_seconds(c, bound, 64, tokens, "selective")
    assert selective == pytest.approx((2 + 2 * 3 / 6 + 5) * unit)


@FLINT
def test_the_memory_line_says_when_the_layout_does_not_fit(monkeypatch):
    """The planner judges its layout as search.py does: flint-8gpu under full checkpointing (6 %
    margin, plus 10 GiB of buffers) needs 75.0 * 1.06 + 10 = 89.5 GiB for an estimate of 75.0,
    over an H100's 79.6 usable; 65.66 * 1.06 + 10 = 79.5996 fits it exactly (the boundary), 65.67
    does not."""
    monkeypatch.chdir(ROOT)
    cfg = load_config("configs/flint-8gpu.toml", ["--parallel.activation_checkpointing=full"])
    layout = cfg.parallel.resolve(8, cfg.model_config.num_experts)
    assert layout.activation_checkpointing == "full"
    estimates = []
    monkeypatch.setattr(planner, "memory_per_gpu", lambda *args: {"total": estimates[-1]})
    for estimate, verdict in (
        (75.0, "DOES NOT FIT, 89.5 GiB"),
        (65.66, "fits, 79.6 GiB"),
        (65.67, "DOES NOT FIT, 79.6 GiB"),
    ):
        estimates.append(estimate)
        line = planner.memory_line(cfg, layout, GPUS["H100"])
        assert line.startswith(f"memory: {verdict} needed per GPU"), line
        assert "of the H100 SXM's 79.6 GiB usable" in line
    monkeypatch.undo()
    real = planner.memory_line(cfg, layout, GPUS["H100"])  # tools.search: no layout fits 8 x H100
    assert real.startswith("memory: DOES NOT FIT") and "tools.search" in real
    assert planner.memory_line(cfg, layout, GPUS["H200"]).startswith("memory: fits")


# ============================================================ the options other changes add


def matmul(op: str = "mm", flops: float = 1e12, **fields) -> OpCost:
    return OpCost(
        "forward", "layers.*.mlp.experts", op, "bfloat16", "", False, flops=flops, **fields
    )


@FLINT
def test_host_syncs_and_the_exchanges_by_hand():
    """tiny (6 layers, 2 dense: 4 MoE layers) on ep 2: the sized exchange copies its split sizes
    to the host once per MoE layer and micro-batch, 100 us each: 4e-4 s (at 100 % of peak, the
    bound, no stall); sync_free and DeepEP none, nor a layout without expert parallelism. The sized
    and sync_free exchanges move their rows at NCCL's fitted 24 % of NVLink, DeepEP at 77 %;
    sync_free's static buffers of 2 x the balanced rows move twice the bytes."""
    c, h100, tokens = tiny(), GPUS["H100"], 8 * 64
    layout = ParallelConfig(dp_shard=2, ep=2, ep_overlap=1).resolve(4, c.num_experts)
    sync = planner.host_sync_item(c, layout, Pricing(h100))
    assert sync.seconds == sync.exposed == pytest.approx(4 * 1e-4)
    assert planner.host_sync_item(c, layout, Pricing(h100, calibrated=False)).seconds == 0.0
    assert planner.host_sync_item(c, layout, Pricing(h100, exchange="sync_free")) is None
    assert planner.host_sync_item(c, layout, Pricing(h100, exchange="deepep")) is None
    no_ep = ParallelConfig(dp_shard=4).resolve(4, c.num_experts)
    assert planner.host_sync_item(c, no_ep, Pricing(h100)) is None
    one_way = tokens * c.num_experts_per_tok * c.hidden_size * 2 / 2 / h100.nvlink
    for pricing, fraction, buffers in (
        (Pricing(h100), 0.24, 1),
        (Pricing(h100, exchange="deepep"), 0.77, 1),
        (Pricing(h100, exchange="sync_free", ep_buffer_factor=2.0), 0.24, 2),
    ):
        a2a = expert_parallel_item(c, layout, pricing, tokens, 2, recomputed=0.0)
        assert a2a.seconds == pytest.approx(4 * 4 * buffers * one_way / fraction)


def test_optimizer_states_by_hand():
    """AdamW over 1e9 FP32 parameters on an H100: 32 bytes each with FP32 moments (weight and
    gradient read, 2 moments read, weight and 2 moments written, the norm's read), 24 with BF16
    moments, at 87 % of 3.35 TB/s."""
    h100 = Pricing(GPUS["H100"])
    assert planner.optimizer_seconds(1e9, "float32", h100) == pytest.approx(
        (4 + 4 + 8 + 4 + 8 + 4) * 1e9 / (3.35e12 * 0.87)
    )
    assert planner.optimizer_seconds(1e9, "bfloat16", h100) == pytest.approx(
        (4 + 4 + 4 + 4 + 4 + 4) * 1e9 / (3.35e12 * 0.87)
    )


def test_op_level_recompute_by_hand():
    """Op-level checkpointing runs again each block's forward op that FlopCounterMode counts no
    FLOPs for (norms, activations, routing, gathers): here the 1 GB norm of a layer, at 87 % of an
    H100's HBM; not its matmul, nor the attention core, nor a backward op, nor the head."""
    h100 = Pricing(GPUS["H100"])
    norm = OpCost("forward", "layers.*.input_layernorm", "mul", "bfloat16", "", False, bytes=1e9)
    costs = [
        norm,
        matmul(bytes=1e9),
        dataclasses.replace(norm, attention_core=True),
        dataclasses.replace(norm, phase="backward"),
        dataclasses.replace(norm, module="norm"),
    ]
    item = planner.op_recompute_item(costs, h100)
    assert item.seconds == item.exposed == pytest.approx(1e9 / (3.35e12 * 0.87))
    assert planner.op_recompute_item(costs[1:], h100) is None
    assert planner.recomputed_share(tiny(), "op") == 0.0


def test_the_options_are_read_from_the_config():
    """Each key reaches the Options (auto attention priced as flex); a value the planner cannot
    price is one line naming its key."""
    cfg = load_config(ROOT / "configs" / "flint-8gpu.toml", [])
    assert planner.read_options(cfg) == planner.Options("flex", "sized", "float32")
    new = load_config(
        ROOT / "configs" / "flint-8gpu.toml",
        [
            "--model.attention_backend=flash",
            "--parallel.ep_exchange=sync_free",
            "--optim.state_dtype=bfloat16",
        ],
    )
    assert planner.read_options(new) == planner.Options("flash", "sync_free", "bfloat16")
    wrong = SimpleNamespace(
        model_config=SimpleNamespace(attention_backend="auto"),
        parallel=SimpleNamespace(ep_exchange="nvshmem"),
        optim=SimpleNamespace(state_dtype="float32"),
    )
    with pytest.raises(ConfigError, match=r"^\[parallel\] ep_exchange = 'nvshmem': the planner"):
        planner.read_options(wrong)
    wrong.parallel.ep_exchange, wrong.optim.state_dtype = "sized", "int8"
    with pytest.raises(ConfigError, match=r"^\[optim\] state_dtype = 'int8'"):
        planner.read_options(wrong)


def test_the_sync_free_buffers_by_hand():
    """Released Flint (256 experts, top 8) on ep 8: every rank gets tokens x min(8, 32) rows, 8x
    the balanced tokens x 8 / 8; the tiny model (8 experts, top 2) on ep 8: min(2, 1) = 1 row a
    token per rank, 8 / 2 = 4x; no expert parallelism: 1."""
    released = SimpleNamespace(num_experts=256, num_experts_per_tok=8)
    small = SimpleNamespace(num_experts=8, num_experts_per_tok=2)
    assert planner.sync_free_buffer_factor(released, 8) == 8.0
    assert planner.sync_free_buffer_factor(small, 8) == 4.0
    assert planner.sync_free_buffer_factor(released, 1) == 1.0


@pytest.mark.slow
@FLINT
def test_the_options_reach_the_step():
    """tiny on 4 H100s, ep 2: the sized exchange's host syncs are an item of the step and
    sync_free's are not; BF16 moments cost 24 / 32 of the FP32 ones' AdamW; op-level checkpointing
    adds its recompute item, which no checkpointing lacks."""
    cfg = load_config(
        ROOT / "configs" / "flint-8gpu.toml", ["--model.preset=tiny", "--data.seq_len=64"]
    )
    layout = dataclasses.replace(cfg.parallel, ep=2, dp_shard=2).resolve(4, 8)
    h100 = GPUS["H100"]

    def plan(layout=layout, **options):
        return planner.plan_step(cfg, layout, h100, options=planner.Options(**options))

    def labels(p):
        return [item.label for item in p.items]

    sized, sync_free = plan(), plan(exchange="sync_free")
    assert any(label.startswith("host syncs") for label in labels(sized))
    assert not any(label.startswith("host syncs") for label in labels(sync_free))

    def adam(p):
        return next(item.seconds for item in p.items if item.label.startswith("AdamW"))

    assert adam(plan(state_dtype="bfloat16")) == pytest.approx(adam(sized) * 24 / 32)
    op = plan(dataclasses.replace(layout, activation_checkpointing="op"))
    assert any(label.startswith("op-level recompute") for label in labels(op))
    none = plan(dataclasses.replace(layout, activation_checkpointing="none"))
    assert not any(label.startswith("op-level recompute") for label in labels(none))
    # a config asking for flash (which the CPU refuses to run) is traced on the CPU's kernels
    flash = load_config(
        ROOT / "configs" / "flint-8gpu.toml",
        ["--model.preset=tiny", "--data.seq_len=64", "--model.attention_backend=flash"],
    )
    assert "attention core (flash kernel, BF16)" in labels(planner.plan_step(flash, layout, h100))


def test_peak_prints_the_bound_table(capsys, monkeypatch):
    """--peak prices the table at 100 % of peak and prints no second bound line; --validate refuses
    it (the validation prints both)."""
    calls = []

    def fake_plan(cfg, layout, device, calibrated=True, options=None):
        calls.append(calibrated)
        return planner.Plan(device, layout, 1.0, 1000.0, 1e9, [], "sync_each", calibrated)

    monkeypatch.setattr(planner, "plan_step", fake_plan)
    monkeypatch.setattr(planner, "memory_line", lambda *args: "memory: (test)")
    monkeypatch.chdir(ROOT)
    planner.main(["--config", "configs/flint-8gpu.toml", "--peak"])
    out = capsys.readouterr().out
    assert calls == [False] and "100 % of peak: step 1.000 s" in out
    assert "(the bound)" not in out
    planner.main(["--config", "configs/flint-8gpu.toml"])
    assert calls == [False, True, False] and "(the bound)" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="drop --peak"):
        planner.main(["--validate", "--peak"])
