"""Start a PgQueuer worker the way ``pgq run`` does: ``pgqueuer.run(factory, ...)``.

``pgq run`` of PgQueuer 1.6.0 fails before starting with the installed typer
(``setup_fancy_logger`` gets a str where it wants the LogLevel enum), so the benchmark
calls the function the CLI calls, with the CLI's defaults (dequeue timeout 30 s,
batch size 10, heartbeat timeout 30 s, no concurrency cap).
"""

from __future__ import annotations

import argparse
import asyncio
from datetime import timedelta

import pgqueuer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("factory", nargs="?", default="bench.peers.pgq_app:create")
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--max-concurrent-tasks", type=int, default=None)
    parser.add_argument("--dequeue-timeout", type=float, default=30.0)
    parser.add_argument("--heartbeat-timeout", type=float, default=30.0)
    a = parser.parse_args()
    asyncio.run(
        pgqueuer.run(
            a.factory,
            dequeue_timeout=timedelta(seconds=a.dequeue_timeout),
            batch_size=a.batch_size,
            max_concurrent_tasks=a.max_concurrent_tasks,
            heartbeat_timeout=timedelta(seconds=a.heartbeat_timeout),
        )
    )


if __name__ == "__main__":
    main()
