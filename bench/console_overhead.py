"""What the console's counting costs the pump: quick-bench throughput with the counting
triggers on over off, in the same run (key ``console_overhead_ratio``).

The series' counters are written by one statement trigger per work table
(django_workpump/sql/schema.sql, "The console's time series"): every claim, flush of
outcomes and renewal pays one upsert per statement. This section drains the same no-op
backlog with the triggers enabled and disabled (``workpump.console_counting``), in turns
within each repetition (which goes first alternates), and reports the median of the
per-repetition ratios, on / off. The sampler runs in the maintenance worker, once a
minute, off the hot path: it is not timed here.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import harness as h
from bench import throughput

# At least this many pairs of drains: one ratio is at the mercy of a noisy machine.
REPS = 5


def counting(server: h.Server, database: str, on: bool) -> None:
    with server.connect(database) as conn:
        conn.execute("SELECT workpump.console_counting(%s)", [on])


def run(cfg: Any, server: h.Server, database: str, workdir: Path) -> dict[str, Any]:
    h.install_schema("workpump", server, database)
    case = throughput.Case("workpump", 1, None, cfg.jobs["workpump"], {}, "default")
    runs: list[dict[str, Any]] = []

    def drain(c: throughput.Case, rep: int, on: bool) -> dict[str, Any]:
        counting(server, database, on)
        named = replace(c, name="console-on" if on else "console-off")
        result = throughput.run_case(server, database, named, rep, workdir)
        h.log(f"console overhead rep {rep + 1} counting {'on' if on else 'off'}: "
              f"{result.get('rate') or 0:,.0f} jobs/s")  # fmt: skip
        return result

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
    counting(server, database, True)
    return {
        "jobs": case.jobs,
        "runs": runs,
        "by_rep": ratios,
        "console_overhead_ratio": h.median(ratios) if ratios else None,
        "rate_on_median": h.median([r["rate"] for r in runs if r["counting"] and "rate" in r]),
        "rate_off_median": h.median([r["rate"] for r in runs if not r["counting"] and "rate" in r]),
    }
