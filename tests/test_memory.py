"""memory.py: the per-GPU memory table counts sharded state as a person would by hand."""

import subprocess
import sys
from pathlib import Path

import pytest

import memory
from config import ConfigError
from memory import GIB, memory_per_gpu, memory_table
from model import FlintConfig, build_model
from parallel import ParallelConfig

ROOT = Path(__file__).resolve().parent.parent


def tiny_config():
    return FlintConfig.from_name("tiny", num_hidden_layers=4)


def test_memory_table_counts_sharded_state_by_hand():
    config = tiny_config()
    total = build_model(config).num_params()
    row = memory_per_gpu(config, ParallelConfig(dp_shard=2, ep=2).resolve(4, 8), seq_len=16, batch_size=2)
    # every parameter is split 4 ways: experts over ep x dp_shard, the rest over dp_shard x ep
    assert abs(row["params"] * GIB - 4 * total / 4) < 1 and abs(row["optimizer"] * GIB - 8 * total / 4) < 1
    full_ac = memory_per_gpu(config, ParallelConfig(dp_shard=4, activation_checkpointing="full").resolve(4), 16, 2)
    no_ac = memory_per_gpu(config, ParallelConfig(dp_shard=4).resolve(4), 16, 2)
    assert full_ac["activations"] < no_ac["activations"]
    assert "| mine: dp_shard=2 ep=2 ac=none |" in memory_table(config, [("mine", ParallelConfig(dp_shard=2, ep=2))], 16, 2)


def test_command_prints_the_released_layouts_labelled(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    memory.main(["--config", "configs/flint-8gpu.toml", "--gpus", "8"])
    out = capsys.readouterr().out
    assert "| config flint-8gpu.toml: ep=8 ac=full |" in out and "| candidate: dp_shard=8 ac=none |" in out
    memory.main(["--config", "configs/flint-8gpu.toml", "--parallel.ep=4", "--parallel.dp_shard=2", "--data.seq_len=8192"])
    out = capsys.readouterr().out
    assert "seq_len 8192" in out and "| config flint-8gpu.toml: dp_shard=2 ep=4 ac=full |" in out


def test_command_errors_are_one_line(monkeypatch):
    monkeypatch.chdir(ROOT)
    for args, message in ((["--gpus", "7"], r"configs/flint-8gpu.toml on --gpus 7: \[parallel\] pp \* dp_replicate"),
                          (["--parallel.ep=3"], r"command line --parallel.ep: \[parallel\] ep = 3 must divide"),
                          (["--model.preset=huge"], "unknown model preset 'huge'")):
        with pytest.raises(ConfigError, match=message):
            memory.main(["--config", "configs/flint-8gpu.toml", *args])
    result = subprocess.run([sys.executable, "memory.py", "--config", "configs/flint-8gpu.toml", "--gpus", "7"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr.startswith("error: ") and "Traceback" not in result.stderr
