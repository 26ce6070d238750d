"""django-workpump: PostgreSQL as a reliable work pump for Django.

Produce work inside your transaction with ``send``, ``receive`` and ``emit`` (``send_many``
and ``emit_many`` for lists); handle it with the decorators, ``periodic`` schedules it;
run it with ``manage.py runworkpump``; ``batch`` groups rows under one callback and
``send(after=...)`` chains them;
``retry_now``, ``requeue_dead``, ``dead_letter``, ``release``, ``cancel`` and ``evict``
are the operator's actions; ``pause``, ``resume`` and ``set_limit`` steer flow control
(docs/flow-control.md). A handler raises ``Snooze``, ``Discard`` or ``Release`` to
steer its row, and takes a ``Retry`` policy and a ``timeout`` at registration; it may
``work.checkpoint(state)`` to resume there after a crash. ``wait`` (``await_work`` from
a coroutine) blocks until rows have ended and reports their outcomes.
"""

from django_workpump.actions import (
    Cancelled,
    cancel,
    dead_letter,
    evict,
    release,
    requeue_dead,
    retry_now,
)
from django_workpump.control import Discard, Release, Retry, Snooze
from django_workpump.flow import pause, resume, set_limit
from django_workpump.periodic import InvalidSchedule, periodic
from django_workpump.producer import (
    Duplicate,
    InvalidWork,
    emit,
    emit_many,
    receive,
    send,
    send_many,
)
from django_workpump.registry import inbox_handler, outbox_handler, perspective, receptor
from django_workpump.waiting import UnknownWork, WaitTimeout, WorkOutcome, await_work, wait
from django_workpump.work import CheckpointTooLarge, InvalidCheckpoint, LeaseLost, Work
from django_workpump.workflows import Batch, BatchStatus, batch, batch_status

__all__ = [
    "Batch",
    "BatchStatus",
    "Cancelled",
    "CheckpointTooLarge",
    "Discard",
    "Duplicate",
    "InvalidCheckpoint",
    "InvalidSchedule",
    "InvalidWork",
    "LeaseLost",
    "Release",
    "Retry",
    "Snooze",
    "UnknownWork",
    "WaitTimeout",
    "Work",
    "WorkOutcome",
    "await_work",
    "batch",
    "batch_status",
    "cancel",
    "dead_letter",
    "emit",
    "emit_many",
    "evict",
    "inbox_handler",
    "outbox_handler",
    "pause",
    "periodic",
    "perspective",
    "receive",
    "receptor",
    "release",
    "requeue_dead",
    "resume",
    "retry_now",
    "send",
    "send_many",
    "set_limit",
    "wait",
]
