"""What the queue-wait metric adds to a claim: ``claim_work`` versus ``claim_work_due_at``.

Run against a migrated database (it writes rows, so not a production one)::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/wp_bench python bench/claim_due_at.py

It registers an instance, inserts ``--backlog`` pending outbox rows, then times each named
query claiming ``--batch`` rows, alternating, ``--rounds`` times each; every claim runs in
a transaction that is rolled back, so each one sees the same backlog. Prints the median
and p90 milliseconds of each and their difference per claimed row. Rows it inserted are
deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from django_workpump.sql import named_queries

TOPIC = "bench.due_at"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    queries = named_queries()
    instance = uuid.uuid4()
    params = {
        "instance_id": instance,
        "max_rows": args.batch,
        "lease_seconds": 300,
        "partition_count": 10_000,
        "categories": ["outbox"],
        "topics": json.dumps({"outbox": [TOPIC]}),
        "topic_prefixes": None,
        "stale_after_seconds": 30,
        "definitively_dead_after_seconds": 300,
        "now": None,
    }
    with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
        conn.execute("SELECT workpump.record_heartbeat(%s, 'bench', 'localhost', 1)", [instance])
        conn.execute(
            "SELECT count(workpump.send(%s, jsonb_build_object('i', g)))"
            " FROM generate_series(1, %s) g",
            [TOPIC, args.backlog],
        )
        conn.execute("VACUUM ANALYZE workpump_outbox")
        timings: dict[str, list[float]] = {"claim_work": [], "claim_work_due_at": []}
        try:
            for _ in range(args.rounds):
                for name, samples in timings.items():
                    conn.execute("BEGIN")
                    started = time.perf_counter()
                    rows = conn.execute(queries[name], params).fetchall()
                    samples.append((time.perf_counter() - started) * 1000)
                    conn.execute("ROLLBACK")
                    assert len(rows) == args.batch, len(rows)
        finally:
            conn.execute("DELETE FROM workpump_outbox WHERE destination = %s", [TOPIC])
            conn.execute("SELECT workpump.deregister_instance(%s)", [instance])
    medians = {}
    for name, samples in timings.items():
        samples.sort()
        medians[name] = statistics.median(samples)
        p90 = samples[int(len(samples) * 0.9) - 1]
        print(f"{name:18} median {medians[name]:7.2f} ms  p90 {p90:7.2f} ms")
    extra = medians["claim_work_due_at"] - medians["claim_work"]
    print(
        f"backlog {args.backlog}, batch {args.batch}, {args.rounds} rounds: due_at adds "
        f"{extra:.2f} ms per claim, {extra * 1000 / args.batch:.1f} us per claimed row"
    )


if __name__ == "__main__":
    main()
