"""Published MoE training runs that planner.py --validate predicts: each expressed as a Flint config
(same widths, layers, experts, top-k, vocabulary, attention windows, sequence, micro-batch,
accumulation; FLOPs by flops_per_token, which matches what the sources count), its layout in Flint's
mesh, the attention kernel and expert exchange it ran, where the layout had to be guessed, and
whether the planner's constants were fitted to it (tools/gpus.py) or it is held out."""

from __future__ import annotations

import dataclasses

from tools.planner import Options

NEMO_AUTOMODEL = (
    "https://github.com/NVIDIA-NeMo/Automodel/blob/main/docs/performance-summary.md (2025-10-02)"
)
TORCHTITAN_DEEPEP = (
    "https://github.com/pytorch/torchtitan/blob/main/torchtitan/distributed/deepep/README.md"
)
MEGATRON_BRIDGE = (
    "https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/main/docs/performance-summary.md"
)


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    """One published run: measured tokens/s per GPU on `gpus` GPUs of kind `gpu`, and how Flint
    expresses it (config + overrides, Options)."""

    name: str
    source: str  # URL
    setup: str  # as published
    gpu: str  # a key of tools/gpus.py's GPUS
    gpus: int
    measured: float  # tokens/s per GPU
    overrides: tuple[str, ...]
    options: Options
    guessed: str  # what of the layout the source does not state (empty: nothing)
    confidence: str  # high | medium | low
    fitted: bool  # a constant of tools/gpus.py was fitted to this run
    config: str = "configs/flint-8gpu.toml"


GPT_OSS = (
    "--model.hidden_size=2880",
    "--model.num_attention_heads=64",
    "--model.num_key_value_heads=8",
    "--model.head_dim=64",
    "--model.vocab_size=201088",
    "--model.sliding_window=128",
    "--model.moe_intermediate_size=2880",
    "--model.num_experts_per_tok=4",
    "--model.mlp_only_layers=[]",
    # no shared expert: one channel, no FLOPs to speak of
    "--model.shared_expert_intermediate_size=1",
)
QWEN3_30B_A3B = (
    "--model.hidden_size=2048",
    "--model.num_hidden_layers=48",
    "--model.num_attention_heads=32",
    "--model.num_key_value_heads=4",
    "--model.head_dim=128",
    "--model.vocab_size=151936",
    "--model.sliding_window=4096",
    "--model.layer_types=[" + ", ".join(['"full_attention"'] * 48) + "]",
    "--model.moe_intermediate_size=768",
    "--model.num_experts=128",
    "--model.num_experts_per_tok=8",
    "--model.mlp_only_layers=[]",
    "--model.shared_expert_intermediate_size=1",
)


def gpt_oss_layers(layers: int, experts: int) -> tuple[str, ...]:
    """GPT-OSS's depth and experts; its attention: sliding (128 keys) and full layers
    alternating."""
    kinds = ", ".join(['"sliding_attention", "full_attention"'] * (layers // 2))
    return (
        f"--model.num_hidden_layers={layers}",
        f"--model.layer_types=[{kinds}]",
        f"--model.num_experts={experts}",
    )


def layout(
    ep: int,
    rows: int,
    accum: int,
    checkpointing: str = "full",
    replicas: int = 1,
    chunks: int = 2,
) -> tuple[str, ...]:
    """A run's layout in full: FSDP over the GPUs of each replica, the experts over `ep`, `rows` x
    4,096 tokens a micro-batch, `accum` micro-batches a step, compiled, its exchange in `chunks`
    overlapped chunks (1: not overlapped; DeepEP's runs do not say how they overlapped: Flint's
    default 2)."""
    return (
        f"--parallel.dp_replicate={replicas}",
        "--parallel.dp_shard=-1",
        f"--parallel.ep={ep}",
        f"--parallel.ep_overlap={chunks}",
        f"--parallel.activation_checkpointing={checkpointing}",
        "--parallel.compile=true",
        "--data.seq_len=4096",
        f"--training.batch_size={rows}",
        f"--training.grad_accum={accum}",
    )


# Megatron's DDP reduces the gradients once a step, in the last micro-batch's backward
MEGATRON_DDP = ("--parallel.accumulation=sync_last",)
DEEPEP_FLEX = Options(attention="flex", exchange="deepep")
DEEPEP_CUDNN = Options(attention="fused", exchange="deepep")
NCCL_CUDNN = Options(attention="fused", exchange="sized")

RUNS = [
    PublishedRun(
        "GPT-OSS-20B (NeMo AutoModel)",
        NEMO_AUTOMODEL,
        "8 x H100, GBS 256, MBS 2, GA 16, seq 4,096, FSDP 8, TE + DeepEP + FlexAttn, full AC, "
        "10.04 s a step",
        "H100",
        8,
        13_058,
        GPT_OSS + gpt_oss_layers(24, 32) + layout(8, 2, 16),
        DEEPEP_FLEX,
        "EP column blank: EP 8 (one node)",
        "high",
        True,
    ),
    PublishedRun(
        "Qwen3-30B-A3B (NeMo AutoModel)",
        NEMO_AUTOMODEL,
        "8 x H100, GBS 512, MBS 4, GA 16, seq 4,096, EP 8, FSDP 8, TE + DeepEP, full AC, 21.773 s "
        "a step",
        "H100",
        8,
        12_040,
        QWEN3_30B_A3B + layout(8, 4, 16),
        DEEPEP_CUDNN,
        "",
        "high",
        True,
    ),
    PublishedRun(
        "Qwen3-30B-A3B, DeepEP (torchtitan)",
        TORCHTITAN_DEEPEP,
        "8 x B200, local batch 8 x 4,096, FSDP 8, EP 8, full AC, compiled, forced balance, "
        "DeepEP, SDPA (cuDNN); 341 TFLOP/s",
        "B200",
        8,
        14_796,
        QWEN3_30B_A3B + layout(8, 8, 1),
        DEEPEP_CUDNN,
        "",
        "high",
        True,
    ),
    PublishedRun(
        "Qwen3-30B-A3B, default EP (torchtitan)",
        TORCHTITAN_DEEPEP,
        "the same 8 x B200 step with torchtitan's default expert parallelism (NCCL "
        "all_to_all_single, split sizes copied to the host)",
        "B200",
        8,
        9_930,
        QWEN3_30B_A3B + layout(8, 8, 1, chunks=1),
        NCCL_CUDNN,
        "",
        "medium",
        True,
    ),
    PublishedRun(
        "GPT-OSS-120B (NeMo AutoModel)",
        NEMO_AUTOMODEL,
        "64 x H100, GBS 512, MBS 2, GA 4, seq 4,096, FSDP 64, TE + DeepEP + FlexAttn, full AC, "
        "4.30 s a step",
        "H100",
        64,
        7_626,
        GPT_OSS + gpt_oss_layers(36, 128) + layout(64, 2, 4),
        DEEPEP_FLEX,
        "EP column blank: EP 64 (FSDP over nodes would gather 29 GB a GPU a pass)",
        "medium",
        False,
    ),
    PublishedRun(
        "Qwen3-30B-A3B, DeepEP, 2 nodes (torchtitan)",
        TORCHTITAN_DEEPEP,
        "16 x B200, strong scaling of the run above: 14,380 tokens/s, 331 TFLOP/s",
        "B200",
        16,
        14_380,
        QWEN3_30B_A3B + layout(8, 8, 1),
        DEEPEP_CUDNN,
        "local batch 8 (the 16-node row equals the weak-scaling table's local batch 8 row)",
        "high",
        False,
    ),
    PublishedRun(
        "Qwen3-30B-A3B, DeepEP, 16 nodes (torchtitan)",
        TORCHTITAN_DEEPEP,
        "128 x B200, local batch 8, FSDP 128 (experts over 16 nodes), EP 8: 13,856 tokens/s, "
        "319 TFLOP/s",
        "B200",
        128,
        13_856,
        QWEN3_30B_A3B + layout(8, 8, 1),
        DEEPEP_CUDNN,
        "",
        "high",
        False,
    ),
    PublishedRun(
        "GPT-OSS-120B (Megatron-Bridge 25.11)",
        MEGATRON_BRIDGE,
        "64 x B200, BF16, GBS 512, MBS 4, seq 4,096, DDP, EP 8, GA 2: 8,213 tokens/s, 223 TFLOP/s",
        "B200",
        64,
        8_213,
        GPT_OSS + gpt_oss_layers(36, 128) + layout(8, 4, 2, "none", replicas=8) + MEGATRON_DDP,
        DEEPEP_CUDNN,
        "DDP with a distributed optimizer as HSDP (8 replicas of an 8-GPU node); recompute, "
        "dispatcher and attention kernel not stated: none, DeepEP, cuDNN",
        "low",
        False,
    ),
    PublishedRun(
        "GPT-OSS-120B (Megatron-Bridge 26.02)",
        MEGATRON_BRIDGE,
        "64 x B200, BF16, GBS 1280, MBS 4, seq 4,096, DDP, EP 64, GA 5: 8,047 tokens/s, 219 "
        "TFLOP/s",
        "B200",
        64,
        8_047,
        GPT_OSS + gpt_oss_layers(36, 128) + layout(64, 4, 5, "none") + MEGATRON_DDP,
        DEEPEP_CUDNN,
        "DDP as FSDP over the 64 GPUs; recompute, dispatcher and attention kernel not stated: "
        "none, DeepEP, cuDNN",
        "low",
        False,
    ),
]
