"""tools/op_trace.py: the FLOPs and bytes a step's ops are recorded with, counted by hand."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from tools.op_trace import CUSTOM_FLOPS, StepRecorder, fuse_chains


def record(step, q_len: int = 0, kv_len: int = 0) -> StepRecorder:
    """Run step() on fake tensors under a StepRecorder (and FlopCounterMode, for its total)."""
    recorder = StepRecorder(q_len, kv_len)
    with (
        FakeTensorMode(),
        FlopCounterMode(display=False, custom_mapping=CUSTOM_FLOPS) as counter,
        recorder,
    ):
        step()
    recorder.counted = counter.get_total_flops()
    fuse_chains(recorder.calls)
    return recorder


def test_matmul_flops_and_bytes_equal_the_hand_count():
    """y = x @ w with gradients for both: 2MKN forward, 2MKN for dx and 2MKN for dw; the forward
    matmul reads x and w and writes y (FP32, 4 bytes each), and FlopCounterMode agrees."""
    m, k, n = 48, 32, 16

    def step():
        x = torch.empty(m, k, requires_grad=True)
        w = torch.empty(k, n, requires_grad=True)
        (x @ w).backward(torch.empty(m, n))

    recorder = record(step)
    costs = list(recorder.costs.values())
    assert sum(c.flops for c in costs) == 6 * m * k * n == recorder.counted
    forward = [c for c in costs if c.op == "mm" and c.shapes == f"[{m}, {k}]x[{k}, {n}]"]
    assert len(forward) == 1 and forward[0].bytes == 4 * (m * k + k * n + m * n)
    assert {c.op for c in costs if c.flops} == {"mm"}


def test_views_move_nothing_and_indexed_ops_move_only_their_rows():
    rows, width, picked = 1000, 64, 10

    def step():
        table = torch.empty(rows, width)
        index = torch.zeros(picked, dtype=torch.long)
        table.t()  # a view
        table.index_select(0, index)  # reads 10 rows, writes 10 rows, reads the index
        # reads the source and the index, writes 10 rows
        table.index_add_(0, index, torch.empty(picked, width))

    costs = {c.op: c.bytes for c in record(step).costs.values()}
    assert costs["t"] == 0
    assert costs["index_select"] == 2 * 4 * picked * width + 8 * picked
    assert costs["index_add_"] == 8 * picked + 2 * 4 * picked * width


def test_fused_chain_reads_its_input_and_writes_its_result_once():
    """((x * 2) + 1) to BF16, then a matmul: eager, each op reads and writes [n] (4 + 4, 4 + 4, 4 +
    2 bytes per element); fused, the chain reads x once (4) and writes the BF16 result the matmul
    reads (2). A matmul is never fused."""
    n = 1024

    def step():
        x = torch.empty(n)
        y = ((x * 2) + 1).to(torch.bfloat16)
        y @ torch.empty(n, 8, dtype=torch.bfloat16)

    costs = list(record(step).costs.values())
    chain = [c for c in costs if c.op in ("mul", "add", "_to_copy")]
    assert len(chain) == 3 and sum(c.bytes for c in chain) == (8 + 8 + 6) * n
    assert sum(c.fused_bytes for c in chain) == (4 + 2) * n
    mm = next(c for c in costs if c.flops)
    assert mm.fused_bytes == mm.bytes > 0


def test_a_chain_is_not_fused_across_the_forward_and_backward_graphs():
    """x * 2 in the forward, then + 1 on its result in the backward: two compiled graphs, so the
    product reaches memory between them. Each op reads and writes [n] FP32 (4 + 4 bytes per
    element), fused or not."""
    n = 1024
    recorder = StepRecorder(0, 0)
    with FakeTensorMode(), recorder:
        y = torch.empty(n) * 2
        recorder.phase = "backward"
        y + 1
    fuse_chains(recorder.calls)
    chain = [c for c in recorder.costs.values() if c.op in ("mul", "add")]
    assert [(c.phase, c.op) for c in chain] == [("forward", "mul"), ("backward", "add")]
    assert [c.fused_bytes for c in chain] == [8 * n, 8 * n]


def test_score_matrices_mark_the_attention_core():
    """Ops on a [B, H, q_len, kv_len] tensor belong to the attention core (a flex kernel on a
    GPU)."""

    def step():
        q, k = torch.empty(2, 4, 16, 8), torch.empty(2, 4, 16, 8)
        torch.softmax(q @ k.transpose(-1, -2), dim=-1)  # [2, 4, 16, 16] scores
        q * 2  # not part of it

    cores = {c.op: c.attention_core for c in record(step, 16, 16).costs.values()}
    assert cores["matmul"] if "matmul" in cores else cores["bmm"]
    assert cores["_softmax"] and not cores["mul"]
