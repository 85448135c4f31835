"""What more than one test file uses: plain functions and constants, imported by name (`from helpers
import ...`); conftest.py holds only pytest's fixtures. No test file imports another test file
(tests/test_structure.py checks it), and tools/gpu_check.sh runs the compile harness below on a GPU.

The harness is parametrised over the registered families (registry.FAMILIES): FAMILY_NAMES is what
tests run a shared guarantee over, and each family's entry below (its debug config, its test models)
goes with its files in a fork (README, Fork), so a fork's tests build only the models that remain.
"""

import json
import multiprocessing
import os
import re
import socket
import sys
import tomllib
from functools import lru_cache
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from registry import FAMILIES, model_class

ROOT = Path(__file__).resolve().parent.parent
# Larger layouts: in the second tier, beyond what CI runs (FLINT_SLOW=1 python -m pytest -q -m
# slow).
slow = pytest.mark.slow(beyond_ci=True)


# ========================================================================== the registered families

FAMILY_NAMES = list(FAMILIES)  # what a test of a shared guarantee is parametrised over
# what a test of machinery independent of the model runs (any family would do)
DEFAULT_FAMILY = FAMILY_NAMES[0]
# Each registered family, the others than DEFAULT_FAMILY with FLINT_SLOW=1 only: a parametrisation
# for tests of shared machinery that take tens of seconds per family.
FIRST_FAMILY_THEN_SLOW = [
    name if name == DEFAULT_FAMILY else pytest.param(name, marks=slow) for name in FAMILY_NAMES
]
# Each registered family, the others than DEFAULT_FAMILY in the second tier (`-m slow`, CI runs it):
# for multi-process tests of shared machinery that the first family's run already exercises.
FIRST_FAMILY_THEN_SECOND_TIER = [
    name if name == DEFAULT_FAMILY else pytest.param(name, marks=pytest.mark.slow)
    for name in FAMILY_NAMES
]


def registered(per_family: dict) -> dict:
    """The entries of a {family: ...} table whose family is registered (a fork drops the others)."""
    return {name: value for name, value in per_family.items() if name in FAMILIES}


def only(family: str):
    """A test of `family`'s own behaviour that lives beside shared ones: skipped in a fork without
    it."""
    return pytest.mark.skipif(
        family not in FAMILIES, reason=f"family {family!r} is not registered (a fork)"
    )


@lru_cache(maxsize=1)
def debug_configs() -> dict[str, Path]:
    """family -> its configs/*debug.toml (seconds on a CPU: what the tests train), found by the
    family the file names ([model].family, by default the first registered), so a fork's deleted
    config takes its family with it."""
    from config import ModelSection

    found = {}
    for path in sorted((ROOT / "configs").glob("*debug.toml")):
        family = (
            tomllib.loads(path.read_text()).get("model", {}).get("family", ModelSection().family)
        )
        if family in FAMILIES:
            found[family] = path
    return found


def tiny_preset(name: str) -> str:
    """The family's smallest preset (its debug config trains it)."""
    from registry import family

    return family(name).smallest_preset


# What the family's smallest preset needs to load at [data]'s defaults (256 tokens): Large 4's
# frozen indexer starts random, so a sequence must fit in index_topk (attention is then dense
# causal).
TINY_MODEL_FIELDS = {"flint": "", "large4": "index_topk = 512\n"}


def tiny_model_toml(name: str = DEFAULT_FAMILY) -> str:
    """A run file's [model] table of the family's smallest preset, as a test of config.py writes
    it."""
    return f'[model]\nfamily = "{name}"\npreset = "{tiny_preset(name)}"\n{TINY_MODEL_FIELDS[name]}'


# ============================================================================= train.py runs


def debug_args(tmp_path: Path, *overrides: str, family: str = DEFAULT_FAMILY) -> list[str]:
    """The family's debug config with every path under tmp_path (peak FLOP/s given: no
    measurement)."""
    from data import EMBEDDED_CORPUS

    return [
        "--config",
        str(debug_configs()[family]),
        f"--data.path={EMBEDDED_CORPUS}",
        f"--data.cache_dir={tmp_path / 'cache'}",
        f"--checkpoint.dir={tmp_path / 'ckpt'}",
        f"--logging.jsonl={tmp_path / 'metrics.jsonl'}",
        "--logging.peak_tflops=0.1",
        *overrides,
    ]


def run_debug(tmp_path: Path, *overrides: str, family: str = DEFAULT_FAMILY) -> dict:
    """train.py's main on the family's debug config under tmp_path -> its summary."""
    import train

    return train.main(debug_args(tmp_path, *overrides, family=family))


def records(tmp_path: Path) -> list[dict]:
    """The JSON records of such a run's logging.jsonl."""
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def train_losses(tmp_path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(tmp_path) if "loss" in r}


def trained_checkpoint(tmp_path: Path, family: str = DEFAULT_FAMILY) -> Path:
    """The checkpoint of one training step of the family's debug config under tmp_path."""
    run_debug(tmp_path, "--training.steps=1", "--training.sample_tokens=0", family=family)
    return tmp_path / "ckpt" / "run_0001" / "step_00000001"


def exported_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face export, by its published name."""
    from safetensors.torch import load_file

    return {
        k: v for file in sorted(directory.glob("*.safetensors")) for k, v in load_file(file).items()
    }


def moe_layers(config) -> list[str]:
    """The names of a config's MoE layers, as the routing record keys them."""
    return [str(i) for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (each group's workers and transport loop); [] where
    /proc cannot tell (not Linux). A process whose groups were closed has none (see
    parallel.close_distributed)."""
    tasks = Path("/proc/self/task")
    names = (
        [(task / "comm").read_text().strip() for task in tasks.iterdir()] if tasks.is_dir() else []
    )
    return [name for name in names if name.startswith(("pt_gloo", "gloo_"))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The tests' processes are forked from one server process that has imported torch and the training
# code (multiprocessing's "forkserver"): a fresh interpreter spends about 2.5 s of a CI core on
# those imports, a fork from the server a few milliseconds, and the suite starts some 150 processes.
# Each child is still a new process (no process group, no compiled graph, its own caches), and it
# takes the environment the test has when it starts it, as a spawned one would (start).
multiprocessing.set_forkserver_preload(["train", "helpers", *FAMILIES.values()])


def start(fn, args: tuple, nprocs: int) -> None:
    """fn(rank, *args) in nprocs new processes, as torch.multiprocessing.spawn runs it (an exception
    or a signal in any of them raises here), forked from the server above."""
    mp.start_processes(
        _in_environment,
        args=(dict(os.environ), fn, *args),
        nprocs=nprocs,
        start_method="forkserver",
    )


def _in_environment(rank: int, environment: dict[str, str], fn, *args) -> None:
    os.environ.clear()
    os.environ.update(environment)
    fn(rank, *args)


def _torchrun_worker(rank: int, world: int, port: int, argv: list[str], fn=None) -> None:
    """What torchrun does for one process: the environment, then train.py's main (or fn) on argv."""
    import train

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    (fn or train.main)(argv)
    left = gloo_threads()  # none may outlive the run: see parallel.close_distributed
    assert not left, f"rank {rank}: gloo threads still running after the run: {left}"


def run_two_processes(argv: list[str], fn=None) -> None:
    """train.main(argv), or fn(argv), in 2 processes, as `torchrun --nproc-per-node 2` would start
    it."""
    start(_torchrun_worker, (2, free_port(), argv, fn), nprocs=2)


def step_host_syncs(argv: list[str]) -> list[str]:
    """What train_step copies to the host in step 2 (not a logged step) of train.py's run of argv:
    main's setup, step 1, then step 2 under profiling.HostSyncs (see there what counts)."""
    import train
    from balance import RoutingMonitor
    from checkpoint import Checkpointer
    from tools.profiling import HostSyncs

    cfg = train.parse_args(argv)
    run = train.start_run(cfg)
    with Checkpointer(cfg, run) as checkpoints, train.Interruption(run) as interruption:
        _, data, _ = train.setup_data(cfg, run)
        model = train.load_model(cfg, run)
        optimizer = train.build_optimizer(model.module, cfg.optim)
        routing = RoutingMonitor(
            model.module, model.config, run.device, cfg.logging.idle_expert_steps
        )
        step = (model, optimizer, data, cfg, run)
        train.train_step(*step, routing, interruption, 1, checkpoints)
        with HostSyncs() as syncs:
            train.train_step(*step, routing, interruption, 2, checkpoints)
    return syncs.reads


def closing(fn):
    """fn, then the process group closed once fn's frame (its model) is gone, as train.main does."""
    from parallel import close_distributed

    def closed(*args):
        try:
            return fn(*args)
        finally:
            close_distributed()

    return closed


# ============================================================================= comparisons


def assert_close_to_scale(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5, what: str = ""
) -> None:
    """Every element within rtol of its own magnitude plus rtol of the tensor's scale (its largest
    magnitude): FP32 summation-order noise grows with the values summed, so a fixed absolute floor
    (1e-6) is crossed on one CPU and not on another by gradients of order 1, while it hides real
    errors in gradients of order 1e-3."""
    scale = expected.detach().abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual,
        expected,
        rtol=rtol,
        atol=rtol * scale,
        msg=(lambda m: f"{what}: {m}") if what else None,
    )


def close(actual, expected, what):
    assert_close_to_scale(actual, expected, rtol=1e-5, what=what)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


# ============================================================================= processes


def exit_now() -> None:
    """End a spawned test process that passed, skipping the interpreter's shutdown. A gloo group
    that torch itself still holds after close_distributed (a compiled graph's fake wrapper of it, a
    gradient left on a parameter) keeps its worker threads, and one that lets go of a tensor while
    Python shuts down aborts the process (see parallel.close_distributed). train.main leaves no such
    group: _torchrun_worker checks it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker(rank, world, port, fn, args):
    from parallel import close_distributed

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        fn(*args)
    finally:
        close_distributed()
    exit_now()


def spawn(world: int, fn, *args) -> None:
    """Run fn(*args) in `world` gloo processes; an exception in any of them fails the test."""
    start(_worker, (world, free_port(), fn, args), nprocs=world)


def in_process_group(fn, *args):
    """fn(*args) in this process, as a process group of one (FSDP still applies its policies)."""
    from parallel import close_distributed, init_distributed

    init_distributed("gloo")
    try:
        return fn(*args)
    finally:
        close_distributed()


# ================================================================= every layout against one process

BATCH, SEQ = 4, 16
STEPS, LR, MAX_NORM = 3, 1e-2, 0.05
LARGE4_SHARING = [0, 1, 1, 3, 1, 5, 5, 3]  # kv_source_layers of tiny_config("large4")
# Each family's model of the layout tests: (preset, overrides). Flint: 4 layers: dense 0-1, MoE 2-3;
# full attention at 0, 1, 3, sliding (window 9) at 2. Large 4: 8 layers: dense 0, MoE 1-7, NoPE 3
# and 7; layers 1 and 5 both produce the RoPE latent (2 and 4 read 1, 6 reads 5) and 7 reads 3; full
# indexers at 0, 1, 3, 5, 7, shared at the others. So a 2-stage pipeline (0-3 | 4-7) carries a
# rotated key (1's, to 4) and a NoPE latent (3's, to 7) across its boundary. index_topk 4: queries
# of make_batch's documents (7 and 6 tokens) see up to 7 keys, so the selections drop keys and
# differ between layers (with 8 each would hold every visible key).
LAYOUT_MODELS = {
    "flint": ("tiny", {"num_hidden_layers": 4}),
    "large4": ("large4-parity", {"index_topk": 4, "kv_source_layers": LARGE4_SHARING}),
}
# Families whose seeded init leaves identity pieces (norms of one, zero biases) that hide bugs, and
# an indexer with ties at the top-k boundary: the layout tests randomize every parameter
# (`randomized`).
RANDOMIZED_FAMILIES = {"large4"}
# Checkpoint tests start from the plain init, under which Large 4's indexer has ties at the top-k
# boundary: there, every key is selected (index_topk = SEQ), so the indexer is skipped.
PLAIN_INIT_OVERRIDES = {"flint": {}, "large4": {"index_topk": SEQ}}


def tiny_config(family: str = DEFAULT_FAMILY, **overrides):
    preset, defaults = LAYOUT_MODELS[family]
    from registry import family as registered

    return registered(family).config.from_name(preset, **{**defaults, **overrides})


def build(config, seed: int = 0, plain: bool = False):
    """The seeded single-process model of any family. Large 4's has every parameter random
    (identity pieces hide bugs) and an indexer without ties at the top-k boundary, unless `plain`:
    the init of build_model (and of a meta build, init_weights)."""
    if config.family in RANDOMIZED_FAMILIES and not plain:
        return randomized(config, seed)
    from layers import build as build_on_meta

    return build_on_meta(model_class(config), config, "cpu", torch.float32, seed)


def randomized(config, seed: int = 0) -> torch.nn.Module:
    """Every parameter random (alpha, SSMax, norms and LayerNorm biases too: identity pieces hide
    bugs).

    The indexer is shaped so that its ReLU scores are positive: a channel with a large key bias
    meets a query channel with a large positive weight. Otherwise all-negative heads give exact-zero
    index ties at the top-k boundary, where the choice is implementation-defined (LARGE4.md section
    1.8)."""
    from layers import build as build_on_meta

    model = build_on_meta(model_class(config), config, "cpu", torch.float32, 0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith(("norm.weight", "layernorm.weight", "softmax_scaling.bias")):
                param.copy_(1 + 0.2 * noise)
            elif name.endswith("indexer.softmax_scaling.scale"):
                param.copy_(0.05 * noise.abs())
            else:
                param.copy_((0.3 if param.dim() < 2 else 0.15) * noise)
        for layer in model.layers.values():
            indexer = getattr(layer.self_attn, "indexer", None)
            if indexer is not None:
                dim = indexer.head_dim
                indexer.k_norm.bias[dim - 1] = 3.0
                indexer.q_input_norm.bias.fill_(1.0)
                indexer.wq_b.weight.view(indexer.heads, dim, -1)[:, dim - 1] += 0.3
    return model


def make_batch(seed: int = 0, vocab: int = 256):
    """Two packed documents and padding per row, the same pattern in every row, so each
    data-parallel share holds the same number of loss tokens (mean of means = mean)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    doc_ids = torch.tensor([0] * 7 + [1] * 6 + [-1] * 3).expand(BATCH, SEQ).clone()
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    targets[(doc_ids < 0) | (doc_ids != torch.roll(doc_ids, -1, 1))] = -100
    return ids, targets, doc_ids


def reference_run(config, batch, plain: bool = False):
    """Single process: the loss and gradients of step 0, then (clipped) AdamW steps' losses."""
    model = build(config, plain=plain)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses, grads, norms = [], None, []
    for step in range(STEPS):
        loss = model(batch[0], batch[1], batch[2])
        loss.backward()
        if step == 0:  # None for frozen parameters (Large 4's indexer)
            grads = {
                n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
            }
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses, grads, norms


def rows_of_this_rank(mesh, batch):
    dp, rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    share = BATCH // dp
    return tuple(t[rank * share : (rank + 1) * share] for t in batch)


def check_layouts(
    layouts: list[dict], model_overrides: dict, family: str = DEFAULT_FAMILY
) -> list[dict]:
    """For each [parallel] layout: step-0 loss and every gradient, the clipped norm and the losses
    of STEPS AdamW steps equal the single-process run; frozen parameters get no gradient and no
    optimizer state. Returns each layout's step-0 gradients (full tensors) by name."""
    from parallel import ParallelConfig, build_mesh, parallelize

    config = tiny_config(family, **model_overrides)
    batch = make_batch(vocab=min(256, config.vocab_size))
    ref_losses, ref_grads, ref_norms = reference_run(config, batch)
    all_grads = []
    for layout in layouts:
        cfg = ParallelConfig.from_dict({"param_dtype": "float32", **layout})
        mesh = build_mesh(cfg, "cpu", config.num_experts)
        pm = parallelize(build(config), cfg, mesh)
        optimizer = torch.optim.AdamW(pm.module.parameters(), lr=LR, foreach=False)
        local = rows_of_this_rank(mesh, batch)
        for step in range(STEPS):
            loss = pm.forward_backward(*local)
            close(loss, ref_losses[step], f"{layout} step {step} loss")
            if step == 0:
                names = [n for n, _ in pm.module.named_parameters()]
                assert names and set(names) <= set(ref_grads), (
                    f"{layout}: renamed parameters {names}"
                )
                grads = {
                    n: None if p.grad is None else full(p.grad)
                    for n, p in pm.module.named_parameters()
                }
                for name, grad in grads.items():
                    if ref_grads[name] is None:
                        assert grad is None, f"{layout}: frozen {name} got a gradient"
                    else:
                        close(grad, ref_grads[name], f"{layout} grad {name}")
                all_grads.append(grads)
            close(pm.clip_grad_norm_(MAX_NORM), ref_norms[step], f"{layout} step {step} grad norm")
            optimizer.step()
            optimizer.zero_grad()
        frozen = [p for p in pm.module.parameters() if not p.requires_grad]
        assert all(p not in optimizer.state for p in frozen), (
            f"{layout}: optimizer state for a frozen parameter"
        )
    return all_grads


# ============================================================= optimizers against a plain reference


def give_same_gradients(
    model: torch.nn.Module, references: dict, generator: torch.Generator
) -> None:
    """One random gradient per parameter: the full tensor to the reference's, this rank's share
    (a DTensor of the same placements) to `model`'s."""
    from torch.distributed.tensor import distribute_tensor

    for name, param in model.named_parameters():
        grad = torch.randn(references[name].shape, generator=generator)
        references[name].grad = grad
        param.grad = (
            distribute_tensor(grad, param.device_mesh, param.placements, src_data_rank=None)
            if isinstance(param, DTensor)
            else grad.clone()
        )


def assert_weights_match(model: torch.nn.Module, references: dict, rtol: float) -> None:
    """Every weight of `model` (its full tensor if sharded) equals the reference's, within rtol of
    its scale."""
    for name, param in model.named_parameters():
        actual = param.full_tensor() if isinstance(param, DTensor) else param
        assert_close_to_scale(actual, references[name], rtol, name)


def adamw_matches_plain(model: torch.nn.Module, reference: torch.nn.Module, steps: int = 4) -> None:
    """train.build_optimizer on `model` (plain tensors or DTensor shards) against a plain for-loop
    torch.optim.AdamW on `reference` (the same weights, full tensors), both fed the same random
    gradients and the same learning rate schedule: the weights agree to FP32 rounding."""
    import train
    from config import OptimSection

    o = OptimSection(lr=1e-2, weight_decay=0.1, beta1=0.8, beta2=0.9, eps=1e-6)
    chosen = train.build_optimizer(model, o)
    decayed = [p for p in reference.parameters() if p.dim() >= 2]
    plain = torch.optim.AdamW(
        [
            {"params": decayed, "weight_decay": 0.1},
            {"params": [p for p in reference.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        betas=(0.8, 0.9),
        eps=1e-6,
        foreach=False,
    )
    references = dict(reference.named_parameters())
    generator = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        for optimizer in (chosen, plain):
            train.set_learning_rate(optimizer, 1e-2 / step)
        give_same_gradients(model, references, generator)
        chosen.step()
        plain.step()
    assert_weights_match(model, references, rtol=1e-6)


# ============================================================================= MoE layers


def shard_experts(moe, rank: int, ep: int, chunks: int = 2, **experts_options):
    """moe with its experts sharded over ep ranks of the world group: this rank holds E / ep of
    them, and exchanges its tokens in `chunks` overlapped pieces ([parallel] ep_overlap)."""
    from moe import ExpertParallelExperts, GroupedExperts

    num_experts, hidden, _ = moe.experts.gate_up_proj.shape
    local = num_experts // ep
    experts = GroupedExperts(hidden, moe.experts.down_proj.shape[1], local, **experts_options)
    with torch.no_grad():
        experts.gate_up_proj.copy_(moe.experts.gate_up_proj[rank * local : (rank + 1) * local])
        experts.down_proj.copy_(moe.experts.down_proj[rank * local : (rank + 1) * local])
    moe.experts = ExpertParallelExperts(experts, dist.group.WORLD, num_experts, chunks)
    return moe


# ========================================================================= Large 4's own test files

LARGE4_PARITY = "large4-parity"  # the preset the parity tests and the config tests share
# its kv_source_layers: layers 1 and 4 both produce the RoPE latent
TWO_PRODUCERS = [0, 1, 1, 3, 4, 4, 6, 3]


def text_config(config) -> dict:
    """A Large4Config's text_config, as config.json holds it (what the reference reads)."""
    return config.to_hf_config()["text_config"]


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled E4M3 by hand: one scale per [block] tile (partial at the edges), amax -> 448."""
    (rows, cols), (bm, bn) = weight.shape, block
    grid = (-(-rows // bm), -(-cols // bn))
    padded = torch.zeros(grid[0] * bm, grid[1] * bn)
    padded[:rows, :cols] = weight.abs()
    scale = padded.view(grid[0], bm, grid[1], bn).amax(dim=(1, 3)) / 448.0  # [grid]
    row_tile, col_tile = torch.arange(rows) // bm, torch.arange(cols) // bn
    quantized = (weight / scale[row_tile[:, None], col_tile[None, :]]).to(torch.float8_e4m3fn)
    return quantized, scale


def dequantize_by_hand(
    quantized: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """Each element times the scale of the tile it lies in, looked up by index."""
    rows, cols = (torch.arange(n) // b for n, b in zip(quantized.shape, block))
    return quantized.float() * scale[rows[:, None], cols[None, :]]


# ============================================================== compiled blocks through parallelize

GRAPH_CALLS = [0]  # compiled graphs run so far in this process (counting_backend)
# One block of each kind whose FP32 units differ (overrides of the family's layout model): Flint's
# dense and MoE blocks; Large 4's dense block with its own latent and full indexer, an MoE block
# owning both, and one sharing them.
BLOCK_MODELS = {
    "flint": {"num_hidden_layers": 2, "mlp_only_layers": [0]},
    "large4": {
        "num_hidden_layers": 3,
        "kv_source_layers": [0, 1, 1],
        "indexer_types": ["full", "full", "shared"],
    },
}


def one_graph_per_block(family: str) -> dict[str, int]:
    """The graphs each block of parallel_block_model runs per forward where blocks compile whole
    (FP32 or a BF16 policy, without expert or context parallelism): one."""
    return {str(i): 1 for i in range(BLOCK_MODELS[family]["num_hidden_layers"])}


def counting_backend(graph, example_inputs, inner: str = "aot_eager"):
    """The `inner` backend, counting each run of a compiled graph: the graphs a block runs per
    forward are its graph breaks plus one (a segment with no op between two breaks makes no
    graph)."""
    compiled = torch._dynamo.lookup_backend(inner)(graph, example_inputs)
    boxed = getattr(compiled, "_boxed_call", False)  # called with one list of inputs

    def run(*args):
        GRAPH_CALLS[0] += 1
        return compiled(*args)

    run._boxed_call = boxed
    return run


def parallel_block_model(family: str):
    return build(tiny_config(family, **BLOCK_MODELS[family]))


def parallel_step(family: str, layout: dict, compile: bool, device: str = "cpu", batches: int = 1):
    """Forward and backward of parallelize's layout on this rank's rows of `batches` batches (the
    later ones must not recompile) -> the summed loss, the accumulated full gradients by native
    name, the graphs each block ran in its first forward (by layer name), how often each block's
    forward ran in the forward and in backward (a recompute), and dynamo's graph breaks by reason.
    tools/gpu_check.sh runs it on a GPU, with inductor."""
    from parallel import ParallelConfig, build_mesh, parallelize

    model = parallel_block_model(family)
    names = [name for name, _ in model.named_parameters()]
    cfg = ParallelConfig.from_dict({"param_dtype": "float32", **layout, "compile": compile})
    pm = parallelize(model, cfg, build_mesh(cfg, device, model.config.num_experts))
    graphs, calls, counting = {}, {}, set()

    def count(name):
        def before(module, args):
            recompute = torch._C._current_graph_task_id() != -1  # a forward run by backward
            calls.setdefault(name, [0, 0])[recompute] += 1
            # the first training forward
            if name not in graphs and torch.is_grad_enabled() and not recompute:
                graphs[name] = -GRAPH_CALLS[0]
                counting.add(name)

        def after(module, args, output):
            if name in counting:
                graphs[name] += GRAPH_CALLS[0]
                counting.remove(name)

        return before, after

    for part in pm.parts:
        for name, layer in part.layers.items():
            before, after = count(name)
            layer.register_forward_pre_hook(before)
            layer.register_forward_hook(after)
    torch._dynamo.utils.counters.clear()
    batch = [t.to(pm.collective_device) for t in make_batch(vocab=model.config.vocab_size)]
    loss = pm.forward_backward(*rows_of_this_rank(pm.mesh, batch))
    graphs_compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for seed in range(1, batches):  # other tokens, other routing: other expert-parallel split sizes
        batch = [
            t.to(pm.collective_device) for t in make_batch(seed, vocab=model.config.vocab_size)
        ]
        loss = loss + pm.forward_backward(*rows_of_this_rank(pm.mesh, batch))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_compiled, (
        "a later batch recompiled"
    )
    grads = {n: full(p.grad) for n, p in pm.module.named_parameters() if p.grad is not None}
    assert set(name for name, _ in pm.module.named_parameters()) <= set(names), (
        "parallelize renamed parameters"
    )
    breaks = torch._dynamo.utils.counters["graph_break"]
    return loss, grads, (graphs if compile else {}), calls, breaks


# ============================================================================ blocks, one at a time


def values_and_grads(block, *inputs):
    """The block's output and the gradients of a fixed random projection of it."""
    out = block(*inputs)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * weight).sum(), [inputs[0], *block.parameters()])
    return out, grads


def block_inputs(config, backend: str = "sdpa"):
    """Hidden states [B, T, H], RoPE tables and the masks of a packed batch with padding, for a
    Flint block (T = 32 > 2 * (window 9 - 1): the tiny preset's sliding layers take the banded
    path)."""
    from attention import build_masks
    from flint_model import rope_tables
    from layers import document_positions

    batch, seq = 2, 32
    g = torch.Generator().manual_seed(0)
    doc_ids = torch.tensor([0] * 13 + [1] * 15 + [-1] * 4).expand(batch, seq).clone()
    doc_ids[1, :20] = 2  # rows differ: masks depend on the batch index
    x = torch.randn(batch, seq, config.hidden_size, generator=g, requires_grad=True)
    rope = rope_tables(document_positions(doc_ids), config.head_dim, config.rope_theta)
    masks = build_masks(config.layer_types, config.window, doc_ids, batch, seq, "cpu", backend)
    return x, rope, masks


def stops_with_one_line(call, kind: type[BaseException], named: str, pattern: str) -> None:
    """call() raises `kind` whose message (a SystemExit's code) is one line holding `named` and
    `pattern`."""
    with pytest.raises(kind) as caught:
        call()
    error = caught.value
    message = str(error.code if isinstance(error, SystemExit) else error)
    assert "\n" not in message, f"more than one line: {message!r}"
    assert named in message, f"{named!r} is not named in {message!r}"
    assert re.search(pattern, message), f"{pattern!r} does not match {message!r}"
