"""PgQueuer worker of the benchmark: ``pgq run bench.peers.pgq_app:create`` (asyncpg)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
from pgqueuer import PgQueuer
from pgqueuer.db import AsyncpgDriver
from pgqueuer.models import Job

from bench import marks


@asynccontextmanager
async def create() -> AsyncIterator[PgQueuer]:
    connection = await asyncpg.connect(os.environ["BENCH_PG_DSN"])
    pgq = PgQueuer(AsyncpgDriver(connection))

    @pgq.entrypoint("noop")
    async def noop(job: Job) -> None:
        marks.first_start()

    @pgq.entrypoint("latency")
    async def latency(job: Job) -> None:
        marks.handler_start(int(job.payload or b"0"))

    @pgq.entrypoint("hold")
    async def hold(job: Job) -> None:
        marks.first_start()
        await asyncio.sleep(3600)

    try:
        yield pgq
    finally:
        await connection.close()
