"""Storing work: outbox rows, inbox rows and events with their work, one by one or in
bulk, and the registry's subscriptions.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django_workpump.db.queries import _fetch, _scalar
from django_workpump.db.rows import FromRow


def send(
    *,
    destination: str,
    payload_json: str,
    stream: str | None,
    priority: int,
    scheduled_for: datetime | None,
    max_attempts: int,
    message_id: uuid.UUID | None,
    partition_count: int,
    max_payload_bytes: int,
    max_payload_depth: int,
    unique_key: str | None = None,
    unique_for: timedelta | None = None,
    headers_json: str | None = None,
    batch_id: uuid.UUID | None = None,
    after: Sequence[uuid.UUID] | None = None,
    after_policy: str = "cancel",
    concurrency_key: str | None = None,
    fairness_key: str | None = None,
    using: str | None = None,
) -> uuid.UUID:
    """Store an outbox row; with ``unique_key``, the id of the row holding it if any."""
    params = {
        "destination": destination,
        "payload": payload_json,
        "stream": stream,
        "priority": priority,
        "scheduled_for": scheduled_for,
        "max_attempts": max_attempts,
        "message_id": message_id,
        "partition_count": partition_count,
        "max_payload_bytes": max_payload_bytes,
        "max_payload_depth": max_payload_depth,
        "concurrency_key": concurrency_key,
        "fairness_key": fairness_key,
        "unique_key": unique_key,
        "unique_for": unique_for,
        "headers": headers_json,
        "batch_id": batch_id,
        "after": None if after is None else list(after),
        "after_policy": after_policy,
    }
    return _scalar("send", params, using)


def send_many(
    *,
    destination: str,
    payloads_json: Sequence[str],
    streams: Sequence[str | None] | None,
    priority: int,
    scheduled_for: datetime | None,
    max_attempts: int,
    message_ids: Sequence[uuid.UUID] | None,
    partition_count: int,
    max_payload_bytes: int,
    max_payload_depth: int,
    batch_id: uuid.UUID | None = None,
    concurrency_key: str | None = None,
    fairness_key: str | None = None,
    using: str | None = None,
) -> list[uuid.UUID]:
    """Store one outbox row per payload, in list order, in one statement; their ids."""
    params = {
        "destination": destination,
        "payloads": "[" + ",".join(payloads_json) + "]",
        "streams": None if streams is None else json.dumps(list(streams)),
        "priority": priority,
        "scheduled_for": scheduled_for,
        "max_attempts": max_attempts,
        "message_ids": None if message_ids is None else list(message_ids),
        "partition_count": partition_count,
        "max_payload_bytes": max_payload_bytes,
        "max_payload_depth": max_payload_depth,
        "batch_id": batch_id,
        "concurrency_key": concurrency_key,
        "fairness_key": fairness_key,
    }
    return list(_scalar("send_many", params, using))


def emit_many(
    *,
    event_type: str,
    payloads_json: Sequence[str],
    streams: Sequence[str | None] | None,
    subscribers_json: str,
    event_ids: Sequence[uuid.UUID] | None,
    priority: int,
    partition_count: int,
    max_payload_bytes: int,
    max_payload_depth: int,
    concurrency_key: str | None = None,
    fairness_key: str | None = None,
    using: str | None = None,
) -> list[uuid.UUID]:
    """Store one event per payload and its work, in list order, in one statement."""
    params = {
        "event_type": event_type,
        "payloads": "[" + ",".join(payloads_json) + "]",
        "streams": None if streams is None else json.dumps(list(streams)),
        "subscribers": subscribers_json,
        "event_ids": None if event_ids is None else list(event_ids),
        "priority": priority,
        "partition_count": partition_count,
        "max_payload_bytes": max_payload_bytes,
        "max_payload_depth": max_payload_depth,
        "concurrency_key": concurrency_key,
        "fairness_key": fairness_key,
    }
    return list(_scalar("emit_many", params, using))


@dataclass(frozen=True, slots=True)
class Received(FromRow):
    """What ``receive`` did: ``stored`` (False: a duplicate) and the row's ``created_at``."""

    stored: bool
    created_at: datetime


def receive(
    *,
    message_id: uuid.UUID,
    handler_name: str,
    payload_json: str,
    stream: str | None,
    priority: int,
    scheduled_for: datetime | None,
    max_attempts: int,
    partition_count: int,
    max_payload_bytes: int,
    max_payload_depth: int,
    deduplicate: bool = True,
    unique_key: str | None = None,
    unique_for: timedelta | None = None,
    headers_json: str | None = None,
    concurrency_key: str | None = None,
    fairness_key: str | None = None,
    using: str | None = None,
) -> Received:
    params = {
        "message_id": message_id,
        "handler_name": handler_name,
        "payload": payload_json,
        "stream": stream,
        "priority": priority,
        "scheduled_for": scheduled_for,
        "max_attempts": max_attempts,
        "partition_count": partition_count,
        "max_payload_bytes": max_payload_bytes,
        "max_payload_depth": max_payload_depth,
        "concurrency_key": concurrency_key,
        "fairness_key": fairness_key,
        "deduplicate": deduplicate,
        "unique_key": unique_key,
        "unique_for": unique_for,
        "headers": headers_json,
    }
    return Received.from_row(_fetch("receive", params, using)[0])


def emit(
    *,
    event_type: str,
    payload_json: str,
    stream: str | None,
    subscribers_json: str,
    event_id: uuid.UUID | None,
    priority: int,
    partition_count: int,
    max_payload_bytes: int,
    max_payload_depth: int,
    unique_key: str | None = None,
    unique_for: timedelta | None = None,
    headers_json: str | None = None,
    concurrency_key: str | None = None,
    fairness_key: str | None = None,
    using: str | None = None,
) -> uuid.UUID:
    """Store an event and its work; with ``unique_key``, the id of the event holding it."""
    params = {
        "event_type": event_type,
        "payload": payload_json,
        "stream": stream,
        "subscribers": subscribers_json,
        "event_id": event_id,
        "priority": priority,
        "partition_count": partition_count,
        "max_payload_bytes": max_payload_bytes,
        "max_payload_depth": max_payload_depth,
        "concurrency_key": concurrency_key,
        "fairness_key": fairness_key,
        "unique_key": unique_key,
        "unique_for": unique_for,
        "headers": headers_json,
    }
    return _scalar("emit", params, using)


def unique_key_holder(
    *,
    kind: str,
    topic: str,
    unique_key: str,
    unique_for: timedelta | None,
    using: str | None = None,
) -> uuid.UUID | None:
    """The id of the outbox row, inbox row or event (``kind``) holding the key, if any."""
    params = {"kind": kind, "topic": topic, "unique_key": unique_key, "unique_for": unique_for}
    return _scalar("unique_key_holder", params, using)


def sync_subscriptions(*, subscriptions_json: str, replace: bool, using: str | None = None) -> int:
    """Upsert the registry's subscriptions (``replace``: delete all others)."""
    params = {"subscriptions": subscriptions_json, "replace": replace}
    return int(_scalar("sync_subscriptions", params, using))
