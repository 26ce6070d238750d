"""Admin pages, the console and ``workpump_status --json`` at 10k, 1M and 10M outbox rows.

For each size the outbox is rebuilt with set-based SQL (``generate_series``; no ORM):
90 % processed, then dead, waiting for a retry, past half their attempts, leased by a
live instance, leased by a gone one, orphaned, and the newest 7.5 % pending; then
VACUUM ANALYZE. Done, dead-lettered and scheduled times come in batches of 100 rows
10 ms apart, as outcomes written one batch per statement do. Each page is fetched by
Django's test client logged in as a superuser, once to warm up and then ``--repeat``
times; the median is reported, and each size's median divided by the smallest size's
(the target is <= 3x at 1M). The console's pages read 7 days of series for 200 topics
(built once, before the sizes); the payload searches look for the newest row's payload.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/workpump_adminbench \\
        python bench/admin_pages.py --sizes 10000 1000000

With ``--record`` the figures become the admin pages section of bench/results/full.json
(keys ``admin_console_overview_ms`` and, with a 10,000,000-row size,
``admin_console_overview_10m_ms``) and docs/benchmark-results.md is rendered from it.

The database named by DATABASE_URL is created if missing and its workpump tables are
emptied: never point it at a database whose rows matter.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

# Share of each kind of row, in insert order (so seq order): the newest are pending.
MIX = [
    ("processed", 0.90),
    ("dead", 0.005),
    ("retry_wait", 0.005),
    ("attempts_high", 0.002),
    ("leased_live", 0.005),
    ("leased_gone", 0.001),
    ("orphaned", 0.007),
    ("pending", 0.075),
]
INSERT_SQL = """
INSERT INTO workpump_outbox (work_id, topic, payload, attempts, max_attempts,
                             done_at, dead_lettered_at, instance_id, lease_expiry,
                             claimed_at, scheduled_for, created_at, last_error)
SELECT gen_random_uuid(), 'bench.topic.' || (g %% 20), jsonb_build_object('i', g),
       %(attempts)s, 10, %(done_at)s::timestamptz - s.batch,
       %(dead_lettered_at)s::timestamptz - s.batch, %(instance_id)s::uuid,
       %(lease_expiry)s, %(claimed_at)s, %(scheduled_for)s::timestamptz - s.batch,
       now() - make_interval(secs => %(n)s - g), %(last_error)s
FROM generate_series(1, %(n)s) g
-- Rows done, dead-lettered or scheduled together share a time, 100 at a time (as a
-- batch of outcomes written by one statement does), each batch 10 ms after the last.
CROSS JOIN LATERAL (SELECT make_interval(secs => (%(n)s - g) / 100 * 0.01) AS batch) s
"""
HOUR = "1 hour"
TOPIC = {"topic": "bench.topic.3"}
DETAIL = "detail"  # the change page of the newest pending row, found after each build
# The newest row's payload and topic, found after each build: a payload search narrowed
# by the default time window, and one narrowed by its topic alone.
PAYLOAD, NEWEST_TOPIC = "payload", {"topic": "newest"}
CONSOLE = "/admin/workpump/serviceinstance/console/"
# The console's series: SERIES_DAYS of minutes for SERIES_TOPICS topics on two instances,
# every topic claimed and done each minute, failing one minute in ten (the counters); then
# folded into the rollup and the totals by the sampler's own function, 6 hours a call, as
# a pump catching up would.
SERIES_TOPICS, SERIES_DAYS = 200, 7
SERIES_SQL = [
    """
INSERT INTO workpump_console_count (minute, category, topic, outcome, instance_id, n, latency)
SELECT m.minute, 'outbox', 'series.topic.' || t, o.outcome, i.id, 10 + t %% 17,
       CASE WHEN o.outcome = 'claimed' THEN ARRAY[5, 3, 2, 1, 1, 0, 0, 0, 0, 0] END
FROM generate_series(date_trunc('minute', now()) - make_interval(days => %(days)s),
                     date_trunc('minute', now()), interval '1 minute') m(minute)
CROSS JOIN generate_series(1, %(topics)s) t
CROSS JOIN (VALUES ('claimed'), ('done'), ('failed')) o(outcome)
CROSS JOIN (VALUES ('00000000-0000-0000-0000-0000000000a1'::uuid),
                   ('00000000-0000-0000-0000-0000000000a2'::uuid)) i(id)
WHERE o.outcome <> 'failed' OR (extract(epoch FROM m.minute)::bigint / 60 + t) %% 10 = 0
""",
    """
INSERT INTO workpump_console_backlog
    (minute, category, topic, pending, scheduled, leased, oldest_pending_seconds)
SELECT m.minute, 'outbox', 'series.topic.' || t, 20, 3, 4, 2
FROM generate_series(date_trunc('minute', now()) - make_interval(days => %(days)s),
                     date_trunc('minute', now()), interval '1 minute') m(minute)
CROSS JOIN generate_series(1, %(topics)s) t
""",
    """
INSERT INTO workpump_console_instance
    (minute, instance_id, service_name, host_name, process_id, heartbeat_age_seconds, in_flight)
SELECT m.minute, i.id, 'bench', 'localhost', 1, 1, 5
FROM generate_series(date_trunc('minute', now()) - make_interval(days => %(days)s),
                     date_trunc('minute', now()), interval '1 minute') m(minute)
CROSS JOIN (VALUES ('00000000-0000-0000-0000-0000000000a1'::uuid),
                   ('00000000-0000-0000-0000-0000000000a2'::uuid)) i(id)
""",
]
PAGES = [
    ("outbox changelist", "/admin/workpump/outbox/", {}),
    ("state=pending", "/admin/workpump/outbox/", {"state": "pending"}),
    ("state=scheduled", "/admin/workpump/outbox/", {"state": "scheduled"}),
    ("state=leased", "/admin/workpump/outbox/", {"state": "leased"}),
    ("state=orphaned", "/admin/workpump/outbox/", {"state": "orphaned"}),
    ("state=done", "/admin/workpump/outbox/", {"state": "done"}),
    ("state=dead", "/admin/workpump/outbox/", {"state": "dead"}),
    ("state=stuck", "/admin/workpump/outbox/", {"state": "stuck"}),
    ("owner=not-live", "/admin/workpump/outbox/", {"owner": "not-live"}),
    ("topic filter", "/admin/workpump/outbox/", TOPIC),
    ("state=pending + topic", "/admin/workpump/outbox/", {"state": "pending", **TOPIC}),
    ("state=stuck + topic", "/admin/workpump/outbox/", {"state": "stuck", **TOPIC}),
    ("summary", "/admin/workpump/serviceinstance/summary/", {}),
    ("instances", "/admin/workpump/serviceinstance/", {}),
    ("streams", "/admin/workpump/activestream/", {}),
    ("detail page", DETAIL, {}),
    ("payload search", "/admin/workpump/outbox/", {"q": PAYLOAD}),
    ("payload search + topic", "/admin/workpump/outbox/", {"q": PAYLOAD, **NEWEST_TOPIC}),
    ("console overview", CONSOLE, {}),
    ("console overview, day", CONSOLE, {"window": "day"}),
    ("console topic", f"{CONSOLE}topic/", {"category": "outbox", "topic": "series.topic.7"}),
    ("console topic, day", f"{CONSOLE}topic/", {"category": "outbox", "topic": "series.topic.7",
                                                 "window": "day"}),
]  # fmt: skip


def kinds(live: uuid.UUID) -> dict[str, dict[str, Any]]:
    """Column values of each kind of row (times relative to the database clock)."""
    base: dict[str, Any] = {
        "attempts": 0,
        "done_at": None,
        "dead_lettered_at": None,
        "instance_id": None,
        "lease_expiry": None,
        "claimed_at": None,
        "scheduled_for": None,
        "last_error": None,
    }
    return {
        "processed": {**base, "attempts": 1, "done_at": "-1 hour"},
        "dead": {**base, "attempts": 10, "dead_lettered_at": "-1 hour", "last_error": "boom"},
        "retry_wait": {**base, "attempts": 2, "scheduled_for": "+1 hour", "last_error": "x"},
        "attempts_high": {**base, "attempts": 6, "scheduled_for": "+1 hour"},
        "leased_live": {
            **base,
            "attempts": 1,
            "instance_id": str(live),
            "lease_expiry": "+1 hour",
            "claimed_at": "-1 minute",
        },
        "leased_gone": {
            **base,
            "attempts": 1,
            "instance_id": str(uuid.uuid4()),
            "lease_expiry": "+1 hour",
            "claimed_at": "-1 minute",
        },
        "orphaned": {
            **base,
            "attempts": 1,
            "instance_id": str(live),
            "lease_expiry": "-1 minute",
            "claimed_at": "-1 hour",
        },
        "pending": base,
    }


def build(total: int) -> dict[str, int]:
    """Empty the work tables and fill the outbox with ``total`` rows of MIX."""
    from django.db import connection

    live = uuid.uuid4()
    made = {}
    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE workpump_outbox, workpump_inbox, workpump_perspective_event,"
            " workpump_receptor_processing, workpump_service_instance, workpump_eviction,"
            " workpump_active_stream"
        )
        cursor.execute("SELECT workpump.record_heartbeat(%s, 'bench', 'localhost', 1)", [live])
        for kind, values in kinds(live).items():
            count = max(1, round(total * dict(MIX)[kind]))
            params = {"n": count}
            for key, value in values.items():
                if (
                    key
                    in (
                        "done_at",
                        "dead_lettered_at",
                        "lease_expiry",
                        "claimed_at",
                        "scheduled_for",
                    )
                    and value is not None
                ):
                    cursor.execute("SELECT now() + %s::interval", [value.replace("+", "")])
                    value = cursor.fetchone()[0]
                params[key] = value
            cursor.execute(INSERT_SQL, params)
            made[kind] = count
        cursor.execute("VACUUM ANALYZE workpump_outbox")
    return made


def build_series() -> int:
    """Replace the console's series with SERIES_DAYS days for SERIES_TOPICS topics, and
    fold them; returns the counter rows."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE workpump_console_count, workpump_console_total, workpump_console_rollup,"
            " workpump_console_backlog, workpump_console_instance, workpump_console_sample"
        )
        for sql in SERIES_SQL:
            cursor.execute(sql, {"days": SERIES_DAYS, "topics": SERIES_TOPICS})
        # The sampler's fold, one call a "minute" (a sample row holds where it stopped).
        folded, minute = None, 0
        while True:
            cursor.execute("SELECT workpump.console_fold(now())")
            (until,) = cursor.fetchone()
            if until == folded:
                break
            folded, minute = until, minute + 1
            cursor.execute(
                "INSERT INTO workpump_console_sample (minute, taken_at, folded_until)"
                " VALUES (date_trunc('minute', now()) - make_interval(mins => 100000 - %s),"
                " now(), %s)",
                [minute, until],
            )
        cursor.execute("SELECT count(*) FROM workpump_console_count")
        (rows,) = cursor.fetchone()
        for table in ("count", "total", "rollup", "backlog", "instance"):
            cursor.execute(f"VACUUM ANALYZE workpump_console_{table}")
    return int(rows)


def timed(fn: Any, repeat: int) -> float:
    fn()  # warm-up: caches, plans, the session
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def keep_live() -> None:
    """Heartbeat the dataset's live instance, as its pump would: a build of 10M rows takes
    minutes, past the stale cutoff, and the rows it holds must stay leased, not stuck."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("UPDATE workpump_service_instance SET last_heartbeat_at = now()")


def measure(
    repeat: int, pages: list[tuple[str, str, dict[str, str]]] | None = None, *, status: bool = True
) -> dict[str, float]:
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.test import Client

    user = User.objects.filter(username="bench").first() or User.objects.create_superuser(
        "bench", password="bench"
    )
    client = Client()
    client.force_login(user)
    from django_workpump.models import Outbox

    newest = Outbox.objects.order_by("-seq").values("seq", "payload", "topic")[0]
    found = {
        PAYLOAD: f"i={newest['payload']['i']}",
        NEWEST_TOPIC["topic"]: newest["topic"],
    }
    results = {}
    for name, page, given in PAGES if pages is None else pages:
        keep_live()
        url = f"/admin/workpump/outbox/{newest['seq']}/change/" if page == DETAIL else page
        params = {key: found.get(value, value) for key, value in given.items()}

        def get(url: str = url, params: dict[str, str] = params) -> None:
            response = client.get(url, params)
            assert response.status_code == 200, (url, params, response.status_code)

        results[name] = timed(get, repeat)
    if not status:
        return results
    keep_live()
    results["workpump_status --json"] = timed(
        lambda: call_command("workpump_status", "--json", stdout=io.StringIO()), repeat
    )
    keep_live()
    results["workpump_status (text)"] = timed(
        lambda: call_command("workpump_status", stdout=io.StringIO()), repeat
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 1_000_000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--payload-index",
        action="store_true",
        help="after each size, time the payload searches again with the opt-in GIN index",
    )
    parser.add_argument(
        "--record",
        action="store_true",
        help="record the figures as the admin pages section of bench/results/full.json and"
        " render docs/benchmark-results.md from it",
    )
    args = parser.parse_args()
    began, began_at = time.monotonic(), datetime.now(UTC).isoformat(timespec="seconds")

    import django
    from django.core.management import call_command
    from django.db import connection

    from tests.settings import DATABASES

    name = DATABASES["default"]["NAME"]
    import psycopg

    admin_url = os.environ["DATABASE_URL"].rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')
    django.setup()
    call_command("migrate", verbosity=0)

    start = time.perf_counter()
    rows = build_series()
    series_seconds = time.perf_counter() - start
    print(
        f"# console series: {SERIES_DAYS} days x {SERIES_TOPICS} topics x 2 instances,"
        f" {rows:,} counter rows, built and folded in {series_seconds:.1f} s",
        flush=True,
    )
    table: dict[int, dict[str, float]] = {}
    built: dict[int, float] = {}
    for size in args.sizes:
        start = time.perf_counter()
        made = build(size)
        built[size] = time.perf_counter() - start
        print(f"# built {size:,} rows in {built[size]:.1f} s: {made}", flush=True)
        table[size] = measure(args.repeat)
        if args.payload_index:
            start = time.perf_counter()
            call_command("workpump_payload_index", stdout=io.StringIO())
            print(f"# payload index built in {time.perf_counter() - start:.1f} s", flush=True)
            searches = [p for p in PAGES if p[0].startswith("payload search")]
            for page, ms in measure(args.repeat, searches, status=False).items():
                table[size][f"{page} (GIN index)"] = ms
            call_command("workpump_payload_index", "--drop", stdout=io.StringIO())
        connection.close()
    base = args.sizes[0]
    header = ["page", *(f"{s:,} rows (ms)" for s in args.sizes)]
    header += [f"{s:,} / {base:,}" for s in args.sizes[1:]]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for page in table[base]:
        cells = [page, *(f"{table[s].get(page, float('nan')):.1f}" for s in args.sizes)]
        cells += [
            f"{table[s].get(page, float('nan')) / table[base][page]:.2f}x" for s in args.sizes[1:]
        ]
        print("| " + " | ".join(cells) + " |")
    if args.record:
        data = {
            "sizes": args.sizes,
            "repeat": args.repeat,
            "series": {"days": SERIES_DAYS, "topics": SERIES_TOPICS, "counter_rows": rows},
            "series_seconds": series_seconds,
            "build_seconds": {str(size): built[size] for size in args.sizes},
            "pages": {
                page: {str(size): table[size].get(page) for size in args.sizes}
                for page in table[base]
            },
        }
        record(data, began, began_at, sys.argv[1:])


def record(data: dict[str, Any], began: float, began_at: str, argv: list[str]) -> None:
    """Replace the admin pages section of bench/results/full.json and render the page."""
    from bench import report, suite
    from bench.harness import RESULTS, save_json

    path = RESULTS / "full.json"
    results = json.loads(path.read_text()) if path.exists() else {"mode": "full"}
    command = "python bench/admin_pages.py " + " ".join(a for a in argv if a != "--record")
    revision = suite.revision()
    meta = {
        "started": began_at,
        "finished": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": time.monotonic() - began,
        "revision": revision,
        "command": command.rstrip(),
        "mode": "full",
        "versions": {
            "django-workpump": f"git {revision}",
            "PostgreSQL (machine)": _server_version(),
            "CPU cores": os.cpu_count(),
            "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        },
    }
    report.record(results, "admin_pages", data, meta)
    save_json("full", results)
    suite.render("full")


def _server_version() -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        return str(cursor.fetchone()[0])


if __name__ == "__main__":
    main()
