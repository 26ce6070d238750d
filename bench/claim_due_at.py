"""What the queue-wait metric adds to a claim: the claim's own ``created_at``/``due_at``
columns versus a lookup of them after the claim.

Run against a migrated database (it writes rows, so not a production one)::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/wp_bench python bench/claim_due_at.py

It registers an instance, inserts ``--backlog`` pending outbox rows, then times each
query claiming ``--batch`` rows, alternating, ``--rounds`` times each; every claim runs in
a transaction that is rolled back, so each one sees the same backlog. The queries:

- ``plain``: ``claim_work`` without the times;
- ``returned``: ``claim_work`` with ``created_at`` and ``due_at`` (the named query
  ``claim_work``);
- ``lookup``: the claim without the times, then one probe of the work id's unique index
  per claimed row for them.

Prints the median and p90 milliseconds of each and the differences per claimed row.
Rows it inserted are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid

import psycopg

TOPIC = "bench.due_at"
ARGUMENTS = """
    p_instance_id => %(instance_id)s,
    p_max_rows => %(max_rows)s,
    p_lease_seconds => %(lease_seconds)s,
    p_partition_count => %(partition_count)s,
    p_categories => %(categories)s,
    p_stale_after_seconds => %(stale_after_seconds)s,
    p_definitively_dead_after_seconds => %(definitively_dead_after_seconds)s,
    p_now => %(now)s,
    p_topics => %(topics)s::jsonb,
    p_topic_prefixes => %(topic_prefixes)s::jsonb"""
V15_COLUMNS = (
    "category, work_id, topic, payload, stream, attempts, max_attempts, lease_expiry,"
    " event_id, event_type, priority, claimed_at, lease_token, headers, has_more"
)
QUERIES = {
    "plain": f"SELECT {V15_COLUMNS} FROM workpump.claim_work({ARGUMENTS})",
    "returned": f"SELECT {V15_COLUMNS}, created_at, due_at FROM workpump.claim_work({ARGUMENTS})",
    # the times looked up per claimed row, after the claim
    "lookup": f"""
SELECT c.category, c.work_id, c.topic, c.payload, c.stream, c.attempts, c.max_attempts,
       c.lease_expiry, c.event_id, c.event_type, c.priority, c.claimed_at, c.lease_token,
       c.headers, c.has_more,
       CASE c.category
           WHEN 'outbox' THEN (SELECT coalesce(t.lease_expiry, t.scheduled_for, t.created_at)
                               FROM workpump_outbox t WHERE t.work_id = c.work_id)
           WHEN 'inbox' THEN (SELECT coalesce(t.lease_expiry, t.scheduled_for, t.created_at)
                              FROM workpump_inbox t WHERE t.work_id = c.work_id)
           WHEN 'perspective_event' THEN (
               SELECT coalesce(t.lease_expiry, t.scheduled_for, t.created_at)
               FROM workpump_perspective_event t WHERE t.work_id = c.work_id)
           WHEN 'receptor' THEN (SELECT coalesce(t.lease_expiry, t.scheduled_for, t.created_at)
                                 FROM workpump_receptor_processing t WHERE t.work_id = c.work_id)
       END AS due_at
FROM workpump.claim_work({ARGUMENTS}) WITH ORDINALITY AS c
ORDER BY c.ordinality""",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
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
        result = conn.execute(
            "SELECT pg_get_function_result(p.oid) FROM pg_proc p"
            " WHERE p.pronamespace = 'workpump'::regnamespace AND p.proname = 'claim_work'"
        ).fetchone()[0]
        names = ["plain", "lookup"] + (["returned"] if "due_at" in result else [])
        conn.execute("SELECT workpump.record_heartbeat(%s, 'bench', 'localhost', 1)", [instance])
        conn.execute(
            "SELECT count(workpump.send(%s, jsonb_build_object('i', g)))"
            " FROM generate_series(1, %s) g",
            [TOPIC, args.backlog],
        )
        conn.execute("VACUUM ANALYZE workpump_outbox")
        timings: dict[str, list[float]] = {name: [] for name in names}
        try:
            for _ in range(args.rounds):
                for name, samples in timings.items():
                    conn.execute("BEGIN")
                    started = time.perf_counter()
                    rows = conn.execute(QUERIES[name], params).fetchall()
                    samples.append((time.perf_counter() - started) * 1000)
                    conn.execute("ROLLBACK")
                    assert len(rows) == args.batch, len(rows)
        finally:
            conn.execute("DELETE FROM workpump_outbox WHERE topic = %s", [TOPIC])
            conn.execute("SELECT workpump.deregister_instance(%s)", [instance])
    medians = {}
    for name, samples in timings.items():
        samples.sort()
        medians[name] = statistics.median(samples)
        p90 = samples[int(len(samples) * 0.9) - 1]
        print(f"{name:9} median {medians[name]:7.2f} ms  p90 {p90:7.2f} ms")
    print(f"backlog {args.backlog}, batch {args.batch}, {args.rounds} rounds, per claimed row:")
    for name in names[1:]:
        extra = medians[name] - medians["plain"]
        print(f"  {name} adds {extra * 1000 / args.batch:6.1f} us over plain")


if __name__ == "__main__":
    main()
