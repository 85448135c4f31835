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
    with dynamo.patch(recompile_limit=dynamo.recompile_limit, suppress_errors=dynamo.suppress_errors):
        yield
    torch._dynamo.reset()
