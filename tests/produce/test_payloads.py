"""Payloads checked at the door and decoded one row at a time.

The SQL producers refuse payloads over ``p_max_payload_bytes`` or nested deeper than
``p_max_payload_depth``; the Python producers refuse what PostgreSQL cannot store (NUL,
surrogates, long stream keys) and over-deep payloads with ``InvalidWork``. Rows that got
in anyway (written before v5, or by a plain INSERT) and that Python cannot decode are
dead-lettered alone by the claim as ``undecodable_payload``; their batch-mates run, and
the admin shows such a payload as stored.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.db import DataError, connection, transaction
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext

import django_workpump as workpump
from django_workpump import db, models
from django_workpump.conf import DEFAULTS
from django_workpump.db import Outcome
from django_workpump.payloads import MAX_DEPTH, UndecodablePayload, decode, nesting_depth
from django_workpump.pump.claim import ClaimPolicy, ClaimWorker
from django_workpump.pump.coordinator import DatabaseCoordinator, InstanceIdentity
from django_workpump.pump.supervisor import EXIT_OK
from django_workpump.registry import registry
from tests.fakes import FakeCoordinator, FakeSink, make_row, watching
from tests.helpers import FAST_PUMP, drain, run_sql, scalar

# Past Python's recursion limit (json.loads raises RecursionError), within PostgreSQL's
# stack for jsonb input (about 10k levels at the default max_stack_depth).
DEEP = 5000
HUGE_INT = "9" * 5000  # past Python's int-string digit limit (4300)


def nested(levels: int, leaf: str = "1") -> str:
    """JSON text of an object whose key "deep" holds ``levels - 1`` nested arrays."""
    return '{"deep": ' + "[" * (levels - 1) + leaf + "]" * (levels - 1) + "}"


DEEP_PAYLOAD = nested(DEEP)
HUGE_PAYLOAD = '{"big": ' + HUGE_INT + "}"


def sql_error(query: str, params: Any = None) -> psycopg.Error:
    """Run ``query`` in a savepoint; return the psycopg error it raised."""
    with pytest.raises(DataError) as raised, transaction.atomic():
        run_sql(query, params)
    cause = raised.value.__cause__
    assert isinstance(cause, psycopg.Error)
    return cause


def insert_outbox(payload_text: str, destination: str = "pl.good") -> uuid.UUID:
    """An outbox row written past the producers, by a plain INSERT."""
    return scalar(  # type: ignore[no-any-return]
        "INSERT INTO workpump_outbox (work_id, topic, payload, partition_number)"
        " VALUES (gen_random_uuid(), %s, %s::jsonb, 0) RETURNING work_id",
        [destination, payload_text],
    )


def insert_event_work(payload_text: str, perspective: str = "pl.totals") -> uuid.UUID:
    """An event with ``payload_text`` and one perspective row on it, written past emit."""
    event_id = uuid.uuid4()
    run_sql(
        "INSERT INTO workpump_event (event_id, event_type, payload) VALUES (%s, 'pl.placed', %s)",
        [event_id, payload_text],
    )
    return scalar(  # type: ignore[no-any-return]
        "INSERT INTO workpump_perspective_event (work_id, topic, event_id,"
        " partition_number) VALUES (gen_random_uuid(), %s, %s, 0) RETURNING work_id",
        [perspective, event_id],
    )


# -- the guarded decoder ---------------------------------------------------------------------


def test_nesting_depth_counts_objects_and_arrays_and_skips_strings():
    assert nesting_depth("{}") == 1
    assert nesting_depth('{"a": [[]], "b": {}}') == 3
    assert nesting_depth('{"a": "[[[{\\"]]"}') == 1
    assert nesting_depth(nested(DEEP)) == DEEP
    assert nesting_depth('"text"') == 0


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (nested(DEEP), f"nests objects and arrays {DEEP} levels deep, more than the 512"),
        (HUGE_PAYLOAD, "Exceeds the limit (4300 digits)"),
        ('{"a": ', "Expecting value"),
    ],
    ids=["deep", "huge-int", "truncated"],
)
def test_decode_refuses_what_python_cannot_decode_with_one_error_type(text, words):
    with pytest.raises(UndecodablePayload) as refused:
        decode(text)
    assert words in str(refused.value)


def test_decode_decodes_up_to_its_depth_limit():
    assert decode(nested(512, "7")) is not None
    assert decode('{"n": 1}') == {"n": 1}


# -- the SQL producers -----------------------------------------------------------------------

SEND = "SELECT workpump.send('pl.good', %s::jsonb, p_max_payload_bytes => %s)"
RECEIVE = (
    "SELECT workpump.receive(gen_random_uuid(), 'pl.inbox', %s::jsonb, p_max_payload_bytes => %s)"
)
EMIT = "SELECT workpump.emit('pl.placed', %s::jsonb, p_max_payload_bytes => %s)"
PRODUCERS = {"send": SEND, "receive": RECEIVE, "emit": EMIT}
NAMED = {
    "send": "outbox destination 'pl.good'",
    "receive": "inbox handler 'pl.inbox'",
    "emit": "event type 'pl.placed'",
}


@pytest.mark.django_db
@pytest.mark.parametrize("producer", PRODUCERS)
def test_sql_producers_refuse_a_payload_over_p_max_payload_bytes(producer):
    payload = json.dumps({"x": "y" * 100})  # {"x": "yyy..."}: 109 bytes as jsonb text
    error = sql_error(PRODUCERS[producer], [payload, 100])
    assert error.sqlstate == "22023"
    assert str(error.diag.message_primary) == (
        f"The payload of {NAMED[producer]} is 109 bytes of JSON, over p_max_payload_bytes "
        "(100): store large data elsewhere and send a reference to it."
    )
    assert scalar(PRODUCERS[producer], [payload, 109]) is not None  # the limit is inclusive


@pytest.mark.django_db
@pytest.mark.parametrize("producer", PRODUCERS)
@pytest.mark.parametrize("levels", [MAX_DEPTH + 1, DEEP])
def test_sql_producers_refuse_a_payload_nested_deeper_than_p_max_payload_depth(producer, levels):
    error = sql_error(PRODUCERS[producer], [nested(levels), 10_000_000])
    assert error.sqlstate == "22023"
    message = str(error.diag.message_primary)
    assert f"nests objects and arrays more than p_max_payload_depth ({MAX_DEPTH}) levels" in (
        message
    )
    assert "flatten it" in message


@pytest.mark.django_db
def test_the_depth_limit_is_the_same_in_sql_and_python_and_can_be_passed():
    at_limit = nested(MAX_DEPTH)
    assert nesting_depth(at_limit) == MAX_DEPTH
    assert scalar(SEND, [at_limit, 10_000]) is not None
    workpump.send("pl.good", json.loads(at_limit))  # the Python producer agrees
    deeper = nested(300)
    assert sql_error(SEND, [deeper, 10_000]).sqlstate == "22023"
    assert scalar(
        "SELECT workpump.send('pl.good', %s::jsonb, p_max_payload_depth => 300)", [deeper]
    )


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        ("p_max_payload_bytes => 0", "p_max_payload_bytes must be at least 1, not 0."),
        ("p_max_payload_bytes => NULL", "p_max_payload_bytes must be at least 1, not NULL."),
        ("p_max_payload_depth => 0", "p_max_payload_depth must be between 1 and 512"),
        ("p_max_payload_depth => 513", "(the deepest payload the pump decodes), not 513."),
    ],
)
def test_sql_producers_refuse_limits_out_of_range(arguments, words):
    error = sql_error(f"SELECT workpump.send('pl.good', '{{}}', {arguments})")
    assert error.sqlstate == "22023"
    assert words in str(error.diag.message_primary)


@pytest.mark.django_db
def test_the_sql_default_size_limit_is_the_settings_default():
    arguments = run_sql(
        "SELECT p.proname, pg_get_function_arguments(p.oid) AS arguments FROM pg_proc p"
        " WHERE p.pronamespace = 'workpump'::regnamespace"
        " AND p.proname IN ('send', 'receive', 'emit')"
    )
    assert len(arguments) == 3
    for row in arguments:
        assert (
            f"p_max_payload_bytes bigint DEFAULT {DEFAULTS['MAX_PAYLOAD_BYTES']}, "
            f"p_max_payload_depth integer DEFAULT {MAX_DEPTH}"
        ) in row["arguments"], row


@pytest.mark.django_db
@override_settings(WORKPUMP={"MAX_PAYLOAD_BYTES": 4321})
def test_the_python_producers_pass_the_configured_limits_through():
    with CaptureQueriesContext(connection) as queries:
        workpump.send("pl.good", {"n": 1})
        workpump.receive(uuid.uuid4(), "pl.inbox", {"n": 1})
        workpump.emit("pl.placed", {"n": 1})
    produced = [q["sql"] for q in queries.captured_queries]
    assert len(produced) == 3
    for query in produced:
        assert "p_max_payload_bytes => 4321" in query
        assert f"p_max_payload_depth => {MAX_DEPTH}" in query


@pytest.mark.django_db
def test_the_size_the_python_producer_measures_is_the_one_sql_checks():
    payload = {"list": list(range(200)), "text": "é ünï 中文 😀", "nested": {"a": [1, {"b": 2}]}}
    workpump.send("pl.good", payload)
    stored = scalar("SELECT octet_length(payload::text) FROM workpump_outbox")
    measured = len(json.dumps(payload, ensure_ascii=False).encode())
    assert measured == stored


# -- the Python producers --------------------------------------------------------------------


def deep_dict(levels: int) -> dict[str, Any]:
    payload: dict[str, Any] = {}
    inner = payload
    for _ in range(levels - 1):
        inner["d"] = {}
        inner = inner["d"]
    return payload


def deep_list(levels: int) -> list[Any]:
    payload: list[Any] = []
    for _ in range(levels - 1):
        payload = [payload]
    return payload


def looped() -> dict[str, Any]:
    payload: dict[str, Any] = {}
    payload["me"] = payload
    return payload


REFUSED: list[tuple[str, Callable[[], Any], str]] = [
    (
        "a stream key over 512 bytes",
        lambda: workpump.send("pl.good", {}, stream="é" * 257),
        "is 514 bytes in UTF-8, over the limit of 512 bytes. Use a shorter key",
    ),
    (
        "an int stream key past the digit limit",
        lambda: workpump.emit("pl.placed", {}, stream=10**5000),
        "is an int of more than 4300 digits, over the limit of 512 bytes",
    ),
    (
        "a NUL in a stream key",
        lambda: workpump.send("pl.good", {}, stream="a\x00b"),
        "has a NUL character (\\x00). Use a key of printable text",
    ),
    (
        "a lone surrogate in a stream key",
        lambda: workpump.receive(uuid.uuid4(), "pl.inbox", {}, stream="a\udcff"),
        "has a surrogate code point (U+DCFF, not valid Unicode). Use a key",
    ),
    (
        "a NUL in a payload string",
        lambda: workpump.send("pl.good", {"a": ["x", "nul\x00"]}),
        "has a NUL character (\\x00) in payload['a'][1]. Remove it, or encode binary data",
    ),
    (
        "a NUL in a payload key",
        lambda: workpump.emit("pl.placed", {"a": {"k\x00": 1}}),
        "has a NUL character (\\x00) in a key of payload['a']",
    ),
    (
        "a lone surrogate in a payload string",
        lambda: workpump.send("pl.good", {"name": b"caf\xe9".decode("utf-8", "surrogateescape")}),
        "has a surrogate code point (U+DCE9, not valid Unicode) in payload['name']",
    ),
    (
        "a lone surrogate in a payload key",
        lambda: workpump.receive(uuid.uuid4(), "pl.inbox", {"\ud800": 1}),
        "has a surrogate code point (U+D800, not valid Unicode) in a key of payload.",
    ),
    (
        "a payload one level too deep",
        lambda: workpump.send("pl.good", deep_dict(MAX_DEPTH + 1)),
        f"nests dicts and lists more than {MAX_DEPTH} levels deep under payload['d']",
    ),
    (
        "a payload past the recursion limit",
        lambda: workpump.emit("pl.placed", {"deep": deep_list(DEEP)}),
        "or contains itself. Flatten it",
    ),
    (
        "a payload that contains itself",
        lambda: workpump.send("pl.good", looped()),
        "or contains itself",
    ),
    (
        "a NUL in a destination",
        lambda: workpump.send("pl.\x00", {}),
        "The outbox destination 'pl.\\x00' has a NUL character",
    ),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("case", "call", "words"), REFUSED, ids=[c for c, _, _ in REFUSED])
def test_python_producers_refuse_what_postgresql_cannot_store_with_invalid_work(case, call, words):
    with pytest.raises(workpump.InvalidWork) as refused:
        call()
    message = str(refused.value)
    assert words in message, message
    assert message.endswith(".")
    # Nothing reached the database: the transaction goes on.
    assert scalar("SELECT count(*) FROM workpump_outbox") == 0


@pytest.mark.django_db
def test_python_producers_accept_a_stream_key_of_exactly_512_bytes_and_any_unicode():
    workpump.send("pl.good", {"text": "😀 é \u2028", "k": {"中": [None, True]}}, stream="é" * 256)
    assert scalar("SELECT octet_length(stream) FROM workpump_outbox") == 512


# -- the claim ---------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_claim_decodes_each_row_and_flags_only_the_undecodable_ones():
    good = [workpump.send("pl.good", {"n": n}) for n in range(3)]
    deep = insert_outbox(DEEP_PAYLOAD)
    huge = scalar("SELECT workpump.send('pl.good', %s::jsonb)", [HUGE_PAYLOAD])
    instance_id = uuid.uuid4()
    scalar("SELECT workpump.record_heartbeat(%s, 'tests', 'host', 1)", [instance_id])
    rows = db.claim_work(instance_id=instance_id, max_rows=10, lease_seconds=300,
                         partition_count=10_000)  # fmt: skip
    by_id = {row.work_id: row for row in rows}
    assert set(by_id) == {*good, deep, huge}
    assert [by_id[work_id].payload for work_id in good] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert all(by_id[work_id].payload_error is None for work_id in good)
    assert by_id[deep].payload == {}
    assert "5000 levels deep" in str(by_id[deep].payload_error)
    assert "Exceeds the limit (4300 digits)" in str(by_id[huge].payload_error)


@pytest.mark.django_db
def test_the_claim_worker_hands_over_the_good_rows_and_dead_letters_only_the_bad_ones():
    good = [workpump.send("pl.good", {"n": n}) for n in range(3)]
    deep = insert_outbox(DEEP_PAYLOAD)
    huge = scalar("SELECT workpump.send('pl.good', %s::jsonb)", [HUGE_PAYLOAD])
    event_work = insert_event_work(nested(DEEP))
    sink = FakeSink(free=10)
    coordinator = DatabaseCoordinator(InstanceIdentity())
    coordinator.heartbeat({})  # registered: only a registered instance may claim
    worker = ClaimWorker(coordinator, sink, ClaimPolicy())

    result = worker.run_once()

    assert result.error is None
    assert result.claimed == 6
    (batch,) = sink.batches
    assert sorted(row.payload["n"] for row in batch) == [0, 1, 2]
    assert {row.work_id for row in batch} == set(good)
    parked = run_sql(
        "SELECT work_id AS id, attempts, failure_reason, last_error, instance_id,"
        " payload::text AS raw FROM workpump_outbox WHERE dead_lettered_at IS NOT NULL"
        " UNION ALL SELECT p.work_id, p.attempts, p.failure_reason, p.last_error,"
        " p.instance_id, e.payload::text FROM workpump_perspective_event p"
        " JOIN workpump_event e USING (event_id) WHERE p.dead_lettered_at IS NOT NULL"
    )
    assert {row["id"] for row in parked} == {deep, huge, event_work}
    for row in parked:
        assert row["failure_reason"] == "undecodable_payload"
        assert row["attempts"] == 1
        assert row["instance_id"] is None
        assert row["last_error"].startswith("the payload cannot be decoded: ")
    raw = {row["id"]: row["raw"] for row in parked}
    assert raw[huge] == '{"big": ' + HUGE_INT + "}"  # kept as written
    assert nesting_depth(raw[deep]) == DEEP
    held = models.Outbox.objects.filter(work_id__in=good, instance_id__isnull=False)
    assert sorted(held.values_list("attempts", flat=True)) == [1, 1, 1]


def test_a_failure_to_park_undecodable_rows_does_not_hold_back_their_batch_mates():
    good, bad = make_row(), dataclasses.replace(make_row(), payload={}, payload_error="deep")

    class Refusing(FakeCoordinator):
        def dead_letter(self, *args: Any) -> list[Outcome]:
            super().dead_letter(*args)
            raise RuntimeError("dead_letter failed: connection lost")

    coordinator = Refusing(claims=[[good, bad]])
    sink = FakeSink(free=4)
    with watching("django_workpump.claim") as log:
        result = ClaimWorker(coordinator, sink, ClaimPolicy()).run_once()
    assert result.claimed == 2 and result.error is None
    assert sink.batches == [[good]]
    assert coordinator.dead_lettered == [(bad.work_id, "the payload cannot be decoded: deep")]
    assert log.wait_for("dead_letter_failed", timeout=0)


@pytest.fixture
def recorded() -> Iterator[list[tuple[str, int, Any]]]:
    """Handlers for pl.good and pl.totals that record (topic, attempt, payload)."""
    seen: list[tuple[str, int, Any]] = []
    lock = threading.Lock()

    def handle(work: Any) -> None:
        with lock:
            seen.append((work.topic, work.attempts, work.payload))

    workpump.outbox_handler("pl.good")(handle)
    workpump.perspective("pl.totals", events=["pl.placed"])(handle)
    yield seen
    registry.unregister("outbox", "pl.good")
    registry.unregister("perspective_event", "pl.totals")


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP={**FAST_PUMP, "CONCURRENCY": 4})
def test_a_pump_runs_the_good_rows_once_and_parks_the_undecodable_ones_unrun(recorded, pump):
    good = [workpump.send("pl.good", {"n": n}, stream=f"s-{n % 2}") for n in range(6)]
    deep = insert_outbox(DEEP_PAYLOAD)
    huge = scalar("SELECT workpump.send('pl.good', %s::jsonb)", [HUGE_PAYLOAD])
    event_work = insert_event_work(HUGE_PAYLOAD)

    assert drain(pump(drain=True)) == EXIT_OK

    assert sorted(n for _, _, payload in recorded for n in [payload.get("n")]) == list(range(6))
    assert {attempt for _, attempt, _ in recorded} == {1}
    done = models.Outbox.objects.filter(work_id__in=good, done_at__isnull=False)
    assert sorted(done.values_list("attempts", flat=True)) == [1] * 6
    dead = run_sql(
        "SELECT work_id AS id, failure_reason, attempts FROM workpump_outbox"
        " WHERE dead_lettered_at IS NOT NULL UNION ALL"
        " SELECT work_id, failure_reason, attempts FROM workpump_perspective_event"
        " WHERE dead_lettered_at IS NOT NULL"
    )
    assert {(r["id"], r["failure_reason"], r["attempts"]) for r in dead} == {
        (deep, "undecodable_payload", 1),
        (huge, "undecodable_payload", 1),
        (event_work, "undecodable_payload", 1),
    }


# -- the admin ---------------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("text", [DEEP_PAYLOAD, HUGE_PAYLOAD], ids=["deep", "huge-int"])
def test_the_admin_shows_an_undecodable_outbox_payload_as_stored(admin_client: Client, text):
    work_id = insert_outbox(text)
    row = models.Outbox.objects.defer("payload").get(work_id=work_id)

    listing = admin_client.get("/admin/workpump/outbox/")
    assert listing.status_code == 200
    assert str(work_id) in listing.content.decode()

    page = admin_client.get(f"/admin/workpump/outbox/{row.pk}/change/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "Shown as stored: this payload cannot be decoded" in html
    stored = scalar("SELECT payload::text FROM workpump_outbox WHERE seq = %s", [row.pk])
    assert stored[:200].replace('"', "&quot;") in html


@pytest.mark.django_db
def test_the_admin_shows_an_undecodable_event_payload_as_stored(admin_client: Client):
    work_id = insert_event_work(HUGE_PAYLOAD)
    pk = models.PerspectiveEvent.objects.get(work_id=work_id).pk

    assert admin_client.get("/admin/workpump/perspectiveevent/").status_code == 200
    page = admin_client.get(f"/admin/workpump/perspectiveevent/{pk}/change/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "Shown as stored: this payload cannot be decoded" in html
    assert HUGE_INT in html


@pytest.mark.django_db
def test_the_admin_still_indents_a_payload_it_can_decode(admin_client: Client):
    work_id = workpump.send("pl.good", {"b": [1, 2], "a": "x"})
    pk = models.Outbox.objects.get(work_id=work_id).pk
    html = admin_client.get(f"/admin/workpump/outbox/{pk}/change/").content.decode()
    assert "cannot be decoded" not in html
    assert "{\n  &quot;a&quot;: &quot;x&quot;,\n  &quot;b&quot;: [\n    1," in html
