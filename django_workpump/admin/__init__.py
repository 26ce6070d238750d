"""The Django admin of the work pump (docs/admin.md).

One changelist per work category with state, lease, attempts and the holder's heartbeat
computed by PostgreSQL; operator actions through the SQL functions; instances,
tombstones, stream ownership, and a summary page with the numbers of
``manage.py workpump_status``. See docs/admin.md.
"""

from __future__ import annotations

from django.contrib import admin

from django_workpump.admin.batches import BatchAdmin
from django_workpump.admin.flow import FlowRuleAdmin
from django_workpump.admin.instances import (
    ActiveStreamAdmin,
    EvictionAdmin,
    ServiceInstanceAdmin,
)
from django_workpump.admin.periodic import PeriodicScheduleAdmin
from django_workpump.admin.perms import can_view_summary
from django_workpump.admin.work import (
    InboxAdmin,
    OutboxAdmin,
    PerspectiveEventAdmin,
    ReceptorProcessingAdmin,
    WorkAdmin,
)
from django_workpump.models import (
    ActiveStream,
    Batch,
    Eviction,
    FlowRule,
    Inbox,
    Outbox,
    PeriodicSchedule,
    PerspectiveEvent,
    ReceptorProcessing,
    ServiceInstance,
)

admin.site.register(Outbox, OutboxAdmin)
admin.site.register(Inbox, InboxAdmin)
admin.site.register(PerspectiveEvent, PerspectiveEventAdmin)
admin.site.register(ReceptorProcessing, ReceptorProcessingAdmin)
admin.site.register(ServiceInstance, ServiceInstanceAdmin)
admin.site.register(Eviction, EvictionAdmin)
admin.site.register(ActiveStream, ActiveStreamAdmin)
admin.site.register(PeriodicSchedule, PeriodicScheduleAdmin)
admin.site.register(Batch, BatchAdmin)
admin.site.register(FlowRule, FlowRuleAdmin)

__all__ = [
    "ActiveStreamAdmin",
    "BatchAdmin",
    "EvictionAdmin",
    "FlowRuleAdmin",
    "InboxAdmin",
    "OutboxAdmin",
    "PeriodicScheduleAdmin",
    "PerspectiveEventAdmin",
    "ReceptorProcessingAdmin",
    "ServiceInstanceAdmin",
    "WorkAdmin",
    "can_view_summary",
]
