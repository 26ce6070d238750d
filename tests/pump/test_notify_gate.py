"""The NOTIFY gate on a real PostgreSQL session.

Each test runs a ``NotifyGate`` in a daemon thread on its own psycopg connection to the test
database and observes it through its callbacks (queues and events, waited on with timeouts)
and from other raw sessions (pg_stat_activity, pg_locks, NOTIFY, pg_terminate_backend).
Covers: connect + self-probe + application name, channel -> signal mapping and a real producer
waking the gate, reconnect after the backend is killed (one transition each way, LISTEN and
alive-lock re-established), the alive-lock (taken when registered, retried by the keepalive,
refused to a duplicate, never taken when disabled), an unreachable database, stop(), the
backoff table and a failing subscriber.
"""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

from django_workpump.pump.notify import CHANNELS, NotifyGate, reconnect_delay
from tests.helpers import conninfo, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Conn = psycopg.Connection[dict[str, Any]]

WAIT_SECONDS = 5.0
JOIN_SECONDS = 10.0
# Fast reconnects keep the suite short; the keepalive is slow unless a test needs it.
FAST = {"reconnect_initial_seconds": 0.05, "reconnect_max_seconds": 0.2}


class Recorder:
    """Callbacks of one gate: signals and availability changes, in order."""

    def __init__(self) -> None:
        self.signals: queue.Queue[str] = queue.Queue()
        self.availability: list[bool] = []
        self.changes: queue.Queue[bool] = queue.Queue()

    def on_signal(self, signal: str) -> None:
        self.signals.put(signal)

    def on_availability(self, available: bool) -> None:
        self.availability.append(available)
        self.changes.put(available)

    def next_change(self) -> bool:
        return self.changes.get(timeout=WAIT_SECONDS)

    def next_signal(self) -> str:
        return self.signals.get(timeout=WAIT_SECONDS)


def make_gate(
    recorder: Recorder,
    instance_id: uuid.UUID | None = None,
    dsn: str | None = None,
    **options: Any,
) -> NotifyGate:
    return NotifyGate(
        dsn or conninfo(),
        instance_id or uuid.uuid4(),
        on_signal=recorder.on_signal,
        on_availability=recorder.on_availability,
        **(FAST | options),
    )


@contextmanager
def running(gate: NotifyGate) -> Iterator[threading.Thread]:
    thread = threading.Thread(target=gate.run, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        gate.stop()
        thread.join(JOIN_SECONDS)


@contextmanager
def listening(**options: Any) -> Iterator[tuple[NotifyGate, Recorder]]:
    """A running gate (``make_gate`` options), once it has become available."""
    recorder = Recorder()
    gate = make_gate(recorder, **options)
    with running(gate):
        assert recorder.next_change() is True
        yield gate, recorder


def register(conn: Conn, instance_id: uuid.UUID) -> None:
    row = conn.execute(
        "SELECT workpump.record_heartbeat(%s, 's', 'h', 1) AS ok", (instance_id,)
    ).fetchone()
    assert row is not None and row["ok"] is True


def alive_lock_held(conn: Conn, instance_id: uuid.UUID) -> bool:
    row = conn.execute("SELECT workpump.alive_lock_held(%s) AS held", (instance_id,)).fetchone()
    assert row is not None
    return bool(row["held"])


def alive_lock_holders(conn: Conn, instance_id: uuid.UUID) -> list[int]:
    """Backend pids holding the instance's alive-lock in this database (from pg_locks)."""
    rows = conn.execute(
        """
        SELECT l.pid
        FROM pg_locks l
        JOIN workpump_service_instance si
          ON l.objid = si.alive_lock_key::oid AND si.instance_id = %s
        WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
          AND l.classid = workpump.lock_namespace('alive')::oid
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
        """,
        (instance_id,),
    ).fetchall()
    return [row["pid"] for row in rows]


def sessions_named(conn: Conn, name: str) -> list[int]:
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (name,)
    ).fetchall()
    return [row["pid"] for row in rows]


def last_query(conn: Conn, pid: int | None) -> str | None:
    row = conn.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return None if row is None else str(row["query"]).strip()


def terminate(conn: Conn, pid: int | None) -> None:
    """Kill a backend and wait (up to 5 s) until it has exited."""
    assert pid is not None
    row = conn.execute("SELECT pg_terminate_backend(%s, 5000) AS ok", (pid,)).fetchone()
    assert row is not None and row["ok"] is True


def notify(conn: Conn, channel: str, payload: str = "") -> None:
    conn.execute("SELECT pg_notify(%s, %s)", (channel, payload))


# -- connect, probe, application name --------------------------------------------------


def test_gate_connects_probes_and_becomes_available_once(raw_connect):
    recorder = Recorder()
    gate = make_gate(recorder)
    observer = raw_connect()
    assert gate.available is False

    with running(gate):
        assert recorder.next_change() is True
        assert gate.available is True
        assert gate.connects == 1
        assert gate.failures == 0
        assert gate.last_failure is None
        pids = sessions_named(observer, f"workpump-{gate.instance_id}")
        assert pids == [gate.backend_pid]

    assert recorder.availability == [True, False]  # the False is the stop


# -- signals ---------------------------------------------------------------------------


def test_each_work_channel_wakes_its_signal(raw_connect):
    producer = raw_connect()

    with listening() as (gate, recorder):
        for channel, signal in CHANNELS.items():
            notify(producer, channel, "anything")
            assert recorder.next_signal() == signal

    assert set(CHANNELS.values()) == {"outbox", "inbox", "perspective_event", "receptor", "orphan"}
    assert gate.signals_received == len(CHANNELS)


def test_signal_comes_from_the_channel_not_the_payload(raw_connect):
    producer = raw_connect()

    with listening() as (_gate, recorder):
        notify(producer, "workpump_inbox", "outbox")
        assert recorder.next_signal() == "inbox"


def test_rows_of_flow_control_ending_wake_a_claim_for_free_slots_not_new_work(raw_connect):
    # complete_work's NOTIFY when flow-controlled rows ended (room under a cap): the
    # claimer claims for its free slots, and makes no claim of underserved groups for it
    producer = raw_connect()

    with listening() as (_gate, recorder):
        notify(producer, "workpump_outbox", "ended")
        notify(producer, "workpump_orphan", "ended")
        assert recorder.next_signal() == "outbox:ended"
        assert recorder.next_signal() == "orphan"


def test_notification_on_an_unrelated_channel_is_ignored(raw_connect):
    producer = raw_connect()

    with listening() as (gate, recorder):
        notify(producer, "workpump_unrelated", "outbox")
        notify(producer, "workpump_outboxx", "outbox")
        notify(producer, "workpump_orphan", "evicted")
        # Notifications of one session arrive in order: the orphan is the first signal.
        assert recorder.next_signal() == "orphan"
        assert recorder.signals.empty()
        assert gate.signals_received == 1


def test_committed_send_wakes_the_outbox_signal(raw_connect):
    producer = raw_connect()
    other = raw_connect()

    with listening() as (_gate, recorder):
        with producer.transaction():
            producer.execute("SELECT workpump.send('x', '{}')")
            # Committed after the send ran but before its commit: delivered first, alone.
            notify(other, "workpump_receptor")
            assert recorder.next_signal() == "receptor"
            assert recorder.signals.empty()
        assert recorder.next_signal() == "outbox"


# -- reconnect -------------------------------------------------------------------------


def test_killed_backend_is_one_transition_each_way_then_listens_again(raw_connect):
    admin = raw_connect()
    producer = raw_connect()

    with listening() as (gate, recorder):
        first_pid = gate.backend_pid
        terminate(admin, first_pid)

        assert recorder.next_change() is False
        assert recorder.next_change() is True
        assert recorder.availability == [True, False, True]
        assert gate.available is True
        assert gate.failures == 1
        assert gate.connects == 2
        assert gate.last_failure is not None and "Error" in gate.last_failure
        assert gate.backend_pid != first_pid
        assert sessions_named(admin, f"workpump-{gate.instance_id}") == [gate.backend_pid]

        notify(producer, "workpump_perspective_event")
        assert recorder.next_signal() == "perspective_event"

    assert recorder.availability == [True, False, True, False]


# -- alive-lock ------------------------------------------------------------------------


def test_gate_of_a_registered_instance_holds_its_alive_lock(raw_connect):
    recorder = Recorder()
    instance_id = uuid.uuid4()
    observer = raw_connect()
    register(observer, instance_id)
    gate = make_gate(recorder, instance_id)
    assert gate.alive_lock_held is False

    with running(gate):
        assert recorder.next_change() is True
        assert gate.alive_lock_held is True
        assert alive_lock_held(observer, instance_id) is True
        assert alive_lock_holders(observer, instance_id) == [gate.backend_pid]

    assert gate.alive_lock_held is False
    assert wait_until(lambda: not alive_lock_held(observer, instance_id))


def test_alive_lock_goes_with_the_killed_session_and_is_retaken_after_reconnect(raw_connect):
    recorder = Recorder()
    instance_id = uuid.uuid4()
    observer = raw_connect()
    register(observer, instance_id)
    gate = make_gate(recorder, instance_id)

    with running(gate):
        assert recorder.next_change() is True
        first_pid = gate.backend_pid
        assert alive_lock_holders(observer, instance_id) == [first_pid]

        terminate(observer, first_pid)
        assert recorder.next_change() is False
        assert first_pid not in alive_lock_holders(observer, instance_id)

        assert recorder.next_change() is True
        assert gate.alive_lock_held is True
        assert alive_lock_holders(observer, instance_id) == [gate.backend_pid]
        assert gate.backend_pid != first_pid


def test_unregistered_instance_takes_the_alive_lock_once_registered(raw_connect):
    recorder = Recorder()
    instance_id = uuid.uuid4()
    observer = raw_connect()
    gate = make_gate(recorder, instance_id, keepalive_seconds=0.2)

    with running(gate):
        assert recorder.next_change() is True
        assert gate.available is True
        assert gate.alive_lock_held is False

        register(observer, instance_id)
        assert alive_lock_held(observer, instance_id) is False
        assert wait_until(lambda: gate.alive_lock_held)
        assert alive_lock_holders(observer, instance_id) == [gate.backend_pid]
        assert recorder.availability == [True]


def test_a_second_gate_of_the_same_instance_takes_a_fresh_key_and_alone_proves_it_alive(
    raw_connect,
):
    # As a listener that reconnects while its old session lingers (half-open TCP): the
    # newest session is the instance's, and a lock the old one keeps proves nothing.
    first_recorder, second_recorder = Recorder(), Recorder()
    instance_id = uuid.uuid4()
    observer = raw_connect()
    register(observer, instance_id)
    first = make_gate(first_recorder, instance_id)
    second = make_gate(second_recorder, instance_id, keepalive_seconds=0.2)

    def recorded_pid() -> int:
        return observer.execute(
            "SELECT alive_lock_pid FROM workpump_service_instance WHERE instance_id = %s",
            (instance_id,),
        ).fetchone()["alive_lock_pid"]

    with running(first):
        assert first_recorder.next_change() is True
        assert first.alive_lock_held is True
        assert recorded_pid() == first.backend_pid
        with running(second):
            assert second_recorder.next_change() is True
            assert second.alive_lock_held is True
            assert recorded_pid() == second.backend_pid
            assert alive_lock_holders(observer, instance_id) == [second.backend_pid]
            assert alive_lock_held(observer, instance_id)

            first.stop()
            assert first_recorder.next_change() is False
            assert alive_lock_held(observer, instance_id)
            assert alive_lock_holders(observer, instance_id) == [second.backend_pid]


def test_gate_without_hold_alive_lock_never_takes_it(raw_connect):
    recorder = Recorder()
    instance_id = uuid.uuid4()
    observer = raw_connect()
    register(observer, instance_id)
    gate = make_gate(recorder, instance_id, hold_alive_lock=False, keepalive_seconds=0.2)

    with running(gate):
        assert recorder.next_change() is True
        # The keepalive has run once the session's last statement is its SELECT 1.
        assert wait_until(lambda: last_query(observer, gate.backend_pid) == "SELECT 1")
        assert gate.available is True
        assert gate.alive_lock_held is False
        assert alive_lock_held(observer, instance_id) is False
        assert alive_lock_holders(observer, instance_id) == []


# -- unreachable database, stop --------------------------------------------------------


def test_unreachable_database_keeps_retrying_unavailable_until_stopped():
    recorder = Recorder()
    dead = psycopg.conninfo.make_conninfo(conninfo(), host="127.0.0.1", port=1)
    gate = make_gate(recorder, dsn=dead)

    thread = threading.Thread(target=gate.run, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: gate.failures >= 3)
        assert gate.available is False
        assert gate.connects == 0
        assert gate.last_failure is not None and "OperationalError" in gate.last_failure
        assert thread.is_alive()
    finally:
        gate.stop()
        thread.join(3)
    assert not thread.is_alive()
    assert recorder.availability == []
    assert gate.alive_lock_held is False


def test_stop_while_available_ends_run_and_the_session(raw_connect):
    recorder = Recorder()
    gate = make_gate(recorder)
    observer = raw_connect()
    name = f"workpump-{gate.instance_id}"

    thread = threading.Thread(target=gate.run, daemon=True)
    thread.start()
    try:
        assert recorder.next_change() is True
        assert sessions_named(observer, name) == [gate.backend_pid]
    finally:
        gate.stop()
        thread.join(JOIN_SECONDS)
    assert not thread.is_alive()
    assert recorder.availability == [True, False]
    assert gate.available is False
    assert gate.failures == 0
    assert wait_until(lambda: sessions_named(observer, name) == [])


# -- backoff, subscribers --------------------------------------------------------------


@pytest.mark.parametrize(
    ("attempt", "seconds"), [(1, 1), (2, 2), (3, 4), (4, 8), (5, 16), (6, 30), (7, 30)]
)
def test_reconnect_delay_doubles_up_to_the_cap(attempt, seconds):
    assert reconnect_delay(attempt, initial=1, maximum=30) == seconds


def test_failing_signal_subscriber_does_not_stop_the_gate(raw_connect):
    recorder = Recorder()
    producer = raw_connect()

    def explode(signal: str) -> None:
        recorder.on_signal(signal)
        raise RuntimeError("subscriber bug")

    gate = NotifyGate(
        conninfo(),
        uuid.uuid4(),
        on_signal=explode,
        on_availability=recorder.on_availability,
        **FAST,
    )
    with running(gate):
        assert recorder.next_change() is True
        notify(producer, "workpump_outbox")
        assert recorder.next_signal() == "outbox"
        notify(producer, "workpump_inbox")
        assert recorder.next_signal() == "inbox"
        assert gate.available is True
        assert gate.failures == 0
        assert gate.connects == 1
