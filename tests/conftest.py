"""pytest's fixtures and the import path; the tests' plain helpers are in tests/helpers.py."""

import os
import sys
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning: the multi-process tests share two cores, and
# threads spinning while a peer process is descheduled made steps up to 30x slower. Set before
# torch starts OpenMP; child processes inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tests import the flat top-level modules (flint_model.py, attention.py, ...), tests/helpers.py and
# the references.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


SLOW = os.environ.get("FLINT_SLOW") == "1"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: a test's marks are complete when it looks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The second tier's tests beyond what CI runs (`slow(beyond_ci=True)`: larger layouts, every
    GPU config at its real size, the forks' whole suites; tens of minutes) are skipped without
    FLINT_SLOW=1."""
    if SLOW:
        return
    beyond = pytest.mark.skip(reason="beyond CI's tiers: FLINT_SLOW=1 python -m pytest -q -m slow")
    for item in items:
        if any(mark.kwargs.get("beyond_ci") for mark in item.iter_markers("slow")):
            item.add_marker(beyond)


@pytest.fixture
def one_thread():
    """Tiny models run as fast on one thread, and stay fast while other processes use the other
    core."""
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
    settings = (
        "recompile_limit",
        "suppress_errors",
        "nested_graph_breaks",
        "capture_scalar_outputs",
        "capture_dynamic_output_shape_ops",
    )
    with dynamo.patch(**{name: getattr(dynamo, name) for name in settings}):
        yield
    torch._dynamo.reset()


@pytest.fixture
def check_rows_stop_at_their_eos():
    """A check for any model's generate: greedy rows that reach EOS at different steps each stop
    there (EOS after it), the others go on unchanged, and the batch stops when every row has."""

    def check(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> None:
        free = model.generate(prompt, steps)  # [B, T + steps], no EOS
        new = free[:, prompt.shape[1] :]
        eos = int(new[0, 2])  # row 0 reaches it at its third new token
        firsts = [row.tolist().index(eos) if eos in row.tolist() else None for row in new]
        assert firsts[0] <= 2 and any(first != firsts[0] for first in firsts), (
            "the rows must finish apart"
        )
        stopped = model.generate(prompt, steps, eos_token_id=eos)
        length = steps if None in firsts else max(firsts) + 1
        assert stopped.shape == (prompt.shape[0], prompt.shape[1] + length)
        for row, first in enumerate(firsts):
            end = length if first is None else first + 1
            assert torch.equal(
                stopped[row, : prompt.shape[1] + end], free[row, : prompt.shape[1] + end]
            )
            assert (stopped[row, prompt.shape[1] + end :] == eos).all()

    return check


@pytest.fixture(scope="session")
def trained_once(tmp_path_factory) -> Path:
    """One checkpoint of one training step of the debug config per test run, for the tests that only
    read it (or copy it to damage it)."""
    from helpers import trained_checkpoint

    return trained_checkpoint(tmp_path_factory.mktemp("trained"))
