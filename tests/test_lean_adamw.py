"""lean_adamw.py: AdamW with BF16 moments ([optim] state_dtype = "bfloat16") against an FP64 AdamW
written from its formula, its stochastic rounding, the states' dtype in the optimizer and through a
checkpoint."""

import shutil

import pytest
import torch

from config import OptimSection
from lean_adamw import BF16StatesAdamW, round_stochastic

BETAS, EPS, LR, WEIGHT_DECAY, STEPS = (0.9, 0.95), 1e-8, 1e-2, 0.1, 6
BF16_UNIT = 2.0**-7  # a BF16 value's spacing is at most 2^-7 of its magnitude (8 significant bits)


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    """1 + 2^-10 lies 1/8 of the way from 1 to the next BF16 value 1 + 2^-7 (and its negative
    likewise): each draw is one of the two, and the mean of 200k draws is x within 5 standard
    deviations (2^-7 * 5 * sqrt(1/8 * 7/8 / 200k)); round-to-nearest would give 1, 2^-10 off."""
    generator = torch.Generator().manual_seed(0)
    for sign in (1.0, -1.0):
        x = torch.full((200_000,), sign * (1 + 2.0**-10))
        rounded = round_stochastic(x, generator)
        assert rounded.dtype == torch.bfloat16
        assert set(rounded.float().unique().tolist()) == {sign, sign * (1 + BF16_UNIT)}
        error = (rounded.double().mean() - x.double().mean()).abs().item()
        assert error < BF16_UNIT * 5 * (1 / 8 * 7 / 8 / 200_000) ** 0.5, error


def make_params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(16) * 1e-3)]


def gradients(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    # gradients whose scale alternates, so the moments do not settle
    scale = 1 + step % 2
    return [torch.randn(64, 64, generator=generator) * scale, torch.randn(16, generator=generator)]


def fp64_adamw(params: list[torch.Tensor], decays: list[float]):
    """AdamW from its formula in FP64, with a first-order bound on how far BF16 moments can take
    each element: a stored moment is off by at most one BF16 unit of itself per rounding, decayed by
    beta afterwards (bm, bv), and the update m_hat / (sqrt(v_hat) + eps) moves by dm / (sqrt(v_hat)
    + eps) plus |update| * dv / (2 v) through the previous step's errors. Yields each step's
    weights, moments and bounds."""
    (beta1, beta2), weights = BETAS, [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(w) for w in weights]
    v = [torch.zeros_like(w) for w in weights]
    bm, bv, bp = ([torch.zeros_like(w) for w in weights] for _ in range(3))
    for step in range(1, STEPS + 1):
        for i, (grad, decay) in enumerate(zip(gradients(step), decays)):
            grad = grad.double()
            m[i] = beta1 * m[i] + (1 - beta1) * grad
            v[i] = beta2 * v[i] + (1 - beta2) * grad**2
            m_hat, v_hat = m[i] / (1 - beta1**step), v[i] / (1 - beta2**step)
            update = LR * m_hat / (v_hat.sqrt() + EPS)
            carried_m, carried_v = beta1 * bm[i], beta2 * bv[i]  # the stored moments' errors
            bp[i] += LR * carried_m / (1 - beta1**step) / (v_hat.sqrt() + EPS)
            bp[i] += update.abs() * carried_v / (2 * v[i] + EPS)
            weights[i] = weights[i] * (1 - LR * decay) - update
            bm[i] = carried_m + BF16_UNIT * m[i].abs()
            bv[i] = carried_v + BF16_UNIT * v[i]
        yield weights, m, v, bp, bm, bv


def test_bf16_moments_stay_within_their_rounding_of_fp64_adamw():
    """Six steps of BF16StatesAdamW (a decayed matrix and an undecayed vector) against FP64 AdamW:
    each moment within its rounding bound, each weight within the bound those errors carry into
    the updates (with 50 % for second-order terms), plus FP32's own rounding; and the BF16 moments
    do differ from FP64 by more than FP32 would (the bound is not vacuous)."""
    params = make_params()
    decays = [WEIGHT_DECAY, 0.0]
    optimizer = BF16StatesAdamW(
        [{"params": [params[0]], "weight_decay": decays[0]}, {"params": [params[1]]}],
        lr=LR,
        betas=BETAS,
        eps=EPS,
    )
    reference = fp64_adamw([p.detach().clone() for p in params], decays)  # before any step
    for step in range(1, STEPS + 1):
        for param, grad in zip(params, gradients(step)):
            param.grad = grad
        optimizer.step()
        weights, m, v, bp, bm, bv = next(reference)
        for i, param in enumerate(params):
            state = optimizer.state[param]
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
            assert int(state["step"]) == step
            fp32 = 1e-6 * (m[i].abs() + 1e-30)
            assert ((state["exp_avg"].double() - m[i]).abs() <= bm[i] + fp32).all(), (step, i)
            fp32 = 1e-6 * v[i]
            assert ((state["exp_avg_sq"].double() - v[i]).abs() <= bv[i] + fp32).all(), (step, i)
            slack = 1.5 * bp[i] + 1e-6 * (weights[i].abs() + LR)  # FP32: of the weight, the update
            assert ((param.detach().double() - weights[i]).abs() <= slack).all(), (step, i)
    state = optimizer.state[params[0]]
    assert (state["exp_avg"].double() - m[0]).abs().max() > 1e-4 * m[0].abs().max()
    # Unbiased: over the 4096 elements, the mean relative error of each moment is the mean of
    # independent roundings (each within a BF16 unit, decayed by beta per step): within 5 standard
    # deviations of 0, where a systematic error of a few tenths of a percent is not
    for moment, want, beta in (
        (state["exp_avg"], m[0], BETAS[0]),
        (state["exp_avg_sq"], v[0], BETAS[1]),
    ):
        large = want.abs() > 1e-3 * want.abs().max()
        relative = (moment.double() - want)[large] / want[large]
        sigma = BF16_UNIT * (1 / (1 - beta**2)) ** 0.5 / large.sum() ** 0.5
        assert relative.mean().abs() < 5 * sigma, (relative.mean(), sigma)


def test_state_dtype_reaches_the_optimizers_states_and_survives_load_state_dict():
    """train.build_optimizer with [optim] state_dtype: AdamW's moments (and Muon's AdamW groups')
    are BF16 after a step, FP32 by default; Muon's momentum stays FP32; a state_dict round trip
    (how a checkpoint resumes) keeps them BF16 where torch's load_state_dict would cast them to the
    parameters' FP32."""
    import train

    for name in ("adamw", "muon"):
        for state_dtype, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            torch.manual_seed(0)
            # layers.0.weight takes Muon; the bias and the norm AdamW
            model = torch.nn.ModuleDict(
                {
                    "layers": torch.nn.Sequential(torch.nn.Linear(8, 8)),
                    "norm": torch.nn.LayerNorm(8),
                }
            )
            optimizer = train.build_optimizer(
                model, OptimSection(name=name, state_dtype=state_dtype)
            )
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            optimizer.step()
            optimizer.load_state_dict(optimizer.state_dict())
            moments = [
                s[key]
                for s in optimizer.state.values()
                for key in ("exp_avg", "exp_avg_sq")
                if key in s
            ]
            assert moments and {m.dtype for m in moments} == {dtype}, (name, state_dtype)
            momenta = [
                s["momentum_buffer"] for s in optimizer.state.values() if "momentum_buffer" in s
            ]
            assert {m.dtype for m in momenta} == ({torch.float32} if name == "muon" else set())


@pytest.mark.slow
def test_bf16_states_resume_exactly_and_are_saved_in_bf16(tmp_path):
    """train.py with state_dtype bfloat16: 5 steps, a checkpoint every 2; resumed from step 2, the
    losses of steps 3-5 equal the uninterrupted run's bit for bit (the same moments, and the same
    random bits: step 3's rounding first moves step 5's loss), and the checkpoint's metadata holds
    the moments as BF16."""
    from checkpoint_files import read_metadata
    from helpers import records, run_debug, train_losses

    common = [
        "--optim.state_dtype=bfloat16",
        "--training.steps=5",
        "--logging.every=1",
        "--checkpoint.every=2",
        "--checkpoint.keep_last=3",
        "--training.sample_tokens=0",
    ]
    run_debug(tmp_path, *common)
    uninterrupted = train_losses(tmp_path)
    run = tmp_path / "ckpt" / "run_0001"
    metadata = read_metadata(run / "step_00000002").state_dict_metadata
    moments = {key: meta.properties.dtype for key, meta in metadata.items() if "exp_avg" in key}
    assert moments and set(moments.values()) == {torch.bfloat16}, moments
    for later in ("step_00000004", "step_00000005"):
        shutil.rmtree(run / later)
    (tmp_path / "metrics.jsonl").unlink()
    run_debug(tmp_path, *common, "--checkpoint.resume=auto")
    assert [r["step"] for r in records(tmp_path) if "loss" in r] == [3, 4, 5]
    resumed = train_losses(tmp_path)
    assert resumed == {step: uninterrupted[step] for step in (3, 4, 5)}, (resumed, uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_a_checkpoint_resumes_under_the_other_state_dtype(tmp_path, saved, resumed):
    """Both optimizers' param groups hold torch AdamW's keys, and load_state_dict casts the moments:
    a run saved with one state_dtype resumes with the other and trains on."""
    from helpers import records, run_debug

    common = ["--logging.every=1", "--training.sample_tokens=0"]
    run_debug(tmp_path, *common, "--training.steps=2", f"--optim.state_dtype={saved}")
    run_debug(
        tmp_path,
        *common,
        "--training.steps=3",
        "--checkpoint.resume=auto",
        f"--optim.state_dtype={resumed}",
    )
    assert [r["step"] for r in records(tmp_path) if "loss" in r] == [1, 2, 3]


# ------------------------------------------------------------------------------------- on shards


def check_bf16_states_on_shards(layouts: list[dict]) -> None:
    """BF16StatesAdamW through train.build_optimizer on FSDP / expert-parallel DTensors against
    torch's plain AdamW on full tensors: the first step's update comes from exact FP32 moments, so
    the weights agree to FP32 rounding; the moments it stores are BF16 DTensors of the parameters'
    placements, within one BF16 unit of (1 - beta1) g and (1 - beta2) g^2."""
    from torch.distributed.tensor import DTensor

    import train
    from helpers import assert_weights_match, build, give_same_gradients, tiny_config
    from parallel import ParallelConfig, build_mesh, parallelize

    config = tiny_config("flint")
    o = OptimSection(lr=1e-2, weight_decay=0.1, beta1=0.8, beta2=0.9, eps=1e-6)
    for layout in layouts:
        cfg = ParallelConfig.from_dict({"param_dtype": "float32", **layout})
        pm = parallelize(build(config), cfg, build_mesh(cfg, "cpu", config.num_experts))
        reference = build(config)
        lean = train.build_optimizer(
            pm.module, OptimSection(**{**vars(o), "state_dtype": "bfloat16"})
        )
        plain = train.build_optimizer(reference, o)
        references = dict(reference.named_parameters())
        give_same_gradients(pm.module, references, torch.Generator().manual_seed(0))
        lean.step()
        plain.step()
        assert_weights_match(pm.module, references, rtol=1e-6)
        for name, param in pm.module.named_parameters():
            state, grad = lean.state[param], references[name].grad
            for key, want in (("exp_avg", 0.2 * grad), ("exp_avg_sq", 0.1 * grad**2)):
                moment = state[key]
                assert isinstance(moment, DTensor) and moment.placements == param.placements
                assert moment.dtype == torch.bfloat16, (name, key)
                error = (moment.full_tensor().float() - want).abs()
                assert (error <= BF16_UNIT * want.abs() + 1e-30).all(), (layout, name, key)


def test_bf16_states_step_fsdp_shards():
    from helpers import in_process_group

    in_process_group(check_bf16_states_on_shards, [{"param_dtype": "bfloat16"}])


@pytest.mark.slow
def test_bf16_states_step_fsdp_and_expert_parallel_shards_of_two_ranks():
    from helpers import spawn

    spawn(2, check_bf16_states_on_shards, [{"dp_shard": 2}, {"ep": 2, "dp_shard": 1}])
