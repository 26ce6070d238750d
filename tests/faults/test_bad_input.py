"""Scenario 7: bad input.

Non-JSON, oversized, over-deep and wrong-shaped payloads, strings PostgreSQL cannot
store, stream keys of the wrong type or length, unknown topics, a wrong-typed setting,
and the SQL functions called with nonsense (unknown category, negative lease, empty
arrays, NULLs, strangers' ids). Each gets a clear error or a defined no-op; the caller's
transaction stays usable and no existing row changes. Hostile payloads that got in
through SQL (too deep for Python, integers past its digit limit) are parked alone as
``undecodable_payload`` by real pumps while the good rows around them run once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from django.db import connection
from psycopg.rows import tuple_row

import django_workpump as workpump
from tests.faults import harness
from tests.faults.harness import ROOT, Database, send_outbox

pytestmark = pytest.mark.faults

WORK_TABLES = (
    "workpump_outbox",
    "workpump_inbox",
    "workpump_perspective_event",
    "workpump_receptor_processing",
    "workpump_event",
    "workpump_service_instance",
    "workpump_eviction",
    "workpump_active_stream",
)


def snapshot(cursor: Any) -> dict[str, list[Any]]:
    """Every row of every workpump table, as text, in a stable order."""
    rows = {}
    for table in WORK_TABLES:
        cursor.execute(f"SELECT t::text FROM {table} t ORDER BY t::text")
        rows[table] = [r[0] for r in cursor.fetchall()]
    return rows


# -- producers -------------------------------------------------------------------------
def deep_list(levels: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(levels - 1):
        value = [value]
    return value


BAD_PRODUCER_CALLS = [
    ("a payload that is not a dict", lambda: workpump.send("fx.outbox", ["a", "list"])),
    ("a payload with a non-JSON value", lambda: workpump.send("fx.outbox", {"d": Decimal(1)})),
    ("a payload with NaN", lambda: workpump.send("fx.outbox", {"x": float("nan")})),
    ("an oversized payload", lambda: workpump.send("fx.outbox", {"x": "y" * 2000})),
    ("a stream key that is a list", lambda: workpump.send("fx.outbox", {}, stream=["s"])),
    ("a stream key that is a bool", lambda: workpump.emit("fx.event", {}, stream=True)),
    ("an empty stream key", lambda: workpump.send("fx.outbox", {}, stream=" ")),
    ("an empty destination", lambda: workpump.send("", {})),
    ("a message id that is not a UUID", lambda: workpump.receive("42", "fx.inbox", {})),
    ("a priority that is a string", lambda: workpump.send("fx.outbox", {}, priority="high")),
    ("max_attempts of zero", lambda: workpump.send("fx.outbox", {}, max_attempts=0)),
    ("a stream key over 512 bytes", lambda: workpump.send("fx.outbox", {}, stream="s" * 513)),
    ("a NUL in a stream key", lambda: workpump.emit("fx.event", {}, stream="a\x00")),
    ("a NUL in a payload", lambda: workpump.send("fx.outbox", {"a": ["\x00"]})),
    ("a lone surrogate in a payload key", lambda: workpump.send("fx.outbox", {"\udc80": 1})),
    ("a payload nested 5000 deep", lambda: workpump.send("fx.outbox", {"a": deep_list(5000)})),
]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("case", "call"), BAD_PRODUCER_CALLS, ids=[c for c, _ in BAD_PRODUCER_CALLS]
)
def test_producers_refuse_bad_input_and_leave_the_transaction_usable(settings, case, call):
    settings.WORKPUMP = {"MAX_PAYLOAD_BYTES": 1000}
    kept = workpump.send("fx.outbox", {"n": 1}, stream="kept")
    with connection.cursor() as cursor:
        before = snapshot(cursor)
    with pytest.raises(workpump.InvalidWork) as refused:
        call()
    message = str(refused.value)
    assert message.endswith(".") and len(message) > 30, message
    # No SQL error happened: the same transaction goes on, nothing changed, and the row
    # written before the refusal is still there.
    with connection.cursor() as cursor:
        assert snapshot(cursor) == before
        cursor.execute("SELECT count(*) FROM workpump_outbox WHERE work_id = %s", [kept])
        assert cursor.fetchone()[0] == 1


# -- SQL functions -----------------------------------------------------------------------
STRANGER = "00000000-0000-0000-0000-0000000000aa"
# (case, SQL, SQLSTATE, words the message must contain); %(id)s is a held row's id.
SQL_ERRORS = [
    ("claim: unknown category",
     f"SELECT * FROM workpump.claim_work('{STRANGER}', p_categories => '{{bogus}}')",
     "22023", "Unknown workpump category 'bogus'"),
    ("claim: NULL instance", "SELECT * FROM workpump.claim_work(NULL)", "22023", "p_instance_id"),
    ("claim: zero rows", f"SELECT * FROM workpump.claim_work('{STRANGER}', 0)", "22023",
     "p_max_rows >= 1"),
    ("claim: negative lease", f"SELECT * FROM workpump.claim_work('{STRANGER}', 5, -30)",
     "22023", "p_lease_seconds >= 1"),
    ("claim: zero partitions",
     f"SELECT * FROM workpump.claim_work('{STRANGER}', p_partition_count => 0)", "22023",
     "p_partition_count >= 1"),
    ("claim: topics not an object of lists",
     "SELECT * FROM workpump.claim_work(%(holder)s, p_topics => '[\"fx.outbox\"]')", "22023",
     "p_topics as an object"),
    ("claim: an unregistered instance", f"SELECT * FROM workpump.claim_work('{STRANGER}')",
     "WP001", "it is not registered"),
    ("renew: unknown category",
     "SELECT * FROM workpump.renew_leases('bogus', ARRAY[%(id)s], ARRAY[%(id)s])",
     "22023", "Unknown workpump category"),
    ("renew: negative lease",
     "SELECT * FROM workpump.renew_leases('outbox', ARRAY[%(id)s], ARRAY[%(id)s], -5)",
     "22023", "p_lease_seconds >= 1"),
    ("renew: a NULL id",
     "SELECT * FROM workpump.renew_leases('outbox', ARRAY[NULL]::uuid[], ARRAY[%(id)s])",
     "22023", "NULL work id"),
    ("renew: no lease tokens", "SELECT * FROM workpump.renew_leases('outbox', ARRAY[%(id)s], NULL)",
     "22023", "one lease token per id"),
    ("renew: an unregistered instance",
     f"SELECT * FROM workpump.renew_leases('outbox', ARRAY[%(id)s], ARRAY[%(id)s], 300,"
     f" '{STRANGER}')", "WP001", "it is not registered"),
    ("complete: NULL instance",
     "SELECT * FROM workpump.complete_work(NULL, 'outbox', ARRAY[%(id)s], ARRAY[%(id)s])",
     "22023", "p_instance_id"),
    ("complete: unknown category",
     f"SELECT * FROM workpump.complete_work('{STRANGER}', 'nonsense', ARRAY[%(id)s],"
     " ARRAY[%(id)s])", "22023", "Unknown workpump category 'nonsense'"),
    ("complete: results of another length",
     f"SELECT * FROM workpump.complete_work('{STRANGER}', 'outbox', ARRAY[%(id)s],"
     " ARRAY[%(id)s], ARRAY['1', '2']::jsonb[])", "22023", "1 ids but 2 results"),
    ("complete: a NULL lease token",
     f"SELECT * FROM workpump.complete_work('{STRANGER}', 'outbox', ARRAY[%(id)s],"
     " ARRAY[NULL]::uuid[])", "22023", "NULL lease token"),
    ("complete: attempt logs of another length",
     f"SELECT * FROM workpump.complete_work('{STRANGER}', 'outbox', ARRAY[%(id)s],"
     " ARRAY[%(id)s], p_logs => ARRAY['[]', '[]']::jsonb[])", "22023",
     "one p_logs entry (a JSON array, or NULL) per id"),
    ("fail: an attempt log record without a message",
     f"SELECT * FROM workpump.fail_work('{STRANGER}', 'outbox', ARRAY[%(id)s], ARRAY[%(id)s],"
     """ ARRAY['e'], p_logs => ARRAY['[{"at": 1, "level": 30, "logger": "x"}]']::jsonb[])""",
     "22023", "not a JSON array of records"),
    ("discard: an attempt log that is not an array",
     f"SELECT * FROM workpump.discard_work('{STRANGER}', 'outbox', ARRAY[%(id)s],"
     """ ARRAY[%(id)s], ARRAY['r'], p_logs => ARRAY['{"at": 1}']::jsonb[])""",
     "22023", "not a JSON array of records"),
    ("fail: no errors", f"SELECT * FROM workpump.fail_work('{STRANGER}', 'outbox',"
     " ARRAY[%(id)s], ARRAY[%(id)s], '{}')", "22023", "one error"),
    ("fail: negative backoff", f"SELECT * FROM workpump.fail_work('{STRANGER}', 'outbox',"
     " ARRAY[%(id)s], ARRAY[%(id)s], ARRAY['e'], NULL, -1)", "22023", "retry seconds >= 0"),
    ("release: tokens of another length",
     f"SELECT * FROM workpump.release_work('{STRANGER}', 'outbox', ARRAY[%(id)s], '{{}}')",
     "22023", "one lease token per id"),
    ("heartbeat: NULL instance",
     "SELECT workpump.record_heartbeat(NULL, 's', 'h', 1)", "22023", "p_instance_id"),
    ("heartbeat: negative stale cutoff",
     f"SELECT workpump.record_heartbeat('{STRANGER}', 's', 'h', 1, '{{}}', -1, 300)", "22023",
     "p_stale_after_seconds"),
    ("heartbeat: dead cutoff below stale",
     f"SELECT workpump.record_heartbeat('{STRANGER}', 's', 'h', 1, '{{}}', 30, 10)", "22023",
     "p_definitively_dead_after_seconds"),
    ("cleanup: NULL cutoff", "SELECT * FROM workpump.cleanup_stale_instances(NULL)", "22023",
     "p_stale_cutoff"),
    ("evict: NULL instance", "SELECT workpump.evict_instance(NULL)", "22023", "p_instance_id"),
    ("send: empty destination", "SELECT workpump.send('', '{}')", "22023", "non-empty"),
    ("send: a JSON array payload", "SELECT workpump.send('fx.outbox', '[1, 2]')", "22023",
     "must be a JSON object"),
    ("send: a NULL payload", "SELECT workpump.send('fx.outbox', NULL)", "22023",
     "must be a JSON object"),
    ("send: a payload that is not JSON", "SELECT workpump.send('fx.outbox', 'not json')",
     "22P02", "invalid input syntax for type json"),
    ("send: priority out of range", "SELECT workpump.send('fx.outbox', '{}', p_priority => 99999)",
     "22023", "smallint"),
    ("send: zero max attempts", "SELECT workpump.send('fx.outbox', '{}', p_max_attempts => 0)",
     "22023", "at least 1"),
    ("send: a payload over p_max_payload_bytes",
     "SELECT workpump.send('fx.outbox', '{\"x\": \"yyyyyyyy\"}', p_max_payload_bytes => 10)",
     "22023", "over p_max_payload_bytes (10): store large data elsewhere"),
    ("receive: a payload nested 101 deep",
     "SELECT workpump.receive(gen_random_uuid(), 'fx.inbox',"
     " ('{\"a\": ' || repeat('[', 100) || repeat(']', 100) || '}')::jsonb)",
     "22023", "more than p_max_payload_depth (100) levels deep: flatten it"),
    ("emit: a payload nested 5000 deep",
     "SELECT workpump.emit('fx.event',"
     " ('{\"a\": ' || repeat('[', 4999) || repeat(']', 4999) || '}')::jsonb)",
     "22023", "more than p_max_payload_depth (100) levels deep"),
    ("emit: a depth limit the pump cannot decode",
     "SELECT workpump.emit('fx.event', '{}', p_max_payload_depth => 1000)", "22023",
     "between 1 and 512"),
    ("send: a stream key of the wrong type", "SELECT workpump.send('fx.outbox', '{}', 42)",
     "42883", "does not exist"),
    ("receive: NULL message id", "SELECT workpump.receive(NULL, 'fx.inbox', '{}')", "22023",
     "message id"),
    ("emit: subscribers not an array",
     "SELECT workpump.emit('fx.event', '{}', NULL, '{\"a\": 1}')", "22023", "JSON array"),
    ("emit: a subscriber of an unknown category",
     "SELECT workpump.emit('fx.event', '{}', NULL,"
     " '[{\"category\": \"outbox\", \"name\": \"x\"}]')",
     "22023", "Bad subscriber"),
    ("retry_now: unknown category", "SELECT * FROM workpump.retry_now('bogus', ARRAY[%(id)s])",
     "22023", "Unknown workpump category"),
    ("dead_letter: a NULL id",
     "SELECT * FROM workpump.dead_letter('outbox', ARRAY[NULL]::uuid[])", "22023",
     "NULL work id"),
    ("purge: zero batch", "SELECT workpump.purge_processed('outbox', now(), 0)", "22023",
     "p_batch >= 1"),
]  # fmt: skip

# (case, SQL, the rows it must return): defined no-ops.
SQL_NOOPS = [
    ("claim: no categories", "SELECT * FROM workpump.claim_work(%(holder)s, "
     "p_categories => '{}')", []),
    ("claim: no topics", "SELECT * FROM workpump.claim_work(%(holder)s, p_topics => '{}')", []),
    ("renew: empty ids", "SELECT * FROM workpump.renew_leases('outbox', '{}', '{}')", []),
    ("renew: NULL ids", "SELECT * FROM workpump.renew_leases('outbox', NULL, NULL)", []),
    ("renew: the holder with another attempt's token",
     "SELECT * FROM workpump.renew_leases('outbox', ARRAY[%(id)s], ARRAY[gen_random_uuid()],"
     " 300, %(holder)s)", []),
    ("complete: empty ids",
     f"SELECT * FROM workpump.complete_work('{STRANGER}', 'outbox', '{{}}', '{{}}')", []),
    ("complete: a stranger's completion",
     f"SELECT status FROM workpump.complete_work('{STRANGER}', 'outbox', ARRAY[%(id)s],"
     " ARRAY[%(token)s])", [{"status": "lost"}]),
    ("complete: the holder with another attempt's token",
     "SELECT status FROM workpump.complete_work(%(holder)s, 'outbox', ARRAY[%(id)s],"
     " ARRAY[gen_random_uuid()])", [{"status": "lost"}]),
    ("fail: a stranger's failure", f"SELECT status FROM workpump.fail_work('{STRANGER}', "
     "'outbox', ARRAY[%(id)s], ARRAY[%(token)s], ARRAY['e'])", [{"status": "lost"}]),
    ("release: a stranger's release",
     f"SELECT status FROM workpump.release_work('{STRANGER}', 'outbox', ARRAY[%(id)s],"
     " ARRAY[%(token)s])", [{"status": "lost"}]),
    ("release: the holder with another attempt's token",
     "SELECT status FROM workpump.release_work(%(holder)s, 'outbox', ARRAY[%(id)s],"
     " ARRAY[gen_random_uuid()])", [{"status": "lost"}]),
    ("deregister: an unknown instance", f"SELECT workpump.deregister_instance('{STRANGER}') AS n",
     [{"n": 0}]),
    ("cleanup: nobody stale",
     "SELECT * FROM workpump.cleanup_stale_instances(now() - interval '1 hour')", []),
    ("emit: no subscribers",
     "SELECT count(*) AS n FROM workpump.emit('fx.event', '{}') e", [{"n": 1}]),
    ("partition of NULL", "SELECT workpump.partition_of(NULL) AS p", [{"p": None}]),
]  # fmt: skip


def held_row(db: Database) -> dict[str, uuid.UUID]:
    """An outbox row leased to a live instance: its id, the holder and the lease token."""
    holder = uuid.uuid4()
    work_id = send_outbox(db, "fx.outbox", {"n": 0}, stream="held")
    db.sql("SELECT workpump.record_heartbeat(%s, 'fx', 'host', 1)", [holder])
    claimed = db.sql("SELECT work_id, lease_token FROM workpump.claim_work(%s, 10)", [holder])
    assert [r["work_id"] for r in claimed] == [work_id]
    return {"id": work_id, "holder": holder, "token": claimed[0]["lease_token"]}


def test_sql_functions_reject_nonsense_with_a_clear_error_and_keep_the_transaction(db):
    held = held_row(db)
    send_outbox(db, "fx.outbox", {"n": 1})  # one more row, unleased
    with db.connect(autocommit=False) as conn, conn.cursor(row_factory=tuple_row) as cursor:
        before = snapshot(cursor)
        cursor.execute("CREATE TEMP TABLE fx_marker AS SELECT 1 AS kept")  # the caller's work
        errors = []
        for case, query, sqlstate, words in SQL_ERRORS:
            cursor.execute("SAVEPOINT nonsense")
            with pytest.raises(psycopg.Error) as raised:
                cursor.execute(query, held)
            error = raised.value
            cursor.execute("ROLLBACK TO SAVEPOINT nonsense")
            assert error.sqlstate == sqlstate, (case, error.sqlstate, str(error))
            assert words in str(error), (case, str(error))
            errors.append(case)
        # The caller's transaction goes on: its own work is there, nothing else changed.
        cursor.execute("SELECT kept FROM fx_marker")
        assert cursor.fetchone()[0] == 1
        assert snapshot(cursor) == before
        cursor.execute("SHOW lock_timeout")
        assert cursor.fetchone()[0] == "0"  # no function left a session setting behind
        conn.commit()
    harness.report("bad-input-sql-errors", cases=len(errors), transaction_usable=True)


def test_sql_nonsense_no_ops_change_nothing(db):
    held = held_row(db)
    work_id, holder = held["id"], held["holder"]
    with db.connect(autocommit=False) as conn:
        cursor = conn.cursor()
        before = snapshot(conn.cursor(row_factory=tuple_row))
        for case, query, expected in SQL_NOOPS:
            cursor.execute(query, held)
            assert cursor.fetchall() == expected, case
            if case != "emit: no subscribers":  # it stores the event, by design
                assert snapshot(conn.cursor(row_factory=tuple_row)) == before, case
            else:
                before = snapshot(conn.cursor(row_factory=tuple_row))
        conn.commit()
    # The held row is still the holder's, untouched by the strangers.
    row = db.sql("SELECT instance_id, attempts FROM workpump_outbox WHERE work_id = %s",
                 [work_id])[0]  # fmt: skip
    assert (row["instance_id"], row["attempts"]) == (holder, 1)
    harness.report("bad-input-sql-noops", cases=len(SQL_NOOPS), rows_changed=0)


def test_an_unknown_category_error_hints_at_the_valid_ones(db):
    with pytest.raises(psycopg.Error) as raised:
        db.sql("SELECT * FROM workpump.renew_leases('bogus', '{}', '{}')")
    assert raised.value.diag.message_hint == (
        "Valid categories: outbox, inbox, perspective_event, receptor."
    )


def test_producers_name_a_partition_count_below_one(db):
    with pytest.raises(psycopg.Error) as raised:
        db.sql("SELECT workpump.send('fx.outbox', '{}', p_partition_count => 0)")
    assert raised.value.sqlstate == "22023", str(raised.value)
    assert "p_partition_count" in str(raised.value)


# -- settings and topics, with real processes ------------------------------------------------
def test_a_wrong_typed_setting_stops_runworkpump_before_it_registers(db):
    env = {
        **os.environ,
        "DATABASE_URL": db.url,
        "PYTHONPATH": str(ROOT),
        "WORKPUMP_JSON": json.dumps({"LEASE_SECONDS": "300", "HEARTBEAT_ENABLED": "yes"}),
    }
    run = subprocess.run(
        [sys.executable, "-m", "django", "runworkpump", f"--settings={harness.SETTINGS_MODULE}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    assert "workpump.E003" in output
    assert "WORKPUMP['LEASE_SECONDS'] ('300') must be an integer." in output
    assert "WORKPUMP['HEARTBEAT_ENABLED'] ('yes') must be True or False." in output
    assert db.scalar("SELECT count(*) FROM workpump_service_instance") == 0


@pytest.mark.timeout(180)
def test_work_for_unknown_topics_waits_unclaimed_and_nothing_else_stops(db, make_fleet):
    nobody = send_outbox(db, "fx.nobody", {"n": 0}, stream="nobody", max_attempts=2)
    db.sql("SELECT workpump.receive(%s, 'fx.ghost', '{}', NULL, p_max_attempts => 2)",
           [uuid.uuid4()])  # fmt: skip
    db.sql(
        "SELECT workpump.emit('fx.event', '{\"n\": 0}', 'ghost', %s::jsonb)",
        [json.dumps([{"category": "perspective_event", "name": "fx.ghost", "max_attempts": 2}])],
    )
    backlog = harness.Backlog(db, streams=4, seconds=0)
    backlog.produce(5)
    fleet = make_fleet(db, harness.FAST)
    pump = fleet.spawn("--drain", "--concurrency", "2")
    assert pump.wait_exit(120) == 0, pump.output()
    # No instance has a handler for them: never claimed, no attempt spent, nothing dead.
    waiting = db.sql(
        "SELECT topic, attempts, dead_lettered_at FROM workpump_outbox"
        " WHERE done_at IS NULL"
        " UNION ALL SELECT topic, attempts, dead_lettered_at FROM workpump_inbox"
        " WHERE done_at IS NULL"
        " UNION ALL SELECT topic, attempts, dead_lettered_at"
        " FROM workpump_perspective_event WHERE done_at IS NULL"
    )
    assert sorted((r["topic"], r["attempts"], r["dead_lettered_at"]) for r in waiting) == [
        ("fx.ghost", 0, None),
        ("fx.ghost", 0, None),
        ("fx.nobody", 0, None),
    ]
    assert db.undone() == 3  # the rest was processed
    assert db.scalar("SELECT attempts FROM workpump_outbox WHERE work_id = %s", [nobody]) == 0
    harness.report("bad-input-unknown-topics", waiting=len(waiting), rest_processed=backlog.total)


# -- hostile payloads written through SQL, run by real pumps --------------------------------
DEEP_TEXT = '{"deep": ' + "[" * 4999 + "]" * 4999 + "}"  # past Python's recursion limit
HUGE_TEXT = '{"big": ' + "9" * 5000 + "}"  # past Python's int-string digit limit
FLOAT_TEXT = '{"big": 1e5000}'  # jsonb prints it as 5001 digits


def hostile_rows(db: Database, tag: int) -> dict[str, list[uuid.UUID]]:
    """Rows Python cannot decode, each on a stream of its own, by category.

    The SQL producers accept the huge numbers (they are shallow and small); the deep
    payloads are refused by them, so they are inserted as a plain INSERT would leave
    them.
    """
    rows: dict[str, list[uuid.UUID]] = {c: [] for c in harness.CATEGORIES}
    stream = f"hostile-{tag}"
    rows["outbox"].append(
        db.scalar("SELECT workpump.send('fx.outbox', %s::jsonb, %s)", [HUGE_TEXT, f"{stream}-o1"])
    )
    rows["outbox"].append(
        db.scalar(
            "INSERT INTO workpump_outbox (work_id, topic, payload, stream,"
            " partition_number) VALUES (gen_random_uuid(), 'fx.outbox', %s::jsonb, %s,"
            " workpump.partition_of(%s)) RETURNING work_id",
            [DEEP_TEXT, f"{stream}-o2", f"{stream}-o2"],
        )
    )
    inbox_id = uuid.uuid4()
    db.sql("SELECT workpump.receive(%s, 'fx.inbox', %s::jsonb)", [inbox_id, FLOAT_TEXT])
    rows["inbox"].append(inbox_id)
    event = db.scalar(
        "SELECT workpump.emit('fx.event', %s::jsonb, %s, %s::jsonb)",
        [HUGE_TEXT, f"{stream}-e1", harness.SUBSCRIBERS],
    )
    deep_event = uuid.uuid4()
    db.sql(
        "INSERT INTO workpump_event (event_id, event_type, payload) VALUES"
        " (%s, 'fx.event', %s::jsonb)",
        [deep_event, DEEP_TEXT],
    )
    db.sql(
        "INSERT INTO workpump_perspective_event (work_id, topic,"
        " event_id, partition_number) VALUES (gen_random_uuid(), 'fx.perspective', %s, 0)",
        [deep_event],
    )
    for category, table, key in (
        ("perspective_event", "workpump_perspective_event", "work_id"),
        ("receptor", "workpump_receptor_processing", "work_id"),
    ):
        rows[category] += [
            r["id"]
            for r in db.sql(
                f"SELECT {key} AS id FROM {table} WHERE event_id = ANY(%s)", [[event, deep_event]]
            )
        ]
    return rows  # fmt: skip


@pytest.mark.timeout(240)
def test_hostile_payloads_written_through_sql_are_parked_alone_and_the_rest_runs_once(
    db, make_fleet
):
    backlog = harness.Backlog(db, streams=4, seconds=0.01)
    hostile: dict[str, list[uuid.UUID]] = {c: [] for c in harness.CATEGORIES}
    for tag in range(3):  # good and hostile rows interleaved, so claims mix them
        backlog.produce(4)
        for category, ids in hostile_rows(db, tag).items():
            hostile[category] += ids
    backlog.produce(4)
    # A payload at the deepest level the SQL producers may be told to accept still runs.
    at_limit = '{"n": 0, "deep": ' + "[" * 511 + "]" * 511 + "}"
    deepest = db.scalar(
        "SELECT workpump.send('fx.outbox', %s::jsonb, p_max_payload_depth => 512)", [at_limit]
    )
    bad = {work_id for ids in hostile.values() for work_id in ids}
    fleet = make_fleet(db, harness.FAST)
    pumps = [fleet.spawn("--drain", "--concurrency", "4") for _ in range(2)]
    for pump in pumps:
        assert pump.wait_exit(180) == 0, pump.output()

    expected = {c: backlog.expected[c] + len(hostile[c]) for c in harness.CATEGORIES}
    expected["outbox"] += 1
    verdict = harness.check_invariants(db, expected=expected, allow_dead=bad)
    harness.assert_invariants(verdict, fleet)
    rows = db.sql(harness.ALL_ROWS)
    good = [r for r in rows if r["id"] not in bad]
    parked = [r for r in rows if r["id"] in bad]
    good_rerun = [r for r in good if r["attempts"] != 1]
    good_dead = [r for r in good if r["dead_lettered_at"] is not None]
    assert good_rerun == [] and good_dead == []
    assert {(r["failure_reason"], r["attempts"]) for r in parked} == {("undecodable_payload", 1)}
    assert all(r["last_error"].startswith("the payload cannot be decoded: ") for r in parked)
    assert db.executions("work_id = ANY(%s)", [list(bad)]) == []
    assert db.scalar(
        "SELECT done_at IS NOT NULL FROM workpump_outbox WHERE work_id = %s", [deepest]
    )
    kept = db.scalar(
        "SELECT count(*) FROM workpump_outbox WHERE work_id = ANY(%s)"
        " AND payload::text IN (%s, %s)",
        [hostile["outbox"], HUGE_TEXT, DEEP_TEXT],
    )
    assert kept == len(hostile["outbox"])  # kept in the row as written, for the admin
    harness.report(
        "bad-input-hostile-payloads",
        pumps=len(pumps),
        good_rows=len(good),
        hostile_rows=len(parked),
        good_attempts_over_1=len(good_rerun),
        good_dead=len(good_dead),
        hostile_parked_undecodable=len(parked),
        hostile_executions=0,
        executions=verdict.executions,
    )
