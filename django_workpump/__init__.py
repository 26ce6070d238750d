"""django-workpump: PostgreSQL as a reliable work pump for Django.

Produce work inside your transaction with ``send``, ``receive`` and ``emit``; handle it
with the decorators; run it with ``manage.py runworkpump``.
"""

from django_workpump.producer import InvalidWork, emit, receive, send
from django_workpump.pump.dispatch import Work
from django_workpump.registry import inbox_handler, outbox_handler, perspective, receptor

__all__ = [
    "InvalidWork",
    "Work",
    "emit",
    "inbox_handler",
    "outbox_handler",
    "perspective",
    "receive",
    "receptor",
    "send",
]
