"""The benchmark's outbox handlers (discovered by django_workpump like admin.py)."""

from __future__ import annotations

import time
from typing import Any

import django_workpump as workpump
from bench import marks


@workpump.outbox_handler("bench.noop")
def noop(work: Any) -> None:
    marks.first_start()


@workpump.outbox_handler("bench.orm")
def orm(work: Any) -> None:
    """A handler that writes one row through the ORM: what real handlers do."""
    from bench.app.models import BenchRecord

    marks.first_start()
    BenchRecord.objects.create(n=work.payload["i"])


@workpump.outbox_handler("bench.flow")
def flow(work: Any) -> None:
    """A no-op of the flow-control section (its rows carry keys or rules)."""
    marks.first_start()


@workpump.outbox_handler("bench.flow_hold")
def flow_hold(work: Any) -> None:
    """A 50 ms call to a partner: the flow section's capped key."""
    marks.first_start()
    time.sleep(0.05)


@workpump.outbox_handler("bench.flow_mark")
def flow_mark(work: Any) -> None:
    """Mark every start (the flow section's pause latency)."""
    marks.mark("fstart", work.payload["i"])


@workpump.outbox_handler("bench.latency")
def latency(work: Any) -> None:
    marks.handler_start(work.payload["i"])


@workpump.outbox_handler("bench.hold")
def hold(work: Any) -> None:
    """Stay in flight (lease renewed by the pump) until the pump cancels the lease."""
    marks.first_start()
    work.lease.cancelled.wait(float(work.payload.get("seconds", 3600)))


@workpump.outbox_handler("bench.cancel")
def cancellable(work: Any) -> None:
    """Wait to be cancelled (bench/cancel_latency.py); mark the start and the moment
    ``work.cancelled`` turned true."""
    key = work.payload["i"]
    marks.mark("cstart", key)
    if work.lease.cancelled.wait(float(work.payload.get("seconds", 60))):
        marks.mark("cseen", key, str(work.lease.cancel_reason))
