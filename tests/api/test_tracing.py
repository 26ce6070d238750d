"""OpenTelemetry tracing: producer spans, the trace context in each row's headers, and a
consumer span per handler run that is a child of, and links to, its producer's span.

Spans of this process are recorded by the SDK's in-memory exporter; the runworkpump
child of the cross-process test writes its spans to a file (tests/settings_tracing.py).
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import override_settings

pytest.importorskip("opentelemetry.sdk.trace")

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.util._once import Once

import django_workpump as workpump
from django_workpump import models, tracing
from django_workpump.producer import InvalidWork
from django_workpump.registry import registry
from django_workpump.testing import RunReport, run_pending
from tests.helpers import FAST_PROCESS, run_sql

TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")
EXPORTER = InMemorySpanExporter()
SEEN: list[dict[str, Any]] = []  # what the in-process handlers saw


@pytest.fixture(scope="module", autouse=True)
def sdk() -> Iterator[None]:
    """An SDK tracer provider, the process's global one while this module's tests run.

    It is unset after them (as OpenTelemetry's own test utilities do), so the rest of
    the suite runs without one. pytest-django runs transactional tests last, so this may
    run twice per session.
    """
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(provider)
    yield
    EXPORTER.clear()
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None


@pytest.fixture(autouse=True)
def handlers() -> Iterator[None]:
    EXPORTER.clear()
    SEEN.clear()

    @workpump.outbox_handler("tr.sync")
    def sync_handler(work):
        SEEN.append({"headers": work.headers, "span": _current()})

    @workpump.outbox_handler("tr.async")
    async def async_handler(work):
        SEEN.append({"headers": work.headers, "span": _current()})

    @workpump.outbox_handler("tr.fail")
    def failing_handler(work):
        raise ValueError("tr.fail cannot")

    @workpump.perspective("tr.view", events=["tr.happened"])
    def view(work):
        SEEN.append({"headers": work.headers, "span": _current()})

    @workpump.receptor("tr.react", events=["tr.happened"])
    def react(work):
        SEEN.append({"headers": work.headers, "span": _current()})

    yield
    for category, topic in [
        ("outbox", "tr.sync"),
        ("outbox", "tr.async"),
        ("outbox", "tr.fail"),
        ("perspective_event", "tr.view"),
        ("receptor", "tr.react"),
    ]:
        registry.unregister(category, topic)


def _current() -> tuple[int, int]:
    context = trace.get_current_span().get_span_context()
    return context.trace_id, context.span_id


def spans(kind: SpanKind | None = None) -> list[ReadableSpan]:
    return [s for s in EXPORTER.get_finished_spans() if kind is None or s.kind == kind]


def ids_of(traceparent: str) -> tuple[int, int]:
    found = TRACEPARENT.match(traceparent)
    assert found, f"not a W3C traceparent: {traceparent!r}"
    return int(found.group(1), 16), int(found.group(2), 16)


def stored_headers(table: str, where: str, params: list[Any]) -> list[Any]:
    rows = run_sql(f"SELECT headers::text FROM {table} WHERE {where} ORDER BY seq", params)
    return [None if row["headers"] is None else json.loads(row["headers"]) for row in rows]


# -- producers ---------------------------------------------------------------------------


@pytest.mark.django_db
def test_send_stores_the_context_of_its_producer_span_in_the_rows_headers():
    message_id = workpump.send("tr.sync", {"n": 1}, stream="s-1")

    (producer,) = spans(SpanKind.PRODUCER)
    (headers,) = stored_headers("workpump_outbox", "work_id = %s", [message_id])
    assert ids_of(headers["traceparent"]) == (
        producer.context.trace_id,
        producer.context.span_id,
    )
    assert producer.name == "send tr.sync"
    assert producer.attributes == {
        "messaging.system": "workpump",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": "tr.sync",
        "messaging.message.id": str(message_id),
        "workpump.category": "outbox",
        "workpump.stream": "s-1",
    }


@pytest.mark.django_db
def test_the_producer_span_is_a_child_of_the_current_span():
    with trace.get_tracer("test").start_as_current_span("request") as request:
        workpump.send("tr.sync", {"n": 1})
    (producer,) = spans(SpanKind.PRODUCER)
    assert producer.parent is not None
    assert producer.parent.span_id == request.get_span_context().span_id


@pytest.mark.django_db
def test_emit_copies_its_context_to_every_subscriber_row():
    event_id = workpump.emit("tr.happened", {"order": 7})

    (producer,) = spans(SpanKind.PRODUCER)
    assert producer.name == "emit tr.happened"
    assert producer.attributes["messaging.message.id"] == str(event_id)
    assert producer.attributes["workpump.category"] == "event"
    expected = (producer.context.trace_id, producer.context.span_id)
    rows = [
        *stored_headers("workpump_perspective_event", "event_id = %s", [event_id]),
        *stored_headers("workpump_receptor_processing", "event_id = %s", [event_id]),
    ]
    assert len(rows) == 2
    assert [ids_of(headers["traceparent"]) for headers in rows] == [expected, expected]


@pytest.mark.django_db
def test_receive_keeps_the_callers_headers_beside_the_trace_context():
    message_id = uuid.uuid4()
    assert workpump.receive(message_id, "tr.sync", {"n": 1}, headers={"tenant": "acme"})

    (headers,) = stored_headers("workpump_inbox", "work_id = %s", [message_id])
    assert headers["tenant"] == "acme"
    (producer,) = spans(SpanKind.PRODUCER)
    assert producer.name == "receive tr.sync"
    assert ids_of(headers["traceparent"])[1] == producer.context.span_id


@pytest.mark.django_db
def test_a_failing_producer_marks_its_span():
    workpump.send("tr.sync", {"n": 1}, unique_key="k")
    EXPORTER.clear()
    with pytest.raises(workpump.Duplicate):
        workpump.send("tr.sync", {"n": 2}, unique_key="k", on_conflict="raise")
    (producer,) = spans(SpanKind.PRODUCER)
    assert producer.status.status_code == StatusCode.ERROR
    assert producer.attributes["error.type"] == "Duplicate"
    assert [event.name for event in producer.events] == ["exception"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("headers", "problem"),
    [
        (["traceparent"], "must be a dict of str to str"),
        ({"retries": 3}, "must map str to str"),
        ({"big": "x" * 9000}, "over the limit of 8192"),
    ],
)
def test_bad_headers_are_refused_naming_the_fix(headers, problem):
    with pytest.raises(InvalidWork, match=problem):
        workpump.send("tr.sync", {"n": 1}, headers=headers)
    assert not models.Outbox.objects.exists()


@pytest.mark.django_db
@override_settings(WORKPUMP={"TRACING": False})
def test_tracing_off_makes_no_span_and_stores_only_the_callers_headers():
    plain = workpump.send("tr.sync", {"n": 1})
    given = workpump.send("tr.sync", {"n": 2}, headers={"tenant": "acme"})

    assert spans() == []
    assert stored_headers("workpump_outbox", "work_id = %s", [plain]) == [None]
    assert stored_headers("workpump_outbox", "work_id = %s", [given]) == [{"tenant": "acme"}]


@pytest.fixture
def without_opentelemetry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """django_workpump.tracing as imported where opentelemetry is not installed."""
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # the import raises ImportError
    importlib.reload(tracing)
    yield
    monkeypatch.undo()
    importlib.reload(tracing)


@pytest.mark.django_db
def test_without_opentelemetry_producing_and_handling_work_and_headers_stay_null(
    without_opentelemetry,
):
    assert not tracing.available() and not tracing.enabled()
    message_id = workpump.send("tr.sync", {"n": 1})
    event_id = workpump.emit("tr.happened", {"order": 1})

    assert run_pending() == 3
    assert stored_headers("workpump_outbox", "work_id = %s", [message_id]) == [None]
    assert stored_headers("workpump_perspective_event", "event_id = %s", [event_id]) == [None]
    assert [seen["headers"] for seen in SEEN] == [None, None, None]
    assert spans() == []


# -- the SQL producers -------------------------------------------------------------------


@pytest.mark.django_db
def test_the_sql_producers_store_p_headers_and_old_calls_still_work():
    headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT workpump.send('tr.sync', '{}'::jsonb, p_headers => %s::jsonb)",
            [json.dumps(headers)],
        )
        (with_headers,) = cursor.fetchone()
        # a positional call that stops before p_headers
        cursor.execute(
            "SELECT workpump.send('tr.sync', '{}'::jsonb, NULL, 0, NULL, 10, NULL, 10000,"
            " 1048576, 100, NULL, NULL, 'return')"
        )
        (without,) = cursor.fetchone()
    assert stored_headers("workpump_outbox", "work_id = %s", [with_headers]) == [headers]
    assert stored_headers("workpump_outbox", "work_id = %s", [without]) == [None]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ('["traceparent"]', "must be a JSON object of strings"),
        ('{"retries": 3}', "must be a JSON object of strings"),
        (json.dumps({"big": "x" * 9000}), "over the limit of 8192 bytes"),
    ],
)
def test_the_sql_producers_refuse_bad_headers(headers, message):
    calls = [
        "SELECT workpump.send('tr.sync', '{}'::jsonb, p_headers => %s::jsonb)",
        "SELECT workpump.receive(gen_random_uuid(), 'tr.sync', '{}'::jsonb,"
        " p_headers => %s::jsonb)",
        "SELECT workpump.emit('tr.happened', '{}'::jsonb, p_headers => %s::jsonb)",
    ]
    for call in calls:
        with (
            pytest.raises(Exception, match=message) as raised,
            transaction.atomic(),
            connection.cursor() as cursor,
        ):
            cursor.execute(call, [headers])
        assert getattr(raised.value.__cause__, "sqlstate", None) == "22023"


# -- consumers ---------------------------------------------------------------------------


def _check_consumer(consumer: ReadableSpan, producer: ReadableSpan) -> None:
    assert consumer.kind == SpanKind.CONSUMER
    assert consumer.context.trace_id == producer.context.trace_id
    assert consumer.parent is not None and consumer.parent.span_id == producer.context.span_id
    assert [link.context.span_id for link in consumer.links] == [producer.context.span_id]


@pytest.mark.django_db
def test_run_pending_runs_each_handler_in_a_consumer_span_of_its_producer():
    message_id = workpump.send("tr.sync", {"n": 1}, stream="s-9")
    workpump.send("tr.async", {"n": 2})
    (sync_producer, async_producer) = spans(SpanKind.PRODUCER)

    assert run_pending() == 2

    consumers = {span.name: span for span in spans(SpanKind.CONSUMER)}
    assert set(consumers) == {"process tr.sync", "process tr.async"}
    _check_consumer(consumers["process tr.sync"], sync_producer)
    _check_consumer(consumers["process tr.async"], async_producer)
    assert consumers["process tr.sync"].attributes == {
        "messaging.system": "workpump",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "tr.sync",
        "messaging.message.id": str(message_id),
        "workpump.category": "outbox",
        "workpump.attempt": 1,
        "workpump.stream": "s-9",
    }
    # the consumer span is the current span inside sync and async handlers
    inside = {(span.context.trace_id, span.context.span_id) for span in consumers.values()}
    assert {seen["span"] for seen in SEEN} == inside
    assert all(ids_of(seen["headers"]["traceparent"]) for seen in SEEN)


@pytest.mark.django_db
def test_subscribers_of_an_event_run_in_spans_of_the_emit():
    event_id = workpump.emit("tr.happened", {"order": 3})
    (producer,) = spans(SpanKind.PRODUCER)

    assert run_pending() == 2

    consumers = {span.name: span for span in spans(SpanKind.CONSUMER)}
    assert set(consumers) == {"process tr.view", "process tr.react"}
    for span in consumers.values():
        _check_consumer(span, producer)
        assert span.attributes["workpump.event_id"] == str(event_id)
        assert span.attributes["workpump.event_type"] == "tr.happened"
    assert consumers["process tr.view"].attributes["workpump.category"] == "perspective_event"
    assert consumers["process tr.react"].attributes["workpump.category"] == "receptor"


@pytest.mark.django_db
def test_a_handlers_exception_is_recorded_and_marks_its_span():
    workpump.send("tr.fail", {"n": 1})

    report = RunReport()
    run_pending(raise_errors=False, report=report)

    assert len(report.failures) == 1
    (consumer,) = spans(SpanKind.CONSUMER)
    assert consumer.status.status_code == StatusCode.ERROR
    assert consumer.status.description == "ValueError: tr.fail cannot"
    assert consumer.attributes["error.type"] == "ValueError"
    (event,) = consumer.events
    assert event.name == "exception"
    assert event.attributes["exception.type"] == "ValueError"


@pytest.mark.django_db
def test_the_claim_returns_the_rows_headers():
    from django_workpump import db
    from django_workpump.testing import TEST_INSTANCE_ID, _register

    message_id = workpump.send("tr.sync", {"n": 1}, headers={"tenant": "acme"})
    _register("default")
    (row,) = db.claim_work(
        instance_id=TEST_INSTANCE_ID, max_rows=10, lease_seconds=60, partition_count=10_000
    )
    assert row.work_id == message_id
    assert row.headers is not None and row.headers["tenant"] == "acme"
    assert TRACEPARENT.match(row.headers["traceparent"])


UNREADABLE_HEADERS = [
    '{"traceparent": 5, "tracestate": ["x"]}',
    '{"traceparent": {"a": 1}, "tracestate": 7, "tenant": "acme"}',
    '{"tracestate": null}',
]


@pytest.mark.django_db
@pytest.mark.parametrize("headers", UNREADABLE_HEADERS)
def test_headers_tracing_cannot_read_never_fail_the_row(headers):
    message_id = workpump.send("tr.sync", {"n": 1})
    run_sql(
        "UPDATE workpump_outbox SET headers = %s::jsonb WHERE work_id = %s",
        [headers, message_id],
    )
    EXPORTER.clear()

    report = RunReport()
    assert run_pending(raise_errors=False, report=report) == 1

    assert report.failures == []
    (row,) = run_sql(
        "SELECT attempts, done_at, dead_lettered_at FROM workpump_outbox WHERE work_id = %s",
        [message_id],
    )
    assert row["attempts"] == 1 and row["done_at"] is not None
    assert row["dead_lettered_at"] is None
    (consumer,) = spans(SpanKind.CONSUMER)  # a span of its own: no producer to link
    assert consumer.parent is None and list(consumer.links) == []


@pytest.mark.django_db
def test_a_batch_with_unreadable_headers_runs_and_links_only_the_readable_ones(batch_handlers):
    for n in range(2):
        workpump.emit("tr.batched", {"n": n}, stream="s-1")
    (_, second) = spans(SpanKind.PRODUCER)
    run_sql(
        "UPDATE workpump_perspective_event SET headers = %s::jsonb WHERE event_id IN"
        " (SELECT event_id FROM workpump_event WHERE payload = '{\"n\": 0}')",
        ['{"traceparent": 5}'],
    )
    EXPORTER.clear()

    assert run_pending() == 4

    consumers = {span.name: span for span in spans(SpanKind.CONSUMER)}
    assert [link.context.span_id for link in consumers["process tr.batch"].links] == [
        second.context.span_id
    ]
    assert len(consumers["process tr.batch.async"].links) == 2  # its rows were not touched


# -- batch handlers ----------------------------------------------------------------------


@pytest.fixture
def batch_handlers() -> Iterator[None]:
    @workpump.perspective("tr.batch", events=["tr.batched"], batch=True)
    def batch(works):
        SEEN.append({"n": [work.payload["n"] for work in works], "span": _current()})

    @workpump.receptor("tr.batch.async", events=["tr.batched"], batch=True)
    async def batch_async(works):
        SEEN.append({"n": [work.payload["n"] for work in works], "span": _current()})

    @workpump.receptor("tr.batch.fail", events=["tr.batch.failing"], batch=True)
    def batch_fail(works):
        raise ValueError("tr.batch.fail cannot")

    yield
    registry.unregister("perspective_event", "tr.batch")
    registry.unregister("receptor", "tr.batch.async")
    registry.unregister("receptor", "tr.batch.fail")


def _check_batch(consumer: ReadableSpan, producers: list[ReadableSpan]) -> None:
    assert consumer.kind == SpanKind.CONSUMER
    # Many producers: none is the parent, each is a link.
    assert consumer.parent is None
    assert [link.context.span_id for link in consumer.links] == [
        producer.context.span_id for producer in producers
    ]


@pytest.mark.django_db
def test_run_pending_runs_a_batch_handler_in_one_span_linked_to_every_producer(batch_handlers):
    for n in range(3):
        workpump.emit("tr.batched", {"n": n}, stream="s-1")
    producers = spans(SpanKind.PRODUCER)
    assert len(producers) == 3

    assert run_pending() == 6  # two batch subscribers, three rows each

    consumers = {span.name: span for span in spans(SpanKind.CONSUMER)}
    assert set(consumers) == {"process tr.batch", "process tr.batch.async"}
    for consumer in consumers.values():
        _check_batch(consumer, producers)
    assert consumers["process tr.batch"].attributes == {
        "messaging.system": "workpump",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "tr.batch",
        "messaging.batch.message_count": 3,
        "workpump.category": "perspective_event",
        "workpump.attempt": 1,
        "workpump.stream": "s-1",
    }
    assert consumers["process tr.batch.async"].attributes["workpump.category"] == "receptor"
    # current inside sync and async batch handlers, which got the run in one call
    inside = {(span.context.trace_id, span.context.span_id) for span in consumers.values()}
    assert {seen["span"] for seen in SEEN} == inside
    assert [seen["n"] for seen in SEEN] == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.django_db
def test_a_batch_handlers_exception_is_recorded_and_marks_its_span(batch_handlers):
    workpump.emit("tr.batch.failing", {"n": 1}, stream="s")
    workpump.emit("tr.batch.failing", {"n": 2}, stream="s")

    report = RunReport()
    run_pending(raise_errors=False, report=report)

    assert len(report.failures) == 1
    (consumer,) = spans(SpanKind.CONSUMER)
    assert consumer.attributes["messaging.batch.message_count"] == 2
    assert consumer.status.status_code == StatusCode.ERROR
    assert consumer.status.description == "ValueError: tr.batch.fail cannot"
    assert consumer.attributes["error.type"] == "ValueError"
    (event,) = consumer.events
    assert event.attributes["exception.type"] == "ValueError"


def _traced_rows(count: int, topic: str) -> tuple[list[Any], list[ReadableSpan]]:
    """``count`` claimed rows of one stream, each carrying its own producer's context."""
    import dataclasses

    from tests.fakes import make_row

    rows = []
    for n in range(count):
        with tracing.producing("emit", "event", "tr.batched") as produced:
            pass
        rows.append(
            dataclasses.replace(
                make_row("receptor"),
                topic=topic,
                stream="s",
                payload={"n": n},
                headers=produced.headers,
            )
        )
    return rows, spans(SpanKind.PRODUCER)


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_the_pump_runs_a_batch_in_one_consumer_span_current_inside_the_handler(is_async):
    from django_workpump.clock import FrozenClock
    from django_workpump.pump.dispatch import Dispatcher
    from django_workpump.pump.lease import LeaseRegistry
    from django_workpump.registry import Handler, Registry
    from tests.fakes import WAIT, FakeCoordinator

    def handle(works):
        SEEN.append({"n": len(works), "span": _current()})

    async def handle_async(works):
        handle(works)

    handlers = Registry()
    func = handle_async if is_async else handle
    handlers.register(Handler("receptor", "tr.pumped", func, events=("tr.batched",), batch=True))
    coordinator = FakeCoordinator()
    dispatcher = Dispatcher(
        coordinator, handlers, LeaseRegistry(), concurrency=1, clock=FrozenClock()
    )
    rows, producers = _traced_rows(3, "tr.pumped")
    dispatcher.start()
    try:
        dispatcher.submit(rows)
        assert dispatcher.wait_idle(WAIT)
    finally:
        dispatcher.stop()

    (consumer,) = spans(SpanKind.CONSUMER)
    _check_batch(consumer, producers)
    assert consumer.name == "process tr.pumped"
    assert consumer.attributes["messaging.batch.message_count"] == 3
    inside = (consumer.context.trace_id, consumer.context.span_id)
    assert [seen["span"] for seen in SEEN] == [inside]
    assert [seen["n"] for seen in SEEN] == [3]


def test_a_batch_span_links_to_the_first_producers_only():
    from django_workpump.testing import _work_of

    rows, producers = _traced_rows(tracing.MAX_BATCH_LINKS + 5, "tr.many")
    EXPORTER.clear()
    with tracing.handling_batch([_work_of(row) for row in rows]):
        pass

    (consumer,) = spans(SpanKind.CONSUMER)
    assert consumer.attributes["messaging.batch.message_count"] == len(rows)
    assert [link.context.span_id for link in consumer.links] == [
        producer.context.span_id for producer in producers[: tracing.MAX_BATCH_LINKS]
    ]
    assert consumer.links[0].attributes == {"messaging.message.id": str(rows[0].work_id)}


# -- tasks -------------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_task_enqueue_is_one_producer_span_whose_context_the_row_carries():
    pytest.importorskip("django_workpump.tasks.compat")
    from tests.settings_tasks import TASKS

    with override_settings(TASKS=TASKS):
        from tests import task_funcs

        result = task_funcs.add.enqueue(1, 2)

    (producer,) = spans(SpanKind.PRODUCER)  # the enqueue, no inner receive span
    assert producer.name.startswith("enqueue ")
    assert producer.attributes["workpump.task"] == "tests.task_funcs.add"
    assert producer.attributes["messaging.message.id"] == result.id
    (headers,) = stored_headers("workpump_inbox", "work_id = %s", [result.id])
    assert ids_of(headers["traceparent"])[1] == producer.context.span_id


# -- across processes --------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_runworkpump_process_continues_the_trace_of_a_producer_in_another(
    pump_process, tmp_path: Path
):
    sent = {
        topic: workpump.send(topic, {"n": n}, **({"max_attempts": 1} if "fail" in topic else {}))
        for n, topic in enumerate(["trace.sync", "trace.async", "trace.fail"])
    }
    producers = {span.attributes["messaging.message.id"]: span for span in spans()}
    assert len(producers) == 3

    spans_file = tmp_path / "spans.jsonl"
    child = pump_process(
        "--drain",
        settings_module="tests.settings_tracing",
        timings={**FAST_PROCESS, "MAX_ATTEMPTS": 1},
        extra_env={"WORKPUMP_TEST_SPANS": str(spans_file)},
    )
    output, _ = child.communicate(timeout=120)
    assert child.returncode == 0, output

    exported = [json.loads(line) for line in spans_file.read_text().splitlines()]
    consumers = {
        span["attributes"]["messaging.message.id"]: span
        for span in exported
        if span["kind"] == "SpanKind.CONSUMER"
    }
    assert set(consumers) == {str(message_id) for message_id in sent.values()}
    for message_id, consumer in consumers.items():
        producer = producers[message_id]
        trace_id = f"0x{producer.context.trace_id:032x}"
        span_id = f"0x{producer.context.span_id:016x}"
        assert consumer["context"]["trace_id"] == trace_id
        assert consumer["parent_id"] == span_id
        assert [link["context"] for link in consumer["links"]] == [
            {"trace_id": trace_id, "span_id": span_id, "trace_state": "[]"}
        ]
        assert consumer["attributes"]["messaging.system"] == "workpump"
        assert consumer["attributes"]["workpump.attempt"] == 1

    # the consumer span is current inside the sync and the async handler
    for topic in ("trace.sync", "trace.async"):
        consumer = consumers[str(sent[topic])]
        result = models.Outbox.objects.get(work_id=sent[topic]).result
        assert result == {
            "trace_id": consumer["context"]["trace_id"][2:],
            "span_id": consumer["context"]["span_id"][2:],
        }
    failed = consumers[str(sent["trace.fail"])]
    assert failed["status"]["status_code"] == "ERROR"
    assert [event["name"] for event in failed["events"]] == ["exception"]
    assert failed["events"][0]["attributes"]["exception.message"] == "trace.fail always fails"
