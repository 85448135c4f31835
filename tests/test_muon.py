"""muon.py against a plain per-matrix reference written from its contract (the module docstring):
the Newton-Schulz iteration, which parameters it takes, and whole optimizer steps; on two ranks with
FSDP and expert parallelism."""

import math

import pytest
import torch

import train
from config import OptimSection
from helpers import (
    assert_close_to_scale,
    assert_weights_match,
    build,
    give_same_gradients,
    only,
    run_debug,
    spawn,
    tiny_config,
    train_losses,
)
from muon import newton_schulz, takes_muon

pytestmark = pytest.mark.usefixtures("one_thread")
MUON = OptimSection(
    name="muon",
    lr=1e-3,
    muon_lr=0.05,
    muon_momentum=0.9,
    weight_decay=0.1,
    beta1=0.8,
    beta2=0.9,
    eps=1e-6,
)


def plain_newton_schulz(matrix: torch.Tensor) -> torch.Tensor:
    """One 2-D matrix, five quintic steps on its wide orientation after a Frobenius
    normalisation."""
    x = matrix if matrix.shape[0] <= matrix.shape[1] else matrix.T
    x = x / (torch.sqrt((x * x).sum()) + 1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = 3.4445 * x + (-4.7750 * gram + 2.0315 * gram @ gram) @ x
    return x if matrix.shape[0] <= matrix.shape[1] else x.T


def plain_muon_update(update: torch.Tensor) -> torch.Tensor:
    """Each trailing matrix on its own (one expert at a time for [E, rows, cols]), times sqrt(max(1,
    rows/cols))."""
    scale = math.sqrt(max(1.0, update.shape[-2] / update.shape[-1]))
    if update.dim() == 2:
        return plain_newton_schulz(update) * scale
    return torch.stack([plain_newton_schulz(matrix) for matrix in update]) * scale


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (3, 8, 5)])
def test_newton_schulz_matches_the_plain_iteration_and_orthogonalises(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    expected = torch.stack([plain_newton_schulz(m) for m in g.reshape(-1, *shape[-2:])]).reshape(
        shape
    )
    assert_close_to_scale(newton_schulz(g), expected, rtol=1e-5)
    singular = torch.linalg.svdvals(newton_schulz(g))
    # the quintic's band around 1, not exactly 1
    assert singular.min() > 0.5 and singular.max() < 1.3


# Against Flint's names, and with every parameter trainable (the plain reference steps them all).
FLINT = only("flint")


@FLINT
def test_muon_takes_the_block_matrices_and_experts_only():
    model = build(tiny_config("flint", num_hidden_layers=3))
    taken = {name for name, param in model.named_parameters() if takes_muon(name, param)}
    assert (
        "layers.2.mlp.experts.gate_up_proj" in taken and "layers.0.self_attn.q_proj.weight" in taken
    )
    assert (
        not {
            "embed_tokens.weight",
            "lm_head.weight",
            "layers.2.mlp.router.weight",
            "layers.0.self_attn.sinks.weight",
            "layers.0.input_layernorm.weight",
        }
        & taken
    )


def muon_matches_plain(model: torch.nn.Module, reference: torch.nn.Module, steps: int = 3) -> None:
    """train.build_optimizer with [optim] name = "muon" on `model` (plain tensors or DTensor shards)
    against the plain per-matrix update on `reference` (full tensors) and torch's AdamW for the
    parameters Muon does not take, fed the same random gradients and learning rates."""
    chosen = train.build_optimizer(model, MUON)
    references = dict(reference.named_parameters())
    muon_names = [n for n, p in references.items() if takes_muon(n, p)]
    others = [p for n, p in references.items() if n not in muon_names]
    adamw = torch.optim.AdamW(
        [
            {"params": [p for p in others if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in others if p.dim() < 2], "weight_decay": 0.0},
        ],
        betas=(0.8, 0.9),
        eps=1e-6,
        foreach=False,
    )
    momenta = {n: torch.zeros_like(references[n]) for n in muon_names}
    generator = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        lr = 1e-3 / step
        train.set_learning_rate(chosen, lr)
        train.set_learning_rate(adamw, lr)
        give_same_gradients(model, references, generator)
        chosen.step()
        adamw.step()
        with torch.no_grad():
            for name in muon_names:
                weight, grad = references[name], references[name].grad
                momenta[name] = 0.9 * momenta[name] + 0.1 * grad
                update = plain_muon_update(grad + 0.9 * (momenta[name] - grad))
                weight.mul_(1 - lr * 50 * 0.1).sub_(lr * 50 * update)  # muon_lr / lr = 50
    assert_weights_match(model, references, rtol=1e-5)


@FLINT
def test_muon_steps_like_the_plain_reference():
    config = tiny_config("flint", num_hidden_layers=3)
    muon_matches_plain(build(config), build(config))


def check_muon_on_shards(layouts: list[dict]) -> None:
    from parallel import ParallelConfig, build_mesh, parallelize

    config = tiny_config("flint")
    for layout in layouts:
        cfg = ParallelConfig.from_dict({"param_dtype": "float32", **layout})
        pm = parallelize(build(config), cfg, build_mesh(cfg, "cpu", config.num_experts))
        muon_matches_plain(pm.module, build(config))


@pytest.mark.slow
@FLINT
def test_muon_steps_like_the_plain_reference_on_two_ranks():
    """FSDP 2 (every matrix sharded on its rows: gathered, orthogonalised whole, re-sharded) and
    EP 2 (each rank orthogonalises its own experts' matrices, no communication)."""
    spawn(2, check_muon_on_shards, [{"dp_shard": 2}, {"ep": 2, "dp_shard": 1}])


@pytest.mark.slow
def test_a_muon_run_saves_and_resumes_exactly(tmp_path):
    """train.py with [optim] name = "muon": the momentum buffers and AdamW states go through the
    checkpoint, so a resume from step 2 gives the uninterrupted losses of steps 3 and 4 bit for bit
    (the optimizer's machinery: the first registered family)."""
    import shutil

    common = [
        "--optim.name=muon",
        "--training.steps=4",
        "--logging.every=1",
        "--checkpoint.every=2",
        "--checkpoint.keep_last=2",
        "--training.sample_tokens=0",
    ]
    run_debug(tmp_path, *common)
    uninterrupted = train_losses(tmp_path)
    assert uninterrupted[4] < uninterrupted[1]
    shutil.rmtree(tmp_path / "ckpt" / "run_0001" / "step_00000004")
    run_debug(tmp_path, *common, "--checkpoint.resume=auto")
    assert train_losses(tmp_path) == uninterrupted


def check_muon_on_a_dim_1_split() -> None:
    """One expert over 2 FSDP ranks: dim 0 is shorter than the shards, so FSDP splits each expert
    matrix along dim 1 (least_padding, Large 4's layout at scale), and Muon must gather it whole."""
    from torch.distributed.tensor import Shard

    from parallel import ParallelConfig, build_mesh, parallelize

    config = tiny_config("flint", num_experts=1, num_experts_per_tok=1)
    cfg = ParallelConfig.from_dict({"param_dtype": "float32", "dp_shard": 2})
    pm = parallelize(build(config), cfg, build_mesh(cfg, "cpu", config.num_experts))
    assert pm.module.layers["2"].mlp.experts.gate_up_proj.placements == (Shard(1),)
    muon_matches_plain(pm.module, build(config))


@pytest.mark.slow
@FLINT
def test_muon_gathers_experts_split_along_dim_1():
    """Treated as whole local matrices, such slices would each be orthogonalised on their own."""
    spawn(2, check_muon_on_a_dim_1_split)
