"""metrics.py: what a person sees of a run besides the loss curve: durations, the records a run
keeps or drops in a shared log, the model's FLOPs per token, the cached CPU peak."""

import json

import metrics
from metrics import drop_superseded_records, duration, model_flops_per_token
from model import Flint, FlintConfig


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


def test_flops_per_token_are_the_whole_models_counted_on_meta():
    config = FlintConfig.from_name("tiny", num_hidden_layers=4)
    assert model_flops_per_token(config, 64) == Flint(config).flops_per_token(64) > 0


def test_a_damaged_peak_cache_is_measured_again(tmp_path, monkeypatch):
    cache = tmp_path / "cpu_peak.json"
    monkeypatch.setattr(metrics, "CPU_PEAK_CACHE", cache)
    assert metrics.read_peak_cache() == {}
    cache.write_text("[1, 2")
    assert metrics.read_peak_cache() == {}
    cache.write_text('{"some cpu": 1.5e11}')
    assert metrics.read_peak_cache() == {"some cpu": 1.5e11}
