"""routing.py: expert loads, idle-expert warnings, and the aux-loss-free selection bias."""

import pytest
import torch

import convert
from config import ConfigError
from moe import Router
from model import FlintConfig
from routing import RoutingMonitor, update_selection_bias, worst_layer
from conftest import records, run_debug, train_losses

pytestmark = pytest.mark.usefixtures("one_thread")


def collapsed_router(selection_bias: bool) -> Router:
    """8 experts, top 2, whose weights send most tokens to experts 0 and 1."""
    router = Router(16, 8, 2, norm_topk_prob=True, selection_bias=selection_bias)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=torch.Generator().manual_seed(0)) * 0.1)
        router.weight[:2] += 0.2  # inputs below are positive on average: experts 0 and 1 win
    return router


def test_the_bias_chooses_and_the_scores_weigh():
    router = collapsed_router(selection_bias=True)
    x = torch.rand(32, 16, generator=torch.Generator().manual_seed(1))
    router.selection_bias[5:7] = 10.0  # far above any sigmoid score difference
    weights, indices, _ = router(x)
    assert (indices.sort(dim=1).values == torch.tensor([5, 6])).all()
    scores = torch.sigmoid(x @ router.weight.T)[:, 5:7]
    torch.testing.assert_close(weights.sort(dim=1).values, (scores / scores.sum(1, keepdim=True)).sort(dim=1).values)


def test_bias_updates_balance_a_collapsed_router():
    router = collapsed_router(selection_bias=True)
    x = torch.rand(512, 16, generator=torch.Generator().manual_seed(1))

    def load() -> torch.Tensor:
        router(x)
        return router.tokens_per_expert.float() / router.tokens_per_expert.float().mean()
    before = load()
    assert before.max() > 3 and before.min() == 0
    loads = []
    for _ in range(400):  # the sign rule ends oscillating around balance: judge the mean of the last steps
        loads.append(load())
        update_selection_bias({0: router}, router.tokens_per_expert.float().unsqueeze(0), rate=0.002)
    after = torch.stack(loads[-100:]).mean(0)
    assert after.max() < 1.1 and after.min() > 0.9, after


def test_bias_update_is_the_sign_rule():
    router = Router(4, 4, 1, norm_topk_prob=False, selection_bias=True)
    update_selection_bias({1: router}, torch.tensor([[9.0, 9, 9, 9], [1.0, 2, 3, 6]]), rate=0.1)  # mean 3
    torch.testing.assert_close(router.selection_bias, torch.tensor([0.1, 0.1, 0.0, -0.1]))


class TwoRouters(torch.nn.Module):
    """named_modules() like a Flint with MoE layers 1 and 2: layers.<i>.mlp.router."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): torch.nn.Module() for i in (1, 2)})
        for layer in self.layers.values():
            layer.mlp = torch.nn.Module()
            layer.mlp.router = Router(4, 4, 1, norm_topk_prob=False)


def test_loads_and_one_warning_per_idle_streak(capsys):
    config = FlintConfig.from_name("tiny", num_hidden_layers=3, mlp_only_layers=[0], num_experts=4, num_experts_per_tok=1)
    model = TwoRouters()
    monitor = RoutingMonitor(model, config, torch.device("cpu"), idle_steps=3)
    model.layers["1"].mlp.router.tokens_per_expert.copy_(torch.tensor([4.0, 4, 4, 4]))
    model.layers["2"].mlp.router.tokens_per_expert.copy_(torch.tensor([8.0, 6, 2, 0]))
    for step in range(1, 6):
        monitor.after_step(step)
    stats = monitor.stats()
    assert stats == {"1": {"max_load": 1.0, "min_load": 1.0, "tokens": [4, 4, 4, 4]},
                     "2": {"max_load": 2.0, "min_load": 0.0, "tokens": [8, 6, 2, 0]}}
    assert worst_layer(stats) == " | experts max/min load 2.00/0.00 (layer 2)"
    warnings = capsys.readouterr().err.strip().splitlines()
    assert warnings == ["WARNING: step 3: layer 2: expert(s) 3 received no tokens for 3 steps in a row (routing "
                        "collapse: see the README's Load balancing)"]


def test_training_with_the_bias_resumes_exactly_and_is_not_exported(tmp_path):
    bias = ["--model.router_bias_update_rate=0.01", "--training.steps=4", "--logging.every=1",
            "--training.sample_tokens=0"]
    run_debug(tmp_path / "whole", *bias, "--checkpoint.every=2")
    step2 = tmp_path / "whole" / "ckpt" / "run_0001" / "step_00000002"
    run_debug(tmp_path / "resumed", *bias, f"--checkpoint.resume={step2}")
    whole, resumed = train_losses(tmp_path / "whole"), train_losses(tmp_path / "resumed")
    assert resumed == {3: whole[3], 4: whole[4]}  # the saved biases route steps 3 and 4 the same way
    model = convert.load_native(tmp_path / "whole" / "ckpt" / "run_0001" / "step_00000004")
    bias_values = model.layers["2"].mlp.router.selection_bias
    assert bias_values.abs().max() == pytest.approx(0.04)  # four steps of 0.01 for the most starved expert
    logged = [r for r in records(tmp_path / "whole") if "routing" in r][-1]["routing"]["2"]["bias"]
    assert logged == pytest.approx(bias_values.tolist(), abs=1e-5)  # the last record's bias: report.py draws it
    with pytest.raises(ConfigError, match=r"export_hf cannot export a model with \[model\].router_bias_update_rate"):
        run_debug(tmp_path / "export", *bias, f"--checkpoint.export_hf={tmp_path / 'hf'}")
    with pytest.raises(ValueError, match=r"per-expert selection bias .* the published format has no place for"):
        convert.export_published(convert.NativeDir(step2), model.config, tmp_path / "hf")
