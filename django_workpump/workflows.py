"""Batches: a group of rows whose last ending produces one callback row.

``with workpump.batch(on_complete=("reports.ready", {...})) as b:`` makes every outbox
row sent inside it (``send``, ``send_many``) a member of batch ``b.id``. The callback is
produced by the transaction that ends the last member, exactly once; see
docs/workflows.md. Dependencies between rows travel with ``send(after=[...])``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction

from django_workpump import db
from django_workpump.conf import setting
from django_workpump.work import Work

CallbackSpec = tuple[str, Mapping[str, Any]] | tuple[str, Mapping[str, Any], Mapping[str, Any]]

_OPTIONS = frozenset({"stream", "priority", "max_attempts"})
_current: ContextVar[Batch | None] = ContextVar("workpump_batch", default=None)


@dataclass(frozen=True)
class Batch:
    """An open batch: rows sent with ``batch=`` it (or inside its ``with``) join it."""

    id: uuid.UUID
    using: str


@dataclass(frozen=True)
class BatchStatus:
    """A batch's progress: members per outcome, and whether its callback was produced."""

    id: uuid.UUID
    parent_id: uuid.UUID | None
    total: int
    pending: int
    done: int
    dead: int
    discarded: int
    cancelled: int
    callback_id: uuid.UUID | None
    callback_error: str | None
    created_at: datetime
    finished_at: datetime | None

    @property
    def failed(self) -> int:
        """Members that ended other than done."""
        return self.dead + self.discarded + self.cancelled

    @property
    def finished(self) -> bool:
        return self.finished_at is not None


def current_batch() -> Batch | None:
    """The batch of the innermost open ``with workpump.batch(...)``, if any."""
    return _current.get()


def _spec_json(which: str, spec: CallbackSpec | None) -> str | None:
    if spec is None:
        return None
    if not isinstance(spec, tuple) or len(spec) not in (2, 3) or not isinstance(spec[0], str):
        raise TypeError(
            f"{which} must be (topic, payload) or (topic, payload, options), not {spec!r}."
        )
    topic, payload = spec[0], spec[1]
    options = dict(spec[2]) if len(spec) == 3 else {}
    if not isinstance(payload, Mapping):
        raise TypeError(f"The payload of {which} must be a mapping, not {type(payload).__name__}.")
    unknown = set(options) - _OPTIONS
    if unknown:
        raise TypeError(
            f"{which} options may be {', '.join(sorted(_OPTIONS))}, "
            f"not {', '.join(sorted(unknown))}."
        )
    return json.dumps({"topic": topic, "payload": dict(payload), **options})


@contextmanager
def batch(
    on_complete: CallbackSpec | None = None,
    on_failure: CallbackSpec | None = None,
    *,
    parent: Batch | uuid.UUID | Work | None = None,
    using: str | None = None,
) -> Iterator[Batch]:
    """Open a batch; outbox rows sent inside the block become its members.

    When the last member ends (done, dead, discarded or cancelled) one callback row is
    sent: ``on_failure`` when a member did not end done and it is given, else
    ``on_complete``; its payload gets ``"batch": {id, total, done, dead, discarded,
    cancelled, succeeded}``. The block runs in one transaction with the batch.

    ``parent`` (a Batch, a batch id, or a Work whose row is a member of one) makes this
    batch one member of the parent: it counts there when this batch's callback row ends.
    Inside another ``with batch()`` the outer one is the parent unless ``parent`` says.
    """
    alias = using or setting("DATABASE_ALIAS")
    complete_json = _spec_json("on_complete", on_complete)
    failure_json = _spec_json("on_failure", on_failure)
    with transaction.atomic(using=alias):
        parent_id = _parent_id(parent, alias)
        batch_id = db.open_batch(
            on_complete_json=complete_json,
            on_failure_json=failure_json,
            parent_batch_id=parent_id,
            using=alias,
        )
        opened = Batch(id=batch_id, using=alias)
        token = _current.set(opened)
        try:
            yield opened
        finally:
            _current.reset(token)
        db.seal_batch(batch_id, using=alias)


def _parent_id(parent: Batch | uuid.UUID | Work | None, alias: str) -> uuid.UUID | None:
    """The batch a new batch nests in: as a send's batch, or the batch of a Work."""
    if isinstance(parent, Work):
        found = db.batch_of(parent.id, using=alias)
        if found is None:
            raise ValueError(f"Work {parent.id} is no member of a batch: pass parent=None.")
        return found
    return batch_id_for(parent, alias)


def batch_status(batch_id: uuid.UUID | str, *, using: str | None = None) -> BatchStatus | None:
    """The progress of batch ``batch_id``, or None when there is no such batch."""
    row = db.batch_status(uuid.UUID(str(batch_id)), using=using or setting("DATABASE_ALIAS"))
    if row is None:
        return None
    return BatchStatus(
        id=row["id"],
        parent_id=row["parent_batch_id"],
        total=row["total"],
        pending=row["pending"],
        done=row["done"],
        dead=row["dead"],
        discarded=row["discarded"],
        cancelled=row["cancelled"],
        callback_id=row["callback_id"],
        callback_error=row["callback_error"],
        created_at=row["created_at"],
        finished_at=row["finished_at"],
    )


def batch_id_for(batch_arg: Batch | uuid.UUID | None, alias: str) -> uuid.UUID | None:
    """The batch a send joins: the one given, else the open ``with batch()`` of ``alias``."""
    if batch_arg is None:
        outer = _current.get()
        return outer.id if outer is not None and outer.using == alias else None
    if isinstance(batch_arg, Batch):
        return batch_arg.id
    return uuid.UUID(str(batch_arg))
