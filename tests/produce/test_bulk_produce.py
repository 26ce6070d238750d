"""send_many / emit_many: order, validation, all-or-nothing, concurrent bulk producers."""

from __future__ import annotations

import json
import random
import threading
import uuid
from collections import defaultdict
from typing import Any

import pytest
from django.db import connection, transaction

import django_workpump as workpump
from django_workpump import models, producer, producer_validation
from tests.helpers import scalar

pytestmark = pytest.mark.django_db


def outbox_in_seq_order() -> list[models.Outbox]:
    return list(models.Outbox.objects.order_by("seq"))


def test_send_many_stores_rows_in_list_order_and_returns_their_ids():
    ids = workpump.send_many(
        "emails.welcome",
        [{"n": n} for n in range(5)],
        streams=["a", None, "b", "a", 7],
        priority=3,
        max_attempts=4,
    )

    rows = outbox_in_seq_order()
    assert [row.work_id for row in rows] == ids
    assert [row.payload for row in rows] == [{"n": n} for n in range(5)]
    assert [row.stream for row in rows] == ["a", None, "b", "a", "7"]
    assert {(row.priority, row.max_attempts, row.topic) for row in rows} == {
        (3, 4, "emails.welcome")
    }
    # the first row of each stream is its head, the later one waits behind it
    assert [row.stream_head for row in rows] == [True, True, True, False, True]
    expected = scalar("SELECT workpump.partition_of('b', 10000)")
    assert rows[2].partition_number == expected
    assert rows[1].partition_number == scalar(
        "SELECT workpump.partition_of(%s, 10000)", (str(ids[1]),)
    )


def test_send_many_keeps_stream_order_after_rows_already_sent():
    first = workpump.send("emails.welcome", {"n": "single"}, stream="s")
    ids = workpump.send_many("emails.welcome", [{"n": 0}, {"n": 1}], streams=["s", "s"])

    rows = list(models.Outbox.objects.filter(stream="s").order_by("seq"))
    assert [row.work_id for row in rows] == [first, *ids]
    assert [row.stream_head for row in rows] == [True, False, False]


def test_send_many_splits_long_lists_into_chunks_all_in_order(monkeypatch):
    monkeypatch.setattr(producer, "BULK_CHUNK_ROWS", 3)
    calls: list[int] = []
    real = producer.db.send_many

    def counting(**kwargs: Any) -> list[uuid.UUID]:
        calls.append(len(kwargs["payloads_json"]))
        return real(**kwargs)

    monkeypatch.setattr(producer.db, "send_many", counting)
    ids = workpump.send_many("emails.welcome", [{"n": n} for n in range(8)], streams=["s"] * 8)

    assert calls == [3, 3, 2]
    assert [row.work_id for row in outbox_in_seq_order()] == ids
    assert [row.payload["n"] for row in outbox_in_seq_order()] == list(range(8))


def test_send_many_of_nothing_writes_nothing():
    assert workpump.send_many("emails.welcome", []) == []
    assert models.Outbox.objects.count() == 0


def nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels - 1):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("payloads", "streams", "message"),
    [
        ({"n": 1}, None, "must be a list of dicts, not dict"),
        ([{"n": 1}, "text"], None, r"outbox message 1 to 'emails.welcome' must be a dict"),
        ([{"n": 1}, {"x": float("nan")}], None, "outbox message 1 .* is not JSON"),
        ([{"n": 1}, {"x": "a\x00b"}], None, "NUL character"),
        ([{"n": 1}, {"a\x00": 1}], None, r"outbox message 1 .* NUL character .* in a key"),
        ([{"n": 1}, {"x": ["\udc80"]}], None, r"outbox message 1 .* surrogate .*\['x'\]\[0\]"),
        ([{}, {}, {"x": nested(101)}], None, r"outbox message 2 .* more than 100 levels"),
        ([{"x": object()}], None, r"outbox message 0 .* is not JSON"),
        ([{"n": 1}, {"n": 2}], ["a", 1.5], "stream of outbox message 1 .* not float"),
        ([{"n": 1}, {"n": 2}], ["a"], "one key \\(or None\\) per payload: got 2 payloads and 1"),
        ([{"n": 1}, {"n": 2}], ["a", " "], "stream of outbox message 1 .* is empty"),
        ([{"n": 1}], "abc", "must be None or a list parallel"),
    ],
)
def test_send_many_refuses_bad_input_before_writing_anything(payloads, streams, message):
    with pytest.raises(workpump.InvalidWork, match=message):
        workpump.send_many("emails.welcome", payloads, streams=streams)
    assert models.Outbox.objects.count() == 0


def test_send_many_stores_payloads_whose_text_only_looks_like_a_problem():
    # Text that resembles a NUL escape or deep nesting, which the payloads do not hold.
    payloads = [
        {"escaped": "\\u0000 is six characters here"},
        {"brackets": "[" * 150 + "{" * 150},
        {"deep": nested(99), "note": "é ✓"},
        {"key\\u0000": ["[{" * 80]},
    ]
    ids = workpump.send_many("emails.welcome", payloads)
    stored = {row.work_id: row.payload for row in models.Outbox.objects.all()}
    assert [stored[i] for i in ids] == payloads


def test_send_many_refuses_an_oversized_payload_naming_its_index(settings):
    settings.WORKPUMP = {"MAX_PAYLOAD_BYTES": 100}
    with pytest.raises(workpump.InvalidWork, match=r"outbox message 2 .*MAX_PAYLOAD_BYTES"):
        workpump.send_many("emails.welcome", [{}, {}, {"x": "y" * 200}])
    assert models.Outbox.objects.count() == 0


def test_send_many_checks_priority_and_run_after():
    with pytest.raises(workpump.InvalidWork, match="priority"):
        workpump.send_many("emails.welcome", [{}], priority=40000)
    with pytest.raises(workpump.InvalidWork, match="aware datetime"):
        workpump.send_many("emails.welcome", [{}], run_after="tomorrow")


def test_the_sql_send_many_refuses_what_send_refuses_and_writes_nothing():
    cases = [
        (
            "ARRAY['{\"a\": 1}', '[1]']::jsonb[]",
            "NULL",
            "Payload 1 of outbox destination .* JSON object",
        ),
        ("ARRAY['{}', '{}']::jsonb[]", "ARRAY['a']", "got 2 payloads and 1 streams"),
        ("ARRAY['{}']::jsonb[]", "ARRAY['   ']", "Stream 0 of outbox destination .* empty"),
        ("ARRAY['{\"a\": [[[1]]]}']::jsonb[]", "NULL", "p_max_payload_depth \\(3\\)"),
        ('ARRAY[\'{"a": "xxxxxxxxxx"}\']::jsonb[]', "NULL", "over p_max_payload_bytes \\(10\\)"),
    ]
    for payloads, streams, message in cases:
        limits = (
            "p_max_payload_depth => 3, p_max_payload_bytes => 10"
            if "x" in payloads
            else ("p_max_payload_depth => 3")
        )
        with (
            pytest.raises(Exception, match=message),
            transaction.atomic(),
            connection.cursor() as cursor,
        ):
            cursor.execute(
                f"SELECT workpump.send_many('emails.welcome', {payloads}, {streams}, {limits})"
            )
    assert models.Outbox.objects.count() == 0


def test_send_many_is_all_or_nothing_with_the_callers_transaction():
    class Boom(Exception):
        pass

    with pytest.raises(Boom), transaction.atomic():
        workpump.send_many("emails.welcome", [{"n": n} for n in range(3)])
        raise Boom
    assert models.Outbox.objects.count() == 0


def test_a_failing_chunk_rolls_back_the_chunks_before_it(monkeypatch):
    monkeypatch.setattr(producer, "BULK_CHUNK_ROWS", 2)
    # the SQL refuses the second chunk (depth 1 allows no nested containers)
    monkeypatch.setattr(producer, "MAX_DEPTH", 1)
    payloads = [{"n": 0}, {"n": 1}, {"n": 2}, {"nested": {"n": 3}}]
    monkeypatch.setattr(producer_validation, "check_payload_values", lambda what, payload: None)
    with pytest.raises(Exception, match="Payload 1 of outbox destination"):
        workpump.send_many("emails.welcome", payloads)
    assert models.Outbox.objects.count() == 0


def test_emit_many_stores_events_and_their_work_in_list_order(order_handlers):
    ids = workpump.emit_many(
        "order.placed", [{"order": n} for n in range(3)], streams=["o-1", "o-2", "o-1"]
    )

    events = list(models.Event.objects.order_by("seq"))
    assert [event.event_id for event in events] == ids
    assert [event.payload for event in events] == [{"order": n} for n in range(3)]
    perspective = list(models.PerspectiveEvent.objects.order_by("seq"))
    assert [(row.event_id, row.stream, row.stream_head) for row in perspective] == [
        (ids[0], "o-1", True),
        (ids[1], "o-2", True),
        (ids[2], "o-1", False),
    ]
    receptor = list(models.ReceptorProcessing.objects.order_by("seq"))
    assert [(row.event_id, row.max_attempts) for row in receptor] == [(i, 3) for i in ids]
    assert [row.stream_head for row in receptor] == [True, True, False]


def test_emit_many_without_subscribers_stores_only_events():
    ids = workpump.emit_many("nobody.listens", [{}, {}])
    assert list(models.Event.objects.order_by("seq").values_list("event_id", flat=True)) == ids
    assert models.PerspectiveEvent.objects.count() == 0


def test_emit_many_refuses_a_bad_payload_and_writes_nothing(order_handlers):
    with pytest.raises(workpump.InvalidWork, match=r"event 1 of type 'order\.placed'"):
        workpump.emit_many("order.placed", [{"n": 0}, ["no"]])
    assert models.Event.objects.count() == 0
    assert models.PerspectiveEvent.objects.count() == 0


def test_bulk_produced_work_wakes_listeners_after_commit(
    django_capture_on_commit_callbacks, order_handlers
):
    from django_workpump.producer import add_produced_listener, remove_produced_listener

    woken: list[str] = []
    add_produced_listener(woken.append)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            workpump.send_many("emails.welcome", [{}, {}])
            workpump.emit_many("order.placed", [{}])
            assert woken == []
    finally:
        remove_produced_listener(woken.append)
    assert woken == ["outbox", "perspective_event", "receptor"]


# --------------------------------------------------------------------------------------
# Concurrent bulk producers
# --------------------------------------------------------------------------------------

STREAMS = [f"s{n}" for n in range(6)]


@pytest.mark.django_db(transaction=True)
def test_concurrent_bulk_producers_on_overlapping_streams_never_deadlock_and_keep_fifo(
    raw_connect,
):
    """Each producer writes every stream in its own shuffled order, many times over: taking
    the stream locks row by row in list order would deadlock two of them; the sorted lock
    order makes them wait. Each call's rows of one stream stay together, in list order."""
    producers, rounds = 4, 12
    barrier = threading.Barrier(producers, timeout=30)
    errors: list[BaseException] = []

    def produce(worker: int) -> None:
        rng = random.Random(worker)
        try:
            with raw_connect() as conn:
                for round_ in range(rounds):
                    streams = [s for s in STREAMS for _ in range(3)]
                    rng.shuffle(streams)
                    payloads = [
                        json.dumps({"w": worker, "r": round_, "i": i}) for i in range(len(streams))
                    ]
                    barrier.wait()
                    with conn.transaction():
                        conn.execute(
                            "SELECT workpump.send_many('emails.welcome', %s::jsonb[], %s)",
                            (payloads, streams),
                        )
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=produce, args=(w,)) for w in range(producers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a producer is stuck"
    assert not [e for e in errors if not isinstance(e, threading.BrokenBarrierError)], errors
    assert not errors

    conn = raw_connect()
    rows = conn.execute(
        "SELECT stream, payload, stream_head FROM workpump_outbox ORDER BY seq"
    ).fetchall()
    assert len(rows) == producers * rounds * len(STREAMS) * 3
    by_stream: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_stream[row["stream"]].append(row)
    for stream, stream_rows in by_stream.items():
        assert [row["stream_head"] for row in stream_rows] == [True] + [False] * (
            len(stream_rows) - 1
        ), stream
        calls = [(row["payload"]["w"], row["payload"]["r"]) for row in stream_rows]
        # one call's rows of a stream are contiguous and in list order
        seen: list[tuple[int, int]] = []
        for call in calls:
            if not seen or seen[-1] != call:
                assert call not in seen, f"{stream}: the rows of call {call} interleave"
                seen.append(call)
        for call in seen:
            indexes = [
                row["payload"]["i"]
                for row in stream_rows
                if (row["payload"]["w"], row["payload"]["r"]) == call
            ]
            assert indexes == sorted(indexes), (stream, call)
        # each producer's calls keep their own order in every stream
        for worker in range(producers):
            assert [r for w, r in seen if w == worker] == list(range(rounds))


@pytest.mark.django_db(transaction=True)
def test_a_bulk_producer_in_reverse_order_waits_instead_of_deadlocking(raw_connect):
    """Two open transactions: the first holds stream a (a single send); the second asks
    for b then a in one bulk call, takes the locks sorted, a first, and waits there holding
    nothing; the first then writes b and commits. Locking in list order would have taken
    b, then waited for a while the first waits for b: a deadlock."""
    first, second = raw_connect(), raw_connect()
    first.execute("BEGIN")
    first.execute("SELECT workpump.send('d', '{}', p_stream => 'a')")
    done = threading.Event()
    failure: list[BaseException] = []

    def bulk() -> None:
        try:
            with second.transaction():
                second.execute(
                    "SELECT workpump.send_many('d', ARRAY['{\"n\": 1}', '{\"n\": 2}']::jsonb[],"
                    " ARRAY['b', 'a'])"
                )
        except BaseException as exc:  # noqa: BLE001
            failure.append(exc)
        done.set()

    thread = threading.Thread(target=bulk)
    thread.start()
    waiting = (
        "SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid = %s"
    )
    for _ in range(300):
        if first.execute(waiting, (second.info.backend_pid,)).fetchone()["n"]:
            break
        threading.Event().wait(0.05)
    first.execute("SELECT workpump.send('d', '{}', p_stream => 'b')")
    first.execute("COMMIT")
    thread.join(30)
    assert done.is_set() and not failure, failure
    rows = first.execute("SELECT stream, payload FROM workpump_outbox ORDER BY seq").fetchall()
    assert [(r["stream"], r["payload"]) for r in rows] == [
        ("a", {}),
        ("b", {}),
        ("b", {"n": 1}),
        ("a", {"n": 2}),
    ]


def test_an_unordered_row_without_a_partition_still_gets_one_from_the_trigger():
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO workpump_outbox (work_id, topic, payload, max_attempts)"
            " VALUES (gen_random_uuid(), 'raw.insert', '{}', 3) RETURNING partition_number,"
            " stream_head, seq"
        )
        partition, head, seq = cursor.fetchone()
    assert head is True
    assert partition == scalar("SELECT workpump.partition_of(%s, 10000)", (str(seq),))
