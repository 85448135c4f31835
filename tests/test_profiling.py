"""profiling.py: one profiled step's time split by module kind, with every family's kinds timed, and
the unchunked loss bench.py compares the fused one with."""

import pytest
import torch

from decoder import Head
from model import FlintConfig, Sinks, build_model
from models import FAMILIES
from profiling import SPLIT_ORDER, TIMED_MODULES, dense_logits_loss, profile_step

pytestmark = pytest.mark.usefixtures("one_thread")


def test_each_familys_module_kinds_and_the_shared_ones_are_timed():
    kinds = {cls for cls, _ in TIMED_MODULES}
    assert all(cls in kinds for family in FAMILIES.values() for cls, _ in family.timed_modules)
    assert {Sinks, Head} <= kinds and len(SPLIT_ORDER) == len(set(SPLIT_ORDER))


def test_a_profiled_step_splits_its_time_across_the_modules():
    model = build_model(FlintConfig.from_name("tiny", num_hidden_layers=3))
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    split, table = profile_step(model, lambda: model(ids, ids).backward(), torch.device("cpu"), table_rows=5)
    assert set(split) <= set(SPLIT_ORDER) and sum(split.values()) == pytest.approx(1.0, abs=0.05)
    assert split["head + loss"] > 0 and split["attention core"] > 0 and split["routed experts"] > 0
    assert table.count("\n") > 5


def test_the_unchunked_loss_is_the_fused_one():
    model = build_model(FlintConfig.from_name("tiny", num_hidden_layers=3))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(dense_logits_loss(model, ids, ids), model(ids, ids), rtol=1e-6, atol=1e-6)
