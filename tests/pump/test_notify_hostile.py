"""Hostile notifications: a NOTIFY is a hint, whoever sends it.

Any role that can connect may ``pg_notify`` on the pump's channels; a role that can read a
work table knows the instance and lease token of every running attempt. These tests create
such roles inside the test (a LOGIN role with nothing but the default CONNECT, and a
read-only role with SELECT on the work tables), connect as them with psycopg, and show that
what they send neither drops a listener (the same backend, no reconnect, the alive-lock
never stamped lost) nor cancels an attempt the database does not show cancelled.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.test import override_settings
from psycopg import sql
from psycopg.rows import dict_row

import django_workpump as workpump
from django_workpump import models
from django_workpump.categories import CATEGORIES
from django_workpump.pump.notify import (
    CANCEL_CHANNEL,
    CHANNELS,
    MalformedNotification,
    NotifyGate,
    parse_cancel,
)
from tests.helpers import FAST_PUMP, conninfo, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Conn = psycopg.Connection[dict[str, Any]]
WAIT = 20.0
ALL_CHANNELS = (*CHANNELS, CANCEL_CHANNEL)


@pytest.fixture
def role() -> Iterator[Callable[..., Conn]]:
    """Create a LOGIN role (SELECT on ``tables`` only) and connect as it; dropped after."""
    admin = psycopg.connect(conninfo(), autocommit=True)
    made: list[tuple[str, Conn]] = []

    def make(*tables: str) -> Conn:
        name = f"wp_attacker_{secrets.token_hex(4)}"
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
        for table in tables:
            admin.execute(
                sql.SQL("GRANT SELECT ON {} TO {}").format(
                    sql.Identifier(table), sql.Identifier(name)
                )
            )
        conn = psycopg.connect(conninfo(), user=name, autocommit=True, row_factory=dict_row)
        made.append((name, conn))
        return conn

    yield make
    for name, conn in made:
        conn.close()
        admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))
    admin.close()


def notify(conn: Conn, channel: str, payload: str) -> None:
    conn.execute("SELECT pg_notify(%s, %s)", (channel, payload))


def hostile_payloads(instance_id: uuid.UUID) -> dict[str, str]:
    """Six kinds of payload a listener must shrug off, each under the 8000-byte limit."""
    me = str(instance_id)
    return {
        "deep nesting": "[" * 3500 + "]" * 3500,
        # 200 attempts (bare ids in the short UUID spelling): cancel_work sends at most 100
        "huge payload": json.dumps(
            {"instance": me, "category": "outbox", "work": [instance_id.hex] * 200}
        ),
        "invalid JSON": '{"instance": "' + me + '", "category": ',
        "wrong types": json.dumps({"instance": me, "category": ["outbox"], "work": "all"}),
        "invalid UUIDs": json.dumps(
            {"instance": me, "category": "outbox", "work": [["not-a-uuid", "1" * 40]]}
        ),
        "unknown shape": json.dumps([{"cancel": "everything"}, 1, None]),
    }


def lock_lost_at(instance_id: uuid.UUID) -> Any:
    return (
        models.ServiceInstance.objects.filter(instance_id=instance_id)
        .values_list("alive_lock_lost_at", flat=True)
        .get()
    )


# -- parsing, pure ----------------------------------------------------------------------


def test_a_cancel_payload_is_parsed_only_in_its_known_shape():
    me, work_id, token = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    good = json.dumps(
        {"instance": str(me), "category": "inbox", "work": [[str(work_id), str(token)]]}
    )
    hint = parse_cancel(good)
    assert (hint.instance, hint.category, hint.attempts) == (me, "inbox", ((work_id, token),))
    # an attempt cancel_work found unleased carries no token: nothing to stop
    unleased = json.dumps(
        {"instance": str(me), "category": "inbox", "work": [[str(work_id), None]]}
    )
    assert parse_cancel(unleased).attempts == ()
    # for another instance: not read past its instance, however bad the rest
    assert parse_cancel(good, uuid.uuid4()) is None
    assert parse_cancel(good, me) == hint
    other = json.dumps({"instance": str(uuid.uuid4()), "category": 1, "work": [["x"]]})
    assert parse_cancel(other, me) is None

    kinds = {}
    assert 7000 < len(hostile_payloads(me)["huge payload"]) < 8000
    for name, payload in hostile_payloads(me).items():
        with pytest.raises(MalformedNotification) as caught:
            parse_cancel(payload)
        kinds[name] = caught.value.kind
    assert kinds == {
        "deep nesting": "too_large",
        "huge payload": "too_many_attempts",
        "invalid JSON": "invalid_json",
        "wrong types": "wrong_shape",
        "invalid UUIDs": "invalid_uuid",
        "unknown shape": "wrong_shape",
    }
    for payload, kind in [
        ("x" * 8001, "too_long"),
        ('{"instance": [[[["' + str(me) + '"]]]]}', "too_deep"),
        ('{"instance": "\\u0041"}', "wrong_shape"),  # cancel_work's strings need no escape
        ('{"instance": "' + str(me) + "}", "invalid_json"),
        ("[]" * 103, "too_large"),
    ]:
        with pytest.raises(MalformedNotification) as caught:
            parse_cancel(payload)
        assert caught.value.kind == kind, payload
    # nesting inside a string is text, not depth
    quoted = json.dumps({"instance": str(me), "category": "outbox", "work": [], "x": "[[[[["})
    assert parse_cancel(quoted).category == "outbox"


def test_a_flood_of_one_kind_logs_once_and_counts_the_rest(caplog):
    clock_now = [0.0]

    class Clock:
        def monotonic(self) -> float:
            return clock_now[0]

        def now(self) -> Any:  # pragma: no cover - unused by the gate
            raise AssertionError

    gate = NotifyGate("", uuid.uuid4(), on_signal=lambda signal: None, clock=Clock())  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="django_workpump.notify"):
        for _ in range(500):
            gate._dispatch(CANCEL_CHANNEL, "[" * 3500 + "]" * 3500)
        gate._dispatch(CANCEL_CHANNEL, "{")
        clock_now[0] = 61.0
        gate._dispatch(CANCEL_CHANNEL, "[" * 3500 + "]" * 3500)
    lines = [r.getMessage() for r in caplog.records if r.name == "django_workpump.notify"]
    assert len(lines) == 3, lines
    assert "too_large" in lines[0] and "invalid_json" in lines[1]
    assert "500 more" in lines[2]  # the 499 suppressed ones and this one
    assert gate.rejected == {"too_large": 501, "invalid_json": 1}


# -- a role with CONNECT only -----------------------------------------------------------


@override_settings(WORKPUMP=FAST_PUMP)
def test_hostile_notifications_on_every_channel_leave_every_listener_up(pump, role, caplog):
    pumps = [pump(), pump()]
    gates = [p.gate for p in pumps]
    assert all(g is not None for g in gates)
    assert wait_until(lambda: all(g.alive_lock_held for g in gates), WAIT)
    pids = [g.backend_pid for g in gates]
    attacker = role()  # CONNECT only: no table, no function of the pump's
    signals_before = [g.signals_received for g in gates]

    with caplog.at_level(logging.WARNING, logger="django_workpump.notify"):
        for p in pumps:
            for payload in hostile_payloads(p.identity.instance_id).values():
                for channel in ALL_CHANNELS:
                    notify(attacker, channel, payload)
        # the recursion that used to end the loop, many times over
        for _ in range(50):
            notify(attacker, CANCEL_CHANNEL, "[" * 3500 + "]" * 3500)

        # every gate read them all: 6 per pump per work channel, 12 + 50 cancels
        work_channels = len(CHANNELS) * 12
        assert wait_until(
            lambda: all(
                g.signals_received - before == work_channels
                for g, before in zip(gates, signals_before, strict=True)
            ),
            WAIT,
        )
        assert wait_until(lambda: all(g.rejected.total() >= 6 + 50 for g in gates), WAIT)

    for g, pid in zip(gates, pids, strict=True):
        assert (g.connects, g.failures, g.last_failure) == (1, 0, None)
        assert g.backend_pid == pid and g.available and g.alive_lock_held
    # heartbeats after the flood still find the alive-lock held: nothing stamped
    beats = [p.heartbeat.beats for p in pumps]
    assert wait_until(
        lambda: all(p.heartbeat.beats > b for p, b in zip(pumps, beats, strict=True)), WAIT
    )
    for p in pumps:
        assert lock_lost_at(p.identity.instance_id) is None
    messages = [r.getMessage() for r in caplog.records if r.name == "django_workpump.notify"]
    assert not any("connection lost" in m for m in messages)
    # logged once per kind per gate, not once per notification
    assert 0 < len(messages) <= 2 * 6, messages


# -- a role that can read the work tables -----------------------------------------------


def spoof_cancel(conn: Conn, work_id: uuid.UUID) -> None:
    """What a reader of workpump_outbox can send: the real holder and lease token."""
    row = conn.execute(
        "SELECT instance_id, lease_token FROM workpump_outbox WHERE work_id = %s", (work_id,)
    ).fetchone()
    assert row is not None and row["instance_id"] is not None
    payload = {
        "instance": str(row["instance_id"]),
        "category": "outbox",
        "work": [[str(work_id), str(row["lease_token"])]],
    }
    notify(conn, CANCEL_CHANNEL, json.dumps(payload))


def spoofed_while_running(
    pump: Callable[..., Any], role: Callable[..., Conn], topic: str, started: threading.Event
) -> tuple[uuid.UUID, Any, NotifyGate]:
    """Send a row of ``topic`` and start a pump; once its handler has ``started``, spoof a
    cancel of the row as a reader of the work tables and wait until the gate has found
    it unconfirmed. The row, the pump and its gate."""
    work_id = workpump.send(topic, {})
    supervisor = pump()
    gate = supervisor.gate
    assert gate is not None
    assert started.wait(WAIT)
    spoof_cancel(role(*(c.table for c in CATEGORIES)), work_id)
    assert wait_until(lambda: gate.cancels_unconfirmed == 1, WAIT)
    return work_id, supervisor, gate


@override_settings(WORKPUMP={**FAST_PUMP, "CONCURRENCY": 2})
def test_a_spoofed_cancel_leaves_the_handler_running_and_its_outcome_stored(
    pump, role, outbox_handler
):
    started, release = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def handler(work: Any) -> dict[str, bool]:
        started.set()
        release.wait(WAIT)
        seen["cancelled"] = work.cancelled
        return {"finished": True}

    outbox_handler("hostile.spoof", handler)
    work_id, supervisor, gate = spoofed_while_running(pump, role, "hostile.spoof", started)
    release.set()
    assert wait_until(lambda: models.Outbox.objects.get(work_id=work_id).done_at is not None, WAIT)
    row = models.Outbox.objects.get(work_id=work_id)
    assert (row.end_state, row.result, row.attempts) == (None, {"finished": True}, 1)
    assert seen == {"cancelled": False}
    assert supervisor.dispatcher.stats.cancelled == 0
    assert (gate.cancels_received, gate.cancels_confirmed) == (1, 0)
    assert (gate.connects, gate.failures) == (1, 0)


@override_settings(WORKPUMP={**FAST_PUMP, "CONCURRENCY": 2})
def test_after_a_spoof_a_real_cancel_still_stops_the_handler(pump, role, outbox_handler):
    started, stopped = threading.Event(), threading.Event()

    def handler(work: Any) -> str:
        started.set()
        if work.lease.cancelled.wait(WAIT):
            stopped.set()
        return "late"

    outbox_handler("hostile.real", handler)
    work_id, supervisor, gate = spoofed_while_running(pump, role, "hostile.real", started)
    assert not stopped.is_set()

    workpump.cancel(work_id)

    assert stopped.wait(WAIT), "the real cancel did not reach the handler"
    assert gate.cancels_confirmed == 1
    row = models.Outbox.objects.get(work_id=work_id)
    assert (row.end_state, row.result) == ("cancelled", None)
    assert wait_until(lambda: supervisor.dispatcher.stats.cancelled == 1, WAIT)


# -- the confirming read -------------------------------------------------------------------


@pytest.mark.parametrize("category", [c.name for c in CATEGORIES])
def test_the_confirming_read_names_only_cancelled_attempts_of_that_category(category):
    from django_workpump import db
    from tests.sql.test_outcomes import TABLES, claim, produce

    me = uuid.uuid4()
    cancelled, running = produce(category), produce(category)
    assert {r["work_id"] for r in claim(me)} == {cancelled, running}
    table, key, _ = TABLES[category]
    with psycopg.connect(conninfo(), autocommit=True) as conn:
        rows = conn.execute(
            sql.SQL("SELECT {}, lease_token FROM {} WHERE {} = ANY (%s)").format(
                sql.Identifier(key), sql.Identifier(table), sql.Identifier(key)
            ),
            ([cancelled, running],),
        ).fetchall()
        token = dict(rows)
        workpump.cancel(cancelled, category=category)
        other = next(c.name for c in CATEGORIES if c.name != category)

        def confirmed(category: str, *pairs: tuple[uuid.UUID, uuid.UUID]) -> set[uuid.UUID]:
            ids, tokens = [i for i, _ in pairs], [t for _, t in pairs]
            return db.cancelled_attempts(conn, category=category, ids=ids, lease_tokens=tokens)

        both = [(cancelled, token[cancelled]), (running, token[running])]
        assert confirmed(category, *both) == {cancelled}
        assert confirmed(category, (cancelled, uuid.uuid4())) == set()  # another attempt
        assert confirmed(other, *both) == set()  # the id is not of that category
        assert confirmed(category) == set()


# -- cancel_work's notifications fit PostgreSQL's payload limit ---------------------------


def test_cancelling_many_running_rows_of_one_holder_notifies_in_parsable_chunks():
    from tests.sql.test_outcomes import claim, produce

    me = uuid.uuid4()
    ids = [produce("perspective_event") for _ in range(120)]
    leased: set[uuid.UUID] = set()
    while len(leased) < len(ids):
        batch = {r["work_id"] for r in claim(me, lease_seconds=300)}
        assert batch, "the claim leased nothing more"
        leased |= batch
    listener = psycopg.connect(conninfo(), autocommit=True)
    listener.execute("LISTEN workpump_cancel")

    # 120 pairs used to exceed 8000 bytes in one payload: the whole cancel failed
    cancelled = workpump.cancel(ids, category="perspective_event")

    assert sorted(map(str, cancelled.running)) == sorted(map(str, ids))
    payloads = [n.payload for n in listener.notifies(timeout=WAIT, stop_after=3)]
    listener.close()
    hints = [parse_cancel(payload) for payload in payloads]
    assert sorted(len(h.attempts) for h in hints) == [20, 50, 50]
    assert {h.instance for h in hints} == {me}
    assert {i for h in hints for i, _ in h.attempts} == set(ids)
    assert max(map(len, payloads)) < 4500
