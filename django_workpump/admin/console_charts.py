"""Server-rendered SVG line charts for the admin console (docs/console.md).

Plain SVG strings built here: no chart library to vendor or keep up to date, nothing
fetched from a CDN, pages that work offline and in any browser the admin supports, and
charts a test can read in Python (each line's points are in its ``points`` attribute).
The price is no hover tooltips: each line's latest value is printed in the legend, and
the numbers are in the tables beside the charts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

# Distinct on light and dark admin themes; a line past the palette reuses its colours.
PALETTE = (
    "#2b7bb9",  # blue
    "#d9822b",  # orange
    "#c23030",  # red
    "#2e8540",  # green
    "#7a4fb5",  # purple
    "#8a6d3b",  # brown
    "#c2458c",  # pink
    "#5c7080",  # grey
)
# Fixed colours for the outcomes, so every chart reads the same.
OUTCOME_COLOURS = {
    "done": "#2e8540",
    "failed": "#d9822b",
    "dead": "#c23030",
    "claimed": "#2b7bb9",
    "renewed": "#7a4fb5",
}

WIDTH, HEIGHT = 560, 170
LEFT, RIGHT, TOP, BOTTOM = 52, 10, 10, 22


@dataclass(frozen=True)
class Line:
    """One series of a chart: a value (or None: no data) per point of the x axis."""

    name: str
    values: Sequence[float | None]
    colour: str | None = None
    href: str | None = None  # the legend entry links here (a topic or instance page)


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^k at or above ``value`` (1 for nothing)."""
    if value <= 0 or not math.isfinite(value):
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * power:
            return float(step * power)
    return float(10 * power)


def number(value: float | None, unit: str = "") -> str:
    """A short label: 1234 -> 1.2k, 0.25 -> 0.25; None -> "-"."""
    if value is None:
        return "-"
    magnitude = abs(value)
    if magnitude >= 1_000_000:
        text = f"{value / 1_000_000:.1f}M"
    elif magnitude >= 1_000:
        text = f"{value / 1_000:.1f}k"
    elif magnitude >= 10 or value == int(value):
        text = f"{value:.0f}"
    else:
        text = f"{value:.2g}"
    return f"{text}{unit}"


def _segments(values: Sequence[float | None]) -> list[list[tuple[int, float]]]:
    """Runs of consecutive points that have a value (a gap breaks the line)."""
    runs: list[list[tuple[int, float]]] = []
    current: list[tuple[int, float]] = []
    for i, value in enumerate(values):
        if value is None or not math.isfinite(value):
            if current:
                runs.append(current)
            current = []
        else:
            current.append((i, value))
    if current:
        runs.append(current)
    return runs


def _label_time(minute: datetime) -> str:
    return (
        timezone.localtime(minute).strftime("%H:%M")
        if timezone.is_aware(minute)
        else (minute.strftime("%H:%M"))
    )


def line_chart(
    chart_id: str,
    title: str,
    minutes: Sequence[datetime],
    lines: Sequence[Line],
    *,
    unit: str = "",
    empty: str = "",
) -> SafeString:
    """A ``<figure>``: the SVG chart of ``lines`` over ``minutes`` and its legend (or, with
    no line, the ``empty`` note)."""
    count = len(minutes)
    peak = max((v for line in lines for v in line.values if v is not None), default=0.0)
    top = nice_ceiling(peak)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(i: int) -> float:
        return LEFT + (plot_w * i / (count - 1) if count > 1 else plot_w / 2)

    def y(value: float) -> float:
        return TOP + plot_h * (1 - min(max(value, 0.0), top) / top)

    parts: list[str] = []
    for fraction in (0.0, 0.5, 1.0):
        level = y(top * fraction)
        parts.append(
            format_html(
                '<line class="wp-grid" x1="{}" y1="{}" x2="{}" y2="{}"/>'
                '<text class="wp-axis" x="{}" y="{}" text-anchor="end">{}</text>',
                LEFT,
                f"{level:.1f}",
                WIDTH - RIGHT,
                f"{level:.1f}",
                LEFT - 4,
                f"{level + 4:.1f}",
                number(top * fraction, unit),
            )
        )
    if count:
        for i, anchor in ((0, "start"), (count // 2, "middle"), (count - 1, "end")):
            parts.append(
                format_html(
                    '<text class="wp-axis" x="{}" y="{}" text-anchor="{}">{}</text>',
                    f"{x(i):.1f}",
                    HEIGHT - 6,
                    anchor,
                    _label_time(minutes[i]),
                )
            )
    for n, line in enumerate(lines):
        colour = line.colour or PALETTE[n % len(PALETTE)]
        for run in _segments(line.values):
            points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in run)
            if len(run) == 1:
                ((i, v),) = run
                parts.append(
                    format_html(
                        '<circle class="wp-point" data-series="{}" cx="{}" cy="{}" '
                        'r="2.5" fill="{}"><title>{}</title></circle>',
                        line.name,
                        f"{x(i):.1f}",
                        f"{y(v):.1f}",
                        colour,
                        line.name,
                    )
                )
            else:
                parts.append(
                    format_html(
                        '<polyline class="wp-line" data-series="{}" points="{}" fill="none" '
                        'stroke="{}" stroke-width="1.8"><title>{}</title></polyline>',
                        line.name,
                        points,
                        colour,
                        line.name,
                    )
                )
    svg = format_html(
        '<svg class="wp-svg" viewBox="0 0 {} {}" width="100%" role="img" aria-label="{}" '
        'preserveAspectRatio="xMidYMid meet">{}</svg>',
        WIDTH,
        HEIGHT,
        title,
        mark_safe("".join(parts)),  # every part was built by format_html
    )
    legend = format_html_join(
        "",
        '<li><span class="wp-swatch" style="background:{}"></span>{} <span class="wp-latest">'
        "{}</span></li>",
        (
            (
                line.colour or PALETTE[n % len(PALETTE)],
                format_html('<a href="{}">{}</a>', line.href, line.name)
                if line.href
                else line.name,
                number(_latest(line.values), unit),
            )
            for n, line in enumerate(lines)
        ),
    )
    if not lines and empty:
        legend = format_html('<li class="wp-empty">{}</li>', empty)
    return format_html(
        '<figure class="wp-chart" id="wp-chart-{}" data-chart="{}" data-lines="{}" '
        'data-points="{}" data-peak="{}"><figcaption>{}</figcaption>{}<ul class="wp-legend">'
        "{}</ul></figure>",
        chart_id,
        chart_id,
        len(lines),
        count,
        number(peak),
        title,
        svg,
        legend,
    )


def _latest(values: Sequence[float | None]) -> float | None:
    for value in reversed(values):
        if value is not None:
            return value
    return None
