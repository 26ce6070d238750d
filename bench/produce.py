"""Producers of the benchmark, one subprocess per use so each system runs in its own
process with its own client: ``python -m bench.produce SYSTEM MODE ...``.

MODE ``bulk``: enqueue N jobs in batches (timed; for django-workpump ``--variant`` says
how: ``send`` per row in one transaction per batch, ``single`` one ``send`` per
transaction in autocommit, ``many`` with ``send_many``, ``set`` a raw INSERT); MODE
``latency``: single enqueues at a fixed gap, each in its own transaction, printing the
commit time of each. The last line
of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

from bench.marks import now_ns


def _pace(start_ns: int, i: int, gap_ms: float) -> None:
    due = start_ns + int(i * gap_ms * 1e6)
    delay = (due - now_ns()) / 1e9
    if delay > 0:
        time.sleep(delay)


# -- django-workpump ---------------------------------------------------------------
def _django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    import django

    django.setup()


def ours_bulk(
    n: int, batch: int, task: str, variant: str, stream: str | None = None
) -> dict[str, Any]:
    _django()
    from django.db import connection, transaction

    import django_workpump as workpump

    destination = f"bench.{task}"
    connection.ensure_connection()
    started = now_ns()
    done = 0
    if variant == "chain":  # each row waits for the one before it (send(after=...))
        previous = None
        while done < n:
            size = min(batch, n - done)
            with transaction.atomic():
                for i in range(done, done + size):
                    after = None if previous is None else [previous]
                    previous = workpump.send(destination, {"i": i}, after=after)
            done += size
        return {"n": n, "seconds": (now_ns() - started) / 1e9}
    if variant == "batch":  # one batch of every row, with a callback (one more row)
        with workpump.batch(on_complete=(destination, {"callback": True})):
            for start in range(0, n, batch):
                size = min(batch, n - start)
                workpump.send_many(destination, [{"i": i} for i in range(start, start + size)])
        return {"n": n, "seconds": (now_ns() - started) / 1e9}
    if variant == "single":  # one send per call, each its own transaction (autocommit)
        for i in range(n):
            workpump.send(destination, {"i": i})
        return {"n": n, "seconds": (now_ns() - started) / 1e9}
    while done < n:
        size = min(batch, n - done)
        with transaction.atomic():
            if variant == "send":
                for i in range(done, done + size):
                    workpump.send(destination, {"i": i}, stream=stream)
            elif variant == "many":  # the bulk producer: one statement per batch
                workpump.send_many(
                    destination,
                    [{"i": i} for i in range(done, done + size)],
                    streams=None if stream is None else [stream] * size,
                )
            else:  # "set": what a bulk producer (send_many) would run: one INSERT per batch
                with connection.cursor() as cursor:
                    cursor.execute(
                        "INSERT INTO workpump_outbox (work_id, topic, payload,"
                        " partition_number, max_attempts)"
                        " SELECT u, %s, jsonb_build_object('i', g),"
                        " workpump.partition_of(u::text, 10000), 10"
                        " FROM (SELECT gen_random_uuid() AS u, g"
                        "       FROM generate_series(%s, %s) g) s",
                        [destination, done, done + size - 1],
                    )
        done += size
    return {"n": n, "seconds": (now_ns() - started) / 1e9}


def ours_latency(n: int, gap_ms: float, offset: int) -> dict[str, Any]:
    _django()
    from django.db import connection, transaction

    import django_workpump as workpump

    connection.ensure_connection()
    commits: dict[int, int] = {}
    start = now_ns()
    for i in range(n):
        _pace(start, i, gap_ms)
        with transaction.atomic():
            workpump.send("bench.latency", {"i": offset + i})
        commits[offset + i] = now_ns()
    return {"commits": commits}


# -- PgQueuer (asyncpg) ------------------------------------------------------------
async def _pgq_queries() -> Any:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    connection = await asyncpg.connect(os.environ["BENCH_PG_DSN"])
    return connection, Queries(AsyncpgDriver(connection))


async def pgq_bulk(n: int, batch: int, task: str) -> dict[str, Any]:
    connection, queries = await _pgq_queries()
    started = now_ns()
    done = 0
    while done < n:
        size = min(batch, n - done)
        await queries.enqueue(
            [task] * size, [str(i).encode() for i in range(done, done + size)], [0] * size
        )
        done += size
    elapsed = (now_ns() - started) / 1e9
    await connection.close()
    return {"n": n, "seconds": elapsed}


async def pgq_latency(n: int, gap_ms: float, offset: int) -> dict[str, Any]:
    connection, queries = await _pgq_queries()
    commits: dict[int, int] = {}
    start = now_ns()
    for i in range(n):
        due = start + int(i * gap_ms * 1e6)
        delay = (due - now_ns()) / 1e9
        if delay > 0:
            await asyncio.sleep(delay)
        await queries.enqueue("latency", str(offset + i).encode())
        commits[offset + i] = now_ns()
    await connection.close()
    return {"commits": commits}


# -- Procrastinate (psycopg) -------------------------------------------------------
async def proc_bulk(n: int, batch: int, task: str, lock: str | None = None) -> dict[str, Any]:
    from bench.peers.proc_app import app

    async with app.open_async():
        job_task = app.tasks[task]
        if lock is not None:  # one lock: the jobs run one at a time, in order
            job_task = job_task.configure(lock=lock)
        started = now_ns()
        done = 0
        while done < n:
            size = min(batch, n - done)
            await job_task.batch_defer_async(*({} for _ in range(size)))
            done += size
        elapsed = (now_ns() - started) / 1e9
    return {"n": n, "seconds": elapsed}


async def proc_latency(n: int, gap_ms: float, offset: int) -> dict[str, Any]:
    from bench.peers.proc_app import app

    commits: dict[int, int] = {}
    async with app.open_async():
        task = app.tasks["latency"]
        start = now_ns()
        for i in range(n):
            due = start + int(i * gap_ms * 1e6)
            delay = (due - now_ns()) / 1e9
            if delay > 0:
                await asyncio.sleep(delay)
            await task.defer_async(i=offset + i)
            commits[offset + i] = now_ns()
    return {"commits": commits}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("system", choices=["workpump", "pgqueuer", "procrastinate"])
    parser.add_argument("mode", choices=["bulk", "latency"])
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--task", default="noop")
    parser.add_argument(
        "--variant", default="send", choices=["send", "single", "many", "set", "chain", "batch"]
    )
    parser.add_argument("--gap-ms", type=float, default=50.0)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--stream", default=None, help="workpump: every job on this stream")
    parser.add_argument("--lock", default=None, help="procrastinate: every job under this lock")
    a = parser.parse_args()
    if a.system == "workpump":
        if a.mode == "bulk":
            result = ours_bulk(a.n, a.batch, a.task, a.variant, a.stream)
        else:
            result = ours_latency(a.n, a.gap_ms, a.offset)
    elif a.system == "pgqueuer":
        coro = (
            pgq_bulk(a.n, a.batch, a.task)
            if a.mode == "bulk"
            else pgq_latency(a.n, a.gap_ms, a.offset)
        )
        result = asyncio.run(coro)
    else:
        coro = (
            proc_bulk(a.n, a.batch, a.task, a.lock)
            if a.mode == "bulk"
            else proc_latency(a.n, a.gap_ms, a.offset)
        )
        result = asyncio.run(coro)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
