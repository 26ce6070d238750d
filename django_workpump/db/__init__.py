"""Typed wrappers around the workpump SQL functions: the only place that runs SQL.

Each wrapper runs one named query of ``sql/queries.sql`` on a Django connection (the
``WORKPUMP['DATABASE_ALIAS']`` one unless ``using`` says otherwise), so it joins the
caller's transaction. ``now`` is for tests only: production lets the database clock rule.

The wrappers live in modules by concern; every public name is re-exported here, so
callers write ``db.claim_work`` or ``from django_workpump.db import Outcome``:

- ``producers``: send, receive, emit and their bulk forms, unique keys, subscriptions;
- ``claim``: ``claim_work`` and the claimed rows (``ClaimedWork``);
- ``outcomes``: renewals and what a holder does with its rows (``Outcome``);
- ``instances``: heartbeats, eviction of stale instances, deregistration;
- ``gate``: the NOTIFY gate's own connection (alive-lock, probes, cancelled attempts);
- ``maintenance``: the schema check, the maintenance lock, retention purges;
- ``periodic``: periodic schedules;
- ``flow``: flow rules (caps, rates, weights, pauses) and how each stands;
- ``operator_actions``: operators' selections and changes, evictions;
- ``status``: reads of the status report;
- ``workflows``: batches (open, seal, status);
- ``queries``, ``loaders``, ``rows``, ``errors``: running named queries, reading
  their rows, and the database refusing an instance.
"""

from __future__ import annotations

from django_workpump.db.claim import ClaimedWork, claim_work, flow_fair, flow_wait_ms
from django_workpump.db.console import console_counting, console_sample, purge_console
from django_workpump.db.errors import INSTANCE_REFUSED_SQLSTATE, InstanceRefused
from django_workpump.db.flow import (
    FlowRuleStatus,
    flag_flow_stragglers,
    flow_reason,
    flow_rule_status,
    set_flow_rule,
    sync_flow_rules,
)
from django_workpump.db.gate import cancelled_attempts, keepalive, notify_probe, take_alive_lock
from django_workpump.db.instances import (
    alive_lock_held,
    cleanup_stale_instances,
    deregister_instance,
    next_eviction_in,
    reap_stale_instances,
    record_heartbeat,
    set_application_name,
)
from django_workpump.db.loaders import PARSED_ONCE_MAX, StoredTime
from django_workpump.db.maintenance import (
    maintenance_lock_holders,
    purge_batches,
    purge_dead,
    purge_events,
    purge_evictions,
    purge_idle_streams,
    purge_inbox_dedup,
    purge_processed,
    purge_task_attempts,
    release_maintenance_lock,
    schema_functions_present,
    try_maintenance_lock,
)
from django_workpump.db.operator_actions import (
    CancelledWork,
    InstanceStanding,
    RunningWork,
    SelectedWork,
    cancel_work,
    evict_instance,
    instance_standing,
    lock_work,
    release_leases,
    requeue_dead,
    retry_now,
    running_work,
    select_work,
)
from django_workpump.db.outcomes import (
    Outcome,
    checkpoint_work,
    complete_work,
    dead_letter,
    discard_work,
    fail_work,
    release_work,
    renew_leases,
    snooze_work,
)
from django_workpump.db.periodic import (
    PeriodicState,
    fire_periodic,
    pause_periodic,
    periodic_states,
    skip_periodic,
    upsert_periodic,
)
from django_workpump.db.producers import (
    Received,
    emit,
    emit_many,
    receive,
    send,
    send_many,
    sync_subscriptions,
    unique_key_holder,
)
from django_workpump.db.queries import (
    explain_arms,
    fetch_named,
    stored_times_readable,
    without_jit,
)
from django_workpump.db.rows import FromRow, Row
from django_workpump.db.search import payload_index_ready, payload_indexes
from django_workpump.db.status import StuckRow, stuck_rows
from django_workpump.db.workflows import (
    batch_of,
    batch_status,
    join_batch,
    open_batch,
    seal_batch,
)

__all__ = [
    "INSTANCE_REFUSED_SQLSTATE",
    "PARSED_ONCE_MAX",
    "PAYLOAD_INDEXES",
    "CancelledWork",
    "ClaimedWork",
    "FlowRuleStatus",
    "FromRow",
    "InstanceRefused",
    "InstanceStanding",
    "Outcome",
    "PeriodicState",
    "Received",
    "Row",
    "RunningWork",
    "SelectedWork",
    "StoredTime",
    "StuckRow",
    "alive_lock_held",
    "batch_of",
    "batch_status",
    "cancel_work",
    "cancelled_attempts",
    "checkpoint_work",
    "claim_work",
    "cleanup_stale_instances",
    "complete_work",
    "console_counting",
    "console_sample",
    "dead_letter",
    "deregister_instance",
    "discard_work",
    "emit",
    "emit_many",
    "evict_instance",
    "explain_arms",
    "fail_work",
    "fetch_named",
    "fire_periodic",
    "flag_flow_stragglers",
    "flow_fair",
    "flow_reason",
    "flow_rule_status",
    "flow_wait_ms",
    "instance_standing",
    "join_batch",
    "keepalive",
    "lock_work",
    "maintenance_lock_holders",
    "next_eviction_in",
    "notify_probe",
    "open_batch",
    "pause_periodic",
    "payload_index_ready",
    "payload_indexes",
    "periodic_states",
    "purge_batches",
    "purge_console",
    "purge_dead",
    "purge_events",
    "purge_evictions",
    "purge_idle_streams",
    "purge_inbox_dedup",
    "purge_processed",
    "purge_task_attempts",
    "reap_stale_instances",
    "receive",
    "record_heartbeat",
    "release_leases",
    "release_maintenance_lock",
    "release_work",
    "renew_leases",
    "requeue_dead",
    "retry_now",
    "running_work",
    "schema_functions_present",
    "seal_batch",
    "select_work",
    "send",
    "send_many",
    "set_application_name",
    "set_flow_rule",
    "skip_periodic",
    "snooze_work",
    "stored_times_readable",
    "stuck_rows",
    "sync_flow_rules",
    "sync_subscriptions",
    "take_alive_lock",
    "try_maintenance_lock",
    "unique_key_holder",
    "upsert_periodic",
    "without_jit",
]
