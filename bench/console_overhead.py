"""What the console's counting costs the pump: quick-bench throughput and pickup latency
with the counting triggers on over off, in the same run (key ``console_overhead_ratio``:
the lower of the two ratios).

The series' counters are written by one statement trigger per work table
(django_workpump/sql/schema.sql, "The console's time series"): every claim, flush of
outcomes and renewal pays one upsert per statement. This section drains the same no-op
backlog with the triggers enabled and disabled (``workpump.console_counting``), in turns
within each repetition (which goes first alternates), and reports the median of the
per-repetition ratios, on / off. The sampler runs in the maintenance worker, once a
minute, off the hot path: it is not timed here.

Latency is measured as the latency section does (an idle, listening worker; single
enqueues at a fixed gap), in blocks alternated the same way, all to one worker; its
ratio is speed on over off, p50 off / p50 on, so that for both ratios 1.0 means no cost
and less is a cost.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import harness as h
from bench import latency, throughput

# At least this many pairs of drains: one ratio is at the mercy of a noisy machine.
REPS = 4  # even: which of a pair goes first is balanced against any drift
# Pairs of latency blocks (each LATENCY_N single enqueues LATENCY_GAP_MS apart, after
# WARMUP_N uncounted ones), all handled by one worker.
LATENCY_REPS = 8
LATENCY_N = 150
LATENCY_GAP_MS = 15.0
WARMUP_N = 10


def counting(server: h.Server, database: str, on: bool) -> None:
    with server.connect(database) as conn:
        conn.execute("SELECT workpump.console_counting(%s)", [on])


def run(cfg: Any, server: h.Server, database: str, workdir: Path) -> dict[str, Any]:
    h.install_schema("workpump", server, database)
    # enqueued with send_many: the backlog per row would take longer than its drain
    case = throughput.Case("workpump", 1, None, cfg.jobs["workpump"], {}, "default", variant="many")
    runs: list[dict[str, Any]] = []

    def drain(c: throughput.Case, rep: int, on: bool) -> dict[str, Any]:
        counting(server, database, on)
        named = replace(c, name="console-on" if on else "console-off")
        result = throughput.run_case(server, database, named, rep, workdir)
        h.log(f"console overhead rep {rep + 1} counting {'on' if on else 'off'}: "
              f"{result.get('rate') or 0:,.0f} jobs/s")  # fmt: skip
        return result

    if cfg.calibrate:
        # Size the backlog once (counting on), so every drain lasts long enough.
        _, case = throughput.drain_long_enough(
            cfg.min_drain_seconds, case, lambda c: drain(c, -1, True)
        )
    ratios: list[float] = []
    reps = max(cfg.reps, REPS)
    for rep in range(reps):
        order = (True, False) if rep % 2 == 0 else (False, True)
        rates: dict[bool, float | None] = {}
        for on in order:
            result = drain(case, rep, on)
            runs.append({**result, "counting": on})
            rates[on] = result.get("rate")
        if rates[True] and rates[False]:
            ratios.append(rates[True] / rates[False])
    lat = latency_pairs(server, database, workdir)
    counting(server, database, True)
    throughput_ratio = h.median(ratios) if ratios else None
    latency_ratio = lat["ratio"]
    both = [r for r in (throughput_ratio, latency_ratio) if r is not None]
    return {
        "jobs": case.jobs,
        "runs": runs,
        "by_rep": ratios,
        "console_overhead_ratio": min(both) if len(both) == 2 else None,
        "throughput_ratio": throughput_ratio,
        "latency_ratio": latency_ratio,
        "latency": lat,
        "rate_on_median": h.median([r["rate"] for r in runs if r["counting"] and "rate" in r]),
        "rate_off_median": h.median([r["rate"] for r in runs if not r["counting"] and "rate" in r]),
    }


def latency_pairs(server: h.Server, database: str, workdir: Path) -> dict[str, Any]:
    """Pickup latency p50 with counting on and off, in alternated pairs of blocks; the
    ratio is the median of each pair's p50 off / p50 on.

    Every block goes to one idle, listening worker: started once, so the difference a
    fresh process makes from run to run (its caches, where the OS put it), which swung
    a pair by more than the 5% measured here, is not in the ratio. After each switch a
    few enqueues go uncounted: the switch (ALTER TABLE) makes every session plan its
    statements on those tables anew.
    """
    with server.connect(database) as conn:
        conn.execute(h.RESET_SQL["workpump"])
    marks = workdir / "console-lat.marks"
    marks.unlink(missing_ok=True)
    worker = h.start_worker(
        "workpump", server, database, marks=marks, log_path=workdir / "console-lat.log"
    )

    def block(offset: int, n: int, gap_ms: float) -> list[float]:
        return latency.block("workpump", server, database, worker, marks, n, gap_ms, offset)

    by_rep: list[float] = []
    p50: dict[bool, list[float]] = {True: [], False: []}
    try:
        time.sleep(2.0)  # started and listening
        offset = 1_000_000
        for rep in range(LATENCY_REPS):
            got: dict[bool, float] = {}
            for on in (True, False) if rep % 2 == 0 else (False, True):
                counting(server, database, on)
                block(offset, WARMUP_N, 50.0)  # replans after the switch; not counted
                offset += WARMUP_N
                lat_ms = block(offset, LATENCY_N, LATENCY_GAP_MS)
                offset += LATENCY_N
                got[on] = h.percentile(lat_ms, 50)
                p50[on].append(got[on])
                h.log(f"console overhead latency rep {rep + 1} counting {'on' if on else 'off'}: "
                      f"p50 {got[on]:.2f} ms")  # fmt: skip
            by_rep.append(got[False] / got[True])
    finally:
        h.stop_worker(worker)
    return {
        "n": LATENCY_N,
        "gap_ms": LATENCY_GAP_MS,
        "warmup": WARMUP_N,
        "p50_on_ms": p50[True],
        "p50_off_ms": p50[False],
        "by_rep": by_rep,
        "ratio": h.median(by_rep),
    }
