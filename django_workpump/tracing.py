"""OpenTelemetry tracing of produced work and of handler runs (docs/tracing.md).

With ``opentelemetry-api`` installed (``pip install 'django-workpump[otel]'``), a
tracer provider set by the application (the SDK's, say) and ``WORKPUMP["TRACING"]``
true (the default), ``send``, ``receive``, ``emit`` and a task's
``enqueue`` each run in a PRODUCER span, whose context the globally configured
propagator (W3C ``traceparent``/``tracestate`` unless the application set another)
writes into the row's headers. Each handler run is a CONSUMER span whose parent is the
context read back from those headers, in whatever process claims the row, and which
also links to it (the messaging conventions' link, for tools that follow links rather
than parents). Without the package nothing here imports it; without a provider nothing
is traced; either way headers stay as the caller gave them and every helper is a no-op.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from django_workpump.conf import setting

logger = logging.getLogger("django_workpump.tracing")

try:
    from opentelemetry import propagate, trace
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode

    # The global provider until the application sets one, and the explicit no-op one.
    _NO_PROVIDER: tuple[type, ...] = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
except ImportError:  # the optional extra is not installed: tracing is off, at no cost
    propagate = trace = None  # type: ignore[assignment]
    _NO_PROVIDER = ()

if TYPE_CHECKING:
    from django_workpump.work import Work

# The instrumentation scope of every span, and ``messaging.system``.
TRACER_NAME = "django_workpump"
SYSTEM = "workpump"

# Attribute keys (OpenTelemetry messaging conventions, then this package's own).
MESSAGING_SYSTEM = "messaging.system"
OPERATION_TYPE = "messaging.operation.type"
OPERATION_NAME = "messaging.operation.name"
DESTINATION = "messaging.destination.name"
MESSAGE_ID = "messaging.message.id"
ERROR_TYPE = "error.type"
CATEGORY = "workpump.category"
ATTEMPT = "workpump.attempt"
STREAM = "workpump.stream"
EVENT_TYPE = "workpump.event_type"
EVENT_ID = "workpump.event_id"
TASK = "workpump.task"
BATCH_COUNT = "messaging.batch.message_count"

# The most producer links one batch handler's span carries (its first rows'); span
# processors cap links too (the SDK's default limit is 128).
MAX_BATCH_LINKS = 128

# True inside a producer span: a producer called within it (enqueue's receive) writes
# that span's context instead of opening a span of its own.
_producing: ContextVar[bool] = ContextVar("workpump_producing", default=False)
_tracer_of: tuple[Any, Any] | None = None  # (provider, its tracer)


def available() -> bool:
    """True when ``opentelemetry-api`` could be imported."""
    return trace is not None


def enabled() -> bool:
    """True when spans are made: the API is importable, ``TRACING`` is on and the
    application set a tracer provider (without one every span would be a no-op)."""
    return (
        trace is not None
        and bool(setting("TRACING"))
        and not isinstance(trace.get_tracer_provider(), _NO_PROVIDER)
    )


def _tracer() -> Any:
    global _tracer_of
    provider = trace.get_tracer_provider()
    if _tracer_of is None or _tracer_of[0] is not provider:
        _tracer_of = (provider, provider.get_tracer(TRACER_NAME))
    return _tracer_of[1]


def _failed(span: Any, exc: BaseException) -> None:
    span.record_exception(exc)
    span.set_attribute(ERROR_TYPE, type(exc).__qualname__)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


class Produced:
    """What a producer writes: its headers (None for none) and names its row's id."""

    __slots__ = ("headers", "span")

    def __init__(self, headers: dict[str, str] | None, span: Any = None) -> None:
        self.headers = headers
        self.span = span

    def stored(self, work_id: Any) -> None:
        """Name the stored row (or event) on the producer span."""
        if self.span is not None:
            self.span.set_attribute(MESSAGE_ID, str(work_id))

    def note(self, name: str, value: str) -> None:
        """Set one more attribute on the producer span."""
        if self.span is not None:
            self.span.set_attribute(name, value)


@contextmanager
def producing(
    operation: str,
    category: str,
    topic: str,
    *,
    stream: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Iterator[Produced]:
    """Run a producer in a PRODUCER span; its ``headers`` carry the span's context.

    ``operation`` is the producer ("send", "receive", "emit", "enqueue"), ``category``
    what it writes ("outbox", "inbox", "event"). The caller's ``headers`` are kept; the
    propagator's keys (``traceparent``, ``tracestate``) are written over theirs.
    """
    carrier = dict(headers) if headers else {}
    if not enabled():
        yield Produced(carrier or None)
        return
    if _producing.get():  # within enqueue's span: the row carries that span's context
        propagate.inject(carrier)
        yield Produced(carrier or None)
        return
    attributes: dict[str, Any] = {
        MESSAGING_SYSTEM: SYSTEM,
        OPERATION_TYPE: "send",
        OPERATION_NAME: operation,
        DESTINATION: topic,
        CATEGORY: category,
    }
    if stream is not None:
        attributes[STREAM] = stream
    with _tracer().start_as_current_span(
        f"{operation} {topic}",
        kind=SpanKind.PRODUCER,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        token = _producing.set(True)
        try:
            propagate.inject(carrier)
            yield Produced(carrier or None, span)
        except BaseException as exc:
            _failed(span, exc)
            raise
        finally:
            _producing.reset(token)


def handling(work: Work) -> AbstractContextManager[None]:
    """Run one handler call in a CONSUMER span, child of and linked to its producer's.

    The producer's context comes from ``work.headers`` through the global propagator;
    a row without one gets a span in the current context. An exception is recorded on
    the span, which is marked as an error, and raised on.
    """
    # Called for every row: without tracing, a shared no-op instead of a generator.
    return _handling(work) if enabled() else _NOT_TRACED


_NOT_TRACED: AbstractContextManager[None] = nullcontext()


def _producer_context(headers: Any) -> Any:
    """The producer's context in a row's headers; None when there is none to read.

    Headers are stored data anyone with table access can write: an entry that is not a
    string (a numeric ``traceparent``), or one the propagators choke on, is ignored, so
    tracing never fails the row it runs.
    """
    if not headers or not isinstance(headers, Mapping):
        return None
    carrier = {k: v for k, v in headers.items() if isinstance(k, str) and isinstance(v, str)}
    if not carrier:
        return None
    try:
        return propagate.extract(carrier)
    except Exception:  # a propagator's bug must not fail the work
        logger.debug("headers without a readable trace context", exc_info=True)
        return None


@contextmanager
def _handling(work: Work) -> Iterator[None]:
    parent = _producer_context(work.headers)
    links = []
    if parent is not None:
        producer = trace.get_current_span(parent).get_span_context()
        if producer.is_valid:
            links.append(Link(producer))
    attributes: dict[str, Any] = {
        MESSAGING_SYSTEM: SYSTEM,
        OPERATION_TYPE: "process",
        OPERATION_NAME: "process",
        DESTINATION: work.topic,
        MESSAGE_ID: str(work.id),
        CATEGORY: work.category,
        ATTEMPT: work.attempts,
    }
    if work.stream is not None:
        attributes[STREAM] = work.stream
    if work.event_id is not None:
        attributes[EVENT_ID] = str(work.event_id)
        attributes[EVENT_TYPE] = work.event_type or ""
    with _consumer_span(work.topic, parent, links, attributes):
        yield


@contextmanager
def handling_batch(works: Sequence[Work]) -> Iterator[None]:
    """Run one batch handler call in a CONSUMER span linked to each row's producer.

    The rows come from many producers, so none is the parent: the span is a child of the
    current context and links to the producer context of each of its first
    ``MAX_BATCH_LINKS`` rows. An exception is recorded and raised on, as in ``handling``.
    """
    if not enabled() or not works:
        yield
        return
    links = []
    for work in works[:MAX_BATCH_LINKS]:
        context = _producer_context(work.headers)
        if context is None:
            continue
        producer = trace.get_current_span(context).get_span_context()
        if producer.is_valid:
            links.append(Link(producer, {MESSAGE_ID: str(work.id)}))
    first = works[0]
    attributes: dict[str, Any] = {
        MESSAGING_SYSTEM: SYSTEM,
        OPERATION_TYPE: "process",
        OPERATION_NAME: "process",
        DESTINATION: first.topic,
        CATEGORY: first.category,
        BATCH_COUNT: len(works),
        ATTEMPT: first.attempts,
    }
    if first.stream is not None:
        attributes[STREAM] = first.stream
    with _consumer_span(first.topic, None, links, attributes):
        yield


@contextmanager
def _consumer_span(
    topic: str, parent: Any, links: list[Link], attributes: dict[str, Any]
) -> Iterator[None]:
    """A current CONSUMER span named for ``topic``; an exception is recorded, then raised."""
    with _tracer().start_as_current_span(
        f"process {topic}",
        context=parent,
        kind=SpanKind.CONSUMER,
        links=links,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield
        except BaseException as exc:
            _failed(span, exc)
            raise
