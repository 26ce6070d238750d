"""Admin pages and ``workpump_status --json`` at 10k, 1M and 10M outbox rows.

For each size the outbox is rebuilt with set-based SQL (``generate_series``; no ORM):
90 % processed, then dead, waiting for a retry, past half their attempts, leased by a
live instance, leased by a gone one, orphaned, and the newest 7.5 % pending; then
VACUUM ANALYZE. Done, dead-lettered and scheduled times come in batches of 100 rows
10 ms apart, as outcomes written one batch per statement do. Each page is fetched by
Django's test client logged in as a superuser, once to warm up and then ``--repeat``
times; the median is reported, and each size's median divided by the smallest size's
(the target is <= 3x at 1M).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/workpump_adminbench \\
        python bench/admin_pages.py --sizes 10000 1000000

The database named by DATABASE_URL is created if missing and its workpump tables are
emptied: never point it at a database whose rows matter.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
import uuid
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
]


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


def measure(repeat: int) -> dict[str, float]:
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.test import Client

    user = User.objects.filter(username="bench").first() or User.objects.create_superuser(
        "bench", password="bench"
    )
    client = Client()
    client.force_login(user)
    from django_workpump.models import Outbox

    newest = Outbox.objects.order_by("-seq").values_list("seq", flat=True)[0]
    results = {}
    for name, page, params in PAGES:
        keep_live()
        url = f"/admin/workpump/outbox/{newest}/change/" if page == DETAIL else page

        def get(url: str = url, params: dict[str, str] = params) -> None:
            response = client.get(url, params)
            assert response.status_code == 200, (url, params, response.status_code)

        results[name] = timed(get, repeat)
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
    args = parser.parse_args()

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

    table: dict[int, dict[str, float]] = {}
    for size in args.sizes:
        start = time.perf_counter()
        made = build(size)
        print(f"# built {size:,} rows in {time.perf_counter() - start:.1f} s: {made}", flush=True)
        table[size] = measure(args.repeat)
        connection.close()
    base = args.sizes[0]
    header = ["page", *(f"{s:,} rows (ms)" for s in args.sizes)]
    header += [f"{s:,} / {base:,}" for s in args.sizes[1:]]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for page in table[base]:
        cells = [page, *(f"{table[s][page]:.1f}" for s in args.sizes)]
        cells += [f"{table[s][page] / table[base][page]:.2f}x" for s in args.sizes[1:]]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
