-- Named queries of db.py: each block runs one workpump.* function (or one read), with
-- Django's %(name)s placeholders. Functions themselves live in schema.sql.

-- name: send
SELECT workpump.send(
    p_destination => %(destination)s,
    p_payload => %(payload)s::jsonb,
    p_stream => %(stream)s,
    p_priority => %(priority)s,
    p_scheduled_for => %(scheduled_for)s,
    p_max_attempts => %(max_attempts)s,
    p_message_id => %(message_id)s,
    p_partition_count => %(partition_count)s,
    p_max_payload_bytes => %(max_payload_bytes)s,
    p_max_payload_depth => %(max_payload_depth)s,
    p_unique_key => %(unique_key)s,
    p_unique_for => %(unique_for)s::interval,
    p_on_conflict => 'return',
    p_headers => %(headers)s::jsonb,
    p_batch_id => %(batch_id)s::uuid,
    p_after => %(after)s::uuid[],
    p_after_policy => %(after_policy)s,
    p_concurrency_key => %(concurrency_key)s,
    p_fairness_key => %(fairness_key)s)

-- name: send_many
-- The payloads and the streams travel as one JSON array each: one parameter, no
-- per-element array quoting on the client.
SELECT workpump.send_many(
    p_destination => %(destination)s,
    p_payloads => ARRAY(SELECT e.value FROM jsonb_array_elements(%(payloads)s::jsonb)
                        WITH ORDINALITY e(value, n) ORDER BY e.n),
    p_streams => CASE WHEN %(streams)s::jsonb IS NOT NULL THEN
        ARRAY(SELECT e.value FROM jsonb_array_elements_text(%(streams)s::jsonb)
              WITH ORDINALITY e(value, n) ORDER BY e.n) END,
    p_priority => %(priority)s,
    p_scheduled_for => %(scheduled_for)s,
    p_max_attempts => %(max_attempts)s,
    p_message_ids => %(message_ids)s::uuid[],
    p_partition_count => %(partition_count)s,
    p_max_payload_bytes => %(max_payload_bytes)s,
    p_max_payload_depth => %(max_payload_depth)s,
    p_batch_id => %(batch_id)s::uuid,
    p_concurrency_key => %(concurrency_key)s,
    p_fairness_key => %(fairness_key)s)

-- name: emit_many
SELECT workpump.emit_many(
    p_event_type => %(event_type)s,
    p_payloads => ARRAY(SELECT e.value FROM jsonb_array_elements(%(payloads)s::jsonb)
                        WITH ORDINALITY e(value, n) ORDER BY e.n),
    p_streams => CASE WHEN %(streams)s::jsonb IS NOT NULL THEN
        ARRAY(SELECT e.value FROM jsonb_array_elements_text(%(streams)s::jsonb)
              WITH ORDINALITY e(value, n) ORDER BY e.n) END,
    p_subscribers => %(subscribers)s::jsonb,
    p_event_ids => %(event_ids)s::uuid[],
    p_priority => %(priority)s,
    p_partition_count => %(partition_count)s,
    p_max_payload_bytes => %(max_payload_bytes)s,
    p_max_payload_depth => %(max_payload_depth)s,
    p_concurrency_key => %(concurrency_key)s,
    p_fairness_key => %(fairness_key)s)

-- name: receive
-- stored: false for a duplicate. created_at: the stored row's created_at, whose default
-- is the statement's timestamp (STATEMENT_TIMESTAMP(), the time this statement started,
-- which a function it calls shares), so a caller needs no second read for it.
SELECT workpump.receive(
    p_message_id => %(message_id)s,
    p_handler_name => %(handler_name)s,
    p_payload => %(payload)s::jsonb,
    p_stream => %(stream)s,
    p_priority => %(priority)s,
    p_scheduled_for => %(scheduled_for)s,
    p_max_attempts => %(max_attempts)s,
    p_partition_count => %(partition_count)s,
    p_max_payload_bytes => %(max_payload_bytes)s,
    p_max_payload_depth => %(max_payload_depth)s,
    p_deduplicate => %(deduplicate)s,
    p_unique_key => %(unique_key)s,
    p_unique_for => %(unique_for)s::interval,
    p_on_conflict => 'return',
    p_headers => %(headers)s::jsonb,
    p_concurrency_key => %(concurrency_key)s,
    p_fairness_key => %(fairness_key)s) AS stored,
    statement_timestamp() AS created_at

-- name: emit
SELECT workpump.emit(
    p_event_type => %(event_type)s,
    p_payload => %(payload)s::jsonb,
    p_stream => %(stream)s,
    p_subscribers => %(subscribers)s::jsonb,
    p_event_id => %(event_id)s,
    p_priority => %(priority)s,
    p_partition_count => %(partition_count)s,
    p_max_payload_bytes => %(max_payload_bytes)s,
    p_max_payload_depth => %(max_payload_depth)s,
    p_unique_key => %(unique_key)s,
    p_unique_for => %(unique_for)s::interval,
    p_on_conflict => 'return',
    p_headers => %(headers)s::jsonb,
    p_concurrency_key => %(concurrency_key)s,
    p_fairness_key => %(fairness_key)s)

-- name: unique_key_holder
SELECT workpump.unique_key_holder(
    p_kind => %(kind)s,
    p_topic => %(topic)s,
    p_unique_key => %(unique_key)s,
    p_unique_for => %(unique_for)s::interval)

-- name: sync_subscriptions
SELECT workpump.sync_subscriptions(
    p_subscriptions => %(subscriptions)s::jsonb,
    p_replace => %(replace)s)

-- name: claim_work
-- created_at and due_at (when the row became claimable) feed the queue-wait metric.
-- The rows the claim parked as dead come too (no lease_token; last_error says why), to be
-- logged.
-- synchronous_commit: the setting this statement's transaction commits with ('off': do
-- not wait for the WAL flush), set for this transaction only; NULL leaves it as it is.
-- A one-row function scan: evaluated once.
SELECT c.category, c.work_id, c.topic, c.payload, c.stream, c.attempts, c.max_attempts,
       c.lease_expiry, c.event_id, c.event_type, c.priority, c.claimed_at, c.lease_token,
       c.headers, c.created_at, c.due_at, c.last_error, c.has_more, c.checkpoint,
       c.after_id
FROM set_config('synchronous_commit',
                coalesce(%(synchronous_commit)s, current_setting('synchronous_commit')),
                true) AS commit_setting
CROSS JOIN workpump.claim_work(
    p_instance_id => %(instance_id)s,
    p_max_rows => %(max_rows)s,
    p_lease_seconds => %(lease_seconds)s,
    p_partition_count => %(partition_count)s,
    p_categories => %(categories)s,
    p_stale_after_seconds => %(stale_after_seconds)s,
    p_definitively_dead_after_seconds => %(definitively_dead_after_seconds)s,
    p_now => %(now)s,
    p_topics => %(topics)s::jsonb,
    p_topic_prefixes => %(topic_prefixes)s::jsonb,
    p_stream_run_max => %(stream_run_max)s,
    p_return_dead_lettered => true,
    p_underserved_only => %(underserved_only)s) AS c

-- name: renew_leases
SELECT work_id, lease_expiry, status
FROM workpump.renew_leases(
    p_category => %(category)s,
    p_ids => %(ids)s::uuid[],
    p_lease_tokens => %(lease_tokens)s::uuid[],
    p_lease_seconds => %(lease_seconds)s,
    p_instance_id => %(instance_id)s,
    p_now => %(now)s)

-- name: complete_work
SELECT work_id, status
FROM workpump.complete_work(
    p_instance_id => %(instance_id)s,
    p_category => %(category)s,
    p_ids => %(ids)s::uuid[],
    p_lease_tokens => %(lease_tokens)s::uuid[],
    p_results => %(results)s::jsonb[],
    p_logs => %(logs)s::jsonb[],
    p_now => %(now)s)

-- name: fail_work
SELECT work_id, status, scheduled_for
FROM workpump.fail_work(
    p_instance_id => %(instance_id)s,
    p_category => %(category)s,
    p_ids => %(ids)s::uuid[],
    p_lease_tokens => %(lease_tokens)s::uuid[],
    p_errors => %(errors)s::text[],
    p_reasons => %(reasons)s::text[],
    p_retry_base_seconds => %(retry_base_seconds)s,
    p_retry_max_seconds => %(retry_max_seconds)s,
    p_now => %(now)s,
    p_retry_delays => %(retry_delays)s::double precision[],
    p_logs => %(logs)s::jsonb[])

-- name: snooze_work
SELECT work_id, status, scheduled_for
FROM workpump.snooze_work(
    p_instance_id => %(instance_id)s,
    p_category => %(category)s,
    p_ids => %(ids)s::uuid[],
    p_lease_tokens => %(lease_tokens)s::uuid[],
    p_seconds => %(seconds)s::double precision[],
    p_max_snoozes => %(max_snoozes)s,
    p_now => %(now)s)

-- name: discard_work
SELECT work_id, status
FROM workpump.discard_work(
    p_instance_id => %(instance_id)s,
    p_category => %(category)s,
    p_ids => %(ids)s::uuid[],
    p_lease_tokens => %(lease_tokens)s::uuid[],
    p_reasons => %(reasons)s::text[],
    p_logs => %(logs)s::jsonb[],
    p_now => %(now)s)

-- name: dead_letter
SELECT r.id
FROM workpump.dead_letter(
    p_category => %(category)s,
    p_ids => %(ids)s::uuid[],
    p_reason => %(reason)s,
    p_now => %(now)s) AS r(id)

-- name: checkpoint_work
SELECT workpump.checkpoint_work(
    p_instance_id => %(instance_id)s,
    p_category => %(category)s,
    p_id => %(id)s,
    p_lease_token => %(lease_token)s,
    p_state => %(state)s::jsonb,
    p_max_bytes => %(max_bytes)s) AS status

-- name: work_outcomes
-- The result comes as its JSON text: the caller decodes it row by row.
SELECT work_id, category, state, result::text AS result, last_error, failure_reason,
       ended_at
FROM workpump.work_outcomes(
    p_ids => %(ids)s::uuid[],
    p_categories => %(categories)s::text[],
    p_now => %(now)s)

-- name: release_work
SELECT work_id, status
FROM workpump.release_work(
    p_instance_id => %(instance_id)s,
    p_category => %(category)s,
    p_ids => %(ids)s::uuid[],
    p_lease_tokens => %(lease_tokens)s::uuid[],
    p_now => %(now)s)

-- name: record_heartbeat
SELECT workpump.record_heartbeat(
    p_instance_id => %(instance_id)s,
    p_service_name => %(service_name)s,
    p_host_name => %(host_name)s,
    p_process_id => %(process_id)s,
    p_metadata => %(metadata)s::jsonb,
    p_stale_after_seconds => %(stale_after_seconds)s,
    p_definitively_dead_after_seconds => %(definitively_dead_after_seconds)s,
    p_now => %(now)s,
    p_lock_loss_grace_seconds => %(lock_loss_grace_seconds)s)

-- name: cleanup_stale_instances
SELECT instance_id
FROM workpump.cleanup_stale_instances(
    p_stale_cutoff => %(stale_cutoff)s,
    p_definitive_dead_cutoff => %(definitive_dead_cutoff)s,
    p_now => %(now)s,
    p_lock_loss_grace_seconds => %(lock_loss_grace_seconds)s)

-- name: next_eviction_in
SELECT workpump.next_eviction_in(
    p_instance_id => %(instance_id)s,
    p_stale_after_seconds => %(stale_after_seconds)s,
    p_definitively_dead_after_seconds => %(definitively_dead_after_seconds)s,
    p_lock_loss_grace_seconds => %(lock_loss_grace_seconds)s,
    p_now => %(now)s)

-- name: deregister_instance
SELECT workpump.deregister_instance(p_instance_id => %(instance_id)s, p_now => %(now)s)

-- name: take_alive_lock
SELECT workpump.take_alive_lock(%(instance_id)s)

-- name: alive_lock_held
SELECT workpump.alive_lock_held(%(instance_id)s)

-- name: reap_stale_instances
SELECT instance_id
FROM workpump.cleanup_stale_instances(
    p_stale_cutoff => now() - make_interval(secs => %(stale_after_seconds)s),
    p_definitive_dead_cutoff => now() - make_interval(secs => %(definitively_dead_after_seconds)s),
    p_lock_loss_grace_seconds => %(lock_loss_grace_seconds)s)

-- name: schema_functions_present
SELECT count(DISTINCT p.proname) = cardinality(%(functions)s::text[])
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = 'workpump' AND p.proname = ANY (%(functions)s::text[])

-- name: notify_probe
SELECT pg_notify(%(channel)s, 'ping')

-- name: keepalive
SELECT 1

-- name: set_application_name
-- Name this session in pg_stat_activity (for the session: it outlives transactions).
SELECT set_config('application_name', %(name)s, false)

-- name: try_maintenance_lock
SELECT workpump.try_maintenance_lock()

-- name: release_maintenance_lock
SELECT workpump.release_maintenance_lock()

-- name: maintenance_lock_holders
-- Backend pids of the sessions holding the maintenance lock (any role can take it).
SELECT l.pid
FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
  AND l.classid = workpump.lock_namespace('maintenance')::oid AND l.objid = 0
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY l.pid

-- name: purge_processed
SELECT workpump.purge_processed(
    %(category)s, now() - make_interval(secs => %(retention_seconds)s), %(batch)s)

-- name: purge_dead
SELECT workpump.purge_dead(
    %(category)s, now() - make_interval(secs => %(retention_seconds)s), %(batch)s)

-- name: purge_inbox_dedup
SELECT workpump.purge_inbox_dedup(
    now() - make_interval(secs => %(retention_seconds)s), %(batch)s)

-- name: purge_task_attempts
-- Attempts outlive nothing: once maintenance purged a task's inbox row (retention),
-- its attempts go too, oldest first, a bounded batch per call.
WITH orphaned AS (
    -- started before the retention cutoff, and the task row is gone
    SELECT a.id
    FROM workpump_task_attempt a
    WHERE a.started_at < now() - make_interval(secs => %(retention_seconds)s)
      AND NOT EXISTS (
          SELECT 1 FROM workpump_inbox i WHERE i.work_id = a.work_id)
    ORDER BY a.started_at
    LIMIT %(batch)s
), purged AS (
    DELETE FROM workpump_task_attempt a
    USING orphaned o
    WHERE a.id = o.id
    RETURNING a.id
)
SELECT count(*) AS purged FROM purged

-- name: purge_events
SELECT workpump.purge_events(now() - make_interval(secs => %(retention_seconds)s), %(batch)s)

-- name: purge_batches
SELECT workpump.purge_batches(now() - make_interval(secs => %(retention_seconds)s), %(batch)s)

-- name: purge_evictions
SELECT workpump.purge_evictions(now() - make_interval(secs => %(retention_seconds)s))

-- name: purge_idle_streams
SELECT workpump.purge_idle_streams(%(batch)s)

-- name: stuck_rows
SELECT * FROM (
    SELECT 'outbox' AS category, work_id, topic, attempts, max_attempts, last_error
    FROM workpump_outbox
    WHERE done_at IS NULL AND dead_lettered_at IS NULL AND attempts * 2 >= max_attempts AND attempts > 1
    UNION ALL
    SELECT 'inbox', work_id, topic, attempts, max_attempts, last_error
    FROM workpump_inbox
    WHERE done_at IS NULL AND dead_lettered_at IS NULL AND attempts * 2 >= max_attempts AND attempts > 1
    UNION ALL
    SELECT 'perspective_event', work_id, topic, attempts, max_attempts, last_error
    FROM workpump_perspective_event
    WHERE done_at IS NULL AND dead_lettered_at IS NULL AND attempts * 2 >= max_attempts AND attempts > 1
    UNION ALL
    SELECT 'receptor', work_id, topic, attempts, max_attempts, last_error
    FROM workpump_receptor_processing
    WHERE done_at IS NULL AND dead_lettered_at IS NULL AND attempts * 2 >= max_attempts AND attempts > 1
) stuck
LIMIT %(limit)s

-- name: evict_instance
SELECT workpump.evict_instance(p_instance_id => %(instance_id)s, p_reason => %(reason)s)

-- Periodic schedules (their functions in schema.sql, docs/periodic.md).

-- name: upsert_periodic
SELECT workpump.upsert_periodic(
    p_name => %(name)s,
    p_cron => %(cron)s,
    p_every_seconds => %(every_seconds)s,
    p_timezone => %(timezone)s,
    p_catch_up => %(catch_up)s,
    p_payload => %(payload)s::jsonb,
    p_priority => %(priority)s,
    p_max_attempts => %(max_attempts)s,
    p_next_fire_at => %(next_fire_at)s,
    p_now => %(now)s)

-- name: fire_periodic
SELECT workpump.fire_periodic(
    p_name => %(name)s,
    p_slot => %(slot)s,
    p_next_fire_at => %(next_fire_at)s,
    p_partition_count => %(partition_count)s,
    p_max_payload_bytes => %(max_payload_bytes)s,
    p_now => %(now)s)

-- name: skip_periodic
SELECT workpump.skip_periodic(
    p_name => %(name)s,
    p_slot => %(slot)s,
    p_next_fire_at => %(next_fire_at)s,
    p_now => %(now)s)

-- name: pause_periodic
SELECT r.name
FROM workpump.pause_periodic(
    p_names => %(names)s::text[], p_paused => %(paused)s, p_now => %(now)s) AS r(name)

-- name: periodic_states
-- The database clock (one row even with no schedules) and each schedule's race state.
SELECT c.now, s.name, s.paused, s.last_slot, s.created_at
FROM (SELECT coalesce(%(now)s::timestamptz, now()) AS now) c
LEFT JOIN workpump_periodic_schedule s ON true
ORDER BY s.name

-- Operator actions of django_workpump.actions and manage.py workpump_action: each runs
-- the SQL function the admin uses, and returns the ids it changed.

-- name: retry_now
SELECT r.id
FROM workpump.retry_now(
    p_category => %(category)s, p_ids => %(ids)s::uuid[], p_now => %(now)s) AS r(id)

-- name: requeue_dead
SELECT r.id
FROM workpump.requeue_dead(
    p_category => %(category)s, p_ids => %(ids)s::uuid[], p_now => %(now)s) AS r(id)

-- name: release_leases
SELECT r.id
FROM workpump.release_leases(
    p_category => %(category)s,
    p_ids => %(ids)s::uuid[],
    p_force => %(force)s,
    p_stale_after_seconds => %(stale_after_seconds)s,
    p_definitively_dead_after_seconds => %(definitively_dead_after_seconds)s,
    p_now => %(now)s) AS r(id)

-- name: cancel_work
SELECT r.work_id, r.holder
FROM workpump.cancel_work(
    p_category => %(category)s, p_ids => %(ids)s::uuid[], p_now => %(now)s) AS r

-- name: cancelled_attempts
-- The attempts among (ids[i], lease_tokens[i]) of category whose row cancel_work ended:
-- cancel_work keeps the attempt's token on the row, so a token names one attempt. Each
-- branch reads its table only for its own category (a one-time filter on the constant).
SELECT t.work_id
FROM (
    SELECT work_id, lease_token, end_state
    FROM workpump_outbox
    WHERE %(category)s::text = 'outbox' AND work_id = ANY (%(ids)s::uuid[])
    UNION ALL
    SELECT work_id, lease_token, end_state
    FROM workpump_inbox
    WHERE %(category)s::text = 'inbox' AND work_id = ANY (%(ids)s::uuid[])
    UNION ALL
    SELECT work_id, lease_token, end_state
    FROM workpump_perspective_event
    WHERE %(category)s::text = 'perspective_event' AND work_id = ANY (%(ids)s::uuid[])
    UNION ALL
    SELECT work_id, lease_token, end_state
    FROM workpump_receptor_processing
    WHERE %(category)s::text = 'receptor' AND work_id = ANY (%(ids)s::uuid[])
) t
JOIN unnest(%(ids)s::uuid[], %(lease_tokens)s::uuid[]) AS a(id, token)
  ON t.work_id = a.id AND t.lease_token = a.token
WHERE t.end_state = 'cancelled'

-- name: select_work
-- Work rows by id and/or filters (each NULL filter matches everything), oldest first:
-- category, work_id, topic, state (workpump.state_of) and created_at.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
), work AS (
    -- the four tables reduced to the columns an operator selects by
    SELECT 'outbox' AS category, t.work_id, t.topic, t.created_at,
           workpump.state_of(t.done_at, t.dead_lettered_at, t.instance_id, t.lease_expiry,
                             t.claimed_at, t.scheduled_for, t.end_state, c.now) AS state
    FROM workpump_outbox t CROSS JOIN clock c
    WHERE %(ids)s::uuid[] IS NULL OR t.work_id = ANY (%(ids)s::uuid[])
    UNION ALL
    SELECT 'inbox', t.work_id, t.topic, t.created_at,
           workpump.state_of(t.done_at, t.dead_lettered_at, t.instance_id, t.lease_expiry,
                             t.claimed_at, t.scheduled_for, t.end_state, c.now)
    FROM workpump_inbox t CROSS JOIN clock c
    WHERE %(ids)s::uuid[] IS NULL OR t.work_id = ANY (%(ids)s::uuid[])
    UNION ALL
    SELECT 'perspective_event', t.work_id, t.topic, t.created_at,
           workpump.state_of(t.done_at, t.dead_lettered_at, t.instance_id, t.lease_expiry,
                             t.claimed_at, t.scheduled_for, t.end_state, c.now)
    FROM workpump_perspective_event t CROSS JOIN clock c
    WHERE %(ids)s::uuid[] IS NULL OR t.work_id = ANY (%(ids)s::uuid[])
    UNION ALL
    SELECT 'receptor', t.work_id, t.topic, t.created_at,
           workpump.state_of(t.done_at, t.dead_lettered_at, t.instance_id, t.lease_expiry,
                             t.claimed_at, t.scheduled_for, t.end_state, c.now)
    FROM workpump_receptor_processing t CROSS JOIN clock c
    WHERE %(ids)s::uuid[] IS NULL OR t.work_id = ANY (%(ids)s::uuid[])
)
SELECT w.category, w.work_id, w.topic, w.state, w.created_at
FROM work w CROSS JOIN clock c
WHERE (%(category)s::text IS NULL OR w.category = %(category)s::text)
  AND (%(topic)s::text IS NULL OR w.topic = %(topic)s::text)
  AND (%(state)s::text IS NULL OR w.state = %(state)s::text)
  AND (%(older_than_seconds)s::double precision IS NULL
       OR w.created_at <= c.now - make_interval(secs => %(older_than_seconds)s::double precision))
ORDER BY w.created_at, w.work_id
LIMIT %(limit)s  -- NULL: every row

-- name: lock_work
-- The rows of %(ids)s, locked until the transaction ends, that still match select_work's
-- filters: what an operator action confirmed on a listing may change now. Claims skip
-- locked rows; a holder's renewal or outcome waits for the action's commit.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
), outbox AS (
    -- each table's rows locked as they are now (FOR UPDATE waits for a writer, then
    -- returns the row it committed)
    SELECT t.work_id, t.topic, t.created_at, t.done_at,
           t.dead_lettered_at, t.instance_id, t.lease_expiry, t.claimed_at, t.scheduled_for,
           t.end_state
    FROM workpump_outbox t WHERE t.work_id = ANY (%(ids)s::uuid[])
    FOR UPDATE
), inbox AS (
    SELECT t.work_id, t.topic, t.created_at, t.done_at, t.dead_lettered_at,
           t.instance_id, t.lease_expiry, t.claimed_at, t.scheduled_for, t.end_state
    FROM workpump_inbox t WHERE t.work_id = ANY (%(ids)s::uuid[])
    FOR UPDATE
), perspective_event AS (
    SELECT t.work_id, t.topic, t.created_at, t.done_at,
           t.dead_lettered_at, t.instance_id, t.lease_expiry, t.claimed_at, t.scheduled_for,
           t.end_state
    FROM workpump_perspective_event t WHERE t.work_id = ANY (%(ids)s::uuid[])
    FOR UPDATE
), receptor AS (
    SELECT t.work_id, t.topic, t.created_at, t.done_at, t.dead_lettered_at,
           t.instance_id, t.lease_expiry, t.claimed_at, t.scheduled_for, t.end_state
    FROM workpump_receptor_processing t WHERE t.work_id = ANY (%(ids)s::uuid[])
    FOR UPDATE
), locked AS (
    -- the four, as category, work_id, topic, created_at and the columns of the state
    SELECT 'outbox' AS category, o.* FROM outbox o
    UNION ALL SELECT 'inbox', i.* FROM inbox i
    UNION ALL SELECT 'perspective_event', p.* FROM perspective_event p
    UNION ALL SELECT 'receptor', r.* FROM receptor r
), work AS (
    -- the state of each locked row as of this transaction's clock
    SELECT l.category, l.work_id, l.topic, l.created_at,
           workpump.state_of(l.done_at, l.dead_lettered_at, l.instance_id, l.lease_expiry,
                             l.claimed_at, l.scheduled_for, l.end_state, c.now) AS state
    FROM locked l CROSS JOIN clock c
)
SELECT w.category, w.work_id, w.topic, w.state, w.created_at
FROM work w CROSS JOIN clock c
WHERE (%(category)s::text IS NULL OR w.category = %(category)s::text)
  AND (%(topic)s::text IS NULL OR w.topic = %(topic)s::text)
  AND (%(state)s::text IS NULL OR w.state = %(state)s::text)
  AND (%(older_than_seconds)s::double precision IS NULL
       OR w.created_at <= c.now - make_interval(secs => %(older_than_seconds)s::double precision))
ORDER BY w.created_at, w.work_id

-- name: instance_standing
-- What an operator evicting %(ids)s must know of each: registered (its row locked until
-- the transaction ends, so it cannot beat meanwhile), live by the liveness rule,
-- tombstoned, and the rows it leases: running (lease not yet expired) and in all.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
), wanted AS (
    SELECT DISTINCT w.instance_id FROM unnest(%(ids)s::uuid[]) AS w(instance_id)
), registered AS (
    -- locked: its heartbeat waits for the eviction's commit, then is refused
    SELECT si.instance_id FROM workpump_service_instance si
    WHERE si.instance_id = ANY (%(ids)s::uuid[])
    FOR UPDATE
), live AS (
    -- the liveness rule with the configured cutoffs
    SELECT l.instance_id
    FROM clock c,
         workpump.live_instances(c.now - make_interval(secs => %(stale_after_seconds)s),
                                 c.now - make_interval(secs => %(definitively_dead_after_seconds)s))
             AS l(instance_id)
), held AS (
    -- the leases of the wanted instances, in every work table
    SELECT t.instance_id, t.lease_expiry FROM workpump_outbox t
    WHERE t.instance_id = ANY (%(ids)s::uuid[])
    UNION ALL SELECT t.instance_id, t.lease_expiry FROM workpump_inbox t
    WHERE t.instance_id = ANY (%(ids)s::uuid[])
    UNION ALL SELECT t.instance_id, t.lease_expiry FROM workpump_perspective_event t
    WHERE t.instance_id = ANY (%(ids)s::uuid[])
    UNION ALL SELECT t.instance_id, t.lease_expiry FROM workpump_receptor_processing t
    WHERE t.instance_id = ANY (%(ids)s::uuid[])
)
SELECT w.instance_id,
       w.instance_id IN (SELECT instance_id FROM registered) AS registered,
       w.instance_id IN (SELECT instance_id FROM live) AS live,
       e.evicted_at,
       e.reason AS evicted_reason,
       (SELECT count(*) FROM held h WHERE h.instance_id = w.instance_id
                                      AND h.lease_expiry > c.now) AS running,
       (SELECT count(*) FROM held h WHERE h.instance_id = w.instance_id) AS held
FROM wanted w CROSS JOIN clock c
LEFT JOIN workpump_eviction e ON e.instance_id = w.instance_id
ORDER BY w.instance_id

-- name: running_work
-- Rows %(ids)s (instance ids) hold under a lease not yet expired, oldest claim first, at
-- most %(limit)s: what an eviction would take from under a running handler.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
), held AS (
    SELECT 'outbox' AS category, t.work_id, t.topic, t.instance_id,
           t.lease_expiry, t.claimed_at
    FROM workpump_outbox t WHERE t.instance_id = ANY (%(ids)s::uuid[])
    UNION ALL
    SELECT 'inbox', t.work_id, t.topic, t.instance_id, t.lease_expiry, t.claimed_at
    FROM workpump_inbox t WHERE t.instance_id = ANY (%(ids)s::uuid[])
    UNION ALL
    SELECT 'perspective_event', t.work_id, t.topic, t.instance_id,
           t.lease_expiry, t.claimed_at
    FROM workpump_perspective_event t WHERE t.instance_id = ANY (%(ids)s::uuid[])
    UNION ALL
    SELECT 'receptor', t.work_id, t.topic, t.instance_id, t.lease_expiry, t.claimed_at
    FROM workpump_receptor_processing t WHERE t.instance_id = ANY (%(ids)s::uuid[])
)
SELECT h.instance_id, h.category, h.work_id, h.topic
FROM held h CROSS JOIN clock c
WHERE h.lease_expiry > c.now
ORDER BY h.claimed_at, h.work_id
LIMIT %(limit)s

-- name: open_batch
SELECT workpump.open_batch(
    p_on_complete => %(on_complete)s::jsonb,
    p_on_failure => %(on_failure)s::jsonb,
    p_parent_batch_id => %(parent_batch_id)s::uuid)

-- name: seal_batch
SELECT workpump.seal_batch(%(batch_id)s::uuid)

-- name: batch_status
SELECT b.id, b.parent_batch_id, b.sealed, b.total, b.pending, b.done, b.dead, b.discarded,
       b.cancelled, b.callback_id, b.callback_error, b.created_at, b.finished_at
FROM workpump_batch b WHERE b.id = %(batch_id)s::uuid

-- name: batch_of
SELECT o.batch_id FROM workpump_outbox o WHERE o.work_id = %(work_id)s::uuid
UNION ALL
SELECT i.batch_id FROM workpump_inbox i WHERE i.work_id = %(work_id)s::uuid

-- name: join_batch
SELECT workpump.join_batch(%(category)s, %(batch_id)s::uuid, %(ids)s::uuid[])

-- name: set_flow_rule
SELECT workpump.set_flow_rule(
    p_kind => %(kind)s,
    p_category => %(category)s,
    p_name => %(name)s,
    p_set => %(settings)s::jsonb,
    p_declared => %(declared)s,
    p_now => %(now)s)

-- name: sync_flow_rules
SELECT workpump.sync_flow_rules(p_rules => %(rules)s::jsonb, p_now => %(now)s)

-- name: flow_rule_status
SELECT * FROM workpump.flow_rule_status(
    p_waiting_cap => %(waiting_cap)s, p_category => %(category)s, p_topic => %(topic)s,
    p_now => %(now)s
)

-- name: flag_flow_stragglers
SELECT workpump.flag_flow_stragglers(%(batch)s)

-- name: flow_reason
SELECT workpump.flow_reason(%(category)s, %(topic)s, %(concurrency_key)s, %(fairness_key)s,
                            %(now)s)
