"""The runtime's view of the database: one instance's calls to the workpump functions.

Services talk to a ``Coordinator``; production uses ``DatabaseCoordinator`` (the ``db`` package on
the configured Django alias, from whichever thread calls it), tests use fakes.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from django.db import DatabaseError, close_old_connections, connections, transaction

from django_workpump import db
from django_workpump.conf import get_settings, lock_loss_grace_seconds
from django_workpump.db import ClaimedWork, Outcome
from django_workpump.registry import CATEGORIES
from django_workpump.states import OutcomeStatus
from django_workpump.work import Lease

T = TypeVar("T")


def lease_arrays(
    leases: Sequence[Lease],
) -> tuple[str, list[uuid.UUID], list[uuid.UUID]]:
    """The category and the parallel id and token arrays the fenced SQL functions take.

    One call writes about one category: leases of two are a caller's mistake.
    """
    categories = {lease.category for lease in leases}
    if len(categories) != 1:
        raise ValueError(
            f"A fenced write names the leases of one category, not of {sorted(categories)}: "
            "write each category apart."
        )
    return (
        leases[0].category,
        [lease.id for lease in leases],
        [lease.token for lease in leases],
    )


@dataclass(frozen=True)
class InstanceIdentity:
    """Who this process is: a fresh id per start."""

    instance_id: uuid.UUID = field(default_factory=uuid.uuid4)
    service_name: str = "workpump"
    host_name: str = field(default_factory=socket.gethostname)
    process_id: int = field(default_factory=os.getpid)


class Coordinator(Protocol):
    identity: InstanceIdentity

    def schema_ready(self) -> bool: ...
    def claim(self, max_rows: int, underserved_only: bool = False) -> list[ClaimedWork]: ...
    def renew(
        self, leases: Sequence[Lease]
    ) -> dict[uuid.UUID, Any]: ...  # id -> new expiry, or None: the attempt was cancelled
    # ``logs``: each attempt's log records (attempt_logs.py), given only when one has some.
    def complete(
        self,
        leases: Sequence[Lease],
        results: Sequence[str | None],
        logs: Sequence[str | None] | None = None,
    ) -> list[Outcome]: ...
    def fail(
        self,
        leases: Sequence[Lease],
        errors: Sequence[str],
        reasons: Sequence[str],
        delays: Sequence[float | None] | None = None,
        logs: Sequence[str | None] | None = None,
    ) -> list[Outcome]: ...
    def snooze(self, leases: Sequence[Lease], seconds: Sequence[float]) -> list[Outcome]: ...
    def discard(
        self,
        leases: Sequence[Lease],
        reasons: Sequence[str],
        logs: Sequence[str | None] | None = None,
    ) -> list[Outcome]: ...
    def release(self, leases: Sequence[Lease]) -> list[Outcome]: ...
    def dead_letter(
        self,
        leases: Sequence[Lease],
        errors: Sequence[str],
        reason: str,
        logs: Sequence[str | None] | None = None,
    ) -> list[Outcome]: ...
    def heartbeat(self, metadata: Mapping[str, Any]) -> bool: ...
    def next_eviction_in(self) -> float | None: ...
    def reap_stale(self) -> list[uuid.UUID]: ...
    def deregister(self) -> int: ...


# Functions the pump calls; the schema gate waits until all of them exist.
REQUIRED_FUNCTIONS = (
    "claim_work",
    "renew_leases",
    "complete_work",
    "fail_work",
    "release_work",
    "record_heartbeat",
    "cleanup_stale_instances",
    "next_eviction_in",
    "check_lease_tokens",
    "deregister_instance",
)


def reset_if_broken(alias: str) -> None:
    """Close this thread's connection if an error left it unusable, so the next call
    reconnects (a killed backend, a database restart, a pooler dropping the server).

    Healthy connections stay open: pump threads keep theirs whatever CONN_MAX_AGE says,
    instead of reconnecting every turn. Never inside a transaction the caller owns.
    """
    connection = connections[alias]
    if connection.connection is None or connection.in_atomic_block:
        return
    if connection.errors_occurred:
        if connection.is_usable():
            connection.errors_occurred = False
        else:
            connection.close()


class DatabaseCoordinator:
    """``Coordinator`` over the ``db`` package, with the WORKPUMP settings of this process.

    Every call first replaces a connection an earlier error broke, and after a failure
    closes it, so a service thread recovers from connection loss on its next turn.
    """

    def __init__(
        self,
        identity: InstanceIdentity,
        categories: Sequence[str] | None = None,
        topics: Mapping[str, Sequence[str]] | None = None,
        topic_prefixes: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.identity = identity
        self.settings = dict(get_settings())
        self.categories = list(categories) if categories else list(CATEGORIES)
        # {category: topics this process has handlers for}; None claims every topic.
        self.topics = None if topics is None else {c: list(t) for c, t in topics.items()}
        # {category: prefixes}: also every topic starting with one of them; None: none.
        self.topic_prefixes = (
            None if topic_prefixes is None else {c: list(p) for c, p in topic_prefixes.items() if p}
        )
        self.alias: str = self.settings["DATABASE_ALIAS"]

    def _call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        reset_if_broken(self.alias)
        try:
            return function(*args, **kwargs)
        except DatabaseError:
            reset_if_broken(self.alias)
            raise

    @property
    def stale_after_seconds(self) -> int:
        return int(self.settings["STALE_AFTER_SECONDS"])

    @property
    def dead_after_seconds(self) -> int:
        return int(self.settings["DEFINITIVELY_DEAD_AFTER_SECONDS"])

    @property
    def lock_loss_grace_seconds(self) -> float:
        return lock_loss_grace_seconds(self.settings)

    def schema_ready(self) -> bool:
        return self._call(db.schema_functions_present, REQUIRED_FUNCTIONS, using=self.alias)

    def claim(self, max_rows: int, underserved_only: bool = False) -> list[ClaimedWork]:
        """Lease up to ``max_rows`` rows; ``underserved_only``: only rows of the flow groups
        that hold fewer than the one holding most (db.claim_work)."""
        return self._call(
            db.claim_work,
            instance_id=self.identity.instance_id,
            max_rows=max_rows,
            lease_seconds=self.settings["LEASE_SECONDS"],
            partition_count=self.settings["PARTITION_COUNT"],
            categories=self.categories,
            topics=self.topics,
            topic_prefixes=self.topic_prefixes or None,
            stale_after_seconds=self.stale_after_seconds,
            definitively_dead_after_seconds=self.dead_after_seconds,
            stream_run_max=self.settings["STREAM_RUN_MAX"],
            synchronous_commit=self.settings["CLAIM_SYNCHRONOUS_COMMIT"],
            underserved_only=underserved_only,
            using=self.alias,
        )

    def flow_wait_ms(self) -> int | None:
        """What the last claim of this thread said of its rate-limited rows (ms until a
        token), or None."""
        return db.flow_wait_ms()

    def flow_fair(self) -> bool:
        """Whether the last claim of this thread reached rows of fairness keys."""
        return db.flow_fair()

    def renew(self, leases: Sequence[Lease]) -> dict[uuid.UUID, Any]:
        category, ids, tokens = lease_arrays(leases)
        return self._call(
            db.renew_leases,
            category=category,
            ids=ids,
            lease_tokens=tokens,
            lease_seconds=self.settings["LEASE_SECONDS"],
            instance_id=self.identity.instance_id,
            using=self.alias,
        )

    def complete(
        self,
        leases: Sequence[Lease],
        results: Sequence[str | None],
        logs: Sequence[str | None] | None = None,
    ) -> list[Outcome]:
        category, ids, tokens = lease_arrays(leases)
        return self._call(
            db.complete_work,
            instance_id=self.identity.instance_id,
            category=category,
            ids=ids,
            lease_tokens=tokens,
            results=results if any(r is not None for r in results) else None,
            logs=logs,
            using=self.alias,
        )

    def fail(
        self,
        leases: Sequence[Lease],
        errors: Sequence[str],
        reasons: Sequence[str],
        delays: Sequence[float | None] | None = None,
        logs: Sequence[str | None] | None = None,
    ) -> list[Outcome]:
        category, ids, tokens = lease_arrays(leases)
        return self._call(
            db.fail_work,
            instance_id=self.identity.instance_id,
            category=category,
            ids=ids,
            lease_tokens=tokens,
            errors=errors,
            reasons=reasons,
            retry_base_seconds=self.settings["RETRY_BACKOFF_BASE_SECONDS"],
            retry_max_seconds=self.settings["RETRY_BACKOFF_MAX_SECONDS"],
            retry_delays=delays,
            logs=logs,
            using=self.alias,
        )

    def snooze(self, leases: Sequence[Lease], seconds: Sequence[float]) -> list[Outcome]:
        category, ids, tokens = lease_arrays(leases)
        return self._call(
            db.snooze_work,
            instance_id=self.identity.instance_id,
            category=category,
            ids=ids,
            lease_tokens=tokens,
            seconds=seconds,
            max_snoozes=self.settings["MAX_SNOOZES"],
            using=self.alias,
        )

    def discard(
        self,
        leases: Sequence[Lease],
        reasons: Sequence[str],
        logs: Sequence[str | None] | None = None,
    ) -> list[Outcome]:
        category, ids, tokens = lease_arrays(leases)
        return self._call(
            db.discard_work,
            instance_id=self.identity.instance_id,
            category=category,
            ids=ids,
            lease_tokens=tokens,
            reasons=reasons,
            logs=logs,
            using=self.alias,
        )

    def release(self, leases: Sequence[Lease]) -> list[Outcome]:
        category, ids, tokens = lease_arrays(leases)
        return self._call(
            db.release_work,
            instance_id=self.identity.instance_id,
            category=category,
            ids=ids,
            lease_tokens=tokens,
            using=self.alias,
        )

    def dead_letter(
        self,
        leases: Sequence[Lease],
        errors: Sequence[str],
        reason: str,
        logs: Sequence[str | None] | None = None,
    ) -> list[Outcome]:
        """Park rows this instance holds as dead with ``reason`` without running them.

        The failure records each row's error under the lease fence; the dead-lettering
        parks at once what would otherwise be retried. A row on its last attempt is parked
        by the failure itself (with ``reason`` when it is one ``fail_work`` keeps, such as
        ``not_retryable`` and ``undecodable_payload``; else ``max_attempts``).
        """

        category, ids, tokens = lease_arrays(leases)

        def fail_and_park() -> list[Outcome]:
            with transaction.atomic(using=self.alias):
                failed = db.fail_work(
                    instance_id=self.identity.instance_id,
                    category=category,
                    ids=ids,
                    lease_tokens=tokens,
                    errors=errors,
                    reasons=[reason] * len(ids),
                    retry_base_seconds=self.settings["RETRY_BACKOFF_BASE_SECONDS"],
                    retry_max_seconds=self.settings["RETRY_BACKOFF_MAX_SECONDS"],
                    logs=logs,
                    using=self.alias,
                )
                retry = [o.work_id for o in failed if o.status == OutcomeStatus.RETRY]
                parked = set(
                    db.dead_letter(category=category, ids=retry, reason=reason, using=self.alias)
                    if retry
                    else []
                )
            return [
                Outcome(o.work_id, OutcomeStatus.DEAD) if o.work_id in parked else o for o in failed
            ]

        return self._call(fail_and_park)

    def heartbeat(self, metadata: Mapping[str, Any]) -> bool:
        return self._call(
            db.record_heartbeat,
            instance_id=self.identity.instance_id,
            service_name=self.identity.service_name,
            host_name=self.identity.host_name,
            process_id=self.identity.process_id,
            metadata_json=json.dumps(dict(metadata), default=str),
            stale_after_seconds=self.stale_after_seconds,
            definitively_dead_after_seconds=self.dead_after_seconds,
            lock_loss_grace_seconds=self.lock_loss_grace_seconds,
            using=self.alias,
        )

    def next_eviction_in(self) -> float | None:
        return self._call(
            db.next_eviction_in,
            instance_id=self.identity.instance_id,
            stale_after_seconds=self.stale_after_seconds,
            definitively_dead_after_seconds=self.dead_after_seconds,
            lock_loss_grace_seconds=self.lock_loss_grace_seconds,
            using=self.alias,
        )

    def reap_stale(self) -> list[uuid.UUID]:
        return self._call(
            db.reap_stale_instances,
            stale_after_seconds=self.stale_after_seconds,
            definitively_dead_after_seconds=self.dead_after_seconds,
            lock_loss_grace_seconds=self.lock_loss_grace_seconds,
            using=self.alias,
        )

    def deregister(self) -> int:
        return self._call(
            db.deregister_instance, instance_id=self.identity.instance_id, using=self.alias
        )


def release_thread_connection(alias: str) -> None:
    """Close this thread's Django connection (a service thread calls it on exit)."""
    close_old_connections()
    connections[alias].close()
