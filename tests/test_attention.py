"""attention.py against the plain reference: masks, both backends, values and gradients.

FlexAttention refuses to run backward on the CPU (`_validate_device` raises before the call),
although its eager implementation is differentiable. The `flex_cpu_backward` fixture lifts that one
check for the duration of a test, so flex gradients are checked here against the reference too."""

import re

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module

import attention as A
from reference import reference_attention, reference_mask


@pytest.fixture
def flex_cpu_backward(monkeypatch):
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)


def random_qkv(batch, q_heads, kv_heads, seq_len, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, seq_len, head_dim, generator=g)
    k = torch.randn(batch, kv_heads, seq_len, head_dim, generator=g)
    v = torch.randn(batch, kv_heads, seq_len, head_dim, generator=g)
    sinks = torch.randn(q_heads, generator=g)
    return [t.requires_grad_() for t in (q, k, v, sinks)]


def packed_doc_ids(seq_len):
    """Row 0: three documents; row 1: two documents then padding (-1)."""
    row0 = [0] * (seq_len // 3) + [1] * (seq_len // 3)
    row0 += [2] * (seq_len - len(row0))
    row1 = [5] * (seq_len // 2) + [6] * (seq_len // 4)
    row1 += [-1] * (seq_len - len(row1))
    return torch.tensor([row0, row1])


CASES = {  # name: (layer type, window, with documents)
    "causal": (A.FULL, None, False),
    "sliding": (A.SLIDING, 7, False),
    "documents": (A.FULL, None, True),
    "sliding+documents+padding": (A.SLIDING, 5, True),
}


def dense(backend_attend):
    """Always the dense boolean mask, whatever build_masks would choose."""

    def build(layer_type, window, doc_ids, batch, seq_len):
        return A.dense_mask(
            A.layer_mask_mod(layer_type, window, doc_ids), batch, seq_len, seq_len, "cpu"
        )

    return build, backend_attend


def built(backend):
    def build(layer_type, window, doc_ids, batch, seq_len):
        return A.build_masks([layer_type], window, doc_ids, batch, seq_len, "cpu", backend)[
            layer_type
        ]

    return build, A.sink_attention


# Every implementation of attention with sinks: FlexAttention (BlockMask); the sdpa backend as the
# model uses it (banded on long sliding layers); the CPU's fused flash kernel on a dense mask; SDPA
# with a sink column (the sdpa backend off the CPU).
IMPLEMENTATIONS = {
    "flex": built("flex"),
    "sdpa": built("sdpa"),
    "cpu_flash": dense(A.dense_sink_attention),
    "sdpa_column": dense(A.sdpa_sink_attention),
}


def check_against_reference(implementation, case, heads=(8, 2), head_dim=64, seq_len=40):
    layer_type, window, with_docs = CASES[case]
    build, attend = IMPLEMENTATIONS[implementation]
    batch = 2
    doc_ids = packed_doc_ids(seq_len) if with_docs else None
    q, k, v, sinks = random_qkv(batch, *heads, seq_len, head_dim)
    out = attend(q, k, v, sinks, build(layer_type, window, doc_ids, batch, seq_len))

    ref_inputs = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    allowed = reference_mask(layer_type, window if window else seq_len, doc_ids, seq_len, batch)
    expected = reference_attention(*ref_inputs, allowed)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)

    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected.backward(grad_out)
    for name, fast, ref in zip("q k v sinks".split(), (q, k, v, sinks), ref_inputs):
        torch.testing.assert_close(fast.grad, ref.grad, rtol=1e-5, atol=1e-5, msg=f"grad of {name}")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_matches_reference(implementation, case, flex_cpu_backward):
    check_against_reference(implementation, case)


@pytest.mark.parametrize("implementation", ["sdpa", "cpu_flash", "sdpa_column"])
def test_head_dim_and_gqa_variants(implementation):
    check_against_reference(implementation, "sliding+documents+padding", heads=(4, 4), head_dim=16)
    check_against_reference(implementation, "causal", heads=(6, 1), head_dim=32)


def test_window_edge_counts_the_current_token():
    mod = A.layer_mask_mod(A.SLIDING, 513, None)
    q, key = torch.tensor(600), torch.tensor([600 - 512, 600 - 513])
    zero = torch.tensor(0)
    assert mod(zero, zero, q, key).tolist() == [True, False]
    dense = A.dense_mask(mod, 1, 600, 600, "cpu")[0, 0]
    assert dense.sum(-1).max().item() == 513


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_window_edge_through_attention(implementation):
    """Key q-512 contributes to the output, key q-513 does not (window 513, both backends)."""
    seq_len, q_pos = 1100, 1060  # long enough for the banded sdpa path (blocks of 512)
    q = torch.zeros(1, 1, seq_len, 8)
    k = torch.zeros(1, 1, seq_len, 8)
    v = torch.zeros(1, 1, seq_len, 8)
    v[0, 0, q_pos - 512, 0] = 1.0  # inside the window
    v[0, 0, q_pos - 513, 1] = 1.0  # just outside
    build, attend = IMPLEMENTATIONS[implementation]
    out = attend(q, k, v, torch.zeros(1), build(A.SLIDING, 513, None, 1, seq_len))[0, 0, q_pos]
    assert out[0].item() == pytest.approx(1 / 514)  # 513 equal keys plus the sink column
    assert out[1].item() == 0.0


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_padding_query_outputs_zeros(implementation, flex_cpu_backward):
    q, k, v, sinks = random_qkv(1, 2, 1, 8, 4)
    doc_ids = torch.tensor([[0, 0, 0, 0, 0, -1, -1, -1]])
    build, attend = IMPLEMENTATIONS[implementation]
    out = attend(q, k, v, sinks, build(A.FULL, None, doc_ids, 1, 8))
    assert torch.isfinite(out).all()
    assert out[0, :, 5:].abs().max().item() == 0.0
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v, sinks))


def test_long_sliding_layers_are_banded():
    """Sliding layers much longer than the window use the banded mask; the tests above check it."""
    masks = A.build_masks([A.SLIDING, A.FULL], 7, None, 2, 40, "cpu", "sdpa")
    assert isinstance(masks[A.SLIDING], A.BandMask) and masks[A.SLIDING].allowed.shape == (
        2 * 7,
        1,
        6,
        12,
    )
    assert masks[A.FULL].shape == (2, 1, 40, 40)
    window_edge = A.build_masks([A.SLIDING], 513, None, 1, 2000, "cpu", "sdpa")[A.SLIDING]
    assert window_edge.allowed.sum(-1).max().item() == 513


def test_block_masks_without_documents_are_cached():
    first = A.build_masks([A.SLIDING], 5, None, 2, 256, "cpu", "flex")[A.SLIDING]
    second = A.build_masks([A.SLIDING], 5, None, 2, 256, "cpu", "flex")[A.SLIDING]
    assert first is second


def a_gpu(monkeypatch, capability: tuple[int, int], package: bool) -> None:
    """A CUDA device of `capability` (named "GPU") with or without the flash-attn-4 package."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU")
    monkeypatch.setattr(A, "flash_package_available", lambda: package)


@pytest.mark.parametrize(
    "capability, package, chosen",
    [
        ((9, 0), True, A.FLASH_OR_FLEX),
        ((10, 0), True, A.FLASH_OR_FLEX),
        ((9, 0), False, "flex"),
        ((8, 0), True, "flex"),
        ((12, 0), True, "flex"),
    ],
)
def test_auto_picks_flash_only_where_it_runs(monkeypatch, capability, package, chosen):
    """Hopper and Blackwell with flash-attn-4 installed: flash (for BF16 and FP16 attention);
    otherwise flex on GPUs, sdpa on the CPU; explicit flex and sdpa stay what they are."""
    a_gpu(monkeypatch, capability, package)
    cuda = torch.device("cuda")
    assert A.resolve_backend("auto", cuda) == chosen
    assert A.resolve_backend("auto", torch.device("cpu")) == "sdpa"
    assert A.resolve_backend("flex", cuda) == "flex" and A.resolve_backend("sdpa", cuda) == "sdpa"
    assert A.resolve_backend("auto", cuda, flash=False) == "flex"  # Large 4's attention
    with pytest.raises(ValueError, match="attention_backend"):
        A.resolve_backend("xformers", torch.device("cpu"))


@pytest.mark.parametrize(
    "device, capability, package, flash, reason",
    [
        ("cpu", (9, 0), True, True, "needs a CUDA GPU .* on the CPU"),
        ("cuda", (8, 0), True, True, "Hopper or Blackwell .* GPU has 8.0"),
        ("cuda", (9, 0), False, True, "flash-attn-4 package .* not installed"),
        ("cuda", (9, 0), True, False, "Flint's sink attention only"),
    ],
)
def test_flash_where_it_cannot_run_is_refused_in_one_line(
    monkeypatch, device, capability, package, flash, reason
):
    a_gpu(monkeypatch, capability, package)
    with pytest.raises(ValueError) as caught:
        A.resolve_backend("flash", torch.device(device), flash=flash)
    message = str(caught.value)
    assert "\n" not in message and message.startswith('attention_backend = "flash"'), message
    assert re.search(reason, message), message


def test_flash_is_refused_with_deterministic_algorithms_on_hopper(monkeypatch):
    """torch 2.13's FLASH backward with a block mask is deterministic on SM100+ only."""
    a_gpu(monkeypatch, (9, 0), True)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    with pytest.raises(ValueError, match="deterministic backward"):
        A.resolve_backend("flash", torch.device("cuda"))
    assert A.resolve_backend("auto", torch.device("cuda")) == "flex"
    a_gpu(monkeypatch, (10, 0), True)
    assert A.resolve_backend("flash", torch.device("cuda")) == "flash"


def flex_calls(monkeypatch) -> list[dict | None]:
    """The kernel_options of each flex_attention call, which then runs as plain flex on the CPU."""
    calls, real = [], A.flex_attention

    def recording(*args, kernel_options=None, **kwargs):
        calls.append(kernel_options)
        return real(*args, **kwargs)

    monkeypatch.setattr(A, "flex_attention", recording)
    return calls


def test_the_flash_backend_reaches_flex_attention_as_its_kernel_options(monkeypatch):
    """flash masks (FlashMask) send {"BACKEND": "FLASH"} to flex_attention, flex masks send none;
    the values are flex's (the FLASH kernel itself runs on GPUs only: tools/gpu_check.sh)."""
    calls = flex_calls(monkeypatch)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 16, generator=g).bfloat16() for _ in range(3))
    sinks = torch.tensor([0.5, -1.0])
    outs = {}
    for backend in ("flex", "flash"):
        masks = A.build_masks([A.FULL], None, None, 1, 128, "cpu", backend)
        assert isinstance(masks[A.FULL], A.FlashMask) == (backend == "flash")
        outs[backend] = A.sink_attention(q, k, v, sinks, masks[A.FULL])
    assert calls == [None, {"BACKEND": "FLASH"}]
    assert torch.equal(outs["flash"], outs["flex"])


def test_auto_runs_fp32_attention_on_flex_and_bf16_on_flash(monkeypatch):
    """auto's choice where FLASH runs (FLASH_OR_FLEX): BF16 to FLASH, FP32 (which flash-attn-4
    does not take) to flex, not refused: the user asked for no backend by name."""
    calls = flex_calls(monkeypatch)
    mask = A.build_masks([A.FULL], None, None, 1, 128, "cpu", A.FLASH_OR_FLEX)[A.FULL]
    assert mask == A.FlashMask(mask.block_mask, required=False)
    q = torch.randn(1, 2, 128, 16)
    A.sink_attention(q.bfloat16(), q.bfloat16(), q.bfloat16(), torch.zeros(2), mask)
    A.sink_attention(q, q, q, torch.zeros(2), mask)
    assert calls == [{"BACKEND": "FLASH"}, None]


def test_flash_refuses_fp32_attention_in_one_line(monkeypatch):
    """flash-attn-4 runs BF16 and FP16 only: FP32 q, k, v are refused, never run on flex."""
    calls = flex_calls(monkeypatch)
    q = torch.randn(1, 2, 128, 16)
    mask = A.build_masks([A.FULL], None, None, 1, 128, "cpu", "flash")[A.FULL]
    with pytest.raises(
        ValueError, match=r'^attention_backend = "flash" runs BF16 or FP16 .*float32'
    ):
        A.sink_attention(q, q, q, torch.zeros(2), mask)
    assert calls == []


def test_a_flint_model_with_the_flash_backend_builds_flash_masks(monkeypatch):
    """[model] attention_backend = "flash" through the model's own mask building (what every
    block reads), in a rehearsal's CUDA choices: FlashMasks for every layer type."""
    from devices import targeting
    from helpers import build, tiny_config

    monkeypatch.setattr(A, "flash_package_available", lambda: True)
    model = build(tiny_config("flint", attention_backend="flash"))
    with targeting("cuda"):
        _, masks = model.block_inputs(None, None, 1, 128, torch.device("cpu"))
    assert masks and all(
        isinstance(mask, A.FlashMask) and mask.required for mask in masks.values()
    ), masks


def test_kv_cache_keeps_window_minus_one_keys():
    cache = A.KVCache(window=4)
    k = torch.randn(1, 1, 10, 2)
    _, _, allowed = cache.update(k, k, torch.arange(10))
    assert cache.k.shape[2] == 3 and cache.positions.tolist() == [7, 8, 9]
    assert allowed[0, 0].sum(-1).tolist() == [1, 2, 3, 4, 4, 4, 4, 4, 4, 4]
    keys, _, allowed = cache.update(k[:, :, :1], k[:, :, :1], torch.tensor([10]))
    assert keys.shape[2] == 4 and allowed.all()


def test_sdpa_sink_logit_stays_fp32_with_bf16_inputs():
    """The sink contract is FP32. BF16 q, k, v whose scores are all 100, and a sink of 100.2, which
    BF16 would round to 100.0: query i sees i + 1 keys, so keep = (i + 1) / (i + 1 + e^0.2) and the
    output is keep * the mean of its values. A BF16 sink moves the first output by 10%."""
    batch, heads, seq_len, dim = 1, 2, 4, 16
    # q . k / sqrt(16) = 100
    q = torch.full((batch, heads, seq_len, dim), 5.0, dtype=torch.bfloat16)
    k = torch.full((batch, 1, seq_len, dim), 5.0, dtype=torch.bfloat16)
    v = torch.randn(batch, 1, seq_len, dim, generator=torch.Generator().manual_seed(0)).to(
        torch.bfloat16
    )
    sinks = torch.full((heads,), 100.2)
    allowed = torch.ones(seq_len, seq_len, dtype=torch.bool).tril().view(1, 1, seq_len, seq_len)
    out = A.sdpa_sink_attention(q, k, v, sinks, allowed)
    seen = torch.arange(1, seq_len + 1, dtype=torch.float32).view(1, 1, seq_len, 1)
    keep = seen / (seen + torch.exp(torch.tensor(0.2)))
    expected = keep * v.float().cumsum(2) / seen  # [B, 1, T, D] -> broadcasts over the heads
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.expand_as(out), rtol=1e-2, atol=1e-2)


@pytest.mark.slow
def test_flash_on_the_cpu_stops_train_py_before_the_run(tmp_path):
    from config import ConfigError
    from helpers import debug_args, stops_with_one_line
    from train import main

    args = debug_args(tmp_path, "--model.attention_backend=flash", "--training.device=cpu")
    stops_with_one_line(
        lambda: main(args), ConfigError, "model.attention_backend", r'"flash" needs a CUDA GPU'
    )
    assert not (tmp_path / "ckpt").exists()
