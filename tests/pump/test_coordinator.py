"""DatabaseCoordinator: a service thread recovers from a lost connection on its next call,
and its claims commit as CLAIM_SYNCHRONOUS_COMMIT says."""

from __future__ import annotations

import uuid

import pytest
from django.db import DatabaseError, connection, transaction

from django_workpump import send
from django_workpump.pump.coordinator import DatabaseCoordinator, InstanceIdentity, lease_arrays
from django_workpump.work import Lease

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_killed_backend_fails_one_call_and_the_next_call_reconnects(raw_connect):
    coordinator = DatabaseCoordinator(InstanceIdentity(service_name="recover"))
    assert coordinator.heartbeat({}) is True
    pid = connection.connection.info.backend_pid

    raw_connect().execute("SELECT pg_terminate_backend(%s, 5000)", [pid])

    with pytest.raises(DatabaseError):
        coordinator.heartbeat({})
    # the broken connection was closed, so this call opens a fresh one
    assert coordinator.heartbeat({}) is True
    assert connection.connection.info.backend_pid != pid
    assert coordinator.claim(5) == []


def test_a_healthy_connection_is_kept_across_calls_whatever_conn_max_age_says():
    coordinator = DatabaseCoordinator(InstanceIdentity(service_name="keep"))
    coordinator.heartbeat({})
    pid = connection.connection.info.backend_pid
    for _ in range(3):
        coordinator.claim(5)
        coordinator.next_eviction_in()
    assert connection.connection.info.backend_pid == pid


@pytest.fixture
def commit_settings_seen(raw_connect):
    """The synchronous_commit each committing transaction that leased an outbox row had.

    A deferred constraint trigger runs at commit, just before the commit record is
    written: what it reads is the setting that commit obeys.
    """
    admin = raw_connect()
    admin.execute("CREATE TABLE test_commit_setting (setting text)")
    admin.execute(
        "CREATE FUNCTION test_record_commit_setting() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN INSERT INTO test_commit_setting"
        " VALUES (current_setting('synchronous_commit')); RETURN NULL; END $$"
    )
    admin.execute(
        "CREATE CONSTRAINT TRIGGER test_commit_setting AFTER UPDATE ON workpump_outbox"
        " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW"
        " WHEN (new.instance_id IS NOT NULL AND old.instance_id IS NULL)"
        " EXECUTE FUNCTION test_record_commit_setting()"
    )

    def seen() -> list[str]:
        rows = admin.execute("DELETE FROM test_commit_setting RETURNING setting").fetchall()
        return [row["setting"] for row in rows]

    yield seen
    admin.execute("DROP TRIGGER test_commit_setting ON workpump_outbox")
    admin.execute("DROP FUNCTION test_record_commit_setting()")
    admin.execute("DROP TABLE test_commit_setting")


def _send_and_claim(coordinator: DatabaseCoordinator) -> int:
    send("emails.welcome", {"n": 1})
    return len(coordinator.claim(5))


def test_a_claim_commits_without_waiting_for_its_wal_flush_by_default(commit_settings_seen):
    coordinator = DatabaseCoordinator(InstanceIdentity(service_name="async-claim"))
    coordinator.heartbeat({})
    assert _send_and_claim(coordinator) == 1
    assert commit_settings_seen() == ["off"]
    # for that transaction only: the session's setting is the server's again
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone() == ("on",)


def test_claim_synchronous_commit_makes_a_claim_wait_for_its_wal_flush(
    settings, commit_settings_seen
):
    settings.WORKPUMP = {"CLAIM_SYNCHRONOUS_COMMIT": True}
    coordinator = DatabaseCoordinator(InstanceIdentity(service_name="sync-claim"))
    coordinator.heartbeat({})
    assert _send_and_claim(coordinator) == 1
    assert commit_settings_seen() == ["on"]


def test_a_claim_inside_the_callers_transaction_leaves_its_commit_setting_alone(
    commit_settings_seen,
):
    coordinator = DatabaseCoordinator(InstanceIdentity(service_name="in-transaction"))
    coordinator.heartbeat({})
    with transaction.atomic():
        assert _send_and_claim(coordinator) == 1
        with connection.cursor() as cursor:
            cursor.execute("SHOW synchronous_commit")
            assert cursor.fetchone() == ("on",)
    assert commit_settings_seen() == ["on"]


def test_a_fenced_write_turns_its_leases_into_one_category_and_parallel_arrays():
    first, second = uuid.uuid4(), uuid.uuid4()
    tokens = uuid.uuid4(), uuid.uuid4()
    leases = [Lease("outbox", first, tokens[0]), Lease("outbox", second, tokens[1])]

    assert lease_arrays(leases) == ("outbox", [first, second], list(tokens))
    with pytest.raises(ValueError, match=r"of one category, not of \['inbox', 'outbox'\]"):
        lease_arrays([*leases, Lease("inbox", uuid.uuid4(), uuid.uuid4())])
