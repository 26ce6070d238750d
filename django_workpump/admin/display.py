"""Formatting of the admin's columns: ages, lease times, state badges, heartbeat colours.

Only formatting happens here: every number comes from an annotation the database
computed (ages in seconds at the database clock).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from django_workpump.conf import get_settings
from django_workpump.payloads import MAX_DEPTH, StoredJSON, UndecodablePayload, decode
from django_workpump.states import WorkState

DASH = "—"

# Colours of the state badges and the heartbeat freshness (readable on white and dark).
STATE_COLOURS: dict[str, str] = {
    WorkState.PENDING: "#4a6785",
    WorkState.SCHEDULED: "#7a6a1f",
    WorkState.LEASED: "#2e7d32",
    WorkState.ORPHANED: "#c2410c",
    WorkState.DONE: "#6b7280",
    WorkState.DEAD: "#b91c1c",
    WorkState.CANCELLED: "#6b21a8",
    WorkState.DISCARDED: "#57534e",
}
FRESHNESS_COLOURS = {"fresh": "#2e7d32", "stale": "#c2410c", "dead": "#b91c1c"}


def duration(seconds: float) -> str:
    """``4m 12s``, ``3m``, ``45s``, ``1h 2m``, ``2d 3h``: the largest unit and the next one;
    ``forever`` for an infinite time (written through SQL)."""
    if not math.isfinite(seconds):
        return "forever"
    total = int(abs(seconds))
    units = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
    for index, (unit, size) in enumerate(units):
        if total >= size or unit == "s":
            first, rest = divmod(total, size)
            text = f"{first}{unit}"
            if unit != "s":
                next_unit, next_size = units[index + 1]
                second = rest // next_size
                if second:  # "3m", not "3m 0s"
                    text += f" {second}{next_unit}"
            return text
    raise AssertionError("unreachable: the loop returns at seconds")


def relative(seconds_left: float) -> str:
    """``in 4m 12s`` for a time ahead, ``expired 3m ago`` for one that has passed."""
    if seconds_left > 0:
        return f"in {duration(seconds_left)}"
    return f"expired {duration(seconds_left)} ago"


def when(value: datetime | str | None) -> str:
    """An absolute time in the current time zone, to the second; a stored time Python
    cannot hold (``StoredTime``) as stored."""
    if value is None:
        return DASH
    if isinstance(value, str):
        return value
    return timezone.localtime(value).strftime("%Y-%m-%d %H:%M:%S")


def stale_after(alive_lock_held: bool) -> float:
    """Seconds after which an instance's heartbeat is late for its own cadence.

    Without its alive-lock (or with no lock source) an instance beats on the fast cadence
    and is late past ``STALE_AFTER_SECONDS``. Holding it, it beats on the slow cadence:
    it is late only when it overran that cadence by the margin the fast cadence is given
    (``STALE_AFTER_SECONDS`` minus one fast interval).
    """
    settings = get_settings()
    stale = float(settings["STALE_AFTER_SECONDS"])
    if not alive_lock_held or settings["LIVENESS_SOURCE_MODE"] == "heartbeat_table_only":
        return stale
    margin = stale - settings["HEARTBEAT_INTERVAL_SECONDS"]
    return max(stale, settings["HEARTBEAT_SLOW_INTERVAL_SECONDS"] + margin)


def freshness(age_seconds: float, alive_lock_held: bool = False) -> str:
    """fresh, stale (late for its cadence) or dead (past the definitive-dead cutoff)."""
    if age_seconds >= get_settings()["DEFINITIVELY_DEAD_AFTER_SECONDS"]:
        return "dead"
    return "fresh" if age_seconds < stale_after(alive_lock_held) else "stale"


def heartbeat(age_seconds: float | None, alive_lock_held: bool = False) -> SafeString | str:
    """The heartbeat age, coloured fresh/stale/dead for the instance's cadence (slow while
    it holds its alive-lock), with the word for screen readers."""
    if age_seconds is None:
        return DASH
    kind = freshness(age_seconds, alive_lock_held)
    return format_html(
        '<span class="wp-heartbeat wp-{}" style="color:{};font-weight:bold" title="{}">'
        "{} ago</span>",
        kind,
        FRESHNESS_COLOURS[kind],
        f"heartbeat {kind}",
        duration(age_seconds),
    )


def badge(state: str, note: str = "") -> SafeString:
    """A coloured state label; ``note`` (e.g. ``stuck``) follows it."""
    colour = STATE_COLOURS.get(state, "#333")
    html = format_html(
        '<span class="wp-state wp-state-{}" data-state="{}" '
        'style="color:#fff;background:{};padding:1px 6px;border-radius:8px;white-space:nowrap">'
        "{}</span>",
        state,
        state,
        colour,
        state,
    )
    if note:
        html = format_html(
            '{} <span class="wp-note" style="color:#c2410c;font-weight:bold">{}</span>', html, note
        )
    return html


# At most this many characters of a stored text the page cannot decode are shown.
RAW_TEXT_LIMIT = 10_000


def pretty_json(value: Any) -> SafeString:
    """A JSON value indented in a ``<pre>`` block; a value Python cannot decode or indent
    (``StoredJSON``, or nested deeper than producers allow) as its stored text."""
    if isinstance(value, StoredJSON):
        return raw_json(value, value.error, "value")
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = decode(value, max_depth=MAX_DEPTH)
    try:
        # Compact first (the C encoder): the indenting one recurses in Python per level.
        text = json.dumps(value, default=str)
    except (ValueError, RecursionError) as exc:
        return raw_json(repr(value)[:RAW_TEXT_LIMIT], str(exc), "value")
    return payload(text, "value")


def payload(text: str, what: str = "payload") -> SafeString:
    """A stored JSON text (a payload, a result) indented, or as stored when Python cannot
    decode it."""
    try:
        # No deeper than producers allow: the indenting encoder recurses per level.
        value = decode(text, max_depth=MAX_DEPTH)
    except UndecodablePayload as exc:
        return raw_json(text, str(exc), what)
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)
    return format_html('<pre class="wp-json" style="margin:0;white-space:pre-wrap">{}</pre>', text)


def raw_json(text: str, error: str, what: str) -> SafeString:
    """A stored JSON text shown as stored (its first RAW_TEXT_LIMIT characters)."""
    cut = len(text) > RAW_TEXT_LIMIT
    return format_html(
        '<p class="wp-undecodable">Shown as stored: this {} cannot be decoded ({}).{}</p>'
        '<pre class="wp-json wp-raw" style="margin:0;white-space:pre-wrap;'
        'word-break:break-all">{}</pre>',
        what,
        error,
        f" Its first {RAW_TEXT_LIMIT:,} characters:" if cut else "",
        text[:RAW_TEXT_LIMIT] + ("…" if cut else ""),
    )


LEVEL_NAMES = {0: "NOTE", 10: "DEBUG", 20: "INFO", 30: "WARNING", 40: "ERROR", 50: "CRITICAL"}


def attempt_logs(records: Iterable[Any]) -> SafeString | str:
    """A row's attempt logs (``AttemptLog``s, the latest attempt first) as a table."""
    body = format_html_join(
        "",
        "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
        (
            (
                r.attempt,
                when(r.logged_at),
                LEVEL_NAMES.get(r.level, str(r.level)),
                r.logger,
                pre(r.message),
            )
            for r in records
        ),
    )
    if not body:
        return "— (none: its handler logged nothing at ATTEMPT_LOG_LEVEL or above)"
    return format_html(
        '<table class="wp-attempt-logs"><thead><tr><th>attempt</th><th>logged</th>'
        "<th>level</th><th>logger</th><th>message</th></tr></thead><tbody>{}</tbody></table>",
        body,
    )


def pre(text: str | None) -> SafeString | str:
    """Multi-line text (a traceback) kept as it is."""
    if not text:
        return DASH
    return format_html('<pre class="wp-error" style="margin:0;white-space:pre-wrap">{}</pre>', text)
