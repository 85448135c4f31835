"""bench.py smoke test: it runs end to end and writes well-formed JSON. Speed is never asserted."""

import json
import math

import pytest
import torch

import bench
from baselines import plain_eager_loss, transformers_loss, transformers_reference
from model import FlintConfig, build_model


def test_quick_run_writes_wellformed_json(tmp_path):
    out = tmp_path / "bench.json"
    bench.main(["--quick", "--json", str(out)])
    result = json.loads(out.read_text())
    assert not list(tmp_path.glob("*.tmp")), "the temporary JSON was not renamed into place"

    rows = {row["name"]: row for row in result["rows"]}
    assert {"flint (eager)", "plain eager baseline", "attention flex (forward only)"} <= set(rows)
    if "transformers reference" in rows and rows["transformers reference"].get("error", "").startswith("skipped"):
        del rows["transformers reference"]  # optional: transformers is not a dependency
    for row in rows.values():
        assert "error" not in row, row
        for key in ("step_s", "tokens_per_s", "mfu", "peak_memory_gib"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["name"], key, row[key])
        assert len(row["step_s_all"]) == result["reps"] == 1

    split = rows["flint (eager)"]["split"]
    assert list(split) == bench.SPLIT_ORDER
    assert all(fraction >= 0 for fraction in split.values())
    assert sum(split.values()) == pytest.approx(1.0)
    # Every timed module ran inside the profiled step, so each got some of its time.
    for category in ("attention core", "routed experts", "router", "head + loss", bench.OPTIMIZER):
        assert split[category] > 0, category

    sweep = result["sweep"]
    assert {point["layer"] for point in sweep} == {"sliding_attention", "full_attention"}
    assert all(point["ms"] > 0 for point in sweep)
    assert result["peak_flops"] > 0 and result["flops_per_token"] > 0
    assert FlintConfig.from_hf_config(result["hf_config"]).hidden_size == 64  # the tiny preset


def test_plain_eager_baseline_computes_the_same_network():
    """The baseline must be the same architecture over the same weights, or comparing speed means nothing."""
    config = FlintConfig.from_name("tiny", initializer_range=0.3)  # large weights: differences would show
    model = build_model(config, seed=0)
    ids = torch.randint(0, config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    ours = bench.flint_loss(model, ids[:, :-1], ids[:, 1:])
    baseline = plain_eager_loss(model, ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(baseline, ours, rtol=1e-5, atol=1e-5)
    for p, g_ours, g_base in zip(model.parameters(), torch.autograd.grad(ours, list(model.parameters())),
                                 torch.autograd.grad(baseline, list(model.parameters()))):
        torch.testing.assert_close(g_base, g_ours, rtol=1e-4, atol=1e-6)


def test_transformers_reference_computes_the_same_network():
    """Only where transformers can be imported (it is not a dependency): its FlintForCausalLM,
    loaded from our export, gives our loss and gradients on our weights."""
    pytest.importorskip("transformers")
    config = FlintConfig.from_name("tiny", initializer_range=0.3)
    model = build_model(config, seed=0)
    reference = transformers_reference(model)
    ids = torch.randint(0, config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    ours = bench.flint_loss(model, ids[:, :-1], ids[:, 1:])
    theirs = transformers_loss(reference, ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    grad_norm = torch.stack([g.norm() for g in torch.autograd.grad(ours, list(model.parameters()))]).norm()
    reference_norm = torch.stack([g.norm() for g in torch.autograd.grad(theirs, list(reference.parameters()))]).norm()
    torch.testing.assert_close(reference_norm, grad_norm, rtol=1e-4, atol=1e-6)


def test_bad_section_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--sections", "main,warp"])
    assert "--sections: unknown section 'warp'" in capsys.readouterr().err
