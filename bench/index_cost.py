"""What the admin's partial indexes cost the hot path: the pump with and without them.

    python bench/index_cost.py [--pairs 8] [--jobs 20000] [--latency-pairs 4]

The admin's state and stuck filters and the status counts read partial indexes that
hold rows in rare states only: ``_orphan``, ``_waiting``, ``_retried`` and ``_dead`` of
each work table (docs/admin.md). A claim or an outcome never writes a row into them, but
PostgreSQL still weighs every index of a table when it plans a statement on it, and
checks each partial index's predicate when it updates a row.

Two databases get the same schema; one then drops those sixteen indexes. Measured in
pairs, the two databases alternating which goes first:

- throughput: ``bench.throughput``'s case (``--jobs`` no-op jobs enqueued, then drained
  by one fresh ``runworkpump`` at its defaults);
- latency: ``bench.latency``'s run (200 jobs sent 20 ms apart, enqueue commit to
  handler start, one warm pump).

Prints each pair, then the medians and their ratios (with / without: a throughput
ratio below 1 and a latency ratio above 1 are costs), and one JSON line. Runs inside
``bench/.venv`` (made by ``bench/run.py``) and uses databases of its own,
``wp_bench_index_with`` and ``wp_bench_index_without``, dropped at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import bootstrap  # noqa: E402

ADMIN_INDEXES = [
    f"wp_{table}_{kind}"
    for table in ("outbox", "inbox", "persp", "receptor")
    for kind in ("orphan", "waiting", "retried", "dead")
]
DATABASES = {"with": "wp_bench_index_with", "without": "wp_bench_index_without"}


def measure(pairs: int, jobs: int, latency_pairs: int) -> dict[str, Any]:
    from bench import harness as h
    from bench import latency
    from bench.throughput import Case, run_case

    server = h.system_server()
    for database in DATABASES.values():
        h.install_schema("workpump", server, database)
    with server.connect(DATABASES["without"]) as conn:
        for name in ADMIN_INDEXES:
            conn.execute(f"DROP INDEX {name}")
    workdir = Path(tempfile.mkdtemp(prefix="wp-index-cost-"))
    case = Case("workpump", 1, None, jobs, name="default")
    rates: dict[str, list[float]] = {"with": [], "without": []}
    p50s: dict[str, list[float]] = {"with": [], "without": []}
    p99s: dict[str, list[float]] = {"with": [], "without": []}
    try:
        for i in range(pairs):
            order = ["with", "without"] if i % 2 == 0 else ["without", "with"]
            for label in order:
                result = run_case(server, DATABASES[label], case, i, workdir)
                if "rate" not in result:
                    raise RuntimeError(f"{label}: {result.get('error')}")
                rates[label].append(result["rate"])
            h.log(
                f"index cost: throughput pair {i}: with {rates['with'][-1]:,.0f},"
                f" without {rates['without'][-1]:,.0f} jobs/s"
            )
        for i in range(latency_pairs):
            order = ["with", "without"] if i % 2 == 0 else ["without", "with"]
            for label in order:
                result = latency.run("workpump", server, DATABASES[label], 200, 20.0, workdir, i)
                p50s[label].append(result["p50"])
                p99s[label].append(result["p99"])
            h.log(
                f"index cost: latency pair {i}: p50 with {p50s['with'][-1]:.2f},"
                f" without {p50s['without'][-1]:.2f} ms"
            )
    finally:
        for database in DATABASES.values():
            server.drop(database)

    def ratio(values: dict[str, list[float]]) -> float | None:
        if not values["with"]:
            return None
        return h.median(values["with"]) / h.median(values["without"])

    per_pair = [w / wo for w, wo in zip(rates["with"], rates["without"], strict=True)]
    return {
        "server": server.version(),
        "pairs": pairs,
        "jobs": jobs,
        "latency_pairs": latency_pairs,
        "rates": rates,
        "latency_p50_ms": p50s,
        "latency_p99_ms": p99s,
        "throughput_ratio": ratio(rates),
        "throughput_ratio_per_pair_median": h.median(per_pair) if per_pair else None,
        "latency_p50_ratio": ratio(p50s),
        "latency_p99_ratio": ratio(p99s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=8, help="throughput pairs")
    parser.add_argument("--jobs", type=int, default=20_000, help="jobs per throughput run")
    parser.add_argument("--latency-pairs", type=int, default=4, help="latency pairs")
    args = parser.parse_args()
    bootstrap(Path(__file__))
    out = measure(args.pairs, args.jobs, args.latency_pairs)
    from bench import harness as h

    for label in ("with", "without"):
        print(
            f"{label:8s} throughput median {h.median(out['rates'][label]):,.0f} jobs/s"
            + (
                f", latency p50 {h.median(out['latency_p50_ms'][label]):.2f} ms,"
                f" p99 {h.median(out['latency_p99_ms'][label]):.2f} ms"
                if out["latency_p50_ms"][label]
                else ""
            )
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
