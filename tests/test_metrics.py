"""metrics.py: what a person sees of a run besides the loss curve: durations, the records a run
keeps or drops in a shared log, the model's FLOPs per token, the cached CPU peak."""

import json

import pytest
import torch

import metrics
import train
from helpers import DEFAULT_FAMILY, FAMILY_NAMES, debug_configs, tiny_config
from metrics import drop_superseded_records, duration, model_flops_per_token
from registry import model_class

DEBUG = str(debug_configs()[DEFAULT_FAMILY])  # the metrics machinery is the same for every model


def test_durations_read_as_minutes_and_seconds_then_hours_and_minutes():
    assert [duration(s) for s in (0, 59.9, 61, 3599, 3600, 7325)] == ["0m00s", "0m59s", "1m01s", "59m59s",
                                                                       "1h00m", "2h02m"]


def test_a_run_drops_only_its_own_records_past_its_resume_step(tmp_path):
    log = tmp_path / "metrics.jsonl"
    lines = [{"run": "a", "step": 1}, {"run": "b", "step": 5}, {"run": "a", "step": 3}, {"step": 9}]
    log.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"run": "a", "ste')  # a crash mid-line
    drop_superseded_records(log, "a", 2)
    assert [json.loads(line) for line in log.read_text().splitlines()] == [lines[0], lines[1], lines[3]]
    before = log.read_text()
    drop_superseded_records(log, "c", 0)  # nothing of run c: the file is left as it is
    assert log.read_text() == before


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_flops_per_token_are_the_whole_models_counted_on_meta(family):
    config = tiny_config(family)
    assert model_flops_per_token(config, 64) == model_class(config)(config).flops_per_token(64) > 0


def test_a_damaged_peak_cache_is_measured_again(tmp_path, monkeypatch):
    cache = tmp_path / "cpu_peak.json"
    monkeypatch.setattr(metrics, "CPU_PEAK_CACHE", cache)
    assert metrics.read_peak_cache() == {}
    cache.write_text("[1, 2")
    assert metrics.read_peak_cache() == {}
    cache.write_text('{"some cpu": 1.5e11}')
    assert metrics.read_peak_cache() == {"some cpu": 1.5e11}


def test_cpu_peak_is_measured_once_per_machine_and_shared_by_its_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "CPU_PEAK_CACHE", tmp_path / "cache" / "cpu_peak.json")
    measured = []
    monkeypatch.setattr(metrics, "measure_cpu_flops", lambda: measured.append(1) or 2e11)
    cfg = train.load_config(DEBUG)
    one = train.Run(0, 1, 0, 1, torch.device("cpu"))
    assert metrics.run_peak_flops(cfg, one) == 2e11 and metrics.run_peak_flops(cfg, one) == 2e11
    assert len(measured) == 1  # the second run reads the cache
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    two_on_one_machine = train.Run(0, 2, 0, 2, torch.device("cpu"))
    assert metrics.run_peak_flops(cfg, two_on_one_machine) == 2e11  # shared cores: not 2 x
    four_on_two_machines = train.Run(0, 4, 0, 4, torch.device("cpu"))
    assert metrics.run_peak_flops(cfg, four_on_two_machines) == 4e11
    given = train.load_config(DEBUG, ["--logging.peak_tflops=0.5"])
    assert metrics.run_peak_flops(given, two_on_one_machine) == pytest.approx(1e12)  # per device, as the key says


def test_a_logged_step_is_one_line_with_units_and_the_same_numbers_in_the_log(tmp_path, capsys):
    """The line a person reads and the JSON record agree: the loss as given, MFU from tokens/s, the
    FLOPs per token and the given peak, and the busiest layer's expert loads at the end."""
    log = tmp_path / "metrics.jsonl"
    cfg = train.load_config(DEBUG, [f"--logging.jsonl={log}", "--logging.peak_tflops=0.1"])
    logger = metrics.MetricsLogger(cfg, train.Run(0, 1, 0, 1, torch.device("cpu")), cfg.model_config,
                                   start_step=0, run_dir=tmp_path / "run_0001")
    routing = {"2": {"max_load": 1.75, "min_load": 0.25}, "3": {"max_load": 3.5, "min_load": 0.0}}
    logger.log_train(5, loss=2.5, lr=1e-3, grad_norm=0.5, routing=routing)
    line = capsys.readouterr().out.splitlines()[-1]
    (record,) = [json.loads(text) for text in log.read_text().splitlines()]
    assert record["run"] == str(tmp_path / "run_0001") and record["tokens"] == 5 * 4 * 64  # steps x batch x seq
    assert record["mfu_percent"] == pytest.approx(100 * record["tokens_per_s"] * logger.flops_per_token / 1e11)
    assert line.startswith("step  5/20 | loss 2.5000 | lr 1.00e-03 | grad norm 0.500 | ")  # steps padded to 20's width
    assert f"{record['tokens_per_s']:,.0f} tokens/s | MFU {record['mfu_percent']:.2f}% | mem " in line
    assert " GiB | " in line and " elapsed | " in line
    assert line.endswith(" left | experts max/min load 3.50/0.00 (layer 3)")  # the busiest layer, its own min
    assert logger.summary["first_loss"] == 2.5
