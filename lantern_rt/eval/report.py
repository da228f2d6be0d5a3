"""What ``lantern bench`` writes: results.json, results.md and two PNG plots (drawn with Pillow)."""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from lantern_rt.fileio import write_together

Row = dict[str, Any]
Column = tuple[str, Callable[[Row], str]]

# --- text ----------------------------------------------------------------------------------


def fmt(value: float | None, spec: str = ".3f", suffix: str = "") -> str:
    """``value`` formatted, or an en dash for a missing value."""
    return "–" if value is None else f"{value:{spec}}{suffix}"


def params_text(params: dict[str, Any]) -> str:
    """``k=10 lambda=5 coupling=gumbel``: the method parameters other than the tree."""
    return " ".join(
        f"{k}={v}" if isinstance(v, str) else f"{k}={v:g}" for k, v in params.items() if k != "tree"
    )


def row_label(row: Row) -> str:
    """``lantern++ k=10 lambda=5 [naive_extend_57] / torch`` (`` B=16`` after a batch size above 1,
    `` x2`` after two or more decode streams)."""
    parts = [row["method"], params_text(row["params"]), f"[{row['tree']}]" if row["tree"] else ""]
    batch, streams = row.get("batch_size", 1), row.get("streams", 1)
    return (
        f"{' '.join(p for p in parts if p)} / {row['backend']}"
        + (f" B={batch}" if batch != 1 else "")
        + (f" x{streams}" if streams != 1 else "")
    )


def markdown_table(headers: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
    def line(values: Sequence[str]) -> str:
        return "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"

    return "\n".join([line(headers), line(["---"] * len(headers)), *(line(row) for row in cells)])


def table(columns: Sequence[Column], rows: Sequence[Row]) -> str:
    return markdown_table([h for h, _ in columns], [[get(r) for _, get in columns] for r in rows])


SPEED_COLUMNS: list[Column] = [
    ("method", lambda r: r["method"]),
    ("params", lambda r: params_text(r["params"])),
    ("tree", lambda r: r["tree"] or ""),
    ("backend", lambda r: r["backend"]),
    ("weights", lambda r: r.get("weight_precision") or "–"),
    ("B", lambda r: str(r.get("batch_size", 1))),
    ("streams", lambda r: str(r.get("streams", 1))),
    ("tau", lambda r: fmt(r["mean_accepted_length"], ".2f")),
    ("s/img", lambda r: fmt(r["seconds_per_image"], ".4f")),
    ("AR s/img", lambda r: fmt(r.get("ar_seconds_per_image"), ".4f")),
    ("speedup", lambda r: fmt(r["speedup_vs_ar"], ".2f", "x")),
    ("floor s/img", lambda r: fmt(r.get("floor_seconds_per_image"), ".4f")),
    ("meas/floor", lambda r: fmt(r.get("measured_over_floor"), ".2f", "x")),
    ("img/s", lambda r: fmt(r.get("images_per_second"), ".2f")),
    ("s/img p90", lambda r: fmt(r["seconds_per_image_p90"], ".4f")),
    ("FD", lambda r: fmt(r["fd_classifier"], ".3g")),
    ("FD vs AR", lambda r: fmt(r.get("fd_vs_ar"), ".3g")),
    ("class acc", lambda r: fmt(r["class_accuracy"])),
    ("precision", lambda r: fmt(r["precision"])),
    ("recall", lambda r: fmt(r["recall"])),
    ("peak MiB", lambda r: fmt(r["peak_memory_mb"], ".0f")),
]
CALIBRATION_COLUMNS: list[Column] = [
    ("reference", lambda r: r["name"]),
    ("images", lambda r: str(r["num_images"])),
    ("FD", lambda r: fmt(r["fd_classifier"], ".3g")),
    ("class acc", lambda r: fmt(r["class_accuracy"])),
    ("precision", lambda r: fmt(r["precision"])),
    ("recall", lambda r: fmt(r["recall"])),
    ("FD vs AR", lambda r: fmt(r["fd_vs_ar"], ".3g")),
    ("what", lambda r: r["description"]),
]
NOTES = """\
tau: tokens committed per target verify call over the run, bonus included. s/img: median seconds of \
the decode loop per image (p90 beside it; VQ decoding excluded), img/s its inverse; B: images decoded \
together per step (a call's decode time is shared by its images). weights: their precision as \
stored. AR s/img: the median of the AR row with the same backend, weights, B and streams, from this \
run; speedup: that over this row's. floor s/img: the memory floor, the bytes an image's calls must \
read over the copy loop's bandwidth (above); meas/floor: s/img over it (1.00x: at the memory bound). FD: Fréchet distance of classifier features to the \
Fashion-MNIST test images of the benchmarked classes (lower is better); FD vs AR: between this row's \
images and the AR row's (compare with the AR seed rows of the calibration: the noise between two AR \
runs); precision/recall: k=3 \
improved precision and recall. peak MiB: the process's peak resident memory when the row's last \
image was done; all pipelines share one process, so it bounds a row's memory rather than isolating it."""


def extractor_name(settings: dict[str, Any]) -> str:
    """``FD-classifier``, or ``FD-features(SPEC)`` for the user's ``--features`` extractor."""
    return f"FD-features({settings['features']})" if settings.get("features") else "FD-classifier"


def speed_table(rows: Sequence[Row]) -> str:
    return table(SPEED_COLUMNS, rows)


FLOOR_FORMULA = (
    "floor s/img = ((W_target x C_target + W_draft x C_draft) / B + KV x R x L x C_target) / bandwidth: "
    "W_target the target's weight bytes a call reads at the row's precision (embedding tables left out), "
    "W_draft the drafter's and its LM head's (0 without a drafter), C_target and C_draft the target and "
    "drafting calls per image (verify calls + the prefill; one drafting call a verify call), KV the K and "
    "V bytes of one cache entry over all layers, R cache rows per image (2 with CFG), L the prefix plus "
    "half the image tokens (lantern_rt/eval/memory_floor.py)"
)


def bandwidth_line(machine: dict[str, Any]) -> str:
    """The results header's line on the memory bandwidth the floors are taken at."""
    bw = machine.get("copy_bandwidth")
    if not bw:
        return "Memory bandwidth: not measured (no floors)."
    return (
        f"Memory bandwidth {bw['bytes_per_s'] / 1e9:.2f} GB/s: a copy loop, two arrays of "
        f"{bw['array_bytes'] / 2**20:.0f} MiB, {bw['threads']} thread(s), best of {bw['repeats']} "
        "(bytes read + written per second)."
    )


def results_markdown(results: dict[str, Any]) -> str:
    s, m = results["settings"], results["machine"]
    load = f"{m['load_average_start'][0]:.2f} -> {m['load_average_end'][0]:.2f}"
    sized = f" (the demo widened to {s['size']})" if s.get("size") else ""
    lines = [
        f"# lantern bench: {s['model']}{sized}",
        "",
        f"`{results['command']}`",
        "",
        f"{results['date']}; {m['platform']}, {m['cpu_count']} CPUs, torch {m['torch']} "
        f"({m['torch_threads']} threads), onnxruntime {m['onnxruntime']}; 1-minute load average {load}.",
        f"{len(s['classes'])} classes x {s['num_images_per_class']} image(s) per class and configuration, seed "
        f"{s['seed']}, {s['warmup']} warmup image(s) per configuration, CFG {s['sampling']['cfg_scale']:g}, "
        f"temperature {s['sampling']['temperature']:g}.",
        f"{bandwidth_line(m)} {FLOOR_FORMULA}.",
        "",
        "## Speed and quality",
        "",
        speed_table(results["rows"]),
        "",
        NOTES,
    ]
    if results["quality_note"]:
        lines += ["", f"No quality metrics: {results['quality_note']}."]
    else:
        real = s.get("reference") or "Fashion-MNIST"
        lines += [
            "",
            f"Feature extractor for FD, precision and recall: {extractor_name(s)}; real images: {real}.",
        ]
    lines += ["", "## Calibration", ""]
    lines.append(table(CALIBRATION_COLUMNS, results["calibration"]) if results["calibration"] else "None.")
    return "\n".join(lines) + "\n"


# --- charts --------------------------------------------------------------------------------

PALETTE = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
PLOT_W, PLOT_H = 640, 360
LEFT, TOP, RIGHT, BOTTOM = 90, 40, 30, 60
LEGEND_LINE = 20
GRID = "#dddddd"


def color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round, evenly spaced values (1, 2 or 5 times a power of ten) from <= lo to >= hi."""
    if not hi > lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(i * step, 12) for i in range(first, last + 1)]


def padded_ticks(values: Sequence[float]) -> list[float]:
    """Ticks spanning ``values`` with 5% of their range to spare on each side."""
    lo, hi = min(values), max(values)
    return nice_ticks(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))


def tick_label(value: float) -> str:
    return f"{value:g}"


def _text(
    draw: ImageDraw.ImageDraw, font: ImageFont.ImageFont, xy: tuple[float, float], text: str, at: str = "lt"
) -> None:
    """Draw ``text`` with its (l|m|r, t|m|b) point at ``xy`` (works with any Pillow font)."""
    x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font)
    fx, fy = {"l": 0.0, "m": 0.5, "r": 1.0}[at[0]], {"t": 0.0, "m": 0.5, "b": 1.0}[at[1]]
    draw.text((xy[0] - x0 - fx * (x1 - x0), xy[1] - y0 - fy * (y1 - y0)), text, fill="black", font=font)


def _vertical_text(
    image: Image.Image, font: ImageFont.ImageFont, centre: tuple[float, float], text: str
) -> None:
    x0, y0, x1, y1 = ImageDraw.Draw(image).textbbox((0, 0), text, font=font)
    label = Image.new("RGB", (x1 - x0 + 4, y1 - y0 + 4), "white")
    ImageDraw.Draw(label).text((2 - x0, 2 - y0), text, fill="black", font=font)
    label = label.rotate(90, expand=True)
    image.paste(label, (int(centre[0] - label.width / 2), int(centre[1] - label.height / 2)))


@dataclass
class Chart:
    """A plot area on an image, mapping data coordinates to pixels."""

    image: Image.Image
    draw: ImageDraw.ImageDraw
    font: ImageFont.ImageFont
    xlim: tuple[float, float]
    ylim: tuple[float, float]
    box: tuple[int, int, int, int] = (LEFT, TOP, LEFT + PLOT_W, TOP + PLOT_H)

    def px(self, x: float, y: float) -> tuple[float, float]:
        left, top, right, bottom = self.box
        fx = (x - self.xlim[0]) / (self.xlim[1] - self.xlim[0])
        fy = (y - self.ylim[0]) / (self.ylim[1] - self.ylim[0])
        return left + fx * (right - left), bottom - fy * (bottom - top)

    def message(self, text: str) -> None:
        left, top, right, bottom = self.box
        _text(self.draw, self.font, ((left + right) / 2, (top + bottom) / 2), textwrap.fill(text, 70), "mm")


def new_chart(
    title: str,
    labels: tuple[str, str],
    xticks: Sequence[tuple[float, str]],
    yticks: Sequence[float],
    legend: Sequence[tuple[str, str]],
    xlim: tuple[float, float] | None = None,
) -> Chart:
    """Axes with ticks, grid lines, a title, axis ``labels`` (x, y) and a legend below the plot."""
    font = ImageFont.load_default(size=13)
    legend_top = TOP + PLOT_H + BOTTOM
    image = Image.new("RGB", (LEFT + PLOT_W + RIGHT, legend_top + LEGEND_LINE * len(legend) + 10), "white")
    draw = ImageDraw.Draw(image)
    xs = [x for x, _ in xticks]
    chart = Chart(image, draw, font, xlim or (xs[0], xs[-1]), (yticks[0], yticks[-1]))
    left, top, right, bottom = chart.box
    for y in yticks:
        py = chart.px(chart.xlim[0], y)[1]
        draw.line([(left, py), (right, py)], fill=GRID)
        _text(draw, font, (left - 6, py), tick_label(y), "rm")
    for x, name in xticks:
        px = chart.px(x, chart.ylim[0])[0]
        draw.line([(px, bottom), (px, bottom + 5)], fill="black")
        _text(draw, font, (px, bottom + 8), name, "mt")
    draw.rectangle(chart.box, outline="black")
    _text(draw, font, (image.width / 2, TOP / 2), title, "mm")
    _text(draw, font, ((left + right) / 2, bottom + 32), labels[0], "mt")
    _vertical_text(image, font, (16, (top + bottom) / 2), labels[1])
    for i, (label, fill) in enumerate(legend):
        y = legend_top + i * LEGEND_LINE
        draw.rectangle([left, y + 3, left + 12, y + 15], fill=fill)
        _text(draw, font, (left + 20, y + 9), label, "lm")
    return chart


def quality_vs_speedup(rows: Sequence[Row], note: str | None, user_features: bool = False) -> Image.Image:
    """FD against speedup vs AR, one numbered point per row (``user_features``: FD is on ``--features``)."""
    points = [
        (i, r["speedup_vs_ar"], r["fd_classifier"])
        for i, r in enumerate(rows)
        if r["fd_classifier"] is not None
    ]
    xticks = padded_ticks([r["speedup_vs_ar"] for r in rows] + [1.0])
    yticks = padded_ticks([y for *_, y in points] or [0.0])
    chart = new_chart(
        "Quality against speed (lower FD is better)",
        (
            "speedup vs AR on the same backend",
            "FD (--features)" if user_features else "FD (classifier features)",
        ),
        [(x, tick_label(x)) for x in xticks],
        yticks,
        [(f"{i + 1}: {row_label(r)}", color(i)) for i, r in enumerate(rows)],
    )
    chart.draw.line([chart.px(1.0, yticks[0]), chart.px(1.0, yticks[-1])], fill="#999999")
    for i, x, y in points:
        px, py = chart.px(x, y)
        chart.draw.ellipse([px - 5, py - 5, px + 5, py + 5], fill=color(i), outline="black")
        _text(chart.draw, chart.font, (px + 7, py - 5), str(i + 1), "lb")
    if not points:
        chart.message(f"No FD to plot: {note}")
    return chart.image


def length_fractions(histogram: dict[str, int], longest: int) -> list[float]:
    """Fraction of verify calls that committed 1..``longest`` tokens."""
    calls = sum(histogram.values()) or 1
    return [histogram.get(str(n), 0) / calls for n in range(1, longest + 1)]


def accepted_lengths(rows: Sequence[Row]) -> Image.Image:
    """Grouped bars: per accepted length, the fraction of verify calls of each speculative row."""
    spec = [(i, r) for i, r in enumerate(rows) if r["method"] != "ar"]
    longest = max((int(n) for _, r in spec for n in r["accepted_length_histogram"]), default=1)
    fractions = [(i, length_fractions(r["accepted_length_histogram"], longest)) for i, r in spec]
    chart = new_chart(
        "Tokens committed per verify call",
        ("accepted length (bonus token included)", "fraction of verify calls"),
        [(n, str(n)) for n in range(1, longest + 1)],
        nice_ticks(0.0, max((f for _, fs in fractions for f in fs), default=1.0)),
        [(row_label(r), color(i)) for i, r in spec],
        xlim=(0.5, longest + 0.5),
    )
    width = 0.8 / max(1, len(spec))
    for j, (i, fs) in enumerate(fractions):
        for n, f in enumerate(fs, start=1):
            x0 = n - 0.4 + j * width
            (left, top), (right, bottom) = chart.px(x0, f), chart.px(x0 + width, 0.0)
            chart.draw.rectangle([left, top, right, bottom], fill=color(i))
    if not spec:
        chart.message("No speculative rows.")
    return chart.image


def write_report(out: Path, results: dict[str, Any]) -> None:
    """results.json, results.md, quality_vs_speedup.png and accepted_lengths.png in ``out``."""
    rows = results["rows"]
    plots = {
        "quality_vs_speedup.png": quality_vs_speedup(
            rows, results["quality_note"], bool(results["settings"].get("features"))
        ),
        "accepted_lengths.png": accepted_lengths(rows),
    }
    body, table = json.dumps(results, indent=2) + "\n", results_markdown(results)
    write_together(  # all four or none
        {
            out / "results.json": lambda p: p.write_text(body),
            out / "results.md": lambda p: p.write_text(table),
            **{
                out / name: lambda p, image=image: image.save(p, format="PNG")
                for name, image in plots.items()
            },
        }
    )
