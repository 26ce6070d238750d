"""Operator actions in Python: retry, re-queue, dead-letter, release, cancel, evict.

Each runs the SQL function the admin's actions run (docs/sql-api.md), on the
``WORKPUMP['DATABASE_ALIAS']`` connection (or ``using``), so it joins the caller's
transaction, and returns what it changed. Work ids may be of any category: each id's
category is looked up unless ``category=`` names it. Ids that match no row, or rows an
action does not apply to (``retry_now`` of a dead row, ...), are left alone and are not
in the result (``cancel`` reports them too). ``manage.py workpump_action`` is the
command-line face of these.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from typing import Any

from django_workpump import db
from django_workpump.conf import get_settings, setting
from django_workpump.dead_letters import log_when_committed
from django_workpump.registry import CATEGORIES

# The failure_reason column's length.
MAX_REASON_CHARS = 40

WorkIds = uuid.UUID | str | Iterable[uuid.UUID | str]


def as_ids(ids: WorkIds, what: str = "work id") -> list[uuid.UUID]:
    """Return ``ids`` (one id or an iterable, UUIDs or strings) as UUIDs."""
    items: Iterable[Any] = [ids] if isinstance(ids, uuid.UUID | str) else ids
    result = []
    for item in items:
        try:
            result.append(item if isinstance(item, uuid.UUID) else uuid.UUID(str(item)))
        except ValueError:
            raise ValueError(
                f"{item!r} is not a valid {what}: pass UUIDs (or their strings), e.g. the id "
                "column of the admin or of manage.py workpump_status."
            ) from None
    return result


def _check_category(category: str | None) -> None:
    if category is not None and category not in CATEGORIES:
        raise ValueError(
            f"Unknown category {category!r}; use one of {', '.join(CATEGORIES)}, "
            "or leave category out to look each id up."
        )


def by_category(
    ids: WorkIds, *, category: str | None = None, using: str | None = None
) -> dict[str, list[uuid.UUID]]:
    """Group work ids by the category of their row (ids of no row are left out)."""
    _check_category(category)
    wanted = as_ids(ids)
    if not wanted:
        return {}
    if category is not None:
        return {category: wanted}
    found: dict[str, list[uuid.UUID]] = {}
    for row in db.select_work(ids=wanted, using=using):
        found.setdefault(row.category, []).append(row.work_id)
    return found


def _each_category(
    ids: WorkIds,
    category: str | None,
    using: str | None,
    action: Callable[[str, list[uuid.UUID], str], list[uuid.UUID]],
) -> list[uuid.UUID]:
    alias = using or setting("DATABASE_ALIAS")
    changed: list[uuid.UUID] = []
    for found_category, found in by_category(ids, category=category, using=alias).items():
        changed.extend(action(found_category, found, alias))
    return changed


def retry_now(
    ids: WorkIds, *, category: str | None = None, using: str | None = None
) -> list[uuid.UUID]:
    """Make scheduled rows (waiting for a retry or a deferral) claimable now."""
    return _each_category(
        ids, category, using, lambda c, i, a: db.retry_now(category=c, ids=i, using=a)
    )


def requeue_dead(
    ids: WorkIds, *, category: str | None = None, using: str | None = None
) -> list[uuid.UUID]:
    """Give dead rows a fresh set of attempts (their last error stays)."""
    return _each_category(
        ids, category, using, lambda c, i, a: db.requeue_dead(category=c, ids=i, using=a)
    )


def dead_letter(
    ids: WorkIds, reason: str, *, category: str | None = None, using: str | None = None
) -> list[uuid.UUID]:
    """Park undone rows as dead with ``reason``; they block their stream until re-queued."""
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError(
            f"dead_letter needs a reason (a non-empty string), not {reason!r}: it is shown as "
            "the row's failure reason."
        )
    if len(reason) > MAX_REASON_CHARS:
        raise ValueError(
            f"The dead_letter reason {reason!r} is {len(reason)} characters long, over "
            f"{MAX_REASON_CHARS} (it is stored as the row's failure_reason); shorten it."
        )

    def park(found_category: str, found: list[uuid.UUID], alias: str) -> list[uuid.UUID]:
        parked = db.dead_letter(category=found_category, ids=found, reason=reason, using=alias)
        log_when_committed(found_category, parked, reason, by="an operator", using=alias)
        return parked

    return _each_category(ids, category, using, park)


def release(
    ids: WorkIds,
    force: bool = False,
    *,
    category: str | None = None,
    using: str | None = None,
) -> list[uuid.UUID]:
    """Release leases so the rows can be claimed again.

    Rows held by a live instance are left alone unless ``force``: a live holder may still
    be running them, and released they would run twice (its late outcome is fenced out).
    """
    settings = get_settings()
    return _each_category(
        ids,
        category,
        using,
        lambda c, i, a: db.release_leases(
            category=c,
            ids=i,
            force=bool(force),
            stale_after_seconds=settings["STALE_AFTER_SECONDS"],
            definitively_dead_after_seconds=settings["DEFINITIVELY_DEAD_AFTER_SECONDS"],
            using=a,
        ),
    )


class Cancelled(list[uuid.UUID]):
    """The ids ``cancel`` changed (a list), and what it found about the others.

    - ``running``: the changed ids whose attempt was running; their holder is told by
      NOTIFY when the caller's transaction commits.
    - ``unknown``: ids of no work row.
    - ``ended``: ids of rows that had already ended (done, cancelled or discarded),
      left as they were.
    """

    def __init__(
        self,
        changed: Iterable[uuid.UUID] = (),
        *,
        running: Iterable[uuid.UUID] = (),
        unknown: Iterable[uuid.UUID] = (),
        ended: Iterable[uuid.UUID] = (),
    ) -> None:
        super().__init__(changed)
        self.running = list(running)
        self.unknown = list(unknown)
        self.ended = list(ended)

    def __repr__(self) -> str:
        return (
            f"Cancelled({list(self)!r}, running={self.running!r}, unknown={self.unknown!r}, "
            f"ended={self.ended!r})"
        )


def cancel(ids: WorkIds, *, category: str | None = None, using: str | None = None) -> Cancelled:
    """End undone rows as ``cancelled``: they never run (again) and their stream moves on.

    A pending, scheduled, orphaned or dead row just ends. A running row ends too, at
    once: its holder is told by NOTIFY when the caller's transaction commits (and by its
    next renewal, should the NOTIFY be missed), ``work.cancelled`` turns true for its
    handler, an async handler's task is cancelled, and whatever the attempt reports
    later is fenced out. Ids of no row are reported in ``result.unknown``, not raised.
    """
    _check_category(category)
    alias = using or setting("DATABASE_ALIAS")
    wanted = as_ids(ids)
    if not wanted:
        return Cancelled()
    found = {row.work_id: row for row in db.select_work(ids=wanted, using=alias)}
    if category is not None:
        found = {i: row for i, row in found.items() if row.category == category}
    grouped: dict[str, list[uuid.UUID]] = {}
    for row in found.values():
        grouped.setdefault(row.category, []).append(row.work_id)
    changed: list[uuid.UUID] = []
    running: list[uuid.UUID] = []
    for found_category, found_ids in grouped.items():
        for cancelled in db.cancel_work(category=found_category, ids=found_ids, using=alias):
            changed.append(cancelled.work_id)
            if cancelled.holder is not None:
                running.append(cancelled.work_id)
    done = set(changed)
    return Cancelled(
        changed,
        running=running,
        unknown=[i for i in dict.fromkeys(wanted) if i not in found],
        ended=[i for i in dict.fromkeys(wanted) if i in found and i not in done],
    )


class UnknownInstance(ValueError):
    """No registration, tombstone or lease names this instance id."""


def evict(
    instance_id: uuid.UUID | str,
    reason: str = "evicted by an operator",
    *,
    using: str | None = None,
) -> int:
    """Evict one instance now: tombstone it and release its leases; return rows released.

    Its next heartbeat is refused and it exits. Evicting it again releases nothing (0).
    An id nothing in the database names raises UnknownInstance and writes no tombstone:
    instance ids are fresh UUIDs a process makes at start, and an unregistered instance
    can take no lease, so such a tombstone would protect nothing.
    """
    (found,) = as_ids(instance_id, "instance id")
    settings = get_settings()
    (standing,) = db.instance_standing(
        ids=[found],
        stale_after_seconds=settings["STALE_AFTER_SECONDS"],
        definitively_dead_after_seconds=settings["DEFINITIVELY_DEAD_AFTER_SECONDS"],
        using=using,
    )
    if not standing.known:
        raise UnknownInstance(
            f"No instance is registered, tombstoned or holds a lease under the id {found}; "
            "nothing was evicted. Check the id with manage.py workpump_status."
        )
    return db.evict_instance(instance_id=found, reason=reason, using=using)
