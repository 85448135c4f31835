import json
import os
import sys
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning: the multi-process tests share two cores, and
# threads spinning while a peer process is descheduled made steps up to 30x slower. Set before
# torch starts OpenMP; child processes inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tests import the flat top-level modules (model.py, attention.py, ...) and tests/reference.py.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
# Each registered family's smallest preset: what the tests parametrised over the families build.
TINY_PRESETS = {"flint": "tiny", "large4": "large4-tiny"}


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (each group's workers and transport loop); [] where
    /proc cannot tell (not Linux). A process whose groups were closed has none (see
    parallel.close_distributed)."""
    tasks = Path("/proc/self/task")
    names = [(task / "comm").read_text().strip() for task in tasks.iterdir()] if tasks.is_dir() else []
    return [name for name in names if name.startswith(("pt_gloo", "gloo_"))]


def exit_now() -> None:
    """End a spawned test process that passed, skipping the interpreter's shutdown. A gloo group that
    torch itself still holds after close_distributed (a compiled graph's fake wrapper of it, a
    gradient left on a parameter) keeps its worker threads, and one that lets go of a tensor while
    Python shuts down aborts the process (see parallel.close_distributed). train.main leaves no
    such group: _torchrun_worker in test_train.py checks it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture
def one_thread():
    """Tiny models run as fast on one thread, and stay fast while other processes use the other core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles as a fresh process would: dynamo counts compiled graphs per code object
    (recompile_limit), and the blocks of every model the suite has compiled share one code object,
    so without a reset a test compiling late in the run would hit the limit that a training run,
    one model per process, never reaches. The settings apply_compile changes (process-wide, as a
    run needs) are put back through torch's own config patch: setting them back by hand, or with
    monkeypatch, can delete a key from torch's config module."""
    dynamo = torch._dynamo.config
    settings = ("recompile_limit", "suppress_errors", "nested_graph_breaks", "capture_scalar_outputs",
                "capture_dynamic_output_shape_ops")
    with dynamo.patch(**{name: getattr(dynamo, name) for name in settings}):
        yield
    torch._dynamo.reset()


@pytest.fixture
def check_rows_stop_at_their_eos():
    """A check for any model's generate: greedy rows that reach EOS at different steps each stop
    there (EOS after it), the others go on unchanged, and the batch stops when every row has."""
    def check(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> None:
        free = model.generate(prompt, steps)  # [B, T + steps], no EOS
        new = free[:, prompt.shape[1]:]
        eos = int(new[0, 2])  # row 0 reaches it at its third new token
        firsts = [row.tolist().index(eos) if eos in row.tolist() else None for row in new]
        assert firsts[0] <= 2 and any(first != firsts[0] for first in firsts), "the rows must finish apart"
        stopped = model.generate(prompt, steps, eos_token_id=eos)
        length = steps if None in firsts else max(firsts) + 1
        assert stopped.shape == (prompt.shape[0], prompt.shape[1] + length)
        for row, first in enumerate(firsts):
            end = length if first is None else first + 1
            assert torch.equal(stopped[row, :prompt.shape[1] + end], free[row, :prompt.shape[1] + end])
            assert (stopped[row, prompt.shape[1] + end:] == eos).all()
    return check


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5, what: str = "") -> None:
    """Every element within rtol of its own magnitude plus rtol of the tensor's scale (its largest
    magnitude): FP32 summation-order noise grows with the values summed, so a fixed absolute floor
    (1e-6) is crossed on one CPU and not on another by gradients of order 1, while it hides real
    errors in gradients of order 1e-3."""
    scale = expected.detach().abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale,
                               msg=(lambda m: f"{what}: {m}") if what else None)


# ----------------------------------------------------------------------------- train.py runs
# Plain functions (not fixtures) because test files call them with their own arguments, many times.

def debug_args(tmp_path: Path, *overrides: str) -> list[str]:
    """configs/debug.toml with every path under tmp_path (peak FLOP/s given: no measurement)."""
    from data import EMBEDDED_CORPUS
    return ["--config", str(ROOT / "configs" / "debug.toml"), f"--data.path={EMBEDDED_CORPUS}",
            f"--data.cache_dir={tmp_path / 'cache'}", f"--checkpoint.dir={tmp_path / 'ckpt'}",
            f"--logging.jsonl={tmp_path / 'metrics.jsonl'}", "--logging.peak_tflops=0.1", *overrides]


def run_debug(tmp_path: Path, *overrides: str) -> dict:
    """train.py's main on configs/debug.toml under tmp_path -> its summary."""
    import train
    return train.main(debug_args(tmp_path, *overrides))


def records(tmp_path: Path) -> list[dict]:
    """The JSON records of such a run's logging.jsonl."""
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def train_losses(tmp_path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(tmp_path) if "loss" in r}


def trained_checkpoint(tmp_path: Path) -> Path:
    """The checkpoint of one training step of configs/debug.toml under tmp_path."""
    run_debug(tmp_path, "--training.steps=1", "--training.sample_tokens=0")
    return tmp_path / "ckpt" / "run_0001" / "step_00000001"


@pytest.fixture(scope="module")
def trained_once(tmp_path_factory) -> Path:
    """One such checkpoint per test file, for the tests that only read it (or copy it to damage it)."""
    return trained_checkpoint(tmp_path_factory.mktemp("trained"))


# ----------------------------------------------------------------------------- Large 4

LARGE4_PARITY = "large4-parity"  # the preset the parity tests and the config tests share
TWO_PRODUCERS = [0, 1, 1, 3, 4, 4, 6, 3]  # its kv_source_layers: layers 1 and 4 both produce the RoPE latent


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


def dequantize_by_hand(quantized: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Each element times the scale of the tile it lies in, looked up by index."""
    rows, cols = (torch.arange(n) // b for n, b in zip(quantized.shape, block))
    return quantized.float() * scale[rows[:, None], cols[None, :]]



# ----------------------------------------------------------------------------- optimizers against a plain reference

def give_same_gradients(model: torch.nn.Module, references: dict, generator: torch.Generator) -> None:
    """One random gradient per parameter: the full tensor to the reference's, this rank's share
    (a DTensor of the same placements) to `model`'s."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    for name, param in model.named_parameters():
        grad = torch.randn(references[name].shape, generator=generator)
        references[name].grad = grad
        param.grad = distribute_tensor(grad, param.device_mesh, param.placements, src_data_rank=None) \
            if isinstance(param, DTensor) else grad.clone()


def assert_weights_match(model: torch.nn.Module, references: dict, rtol: float) -> None:
    """Every weight of `model` (its full tensor if sharded) equals the reference's, within rtol of its scale."""
    from torch.distributed.tensor import DTensor
    for name, param in model.named_parameters():
        actual = param.full_tensor() if isinstance(param, DTensor) else param
        assert_close_to_scale(actual, references[name], rtol, name)
