"""What tracing costs a producer: ``send`` rate with tracing off, with the OpenTelemetry
API alone (no SDK: spans are no-ops and no context is written), and with an SDK tracer
provider recording every span (a processor that drops them, so no exporter is timed).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/workpump_tracebench \\
        python bench/tracing_overhead.py --sends 5000 --rounds 5

Each round sends ``--sends`` outbox rows, ``--batch`` per transaction, in each mode in
turn (the SDK modes after the API-only rounds: a process sets its tracer provider once);
the median rate per mode is printed, then one JSON line. The database is migrated and
its outbox emptied: never point it at a database whose rows matter.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def setup() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def send_rate(sends: int, batch: int, tracing_on: bool) -> float:
    from django.db import connection, transaction
    from django.test import override_settings

    import django_workpump as workpump

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE workpump_outbox")
    with override_settings(WORKPUMP={"TRACING": tracing_on}):
        started = time.perf_counter()
        done = 0
        while done < sends:
            size = min(batch, sends - done)
            with transaction.atomic():
                for i in range(done, done + size):
                    workpump.send("bench.traced", {"i": i})
            done += size
        elapsed = time.perf_counter() - started
    return sends / elapsed


def span_cost_us(calls: int, tracing_on: bool) -> float:
    """Microseconds one producer span adds (tracing.producing alone, no database)."""
    from django.test import override_settings

    from django_workpump import tracing

    with override_settings(WORKPUMP={"TRACING": tracing_on}):
        started = time.perf_counter()
        for i in range(calls):
            with tracing.producing("send", "outbox", "bench.traced") as out:
                out.stored(i)
        return (time.perf_counter() - started) / calls * 1e6


def headers_written() -> bool:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT bool_and(headers ? 'traceparent') FROM workpump_outbox")
        return bool(cursor.fetchone()[0])


def install_sdk() -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Drop()))
    trace.set_tracer_provider(provider)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sends", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20000, help="calls of the span-only timing")
    options = parser.parse_args()
    setup()
    from django_workpump import tracing

    if not tracing.available():
        sys.exit("opentelemetry-api is not installed: pip install 'django-workpump[otel]'.")
    rates: dict[str, list[float]] = {"off": [], "api_only": [], "sdk_off": [], "sdk": []}
    costs: dict[str, float] = {}
    send_rate(options.sends, options.batch, False)  # warm up
    for _ in range(options.rounds):
        rates["off"].append(send_rate(options.sends, options.batch, False))
        rates["api_only"].append(send_rate(options.sends, options.batch, True))
    costs["off"] = span_cost_us(options.calls, False)
    costs["api_only"] = span_cost_us(options.calls, True)
    install_sdk()
    for _ in range(options.rounds):
        rates["sdk_off"].append(send_rate(options.sends, options.batch, False))
        rates["sdk"].append(send_rate(options.sends, options.batch, True))
    costs["sdk_off"] = span_cost_us(options.calls, False)
    costs["sdk"] = span_cost_us(options.calls, True)
    assert headers_written(), "the SDK rounds should have written a traceparent per row"
    medians = {mode: statistics.median(values) for mode, values in rates.items()}
    for mode, rate in medians.items():
        change = (rate / medians["off"] - 1) * 100
        print(
            f"{mode:>9}: {rate:8.0f} sends/s ({change:+.1f} % vs off); "
            f"tracing.producing alone {costs[mode]:6.1f} us/call"
        )
    print(
        json.dumps(
            {
                "sends": options.sends,
                "batch": options.batch,
                "median_rate": medians,
                "producing_us": costs,
            }
        )
    )


if __name__ == "__main__":
    main()
