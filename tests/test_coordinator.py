"""DatabaseCoordinator: a service thread recovers from a lost connection on its next call."""

from __future__ import annotations

import pytest
from django.db import DatabaseError, connection

from django_workpump.pump.coordinator import DatabaseCoordinator, InstanceIdentity

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
