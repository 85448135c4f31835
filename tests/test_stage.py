"""stage.py: the seam through which a layout reaches a model's forward. Each test plans a call of a
stand-in model (an embedding or none, and the router losses it asks for) and checks what the plan
hands the forward against values worked out by hand; the models' forwards through it, in every
layout, are checked in test_parallel.py and test_balance.py."""

from types import SimpleNamespace

import pytest
import torch

from balance import RouterLosses
from stage import ONE_DEVICE, ForwardPlan, StageContext

Z_ONLY = RouterLosses(num_experts=4, top_k=2, num_moe_layers=2, z=0.5)  # one statistic, "z" [1]
NO_LOSSES = RouterLosses(num_experts=4, top_k=2, num_moe_layers=2)


def stand_in(first: bool = True, losses: RouterLosses = NO_LOSSES) -> SimpleNamespace:
    """What a plan reads of a model: whether it holds the embedding, its input check (which
    records what it was given), its router losses."""
    checked = []
    return SimpleNamespace(
        embed_tokens=object() if first else None,
        router_losses=losses,
        checked=checked,
        check_inputs=lambda *given: checked.append(given),
    )


def test_one_device_adds_nothing_to_the_forward():
    ids, targets = torch.arange(8).view(2, 4), torch.ones(2, 4, dtype=torch.long)
    model = stand_in()
    plan = ONE_DEVICE.plan(model, (ids, targets), None, None, None)
    assert model.checked == [(ids, targets, None, None)]  # a first stage checks what it is given
    assert plan.input_ids is ids and plan.targets is targets and plan.received == ()
    assert (plan.batch, plan.seq_len) == (2, 4)
    assert plan.mine is None and plan.gather is None and plan.stats is None
    assert plan.positions.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert plan.local(ids) is ids
    h, loss = torch.randn(2, 4, 3), torch.tensor(2.5)
    assert plan.send(h) == (h,) and plan.loss(loss) is loss


def test_positions_restart_at_each_document():
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, -1]])
    plan = ONE_DEVICE.plan(stand_in(), (torch.zeros(1, 6, dtype=torch.long),), None, doc_ids, None)
    assert plan.doc_ids is doc_ids and plan.positions.tolist() == [[0, 1, 0, 1, 2, 0]]


def cp_rank(gathered: list) -> StageContext:
    """Rank 0 of 2 splitting 8 positions into 4 chunks: it computes chunks 0 and 3, as
    parallel.cp_token_index places them; its gather records the dim and doubles the sequence."""

    def queries(seq_len: int, device) -> torch.Tensor:
        assert seq_len == 8
        return torch.tensor([0, 1, 6, 7], device=device)

    def gather(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        gathered.append(dim)
        return torch.cat([t, t], dim=dim)

    return StageContext(2, None, queries, gather)


def test_a_context_parallel_rank_computes_its_share_and_its_share_of_the_loss():
    gathered: list = []
    ids = torch.arange(16).view(2, 8)
    # 13 loss tokens, 1 + 4 of them at this rank's positions
    targets = torch.tensor([[-100, -100, 5, 5, 5, 5, 5, -100], [5] * 8])
    plan = cp_rank(gathered).plan(stand_in(), (ids,), targets, None, None)
    assert plan.seq_len == 8 and plan.mine.tolist() == [0, 1, 6, 7]
    assert plan.local(ids).tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert plan.local(plan.positions).tolist() == [[0, 1, 6, 7]] * 2
    share = plan.loss(torch.tensor(2.0))  # the head's mean over this rank's 5 -> its share of 13's
    assert share.item() == pytest.approx(2.0 * 5 * 2 / 13, rel=1e-6)
    h = torch.ones(2, 4, 3)
    assert plan.block(lambda x, gather: gather(x, 2), h).shape == (2, 4, 6) and gathered == [2]


def test_a_later_stage_counts_the_whole_sequence_from_its_share():
    """Its hidden states hold T / cp positions; the plan's sequence is the whole T."""
    hidden = torch.randn(2, 4, 3)
    plan = cp_rank([]).plan(stand_in(first=False), (hidden,), None, None, None)
    assert plan.received == (hidden,) and plan.input_ids is None and plan.seq_len == 8
    assert plan.mine.tolist() == [0, 1, 6, 7]


def test_router_statistics_start_pass_through_each_block_and_cross_after_the_model_s_tensors():
    ids, targets = torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.long)
    doc_ids = torch.tensor([[0, 0, 0, -1, -1], [1, 1, 1, 1, -1]])  # 7 real tokens
    plan = ONE_DEVICE.plan(stand_in(losses=Z_ONLY), (ids, targets), None, doc_ids, None)
    assert plan.stats["z"].tolist() == [0.0]

    def moe_block(x, gather=None, stats=None, real=None):  # adds its statistics: the last output
        return x + 1, x - 1, {"z": stats["z"] + real.sum()}

    h = torch.zeros(2, 5, 3)
    h, other = plan.block(moe_block, h)
    h, other = plan.block(moe_block, h)
    assert h.unique().tolist() == [2.0] and other.unique().tolist() == [0.0]
    assert plan.stats["z"].tolist() == [14.0]  # 7 real tokens, twice
    sent = plan.send(h, other)
    assert len(sent) == 3 and sent[0] is h and sent[1] is other and sent[2].tolist() == [14.0]

    later = ONE_DEVICE.plan(stand_in(first=False, losses=Z_ONLY), sent, targets, doc_ids, None)
    assert later.received == sent[:2] and later.stats["z"] is sent[2]
    assert later.local_real.sum().item() == 7


def test_without_targets_no_statistics_are_taken_or_sent():
    """Evaluation for logits: the statistics stay off, and a later stage keeps all it received."""
    received = (torch.zeros(2, 5, 3), torch.zeros(1))
    plan = ONE_DEVICE.plan(stand_in(first=False, losses=Z_ONLY), received, None, None, None)
    assert plan.stats is None and plan.received == received
    assert plan.block(lambda x, gather: x + 1, received[0]).unique().tolist() == [1.0]


def test_generation_s_plan_adds_nothing():
    plan = ForwardPlan()
    assert plan.block(lambda x, cache, gather: (x, cache, gather), 1, cache=2) == (1, 2, None)
    assert plan.send(torch.ones(1))[0].item() == 1.0 and len(plan.send(torch.ones(1))) == 1
