"""report.py: the page's plotted series read back through their axes give the logged values, drawn
the right way up; the summary table reads back hand-computed values; runs overlay; lines that are
not records are skipped and counted; no string of a user's file is live markup on the page; hostile
and careless input gives a page or one line; a real browser draws the page."""

import ast
import copy
import html
import json
import math
import re
import shutil
import struct
import subprocess
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

import report
from report import load_runs, memory_timeline_svg, render, thinned, write_report

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
LINE_CHARTS = {
    "lr": "lr",
    "grad-norm": "grad_norm",
    "tokens-per-s": "tokens_per_s",
    "mfu": "mfu_percent",
    "memory": "memory_gib",
}


# ---------------------------------------------------------------------------- reading the page back


class Chart:
    def __init__(self):
        self.x_ticks, self.y_ticks = [], []  # (pixel, label)
        self.series = []  # {"run", "what", "stroke", "points": [(px, py)]}: a stretch each
        self.cells = []  # (x, width, fill, title, y)
        self.areas = {}  # a polygon's data-holder -> its points [(px, py)]
        self.legend = []
        self.circles = []  # (cx, cy, title): a plotted point each
        self.marks = []  # (x, title): a value that is not a finite number, marked at the top
        self.frame = None  # the plot area's rect: (x, y, width, height)


class Page(HTMLParser):
    """The charts of a report (by data-chart), the skipped-lines notes, and every text of the
    page."""

    def __init__(self, text: str):
        super().__init__()
        self.rawdata_text = text
        self.charts, self.skipped, self.texts = {}, [], []
        self.elements = []  # (tag, attributes) of every element, in order
        self.rows = []  # the table's rows: each a list of its cells' text
        self.chart, self.group, self.text_attrs, self.cell = None, None, None, None
        self.circle, self.mark, self.table_cell = None, None, None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.elements.append((tag, attrs))
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self.table_cell = ""
        elif tag == "circle":
            self.circle = [float(a["cx"]), float(a["cy"]), None]
        elif tag == "text" and a.get("class") == "not-finite":
            self.mark = [float(a["x"]), None]
        if tag == "svg":  # one without data-chart: markup a user's file put in, which a test finds
            self.chart = self.charts.setdefault(a.get("data-chart", "?"), Chart())
        elif tag == "g":
            self.group = a.get("class")
        elif tag == "text":
            self.text_attrs = a
        elif tag == "polyline" and {"data-run", "data-what", "stroke", "points"} <= set(a):
            self.chart.series.append(
                {
                    "run": a["data-run"],
                    "what": a["data-what"],
                    "stroke": a["stroke"],
                    "points": [tuple(map(float, p.split(","))) for p in a["points"].split()],
                }
            )
        elif tag == "polygon":
            self.chart.areas[a["data-holder"]] = [
                tuple(map(float, p.split(","))) for p in a["points"].split()
            ]
        elif tag == "rect" and a.get("class") == "frame":
            self.chart.frame = tuple(float(a[key]) for key in ("x", "y", "width", "height"))
        elif tag == "rect" and "fill" in a and self.group is None:
            self.cell = [float(a["x"]), float(a["width"]), a["fill"], None, float(a["y"])]
        elif tag == "p" and "data-skipped" in a:
            self.skipped.append(int(a["data-skipped"]))

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self.table_cell is not None:
            self.rows[-1].append(self.table_cell.strip())
            self.table_cell = None
        elif tag == "circle" and self.circle:
            self.chart.circles.append(tuple(self.circle))
            self.circle = None
        elif tag == "text" and self.mark:
            self.chart.marks.append(tuple(self.mark))
            self.mark = None
        if tag == "g":
            self.group = None
        elif tag == "rect" and self.cell:
            self.chart.cells.append(tuple(self.cell))
            self.cell = None

    def handle_data(self, data):
        self.texts.append(data)
        if self.table_cell is not None:
            self.table_cell += data
        for element in (self.circle, self.mark):
            if element is not None and element[-1] is None:
                element[-1] = data
        if self.cell is not None:
            self.cell[3] = data
        if self.text_attrs is None or self.chart is None:
            return
        if self.group == "x-ticks":
            self.chart.x_ticks.append((float(self.text_attrs["x"]), data))
        elif self.group == "y-ticks":
            self.chart.y_ticks.append((float(self.text_attrs["y"]), data))
        elif self.group == "legend":
            self.chart.legend.append(data)
        self.text_attrs = None


def tick_value(label: str) -> float:
    return float(label[:-1]) * SUFFIXES[label[-1]] if label[-1] in SUFFIXES else float(label)


def axis(ticks: list[tuple[float, str]]):
    """pixel -> value, from the tick labels' positions; every tick must agree with the first and
    last."""
    (p0, v0), (p1, v1) = [(p, tick_value(label)) for p, label in (ticks[0], ticks[-1])]

    def to_value(p: float) -> float:  # in halves, so that +-1e308 does not overflow
        return 2 * (v0 / 2 + (p - p0) / (p1 - p0) * (v1 / 2 - v0 / 2))

    for p, label in ticks:
        # 0.01-pixel rounding
        assert to_value(p) == pytest.approx(tick_value(label), abs=1e-4 * abs(v1 - v0))
    return to_value, abs(v1 - v0)


def values_of(chart: Chart, run: str, what: str) -> list[tuple[float, float]]:
    """The data points of a run's series, read back through the chart's axes."""
    stretches = [s for s in chart.series if s["run"] == run and s["what"] == what]
    assert stretches, (run, what)
    x_of, _ = axis(chart.x_ticks)
    y_of, _ = axis(chart.y_ticks)
    return [(x_of(px), y_of(py)) for s in stretches for px, py in s["points"]]


def assert_points(chart: Chart, run: str, what: str, expected: list[tuple[float, float]]) -> None:
    got = values_of(chart, run, what)
    _, x_span = axis(chart.x_ticks)
    _, y_span = axis(chart.y_ticks)
    assert len(got) == len(expected), (run, what)
    for (gx, gy), (ex, ey) in zip(got, expected):  # pixels are rounded to 0.01 of a ~450 pixel axis
        assert gx == pytest.approx(ex, abs=1e-4 * x_span) and gy == pytest.approx(
            ey, abs=1e-4 * y_span
        ), (run, what)


# ----------------------------------------------------------------------------- synthetic logs


def record(run: str, step: int, tokens_per_step: int = 512, **values) -> dict:
    loss = 5.5 * math.exp(-step / 40) + 1.0
    base = {
        "run": run,
        "step": step,
        "loss": loss,
        "lr": 1e-3 * min(1.0, step / 10),
        "grad_norm": 1 + 1 / step,
        "tokens_per_s": 1000.0 + 7 * step,
        "mfu_percent": 2.0 + step / 100,
        "memory_gib": 0.25 + step / 1e3,
        "elapsed_s": step / 10,
        "remaining_s": 1.0,
        "tokens": step * tokens_per_step,
        "routing": {
            "2": {"max_load": 3 - step / 50, "min_load": step / 100, "tokens": [10] * 8},
            "3": {"max_load": 2.5 - step / 60, "min_load": step / 120, "tokens": [10] * 8},
        },
    }
    return {**base, **values}


def write_log(
    path: Path, runs: dict[str, int], steps=(1, 10, 20, 30, 40, 50)
) -> dict[str, list[dict]]:
    """Two kinds of records per run (training, then validation every 20 steps), interleaved as runs
    sharing a log write them."""
    written = {name: [] for name in runs}
    with open(path, "a") as log:
        for step in steps:
            for name, tokens_per_step in runs.items():
                rows = [record(name, step, tokens_per_step)]
                if step % 20 == 0:
                    rows.append({"run": name, "step": step, "val_loss": rows[0]["loss"] + 0.1})
                for row in rows:
                    log.write(json.dumps(row) + "\n")
                written[name] += rows
    return written


def test_every_plotted_series_reads_back_as_the_logged_values_and_runs_overlay(tmp_path):
    log = tmp_path / "metrics.jsonl"
    runs = {"runs/adamw/run_0001": 512, "runs/muon/run_0001": 1024}
    written = write_log(log, runs)
    page = Page(write_report([log], tmp_path / "report.html").read_text())
    labels = {"runs/adamw/run_0001": "adamw/run_0001", "runs/muon/run_0001": "muon/run_0001"}
    for name, records in written.items():
        label, train = labels[name], [r for r in records if "loss" in r]
        evals = [r for r in records if "val_loss" in r]
        assert_points(
            page.charts["loss-step"],
            label,
            "training loss",
            [(r["step"], r["loss"]) for r in train],
        )
        assert_points(
            page.charts["loss-step"],
            label,
            "validation loss",
            [(r["step"], r["val_loss"]) for r in evals],
        )
        assert_points(
            page.charts["loss-tokens"],
            label,
            "training loss",
            [(r["tokens"], r["loss"]) for r in train],
        )
        assert_points(
            page.charts["loss-tokens"],
            label,
            "validation loss",
            [(r["step"] * runs[name], r["val_loss"]) for r in evals],
        )
        for chart, key in LINE_CHARTS.items():
            (what,) = {s["what"] for s in page.charts[chart].series}
            assert_points(page.charts[chart], label, what, [(r["step"], r[key]) for r in train])
    # both runs on the same axes, told apart
    for chart in ["loss-step", "loss-tokens", *LINE_CHARTS]:
        series = page.charts[chart].series
        assert {s["run"] for s in series} == set(labels.values())
        assert len({s["stroke"] for s in series}) == 2
        assert set(labels.values()) <= set(page.charts[chart].legend)
    assert not page.skipped


def test_lines_that_are_not_records_are_skipped_and_counted(tmp_path):
    log = tmp_path / "metrics.jsonl"
    written = write_log(log, {"run_a": 512}, steps=(1, 10, 20))
    with open(log, "a") as f:
        f.write('{"hello": "another program\'s JSON"}\n')  # line 5
        f.write("[1, 2, 3]\n")
        # a record's field of the wrong type
        f.write(json.dumps(record("run_a", 25, loss="low")) + "\n")
        f.write("\n")  # blank lines are not counted
        f.write(json.dumps(record("run_a", 30))[:57])  # a run writing its next line right now
    page = Page(write_report([log], tmp_path / "report.html").read_text())
    assert page.skipped == [4]
    note = next(text for text in page.texts if "skipped" in text)
    assert (
        "line 5: not a record of a run" in note
        and "line 9: not JSON (a truncated last line" in note
    )
    train = [r for r in written["run_a"] if "loss" in r]
    assert_points(
        page.charts["loss-step"], "run_a", "training loss", [(r["step"], r["loss"]) for r in train]
    )


def test_a_step_logged_twice_shows_its_later_record(tmp_path):
    """A run resumed from a checkpoint logs its later steps again; the report keeps the newer
    record."""
    log = tmp_path / "metrics.jsonl"
    first, second = record("run_a", 10, loss=4.0), record("run_a", 10, loss=3.0)
    log.write_text("".join(json.dumps(r) + "\n" for r in (record("run_a", 1), first, second)))
    page = Page(write_report([log], tmp_path / "report.html").read_text())
    assert_points(
        page.charts["loss-step"],
        "run_a",
        "training loss",
        [(1, record("run_a", 1)["loss"]), (10, 3.0)],
    )


def test_a_run_directory_names_its_records_and_a_run_still_going_is_read_as_far_as_it_has_gone(
    tmp_path,
):
    log = tmp_path / "metrics.jsonl"
    write_log(log, {str(tmp_path / "ckpt" / "run_0001"): 512, "someone else": 512}, steps=(1, 10))
    run_dir = tmp_path / "ckpt" / "run_0001"
    run_dir.mkdir(parents=True)
    report.note_run(
        run_dir, log, str(run_dir), {"optim": {"name": "adamw"}, "training": {"steps": 100}}
    )
    runs, logs = load_runs([run_dir])
    assert [run.name for run in runs] == [str(run_dir)] and sorted(runs[0].train) == [1, 10]
    assert "10 of 100" in render(runs, logs)
    assert report.main([str(run_dir)]) == run_dir / "report.html"


def test_a_source_that_is_no_run_is_one_clear_line(tmp_path):
    (tmp_path / "run_0001").mkdir()
    for source, expected in [
        (tmp_path / "none", "no such run directory or JSONL file"),
        (tmp_path / "run_0001", "no run.json, so not a run directory of train.py"),
    ]:
        done = subprocess.run(
            [sys.executable, "report.py", str(source)], cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith(f"error: {source}: {expected}")


def test_report_is_a_leaf_without_torch():
    heavy = "('torch', 'numpy', 'metrics', 'moe')"
    code = f"import sys, report; print(sorted(m for m in sys.modules if m in {heavy}))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert loaded.stdout.strip() == "[]"


def test_a_long_series_is_thinned_keeping_each_buckets_extremes():
    points = [(float(i), math.sin(i / 50) + (5.0 if i == 6543 else 0.0)) for i in range(10_000)]
    kept = thinned(points)
    assert len(kept) <= report.MAX_POINTS + 2 and kept == sorted(kept)
    assert (6543.0, points[6543][1]) in kept and min(kept, key=lambda p: p[1])[1] == min(
        p[1] for p in points
    )


# ----------------------------------------------------------------------------- heatmaps


def luminance(colour: str) -> float:
    r, g, b = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def check_heatmap(
    chart: Chart, expected: dict[tuple[str, int], float], brighter_when_higher: bool
) -> None:
    """Each cell's title names its layer, step and value, its span holds its step, and the colours
    order as the values do."""
    x_of, span = axis(chart.x_ticks)
    seen = {}
    for x, width, fill, title, _ in chart.cells:
        where, value = title.rsplit(": ", 1)[0], float(title.rsplit(" ", 1)[1])
        layer, step = where.split(", ")[0].split()[1], int(where.split("step ")[1])
        assert x_of(x) - 1e-4 * span <= step <= x_of(x + width) + 1e-4 * span
        seen[(layer, step)] = (value, fill)
    assert {k: v for k, (v, _) in seen.items()} == pytest.approx(expected, rel=1e-3)
    ordered = [luminance(fill) for _, fill in sorted(seen.values())]
    assert ordered == sorted(ordered, reverse=not brighter_when_higher)


def test_expert_heatmaps_hold_each_layers_loads_drops_and_bias_spread(tmp_path):
    log = tmp_path / "metrics.jsonl"
    with open(log, "w") as f:
        for step in (1, 5, 10, 15):
            routing = {
                layer: {
                    "max_load": 1 + layer_no / 2 + 1 / step,
                    "min_load": 0.5 - 1 / (step + layer_no),
                    "tokens": [16] * 8,
                    "dropped": step * layer_no,
                    "bias": [0.01 * step, -0.003 * step, 0.0],
                }
                for layer_no, layer in ((1, "2"), (2, "3"), (3, "10"))
            }
            f.write(json.dumps(record("run", step, routing=routing)) + "\n")
    page = Page(write_report([log], tmp_path / "report.html").read_text())
    records = [json.loads(line) for line in log.read_text().splitlines()]

    def expected(value):
        return {
            (layer, r["step"]): value(stats)
            for r in records
            for layer, stats in r["routing"].items()
        }

    check_heatmap(
        page.charts["max-load-0"], expected(lambda s: s["max_load"]), brighter_when_higher=True
    )
    check_heatmap(
        page.charts["min-load-0"], expected(lambda s: s["min_load"]), brighter_when_higher=False
    )
    check_heatmap(
        page.charts["dropped-0"],
        expected(lambda s: 100 * s["dropped"] / 128),
        brighter_when_higher=True,
    )
    check_heatmap(
        page.charts["bias-0"],
        expected(lambda s: max(s["bias"]) - min(s["bias"])),
        brighter_when_higher=True,
    )


def test_a_long_run_bins_its_steps_into_columns_keeping_the_worst_of_each(tmp_path):
    log = tmp_path / "metrics.jsonl"
    loads = {step: (1 + step % 7 / 10, step % 5 / 10) for step in range(1, 251)}
    log.write_text(
        "".join(
            json.dumps(record("run", step, routing={"2": {"max_load": high, "min_load": low}}))
            + "\n"
            for step, (high, low) in loads.items()
        )
    )
    charts = Page(write_report([log], tmp_path / "report.html").read_text()).charts
    for chart, worst, index in (("max-load-0", max, 0), ("min-load-0", min, 1)):
        shown = {
            int(title.split("step ")[1].split(":")[0]): float(title.rsplit(" ", 1)[1])
            for _, _, _, title, _ in charts[chart].cells
        }
        assert len(shown) == math.ceil(250 / 3) <= report.MAX_COLUMNS  # 3 logged steps a column
        edges = [0, *sorted(shown)]
        for first, last in zip(edges, edges[1:]):
            assert shown[last] == pytest.approx(
                worst(loads[s][index] for s in range(first + 1, last + 1)), rel=1e-3
            )


def test_a_dense_run_has_no_expert_heatmaps(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text(json.dumps(record("dense", 1, routing={})) + "\n")
    page = Page(write_report([log], tmp_path / "report.html").read_text())
    assert not [name for name in page.charts if "load" in name]


# -------------------------------------------------------------------------- the rehearsal's picture


def test_the_memory_timeline_stacks_the_holders_up_to_the_peak():
    """Allocations and frees by phase: the stack's top reaches the peak, each holder's band is as
    thick as its live bytes there, and the holders that held nothing at the peak fall into the
    rest."""
    mib = 2**20
    events = [
        ("start", "start: weights", 400 * mib),
        ("forward", "forward: activations", 300 * mib),
        ("forward", "forward: scratch", 200 * mib),
        ("backward", "backward: grads", 400 * mib),
        ("backward", "forward: scratch", -200 * mib),
        ("optimizer", "optimizer: states", 800 * mib),
    ]
    page = Page(memory_timeline_svg(events, "test", holders=3))
    chart = page.charts["memory-timeline"]
    y_of, span = axis(chart.y_ticks)
    assert list(chart.areas) == [
        "optimizer: states",
        "start: weights",
        "backward: grads",
        "everything else",
    ]
    live_at_peak = {
        "optimizer: states": 800,
        "start: weights": 400,
        "backward: grads": 400,
        "everything else": 300,
    }
    below = 0.0
    # each outline, then its base: the top edge's highest point
    for holder, area in chart.areas.items():
        top = max(y_of(py) for _, py in area[: len(area) // 2])
        assert top - below == pytest.approx(live_at_peak[holder] / 1024, abs=1e-3 * span), holder
        below = top
    assert below == pytest.approx(1900 / 1024, abs=1e-3 * span)
    assert "peak 1.86 GiB, in the optimizer" in "".join(page.texts)


# ----------------------------------------------------------------------------- a real browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NEEDS_CHROMIUM = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium: `apt-get install -y chromium` (Debian) to run it"
)


def png_pixels(data: bytes) -> np.ndarray:
    """An 8-bit RGB or RGBA PNG -> [height, width, channels], unfiltered as the PNG specification
    says."""
    width, height, depth, colour_type = struct.unpack(">IIBB", data[16:26])
    assert depth == 8 and colour_type in (2, 6)
    channels, chunks, at = (3 if colour_type == 2 else 4), [], 8
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at : at + 8])
        if kind == b"IDAT":
            chunks.append(data[at + 8 : at + 8 + length])
        at += 12 + length
    raw = np.frombuffer(zlib.decompress(b"".join(chunks)), np.uint8).reshape(
        height, 1 + width * channels
    )
    rows, up = np.zeros((height, width * channels), np.uint8), np.zeros(width * channels, np.int64)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:].astype(np.int64)
        if kind == 1:  # sub: a running sum of each channel along the row
            line = line.reshape(width, channels).cumsum(axis=0).reshape(-1)
        elif kind == 2:
            line = line + up
        elif kind in (3, 4):  # average, Paeth: each byte needs the one decoded before it
            line = unfilter_row(line.tolist(), up.tolist(), channels, kind)
        up = np.asarray(line, np.int64) & 255
        rows[y] = up
    return rows.reshape(height, width, channels)


def unfilter_row(line: list[int], up: list[int], channels: int, kind: int) -> list[int]:
    out = [0] * len(line)
    for i, value in enumerate(line):
        left, above = (out[i - channels], up[i - channels]) if i >= channels else (0, 0)
        if kind == 3:
            guess = (left + up[i]) // 2
        else:
            p = left + up[i] - above
            pa, pb, pc = abs(p - left), abs(p - up[i]), abs(p - above)
            guess = left if pa <= pb and pa <= pc else up[i] if pb <= pc else above
        out[i] = (value + guess) & 255
    return out


@pytest.mark.slow
@pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium: `apt-get install -y chromium` (Debian) to run it"
)
def test_a_browser_draws_the_report(tmp_path):
    log = tmp_path / "metrics.jsonl"
    write_log(log, {"runs/adamw/run_0001": 512, "runs/muon/run_0001": 512})
    page = write_report([log], tmp_path / "report.html")
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--screenshot={shot}",
            "--window-size=800,500",
            page.as_uri(),
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )
    pixels = png_pixels(shot.read_bytes())[..., :3].astype(int)
    assert pixels.shape[:2] == (500, 800)
    ink = (pixels.sum(axis=2) < 600).mean()  # text, axes and lines on a white page
    assert 0.01 < ink < 0.5
    for colour in report.COLOURS[:2]:  # both runs' lines are drawn in their colours
        rgb = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)])
        assert (np.abs(pixels - rgb).sum(axis=2) < 40).sum() > 50, colour


def browser_dom(page: Path, fragment: str) -> str:
    """The page's DOM after its script ran in headless Chromium, opened at page.html#fragment."""
    done = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--dump-dom",
            f"{page.as_uri()}#{fragment}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout


def hovers(dom: str) -> dict[str, list[tuple[float, float, str]]]:
    """chart -> its hover markers as the script drew them: (cx, cy, the text shown)."""
    out = {}
    for chart, body in re.findall(r'data-chart="([^"]+)"(.*?)</svg>', dom, flags=re.S):
        found = re.findall(
            r'<g class="hover"[^>]*><circle cx="([^"]+)" cy="([^"]+)"[^>]*>'
            r"</circle><text[^>]*>([^<]*)</text></g>",
            body,
        )
        out[chart] = [(float(cx), float(cy), html.unescape(words)) for cx, cy, words in found]
    return out


@pytest.mark.slow
@NEEDS_CHROMIUM
def test_a_browser_shows_the_nearest_points_value_smooths_and_scales(tmp_path):
    """The page's script, run by Chromium: the hover (placed through the address, as a pointer
    would be) names the nearest logged point where the static chart put it, later steps to the right
    and larger losses higher; smoothing 0.5 draws TensorBoard's debiased average; log=1 shows the
    logarithmic charts."""
    handwritten_page(tmp_path)
    fragment = (
        "smooth=0.5&log=1&hover=loss-step:5.4:3.1,loss-step:10:3.4,loss-elapsed:2.4:3.05,"
        "loss-step-log:10:3.5"
    )
    dom = browser_dom(tmp_path / "report.html", fragment)
    shown, charts = hovers(dom), Page(dom).charts
    (at5, at10), (timed,) = shown["loss-step"], shown["loss-elapsed"]
    (logged,) = shown["loss-step-log"]
    assert at5[2] == f"{LABEL}, training loss: 3 at step 5"
    assert at10[2] == f"{LABEL}, training loss: 3.5 at step 10"
    assert timed[2] == f"{LABEL}, training loss: 3 at wall-clock seconds 2.5"
    assert logged[2] == f"{LABEL}, training loss: 3.5 at step 10"
    assert at10[0] > at5[0] and at10[1] < at5[1]  # step 10 right of step 5; 3.5 above 3.0
    for (cx, cy, _), chart, x_text in [
        (at5, "loss-step", "step 5"),
        (at10, "loss-step", "step 10"),
        (logged, "loss-step-log", "step 10"),
    ]:
        assert (cx, cy) == pytest.approx(
            point_at(charts[chart], LABEL, "training loss", x_text), abs=0.01
        )
    # weight 0.5 over 4.0, 3.0, 3.5: (2/0.5, 2.5/0.75, 3/0.875), by hand
    assert_points(
        charts["loss-step"],
        LABEL,
        "training loss (smoothed)",
        [(1, 4.0), (5, 2.5 / 0.75), (10, 3.0 / 0.875)],
    )
    assert re.search(r'<body class="[^"]*log-scale', dom)
    assert not re.search(r'<div class="controls" id="controls" hidden', dom)  # the script shows it


@pytest.mark.slow
@NEEDS_CHROMIUM
def test_a_browser_zooms_a_chart_onto_steps_and_fits_its_y_axis_to_them(tmp_path):
    """zoom=CHART:4:10 (as a drag across steps 4 to 10 leaves it in the address): the chart drawn
    again over steps 4 to 10, its y axis round values around what is there (3.0 to 3.7: the other
    run's 5.0 at step 1 is out of view), each point where the new axes put it; on the logarithmic
    chart, the powers 2 and 5 around 3.0 and 3.7."""
    drawn = handwritten_page(tmp_path).charts
    dom = browser_dom(tmp_path / "report.html", "zoom=loss-step:4:10,loss-step-log:4:10")
    charts = Page(dom).charts
    zoomed, logarithmic = charts["loss-step"], charts["loss-step-log"]
    assert [label for _, label in zoomed.x_ticks] == ["4", "6", "8", "10"]
    assert [label for _, label in zoomed.y_ticks] == ["3", "3.2", "3.4", "3.6", "3.8"]
    assert_points(zoomed, LABEL, "training loss", [(5, 3.0), (10, 3.5)])
    assert_points(zoomed, LABEL, "validation loss", [(5, 3.6), (10, 3.7)])
    ((x5, y5), (x10, y10)) = next(
        s["points"] for s in zoomed.series if s["what"] == "training loss" and s["points"]
    )
    left, top, width, height = zoomed.frame
    assert x10 == pytest.approx(left + width) and x5 == pytest.approx(left + width / 6, abs=0.01)
    assert y5 == pytest.approx(top + height, abs=0.01) and y10 < y5  # 3.0 at the bottom, up to 3.5
    assert [label for _, label in logarithmic.y_ticks] == ["2", "5"]
    assert [label for _, label in logarithmic.x_ticks] == ["4", "6", "8", "10"]
    assert charts["loss-tokens"].x_ticks == drawn["loss-tokens"].x_ticks  # the others as drawn


@pytest.mark.slow
@NEEDS_CHROMIUM
def test_a_browser_hovers_a_long_series_at_its_nearest_point(tmp_path):
    log = tmp_path / "metrics.jsonl"
    write_log(log, {"a": 512}, steps=range(1, 501))
    page = write_report([log], tmp_path / "report.html")
    circles = Page(page.read_text()).charts["loss-step"].circles
    assert not [title for *_, title in circles if "training loss" in title]  # too long for points
    loss = record("a", 250)["loss"]
    ((_, _, words),) = hovers(browser_dom(page, f"hover=loss-step:250.3:{loss}"))["loss-step"]
    assert words == f"a, training loss: {loss:.6g} at step 250"


# ----------------------------------------------------------------------------- read back

# A run directory's records, written out by hand: every number below is read back from the page.
HANDWRITTEN = [
    '{"run": "RUN", "step": 1, "loss": 4.0, "lr": 0.001, "grad_norm": 2.0, "tokens_per_s": 100.0, '
    '"mfu_percent": 1.0, "memory_gib": 0.5, "tokens": 1024, "elapsed_s": 0.5, '
    '"routing": {"2": {"max_load": 1.5, "min_load": 0.5}, '
    '"10": {"max_load": 2.0, "min_load": 0.25}}}',
    '{"run": "RUN", "step": 5, "loss": 3.0, "lr": 0.003, "grad_norm": 1.0, "tokens_per_s": 400.0, '
    '"mfu_percent": 4.0, "memory_gib": 1.25, "tokens": 5120, "elapsed_s": 2.5, '
    '"routing": {"2": {"max_load": 1.25, "min_load": 0.75}, '
    '"10": {"max_load": 3.0, "min_load": 0.0}}}',
    '{"run": "RUN", "step": 5, "val_loss": 3.6}',
    '{"run": "RUN", "step": 10, "loss": 3.5, "lr": 0.002, "grad_norm": 1.5, "tokens_per_s": 200.0, '
    '"mfu_percent": 2.0, "memory_gib": 1.0, "tokens": 10240, "elapsed_s": 6.0}',
    '{"run": "RUN", "step": 10, "val_loss": 3.7}',
    # a second run that diverged: no memory, no MFU, no settings; its loss ends at inf
    '{"run": "other", "step": 1, "loss": 5.0, "tokens_per_s": 50.0, "mfu_percent": null}',
    '{"run": "other", "step": 2, "loss": NaN, "tokens_per_s": 90.0}',
    '{"run": "other", "step": 3, "loss": 1e400, "tokens_per_s": 70.0}',
]


def handwritten_page(tmp_path: Path) -> Page:
    """The page of a run directory (settings: AdamW, lr 3e-3, 20 steps) and the log it names."""
    run_dir = tmp_path / "ckpt" / "run_0001"
    run_dir.mkdir(parents=True)
    log = tmp_path / "metrics.jsonl"
    log.write_text("\n".join(HANDWRITTEN).replace("RUN", str(run_dir)) + "\n")
    settings = {"optim": {"name": "adamw", "lr": 0.003}, "training": {"steps": 20}}
    (run_dir / "run.json").write_text(
        json.dumps({"jsonl": str(log), "run": str(run_dir), "settings": settings})
    )
    return Page(write_report([run_dir, log], tmp_path / "report.html").read_text())


def test_the_summary_table_reads_back_hand_computed_values(tmp_path):
    page = handwritten_page(tmp_path)
    head, *rows = page.rows
    table = [dict(zip(head, row)) for row in rows]
    assert table == [
        {
            "run": "\u25a0 run_0001 (adamw)",
            "last step": "10 of 20",
            "training loss": "4.0000 \u2192 3.5000",
            "best validation loss": "3.6000",
            "tokens/s (median)": "200",
            "MFU (median)": "2.00 %",
            "peak memory": "1.25 GiB",
            "settings": "adamw, lr 0.003, 1,024 tokens/step",
        },
        {
            "run": "\u25a0 other",
            "last step": "3",
            "training loss": "5.0000 \u2192 inf",
            "best validation loss": "-",
            "tokens/s (median)": "70",
            "MFU (median)": "-",
            "peak memory": "-",
            "settings": "",
        },
    ]


def test_the_settings_column_shows_every_setting_that_differs_between_the_runs(tmp_path):
    """An FP8 run and its FP32 twin (same optimizer, lr and batch) are told apart; the settings all
    runs share are not repeated; a run without run.json is left out of the comparison."""
    log = tmp_path / "metrics.jsonl"
    shared = {"optim": {"name": "adamw", "lr": 0.003}, "training": {"steps": 20}}
    twins = {
        "fp8": {**shared, "parallel": {"fp8": "rowwise", "tp": 1}},
        "fp32": {**shared, "parallel": {"tp": 1}, "model": {"layers": [1, 2]}},
    }
    sources = []
    for name, settings in twins.items():
        run_dir = tmp_path / name / "run_0001"
        run_dir.mkdir(parents=True)
        (run_dir / "run.json").write_text(
            json.dumps({"jsonl": str(log), "run": str(run_dir), "settings": settings})
        )
        sources.append(run_dir)
    records = [
        {"run": str(run), "step": 2, "loss": 3.0, "tokens": 2048}
        for run in [*sources, "no settings"]
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    page = Page(write_report([*sources, log], tmp_path / "report.html").read_text())
    head, *rows = page.rows
    settings = {row[0].lstrip("\u25a0 "): row[head.index("settings")] for row in rows}
    assert settings == {
        "fp8/run_0001 (adamw)": "adamw, lr 0.003, 1,024 tokens/step; parallel.fp8 = rowwise, "
        "model.layers = (unset)",
        "fp32/run_0001 (adamw)": "adamw, lr 0.003, 1,024 tokens/step; parallel.fp8 = (unset), "
        "model.layers = [1, 2]",
        "no settings": "1,024 tokens/step",
    }


LABEL = "run_0001 (adamw)"  # the runs' optimizers differ: the one with settings names its own


def point_at(chart: Chart, run: str, what: str, x_text: str) -> tuple[float, float]:
    """The pixel (cx, cy) of the point whose hover title names the run, the series and x."""
    (point,) = [
        (cx, cy)
        for cx, cy, title in chart.circles
        if title and title.startswith(f"{run}, {what}: ") and title.endswith(f" {x_text}")
    ]
    return point


def test_axes_draw_larger_values_higher_and_later_steps_further_right(tmp_path):
    """Read through the tick labels, a chart drawn upside down reads back right: here the pixels
    of known points are compared. Each quantity's three values are distinct (HANDWRITTEN)."""
    charts = handwritten_page(tmp_path).charts
    records = [json.loads(line.replace("RUN", "run_0001")) for line in HANDWRITTEN[:5]]
    train = [r for r in records if "loss" in r]
    quantities = [
        ("loss-step", "loss", "training loss", "step"),
        ("loss-tokens", "loss", "training loss", "tokens"),
        ("loss-elapsed", "loss", "training loss", "elapsed_s"),
        ("loss-step-log", "loss", "training loss", "step"),
        ("loss-tokens-log", "loss", "training loss", "tokens"),
        ("loss-elapsed-log", "loss", "training loss", "elapsed_s"),
        ("lr", "lr", "learning rate", "step"),
        ("grad-norm", "grad_norm", "gradient norm (global L2, before clipping)", "step"),
        ("tokens-per-s", "tokens_per_s", "throughput", "step"),
        ("mfu", "mfu_percent", "model FLOPs utilisation", "step"),
        (
            "memory",
            "memory_gib",
            "peak memory since the previous point (GPU allocated; CPU: resident set)",
            "step",
        ),
    ]
    axis_titles = {"step": "step", "tokens": "tokens", "elapsed_s": "wall-clock seconds"}
    for chart, key, what, x_key in quantities:
        points = [
            (
                r[x_key],
                r[key],
                point_at(charts[chart], LABEL, what, f"{axis_titles[x_key]} {r[x_key]:g}"),
            )
            for r in train
        ]
        by_x = [px for _, _, (px, _) in sorted(points)]
        by_value = [py for _, _, (_, py) in sorted(points, key=lambda p: p[1])]
        assert by_x == sorted(by_x) and len(set(by_x)) == 3, chart  # later: further right
        assert by_value == sorted(by_value, reverse=True), chart  # larger: higher (smaller y)
        assert len(set(by_value)) == 3, chart
    evals = [point_at(charts["loss-step"], LABEL, "validation loss", f"step {s}") for s in (5, 10)]
    assert evals[0][0] < evals[1][0] and evals[0][1] > evals[1][1]  # 3.6 at step 5 below 3.7 at 10
    # An evaluation has no time of its own: it is placed at its step's training record's.
    timed = [
        point_at(charts["loss-elapsed"], LABEL, "validation loss", f"wall-clock seconds {t}")
        for t in (2.5, 6)
    ]
    assert timed[0][0] < timed[1][0] and timed[0][1] > timed[1][1]
    for chart, x_key in [("loss-elapsed", "elapsed_s"), ("loss-tokens", "tokens")]:
        # The x axis ends at the last logged value (6 s, 10,240 tokens), not at the next round tick.
        x, _, width, _ = charts[chart].frame
        last = point_at(
            charts[chart], LABEL, "training loss", f"{axis_titles[x_key]} {train[-1][x_key]:g}"
        )
        assert last[0] == pytest.approx(x + width, abs=0.01)
    for chart in charts.values():  # the tick labels agree: values grow rightwards and upwards
        for ticks, grows in ((chart.x_ticks, 1), (chart.y_ticks, -1)):
            values = [tick_value(label) for _, label in sorted(ticks)]
            assert values == sorted(values, reverse=grows < 0)
    cells = {
        tuple(title.split(":")[0].split(", ")): (x, y)
        for x, _, _, title, y in charts["max-load-0"].cells
    }
    assert cells[("layer 2", "step 1")][0] < cells[("layer 2", "step 5")][0]  # steps rightwards
    assert cells[("layer 2", "step 1")][1] < cells[("layer 10", "step 1")][1]  # layers downwards


def test_a_log_scale_spaces_equal_ratios_equally_and_leaves_out_what_it_cannot_place(tmp_path):
    log = tmp_path / "metrics.jsonl"
    losses = {1: 100.0, 2: 10.0, 3: 1.0, 4: 0.5, 5: 0.0}  # 0 has no place on a log axis
    log.write_text(
        "".join(
            json.dumps({"run": "a", "step": step, "loss": loss}) + "\n"
            for step, loss in losses.items()
        )
    )
    charts = Page(write_report([log], tmp_path / "report.html").read_text()).charts
    y = {
        step: point_at(charts["loss-step-log"], "a", "training loss", f"step {step}")[1]
        for step in (1, 2, 3, 4)
    }
    decade = y[3] - y[2]
    assert decade > 0 and y[2] - y[1] == pytest.approx(decade, abs=0.02)  # 100 -> 10 as 10 -> 1
    assert y[4] - y[3] == pytest.approx(decade * math.log10(2), abs=0.02)  # 1 -> 0.5: log10(2)
    assert not [title for *_, title in charts["loss-step-log"].circles if "step 5" in title]
    assert point_at(charts["loss-step"], "a", "training loss", "step 5")  # the linear one has it
    linear = {
        step: point_at(charts["loss-step"], "a", "training loss", f"step {step}")[1]
        for step in (1, 2, 3)
    }
    assert linear[2] - linear[1] == pytest.approx(10 * (linear[3] - linear[2]), abs=0.05)
    ticks = [(p, math.log10(tick_value(label))) for p, label in charts["loss-step-log"].y_ticks]
    (p0, v0), (p1, v1) = ticks[0], ticks[-1]
    for p, v in ticks:  # each tick sits where its value's logarithm puts it
        assert p == pytest.approx(p0 + (v - v0) / (v1 - v0) * (p1 - p0), abs=0.02)
    assert min(v for _, v in ticks) <= math.log10(0.5) and max(v for _, v in ticks) >= 2


def test_a_value_that_is_not_finite_is_marked_and_breaks_the_line(tmp_path):
    """The diverged run: NaN at step 2 and 1e400 (inf) at step 3 are marked where they were logged;
    its one finite point stays a point of its own, read back through the axes."""
    chart = handwritten_page(tmp_path).charts["loss-step"]
    x_of, span = axis(chart.x_ticks)
    marks = {round(x_of(x)): title for x, title in chart.marks}
    assert marks == {
        2: "other, training loss: nan at step 2",
        3: "other, training loss: inf at step 3",
    }
    got = values_of(chart, "other", "training loss")
    assert got == [pytest.approx((1.0, 5.0), abs=1e-4 * span)]


# ----------------------------------------------------------------------------- no live markup

PAYLOAD = (
    "<script>alert(1)</script>\"><img src=x onerror=alert(2)>' onmouseover='alert(3)"
    "</title></svg></script><svg onload=alert(4)>&amp;\x00\ud800"
)
PAYLOAD_DIR = '<script>alert(5)</script>"><img src=x onerror=alert(6)>'  # a path: its / nests


def full_record(step: int) -> dict:
    """A training record with every field train.py writes (metrics.MetricsLogger.log_train) and
    every field of a layer's routing statistics (balance.RoutingMonitor.stats)."""
    routing = {
        "max_load": 1.5,
        "min_load": 0.5,
        "tokens": [3, 5],
        "dropped": 1,
        "bias": [0.1, -0.2],
    }
    return {**record("RUN", step), "routing": {"2": routing, "3": dict(routing)}}


def leaves(value, where=()):
    """Every place a user's file can hold a string: each key of each object, each value."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield where + (key,), "key"
            yield from leaves(item, where + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from leaves(item, where + (i,))
    yield where, "value"


def with_payload(value, where, what):
    """A deep copy of value with the key or the value at `where` replaced by PAYLOAD."""
    value = copy.deepcopy(value)
    if not where:
        return PAYLOAD
    parent = value
    for step in where[:-1]:
        parent = parent[step]
    if what == "key":
        parent[PAYLOAD] = parent.pop(where[-1])
    else:
        parent[where[-1]] = PAYLOAD
    return value


def written_keys(path: str, function: str, stores: bool = False) -> set[str]:
    """The string keys of the dict literals (and with `stores`, of the subscript stores) in one
    function of a source file, as the file is now: what a record or a layer's statistics hold."""
    tree = ast.parse((ROOT / path).read_text())
    (found,) = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == function
    ]
    keys = {
        k.value
        for node in ast.walk(found)
        if isinstance(node, ast.Dict)
        for k in node.keys
        if isinstance(k, ast.Constant) and isinstance(k.value, str)
    }
    return keys | {
        node.slice.value
        for node in ast.walk(found)
        if stores
        and isinstance(node, ast.Subscript)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.slice, ast.Constant)
    }


def test_the_full_record_holds_every_field_the_trainer_writes():
    """So that the markup test below covers a field added to the records."""
    record_keys = {
        key
        for function in ("log_train", "log_eval", "write")
        for key in written_keys("metrics.py", function)
    }
    assert record_keys <= set(full_record(1)) | {"run", "val_loss"}  # hostile_run's two templates
    assert written_keys("balance.py", "stats", stores=True) <= set(full_record(1)["routing"]["2"])


def hostile_run(tmp_path: Path) -> tuple[list[Path], int]:
    """Run directories and their JSONL under paths holding markup; in their records and run.json,
    one copy per key and per value (at every depth) with that key or value replaced by PAYLOAD
    -> the sources, and how many copies."""
    where = tmp_path / PAYLOAD_DIR
    where.mkdir(parents=True)
    log = where / f"{PAYLOAD_DIR.replace('/', '')}.jsonl"
    training, evaluation = full_record(1), {"run": "RUN", "step": 1, "val_loss": 3.0}
    settings = {
        "optim": {"name": "adamw", "lr": 0.003},
        "training": {"steps": 20},
        "model": {"x": [1]},
    }
    lines, sources = [], []
    places = [(t, p) for t in (training, evaluation) for p in leaves(t)]
    for k, (template, place) in enumerate(places):
        hostile = with_payload(template, *place)
        if isinstance(hostile, dict) and hostile.get("run") == "RUN":
            hostile["run"] = f"run {k}"
        run = hostile.get("run", f"run {k}") if isinstance(hostile, dict) else f"run {k}"
        sound = {**full_record(2), "run": run}  # beside it
        lines += [json.dumps(hostile), json.dumps(sound)]
    note = {"jsonl": str(log), "run": "RUN", "settings": settings}
    for k, place in enumerate(leaves(note)):
        if place == (("jsonl",), "value"):
            continue  # the path, with markup, is the log's own
        run_dir = where / f"run_{k:04d}"
        run_dir.mkdir()
        hostile = with_payload({**note, "run": str(run_dir)}, *place)
        (run_dir / "run.json").write_text(json.dumps(hostile))
        if isinstance(hostile, dict) and isinstance(hostile.get("run"), str) and "jsonl" in hostile:
            lines.append(json.dumps({**full_record(1), "run": hostile["run"]}))
            sources.append(run_dir)
        else:  # no run directory without "jsonl" and "run": one line, before any page
            expected = r"run\.json: expected (a JSON object|\"jsonl\" and \"run\" strings)"
            with pytest.raises(report.ReportError, match=expected):
                load_runs([run_dir])
    lines += [PAYLOAD.replace("\ud800", ""), json.dumps(PAYLOAD)]  # not records: skipped, counted
    log.write_text("\n".join(lines) + "\n")
    return sources + [log], len(lines)


def live_markup(page: Page, clean: Page) -> list:
    """The elements and attributes of `page` that a page without markup in its data never has,
    every event handler, and any script or policy other than the clean page's own."""
    allowed = {(tag, name) for tag, attrs in clean.elements for name, _ in attrs}
    tags = {tag for tag, _ in clean.elements}
    own = [(tag, attrs) for tag, attrs in clean.elements if tag in ("script", "meta")]
    theirs = [(tag, attrs) for tag, attrs in page.elements if tag in ("script", "meta")]
    return (
        [tag for tag, _ in page.elements if tag not in tags]
        + [
            (tag, name)
            for tag, attrs in page.elements
            for name, _ in attrs
            if (tag, name) not in allowed or name.startswith("on")
        ]
        + ([theirs] if theirs != own else [])
    )


def scripts(page_text: str) -> list[str]:
    """The contents of the page's <script> elements, as the browser's parser ends them."""
    return re.findall(r"<script[^>]*>(.*?)</script", page_text, flags=re.S | re.I)


def strings_in(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for key, v in value.items() for s in [key, *strings_in(v)]]
    return [s for v in value for s in strings_in(v)] if isinstance(value, list) else []


@pytest.mark.slow
def test_no_string_of_a_users_files_is_live_markup(tmp_path):
    sources, copies = hostile_run(tmp_path)
    page_text = write_report(sources, tmp_path / "report.html").read_text()
    clean_log = tmp_path / "clean.jsonl"
    clean_log.write_text(
        json.dumps({**full_record(1), "run": "a"})
        + "\n"
        + json.dumps({"run": "a", "step": 1, "val_loss": 3.0})
        + "\nnot a record\n"
    )
    clean = Page(write_report([clean_log], tmp_path / "clean.html").read_text())
    page = Page(page_text)
    assert copies > 60 and not live_markup(page, clean)
    # The only scripts are the report's own, byte for byte those of a page without markup in its
    # data: its data (a JSON block that the browser never runs) and its code; no <, > or & in the
    # data can end the block, and the data parses back to the strings of the files.
    shown = PAYLOAD.replace("\x00", "\ufffd").replace("\ud800", "\ufffd")
    (data, code), (_, clean_code) = scripts(page_text), scripts(clean.rawdata_text)
    assert page_text.lower().count("<script") == 2 and code == clean_code
    assert not {"<", ">", "&", "\u2028", "\u2029"} & set(data)
    label = shown.rsplit("/", 1)[-1]  # a run's label: the last part of its name as a path
    assert any(label in string for string in strings_in(json.loads(data)))
    assert "<img" not in page_text  # only escaped text holds it
    texts = "".join(page.texts)
    titles = [title for chart in page.charts.values() for *_, title, _ in chart.cells]
    assert f"layer {shown}, step 1" in " ".join(titles)  # a layer named with markup: as text
    assert texts.count(shown) >= 5 and PAYLOAD_DIR in texts  # legends, table, headings, paths
    assert any(
        label in (value or "")  # data-run
        for _, attrs in page.elements
        for _, value in attrs
    )


def test_the_memory_picture_shows_markup_in_its_names_as_text():
    events = [(PAYLOAD, PAYLOAD, 2**30), ("backward", "x" + PAYLOAD, 2**29)]
    picture = memory_timeline_svg(events, PAYLOAD, holders=1)
    clean = Page(
        memory_timeline_svg(
            [("forward", "weights", 2**30), ("backward", "x", 2**29)], "title", holders=1
        )
    )
    page = Page(picture)
    assert not live_markup(page, clean) and "<script" not in picture
    assert PAYLOAD.replace("\x00", "\ufffd").replace("\ud800", "\ufffd") in "".join(page.texts)


# ----------------------------------------------------------------------------- where the page goes


def run_report(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "report.py", *map(str, args)], cwd=ROOT, capture_output=True, text=True
    )


def test_watch_rewrites_the_page_when_the_run_logs_more(tmp_path, monkeypatch):
    """Two polls 0.01 s apart; between them the run logs step 20; the second poll's page has it."""
    log, out = tmp_path / "metrics.jsonl", tmp_path / "report.html"
    written = write_log(log, {"run_a": 512}, steps=(1, 10))
    first_pages, sleeps = [], []

    def log_between_polls(seconds: float) -> None:
        sleeps.append(seconds)
        first_pages.append(Page(out.read_text()))
        with open(log, "a") as f:
            f.write(json.dumps(record("run_a", 20)) + "\n")

    monkeypatch.setattr(report.time, "sleep", log_between_polls)
    report.watch([log], out, interval=0.01, polls=2)
    assert sleeps == [0.01]
    train = [(r["step"], r["loss"]) for r in written["run_a"] if "loss" in r]
    assert_points(first_pages[0].charts["loss-step"], "run_a", "training loss", train)
    assert_points(
        Page(out.read_text()).charts["loss-step"],
        "run_a",
        "training loss",
        train + [(20, record("run_a", 20)["loss"])],
    )
    assert '<meta http-equiv="refresh" content="2">' in out.read_text()  # the browser reloads it
    watcher = report.Watcher([log], out)
    assert watcher.poll() == out and watcher.poll() is None  # nothing new: not rewritten
    assert sorted(path.name for path in tmp_path.iterdir()) == ["metrics.jsonl", "report.html"]
    run_dir = tmp_path / "run_0001"  # a run directory: its run.json and the log it names
    report.note_run(run_dir, log, "run_a", {})
    watcher = report.Watcher([run_dir])
    assert watcher.read_files() == [run_dir / "run.json", log]
    assert watcher.poll() == run_dir / "report.html" and watcher.poll() is None
    report.note_run(run_dir, log, "run_a", {"optim": {"name": "muon"}})  # its settings changed
    assert watcher.poll() == run_dir / "report.html"


def test_the_pages_data_holds_every_logged_point_for_the_hover(tmp_path):
    """A long series' drawn line is thinned; the points the script hovers over are all there."""
    log = tmp_path / "metrics.jsonl"
    written = write_log(log, {"a": 512}, steps=range(1, 2501))
    page_text = write_report([log], tmp_path / "report.html").read_text()
    (data, _) = scripts(page_text)
    charts = json.loads(data)
    train = [[r["step"], r["loss"]] for r in written["a"] if "loss" in r]
    (series,) = [s for s in charts["loss-step"]["series"] if s["what"] == "training loss"]
    assert series["stretches"] == [train] and len(train) > report.MAX_POINTS
    drawn = [s for s in Page(page_text).charts["loss-step"].series if s["what"] == "training loss"]
    assert len(drawn[0]["points"]) < len(train)


def test_watch_stops_on_ctrl_c_and_refuses_an_interval_out_of_range(tmp_path, monkeypatch, capsys):
    log, out = tmp_path / "metrics.jsonl", tmp_path / "report.html"
    write_log(log, {"run_a": 512}, steps=(1, 10))

    def ctrl_c(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(report.time, "sleep", ctrl_c)
    assert report.main([str(log), "--out", str(out), "--watch", "--interval", "3600"]) is None
    assert capsys.readouterr().out.endswith("stopped watching\n") and out.is_file()
    for interval in ("0", "3601", "nan"):
        done = run_report(log, "--watch", "--interval", interval)
        expected = f"error: --interval: expected seconds above 0 and at most 3600, got {interval}\n"
        assert done.returncode == 1 and done.stderr == expected


def test_the_page_never_overwrites_a_file_it_reads(tmp_path):
    log = tmp_path / "metrics.jsonl"
    write_log(log, {"run_a": 512}, steps=(1, 10))
    run_dir = tmp_path / "run_0001"
    run_dir.mkdir()
    note = {"jsonl": str(log), "run": "run_a", "settings": {}}
    (run_dir / "run.json").write_text(json.dumps(note))
    (tmp_path / "link.jsonl").symlink_to(log)
    before = {path: path.read_bytes() for path in (log, run_dir / "run.json")}
    link, through_parent = tmp_path / "link.jsonl", tmp_path / ".." / tmp_path.name / log.name
    for sources, out, read in [
        ([log], log, log),
        ([log], link, log),
        ([run_dir], log, log),
        ([run_dir], run_dir / "run.json", run_dir / "run.json"),
        ([link], through_parent, link),
    ]:  # the same file, by other paths
        done = run_report(*sources, "--out", out)
        assert done.returncode == 1 and done.stdout == "", done.stderr
        assert done.stderr == (
            f"error: {out}: the report would overwrite {read}, which it reads; "
            f"name another file with --out\n"
        )
    assert {path: path.read_bytes() for path in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "metrics.jsonl", "run_0001"]
    beside = tmp_path / "metrics.html"  # the accepted neighbour: the same directory, another name
    assert run_report(log, "--out", beside).returncode == 0
    assert Page(beside.read_text()).charts["loss-step"].series
    assert {path: path.read_bytes() for path in before} == before


def test_out_naming_a_directory_writes_report_html_inside_and_leaves_no_temporary(tmp_path):
    log = tmp_path / "metrics.jsonl"
    write_log(log, {"run_a": 512}, steps=(1, 10))
    pages = tmp_path / "pages"
    pages.mkdir()
    done = run_report(log, "--out", pages)
    assert done.returncode == 0 and done.stdout == f"report: {pages / 'report.html'}\n", done.stderr
    assert [p.name for p in pages.iterdir()] == ["report.html"]
    assert Page((pages / "report.html").read_text()).charts["loss-step"].series
    (pages / "report.html").unlink()
    (pages / "report.html").mkdir()  # report.html inside is a directory: refused, nothing left
    done = run_report(log, "--out", pages)
    assert done.returncode == 1 and done.stderr == (
        f"error: {pages / 'report.html'}: is a directory, so the report cannot be written there; "
        f"name a file with --out\n"
    )
    assert [p.name for p in pages.iterdir()] == ["report.html"]
    assert not any((pages / "report.html").iterdir())
    assert "a directory to write report.html into" in run_report("--help").stdout


# ----------------------------------------------------------------------------- careless input


def test_a_loss_past_any_float_is_marked_and_huge_finite_ones_get_a_sane_axis(tmp_path):
    """1e400 reads as inf: marked at its step. +-1e308 are 2e308 apart, past any float: the axis
    still spans them with finite round ticks, and every point reads back through it."""
    log = tmp_path / "metrics.jsonl"
    losses = {
        1: "2.5",
        2: "1e400",
        3: "1e308",
        4: "-1e308",
        5: "-1e400",
        6: "1.7976931348623157e308",
    }
    log.write_text(
        "".join(
            f'{{"run": "r", "step": {step}, "loss": {loss}}}\n' for step, loss in losses.items()
        )
    )
    done = run_report(log, "--out", tmp_path / "report.html")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    chart = Page((tmp_path / "report.html").read_text()).charts["loss-step"]
    ticks = [tick_value(label) for _, label in chart.y_ticks]
    assert all(math.isfinite(t) for t in ticks) and ticks == sorted(ticks) and len(ticks) >= 4
    assert ticks[0] <= -1e308 and ticks[-1] == pytest.approx(sys.float_info.max, rel=1e-5)
    x_of, _ = axis(chart.x_ticks)
    assert {round(x_of(x)): title.rsplit(":", 1)[-1] for x, title in chart.marks} == {
        2: " inf at step 2",
        5: " -inf at step 5",
    }
    assert [len(s["points"]) for s in chart.series] == [1, 2, 1]  # the line breaks at inf
    got = values_of(chart, "r", "training loss")
    expected = [(1, 2.5), (3, 1e308), (4, -1e308), (6, 1.7976931348623157e308)]
    assert len(got) == len(expected)
    for (gx, gy), (ex, ey) in zip(got, expected):
        assert gx == pytest.approx(ex, abs=0.01)
        assert gy / 1e308 == pytest.approx(ey / 1e308, abs=1e-3)


SOUND = {
    "run": "r",
    "step": 1,
    "loss": 2.5,
    "tokens": 512,
    "routing": {"2": {"max_load": 1.5, "min_load": 0.5}},
}


def line(**changes) -> str:
    return json.dumps({**SOUND, "step": 2, **changes})


# (what, the JSONL's lines after a sound record, run.json's settings (None: no run directory), lines
# skipped). Each gives a page, or the one line of a ReportError.
CARELESS = [
    ("optim a string", [], {"optim": "adamw"}, 0),
    ("optim a list", [], {"optim": ["adamw", 3]}, 0),
    ("optim null", [], {"optim": None}, 0),
    ("optim.name a list", [], {"optim": {"name": ["a"]}}, 0),
    ("optim.name an object", [], {"optim": {"name": {"a": 1}}}, 0),
    ("optim.lr a string", [], {"optim": {"lr": "3e-4"}}, 0),
    ("optim.lr a bool", [], {"optim": {"lr": True}}, 0),
    ("optim.lr 1e400", [], {"optim": {"lr": math.inf}}, 0),
    ("optim.lr 10**400", [], {"optim": {"lr": 10**400}}, 0),
    ("training a string", [], {"training": "x"}, 0),
    ("training.steps a string", [], {"training": {"steps": "9"}}, 0),
    ("training.steps a bool", [], {"training": {"steps": True}}, 0),
    ("training.steps negative", [], {"training": {"steps": -1}}, 0),
    ("settings a list", [], [1], 0),
    ("loss NaN", [line(loss=math.nan)], None, 0),
    ("loss a bool", [line(loss=True)], None, 1),
    ("loss 10**400", [line(loss=10**400)], None, 0),
    ("loss null", [line(loss=None)], None, 1),
    ("step a bool", [line(step=True)], None, 1),
    ("step negative", [line(step=-1)], None, 1),
    ("step 2**60", [line(step=2**60)], None, 1),
    ("step 1.5", [line(step=1.5)], None, 1),
    ("step a string", [line(step="2")], None, 1),
    ("run a number", [line(run=5)], None, 1),
    ("run empty", [line(run="")], None, 0),
    ("tokens 10**400", [line(tokens=10**400)], None, 0),
    ("tokens NaN", [line(tokens=math.nan)], None, 0),
    ("lr a string", [line(lr="x")], None, 1),
    ("memory inf", [line(memory_gib=math.inf)], None, 0),
    ("mfu a list", [line(mfu_percent=[1])], None, 1),
    ("routing a string", [line(routing="x")], None, 1),
    ("a layer a string", [line(routing={"2": "x"})], None, 0),
    ("max_load a string", [line(routing={"2": {"max_load": "x"}})], None, 0),
    ("max_load inf", [line(routing={"2": {"max_load": math.inf, "min_load": -1e308}})], None, 0),
    ("tokens a string", [line(routing={"2": {"tokens": "x", "dropped": 5}})], None, 0),
    (
        "dropped past any float",
        [line(routing={"2": {"tokens": [1e-300], "dropped": 1e308}})],
        None,
        0,
    ),
    ("bias spread past any float", [line(routing={"2": {"bias": [1e308, -1e308]}})], None, 0),
    ("bias 10**400", [line(routing={"2": {"bias": [10**400, True, "x", 1]}})], None, 0),
    ("val_loss NaN", ['{"run": "r", "step": 1, "val_loss": NaN}'], None, 0),
    ("val_loss a string", ['{"run": "r", "step": 1, "val_loss": "x"}'], None, 1),
    ("val_loss 10**400", ['{"run": "r", "step": 1, "val_loss": ' + "9" * 400 + "}"], None, 0),
    ("a number of 5000 digits", ['{"run": "r", "step": 2, "loss": ' + "9" * 5000 + "}"], None, 1),
    ("nested too deeply", ["[" * 100_000], None, 1),
    ("a lone surrogate", [line(run="\ud800<")], None, 0),
    ("a truncated last line", [line()[:20]], None, 1),
    ("not UTF-8", [line(run="r\udcff")], None, 0),
    ("a byte-order mark", ["\ufeff" + line()], None, 0),
]


@pytest.mark.parametrize(
    "lines, settings, skipped", [case[1:] for case in CARELESS], ids=[case[0] for case in CARELESS]
)
def test_careless_records_and_settings_give_a_page(tmp_path, lines, settings, skipped):
    log = tmp_path / "metrics.jsonl"
    text = "\n".join([json.dumps(SOUND), *lines]) + ("\n" if "truncated" not in str(lines) else "")
    if "\ufeff" in text:  # the mark starts the file
        text = "\ufeff" + text.replace("\ufeff", "")
    raw_byte = "\udcff" in text  # written as the byte 0xff, which is not UTF-8
    log.write_bytes(text.encode("utf-8", "surrogateescape" if raw_byte else "surrogatepass"))
    source = log
    if settings is not None:
        source = tmp_path / "run_0001"
        source.mkdir()
        note = {"jsonl": str(log), "run": "r", "settings": settings}
        (source / "run.json").write_text(json.dumps(note))
    page = Page(report.main([str(source), "--out", str(tmp_path / "report.html")]).read_text())
    assert page.skipped == ([skipped] if skipped else [])
    assert page.charts["loss-step"].series[0]["points"]  # the sound record is drawn


@pytest.mark.parametrize(
    "note, expected",
    [
        ("", "cannot read JSON"),
        ("[1]", "expected a JSON object, got a list"),
        ('{"run": "r"}', 'expected "jsonl" and "run" strings'),
        ('{"jsonl": 5, "run": "r"}', "strings"),
        ('{"jsonl": "a\\u0000b", "run": "r"}', "holds a NUL character"),
        ("[" * 100_000, "nested too deeply"),
        ('{"jsonl": "", "run": "r"}', "its records' file . does not exist"),
    ],
)
def test_a_run_json_that_names_no_records_is_one_line(tmp_path, note, expected):
    run_dir = tmp_path / "run_0001"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(note)
    done = run_report(run_dir)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(f"error: {run_dir / 'run.json'}: ") and expected in done.stderr
    assert done.stderr.count("\n") == 1 and not (run_dir / "report.html").exists()


def test_non_utf8_bytes_and_an_empty_log_give_a_page_that_says_so(tmp_path):
    binary, empty = tmp_path / "binary.jsonl", tmp_path / "empty.jsonl"
    binary.write_bytes(b"\xff\xfe\x00\x80garbage\n" + json.dumps(SOUND).encode() + b"\n")
    empty.write_bytes(b"")
    both = report.main([str(binary), str(empty), "--out", str(tmp_path / "r.html")])
    page = Page(both.read_text())
    assert page.skipped == [1] and page.charts["loss-step"].series
    page = Page(report.main([str(empty), "--out", str(tmp_path / "e.html")]).read_text())
    assert "No records of a run in these files." in page.texts
    assert not page.charts["loss-step"].series


# ----------------------------------------------------------------------------- a diverged run


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_run_stopped_by_divergence_writes_its_report(tmp_path, monkeypatch):
    """Steps 1 and 2 train at the debug config's rates; from step 3 the rate is 1e6, so the update
    blows the weights up and train.py's check stops the run: its page holds the two logged steps."""
    import train
    from helpers import run_debug, train_losses

    real_step = train.train_step

    def blown_up_from_step_3(model, optimizer, *args):
        if args[-2] >= 3:  # the step number
            for group in optimizer.param_groups:
                group["lr"] = 1e6
        return real_step(model, optimizer, *args)

    monkeypatch.setattr(train, "train_step", blown_up_from_step_3)
    with pytest.raises(train.TrainingError, match=r"step 3: .*the run diverged"):
        run_debug(tmp_path, "--training.steps=6", "--logging.every=1", "--training.sample_tokens=0")
    logged = train_losses(tmp_path)
    assert sorted(logged) == [1, 2]
    page = Page((tmp_path / "ckpt" / "run_0001" / "report.html").read_text())
    assert_points(page.charts["loss-step"], "run_0001", "training loss", sorted(logged.items()))
