"""The GPUs the planner prices: their data-sheet peaks (Device) and what real kernels and
collectives reach of them on each generation (Efficiency), each number from a published measurement
cited beside it. planner.py reads both; nothing here runs a GPU."""

from __future__ import annotations

import dataclasses

from tools.memory import GPU_GIB

TFLOPS, TBPS, GBPS = 1e12, 1e12, 1e9


@dataclasses.dataclass(frozen=True)
class Device:
    """Dense peaks in FLOP/s and bandwidths in bytes/s per GPU (one direction for links)."""

    name: str
    bf16: float  # tensor cores, dense
    tf32: float  # tensor cores, dense
    fp32: float  # CUDA cores (FP32 matmuls at torch's default "highest" precision)
    hbm: float
    nvlink: float  # per GPU, each way
    network: float  # per GPU, each way
    gpus_per_node: int = 8
    memory_gib: float = 140.4  # usable (memory.GPU_GIB): what accumulation "auto" and search.py fit


GPUS = {
    # NVIDIA H100 Tensor Core GPU data sheet (SXM column; sparse figures halved to dense): BF16
    # 1,979 TFLOP/s sparse, TF32 989 sparse, FP32 67; HBM3 3.35 TB/s; NVLink 900 GB/s (both ways).
    # Network: DGX H100 user guide, 8 ConnectX-7 at 400 Gb/s InfiniBand, one per GPU.
    "H100": Device(
        "H100 SXM",
        989.4 * TFLOPS,
        494.7 * TFLOPS,
        67 * TFLOPS,
        3.35 * TBPS,
        450 * GBPS,
        50 * GBPS,
        memory_gib=GPU_GIB["80GB"],
    ),
    # NVIDIA H200 Tensor Core GPU data sheet (SXM): the H100's compute, HBM3e 4.8 TB/s, NVLink 900
    # GB/s. Network: HGX H200 reference, 400 Gb/s per GPU (ConnectX-7).
    "H200": Device(
        "H200 SXM", 989.4 * TFLOPS, 494.7 * TFLOPS, 67 * TFLOPS, 4.8 * TBPS, 450 * GBPS, 50 * GBPS
    ),
    # NVIDIA DGX B200 data sheet, per GPU of 8 (sparse halved): BF16 4.5 PFLOP/s sparse, TF32 2.2
    # sparse, FP32 75 TFLOP/s (600 for 8 GPUs); HBM3e 8 TB/s (64 for 8); NVLink 5 1.8 TB/s both
    # ways; 8 ConnectX-7 at 400 Gb/s.
    "B200": Device(
        "B200",
        2250 * TFLOPS,
        1100 * TFLOPS,
        75 * TFLOPS,
        8.0 * TBPS,
        900 * GBPS,
        50 * GBPS,
        memory_gib=179.0,
    ),  # 192 GB HBM3e, less what the driver keeps
}
# [parallel] fp8's matmuls, by Device name: the same data sheets' dense FP8 (E4M3) peaks (sparse
# halved: H100 and H200 3,958 TFLOP/s, B200 9 PFLOP/s). The CPU runs them at its measured rate. MFU
# stays against bf16.
FP8_PEAKS = {"H100 SXM": 1979 * TFLOPS, "H200 SXM": 1979 * TFLOPS, "B200": 4500 * TFLOPS}


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """What real kernels and collectives reach on one GPU kind, as fractions of its Device peaks
    (host_sync: seconds). The comments above each generation say which were fitted to a published
    run (planner.py --validate marks those runs) rather than measured by a benchmark."""

    gemm: float  # dense BF16 GEMMs at a transformer layer's shapes (TF32, FP32, FP8 alike)
    grouped_gemm: float  # torch._grouped_mm over the dense rate, before its part-filled tiles
    attention: dict[str, tuple[float, float]]  # backend: (forward, backward) of the BF16 peak
    hbm: float  # large copies, fused elementwise chains, foreach optimizer kernels
    nvlink_ring: float  # NCCL ring all-gather / reduce-scatter bus bandwidth, large messages
    network: float  # RDMA per GPU, 400 Gb/s ConnectX-7
    all_to_all: float  # DeepEP's expert all-to-all on NVLink (the published runs')
    all_to_all_nccl: float  # NCCL all_to_all_single on NVLink (moe.py's exchange)
    # one device-to-host copy (moe.py's split sizes, once per MoE layer): the GPU idles while the
    # queue behind it drains and the host launches the next kernels
    host_sync: float


# Hopper. Dense BF16 GEMMs: about 650-750 TFLOP/s of the H100 SXM's 989 under its 700 W cap (NVIDIA
# Transformer Engine and Megatron performance material quote 60-75 % for large BF16 GEMMs); 0.70 is
# their middle. Attention, FlashAttention-3 (Shah et al., 2024, https://arxiv.org/abs/2407.08608):
# FlashAttention-2 at 35 % forward and about 30 % backward of the H100's BF16 peak (head dim 128,
# long sequences), FlashAttention-3 (and cuDNN's Hopper kernels, the same class) about 600 TFLOP/s
# forward and 450 backward, causal, 4k tokens (0.60, 0.45). flex (Triton): the FlexAttention post
# (https://pytorch.org/blog/flexattention/) measures 90 % of FlashAttention-2 forward and 85 %
# backward. flash, flex's FLASH backend (PyTorch's "FlexAttention + FlashAttention-4" post,
# https://pytorch.org/?p=46919: flash-attn-4's CuTeDSL kernels, 1.2-3.2 x the Triton backend):
# FlashAttention-3's rates, the class FA4 reaches on Hopper. HBM: STREAM-like copies reach about 2.9
# of the H100's 3.35 TB/s (nvbandwidth, BabelStream). NCCL rings: nccl-tests on 8 x H100 SXM, about
# 360 of 450 GB/s bus bandwidth. Network: DeepEP's README (https://github.com/deepseek-ai/DeepEP)
# measures 43-47 GB/s RDMA per GPU of 50. The all-to-all: DeepEP's 153-158 GB/s on H800's 200 GB/s
# NVLink (0.77).
HOPPER_ATTENTION = {
    "flex": (0.90 * 0.35, 0.85 * 0.30),
    "fused": (0.60, 0.45),
    "flash": (0.60, 0.45),
}
# NCCL all_to_all_single, the exchange moe.py runs, fitted (like Blackwell's grouped GEMM) to
# torchtitan's own 8 x B200 runs of Qwen3-30B-A3B
# (https://github.com/pytorch/torchtitan/tree/main/torchtitan/distributed/deepep): its default
# expert parallelism (NCCL all_to_all_single, not overlapped, split sizes copied to the host as
# moe.py does) at 9,930 tokens/s against DeepEP's 14,796 on the same step. No B200- or H100-only
# measurement of it was found, so the fraction serves both generations. A host sync: no published
# measurement found; estimated at 100 microseconds (about 20 kernel launches of 5 us queued behind
# it before the GPU is busy again), host-side, so every generation alike.
ALL_TO_ALL_NCCL = 0.24
HOST_SYNC_SECONDS = 1e-4
HOPPER = Efficiency(
    gemm=0.70,
    grouped_gemm=1.0,
    attention=HOPPER_ATTENTION,
    hbm=0.87,
    nvlink_ring=0.80,
    network=0.90,
    all_to_all=0.77,
    all_to_all_nccl=ALL_TO_ALL_NCCL,
    host_sync=HOST_SYNC_SECONDS,
)
# Blackwell (B200, 1,000 W). GEMMs: a B200 runs mixed-precision GPT-1.3B training 1.55 x an H200
# (Jarmusch and Chandrasekaran, "Microbenchmarking NVIDIA's Blackwell Architecture",
# https://arxiv.org/abs/2512.02189) at 2.27 x its BF16 peak: the H100's 0.70 x 1.55 / 2.27 = 0.48.
# torch._grouped_mm's SM100 kernels (https://github.com/pytorch/pytorch/pull/156203, SM90's
# CUTLASS schedules ported) reach less again: fitted to torchtitan's 8 x B200 DeepEP run (14,796
# tokens/s, above). Attention: FlashAttention-4 reaches 1,613 TFLOP/s forward, 71 % of the B200's
# peak, 2.1-2.7 x Triton and up to 1.3 x cuDNN 9.13 (FA4's release,
# https://github.com/Dao-AILab/flash-attention, as summarised at https://theneuralfeed.com/article/
# flashattention-4-1613-tflops-s-2-7x-faster-than-triton-written-in-python-what-it/brUJfEuc);
# backward at FlashAttention-3's backward / forward ratio (0.75): flash (0.71, 0.53), cuDNN (0.55,
# 0.41), flex's Triton kernels at FA4 / 2.4 (0.30, 0.22). HBM: over 6,000 GB/s device-to-device of
# 8,000 on 8 x B200 HGX (https://www.newmind.ai/journal/18, TogetherAI B200 benchmark): 0.75.
# NVLink 5 rings, the network and the all-to-all: no B200 measurement found, Hopper's fractions.
BLACKWELL = Efficiency(
    gemm=0.70 * 1.55 * 989.4 / 2250,
    grouped_gemm=0.41,
    attention={"flex": (0.71 / 2.4, 0.53 / 2.4), "fused": (0.55, 0.41), "flash": (0.71, 0.53)},
    hbm=0.75,
    nvlink_ring=0.80,
    network=0.90,
    all_to_all=0.77,
    all_to_all_nccl=ALL_TO_ALL_NCCL,
    host_sync=HOST_SYNC_SECONDS,
)
# By the first word of a Device's name (a GPU kind). The H200 is the H100's GH100 die at the same
# 700 W with faster HBM3e (NVIDIA H200 data sheet): Hopper's fractions; no published H200
# copy-bandwidth measurement was found, so its HBM fraction is the H100's too.
EFFICIENCIES = {"H100": HOPPER, "H200": HOPPER, "B200": BLACKWELL}
# A measured CPU (planner --gpu cpu): its rates are measured now, so every fraction is 1.
MEASURED = Efficiency(
    gemm=1.0,
    grouped_gemm=1.0,
    attention={backend: (1.0, 1.0) for backend in HOPPER_ATTENTION},
    hbm=1.0,
    nvlink_ring=1.0,
    network=1.0,
    all_to_all=1.0,
    all_to_all_nccl=1.0,
    host_sync=0.0,
)
ATTENTION_BACKENDS = tuple(HOPPER_ATTENTION)


def efficiency_of(device: Device) -> Efficiency:
    """The calibrated fractions of `device`'s generation, by the first word of its name (a measured
    CPU: all 1)."""
    return EFFICIENCIES.get(device.name.split()[0], MEASURED)
