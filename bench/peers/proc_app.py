"""Procrastinate app of the benchmark (psycopg connector):
``procrastinate --app=bench.peers.proc_app.app worker``."""

from __future__ import annotations

import asyncio
import os

from procrastinate import App, PsycopgConnector

from bench import marks

app = App(connector=PsycopgConnector(conninfo=os.environ.get("BENCH_PG_DSN", "")))


@app.task(name="noop")
async def noop() -> None:
    marks.first_start()


@app.task(name="latency")
async def latency(i: int) -> None:
    marks.handler_start(i)


@app.task(name="hold")
async def hold() -> None:
    marks.first_start()
    await asyncio.sleep(3600)
