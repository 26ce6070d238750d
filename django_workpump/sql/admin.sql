-- Named queries of the Django admin (django_workpump/admin/): the operator actions, each
-- through the SQL function that keeps leases fenced, with Django's %(name)s placeholders.
-- Each returns rows (the ids it changed, or a count), run with db.fetch_named("admin.sql", ...);
-- the subquery fragments at the end are read by admin/expressions.py into its querysets.

-- name: retry_now
-- Scheduled rows (retry wait or deferral) become claimable now; the ids that changed.
SELECT r.id
FROM workpump.retry_now(%(category)s, %(ids)s::uuid[]) AS r(id)

-- name: release_leases
-- Leases of the given rows released; rows held by a live instance (the liveness rule with
-- the configured cutoffs) are skipped unless forced. The ids that were released.
SELECT r.id
FROM workpump.release_leases(
    %(category)s, %(ids)s::uuid[], %(force)s,
    %(stale_after_seconds)s, %(definitively_dead_after_seconds)s
) AS r(id)

-- name: dead_letter
-- Undone rows parked as dead with the operator's reason; the ids that changed.
SELECT r.id
FROM workpump.dead_letter(%(category)s, %(ids)s::uuid[], %(reason)s) AS r(id)

-- name: requeue_dead
-- Dead rows given a fresh set of attempts (their last error stays); the ids that changed.
SELECT r.id
FROM workpump.requeue_dead(%(category)s, %(ids)s::uuid[]) AS r(id)

-- name: cancel_work
-- Undone rows ended as cancelled (a running attempt's holder is told by NOTIFY on
-- commit); the ids that changed.
SELECT r.work_id AS id
FROM workpump.cancel_work(%(category)s, %(ids)s::uuid[]) AS r

-- name: evict_instance
-- One instance tombstoned and every lease it held released; the number of rows released.
SELECT workpump.evict_instance(%(instance_id)s, %(reason)s) AS released

-- Subquery fragments of the admin's ORM querysets (RawSQL, positional parameters):
-- each yields one column of ids or keys for an IN test, so liveness and the alive-lock
-- come from the same SQL functions every other reader uses.

-- name: live_instance_ids
-- The live instances by workpump.live_instances: stale and definitive-dead cutoffs in
-- seconds before now().
SELECT workpump.live_instances(
    now() - make_interval(secs => %s), now() - make_interval(secs => %s)
)

-- name: held_alive_lock_keys
-- alive_lock_key values whose alive-lock some session holds now (pg_locks).
SELECT workpump.held_alive_lock_keys()

-- name: listening_instance_ids
-- Instances whose NOTIFY gate is connected: sessions of this database named
-- workpump-<instance id> (anything else named workpump-... yields NULL, not an error).
SELECT CASE WHEN a.application_name ~ '^workpump-[0-9a-f-]{36}$'
            THEN substr(a.application_name, 10)::uuid END
FROM pg_stat_activity a
WHERE a.datname = current_database()

-- name: stuck_seqs
-- Seqs of the rows of one work table that a filter selects (for a "seq IN (...)" test).
-- The names in braces are filled in by admin/expressions.py (FilteredSeqs): table; for
-- perspective and receptor rows the condition that a head h orders the
-- same rows as r (same_scope); in_order, the fragment's order over its rows s ("ORDER BY
-- s.seq DESC", newest first) for a page, empty for a count; arm_order, that order over an
-- arm's rows t (for a count too, so that an arm reads its index, not the table); and
-- same_topic (same_topic_r over r): empty, or the condition that the row's topic
-- equals the topic filter's, a parameter before each arm's bound. Each arm reads one
-- partial index in that order, at most the given number of rows (NULL: all): the rows a
-- page shows, or the count's limit, not every row of the table.
--
-- Stuck rows (docs/admin.md, the stuck rule), as four disjoint arms, so a count stops
-- after its limit without removing duplicates: held by an instance that is not live, or
-- past the lease's expiry (the _held index per holder, newest first; the holders are
-- found by a loose index scan of it, one probe each); orphaned by an eviction
-- (_orphan); past half their attempts (_retried) and in neither; behind a dead or
-- retrying stream head (_stream) and in none. Parameters: the stale and definitive-dead
-- cutoffs in seconds, then the bound, five times (with same_topic, the topic before
-- each of the first four).
WITH RECURSIVE holders AS (
    (SELECT t.instance_id FROM {table} t
     WHERE t.instance_id IS NOT NULL ORDER BY t.instance_id LIMIT 1)
    UNION ALL
    SELECT (SELECT t.instance_id FROM {table} t
            WHERE t.instance_id > h.instance_id ORDER BY t.instance_id LIMIT 1)
    FROM holders h WHERE h.instance_id IS NOT NULL
), judged AS MATERIALIZED (
    SELECT h.instance_id,
           h.instance_id IN (SELECT workpump.live_instances(
               now() - make_interval(secs => %s), now() - make_interval(secs => %s))) AS live
    FROM holders h WHERE h.instance_id IS NOT NULL
), stuck AS (
    SELECT s.seq FROM judged j CROSS JOIN LATERAL (
        SELECT t.seq FROM {table} t
        WHERE t.instance_id = j.instance_id
          AND t.done_at IS NULL AND t.dead_lettered_at IS NULL
          AND (NOT j.live OR t.lease_expiry <= now())
        {same_topic}
        ORDER BY t.seq DESC LIMIT %s) s
    UNION ALL
    (SELECT t.seq FROM {table} t
     WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL
       AND t.instance_id IS NULL AND t.claimed_at IS NOT NULL
     {same_topic}
     ORDER BY t.seq DESC LIMIT %s)
    UNION ALL
    (SELECT t.seq FROM {table} t
     WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL
       AND t.attempts > 1 AND t.max_attempts <= t.attempts * 2
       AND ((t.instance_id IS NULL AND t.claimed_at IS NULL)
            OR (t.lease_expiry > now()
                AND t.instance_id IN (SELECT j.instance_id FROM judged j WHERE j.live)))
     {same_topic}
     ORDER BY t.seq DESC LIMIT %s)
    UNION ALL
    (SELECT r.seq FROM {table} r
     WHERE r.done_at IS NULL AND r.dead_lettered_at IS NULL
       AND NOT r.stream_head AND r.stream IS NOT NULL
       AND NOT (r.attempts > 1 AND r.max_attempts <= r.attempts * 2)
       AND ((r.instance_id IS NULL AND r.claimed_at IS NULL)
            OR (r.lease_expiry > now()
                AND r.instance_id IN (SELECT j.instance_id FROM judged j WHERE j.live)))
       AND EXISTS (SELECT 1 FROM {table} h
                   WHERE h.stream = r.stream {same_scope} AND h.seq < r.seq
                     AND h.stream_head AND h.done_at IS NULL
                     AND (h.dead_lettered_at IS NOT NULL
                          OR (h.scheduled_for > now() AND h.attempts > 0)))
     {same_topic_r}
     ORDER BY r.seq DESC LIMIT %s)
)
SELECT s.seq FROM stuck s {in_order} LIMIT %s

-- name: not_live_seqs
-- Rows held by an instance that is not live (stale, evicted or gone): the holders by a
-- loose index scan of _held, one probe each, then each not-live holder's rows through
-- the same index. Parameters: the stale and definitive-dead cutoffs in seconds, then the
-- bound, twice (with same_topic, the topic before the first).
WITH RECURSIVE holders AS (
    (SELECT t.instance_id FROM {table} t
     WHERE t.instance_id IS NOT NULL ORDER BY t.instance_id LIMIT 1)
    UNION ALL
    SELECT (SELECT t.instance_id FROM {table} t
            WHERE t.instance_id > h.instance_id ORDER BY t.instance_id LIMIT 1)
    FROM holders h WHERE h.instance_id IS NOT NULL
), not_live AS (
    SELECT h.instance_id FROM holders h
    WHERE h.instance_id IS NOT NULL
      AND h.instance_id NOT IN (SELECT workpump.live_instances(
          now() - make_interval(secs => %s), now() - make_interval(secs => %s)))
)
SELECT s.seq FROM not_live n CROSS JOIN LATERAL (
    SELECT t.seq FROM {table} t WHERE t.instance_id = n.instance_id
    {same_topic}
    ORDER BY t.seq DESC LIMIT %s) s
{in_order} LIMIT %s

-- name: held_seqs
-- Rows held by an instance, each holder's newest first through the _held index (the
-- holders found by the same loose index scan). The lease condition is an unexpired lease
-- for the leased state, an expired one for the held half of the orphaned state; the
-- unheld arm is empty, or for the orphaned state the rows an eviction released and no
-- one re-claimed (_orphan), newest first. Parameters: the bound, two or three times
-- (with same_topic, the topic before each but the last).
WITH RECURSIVE holders AS (
    (SELECT t.instance_id FROM {table} t
     WHERE t.instance_id IS NOT NULL ORDER BY t.instance_id LIMIT 1)
    UNION ALL
    SELECT (SELECT t.instance_id FROM {table} t
            WHERE t.instance_id > h.instance_id ORDER BY t.instance_id LIMIT 1)
    FROM holders h WHERE h.instance_id IS NOT NULL
), held AS (
    SELECT s.seq FROM holders h CROSS JOIN LATERAL (
        SELECT t.seq FROM {table} t
        WHERE t.instance_id = h.instance_id
          AND t.done_at IS NULL AND t.dead_lettered_at IS NULL AND {lease}
        {same_topic}
        ORDER BY t.seq DESC LIMIT %s) s
    WHERE h.instance_id IS NOT NULL
    {unheld_arm}
)
SELECT s.seq FROM held s {in_order} LIMIT %s

-- name: orphans_arm
-- The orphaned state's arm of held_seqs for rows an eviction released and no one
-- re-claimed (_orphan), newest first. One parameter: the bound.
UNION ALL
    (SELECT t.seq FROM {table} t
     WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL
       AND t.instance_id IS NULL AND t.claimed_at IS NOT NULL
     {same_topic}
     ORDER BY t.seq DESC LIMIT %s)

-- name: pending_seqs
-- Pending rows (workpump.state_of: undone, not dead, unheld, never claimed since its last
-- release, and due), as four disjoint arms, each in the claim's order (arm_order:
-- priority, highest first, then seq) and at most the bound: claimable stream heads (the
-- _ready index, read in that order); flow-controlled heads (the _flow index, sorted); rows whose retry or deferral fell due (_waiting, the
-- due part: rows the claim takes within a poll, then sorted); and unscheduled rows behind
-- their stream's head (_stream, then sorted: the ordered streams' backlog). Parameters:
-- for each arm the topic (only with same_topic) and the bound, then the bound.
WITH pending AS (
    (SELECT t.seq, t.priority FROM {table} t
     WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
       AND t.instance_id IS NULL AND t.scheduled_for IS NULL AND NOT t.flow_controlled
       AND t.claimed_at IS NULL
       {same_topic}
     {arm_order} LIMIT %s)
    UNION ALL
    (SELECT t.seq, t.priority FROM {table} t
     WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
       AND t.flow_controlled
       AND t.instance_id IS NULL AND t.scheduled_for IS NULL AND t.claimed_at IS NULL
       {same_topic}
     {arm_order} LIMIT %s)
    UNION ALL
    (SELECT t.seq, t.priority FROM {table} t
     WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL
       AND t.instance_id IS NULL AND t.scheduled_for <= now() AND t.claimed_at IS NULL
       {same_topic}
     {arm_order} LIMIT %s)
    UNION ALL
    (SELECT t.seq, t.priority FROM {table} t
     WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream IS NOT NULL
       AND NOT t.stream_head AND t.instance_id IS NULL AND t.scheduled_for IS NULL
       AND t.claimed_at IS NULL {same_topic}
     {arm_order} LIMIT %s)
)
SELECT s.seq FROM pending s {in_order} LIMIT %s

-- name: count_rows
-- The rows of one of the fragments above, counted as they are read (the admin
-- paginator's capped count).
SELECT count(*) FROM ({rows}) s

-- name: payload_index_ready
-- Whether the payload index %(name)s exists (in the search_path) and is valid.
SELECT EXISTS (SELECT 1 FROM pg_index i
               WHERE i.indexrelid = to_regclass(%(name)s) AND i.indisvalid) AS ready

-- name: payload_index_ddl
-- The statements that create (or drop) the opt-in payload indexes, to run one by one
-- outside a transaction (CONCURRENTLY): manage.py workpump_payload_index.
SELECT d.statement FROM workpump.payload_index_ddl(%(create)s) AS d(statement)
