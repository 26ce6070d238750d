"""Workflows: what a chain and a batch callback cost against the same rows without them.

A chain of N rows (each sent with ``after=[the previous]``: a claim leases a link with
the links behind it, each started once the one before it completed, as a stream's run
is) is drained by one fresh ``runworkpump`` and compared with N rows on one stream (also
strictly one after another). A fan-out of M rows sent with ``send_many`` inside
``workpump.batch()`` with a callback is compared with the same fan-out without a batch:
the overhead is the ratio of drain times minus one (the batch's counts are kept by every
member's completion).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench import harness as h
from bench.throughput import Case, run_case

STREAM = "hot"


def cases(chain_jobs: int, fanout_jobs: int) -> dict[str, Case]:
    return {
        "stream": Case("workpump", 1, None, chain_jobs, name="wf_stream", stream=STREAM),
        "chain": Case("workpump", 1, None, chain_jobs, name="wf_chain", variant="chain"),
        "fanout": Case("workpump", 1, None, fanout_jobs, name="wf_fanout", variant="many"),
        "fanin": Case("workpump", 1, None, fanout_jobs, name="wf_fanin", variant="batch"),
    }


def run(
    server: h.Server,
    database: str,
    chain_jobs: int,
    fanout_jobs: int,
    workdir: Path,
    reps: int = 1,
) -> dict[str, Any]:
    """Every case ``reps`` times, the order reversed every other round; ratios are the
    medians of the ratios of one round's cases."""
    rounds: list[dict[str, dict[str, Any]]] = []
    for rep in range(reps):
        named = list(cases(chain_jobs, fanout_jobs).items())
        this_round: dict[str, dict[str, Any]] = {}
        for name, case in named if rep % 2 == 0 else reversed(named):
            result = run_case(server, database, case, rep, workdir)
            this_round[name] = result
            rate = result.get("rate")
            h.log(
                f"workflow {name} (round {rep + 1}/{reps}): "
                + (f"{rate:,.0f} rows/s" if rate else f"FAILED {result.get('error')}")
            )
        rounds.append(this_round)

    def median_of(pairs: list[tuple[Any, Any]], f: Any) -> float | None:
        if not pairs or any(a is None or b is None for a, b in pairs):
            return None
        return statistics.median(f(a, b) for a, b in pairs)

    chain_ratio = median_of(
        [(r["chain"].get("rate"), r["stream"].get("rate")) for r in rounds], lambda a, b: a / b
    )
    fanin_overhead = median_of(
        [(r["fanin"].get("seconds"), r["fanout"].get("seconds")) for r in rounds],
        lambda a, b: a / b - 1,
    )
    runs = {
        name: {
            "jobs": rounds[-1][name].get("jobs"),
            "rates": [r[name].get("rate") for r in rounds],
            "seconds": [r[name].get("seconds") for r in rounds],
            "error": rounds[-1][name].get("error"),
        }
        for name in rounds[-1]
    }
    return {
        "runs": runs,
        "rounds": reps,
        "summary": {
            "workflow_chain_vs_stream_ratio": chain_ratio,
            "workflow_fanin_overhead": fanin_overhead,
            "chain_rows_per_s": statistics.median([r for r in runs["chain"]["rates"] if r] or [0]),
            "stream_rows_per_s": statistics.median(
                [r for r in runs["stream"]["rates"] if r] or [0]
            ),
        },
    }
