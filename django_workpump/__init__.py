"""django-workpump: PostgreSQL as a reliable work pump for Django.

Produce work inside your transaction with ``send``, ``receive`` and ``emit``; handle it
with the decorators, ``periodic`` schedules it; run it with ``manage.py runworkpump``.
"""

from django_workpump.periodic import InvalidSchedule, periodic
from django_workpump.producer import InvalidWork, emit, receive, send
from django_workpump.pump.dispatch import Work
from django_workpump.registry import inbox_handler, outbox_handler, perspective, receptor

__all__ = [
    "InvalidSchedule",
    "InvalidWork",
    "Work",
    "emit",
    "inbox_handler",
    "outbox_handler",
    "periodic",
    "perspective",
    "receive",
    "receptor",
    "send",
]
