"""Write cost and search time of the opt-in payload GIN index (docs/admin.md, "Search").

    python bench/payload_index_cost.py postgresql://postgres@127.0.0.1:5432/SCRATCH

on a migrated scratch database (it empties the outbox there): inserts 4 x 50,000 rows
through send_many, alternately without and with the index, then times one payload
search with and without it over the 200,000 rows.
"""

from __future__ import annotations

import sys
import time

import psycopg

INSERT = (
    "SELECT workpump.send_many('gin.t', ARRAY(SELECT jsonb_build_object('user_id', g,"
    " 'email', 'u' || g || '@example.com', 'plan', jsonb_build_object('tier', 'pro',"
    " 'seats', g % 50)) FROM generate_series(1, 5000) g))"
)
CREATE = (
    "CREATE INDEX IF NOT EXISTS wp_outbox_payload ON workpump_outbox"
    " USING gin (payload jsonb_path_ops)"
)
DROP = "DROP INDEX IF EXISTS wp_outbox_payload"
SEARCH = "SELECT count(*) FROM workpump_outbox WHERE payload @> '{\"user_id\": 777}'"


def main(dsn: str) -> None:
    conn = psycopg.connect(dsn, autocommit=True)

    def insert(label: str, rounds: int = 10) -> None:
        started = time.perf_counter()
        for _ in range(rounds):
            conn.execute(INSERT)
        seconds = time.perf_counter() - started
        rows = rounds * 5000
        print(f"{label}: {rows / seconds:,.0f} rows/s ({seconds * 1e6 / rows:.1f} us/row)")

    def search(label: str) -> None:
        started = time.perf_counter()
        (found,) = conn.execute(SEARCH).fetchone()
        print(f"{label}: {found} rows in {(time.perf_counter() - started) * 1000:.1f} ms")

    conn.execute("TRUNCATE workpump_outbox CASCADE")
    for _ in range(2):
        conn.execute(DROP)
        insert("send_many, no payload index")
        conn.execute(CREATE)
        insert("send_many, with the GIN index")
    sizes = conn.execute(
        "SELECT pg_size_pretty(pg_relation_size('wp_outbox_payload')),"
        " pg_size_pretty(pg_relation_size('workpump_outbox'))"
    ).fetchone()
    print(f"index {sizes[0]}, table {sizes[1]}")
    search("search with the index")
    conn.execute(DROP)
    search("search without it")
    conn.execute("TRUNCATE workpump_outbox CASCADE")


if __name__ == "__main__":
    main(sys.argv[1])
