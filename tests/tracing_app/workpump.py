"""Handlers run by the runworkpump child of tests/api/test_tracing.py.

Each returns the ids of the span current while it runs, so the test can check that the
consumer span is current inside sync and async handlers alike.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

import django_workpump as workpump


def current_span() -> dict[str, str]:
    context = trace.get_current_span().get_span_context()
    return {"trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}"}


@workpump.outbox_handler("trace.sync")
def traced_sync(work: Any) -> dict[str, str]:
    return current_span()


@workpump.outbox_handler("trace.async")
async def traced_async(work: Any) -> dict[str, str]:
    return current_span()


@workpump.outbox_handler("trace.fail", max_attempts=1)
def traced_failure(work: Any) -> None:
    raise ValueError("trace.fail always fails")
