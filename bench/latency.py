"""Latency: an idle, listening worker; single enqueues at a fixed gap, each committed on
its own; enqueue commit (producer side, after COMMIT returned) -> handler start.

Both times are CLOCK_MONOTONIC of this machine. Ten warm-up jobs go first (not counted)
so connections and caches are warm; then the worker idles a second before the run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench import harness as h

WARMUP = 10
WARMUP_OFFSET = 1_000_000


def run(
    system: str, server: h.Server, database: str, n: int, gap_ms: float, workdir: Path, rep: int
) -> dict[str, Any]:
    with server.connect(database) as conn:
        conn.execute(h.RESET_SQL[system])
    marks = workdir / f"lat-{system}-r{rep}.marks"
    marks.unlink(missing_ok=True)
    worker = h.start_worker(
        system, server, database, marks=marks, log_path=workdir / f"lat-{system}-r{rep}.log"
    )

    try:
        time.sleep(2.0)
        block(system, server, database, worker, marks, WARMUP, 50.0, WARMUP_OFFSET)
        time.sleep(1.0)
        idle_rss = worker.rss()
        lat_ms = block(system, server, database, worker, marks, n, gap_ms, 0)
    finally:
        h.stop_worker(worker)
    return {
        "system": system,
        "rep": rep,
        "n": n,
        "gap_ms": gap_ms,
        "lat_ms": lat_ms,
        "p50": h.percentile(lat_ms, 50),
        "p95": h.percentile(lat_ms, 95),
        "p99": h.percentile(lat_ms, 99),
        "max": max(lat_ms),
        "min": min(lat_ms),
        "idle_rss_mb": idle_rss / 2**20,
    }


def block(
    system: str,
    server: h.Server,
    database: str,
    worker: h.Worker,
    marks: Path,
    n: int,
    gap_ms: float,
    offset: int,
) -> list[float]:
    """Enqueue ``n`` jobs numbered from ``offset``, ``gap_ms`` apart, to a running
    ``worker`` that marks its starts in ``marks``; each one's latency in ms."""
    produced = h.produce(
        system,
        server,
        database,
        ["latency", "--n", str(n), "--gap-ms", str(gap_ms), "--offset", str(offset)],
    )

    def starts() -> dict[int, int]:
        return {int(m[1]): int(m[2]) for m in h.read_marks(marks) if m[0] == "lat"}

    if not h.wait_for(lambda: all(k in starts() for k in range(offset, offset + n)), 60, 0.1):
        raise RuntimeError(f"{system}: latency jobs not handled:\n{worker.output()[-2000:]}")
    got = starts()
    return [(got[int(k)] - v) / 1e6 for k, v in produced["commits"].items()]


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for system in h.SYSTEMS:
        items = [r for r in runs if r["system"] == system]
        if not items:
            continue
        pooled = [v for r in items for v in r["lat_ms"]]
        out[system] = {
            "rounds": len(items),
            "samples": len(pooled),
            "p50": h.percentile(pooled, 50),
            "p95": h.percentile(pooled, 95),
            "p99": h.percentile(pooled, 99),
            "max": max(pooled),
            "p50_by_round": [r["p50"] for r in items],
            "p99_by_round": [r["p99"] for r in items],
            "idle_rss_mb": h.median([r["idle_rss_mb"] for r in items]),
        }
    return out
