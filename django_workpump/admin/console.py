"""The operator console in the admin (docs/console.md): an overview with charts of the
last hour or day, a page per topic and per instance, each refreshing itself.

Every page reads the console's per-minute series (``db.console``; written by the work
tables' counting trigger and the maintenance worker's sample) plus, on the topic and
instance pages, a bounded read of the work tables (failure reasons, rows in flight) and,
on the topic page, the flow rules that hold the topic back (its own, its category's).
A page asked for with ``?fragment=1`` returns its live part alone: the page's small
inline script fetches that every few seconds and swaps it in, so the charts move
without a reload, with no third-party script and nothing fetched from elsewhere.

Who may see them: whoever may see the summary (view permission on the four work models
and on instances, ``can_view_summary``).
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.http import urlencode

from django_workpump import categories, db
from django_workpump.admin import console_data as data
from django_workpump.admin import display
from django_workpump.admin.base import pump_database
from django_workpump.admin.console_charts import OUTCOME_COLOURS, Line, line_chart
from django_workpump.admin.perms import can_view_summary
from django_workpump.db import console as series
from django_workpump.models import FlowRule
from django_workpump.storable import error_headline

# How often a page fetches its live part again.
REFRESH_SECONDS = 5
# Lines drawn per chart of topics or instances (the busiest); the tables list the rest.
MAX_LINES = 8
# Topics listed in the overview's table.
MAX_TOPICS = 50


def console_urls(model_admin: admin.ModelAdmin) -> list[URLPattern]:
    """The console's URLs, under the instances' admin (next to the summary)."""
    site = model_admin.admin_site

    def view(function: Any) -> Any:
        def wrapped(request: HttpRequest, **kwargs: Any) -> HttpResponse:
            if not can_view_summary(site, request):
                raise PermissionDenied
            request.current_app = site.name
            with db.without_jit(using=pump_database()):
                context = function(request, **kwargs)
            context.update(site.each_context(request))
            context["opts"] = model_admin.model._meta
            context["app_label"] = model_admin.model._meta.app_label
            context["refresh_seconds"] = REFRESH_SECONDS
            rules_admin = site._registry.get(FlowRule)
            context["can_view_rules"] = bool(
                rules_admin and rules_admin.has_view_permission(request)
            )
            template = (
                context["live_template"]
                if request.GET.get("fragment")
                else ("admin/workpump/console.html")
            )
            return TemplateResponse(request, template, context)  # never cached: admin_view

        return site.admin_view(wrapped)

    return [
        path("console/", view(overview), name="workpump_console"),
        path("console/topic/", view(topic_page), name="workpump_console_topic"),
        path(
            "console/instance/<uuid:instance_id>/",
            view(instance_page),
            name="workpump_console_instance",
        ),
    ]


# -- links


def topic_url(category: str, topic: str, window: str) -> str:
    query = urlencode({"category": category, "topic": topic, "window": window})
    return f"{reverse('admin:workpump_console_topic')}?{query}"


def instance_url(instance_id: Any, window: str) -> str:
    url = reverse("admin:workpump_console_instance", args=[instance_id])
    return f"{url}?{urlencode({'window': window})}"


def rows_url(category: str, **filters: str) -> str:
    """The changelist of a category, filtered (``topic=``, ``state=``, ``owner=``)."""
    spec = categories.category(category)
    url = reverse(f"admin:workpump_{spec.model.lower()}_changelist")
    return f"{url}?{urlencode(filters)}" if filters else url


def row_url(category: str, seq: int) -> str:
    spec = categories.category(category)
    return reverse(f"admin:workpump_{spec.model.lower()}_change", args=[seq])


# -- shared pieces


def _window(request: HttpRequest) -> tuple[str, data.Grid]:
    window = data.window_name(request.GET.get("window"))
    clock = series.console_clock(using=pump_database())
    return window, data.grid(window, clock["minute"])


def _windows(request: HttpRequest, window: str) -> list[dict[str, Any]]:
    links = []
    for name in data.WINDOWS:
        query = request.GET.copy()
        query["window"] = name
        query.pop("fragment", None)
        links.append({"name": name, "url": f"?{query.urlencode()}", "current": name == window})
    return links


def _outcome_chart(
    chart_id: str, title: str, g: data.Grid, rows: list[dict[str, Any]], outcomes: tuple[str, ...]
) -> Any:
    rates = data.rates(rows, g, keys=outcomes)
    lines = [Line(o, rates[o], colour=OUTCOME_COLOURS.get(o)) for o in outcomes]
    return line_chart(chart_id, title, g.points, lines, unit="/min")


def _latency_chart(chart_id: str, g: data.Grid, **filters: Any) -> Any:
    using = pump_database()
    bounds = series.console_clock(using=using)["bounds"]
    rows = series.console_latency(g.since, g.until, step=g.step, using=using, **filters)
    quantiles = data.latency_quantiles(rows, g, bounds)
    lines = [Line("p50", quantiles[0.5]), Line("p95", quantiles[0.95], colour="#c23030")]
    return line_chart(chart_id, "Pickup latency (seconds, from due to claimed)", g.points, lines)


def _backlog_charts(g: data.Grid, **filters: Any) -> list[Any]:
    rows = series.console_backlog(g.since, g.until, step=g.step, using=pump_database(), **filters)
    waiting = data.backlog(rows, g)
    return [
        line_chart(
            "backlog",
            "Backlog (pending + scheduled)",
            g.points,
            [Line("pending + scheduled", waiting["waiting"]), Line("pending", waiting["pending"])],
        ),
        line_chart(
            "oldest",
            "Oldest pending row (age, seconds)",
            g.points,
            [Line("oldest pending", waiting["oldest"], colour="#c23030")],
            unit="s",
        ),
    ]


# -- pages


def overview(request: HttpRequest) -> dict[str, Any]:
    window, g = _window(request)
    using = pump_database()
    hour, day = data.grid("hour", g.until), data.grid("day", g.until)
    charts = [
        _outcome_chart(
            "throughput-hour",
            "Throughput, last hour (per minute)",
            hour,
            series.console_outcomes(hour.since, hour.until, step=hour.step, using=using),
            data.OUTCOMES,
        ),
        _outcome_chart(
            "throughput-day",
            "Throughput, last day (per minute, 10-minute means)",
            day,
            series.console_outcomes(day.since, day.until, step=day.step, using=using),
            data.OUTCOMES,
        ),
    ]
    topics = series.console_topics(g.since, g.until, step=g.step, limit=MAX_TOPICS, using=using)
    for t in topics:
        t["url"] = topic_url(t["category"], t["topic"], window)
        t["rows_url"] = rows_url(t["category"], topic=t["topic"])
    busiest = topics[:MAX_LINES]
    # the dead chart draws the topics with the most dead rows, busy or not
    dying = sorted((t for t in topics if t["dead"]), key=lambda t: -t["dead"])[:MAX_LINES]
    drawn = list(dict.fromkeys((t["category"], t["topic"]) for t in (*busiest, *dying)))
    per_topic = series.console_topic_outcomes(g.since, g.until, drawn, step=g.step, using=using)
    of_topic: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in per_topic:
        of_topic.setdefault((r["category"], r["topic"]), []).append(r)
    for outcome, title, shown_topics in (
        ("done", "Done per topic", busiest),
        ("failed", "Failed (to retry) per topic", busiest),
        ("dead", "Dead per topic", dying),
    ):
        lines = []
        for t in shown_topics:
            rows = of_topic.get((t["category"], t["topic"]), [])
            rate = data.rates(rows, g, keys=(outcome,))[outcome]
            lines.append(Line(f"{t['topic']} ({t['category']})", rate, href=t["url"]))
        charts.append(
            line_chart(
                f"topics-{outcome}",
                f"{title} (per minute)",
                g.points,
                lines,
                empty=f"No topic has {outcome} rows in the last {window}.",
            )
        )
    charts.append(_latency_chart("latency", g))
    charts.extend(_backlog_charts(g))
    samples = series.console_instances(g.since, g.until, step=g.step, using=using)
    totals, instances = data.instances(samples, g)
    charts.append(
        line_chart(
            "instances",
            "Instances alive and rows in flight",
            g.points,
            [Line("alive", totals["alive"]), Line("in flight", totals["in flight"])],
        )
    )
    shown = sorted(instances, key=lambda i: -(i.latest_in_flight or 0))[:MAX_LINES]
    for each in instances:
        each.url = instance_url(each.instance_id, window)
        each.age = display.duration(each.latest_age) if each.latest_age is not None else "-"
    charts.append(
        line_chart(
            "heartbeats",
            "Heartbeat age per instance (seconds)",
            g.points,
            [Line(i.label, i.heartbeat_age, href=i.url) for i in shown],
            unit="s",
        )
    )
    return {
        "title": "Work pump console",
        "window": window,
        "windows": _windows(request, window),
        "charts": charts,
        "topics": topics,
        "instances": instances,
        "live_template": "admin/workpump/console_overview.html",
        "taken_at": g.until,
    }


def topic_page(request: HttpRequest) -> dict[str, Any]:
    category, topic = request.GET.get("category", ""), request.GET.get("topic")
    if category not in categories.NAMES or topic is None:
        raise Http404("The console's topic page needs ?category= (one of the four) and ?topic=.")
    window, g = _window(request)
    using = pump_database()
    rows = series.console_outcomes(
        g.since, g.until, step=g.step, category=category, topic=topic, using=using
    )
    outcomes = ("claimed", *data.OUTCOMES)
    charts = [
        _outcome_chart("outcomes", "Claimed, done, failed, dead (per minute)", g, rows, outcomes),
        _latency_chart("latency", g, category=category, topic=topic),
        *_backlog_charts(g, category=category, topic=topic),
    ]
    failures = series.console_failures(category, topic, using=using)
    for f in failures:
        f["headline"] = error_headline(f["last_error"])
    flow_rules = db.flow_rule_status(category=category, topic=topic, using=using)
    held_back = db.flow_reason(
        category=category, topic=topic, concurrency_key="", fairness_key="", using=using
    )
    window_totals = data.totals(rows)
    minutes = g.minutes
    return {
        "title": f"Topic {topic} ({category})",
        "window": window,
        "windows": _windows(request, window),
        "charts": charts,
        "category": category,
        "topic": topic,
        "totals": [
            {"outcome": o, "n": window_totals.get(o, 0), "rate": window_totals.get(o, 0) / minutes}
            for o in (*outcomes, "released", "orphaned", "expired", "cancelled", "discarded")
        ],
        "failures": failures,
        "flow_rules": [
            {"rule": r, "url": reverse("admin:workpump_flowrule_change", args=[r.id])}
            for r in flow_rules
        ],
        "held_back": held_back,
        "flow_rules_url": reverse("admin:workpump_flowrule_changelist"),
        "rows_url": rows_url(category, topic=topic),
        "waiting_url": rows_url(category, topic=topic, state="pending"),
        "dead_url": rows_url(category, topic=topic, state="dead"),
        "live_template": "admin/workpump/console_topic.html",
        "taken_at": g.until,
    }


def instance_page(request: HttpRequest, instance_id: UUID) -> dict[str, Any]:
    window, g = _window(request)
    using = pump_database()
    rows = series.console_outcomes(
        g.since, g.until, step=g.step, instance_id=instance_id, using=using
    )
    outcomes = ("claimed", "done", "failed", "renewed")
    samples = series.console_instances(g.since, g.until, instance_id=instance_id, using=using)
    charts = [
        _outcome_chart("outcomes", "Claims, completions, failures, renewals", g, rows, outcomes),
        _latency_chart("latency", g, instance_id=instance_id),
    ]
    label = str(instance_id)
    if samples:
        _, each = data.instances(samples, g)
        label = each[0].label
        charts.append(
            line_chart(
                "heartbeat",
                "Heartbeat age (seconds) and rows in flight",
                g.points,
                [
                    Line("heartbeat age", each[0].heartbeat_age, colour="#c23030"),
                    Line("in flight", each[0].in_flight),
                ],
            )
        )
    in_flight = series.console_in_flight(instance_id, using=using)
    for r in in_flight:
        r["url"] = row_url(r["category"], r["seq"])
        r["claimed"] = display.when(r["claimed_at"])
        r["expires"] = display.when(r["lease_expiry"])
    window_totals = data.totals(rows)
    return {
        "title": f"Instance {label}",
        "window": window,
        "windows": _windows(request, window),
        "charts": charts,
        "instance_id": instance_id,
        "totals": [
            {"outcome": o, "n": window_totals.get(o, 0)}
            for o in (*outcomes, "dead", "released", "orphaned", "expired")
        ],
        "in_flight": in_flight,
        "heartbeats": [
            {
                "minute": s["minute"],
                "age": s["heartbeat_age_seconds"],
                "alive": s["alive"],
                "in_flight": s["in_flight"],
            }
            for s in samples[-15:]
        ],
        "owner_url": {c: rows_url(c, owner=str(instance_id)) for c in categories.NAMES},
        "live_template": "admin/workpump/console_instance.html",
        "taken_at": g.until,
    }
