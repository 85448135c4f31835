"""See a run: one HTML page of plots from the records train.py appends to logging.jsonl.

    python3 report.py RUN_DIR [RUN_DIR ...] [--out FILE]    # runs overlaid on the same axes
    python3 report.py runs/smoke/metrics.jsonl              # every run that file holds
    python3 report.py RUN_DIR --watch [--interval 2]         # rewritten as the run logs, to Ctrl-C

RUN_DIR is a run directory of train.py (checkpoint.dir/run_NNNN): its run.json, written when the run
starts, names the JSONL file that holds its records and the settings it ran with. train.py writes
RUN_DIR/report.html at the end of every run, a run stopped by divergence too; a run still going is
read as far as it has gone. --out names the page's file, or a directory to write report.html into;
never a file the report reads.

The page is one self-contained file (inline SVG, CSS and its own small script, nothing fetched):
training and validation loss against step, tokens and wall-clock seconds (each also on a log axis),
learning rate, gradient norm, tokens/s, MFU and memory (the peak so far: metrics.py logs the GPU
allocator's peak since the start, or on the CPU the process's maximum resident set, not a step's
own), every setting of run.json that differs between the runs, and for MoE runs a heatmap per run of
each layer's busiest and idlest expert's load, the assignments dropped past the experts' capacity
and the spread of the selection bias, over the steps. A line that is not a record (a truncated last
line, something else's JSON) is skipped and counted on the page; a value that is not a finite number
(inf, NaN) is marked where it was logged; every string of a file (run and layer names, paths,
settings) is escaped, so nothing in a record is markup on the page. The script (a smoothing slider,
TensorBoard's debiased moving average; a log-scale toggle; the nearest point's value under the
pointer, at any series length) reads the charts' points from a JSON block in which no string can end
the block (<, > and & escaped), and the page's content security policy runs no other script. The
address can set the view: report.html#smooth=0.6&log=1 and hover=CHART:X:Y,... (a marker at the
point nearest to X, Y of that chart, as the pointer would).

A leaf like files.py: it imports nothing of the model (no torch), so it runs on any copy of a log.
rehearsal.py draws its memory timeline with the same axes (memory_timeline_svg).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import html
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from files import read_json_object, write_atomically

# in a run directory: {"jsonl": its records' file, "run": their name, "settings": config}
RUN_NOTE = "run.json"
REPORT = "report.html"
COLOURS = [
    "#2563eb",
    "#dc2626",
    "#16a34a",
    "#9333ea",
    "#ea580c",
    "#0891b2",
    "#db2777",
    "#65a30d",
    "#4b5563",
    "#ca8a04",
]
# A perceptually even dark-to-bright ramp (viridis' anchors): bright is the value to worry about.
RAMP = [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]
MAX_POINTS = 2000  # a longer series is thinned to each bucket's lowest and highest point
MAX_COLUMNS = 100  # a heatmap bins more logged steps than this into this many columns
NUMBER_FIELDS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu_percent", "memory_gib", "tokens")
MAX_STEP = 2**53  # the largest step a float (an axis) holds exactly
FLOAT_MAX = sys.float_info.max
# Characters no page may hold: C0 controls but tab and newlines, DEL, and lone surrogates (a JSON
# escape such as "\ud800" decodes to one, and no UTF-8 file can hold it).
UNPRINTABLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")


class ReportError(ValueError):
    """A source that is neither a run directory nor a JSONL file; the message says which and why."""


# ============================================================================= reading the records


@dataclass
class RunLog:
    """One run's records: train[step] (a later record of a step replaces an earlier one) and the
    validation losses evals[step]; label names it in legends, settings is its config (run.json)."""

    name: str
    label: str = ""
    settings: dict = field(default_factory=dict)
    train: dict[int, dict] = field(default_factory=dict)
    evals: dict[int, float] = field(default_factory=dict)

    def tokens_per_step(self) -> float | None:
        return next(
            (
                r["tokens"] / step
                for step, r in self.train.items()
                if step and finite(r.get("tokens"))
            ),
            None,
        )

    def setting(self, section: str, key: str) -> object:
        """run.json's settings[section][key]; None where a section is missing or not a table."""
        part = self.settings.get(section)
        return part.get(key) if isinstance(part, dict) else None


@dataclass
class LogFile:
    path: Path
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (line number, why)


def note_run(run_dir: Path, jsonl: Path, name: str, settings: dict) -> None:
    """What report.py needs to find a run's records from its directory (train.py, at the start)."""
    note = {"jsonl": str(Path(jsonl).resolve()), "run": name, "settings": settings}
    write_atomically(Path(run_dir) / RUN_NOTE, json.dumps(note, indent=1))


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite(value: object) -> bool:
    """A number that an axis can place: not inf or NaN, and not an integer beyond any float."""
    try:
        return is_number(value) and math.isfinite(value)
    except OverflowError:
        return False


def as_float(value: int | float) -> float:
    """A JSON number as a float: an integer too large for one is infinite, as 1e400 reads."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def not_a_record(value: object) -> str | None:
    """Why a JSON value is not one of train.py's records, or None when it is one."""
    if not isinstance(value, dict) or not isinstance(value.get("run"), str):
        return 'not a record of a run (no "run" name)'
    step = value.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        return "no step number (a whole number from 0 to 2**53)"
    if "val_loss" in value:
        return None if is_number(value["val_loss"]) else '"val_loss" is not a number'
    if not is_number(value.get("loss")):
        return "neither a loss nor a validation loss"
    wrong = [
        key for key in NUMBER_FIELDS if value.get(key) is not None and not is_number(value[key])
    ]
    if wrong:
        return f"{', '.join(wrong)} not a number"
    return None if isinstance(value.get("routing", {}), dict) else '"routing" is not an object'


def read_log(path: Path, runs: dict[str, RunLog], wanted: set[str] | None) -> LogFile:
    """Adds the records of `path` to runs (those of the `wanted` run names; None: every run)."""
    log = LogFile(path)
    # Bytes that are not UTF-8 become U+FFFD; utf-8-sig drops the byte-order mark of some editors.
    with open(path, encoding="utf-8-sig", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except RecursionError:
                log.skipped.append((number, "JSON nested too deeply"))
                continue
            except ValueError:
                truncated = " (a truncated last line: a run writing it, or a crash)"
                ending = "" if line.endswith("\n") else truncated
                log.skipped.append((number, "not JSON" + ending))
                continue
            why = not_a_record(record)
            if why:
                log.skipped.append((number, why))
            elif wanted is None or record["run"] in wanted:
                run = runs.setdefault(record["run"], RunLog(record["run"]))
                if "val_loss" in record:
                    run.evals[record["step"]] = as_float(record["val_loss"])
                else:
                    run.train[record["step"]] = {
                        **record,
                        **{
                            key: as_float(record[key])
                            for key in NUMBER_FIELDS
                            if is_number(record.get(key))
                        },
                    }
    return log


def load_runs(sources: list[Path]) -> tuple[list[RunLog], list[LogFile]]:
    """Run directories (through their run.json) and JSONL files -> the runs, in the order given, and
    the files read."""
    # a file, as given first -> the run names to read (None: all)
    wanted: dict[Path, set[str] | None] = {}
    # a file's resolved path -> the path as given, so each file is read once
    given: dict[Path, Path] = {}
    settings: dict[str, dict] = {}
    order: list[str] = []
    for source in map(Path, sources):
        if source.is_dir():
            note_path = source / RUN_NOTE
            if not note_path.is_file():
                raise ReportError(
                    f"{source}: no {RUN_NOTE}, so not a run directory of train.py "
                    f"(checkpoint.dir/run_NNNN); name its logging.jsonl file instead"
                )
            note = read_note(note_path)
            jsonl = given.setdefault(Path(note["jsonl"]).resolve(), Path(note["jsonl"]))
            if not jsonl.is_file():
                raise ReportError(f"{note_path}: its records' file {jsonl} does not exist")
            if wanted.get(jsonl, set()) is not None:
                wanted.setdefault(jsonl, set()).add(note["run"])
            settings[note["run"]] = (
                note.get("settings") if isinstance(note.get("settings"), dict) else {}
            )
            order.append(note["run"])
        elif source.is_file():
            wanted[given.setdefault(source.resolve(), source)] = None
        else:
            raise ReportError(f"{source}: no such run directory or JSONL file")
    runs: dict[str, RunLog] = {}
    logs = [read_log(path, runs, names) for path, names in wanted.items()]
    chosen = [runs.pop(name, RunLog(name)) for name in dict.fromkeys(order)] + list(runs.values())
    for run in chosen:
        run.settings = settings.get(run.name, {})
    label_runs(chosen)
    return chosen, logs


def read_note(path: Path) -> dict:
    """A run directory's run.json, checked: "jsonl" and "run" strings (a path that can exist)."""
    try:
        note = read_json_object(path)
    except RecursionError as error:
        raise ReportError(f"{path}: cannot read JSON: nested too deeply") from error
    except ValueError as error:  # not JSON, not an object: files.py's line names the file
        raise ReportError(str(error)) from error
    if not isinstance(note.get("jsonl"), str) or not isinstance(note.get("run"), str):
        raise ReportError(f'{path}: expected "jsonl" and "run" strings, got keys {sorted(note)}')
    if "\0" in note["jsonl"]:
        raise ReportError(f'{path}: "jsonl" holds a NUL character, so names no file')
    return note


def label_runs(runs: list[RunLog]) -> None:
    """Each run's directory name, after the parts of its path (counted from the end) that tell it
    from the runs of the same name ("adamw/run_0001", "muon/run_0001"); and its optimizer where runs
    differ."""
    parts = [tuple(reversed(Path(run.name).parts or (run.name,))) for run in runs]
    optimizers = [optimizer_name(run) for run in runs]
    for run, mine, optimizer in zip(runs, parts, optimizers):
        namesakes = [p for p in parts if p[0] == mine[0]]
        telling = [
            part
            for depth, part in enumerate(mine[1:], 1)
            if len({p[depth] if depth < len(p) else None for p in namesakes}) > 1
        ]
        label = "/".join([*reversed(telling), mine[0]])
        differ = len(set(optimizers)) > 1 and optimizer and optimizer not in label
        run.label = f"{label} ({optimizer})" if differ else label


def optimizer_name(run: RunLog) -> str | None:
    name = run.setting("optim", "name")
    return name if isinstance(name, str) else None


# ============================================================================= numbers on axes


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round values (1, 2 or 5 times a power of ten apart) from at most lo to at least
    hi, for any finite lo and hi: halves never overflow (1e308 and -1e308 are 2e308 apart, past any
    float), and where a round value would pass the largest float, lo or hi itself ends the axis."""
    if not hi - lo > max(1e-9 * max(abs(lo), abs(hi)), 1e-300):  # flat at 12 digits: widen it
        centre = lo / 2 + hi / 2
        spread = 1.0 if abs(centre) < 1e-12 else abs(centre) / 2
        lo, hi = max(centre - spread, -FLOAT_MAX), min(centre + spread, FLOAT_MAX)
    raw = hi / count - lo / count
    power = 10.0 ** math.floor(math.log10(raw))
    spacing = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first, last = math.floor(lo / spacing + 1e-9), math.ceil(hi / spacing - 1e-9)
    ticks = [float(f"{i * spacing:.12g}") for i in range(first, last + 1)]
    inside = [tick for tick in ticks if math.isfinite(tick)]
    return [lo] * math.isinf(ticks[0]) + inside + [hi] * math.isinf(ticks[-1])


def log_ticks(lo: float, hi: float) -> list[float]:
    """Ticks of a logarithmic axis from at most lo to at least hi (both positive): the powers of ten
    around them, with 2 and 5 times each between where the span is under three decades."""
    first = max(math.floor(math.log10(lo) + 1e-9), -307)  # past these, 10 ** k is no float
    last = min(max(math.ceil(math.log10(hi) - 1e-9), first + 1), 308)
    steps = (1, 2, 5) if last - first < 3 else (1,)
    ticks = [float(f"{m * 10.0**k:.12g}") for k in range(first, last + 1) for m in steps]
    below = max((t for t in ticks if t <= lo * (1 + 1e-9)), default=ticks[0])
    above = min((t for t in ticks if t >= hi * (1 - 1e-9) and math.isfinite(t)), default=ticks[-1])
    return [t for t in ticks if below <= t <= above]


def number(value: float) -> str:
    """A tick label: 0, 0.0015, 2.5, 400, 20k, 1.5M, 3G, 1e+20."""
    if abs(value) >= 1e15:
        return f"{value:g}"
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


def ramp(t: float) -> str:
    """t in [0, 1] -> a colour of RAMP, as #rrggbb."""
    t = min(max(t, 0.0), 1.0) * (len(RAMP) - 1)
    i = min(int(t), len(RAMP) - 2)
    a, b = RAMP[i], RAMP[i + 1]
    return "#" + "".join(f"{round(x + (y - x) * (t - i)):02x}" for x, y in zip(a, b))


def text(value: object) -> str:
    """Any value as the text of an element or an attribute's value (quoted with "): its markup
    escaped, and characters no page may hold shown as U+FFFD. Every string of a user's file that
    reaches the page passes through here."""
    return html.escape(UNPRINTABLE.sub("\ufffd", str(value)), quote=True)


def tag(name: str, content: str | None = None, **values) -> str:
    """An SVG element: tag("text", "0.5", x=3, class_="tick", text_anchor="end") -> <text x="3"
    class="tick" text-anchor="end">0.5</text>; content (already escaped) None: <name .../>."""
    attributes = " ".join(
        f'{key.rstrip("_").replace("_", "-")}="{text(value)}"' for key, value in values.items()
    )
    return (
        f"<{name} {attributes}/>" if content is None else f"<{name} {attributes}>{content}</{name}>"
    )


class Frame:
    """A plot area (left, top, width, height in pixels) whose axes end at round ticks around the
    data; with `tight_x` the x axis ends at the data itself (a run's last step, not the next round
    value); with `log_y` the y axis is logarithmic (ys all positive)."""

    def __init__(
        self,
        xs: list[float],
        ys: list[float],
        left: float,
        top: float,
        width: float,
        height: float,
        tight_x: bool = False,
        log_y: bool = False,
    ):
        self.xticks, self.log_y = nice_ticks(min(xs), max(xs)), log_y
        self.xends = [self.xticks[0], self.xticks[-1]]
        if tight_x and max(xs) > min(xs):
            self.xends = [min(xs), max(xs)]
            self.xticks = [t for t in self.xticks if min(xs) <= t <= max(xs)]
        self.yticks = log_ticks(min(ys), max(ys)) if log_y else nice_ticks(min(ys), max(ys))
        self.yends = (
            [math.log10(self.yticks[0]), math.log10(self.yticks[-1])] if log_y else self.yticks
        )
        self.left, self.top, self.width, self.height = left, top, width, height

    def x(self, value: float) -> float:
        return round(self.left + along(value, self.xends) * self.width, 2)

    def y(self, value: float) -> float:
        value = math.log10(value) if self.log_y else value
        return round(self.top + self.height - along(value, self.yends) * self.height, 2)

    def ends(self) -> dict:
        """The axes' ends, in the page's data: its script maps points and the pointer with them."""
        return {
            "left": self.left,
            "top": self.top,
            "width": self.width,
            "height": self.height,
            "x": self.xends,
            "y": [self.yends[0], self.yends[-1]],
            "log": self.log_y,
        }

    def axes(self, x_label: str, y_label: str, grid: bool = True) -> list[str]:
        """Grid lines, tick labels (each <text> at its tick's position) and the axis titles; a
        heatmap (grid False) has neither grid lines nor y ticks: its rows are named instead."""
        bottom, right, middle = (
            self.top + self.height,
            self.left + self.width,
            self.top + self.height / 2,
        )
        out = ['<g class="x-ticks">']
        for tick in self.xticks:
            line = tag(
                "line", x1=self.x(tick), x2=self.x(tick), y1=self.top, y2=bottom, class_="grid"
            )
            out.append(
                (line if grid else "")
                + tag(
                    "text",
                    number(tick),
                    x=self.x(tick),
                    y=bottom + 14,
                    class_="tick",
                    text_anchor="middle",
                )
            )
        out.append('</g><g class="y-ticks">')
        for tick in self.yticks if grid else []:
            out.append(
                tag("line", x1=self.left, x2=right, y1=self.y(tick), y2=self.y(tick), class_="grid")
                + tag(
                    "text",
                    number(tick),
                    x=self.left - 5,
                    y=self.y(tick),
                    class_="tick",
                    text_anchor="end",
                    dominant_baseline="middle",
                )
            )
        frame = tag(
            "rect", x=self.left, y=self.top, width=self.width, height=self.height, class_="frame"
        )
        return out + [
            "</g>",
            frame,
            tag(
                "text",
                text(x_label),
                x=self.left + self.width / 2,
                y=bottom + 30,
                class_="axis",
                text_anchor="middle",
            ),
            tag(
                "text",
                text(y_label),
                x=14,
                y=middle,
                class_="axis",
                text_anchor="middle",
                transform=f"rotate(-90 14 {middle})",
            ),
        ]


def along(value: float, ticks: list[float]) -> float:
    """How far along the axis from its first tick to its last: 0 to 1. In halves, so that the span
    of an axis from -1e308 to 1e308 does not overflow."""
    lo, hi = ticks[0], ticks[-1]
    return (value / 2 - lo / 2) / (hi / 2 - lo / 2)


def svg(
    chart: str, width: float, height: float, body: list[str], title: str, style: str = ""
) -> str:
    """An SVG element; `style` (CSS) makes it stand alone, outside the report's page, at its own
    size. On the page it takes its column's width (the viewBox keeps its proportions)."""
    size = f'width="{width}" height="{height}"' if style else 'width="100%"'
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" data-chart="{chart}" '
        f'viewBox="0 0 {width} {height}" {size}>'
        + (f"<style>{style}</style>" if style else "")
        + tag("text", text(title), x=8, y=18, class_="title")
        + "".join(body)
        + "</svg>"
    )


# ============================================================================= charts


@dataclass
class Series:
    run: str  # the run's label
    what: str  # "training loss", "validation loss", ...
    colour: str
    points: list[tuple[float, float]]  # (x, y) in x order: x finite, y as logged (inf, NaN too)
    dashed: bool = False


def thinned(
    points: list[tuple[float, float]], limit: int = MAX_POINTS
) -> list[tuple[float, float]]:
    """At most about `limit` points: each bucket of neighbours keeps its lowest and highest."""
    if len(points) <= limit:
        return points
    size = math.ceil(len(points) / (limit // 2))
    kept = []
    for start in range(0, len(points), size):
        bucket = points[start : start + size]
        kept += sorted({min(bucket, key=lambda p: p[1]), max(bucket, key=lambda p: p[1])})
    return kept


def line_chart(
    chart: str,
    title: str,
    x_label: str,
    y_label: str,
    series: list[Series],
    width: int = 540,
    height: int = 300,
    log_y: bool = False,
    data: dict | None = None,
) -> str:
    """Every series on the same axes, a legend of the runs below (dashed: the style note says what).
    The x axis ends at the data. With `log_y` the y axis is logarithmic: a value that is not
    positive has no place on it and is left out. `data` (when given) gets the chart's axes and every
    finite point of each series under the chart's name, for the page's script (hover, smoothing)."""
    if log_y:
        series = [
            Series(s.run, s.what, s.colour, [(x, y) for x, y in s.points if not y <= 0], s.dashed)
            for s in series
        ]
    drawn = [s for s in series if s.points]
    runs = list(dict.fromkeys((s.run, s.colour) for s in drawn))
    columns = 2 if max((len(run) for run, _ in runs), default=0) <= 36 else 1
    notes = [
        note
        for note, shown in (
            (DASHED_NOTE, any(s.dashed for s in drawn)),
            (MARK_NOTE, any(not_finite(s) for s in drawn)),
        )
        if shown
    ]
    total = height + 16 * (math.ceil(len(runs) / columns) + len(notes))
    if not drawn:
        nothing = tag(
            "text", "nothing logged", x=width / 2, y=height / 2, class_="axis", text_anchor="middle"
        )
        return svg(chart, width, total, [nothing], title)
    xs = [x for s in drawn for x, _ in s.points]
    ys = [y for s in drawn for _, y in s.points if math.isfinite(y)] or [1.0, 10.0]
    # below the plot: the ticks and the axis title
    frame = Frame(
        xs, ys, left=62, top=30, width=width - 80, height=height - 84, tight_x=True, log_y=log_y
    )
    body = frame.axes(x_label, y_label)
    if data is not None:
        data[chart] = {
            "frame": frame.ends(),
            "x_label": x_label,
            "series": [
                {
                    "run": s.run,
                    "what": s.what,
                    "colour": s.colour,
                    "dashed": s.dashed,
                    "stretches": finite_stretches(s.points),
                }
                for s in drawn
            ],
        }
    for s in drawn:
        for stretch in finite_stretches(s.points):  # a value that is not a number breaks the line
            points = thinned(stretch)
            body.append(
                tag(
                    "polyline",
                    class_="series",
                    data_run=s.run,
                    data_what=s.what,
                    stroke=s.colour,
                    stroke_dasharray="5 3" if s.dashed else "none",
                    points=" ".join(f"{frame.x(x)},{frame.y(y)}" for x, y in points),
                )
            )
            if len(points) <= 60 or s.dashed:  # a point each, with its value on hover
                body += [
                    tag(
                        "circle",
                        point_title(s, x, y, x_label),
                        cx=frame.x(x),
                        cy=frame.y(y),
                        r=2.5,
                        fill=s.colour,
                    )
                    for x, y in points
                ]
        body += [
            tag(
                "text",
                point_title(s, x, y, x_label) + "&#215;",
                class_="not-finite",
                data_run=s.run,
                data_what=s.what,
                x=frame.x(x),
                y=frame.top + 6,
                fill=s.colour,
                text_anchor="middle",
            )
            for x, y in not_finite(s)
        ]
    body += legend(runs, notes, height - 12, width, columns)
    return svg(chart, width, total, body, title)


DASHED_NOTE = "solid: training loss; dashed with dots: validation loss"
MARK_NOTE = "\u00d7 at the top: a value that is not a finite number (inf, NaN), on hover"


def finite_stretches(points: list[tuple[float, float]]) -> list[list[tuple[float, float]]]:
    """The runs of neighbouring points whose values are finite numbers."""
    stretches = [[]]
    for x, y in points:
        if math.isfinite(y):
            stretches[-1].append((x, y))
        elif stretches[-1]:
            stretches.append([])
    return [stretch for stretch in stretches if stretch]


def not_finite(series: Series) -> list[tuple[float, float]]:
    return [(x, y) for x, y in series.points if not math.isfinite(y)]


def point_title(s: Series, x: float, y: float, x_label: str) -> str:
    return f"<title>{text(s.run)}, {text(s.what)}: {y:.6g} at {text(x_label)} {x:g}</title>"


def legend(
    runs: list[tuple[str, str]], notes: list[str], top: float, width: float, columns: int
) -> list[str]:
    out = ['<g class="legend">']
    for i, (run, colour) in enumerate(runs):
        x, y = 62 + (i % columns) * (width - 80) / 2, top + 16 * (i // columns)
        out.append(
            tag("line", x1=x, x2=x + 18, y1=y, y2=y, stroke=colour, stroke_width=2.5)
            + tag("text", text(run[:72]), x=x + 24, y=y + 4, class_="tick")
        )
    below = top + 4 + 16 * math.ceil(len(runs) / columns)
    out += [
        tag("text", text(note), x=62, y=below + 16 * k, class_="tick")
        for k, note in enumerate(notes)
    ]
    return out + ["</g>"]


def heatmap(
    chart: str,
    title: str,
    rows: list[str],
    steps: list[int],
    cells: dict[tuple[int, int], float],
    scale: tuple[float, float],
    what: str,
    width: int = 540,
) -> str:
    """rows x steps cells (row i, column j) -> value; a missing cell is left blank. Column j spans
    from the middle of the gap before its step to the middle of the gap after; `scale` maps its low
    end to the ramp's dark end and its high end to the bright end (a high end below the low one
    reverses it)."""
    row_height = max(3.0, min(40.0, 220 / max(len(rows), 1)))
    plot_height = row_height * len(rows)
    frame = Frame(
        [float(steps[0]), float(steps[-1])],
        [0.0, 1.0],
        left=62,
        top=30,
        width=width - 140,
        height=plot_height,
    )
    edges = [steps[0]] + [(a + b) / 2 for a, b in zip(steps, steps[1:])] + [steps[-1]]
    lo, hi = scale
    body = []
    for (i, j), value in cells.items():
        x0, x1 = frame.x(edges[j]), frame.x(edges[j + 1])
        title = f"<title>layer {text(rows[i])}, step {steps[j]}: {text(what)} {value:.4g}</title>"
        # A value past any float (an overflowing spread, a logged inf) has no colour: a red outline.
        shade = ramp(along(value, [lo, hi]) if hi != lo else 0.0) if math.isfinite(value) else None
        colour = (
            {"fill": shade}
            if shade
            else {"fill": "none", "stroke": "#dc2626", "class_": "not-finite"}
        )
        body.append(
            tag(
                "rect",
                title,
                x=x0,
                y=round(30 + i * row_height, 2),
                width=max(round(x1 - x0, 2), 0.6),
                height=row_height,
                **colour,
            )
        )
    body += frame.axes("step", "layer", grid=False)
    every = math.ceil(len(rows) / 24)  # at most 24 row names
    body += [
        tag(
            "text",
            text(row),
            x=57,
            y=round(30 + (i + 0.5) * row_height, 2),
            class_="tick",
            text_anchor="end",
            dominant_baseline="middle",
        )
        for i, row in enumerate(rows)
        if i % every == 0
    ]
    body += colour_bar(scale, width - 66, 30, plot_height)
    return svg(chart, width, plot_height + 80, body, title)


def colour_bar(
    scale: tuple[float, float], left: float, top: float, height: float, steps: int = 32
) -> list[str]:
    """The ramp from the dark end (bottom) to the bright end (top), labelled with round values of
    scale."""
    lo, hi = scale
    out = ['<g class="colour-bar">']
    out += [
        tag(
            "rect",
            x=left,
            y=round(top + k * height / steps, 2),
            width=12,
            height=round(height / steps + 0.5, 2),
            fill=ramp(1 - (k + 0.5) / steps),
        )
        for k in range(steps)
    ]
    for value in nice_ticks(min(lo, hi), max(lo, hi), 4):
        if min(lo, hi) <= value <= max(lo, hi):
            y = top + height * (1 - ((value - lo) / (hi - lo) if hi != lo else 0))
            out.append(
                tag(
                    "text",
                    number(value),
                    x=left + 16,
                    y=round(y, 2),
                    class_="tick",
                    dominant_baseline="middle",
                )
            )
    return out + ["</g>"]


# ============================================================================= the runs' charts

LOSS_AXES = [
    ("step", "step", "step"),
    ("tokens", "tokens", "tokens"),
    ("elapsed", "elapsed_s", "wall-clock seconds"),
]  # (chart, record's key, axis title)
# metrics.py logs the GPU allocator's peak since the run started, or on the CPU the process's
# lifetime maximum resident set (ru_maxrss): neither is the step's own peak, and the title says so.
MEMORY_TITLE = "peak memory since the previous point (GPU allocated; CPU: resident set)"


def training_charts(runs: list[RunLog], data: dict | None = None) -> list[str]:
    """Loss against step, tokens and wall-clock time, each on a linear and a logarithmic axis (the
    page's toggle shows one), then one chart per logged quantity, every run overlaid. `data` gets
    each chart's points for the page's script."""
    coloured = list(zip(runs, COLOURS * len(runs)))

    # A value that is not a finite number (inf, NaN) stays in the series: drawn as a mark, a gap.
    def logged(run: RunLog, colour: str, key: str, what: str, x_key: str = "step") -> Series:
        points = [
            (float(r[x_key]), r[key])
            for _, r in sorted(run.train.items())
            if is_number(r.get(key)) and finite(r.get(x_key))
        ]
        return Series(run.label, what, colour, points)

    def validation(run: RunLog, colour: str, x_key: str) -> Series:
        # Evaluations hold no token count or time: a step's, from its training record.
        at_step = {
            step: 1.0 * step if x_key == "step" else run.train.get(step, {}).get(x_key)
            for step in run.evals
        }
        points = [
            (float(at_step[step]), loss)
            for step, loss in sorted(run.evals.items())
            if finite(at_step[step])
        ]
        return Series(run.label, "validation loss", colour, points, dashed=True)

    charts = []
    for name, x_key, x_label in LOSS_AXES:
        series = [
            s
            for run, colour in coloured
            for s in (
                logged(run, colour, "loss", "training loss", x_key),
                validation(run, colour, x_key),
            )
        ]
        for log_y, scale in ((False, ""), (True, "-log")):
            box = "scale-log" if log_y else "scale-linear"
            charts.append(
                f'<div class="{box}">'
                + line_chart(
                    f"loss-{name}{scale}",
                    f"loss against {x_label}" + " (log scale)" * log_y,
                    x_label,
                    "loss (nats per token)",
                    series,
                    log_y=log_y,
                    data=data,
                )
                + "</div>"
            )
    for key, chart, title, y_label in [
        ("lr", "lr", "learning rate", "learning rate (per step)"),
        ("grad_norm", "grad-norm", "gradient norm (global L2, before clipping)", "gradient norm"),
        ("tokens_per_s", "tokens-per-s", "throughput", "tokens/s (all ranks)"),
        ("mfu_percent", "mfu", "model FLOPs utilisation", "MFU (%)"),
        ("memory_gib", "memory", MEMORY_TITLE, "GiB (rank 0)"),
    ]:
        series = [logged(run, colour, key, title) for run, colour in coloured]
        chart_svg = line_chart(chart, title, "step", y_label, series, data=data)
        charts.append(f"<div>{chart_svg}</div>")
    return charts


def expert_charts(run: RunLog, index: int) -> list[str]:
    """Per MoE layer over the logged steps: max and min load over the mean, dropped assignments
    (capacity), the selection bias' spread (where the run moves it)."""
    records = [r for _, r in sorted(run.train.items()) if r.get("routing")]
    layers = sorted({layer for r in records for layer in r["routing"]}, key=lambda s: (len(s), s))
    if not records or not layers:
        return []
    bins = [
        records[i : i + math.ceil(len(records) / MAX_COLUMNS)]
        for i in range(0, len(records), math.ceil(len(records) / MAX_COLUMNS))
    ]
    steps = [b[-1]["step"] for b in bins]

    def cells(value_of, worst) -> dict[tuple[int, int], float]:
        out = {}
        for j, records_of_bin in enumerate(bins):
            for i, layer in enumerate(layers):
                values = [
                    v
                    for r in records_of_bin
                    if (v := value_of(r["routing"].get(layer))) is not None
                ]
                if values:
                    out[(i, j)] = worst(values)
        return out

    def field_of(key):
        return (
            lambda stats: float(stats[key])
            if isinstance(stats, dict) and finite(stats.get(key))
            else None
        )

    # of the layer's assignments: its experts' routed tokens, before any drop
    def dropped_percent(stats):
        tokens = (
            stats.get("tokens")
            if isinstance(stats, dict) and finite(stats.get("dropped"))
            else None
        )
        total = sum(t for t in tokens if finite(t)) if isinstance(tokens, list) else 0
        return 100 * as_float(stats["dropped"]) / as_float(total) if total else None

    def bias_spread(stats):
        bias = stats.get("bias") if isinstance(stats, dict) else None
        values = [as_float(b) for b in bias if finite(b)] if isinstance(bias, list) else []
        return max(values) - min(values) if values else None  # inf: a spread past any float

    def top(values, least):  # the scale's bright end: the highest finite value, or at least `least`
        return max([least, *(v for v in values if math.isfinite(v))])

    highest = cells(field_of("max_load"), max)
    charts = [
        heatmap(
            f"max-load-{index}",
            "busiest expert's load / mean (1 = balanced)",
            layers,
            steps,
            highest,
            (1.0, top(highest.values(), 1.5)),
            "max load",
        )
    ]
    lowest = cells(field_of("min_load"), min)
    charts.append(
        heatmap(
            f"min-load-{index}",
            "idlest expert's load / mean (0 = an expert got nothing)",
            layers,
            steps,
            lowest,
            (1.0, 0.0),
            "min load",
        )
    )
    dropped = cells(dropped_percent, max)
    if dropped:
        charts.append(
            heatmap(
                f"dropped-{index}",
                "assignments dropped past capacity (% of the layer's)",
                layers,
                steps,
                dropped,
                (0.0, top(dropped.values(), 1.0)),
                "dropped %",
            )
        )
    spread = cells(bias_spread, max)
    if spread:
        charts.append(
            heatmap(
                f"bias-{index}",
                "selection bias: highest minus lowest expert's",
                layers,
                steps,
                spread,
                (0.0, top(spread.values(), 1e-3)),
                "bias spread",
            )
        )
    return charts


# ============================================================================= the page

SVG_STYLE = """svg{font-family:system-ui,sans-serif;background:#fff}
svg .title{font-weight:600;font-size:13px}
svg .tick{font-size:11px;fill:#374151}svg .axis{font-size:12px;fill:#111}svg .grid{stroke:#e5e7eb}
svg .frame{fill:none;stroke:#9ca3af}svg polyline{fill:none;stroke-width:1.8}"""
STYLE = (
    """body{font:14px system-ui,sans-serif;margin:24px;color:#111;background:#fff}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}table{border-collapse:collapse}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:right;white-space:nowrap}
th{background:#f3f4f6}
td:first-child{text-align:left}td:last-child{text-align:left;white-space:normal}
.grid-of-charts{gap:12px}
.warning{background:#fff7ed;border:1px solid #fdba74;padding:8px}
.grid-of-charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(480px,1fr))}
body.log-scale .scale-linear,body:not(.log-scale) .scale-log{display:none}
svg.smoothing polyline.series[data-what="training loss"]{stroke-opacity:.3}
svg polyline.smoothed{fill:none;stroke-width:2}.controls{margin:8px 0}
svg rect.selection{fill:#2563eb;fill-opacity:.12}svg{user-select:none}"""
    + SVG_STYLE
)
CONTROLS = (
    '<div class="controls" id="controls" hidden><label>smoothing <input type="range" '
    'id="smoothing" min="0" max="0.99" step="0.01" value="0"></label> '
    '<output id="smoothing-value">0.00</output> <label><input type="checkbox" '
    'id="log-scale"> log scale</label> (hover a chart for the nearest point\'s value; drag '
    "across one to zoom, double-click to zoom out)"
    "</div>"
)
SCRIPT = r"""(function () {
"use strict";
// The report's only script: its numbers come from the JSON block (JSON.parse, never as markup),
// and every text it writes is textContent. Hash: smooth=0.6, log=1, hover=CHART:X:Y,CHART:X:Y,
// zoom=CHART:X0:X1,CHART:X0:X1 (a chart drawn again over X0 to X1, its y axis fitted to them).
var data = JSON.parse(document.getElementById("report-data").textContent);
var hash = new URLSearchParams(location.hash.slice(1));
var NS = "http://www.w3.org/2000/svg";
var slider = document.getElementById("smoothing"), logBox = document.getElementById("log-scale");
function along(v, ends) { return (v / 2 - ends[0] / 2) / (ends[1] / 2 - ends[0] / 2); }
function pixel(f, p) {
  var y = f.log ? Math.log10(p[1]) : p[1];
  return [f.left + along(p[0], f.x) * f.width, f.top + f.height - along(y, f.y) * f.height];
}
function within(f, p) { return p[0] >= f.x[0] && p[0] <= f.x[1]; }
function smoothed(points, weight) {  // TensorBoard's debiased exponential moving average
  var last = 0, out = [];
  points.forEach(function (p, i) {
    last = last * weight + (1 - weight) * p[1];
    out.push([p[0], weight > 0 ? last / (1 - Math.pow(weight, i + 1)) : p[1]]);
  });
  return out;
}
function element(name, attributes) {
  var e = document.createElementNS(NS, name);
  Object.keys(attributes).forEach(function (k) { e.setAttribute(k, attributes[k]); });
  return e;
}
function svgOf(chart) { return document.querySelector('svg[data-chart="' + chart + '"]'); }
function smooth(weight) {
  document.getElementById("smoothing-value").textContent = weight.toFixed(2);
  Object.keys(data).forEach(function (chart) {
    var svg = svgOf(chart), f = data[chart].frame;
    svg.querySelectorAll("polyline.smoothed").forEach(function (e) { e.remove(); });
    svg.classList.toggle("smoothing", weight > 0);
    if (weight <= 0 || chart.indexOf("loss-") !== 0) return;
    data[chart].series.forEach(function (s) {
      if (s.what !== "training loss") return;
      s.stretches.forEach(function (stretch) {
        var points = smoothed(stretch, weight).filter(function (p) { return within(f, p); })
                                              .map(function (p) { return pixel(f, p).join(","); });
        var line = element("polyline",
                           {"class": "smoothed", stroke: s.colour, points: points.join(" ")});
        line.setAttribute("data-run", s.run);
        line.setAttribute("data-what", s.what + " (smoothed)");
        svg.appendChild(line);
      });
    });
  });
}
function nearest(chart, px, py) {  // the logged point closest to the pixel, over every series
  var f = data[chart].frame, best = null;
  data[chart].series.forEach(function (s) {
    s.stretches.forEach(function (stretch) {
      stretch.filter(function (p) { return within(f, p); }).forEach(function (p) {
        var q = pixel(f, p), d = (q[0] - px) * (q[0] - px) + (q[1] - py) * (q[1] - py);
        if (best === null || d < best.d) best = {d: d, s: s, p: p, q: q};
      });
    });
  });
  return best;
}
function show(chart, px, py, keep) {
  var svg = svgOf(chart), best = nearest(chart, px, py);
  if (!keep) svg.querySelectorAll("g.hover").forEach(function (e) { e.remove(); });
  if (best === null) return;
  var s = best.s, p = best.p, words = s.run + ", " + s.what + ": " + Number(p[1].toPrecision(6))
      + " at " + data[chart].x_label + " " + p[0];
  var g = element("g", {"class": "hover", "data-x": p[0], "data-y": p[1]});
  g.appendChild(element("circle", {cx: best.q[0], cy: best.q[1], r: 4, fill: s.colour}));
  var f = data[chart].frame;
  var label = element("text", {x: f.left + f.width - 6, y: f.top + 14, "class": "tick",
                               "text-anchor": "end"});
  label.textContent = words;
  g.appendChild(label);
  svg.appendChild(g);
}
function niceTicks(lo, hi) {  // report.py's nice_ticks, for the finite ends of a zoom
  if (!(hi - lo > 1e-9 * Math.max(Math.abs(lo), Math.abs(hi), 1e-300))) {
    var centre = lo / 2 + hi / 2, spread = Math.abs(centre) < 1e-12 ? 1 : Math.abs(centre) / 2;
    lo = centre - spread; hi = centre + spread;
  }
  var raw = hi / 5 - lo / 5, power = Math.pow(10, Math.floor(Math.log10(raw)));
  var spacing = [1, 2, 5, 10].map(function (m) { return m * power; })
                             .filter(function (step) { return step >= raw; })[0], ticks = [];
  for (var i = Math.floor(lo / spacing + 1e-9); i <= Math.ceil(hi / spacing - 1e-9); i++) {
    ticks.push(Number((i * spacing).toPrecision(12)));
  }
  return ticks;
}
function logTicks(lo, hi) {  // report.py's log_ticks
  var first = Math.max(Math.floor(Math.log10(lo) + 1e-9), -307);
  var last = Math.min(Math.max(Math.ceil(Math.log10(hi) - 1e-9), first + 1), 308), ticks = [];
  var steps = last - first < 3 ? [1, 2, 5] : [1];
  for (var k = first; k <= last; k++) {
    steps.forEach(function (m) { ticks.push(Number((m * Math.pow(10, k)).toPrecision(12))); });
  }
  var below = Math.max.apply(null, ticks.filter(function (t) { return t <= lo * (1 + 1e-9); }));
  var above = Math.min.apply(null, ticks.filter(function (t) { return t >= hi * (1 - 1e-9); }));
  return ticks.filter(function (t) { return t >= below && t <= above; });
}
function label(v) {  // report.py's number: 0.0015, 2.5, 400, 20k, 1.5M, 3G, 1e+20
  var g = function (x) { return String(Number(x.toPrecision(6))); };
  if (Math.abs(v) >= 1e15) return v.toExponential().replace(/\.?0+e/, "e");
  var scales = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
  for (var i = 0; i < scales.length; i++) {
    if (Math.abs(v) >= scales[i][0]) return g(v / scales[i][0]) + scales[i][1];
  }
  return g(v);
}
function tick(parent, tag, attributes, words) {
  var e = element(tag, attributes);
  if (words !== undefined) e.textContent = words;
  parent.appendChild(e);
}
function drawTicks(svg, f, xticks, yticks) {  // as report.py's Frame.axes draws them
  var bottom = f.top + f.height, right = f.left + f.width;
  var xs = svg.querySelector("g.x-ticks"), ys = svg.querySelector("g.y-ticks");
  while (xs.firstChild) xs.removeChild(xs.firstChild);
  while (ys.firstChild) ys.removeChild(ys.firstChild);
  xticks.forEach(function (t) {
    var x = pixel(f, [t, f.log ? 1 : 0])[0].toFixed(2);
    tick(xs, "line", {x1: x, x2: x, y1: f.top, y2: bottom, "class": "grid"});
    tick(xs, "text", {x: x, y: bottom + 14, "class": "tick", "text-anchor": "middle"}, label(t));
  });
  yticks.forEach(function (t) {
    var y = pixel(f, [f.x[0], t])[1].toFixed(2);
    tick(ys, "line", {x1: f.left, x2: right, y1: y, y2: y, "class": "grid"});
    tick(ys, "text", {x: f.left - 5, y: y, "class": "tick", "text-anchor": "end",
                      "dominant-baseline": "middle"}, label(t));
  });
}
var originals = {}, zoomed = {};  // each chart as the page drew it; each zoomed chart's steps
function zoom(chart, x0, x1) {  // the chart over x0..x1, its y axis fitted to what is there
  var d = data[chart], lo = Math.min(x0, x1), hi = Math.max(x0, x1), ys = [];
  if (!(hi > lo)) return;
  if (!originals[chart]) originals[chart] = {svg: svgOf(chart).cloneNode(true), frame: d.frame};
  var f = Object.assign({}, originals[chart].frame, {x: [lo, hi]});
  d.series.forEach(function (s) {
    s.stretches.forEach(function (stretch) {
      stretch.forEach(function (p) { if (within(f, p) && (!f.log || p[1] > 0)) ys.push(p[1]); });
    });
  });
  if (!ys.length) return;
  var low = Math.min.apply(null, ys), high = Math.max.apply(null, ys);
  var yticks = f.log ? logTicks(low, high) : niceTicks(low, high);
  var ends = [yticks[0], yticks[yticks.length - 1]];
  f.y = f.log ? ends.map(Math.log10) : ends;
  d.frame = f;
  var svg = svgOf(chart);
  svg.querySelectorAll("polyline, circle, text.not-finite, g.hover").forEach(function (e) {
    e.remove();
  });
  drawTicks(svg, f, niceTicks(lo, hi).filter(function (t) { return t >= lo && t <= hi; }), yticks);
  var lines = document.createDocumentFragment();  // above the grid, below the legend
  d.series.forEach(function (s) {
    s.stretches.forEach(function (stretch) {
      var shown = stretch.filter(function (p) { return within(f, p) && (!f.log || p[1] > 0); });
      var line = element("polyline", {"class": "series", stroke: s.colour,
                                      "stroke-dasharray": s.dashed ? "5 3" : "none",
                                      points: shown.map(function (p) {
                                        return pixel(f, p).map(function (v) {
                                          return v.toFixed(2);
                                        }).join(",");
                                      }).join(" ")});
      line.setAttribute("data-run", s.run);
      line.setAttribute("data-what", s.what);
      lines.appendChild(line);
    });
  });
  svg.querySelector("rect.frame").after(lines);
  zoomed[chart] = [lo, hi];
  smooth(Number(slider.value));
}
function unzoom(chart) {  // back to the chart the page drew
  if (!originals[chart]) return;
  svgOf(chart).replaceWith(originals[chart].svg.cloneNode(true));
  data[chart].frame = originals[chart].frame;
  delete zoomed[chart];
  smooth(Number(slider.value));
}
function pointer(svg, event) {  // the event's position in the chart's own pixels
  var point = svg.createSVGPoint();
  point.x = event.clientX; point.y = event.clientY;
  return point.matrixTransform(svg.getScreenCTM().inverse());
}
function chartAt(event) {
  var svg = event.target.closest && event.target.closest("svg[data-chart]");
  return svg && data[svg.getAttribute("data-chart")] ? svg : null;
}
function stepAt(chart, px) {
  var f = data[chart].frame;
  return f.x[0] + (px - f.left) / f.width * (f.x[1] - f.x[0]);
}
var dragging = null;  // {chart, from}: a press on a chart, to zoom on the span dragged over
document.addEventListener("mousedown", function (event) {
  var svg = chartAt(event);
  if (svg) dragging = {chart: svg.getAttribute("data-chart"), from: pointer(svg, event).x};
});
document.addEventListener("mousemove", function (event) {
  var svg = chartAt(event);
  if (!svg) return;
  var chart = svg.getAttribute("data-chart"), at = pointer(svg, event);
  show(chart, at.x, at.y, false);
  svg.querySelectorAll("rect.selection").forEach(function (e) { e.remove(); });
  if (dragging && dragging.chart === chart) {
    var f = data[chart].frame;
    svg.appendChild(element("rect", {"class": "selection", x: Math.min(dragging.from, at.x),
                                     y: f.top, width: Math.abs(at.x - dragging.from),
                                     height: f.height}));
  }
});
document.addEventListener("mouseup", function (event) {
  var svg = chartAt(event), from = dragging;
  dragging = null;
  if (!svg || !from || from.chart !== svg.getAttribute("data-chart")) return;
  var to = pointer(svg, event).x;
  svg.querySelectorAll("rect.selection").forEach(function (e) { e.remove(); });
  if (Math.abs(to - from.from) < 5) return;  // a click, not a drag
  zoom(from.chart, stepAt(from.chart, from.from), stepAt(from.chart, to));
  remember();
});
document.addEventListener("dblclick", function (event) {
  var svg = chartAt(event);
  if (svg) { unzoom(svg.getAttribute("data-chart")); remember(); }
});
document.getElementById("controls").hidden = false;
function remember() {  // in the address, so that a reload (report.py --watch) keeps the view
  var zooms = Object.keys(zoomed).map(function (c) { return [c].concat(zoomed[c]).join(":"); });
  history.replaceState(null, "", "#smooth=" + slider.value + "&log=" + (logBox.checked ? 1 : 0)
                       + (zooms.length ? "&zoom=" + zooms.join(",") : ""));
}
slider.addEventListener("input", function () { smooth(Number(slider.value)); remember(); });
logBox.addEventListener("change", function () {
  document.body.classList.toggle("log-scale", logBox.checked);
  remember();
});
slider.value = hash.get("smooth") || "0";
logBox.checked = hash.get("log") === "1";
document.body.classList.toggle("log-scale", logBox.checked);
smooth(Number(slider.value));
(hash.get("zoom") || "").split(",").filter(Boolean).forEach(function (wanted) {
  var parts = wanted.split(":");
  if (data[parts[0]]) zoom(parts[0], Number(parts[1]), Number(parts[2]));
});
(hash.get("hover") || "").split(",").filter(Boolean).forEach(function (wanted) {
  var parts = wanted.split(":"), chart = parts[0];
  if (!data[chart]) return;
  var q = pixel(data[chart].frame, [Number(parts[1]), Number(parts[2])]);
  show(chart, q[0], q[1], true);
});
})();
"""


def summary_row(run: RunLog, colour: str, differing: list[str]) -> str:
    """The run's row: its first and last training loss as logged (inf and NaN shown as such: a
    diverged run); medians, the best and the peak over the finite values."""
    train = [r for _, r in sorted(run.train.items())]
    total = run.setting("training", "steps")
    last = max([*run.train, *run.evals], default=0)

    def finite_values(key):
        return [r[key] for r in train if finite(r.get(key))]

    def median(key, unit, digits):
        values = finite_values(key)
        return f"{statistics.median(values):,.{digits}f}{unit}" if values else "-"

    losses = [r["loss"] for r in train]
    best = [loss for loss in run.evals.values() if math.isfinite(loss)]
    has_total = isinstance(total, int) and not isinstance(total, bool) and total >= 0
    cells = [
        f'<span style="color:{colour}">&#9632;</span> {text(run.label)}',
        f"{last}" + (f" of {total}" if has_total else ""),
        f"{losses[0]:.4f} &rarr; {losses[-1]:.4f}" if losses else "-",
        f"{min(best):.4f}" if best else "-",
        median("tokens_per_s", "", 0),
        median("mfu_percent", " %", 2),
        f"{max(finite_values('memory_gib')):.2f} GiB" if finite_values("memory_gib") else "-",
        text(described(run, differing)),
    ]
    return "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def described(run: RunLog, differing: list[str]) -> str:
    """The settings that tell runs apart at a glance: optimizer, peak learning rate, tokens per
    step, then each of `differing` (dotted names of run.json's settings) as this run has it."""
    lr, per_step = run.setting("optim", "lr"), run.tokens_per_step()
    glance = ", ".join(
        part
        for part in (
            optimizer_name(run),
            f"lr {lr:g}" if finite(lr) else "",
            f"{per_step:,.0f} tokens/step" if per_step else "",
        )
        if part
    )
    mine = flattened(run.settings)
    rest = ", ".join(
        f"{key} = {shown_setting(mine[key]) if key in mine else '(unset)'}"
        for key in differing
        if key not in GLANCED and run.settings
    )
    return "; ".join(part for part in (glance, rest) if part)


GLANCED = {"optim.name", "optim.lr"}  # shown at a glance by described()
SETTING_CHARACTERS = 60  # a longer value (a list of layers) is cut, with an ellipsis


def flattened(settings: dict, prefix: str = "") -> dict[str, object]:
    """{"fp8": {"recipe": "rowwise"}} -> {"fp8.recipe": "rowwise"}: a table's keys, dotted."""
    out = {}
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            out.update(flattened(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def shown_setting(value: object) -> str:
    shown = value if isinstance(value, str) else json.dumps(value)
    return shown if len(shown) <= SETTING_CHARACTERS else shown[: SETTING_CHARACTERS - 1] + "\u2026"


def differing_settings(runs: list[RunLog]) -> list[str]:
    """The dotted names of the settings whose values differ between the runs that have settings (a
    run without run.json has none to compare), in the order of the first run that sets each."""
    tables = [flattened(run.settings) for run in runs if run.settings]
    names = list(dict.fromkeys(key for table in tables for key in table))
    return [
        key
        for key in names
        if len(tables) > 1
        and len(
            {
                (key in table, json.dumps(table.get(key), sort_keys=True, default=repr))
                for table in tables
            }
        )
        > 1
    ]


def render(runs: list[RunLog], logs: list[LogFile], refresh: int | None = None) -> str:
    """The page: which runs, what was skipped, the training charts, then each MoE run's heatmaps;
    `refresh` (seconds) makes a browser reload it that often (report.py --watch rewrites it)."""
    head = (
        "<tr><th>run</th><th>last step</th><th>training loss</th><th>best validation loss</th>"
        "<th>tokens/s (median)</th><th>MFU (median)</th><th>peak "
        "memory</th><th>settings</th></tr>"
    )
    differing = differing_settings(runs)
    rows = "".join(
        summary_row(run, colour, differing) for run, colour in zip(runs, COLOURS * len(runs))
    )
    parts = [
        f"<h1>Training report: {text(', '.join(run.label for run in runs))}</h1>",
        f"<table>{head}{rows}</table>",
        f"<p>Records from {text(', '.join(str(log.path) for log in logs))}.</p>",
    ]
    if not runs:
        parts.append('<p class="warning">No records of a run in these files.</p>')
    for log in logs:
        if log.skipped:
            where = "; ".join(f"line {n}: {why}" for n, why in log.skipped[:5])
            more = f" and {len(log.skipped) - 5} more" if len(log.skipped) > 5 else ""
            parts.append(
                f'<p class="warning" data-skipped="{len(log.skipped)}">'
                f"{text(str(log.path))}: {len(log.skipped)} line(s) skipped, not records "
                f"of a run: {text(where)}{more}</p>"
            )
    data: dict = {}
    parts += [
        "<h2>Training</h2>",
        CONTROLS,
        '<div class="grid-of-charts">',
        *training_charts(runs, data),
        "</div>",
    ]
    for index, run in enumerate(runs):
        experts = expert_charts(run, index)
        if experts:
            parts += [
                f"<h2>Experts: {text(run.label)}</h2>",
                '<div class="grid-of-charts">',
                *experts,
                "</div>",
            ]
    # The policy lets no script run but the report's own (by its hash) and nothing be fetched.
    digest = base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()
    policy = f"default-src 'none'; style-src 'unsafe-inline'; script-src 'sha256-{digest}'"
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{policy}">'
        + (f'<meta http-equiv="refresh" content="{int(refresh)}">' if refresh else "")
        + "<title>flint report</title>"
        f"<style>{STYLE}</style></head><body>{''.join(parts)}"
        f'<script type="application/json" id="report-data">{script_json(data)}</script>'
        f"<script>{SCRIPT}</script></body></html>\n"
    )


def script_json(value: object) -> str:
    """`value` as JSON that no string in it can end or alter the <script> element holding it: every
    <, > and & (and U+2028, U+2029, beyond ASCII) written as a \\u escape, which JSON.parse reads
    back; characters no page may hold are U+FFFD, as text() shows them."""

    def clean(item: object) -> object:
        if isinstance(item, str):
            return UNPRINTABLE.sub("\ufffd", item)
        if isinstance(item, dict):
            return {clean(key): clean(v) for key, v in item.items()}
        return [clean(v) for v in item] if isinstance(item, (list, tuple)) else item

    encoded = json.dumps(clean(value), ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return encoded.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def write_report(sources: list[Path], out: Path | None = None, refresh: int | None = None) -> Path:
    """The report of the runs `sources` names (run directories, JSONL files), written to `out`
    (default: the one run directory's report.html, else ./report.html) -> its path."""
    runs, logs = load_runs(sources)
    out = page_path(sources, out, [log.path for log in logs])
    write_page(out, render(runs, logs, refresh))
    return out


class Watcher:
    """The page of `sources`, rewritten (atomically) at a poll when a file it reads has changed."""

    def __init__(self, sources: list[Path], out: Path | None = None, refresh: int | None = None):
        self.sources, self.out, self.refresh = [Path(source) for source in sources], out, refresh
        self.seen: list[tuple[str, int, int]] | None = None

    def read_files(self) -> list[Path]:
        """The JSONL files and run.json notes the page is made of."""
        files = []
        for source in self.sources:
            note = source / RUN_NOTE
            files += [note, Path(read_note(note)["jsonl"])] if note.is_file() else [source]
        return files

    def poll(self) -> Path | None:
        """The page's path when this poll rewrote it: a file's size or modification time changed
        since the last poll (the first poll always writes it); else None."""
        stamps = [
            (str(path), info.st_size, info.st_mtime_ns)
            for path in self.read_files()
            if (info := stat_or_none(path))
        ]
        if stamps == self.seen:
            return None
        self.seen = stamps
        return write_report(self.sources, self.out, self.refresh)


def stat_or_none(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:  # not there yet, or gone: write_report says which
        return None


def watch(
    sources: list[Path], out: Path | None = None, interval: float = 2.0, polls: int | None = None
) -> None:
    """Rewrites the page as the runs log, polling every `interval` seconds (`polls` times; None:
    until Ctrl-C); the page reloads itself in a browser about as often."""
    watcher = Watcher(sources, out, refresh=max(2, math.ceil(interval)))
    done = 0
    while polls is None or done < polls:
        path = watcher.poll()
        if path:
            print(f"report: {path} ({time.strftime('%H:%M:%S')})", flush=True)
        done += 1
        if polls is None or done < polls:
            time.sleep(interval)


def page_path(sources: list[Path], out: Path | None, logs: list[Path]) -> Path:
    """Where the page goes: `out`, or report.html inside it when it is a directory (as cp puts a
    file into a directory); by default the one run directory's report.html, else ./report.html.
    Never over a file the report reads (compared as files: a link to one counts)."""
    if out is None:
        one_dir = len(sources) == 1 and Path(sources[0]).is_dir()
        out = Path(sources[0]) / REPORT if one_dir else Path(REPORT)
    elif out.is_dir():
        out = out / REPORT
    if out.is_dir():
        raise ReportError(
            f"{out}: is a directory, so the report cannot be written there; name a file with --out"
        )
    notes = [Path(source) / RUN_NOTE for source in sources if Path(source).is_dir()]
    for read in [*logs, *notes]:
        if out.exists() and read.exists() and out.samefile(read):
            raise ReportError(
                f"{out}: the report would overwrite {read}, which it reads; "
                f"name another file with --out"
            )
    return out


def write_page(path: Path, page: str) -> None:
    """The page written atomically, as ASCII (character references for the rest), so that it reads
    the same whatever encoding this machine's locale writes files in."""
    try:
        write_atomically(path, page.encode("ascii", "xmlcharrefreplace").decode("ascii"))
    except OSError as error:
        raise ReportError(f"{path}: cannot write the report: {error}") from error


# =========================================================================== the rehearsal's memory


def memory_timeline_svg(
    events: list[tuple[str, str, int]],
    title: str,
    holders: int = 6,
    width: int = 720,
    height: int = 360,
) -> str:
    """Live memory over a rehearsal (rehearsal.PeakMemory.timeline): events (the phase running, what
    made the storage, bytes added or freed), in order. Drawn at the highest total of each of up to
    600 equal spans of events (so the peak is drawn), stacked by what holds it: the `holders`
    largest at the peak, then the rest; the phases as bands behind."""
    live, total, span, gib = {}, 0, math.ceil(len(events) / 600), 2**30
    samples, best = [(0, 0, {})], None  # (event index, total bytes, bytes by holder)
    for index, (_, origin, nbytes) in enumerate(events, 1):
        live[origin] = live.get(origin, 0) + nbytes
        total += nbytes
        if best is None or total > best[1]:
            best = (index, total, dict(live))
        if index % span == 0 or index == len(events):
            samples.append(best)
            best = None
    peak_at, peak, at_peak = max(samples, key=lambda sample: sample[1])
    if not peak:
        return svg("memory-timeline", width, height, [], title + ": nothing allocated", SVG_STYLE)
    top = sorted(at_peak, key=lambda origin: -at_peak[origin])[:holders]
    frame = Frame(
        [0.0, float(len(events))],
        [0.0, peak / gib],
        left=62,
        top=30,
        width=width - 80,
        # below: the x axis' ticks and title, then four rows of holders
        height=height - 130,
    )
    body = phase_bands(events, frame) + frame.axes("allocations and frees, in order", "live GiB")
    below = [0.0] * len(samples)
    for k, name in enumerate(top + ["everything else"]):
        above = [
            b + (held.get(name, 0) if k < len(top) else t - sum(held.get(n, 0) for n in top)) / gib
            for b, (_, t, held) in zip(below, samples)
        ]
        edge = [(frame.x(i), frame.y(v)) for (i, _, _), v in zip(samples, above)]
        base = [
            (frame.x(i), frame.y(v)) for (i, _, _), v in zip(reversed(samples), reversed(below))
        ]
        colour, x, y = (
            COLOURS[k] if k < len(top) else "#9ca3af",
            62 + (k % 2) * 330,
            height - 60 + 16 * (k // 2),
        )
        body += [
            tag(
                "polygon",
                f"<title>{text(name)}</title>",
                class_="holder",
                data_holder=name,
                fill=colour,
                fill_opacity=0.75,
                points=" ".join(f"{px},{py}" for px, py in edge + base),
            ),
            tag("rect", x=x, y=y, width=10, height=10, fill=colour),
            tag("text", text(name[:56]), x=x + 16, y=y + 9, class_="tick"),
        ]
        below = above
    y, phase = frame.y(peak / gib), text(events[peak_at - 1][0])
    body += [
        tag(
            "line",
            class_="peak",
            x1=62,
            x2=width - 18,
            y1=y,
            y2=y,
            stroke="#111",
            stroke_dasharray="4 3",
        ),
        tag(
            "text",
            f"peak {peak / gib:.3g} GiB, in the {phase}",
            x=width - 20,
            y=y + 14,
            class_="tick",
            text_anchor="end",
        ),
    ]
    return svg("memory-timeline", width, height, body, title, SVG_STYLE)


def phase_bands(events: list[tuple[str, str, int]], frame: Frame) -> list[str]:
    """Alternating shaded bands, one per stretch of events in one phase, named at the top."""
    out, start = ['<g class="phases">'], 0
    stretches = []
    for index in range(1, len(events) + 1):
        if index == len(events) or events[index][0] != events[start][0]:
            stretches.append((start, index, events[start][0]))
            start = index
    for k, (first, last, phase) in enumerate(stretches):
        x0, x1 = frame.x(first), frame.x(last)
        out.append(
            tag(
                "rect",
                f"<title>{text(phase)}</title>",
                x=x0,
                y=frame.top,
                width=round(x1 - x0, 2),
                height=frame.height,
                fill="#f3f4f6" if k % 2 else "#ffffff",
            )
        )
        if x1 - x0 > 40:  # room for a name
            out.append(
                tag(
                    "text",
                    text(phase[: int((x1 - x0) / 6)]),
                    x=round((x0 + x1) / 2, 2),
                    y=frame.top + 12,
                    class_="tick",
                    text_anchor="middle",
                )
            )
    return out + ["</g>"]


def write_memory_timeline(path: Path, events: list[tuple[str, str, int]], title: str) -> Path:
    """memory_timeline_svg as a file that a browser opens."""
    write_page(
        Path(path), '<?xml version="1.0" encoding="utf-8"?>\n' + memory_timeline_svg(events, title)
    )
    return Path(path)


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "sources",
        nargs="+",
        type=Path,
        help="run directories (checkpoint.dir/run_NNNN) or JSONL files",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="the HTML file, or a directory to write report.html into (default: "
        "RUN_DIR/report.html for one run directory, else ./report.html); "
        "never one of the files it reads",
    )
    parser.add_argument(
        "--watch",
        action="store_true",
        help="rewrite the page whenever the runs log more (until Ctrl-C); the page "
        "reloads itself in the browser",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=2.0,
        help="with --watch: seconds between looks at the files (default 2)",
    )
    args = parser.parse_args(argv)
    if not 0 < args.interval <= 3600:
        raise ReportError(
            f"--interval: expected seconds above 0 and at most 3600, got {args.interval:g}"
        )
    if args.watch:
        try:
            watch(args.sources, args.out, args.interval)
        except KeyboardInterrupt:
            print("stopped watching", flush=True)
        return None
    path = write_report(args.sources, args.out)
    print(f"report: {path}")
    return path


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as error:  # a ReportError, or a file that cannot be read
        sys.exit(f"error: {error}")
