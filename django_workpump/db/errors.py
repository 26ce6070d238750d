"""The database refusing an instance (evicted or not registered): ``InstanceRefused``."""

from __future__ import annotations

from django.db import DatabaseError

# SQLSTATE of claim_work and renew_leases refusing an evicted or unregistered instance.
INSTANCE_REFUSED_SQLSTATE = "WP001"


class InstanceRefused(Exception):
    """The database refused this instance (evicted or not registered): it must stop."""


def _refused(exc: DatabaseError) -> InstanceRefused | None:
    """The InstanceRefused a database error stands for, or None for any other error."""
    if getattr(exc.__cause__, "sqlstate", None) != INSTANCE_REFUSED_SQLSTATE:
        return None
    diagnostic = getattr(exc.__cause__, "diag", None)
    message = getattr(diagnostic, "message_primary", None) or str(exc).strip()
    return InstanceRefused(message)
