"""balance.py: expert load balance.

The router losses: Flint's published balance term against the formula flint computed before the
losses moved into the layers (against the reference implementation's own values in
tests/test_flint_model.py), DeepSeek-V3's sequence-wise term and the z-loss against plain loops, in
one process and in pipeline, context and expert parallel layouts against one process, for each
registered family.

Routing health: expert loads, idle-expert warnings, and the aux-loss-free selection bias."""

import dataclasses
import gc
import weakref

import pytest
import torch

import convert
from balance import RouterLosses, RoutingMonitor, add_layer, update_selection_bias, worst_layer
from config import ConfigError
from helpers import (
    FAMILY_NAMES,
    assert_close_to_scale,
    build,
    close,
    full,
    make_batch,
    only,
    records,
    registered,
    rows_of_this_rank,
    run_debug,
    slow,
    spawn,
    tiny_config,
    train_losses,
)
from moe import Router
from parallel import ParallelConfig, build_mesh, parallelize


def pooled_reference(
    router_logits: list[torch.Tensor], top_k: int, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The balance term as flint computed it before the router losses moved into the layers (the
    routers kept their logits, the model pooled them here): per layer, the softmax and its top-k;
    both summed over the real tokens and the layers, divided by (real tokens x layers);
    E * sum_e f_e * P_e."""
    num_experts = router_logits[0].shape[-1]
    # [N]
    rows = torch.ones(router_logits[0].shape[0]) if mask is None else mask.reshape(-1).float()
    assignments = torch.zeros(num_experts)
    probabilities = torch.zeros(num_experts)
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)  # [N, E]
        chosen = torch.topk(probs, top_k, dim=-1).indices  # [N, k]
        assignments = assignments.scatter_add(0, chosen.flatten(), rows.repeat_interleave(top_k))
        probabilities = probabilities + (probs * rows.unsqueeze(-1)).sum(dim=0)
    total = rows.sum() * len(router_logits)
    return num_experts * torch.sum(assignments / total * probabilities / total)


def sequence_reference(
    routing: list, real: torch.Tensor, targets: torch.Tensor, score_function: str, top_k: int
) -> torch.Tensor:
    """DeepSeek-V3's eqs. 17-20 token by token: for each MoE layer (logits [B, T, E], chosen
    [B, T, k]) and each row, f_e = E / (k T) * (its real tokens routed to e), P_e = the mean over
    them of the scores normalised to sum 1; sum_e f_e P_e, the rows weighed by their loss tokens."""
    loss_tokens = [int((row != -100).sum()) for row in targets]
    total = torch.zeros(())
    for logits, chosen in routing:
        num_experts = logits.shape[-1]
        for b in range(logits.shape[0]):
            tokens = [t for t in range(logits.shape[1]) if real[b, t]]
            f, p = [0.0] * num_experts, [torch.zeros(()) for _ in range(num_experts)]
            for t in tokens:
                scores = (
                    torch.sigmoid(logits[b, t])
                    if score_function == "sigmoid"
                    else torch.softmax(logits[b, t], 0)
                )
                for e in range(num_experts):
                    p[e] = p[e] + scores[e] / scores.sum() / len(tokens)
                for e in chosen[b, t].tolist():
                    f[e] += num_experts / (top_k * len(tokens))
            total = total + sum(f[e] * p[e] for e in range(num_experts)) * loss_tokens[b] / sum(
                loss_tokens
            )
    return total


def z_reference(routing: list, real: torch.Tensor) -> torch.Tensor:
    """ST-MoE's eq. 5 token by token: the mean over real tokens of log(sum_e exp(logit_e))^2, summed
    over MoE layers."""
    total, tokens = torch.zeros(()), int(real.sum())
    for logits, _ in routing:
        for b, t in real.nonzero().tolist():
            total = total + torch.log(torch.exp(logits[b, t]).sum()) ** 2 / tokens
    return total


def captured_routing(model: torch.nn.Module) -> list:
    """Hooks that collect each router's (logits [B, T, E], chosen [B, T, k]) of the next forward."""
    routing = []

    def hook(module, args, output):
        batch, seq_len = hook.shape
        routing.append((output[2].view(batch, seq_len, -1), output[1].view(batch, seq_len, -1)))

    for module in model.modules():
        if isinstance(module, Router):
            module.register_forward_hook(hook)
    return routing, hook


LOSSES = {
    "flint": dict(
        output_router_logits=True,
        router_aux_loss_coef=0.25,
        router_sequence_loss_coef=0.1,
        router_z_loss_coef=0.01,
    ),
    "large4": dict(router_sequence_loss_coef=0.1, router_z_loss_coef=0.01),
}
# how each family's router scores its experts
SCORE_FUNCTIONS = {"flint": "sigmoid", "large4": "softmax"}


def family_batch(config):
    return make_batch(vocab=min(256, config.vocab_size))


def loss_and_grads(model, batch, extra=None) -> tuple[torch.Tensor, dict]:
    """model's loss on batch (plus extra(routing) of the routing it captured), and its gradients."""
    routing, hook = captured_routing(model)
    hook.shape = batch[0].shape
    loss = model(*batch)
    if extra is not None:
        loss = loss + extra(routing)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@only("flint")  # output_router_logits: Flint's published term
@pytest.mark.parametrize("masked", [True, False])
def test_the_layers_give_the_pooled_balance_term_bit_for_bit(masked):
    """What flint computed before (every router's logits kept, pooled after the last layer) and
    the statistics the layers add now: the same loss and gradients, to the bit."""
    config = tiny_config("flint", output_router_logits=True, router_aux_loss_coef=0.25)
    ids, targets, doc_ids = make_batch()
    batch = (ids, targets, doc_ids if masked else None)
    loss, grads = loss_and_grads(build(config), batch)
    mask = doc_ids >= 0 if masked else None
    expected, expected_grads = loss_and_grads(
        build(dataclasses.replace(config, output_router_logits=False)),
        batch,
        lambda r: 0.25 * pooled_reference([logits.flatten(0, 1) for logits, _ in r], 2, mask),
    )
    assert torch.equal(loss, expected)
    for name, grad in grads.items():
        assert torch.equal(grad, expected_grads[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_sequence_wise_and_z_losses_equal_the_plain_loops(family):
    """Each loss alone (and Flint's three together) against the loops above: values and
    gradients."""
    config = tiny_config(family)  # every router loss off
    batch = family_batch(config)
    real, score_function = batch[2] >= 0, SCORE_FUNCTIONS[family]
    terms = {
        "router_sequence_loss_coef": lambda r: 0.1
        * sequence_reference(r, real, batch[1], score_function, config.num_experts_per_tok),
        "router_z_loss_coef": lambda r: 0.01 * z_reference(r, real),
    }
    cases = [
        {name: value}
        for name, value in (("router_sequence_loss_coef", 0.1), ("router_z_loss_coef", 0.01))
    ]
    if family == "flint":
        cases.append(LOSSES["flint"])
        terms["output_router_logits"] = lambda r: 0.25 * pooled_reference(
            [logits.flatten(0, 1) for logits, _ in r], 2, real
        )
    plain, _ = loss_and_grads(build(config), batch)
    for case in cases:
        loss, grads = loss_and_grads(build(dataclasses.replace(config, **case)), batch)
        expected, expected_grads = loss_and_grads(
            build(config), batch, lambda r: sum(terms[name](r) for name in case if name in terms)
        )
        assert (loss - plain).abs() > 1e-3, f"{case}: the term adds nothing to compare"
        close(loss, expected, f"{family} {case} loss")
        for name, grad in grads.items():
            if grad is not None or expected_grads[name] is not None:
                close(grad, expected_grads[name], f"{family} {case} grad {name}")


def test_terms_by_hand():
    """Two layers of four tokens, E = 4, k = 1, the last token padding: f and P counted by hand."""
    big = 30.0  # the softmax of a one-hot logit row of this size is one-hot in FP32
    first = torch.tensor([[big, 0, 0, 0], [big, 0, 0, 0], [0, big, 0, 0], [0, 0, 0, big]])
    second = torch.tensor([[0, 0, big, 0], [0, 0, big, 0], [0, 0, big, 0], [big, 0, 0, 0]])
    real, targets = torch.tensor([[True, True, True, False]]), torch.zeros(1, 4, dtype=torch.long)

    def loss(losses: RouterLosses, layers: list[torch.Tensor], real: torch.Tensor) -> torch.Tensor:
        stats = losses.start(1, torch.device("cpu"))
        for slot, logits in enumerate(layers):
            stats = add_layer(
                stats, slot, logits.unsqueeze(0), logits.argmax(-1).view(1, -1, 1), real, "softmax"
            )
        return losses.loss(stats, real, targets)

    # balance, pooled over both layers: expert 0 twice, 1 once, 2 three times, of 6 -> f = P
    share = torch.tensor([2, 1, 3, 0]) / 6
    torch.testing.assert_close(
        loss(RouterLosses(4, 1, 2, balance=1.0), [first, second], real), 4 * (share * share).sum()
    )
    # sequence-wise, per layer over the row's 3 tokens: f_e = 4 / 3 * count_e and P_e = count_e / 3,
    # with counts (2, 1, 0, 0), then (0, 0, 3, 0)
    torch.testing.assert_close(
        loss(RouterLosses(4, 1, 2, sequence=1.0), [first, second], real),
        torch.tensor(4 / 9 * (4 + 1) + 4 / 9 * 9),
    )
    torch.testing.assert_close(
        loss(RouterLosses(4, 1, 2, z=1.0), [first, second], real), torch.tensor(2 * big**2)
    )
    balanced = torch.eye(4) * big  # every expert once: f = P = 1/4: both balance terms give k = 1
    torch.testing.assert_close(
        loss(
            RouterLosses(4, 1, 1, balance=1.0, sequence=1.0),
            [balanced],
            torch.ones(1, 4, dtype=torch.bool),
        ),
        torch.tensor(2.0),
    )


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_no_router_keeps_its_logits_after_backward(family):
    """The logits live on only in what autograd saves, and backward frees that (issue 21: 47 layers
    of [N, E] FP32 logits kept after each step)."""
    model = build(tiny_config(family, **LOSSES[family]))
    alive = []

    def hook(module, args, output):
        alive.append(weakref.ref(output[2]))

    routers = [m for m in model.modules() if isinstance(m, Router)]
    for router in routers:
        router.register_forward_hook(hook)
    loss = model(*make_batch(vocab=min(256, model.config.vocab_size)))
    # Flint's: 2
    moe_layers = sum(model.config.is_moe_layer(i) for i in range(model.config.num_hidden_layers))
    # held by the graph until backward
    assert len(alive) == moe_layers and all(ref() is not None for ref in alive)
    loss.backward()
    del loss
    gc.collect()
    assert all(ref() is None for ref in alive), "a router's logits outlived backward"
    for router in routers:  # and no router holds a tensor besides its weight and statistics buffers
        assert not [name for name, value in vars(router).items() if torch.is_tensor(value)]


# Flint's block call; Large 4's blocks compile whole with the losses on in test_compile.py
@pytest.mark.slow
@only("flint")
def test_an_moe_block_with_its_statistics_compiles_to_one_graph(one_thread):
    """fullgraph=True: adding the statistics breaks no graph (counts by scatter-add into a fixed
    size); the compiled block gives the eager block's output, statistics and gradients."""
    model = build(tiny_config("flint", **LOSSES["flint"]))
    block, (ids, _, doc_ids) = model.layers["2"], make_batch()
    rope, masks = model.block_inputs(doc_ids, None, *ids.shape, ids.device)
    x = torch.randn(
        *ids.shape,
        model.config.hidden_size,
        generator=torch.Generator().manual_seed(0),
        requires_grad=True,
    )

    def run(layer) -> tuple:
        out, stats = layer(
            x,
            rope,
            masks,
            stats=model.router_losses.start(ids.shape[0], x.device),
            real=doc_ids >= 0,
        )
        objective = out.sum() + sum(value.float().sum() for value in stats.values())
        return out, stats, torch.autograd.grad(objective, [x, *layer.parameters()])

    torch._dynamo.reset()
    (out, stats, grads), compiled = (
        run(block),
        run(torch.compile(block, fullgraph=True, backend="aot_eager")),
    )
    close(compiled[0], out, "output")
    for name, value in stats.items():
        close(compiled[1][name], value, name)
    for grad, expected in zip(compiled[2], grads):
        assert_close_to_scale(grad, expected, rtol=1e-4)


# ---------------------------------------------------------------------- layouts against one process


def one_process(config, batch, parts: int) -> tuple[torch.Tensor, dict]:
    """One process that cuts the batch into `parts` micro-batches as a layout does (a pipeline's
    micro-batches, the expert-parallel ranks' batches: the balance and z terms are per micro-batch),
    each weighed by its loss tokens as ParallelModel weighs them."""
    model, tokens, total = build(config), (batch[1] != -100).sum(), torch.zeros(())
    for chunk in zip(*(t.chunk(parts) for t in batch)):
        loss = model(*chunk) * (chunk[1] != -100).sum() / tokens
        loss.backward()
        total += loss.detach()
    return total, {n: p.grad for n, p in model.named_parameters()}


def check_router_losses_in_layouts(layouts: dict[str, list[tuple[dict, int]]]) -> None:
    """For each family and (layout, micro-batches of the one-process run): the step's loss and every
    gradient with every router loss on."""
    for family, cases in layouts.items():
        config = tiny_config(family, **LOSSES[family])
        batch = family_batch(config)
        for layout, parts in cases:
            expected, expected_grads = one_process(config, batch, parts)
            cfg = ParallelConfig.from_dict({"param_dtype": "float32", "dp_shard": 1, **layout})
            mesh = build_mesh(cfg, "cpu", config.num_experts)
            pm = parallelize(build(config), cfg, mesh)
            close(
                pm.forward_backward(*rows_of_this_rank(mesh, batch)),
                expected,
                f"{family} {layout} loss",
            )
            for name, param in pm.module.named_parameters():
                if expected_grads[name] is None:
                    assert param.grad is None, f"{family} {layout}: frozen {name} got a gradient"
                else:
                    close(full(param.grad), expected_grads[name], f"{family} {layout} grad {name}")


@pytest.mark.slow
def test_router_losses_in_every_layout_match_one_process():
    """Every router loss on, on 2 gloo ranks, against one process run on the same micro-batches: a
    pipeline of 2 stages (1F1B: 2 micro-batches; Large 4's stages 0-3 | 4-7 both hold MoE layers, so
    the statistics cross with their gradient), context parallel (counts summed over the cp group,
    each rank's share of the sums), expert parallel (each rank's own batch) and FSDP with every
    block recomputed in backward (the statistics are block outputs: the recompute adds nothing
    twice)."""
    spawn(
        2,
        check_router_losses_in_layouts,
        registered(
            {
                "flint": [
                    ({"pp": 2}, 2),
                    ({"cp": 2}, 1),
                    ({"ep": 2}, 2),
                    ({"dp_shard": 2, "activation_checkpointing": "full"}, 2),
                ],
                "large4": [({"pp": 2}, 2), ({"cp": 2}, 1)],
            }
        ),
    )


@slow
def test_router_losses_in_more_layouts_match_one_process():
    """ZB-V (4 stages in a V, whose boundaries carry the statistics 3 times, the backward split into
    input and weight gradients) and Large 4 under expert parallel, on 2 ranks; pipeline with context
    parallel (the last stage sums the counts over its cp group) and expert with context parallel on
    4."""
    spawn(
        2,
        check_router_losses_in_layouts,
        registered(
            {"flint": [({"pp": 2, "pp_schedule": "ZBVZeroBubble"}, 4)], "large4": [({"ep": 2}, 2)]}
        ),
    )
    spawn(
        4,
        check_router_losses_in_layouts,
        registered(
            {
                "flint": [({"pp": 2, "cp": 2}, 2), ({"ep": 2, "cp": 2}, 2)],
                "large4": [({"pp": 2, "cp": 2}, 2)],
            }
        ),
    )


def collapsed_router(selection_bias: bool) -> Router:
    """8 experts, top 2, whose weights send most tokens to experts 0 and 1."""
    router = Router(16, 8, 2, norm_topk_prob=True, selection_bias=selection_bias)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=torch.Generator().manual_seed(0)) * 0.1)
        router.weight[:2] += 0.2  # inputs below are positive on average: experts 0 and 1 win
    return router


@pytest.mark.usefixtures("one_thread")
def test_the_bias_chooses_and_the_scores_weigh():
    router = collapsed_router(selection_bias=True)
    x = torch.rand(32, 16, generator=torch.Generator().manual_seed(1))
    router.selection_bias[5:7] = 10.0  # far above any sigmoid score difference
    weights, indices, _ = router(x)
    assert (indices.sort(dim=1).values == torch.tensor([5, 6])).all()
    scores = torch.sigmoid(x @ router.weight.T)[:, 5:7]
    torch.testing.assert_close(
        weights.sort(dim=1).values, (scores / scores.sum(1, keepdim=True)).sort(dim=1).values
    )


@pytest.mark.usefixtures("one_thread")
def test_bias_updates_balance_a_collapsed_router():
    router = collapsed_router(selection_bias=True)
    x = torch.rand(512, 16, generator=torch.Generator().manual_seed(1))

    def load() -> torch.Tensor:
        router(x)
        return router.tokens_per_expert.float() / router.tokens_per_expert.float().mean()

    before = load()
    assert before.max() > 3 and before.min() == 0
    loads = []
    # the sign rule ends oscillating around balance: judge the mean of the last steps
    for _ in range(400):
        loads.append(load())
        update_selection_bias(
            {0: router}, router.tokens_per_expert.float().unsqueeze(0), rate=0.002
        )
    after = torch.stack(loads[-100:]).mean(0)
    assert after.max() < 1.1 and after.min() > 0.9, after


@pytest.mark.usefixtures("one_thread")
def test_bias_update_is_the_sign_rule():
    router = Router(4, 4, 1, norm_topk_prob=False, selection_bias=True)
    # mean 3
    update_selection_bias({1: router}, torch.tensor([[9.0, 9, 9, 9], [1.0, 2, 3, 6]]), rate=0.1)
    torch.testing.assert_close(router.selection_bias, torch.tensor([0.1, 0.1, 0.0, -0.1]))


class TwoRouters(torch.nn.Module):
    """named_modules() like a Flint with MoE layers 1 and 2: layers.<i>.mlp.router."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): torch.nn.Module() for i in (1, 2)})
        for layer in self.layers.values():
            layer.mlp = torch.nn.Module()
            layer.mlp.router = Router(4, 4, 1, norm_topk_prob=False)


@dataclasses.dataclass
class ThreeLayers:
    """What RoutingMonitor reads of a model's config: 3 layers, MoE layers 1 and 2 of 4 experts, top
    1."""

    num_hidden_layers: int = 3
    num_experts: int = 4
    num_experts_per_tok: int = 1
    capacity_factor: float | None = None
    router_bias_update_rate: float = 0.0

    def is_moe_layer(self, i: int) -> bool:
        return i > 0


@pytest.mark.usefixtures("one_thread")
def test_loads_and_one_warning_per_idle_streak(capsys):
    config = ThreeLayers()
    model = TwoRouters()
    monitor = RoutingMonitor(model, config, torch.device("cpu"), idle_steps=3)
    model.layers["1"].mlp.router.tokens_per_expert.copy_(torch.tensor([4.0, 4, 4, 4]))
    model.layers["2"].mlp.router.tokens_per_expert.copy_(torch.tensor([8.0, 6, 2, 0]))
    for step in range(1, 6):
        monitor.after_step(step)
    stats = monitor.stats()
    assert stats == {
        "1": {"max_load": 1.0, "min_load": 1.0, "tokens": [4, 4, 4, 4]},
        "2": {"max_load": 2.0, "min_load": 0.0, "tokens": [8, 6, 2, 0]},
    }
    assert worst_layer(stats) == " | experts max/min load 2.00/0.00 (layer 2)"
    warnings = capsys.readouterr().err.strip().splitlines()
    assert warnings == [
        "WARNING: step 3: layer 2: expert(s) 3 received no tokens for 3 steps in a "
        "row (routing "
        "collapse: see GUIDE.md, Load balancing)"
    ]


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_training_with_the_bias_resumes_exactly_and_is_not_exported(tmp_path, family):
    """router_bias_update_rate through train.py: the bias moves by the rate each step, a native
    checkpoint carries it and the rate, a resume routes as the uninterrupted run, and both ways of
    exporting to the published format refuse."""
    bias = [
        "--model.router_bias_update_rate=0.01",
        "--training.steps=4",
        "--logging.every=1",
        "--training.sample_tokens=0",
    ]
    run_debug(tmp_path / "whole", *bias, "--checkpoint.every=2", family=family)
    step2 = tmp_path / "whole" / "ckpt" / "run_0001" / "step_00000002"
    run_debug(tmp_path / "resumed", *bias, f"--checkpoint.resume={step2}", family=family)
    whole, resumed = train_losses(tmp_path / "whole"), train_losses(tmp_path / "resumed")
    # the saved biases route steps 3 and 4 the same way
    assert resumed == {3: whole[3], 4: whole[4]}
    model = convert.load_native(tmp_path / "whole" / "ckpt" / "run_0001" / "step_00000004")
    assert model.config.router_bias_update_rate == 0.01
    # layer 2 is an MoE layer of both debug configs
    bias_values = model.layers["2"].mlp.router.selection_bias
    moe_layers = [i for i in range(model.config.num_hidden_layers) if model.config.is_moe_layer(i)]
    steps = torch.stack([model.layers[str(i)].mlp.router.selection_bias for i in moe_layers]) / 0.01
    # each step moved each bias by -0.01, 0 or +0.01
    torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-4)
    assert (steps.abs().sum(dim=1) > 0).all()
    logged = [r for r in records(tmp_path / "whole") if "routing" in r][-1]["routing"]["2"]["bias"]
    # the last record's bias: report.py draws it
    assert logged == pytest.approx(bias_values.tolist(), abs=1e-5)
    with pytest.raises(
        ConfigError,
        match=r"export_hf cannot export a model with "
        r"\[model\].router_bias_update_rate",
    ):
        run_debug(
            tmp_path / "export", *bias, f"--checkpoint.export_hf={tmp_path / 'hf'}", family=family
        )
    with pytest.raises(
        ValueError,
        match=r"per-expert selection bias .* the published format has no "
        r"place for",
    ):
        convert.export_published(convert.NativeDir(step2), model.config, tmp_path / "hf")


@only("flint")  # Flint's sigmoid scores and its vocabulary
def test_the_sequence_wise_term_weighs_each_row_by_its_loss_tokens():
    """Rows of the same real tokens but different loss tokens (targets masked, inputs kept): the
    term weighs each sequence by its loss tokens, so that it does not depend on how a step is cut.
    Every other batch of the suite gives all rows the same loss tokens, where a plain mean over rows
    is the same."""
    config = tiny_config()
    ids, targets, doc_ids = make_batch()
    targets = targets.clone()
    targets[0, :9] = -100  # row 0 keeps 2 loss tokens, row 1 7, rows 2 and 3 all 11
    targets[1, :4] = -100
    loss_tokens = (targets != -100).sum(dim=1).tolist()
    assert len(set(loss_tokens)) > 1, loss_tokens
    batch, real = (ids, targets, doc_ids), doc_ids >= 0
    # the term then outweighs the cross-entropy: a wrong weighing is far outside FP32 noise
    coef = 10.0
    loss, grads = loss_and_grads(
        build(dataclasses.replace(config, router_sequence_loss_coef=coef)), batch
    )
    expected, expected_grads = loss_and_grads(
        build(config),
        batch,
        lambda r: coef
        * sequence_reference(r, real, targets, "sigmoid", config.num_experts_per_tok),
    )
    close(loss, expected, "loss")
    for name, grad in grads.items():
        if grad is not None or expected_grads[name] is not None:
            close(grad, expected_grads[name], f"grad {name}")


def test_train_py_passes_on_the_routing_settings_of_its_config(tmp_path, monkeypatch):
    """One step of the debug config with force_balanced_routing and idle_expert_steps = 7 set: the
    routing record shows every expert of every MoE layer with the same load (forced balance routes
    round robin), and the routing monitor is built to warn after the 7 steps asked (recorded)."""
    import train

    idle_steps = []

    class Recording(RoutingMonitor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            idle_steps.append(self.idle_steps)

    monkeypatch.setattr(train, "RoutingMonitor", Recording)
    run_debug(
        tmp_path,
        "--training.steps=1",
        "--logging.every=1",
        "--training.sample_tokens=0",
        "--training.force_balanced_routing=true",
        "--logging.idle_expert_steps=7",
    )
    routing = next(r["routing"] for r in records(tmp_path) if "routing" in r)
    loads = [(layer["max_load"], layer["min_load"]) for layer in routing.values()]
    assert loads and set(loads) == {(1.0, 1.0)}, routing
    assert idle_steps == [7]
