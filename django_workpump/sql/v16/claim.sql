-- Schema version 16, part 1: the claim says when each row was created and when it fell
-- due, so the queue-wait metric needs no lookup after the claim.
--
-- leased_work and claim_work's rows gain created_at (the row's) and due_at: when the row
-- became claimable, i.e. the expiry of the lease a claim took over, else the time its
-- retry or deferral fell due (scheduled_for), else created_at. Both are read from the
-- version each claim locked, before it writes its lease. What a claim leases is
-- unchanged from version 15; a caller that names the columns it selects (every earlier
-- worker does) reads the same rows as before.

DROP FUNCTION workpump.claim_work(uuid, integer, integer, integer, text[], integer, integer,
                                  timestamptz, jsonb, jsonb, integer);
DROP FUNCTION workpump.claim_outbox(uuid, integer, integer, integer, integer, text[],
                                    timestamptz, text[], integer);
DROP FUNCTION workpump.claim_inbox(uuid, integer, integer, integer, integer, text[],
                                   timestamptz, text[], integer);
DROP FUNCTION workpump.claim_perspective_event(uuid, integer, integer, integer, integer,
                                               text[], timestamptz, text[], integer);
DROP FUNCTION workpump.claim_receptor(uuid, integer, integer, integer, integer, text[],
                                      timestamptz, text[], integer);

ALTER TYPE workpump.leased_work ADD ATTRIBUTE created_at timestamptz,
                                ADD ATTRIBUTE due_at timestamptz;

-- The outbox claim: rows of workpump.send, whose topic is the destination.
-- Lease up to p_limit claimable rows of the topics in p_topics (NULL: any), or of a topic
-- starting with one of p_topic_prefixes, to p_instance_id until p_now + p_lease_seconds,
-- each with a new lease token; rows whose attempts are used up are parked as dead instead.
-- Each row comes with its created_at and due_at (see claim_work). Called by
-- claim_work, which checks the instance and the input and computes p_rank and
-- p_live_count.
CREATE FUNCTION workpump.claim_outbox(
    p_instance_id uuid,
    p_limit integer,
    p_lease_seconds integer DEFAULT 300,
    p_rank integer DEFAULT 0,
    p_live_count integer DEFAULT 1,
    p_topics text[] DEFAULT NULL,
    p_now timestamptz DEFAULT NULL,
    p_topic_prefixes text[] DEFAULT NULL,
    p_run_max integer DEFAULT 1
) RETURNS SETOF workpump.leased_work
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_lease_expiry timestamptz := v_now + make_interval(secs => p_lease_seconds);
BEGIN
    RETURN QUERY
    WITH
    -- timers: stream heads whose lease expired or whose retry or deferral fell due, the
    -- longest due first (index wp_outbox_timer)
    timers AS MATERIALIZED (
        SELECT t.seq, t.ctid, 1 AS pass, t.attempts < t.max_attempts AS leasable,
               t.seq AS run_seq, t.priority AS run_priority, t.stream AS run_stream,
               ''::text AS run_scope,
               coalesce(t.lease_expiry, t.scheduled_for, t.created_at) AS due_at
        FROM workpump_outbox t
        WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
          AND (t.instance_id IS NOT NULL OR t.scheduled_for IS NOT NULL)
          AND coalesce(t.lease_expiry, t.scheduled_for) <= v_now
          AND (p_topics IS NULL OR t.destination = ANY (p_topics)
               OR t.destination ^@ ANY (p_topic_prefixes))
        ORDER BY coalesce(t.lease_expiry, t.scheduled_for)
        LIMIT p_limit
        FOR UPDATE OF t SKIP LOCKED
    ),
    -- own_share: with live peers, ready stream heads of this instance's partitions
    -- (partition_number mod live count = rank), in the budget the timers left
    own_share AS MATERIALIZED (
        SELECT * FROM (
            SELECT t.seq, t.ctid, 2 AS pass, t.attempts < t.max_attempts AS leasable,
                   t.seq AS run_seq, t.priority AS run_priority, t.stream AS run_stream,
                   ''::text AS run_scope,
                   coalesce(t.lease_expiry, t.scheduled_for, t.created_at) AS due_at
            FROM workpump_outbox t
            WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
              AND t.instance_id IS NULL AND t.scheduled_for IS NULL
              AND p_live_count > 1 AND t.partition_number % p_live_count = p_rank
              AND (p_topics IS NULL OR t.destination = ANY (p_topics)
                   OR t.destination ^@ ANY (p_topic_prefixes))
            ORDER BY t.priority DESC, t.seq
            LIMIT p_limit - (SELECT count(*) FROM timers WHERE timers.leasable)
            FOR UPDATE OF t SKIP LOCKED
        ) share
        LIMIT p_limit  -- cuts nothing: gives the planner a row estimate
    ),
    -- any_share: ready stream heads of anyone's partitions, in the budget still left, so
    -- no row waits on a busy peer (index wp_outbox_ready)
    any_share AS MATERIALIZED (
        SELECT * FROM (
            SELECT t.seq, t.ctid, 3 AS pass, t.attempts < t.max_attempts AS leasable,
                   t.seq AS run_seq, t.priority AS run_priority, t.stream AS run_stream,
                   ''::text AS run_scope,
                   coalesce(t.lease_expiry, t.scheduled_for, t.created_at) AS due_at
            FROM workpump_outbox t
            WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
              AND t.instance_id IS NULL AND t.scheduled_for IS NULL
              AND t.seq NOT IN (SELECT own_share.seq FROM own_share)
              AND (p_topics IS NULL OR t.destination = ANY (p_topics)
                   OR t.destination ^@ ANY (p_topic_prefixes))
            ORDER BY t.priority DESC, t.seq
            LIMIT p_limit - (SELECT count(*) FROM timers WHERE timers.leasable)
                          - (SELECT count(*) FROM own_share WHERE own_share.leasable)
            FOR UPDATE OF t SKIP LOCKED
        ) share
        LIMIT p_limit  -- cuts nothing: gives the planner a row estimate
    ),
    -- candidates: every head locked above, once (the three passes are disjoint)
    candidates AS (
        SELECT * FROM timers
        UNION ALL SELECT * FROM own_share
        UNION ALL SELECT * FROM any_share
    ),
    -- run_budget: the rows the heads left in the budget, and how many runs share them
    run_budget AS MATERIALIZED (
        SELECT greatest(p_limit - count(*) FILTER (WHERE c.leasable), 0) AS rows_left,
               count(*) FILTER (WHERE c.leasable AND c.run_stream IS NOT NULL) AS runs
        FROM candidates c
    ),
    -- upcoming: with p_run_max > 1, the undone rows that follow each leasable stream head,
    -- in stream order, no more per head than its share of the budget
    upcoming AS MATERIALIZED (
        SELECT c.seq AS head_seq, n.seq,
               row_number() OVER (PARTITION BY c.seq ORDER BY n.seq) AS position
        FROM candidates c
        CROSS JOIN run_budget b
        CROSS JOIN LATERAL (
            SELECT n.seq FROM workpump_outbox n
            WHERE n.stream = c.run_stream AND n.processed_at IS NULL
              AND n.stream IS NOT NULL AND n.seq > c.seq
            ORDER BY n.stream, n.seq
            LIMIT least(p_run_max - 1, ceil(b.rows_left::numeric / greatest(b.runs, 1)))
        ) n
        WHERE p_run_max > 1 AND c.leasable AND c.run_stream IS NOT NULL AND b.rows_left > 0
    ),
    -- locked: those rows locked, as they are now (a row someone else is writing is
    -- skipped, and ends its run there)
    locked AS MATERIALIZED (
        SELECT l.seq, l.ctid, l.leasable, l.due_at
        FROM upcoming u
        CROSS JOIN LATERAL (
            -- one primary key lookup per row
            SELECT n.seq, n.ctid,
                   coalesce(n.lease_expiry, n.scheduled_for, n.created_at) AS due_at,
                   n.processed_at IS NULL AND n.dead_lettered_at IS NULL
                   AND n.attempts < n.max_attempts
                   AND (n.instance_id IS NULL OR n.lease_expiry <= v_now)
                   AND (n.scheduled_for IS NULL OR n.scheduled_for <= v_now) AS leasable
            FROM workpump_outbox n
            WHERE n.seq = u.seq
            FOR UPDATE OF n SKIP LOCKED
        ) l
    ),
    -- followers: each head's run, the consecutive leasable rows right after it (the
    -- first row that is not ends the run), in the budget the heads left
    followers AS (
        SELECT r.seq, r.ctid, c.pass, true AS leasable, c.seq AS run_seq,
               c.run_priority, c.run_stream, c.run_scope, r.due_at
        FROM (
            SELECT u.head_seq, u.seq, u.position, l.ctid, l.due_at,
                   bool_and(coalesce(l.leasable, false))
                       OVER (PARTITION BY u.head_seq ORDER BY u.position) AS in_run
            FROM upcoming u LEFT JOIN locked l ON l.seq = u.seq
        ) r
        JOIN candidates c ON c.seq = r.head_seq
        WHERE r.in_run
        ORDER BY r.position, c.pass, c.run_priority DESC, c.seq
        LIMIT (SELECT b.rows_left FROM run_budget b)
    ),
    -- leased: the heads and their runs
    leased AS (
        SELECT * FROM candidates
        UNION ALL SELECT * FROM followers
    ),
    -- claimed_heads: each head leased (one attempt more, a new token) or, with its
    -- attempts used up, parked as dead; an expired lease taken over is stamped as an
    -- attempt that ended without an outcome. Rows are found by the ctid of the version
    -- locked above: a TID lookup, never a scan, whatever the table's statistics say
    claimed_heads AS (
        UPDATE workpump_outbox t SET
            attempts = t.attempts + (t.attempts < t.max_attempts)::integer,
            instance_id = CASE WHEN t.attempts < t.max_attempts THEN p_instance_id END,
            lease_expiry = CASE WHEN t.attempts < t.max_attempts THEN v_lease_expiry END,
            lease_token = CASE WHEN t.attempts < t.max_attempts THEN gen_random_uuid() END,
            claimed_at = CASE WHEN t.attempts < t.max_attempts THEN v_now END,
            dead_lettered_at = CASE WHEN t.attempts >= t.max_attempts THEN v_now END,
            lease_renewals = 0,
            scheduled_for = NULL,
            failure_reason = CASE
                WHEN t.attempts >= t.max_attempts THEN 'max_attempts'
                WHEN t.instance_id IS NOT NULL THEN 'lease_expired'
                ELSE t.failure_reason END,
            last_error = CASE
                WHEN t.instance_id IS NOT NULL THEN
                    'attempt ' || t.attempts || ' ended without a reported outcome: the lease'
                    || ' of instance ' || t.instance_id || ' expired at ' || t.lease_expiry
                ELSE t.last_error END
        FROM candidates c WHERE t.ctid = c.ctid
        RETURNING t.seq, t.message_id AS work_id, t.destination AS topic,
                  t.payload AS payload, t.stream, '' AS scope,
                  t.partition_number, t.attempts, t.max_attempts, t.lease_expiry,
                  NULL::uuid AS event_id, t.priority, t.claimed_at, t.lease_token,
                  t.dead_lettered_at IS NOT NULL AS dead, t.headers,
                  t.created_at, c.due_at
    ),
    -- claimed_runs: each follower leased the same way (it has attempts left)
    claimed_runs AS (
        UPDATE workpump_outbox t SET
            attempts = t.attempts + (t.attempts < t.max_attempts)::integer,
            instance_id = CASE WHEN t.attempts < t.max_attempts THEN p_instance_id END,
            lease_expiry = CASE WHEN t.attempts < t.max_attempts THEN v_lease_expiry END,
            lease_token = CASE WHEN t.attempts < t.max_attempts THEN gen_random_uuid() END,
            claimed_at = CASE WHEN t.attempts < t.max_attempts THEN v_now END,
            dead_lettered_at = CASE WHEN t.attempts >= t.max_attempts THEN v_now END,
            lease_renewals = 0,
            scheduled_for = NULL,
            failure_reason = CASE
                WHEN t.attempts >= t.max_attempts THEN 'max_attempts'
                WHEN t.instance_id IS NOT NULL THEN 'lease_expired'
                ELSE t.failure_reason END,
            last_error = CASE
                WHEN t.instance_id IS NOT NULL THEN
                    'attempt ' || t.attempts || ' ended without a reported outcome: the lease'
                    || ' of instance ' || t.instance_id || ' expired at ' || t.lease_expiry
                ELSE t.last_error END
        FROM followers c WHERE t.ctid = c.ctid
        RETURNING t.seq, t.message_id AS work_id, t.destination AS topic,
                  t.payload AS payload, t.stream, '' AS scope,
                  t.partition_number, t.attempts, t.max_attempts, t.lease_expiry,
                  NULL::uuid AS event_id, t.priority, t.claimed_at, t.lease_token,
                  t.dead_lettered_at IS NOT NULL AS dead, t.headers,
                  t.created_at, c.due_at
    ),
    claimed AS (
        SELECT * FROM claimed_heads
        UNION ALL SELECT * FROM claimed_runs
    ),
    -- pinned: the claimer owns each ordered stream it now works on (sorted: one lock
    -- order for all claimers)
    pinned AS (
        INSERT INTO workpump_active_stream AS s
            (category, scope, stream, partition_number, owner_instance_id, lease_expiry,
             created_at, last_activity_at)
        SELECT DISTINCT ON (c.scope, c.stream)
               'outbox', c.scope, c.stream, c.partition_number, p_instance_id,
               v_lease_expiry, v_now, v_now
        FROM claimed c
        WHERE c.stream IS NOT NULL AND NOT c.dead
        ORDER BY c.scope, c.stream
        ON CONFLICT (category, scope, stream) DO UPDATE
            SET owner_instance_id = excluded.owner_instance_id,
                lease_expiry = excluded.lease_expiry,
                last_activity_at = excluded.last_activity_at
    )
    -- the leased rows (parked ones are not returned), pass by pass as claimed, each
    -- run together after its head, in stream order
    SELECT 'outbox'::text, c.work_id, c.topic, c.payload, c.stream, c.attempts,
           c.max_attempts, c.lease_expiry, c.event_id, NULL::text, c.priority::integer,
           c.claimed_at, c.lease_token, c.headers, c.created_at, c.due_at
    FROM claimed c
    JOIN leased USING (seq)
    WHERE NOT c.dead
    ORDER BY leased.pass, leased.run_priority DESC, leased.run_seq, c.seq;
END
$$;

-- The inbox claim: rows of workpump.receive, whose topic is the handler_name.
-- Lease up to p_limit claimable rows of the topics in p_topics (NULL: any), or of a topic
-- starting with one of p_topic_prefixes, to p_instance_id until p_now + p_lease_seconds,
-- each with a new lease token; rows whose attempts are used up are parked as dead instead.
-- Each row comes with its created_at and due_at (see claim_work). Called by
-- claim_work, which checks the instance and the input and computes p_rank and
-- p_live_count.
CREATE FUNCTION workpump.claim_inbox(
    p_instance_id uuid,
    p_limit integer,
    p_lease_seconds integer DEFAULT 300,
    p_rank integer DEFAULT 0,
    p_live_count integer DEFAULT 1,
    p_topics text[] DEFAULT NULL,
    p_now timestamptz DEFAULT NULL,
    p_topic_prefixes text[] DEFAULT NULL,
    p_run_max integer DEFAULT 1
) RETURNS SETOF workpump.leased_work
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_lease_expiry timestamptz := v_now + make_interval(secs => p_lease_seconds);
BEGIN
    RETURN QUERY
    WITH
    -- timers: stream heads whose lease expired or whose retry or deferral fell due, the
    -- longest due first (index wp_inbox_timer)
    timers AS MATERIALIZED (
        SELECT t.seq, t.ctid, 1 AS pass, t.attempts < t.max_attempts AS leasable,
               t.seq AS run_seq, t.priority AS run_priority, t.stream AS run_stream,
               ''::text AS run_scope,
               coalesce(t.lease_expiry, t.scheduled_for, t.created_at) AS due_at
        FROM workpump_inbox t
        WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
          AND (t.instance_id IS NOT NULL OR t.scheduled_for IS NOT NULL)
          AND coalesce(t.lease_expiry, t.scheduled_for) <= v_now
          AND (p_topics IS NULL OR t.handler_name = ANY (p_topics)
               OR t.handler_name ^@ ANY (p_topic_prefixes))
        ORDER BY coalesce(t.lease_expiry, t.scheduled_for)
        LIMIT p_limit
        FOR UPDATE OF t SKIP LOCKED
    ),
    -- own_share: with live peers, ready stream heads of this instance's partitions
    -- (partition_number mod live count = rank), in the budget the timers left
    own_share AS MATERIALIZED (
        SELECT * FROM (
            SELECT t.seq, t.ctid, 2 AS pass, t.attempts < t.max_attempts AS leasable,
                   t.seq AS run_seq, t.priority AS run_priority, t.stream AS run_stream,
                   ''::text AS run_scope,
                   coalesce(t.lease_expiry, t.scheduled_for, t.created_at) AS due_at
            FROM workpump_inbox t
            WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
              AND t.instance_id IS NULL AND t.scheduled_for IS NULL
              AND p_live_count > 1 AND t.partition_number % p_live_count = p_rank
              AND (p_topics IS NULL OR t.handler_name = ANY (p_topics)
                   OR t.handler_name ^@ ANY (p_topic_prefixes))
            ORDER BY t.priority DESC, t.seq
            LIMIT p_limit - (SELECT count(*) FROM timers WHERE timers.leasable)
            FOR UPDATE OF t SKIP LOCKED
        ) share
        LIMIT p_limit  -- cuts nothing: gives the planner a row estimate
    ),
    -- any_share: ready stream heads of anyone's partitions, in the budget still left, so
    -- no row waits on a busy peer (index wp_inbox_ready)
    any_share AS MATERIALIZED (
        SELECT * FROM (
            SELECT t.seq, t.ctid, 3 AS pass, t.attempts < t.max_attempts AS leasable,
                   t.seq AS run_seq, t.priority AS run_priority, t.stream AS run_stream,
                   ''::text AS run_scope,
                   coalesce(t.lease_expiry, t.scheduled_for, t.created_at) AS due_at
            FROM workpump_inbox t
            WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
              AND t.instance_id IS NULL AND t.scheduled_for IS NULL
              AND t.seq NOT IN (SELECT own_share.seq FROM own_share)
              AND (p_topics IS NULL OR t.handler_name = ANY (p_topics)
                   OR t.handler_name ^@ ANY (p_topic_prefixes))
            ORDER BY t.priority DESC, t.seq
            LIMIT p_limit - (SELECT count(*) FROM timers WHERE timers.leasable)
                          - (SELECT count(*) FROM own_share WHERE own_share.leasable)
            FOR UPDATE OF t SKIP LOCKED
        ) share
        LIMIT p_limit  -- cuts nothing: gives the planner a row estimate
    ),
    -- candidates: every head locked above, once (the three passes are disjoint)
    candidates AS (
        SELECT * FROM timers
        UNION ALL SELECT * FROM own_share
        UNION ALL SELECT * FROM any_share
    ),
    -- run_budget: the rows the heads left in the budget, and how many runs share them
    run_budget AS MATERIALIZED (
        SELECT greatest(p_limit - count(*) FILTER (WHERE c.leasable), 0) AS rows_left,
               count(*) FILTER (WHERE c.leasable AND c.run_stream IS NOT NULL) AS runs
        FROM candidates c
    ),
    -- upcoming: with p_run_max > 1, the undone rows that follow each leasable stream head,
    -- in stream order, no more per head than its share of the budget
    upcoming AS MATERIALIZED (
        SELECT c.seq AS head_seq, n.seq,
               row_number() OVER (PARTITION BY c.seq ORDER BY n.seq) AS position
        FROM candidates c
        CROSS JOIN run_budget b
        CROSS JOIN LATERAL (
            SELECT n.seq FROM workpump_inbox n
            WHERE n.stream = c.run_stream AND n.processed_at IS NULL
              AND n.stream IS NOT NULL AND n.seq > c.seq
            ORDER BY n.stream, n.seq
            LIMIT least(p_run_max - 1, ceil(b.rows_left::numeric / greatest(b.runs, 1)))
        ) n
        WHERE p_run_max > 1 AND c.leasable AND c.run_stream IS NOT NULL AND b.rows_left > 0
    ),
    -- locked: those rows locked, as they are now (a row someone else is writing is
    -- skipped, and ends its run there)
    locked AS MATERIALIZED (
        SELECT l.seq, l.ctid, l.leasable, l.due_at
        FROM upcoming u
        CROSS JOIN LATERAL (
            -- one primary key lookup per row
            SELECT n.seq, n.ctid,
                   coalesce(n.lease_expiry, n.scheduled_for, n.created_at) AS due_at,
                   n.processed_at IS NULL AND n.dead_lettered_at IS NULL
                   AND n.attempts < n.max_attempts
                   AND (n.instance_id IS NULL OR n.lease_expiry <= v_now)
                   AND (n.scheduled_for IS NULL OR n.scheduled_for <= v_now) AS leasable
            FROM workpump_inbox n
            WHERE n.seq = u.seq
            FOR UPDATE OF n SKIP LOCKED
        ) l
    ),
    -- followers: each head's run, the consecutive leasable rows right after it (the
    -- first row that is not ends the run), in the budget the heads left
    followers AS (
        SELECT r.seq, r.ctid, c.pass, true AS leasable, c.seq AS run_seq,
               c.run_priority, c.run_stream, c.run_scope, r.due_at
        FROM (
            SELECT u.head_seq, u.seq, u.position, l.ctid, l.due_at,
                   bool_and(coalesce(l.leasable, false))
                       OVER (PARTITION BY u.head_seq ORDER BY u.position) AS in_run
            FROM upcoming u LEFT JOIN locked l ON l.seq = u.seq
        ) r
        JOIN candidates c ON c.seq = r.head_seq
        WHERE r.in_run
        ORDER BY r.position, c.pass, c.run_priority DESC, c.seq
        LIMIT (SELECT b.rows_left FROM run_budget b)
    ),
    -- leased: the heads and their runs
    leased AS (
        SELECT * FROM candidates
        UNION ALL SELECT * FROM followers
    ),
    -- claimed_heads: each head leased (one attempt more, a new token) or, with its
    -- attempts used up, parked as dead; an expired lease taken over is stamped as an
    -- attempt that ended without an outcome. Rows are found by the ctid of the version
    -- locked above: a TID lookup, never a scan, whatever the table's statistics say
    claimed_heads AS (
        UPDATE workpump_inbox t SET
            attempts = t.attempts + (t.attempts < t.max_attempts)::integer,
            instance_id = CASE WHEN t.attempts < t.max_attempts THEN p_instance_id END,
            lease_expiry = CASE WHEN t.attempts < t.max_attempts THEN v_lease_expiry END,
            lease_token = CASE WHEN t.attempts < t.max_attempts THEN gen_random_uuid() END,
            claimed_at = CASE WHEN t.attempts < t.max_attempts THEN v_now END,
            dead_lettered_at = CASE WHEN t.attempts >= t.max_attempts THEN v_now END,
            lease_renewals = 0,
            scheduled_for = NULL,
            failure_reason = CASE
                WHEN t.attempts >= t.max_attempts THEN 'max_attempts'
                WHEN t.instance_id IS NOT NULL THEN 'lease_expired'
                ELSE t.failure_reason END,
            last_error = CASE
                WHEN t.instance_id IS NOT NULL THEN
                    'attempt ' || t.attempts || ' ended without a reported outcome: the lease'
                    || ' of instance ' || t.instance_id || ' expired at ' || t.lease_expiry
                ELSE t.last_error END
        FROM candidates c WHERE t.ctid = c.ctid
        RETURNING t.seq, t.message_id AS work_id, t.handler_name AS topic,
                  t.payload AS payload, t.stream, '' AS scope,
                  t.partition_number, t.attempts, t.max_attempts, t.lease_expiry,
                  NULL::uuid AS event_id, t.priority, t.claimed_at, t.lease_token,
                  t.dead_lettered_at IS NOT NULL AS dead, t.headers,
                  t.created_at, c.due_at
    ),
    -- claimed_runs: each follower leased the same way (it has attempts left)
    claimed_runs AS (
        UPDATE workpump_inbox t SET
            attempts = t.attempts + (t.attempts < t.max_attempts)::integer,
            instance_id = CASE WHEN t.attempts < t.max_attempts THEN p_instance_id END,
            lease_expiry = CASE WHEN t.attempts < t.max_attempts THEN v_lease_expiry END,
            lease_token = CASE WHEN t.attempts < t.max_attempts THEN gen_random_uuid() END,
            claimed_at = CASE WHEN t.attempts < t.max_attempts THEN v_now END,
            dead_lettered_at = CASE WHEN t.attempts >= t.max_attempts THEN v_now END,
            lease_renewals = 0,
            scheduled_for = NULL,
            failure_reason = CASE
                WHEN t.attempts >= t.max_attempts THEN 'max_attempts'
                WHEN t.instance_id IS NOT NULL THEN 'lease_expired'
                ELSE t.failure_reason END,
            last_error = CASE
                WHEN t.instance_id IS NOT NULL THEN
                    'attempt ' || t.attempts || ' ended without a reported outcome: the lease'
                    || ' of instance ' || t.instance_id || ' expired at ' || t.lease_expiry
                ELSE t.last_error END
        FROM followers c WHERE t.ctid = c.ctid
        RETURNING t.seq, t.message_id AS work_id, t.handler_name AS topic,
                  t.payload AS payload, t.stream, '' AS scope,
                  t.partition_number, t.attempts, t.max_attempts, t.lease_expiry,
                  NULL::uuid AS event_id, t.priority, t.claimed_at, t.lease_token,
                  t.dead_lettered_at IS NOT NULL AS dead, t.headers,
                  t.created_at, c.due_at
    ),
    claimed AS (
        SELECT * FROM claimed_heads
        UNION ALL SELECT * FROM claimed_runs
    ),
    -- pinned: the claimer owns each ordered stream it now works on (sorted: one lock
    -- order for all claimers)
    pinned AS (
        INSERT INTO workpump_active_stream AS s
            (category, scope, stream, partition_number, owner_instance_id, lease_expiry,
             created_at, last_activity_at)
        SELECT DISTINCT ON (c.scope, c.stream)
               'inbox', c.scope, c.stream, c.partition_number, p_instance_id,
               v_lease_expiry, v_now, v_now
        FROM claimed c
        WHERE c.stream IS NOT NULL AND NOT c.dead
        ORDER BY c.scope, c.stream
        ON CONFLICT (category, scope, stream) DO UPDATE
            SET owner_instance_id = excluded.owner_instance_id,
                lease_expiry = excluded.lease_expiry,
                last_activity_at = excluded.last_activity_at
    )
    -- the leased rows (parked ones are not returned), pass by pass as claimed, each
    -- run together after its head, in stream order
    SELECT 'inbox'::text, c.work_id, c.topic, c.payload, c.stream, c.attempts,
           c.max_attempts, c.lease_expiry, c.event_id, NULL::text, c.priority::integer,
           c.claimed_at, c.lease_token, c.headers, c.created_at, c.due_at
    FROM claimed c
    JOIN leased USING (seq)
    WHERE NOT c.dead
    ORDER BY leased.pass, leased.run_priority DESC, leased.run_seq, c.seq;
END
$$;

-- The perspective claim: rows of workpump.emit, whose topic is the perspective_name;
-- payload and event type come from the event.
-- Lease up to p_limit claimable rows of the topics in p_topics (NULL: any), or of a topic
-- starting with one of p_topic_prefixes, to p_instance_id until p_now + p_lease_seconds,
-- each with a new lease token; rows whose attempts are used up are parked as dead instead.
-- Each row comes with its created_at and due_at (see claim_work). Called by
-- claim_work, which checks the instance and the input and computes p_rank and
-- p_live_count.
CREATE FUNCTION workpump.claim_perspective_event(
    p_instance_id uuid,
    p_limit integer,
    p_lease_seconds integer DEFAULT 300,
    p_rank integer DEFAULT 0,
    p_live_count integer DEFAULT 1,
    p_topics text[] DEFAULT NULL,
    p_now timestamptz DEFAULT NULL,
    p_topic_prefixes text[] DEFAULT NULL,
    p_run_max integer DEFAULT 1
) RETURNS SETOF workpump.leased_work
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_lease_expiry timestamptz := v_now + make_interval(secs => p_lease_seconds);
BEGIN
    RETURN QUERY
    WITH
    -- timers: stream heads whose lease expired or whose retry or deferral fell due, the
    -- longest due first (index wp_persp_timer)
    timers AS MATERIALIZED (
        SELECT t.seq, t.ctid, 1 AS pass, t.attempts < t.max_attempts AS leasable,
               t.seq AS run_seq, t.priority AS run_priority, t.stream AS run_stream,
               t.perspective_name AS run_scope,
               coalesce(t.lease_expiry, t.scheduled_for, t.created_at) AS due_at
        FROM workpump_perspective_event t
        WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
          AND (t.instance_id IS NOT NULL OR t.scheduled_for IS NOT NULL)
          AND coalesce(t.lease_expiry, t.scheduled_for) <= v_now
          AND (p_topics IS NULL OR t.perspective_name = ANY (p_topics)
               OR t.perspective_name ^@ ANY (p_topic_prefixes))
        ORDER BY coalesce(t.lease_expiry, t.scheduled_for)
        LIMIT p_limit
        FOR UPDATE OF t SKIP LOCKED
    ),
    -- own_share: with live peers, ready stream heads of this instance's partitions
    -- (partition_number mod live count = rank), in the budget the timers left
    own_share AS MATERIALIZED (
        SELECT * FROM (
            SELECT t.seq, t.ctid, 2 AS pass, t.attempts < t.max_attempts AS leasable,
                   t.seq AS run_seq, t.priority AS run_priority, t.stream AS run_stream,
                   t.perspective_name AS run_scope,
                   coalesce(t.lease_expiry, t.scheduled_for, t.created_at) AS due_at
            FROM workpump_perspective_event t
            WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
              AND t.instance_id IS NULL AND t.scheduled_for IS NULL
              AND p_live_count > 1 AND t.partition_number % p_live_count = p_rank
              AND (p_topics IS NULL OR t.perspective_name = ANY (p_topics)
                   OR t.perspective_name ^@ ANY (p_topic_prefixes))
            ORDER BY t.priority DESC, t.seq
            LIMIT p_limit - (SELECT count(*) FROM timers WHERE timers.leasable)
            FOR UPDATE OF t SKIP LOCKED
        ) share
        LIMIT p_limit  -- cuts nothing: gives the planner a row estimate
    ),
    -- any_share: ready stream heads of anyone's partitions, in the budget still left, so
    -- no row waits on a busy peer (index wp_persp_ready)
    any_share AS MATERIALIZED (
        SELECT * FROM (
            SELECT t.seq, t.ctid, 3 AS pass, t.attempts < t.max_attempts AS leasable,
                   t.seq AS run_seq, t.priority AS run_priority, t.stream AS run_stream,
                   t.perspective_name AS run_scope,
                   coalesce(t.lease_expiry, t.scheduled_for, t.created_at) AS due_at
            FROM workpump_perspective_event t
            WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
              AND t.instance_id IS NULL AND t.scheduled_for IS NULL
              AND t.seq NOT IN (SELECT own_share.seq FROM own_share)
              AND (p_topics IS NULL OR t.perspective_name = ANY (p_topics)
                   OR t.perspective_name ^@ ANY (p_topic_prefixes))
            ORDER BY t.priority DESC, t.seq
            LIMIT p_limit - (SELECT count(*) FROM timers WHERE timers.leasable)
                          - (SELECT count(*) FROM own_share WHERE own_share.leasable)
            FOR UPDATE OF t SKIP LOCKED
        ) share
        LIMIT p_limit  -- cuts nothing: gives the planner a row estimate
    ),
    -- candidates: every head locked above, once (the three passes are disjoint)
    candidates AS (
        SELECT * FROM timers
        UNION ALL SELECT * FROM own_share
        UNION ALL SELECT * FROM any_share
    ),
    -- run_budget: the rows the heads left in the budget, and how many runs share them
    run_budget AS MATERIALIZED (
        SELECT greatest(p_limit - count(*) FILTER (WHERE c.leasable), 0) AS rows_left,
               count(*) FILTER (WHERE c.leasable AND c.run_stream IS NOT NULL) AS runs
        FROM candidates c
    ),
    -- upcoming: with p_run_max > 1, the undone rows that follow each leasable stream head,
    -- in stream order, no more per head than its share of the budget
    upcoming AS MATERIALIZED (
        SELECT c.seq AS head_seq, n.seq,
               row_number() OVER (PARTITION BY c.seq ORDER BY n.seq) AS position
        FROM candidates c
        CROSS JOIN run_budget b
        CROSS JOIN LATERAL (
            SELECT n.seq FROM workpump_perspective_event n
            WHERE n.perspective_name = c.run_scope AND n.stream = c.run_stream AND n.processed_at IS NULL
              AND n.stream IS NOT NULL AND n.seq > c.seq
            ORDER BY n.perspective_name, n.stream, n.seq
            LIMIT least(p_run_max - 1, ceil(b.rows_left::numeric / greatest(b.runs, 1)))
        ) n
        WHERE p_run_max > 1 AND c.leasable AND c.run_stream IS NOT NULL AND b.rows_left > 0
    ),
    -- locked: those rows locked, as they are now (a row someone else is writing is
    -- skipped, and ends its run there)
    locked AS MATERIALIZED (
        SELECT l.seq, l.ctid, l.leasable, l.due_at
        FROM upcoming u
        CROSS JOIN LATERAL (
            -- one primary key lookup per row
            SELECT n.seq, n.ctid,
                   coalesce(n.lease_expiry, n.scheduled_for, n.created_at) AS due_at,
                   n.processed_at IS NULL AND n.dead_lettered_at IS NULL
                   AND n.attempts < n.max_attempts
                   AND (n.instance_id IS NULL OR n.lease_expiry <= v_now)
                   AND (n.scheduled_for IS NULL OR n.scheduled_for <= v_now) AS leasable
            FROM workpump_perspective_event n
            WHERE n.seq = u.seq
            FOR UPDATE OF n SKIP LOCKED
        ) l
    ),
    -- followers: each head's run, the consecutive leasable rows right after it (the
    -- first row that is not ends the run), in the budget the heads left
    followers AS (
        SELECT r.seq, r.ctid, c.pass, true AS leasable, c.seq AS run_seq,
               c.run_priority, c.run_stream, c.run_scope, r.due_at
        FROM (
            SELECT u.head_seq, u.seq, u.position, l.ctid, l.due_at,
                   bool_and(coalesce(l.leasable, false))
                       OVER (PARTITION BY u.head_seq ORDER BY u.position) AS in_run
            FROM upcoming u LEFT JOIN locked l ON l.seq = u.seq
        ) r
        JOIN candidates c ON c.seq = r.head_seq
        WHERE r.in_run
        ORDER BY r.position, c.pass, c.run_priority DESC, c.seq
        LIMIT (SELECT b.rows_left FROM run_budget b)
    ),
    -- leased: the heads and their runs
    leased AS (
        SELECT * FROM candidates
        UNION ALL SELECT * FROM followers
    ),
    -- claimed_heads: each head leased (one attempt more, a new token) or, with its
    -- attempts used up, parked as dead; an expired lease taken over is stamped as an
    -- attempt that ended without an outcome. Rows are found by the ctid of the version
    -- locked above: a TID lookup, never a scan, whatever the table's statistics say
    claimed_heads AS (
        UPDATE workpump_perspective_event t SET
            attempts = t.attempts + (t.attempts < t.max_attempts)::integer,
            instance_id = CASE WHEN t.attempts < t.max_attempts THEN p_instance_id END,
            lease_expiry = CASE WHEN t.attempts < t.max_attempts THEN v_lease_expiry END,
            lease_token = CASE WHEN t.attempts < t.max_attempts THEN gen_random_uuid() END,
            claimed_at = CASE WHEN t.attempts < t.max_attempts THEN v_now END,
            dead_lettered_at = CASE WHEN t.attempts >= t.max_attempts THEN v_now END,
            lease_renewals = 0,
            scheduled_for = NULL,
            failure_reason = CASE
                WHEN t.attempts >= t.max_attempts THEN 'max_attempts'
                WHEN t.instance_id IS NOT NULL THEN 'lease_expired'
                ELSE t.failure_reason END,
            last_error = CASE
                WHEN t.instance_id IS NOT NULL THEN
                    'attempt ' || t.attempts || ' ended without a reported outcome: the lease'
                    || ' of instance ' || t.instance_id || ' expired at ' || t.lease_expiry
                ELSE t.last_error END
        FROM candidates c WHERE t.ctid = c.ctid
        RETURNING t.seq, t.event_work_id AS work_id, t.perspective_name AS topic,
                  NULL::jsonb AS payload, t.stream, t.perspective_name AS scope,
                  t.partition_number, t.attempts, t.max_attempts, t.lease_expiry,
                  t.event_id AS event_id, t.priority, t.claimed_at, t.lease_token,
                  t.dead_lettered_at IS NOT NULL AS dead, t.headers,
                  t.created_at, c.due_at
    ),
    -- claimed_runs: each follower leased the same way (it has attempts left)
    claimed_runs AS (
        UPDATE workpump_perspective_event t SET
            attempts = t.attempts + (t.attempts < t.max_attempts)::integer,
            instance_id = CASE WHEN t.attempts < t.max_attempts THEN p_instance_id END,
            lease_expiry = CASE WHEN t.attempts < t.max_attempts THEN v_lease_expiry END,
            lease_token = CASE WHEN t.attempts < t.max_attempts THEN gen_random_uuid() END,
            claimed_at = CASE WHEN t.attempts < t.max_attempts THEN v_now END,
            dead_lettered_at = CASE WHEN t.attempts >= t.max_attempts THEN v_now END,
            lease_renewals = 0,
            scheduled_for = NULL,
            failure_reason = CASE
                WHEN t.attempts >= t.max_attempts THEN 'max_attempts'
                WHEN t.instance_id IS NOT NULL THEN 'lease_expired'
                ELSE t.failure_reason END,
            last_error = CASE
                WHEN t.instance_id IS NOT NULL THEN
                    'attempt ' || t.attempts || ' ended without a reported outcome: the lease'
                    || ' of instance ' || t.instance_id || ' expired at ' || t.lease_expiry
                ELSE t.last_error END
        FROM followers c WHERE t.ctid = c.ctid
        RETURNING t.seq, t.event_work_id AS work_id, t.perspective_name AS topic,
                  NULL::jsonb AS payload, t.stream, t.perspective_name AS scope,
                  t.partition_number, t.attempts, t.max_attempts, t.lease_expiry,
                  t.event_id AS event_id, t.priority, t.claimed_at, t.lease_token,
                  t.dead_lettered_at IS NOT NULL AS dead, t.headers,
                  t.created_at, c.due_at
    ),
    claimed AS (
        SELECT * FROM claimed_heads
        UNION ALL SELECT * FROM claimed_runs
    ),
    -- pinned: the claimer owns each ordered stream it now works on (sorted: one lock
    -- order for all claimers)
    pinned AS (
        INSERT INTO workpump_active_stream AS s
            (category, scope, stream, partition_number, owner_instance_id, lease_expiry,
             created_at, last_activity_at)
        SELECT DISTINCT ON (c.scope, c.stream)
               'perspective_event', c.scope, c.stream, c.partition_number, p_instance_id,
               v_lease_expiry, v_now, v_now
        FROM claimed c
        WHERE c.stream IS NOT NULL AND NOT c.dead
        ORDER BY c.scope, c.stream
        ON CONFLICT (category, scope, stream) DO UPDATE
            SET owner_instance_id = excluded.owner_instance_id,
                lease_expiry = excluded.lease_expiry,
                last_activity_at = excluded.last_activity_at
    )
    -- the leased rows (parked ones are not returned), pass by pass as claimed, each
    -- run together after its head, in stream order
    SELECT 'perspective_event'::text, c.work_id, c.topic, e.payload, c.stream, c.attempts,
           c.max_attempts, c.lease_expiry, c.event_id, e.event_type, c.priority::integer,
           c.claimed_at, c.lease_token, c.headers, c.created_at, c.due_at
    FROM claimed c
    JOIN leased USING (seq)
    JOIN workpump_event e ON e.event_id = c.event_id
    WHERE NOT c.dead
    ORDER BY leased.pass, leased.run_priority DESC, leased.run_seq, c.seq;
END
$$;

-- The receptor claim: rows of workpump.emit, whose topic is the receptor_name;
-- payload and event type come from the event.
-- Lease up to p_limit claimable rows of the topics in p_topics (NULL: any), or of a topic
-- starting with one of p_topic_prefixes, to p_instance_id until p_now + p_lease_seconds,
-- each with a new lease token; rows whose attempts are used up are parked as dead instead.
-- Each row comes with its created_at and due_at (see claim_work). Called by
-- claim_work, which checks the instance and the input and computes p_rank and
-- p_live_count.
CREATE FUNCTION workpump.claim_receptor(
    p_instance_id uuid,
    p_limit integer,
    p_lease_seconds integer DEFAULT 300,
    p_rank integer DEFAULT 0,
    p_live_count integer DEFAULT 1,
    p_topics text[] DEFAULT NULL,
    p_now timestamptz DEFAULT NULL,
    p_topic_prefixes text[] DEFAULT NULL,
    p_run_max integer DEFAULT 1
) RETURNS SETOF workpump.leased_work
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_lease_expiry timestamptz := v_now + make_interval(secs => p_lease_seconds);
BEGIN
    RETURN QUERY
    WITH
    -- timers: stream heads whose lease expired or whose retry or deferral fell due, the
    -- longest due first (index wp_receptor_timer)
    timers AS MATERIALIZED (
        SELECT t.seq, t.ctid, 1 AS pass, t.attempts < t.max_attempts AS leasable,
               t.seq AS run_seq, t.priority AS run_priority, t.stream AS run_stream,
               t.receptor_name AS run_scope,
               coalesce(t.lease_expiry, t.scheduled_for, t.created_at) AS due_at
        FROM workpump_receptor_processing t
        WHERE t.completed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
          AND (t.instance_id IS NOT NULL OR t.scheduled_for IS NOT NULL)
          AND coalesce(t.lease_expiry, t.scheduled_for) <= v_now
          AND (p_topics IS NULL OR t.receptor_name = ANY (p_topics)
               OR t.receptor_name ^@ ANY (p_topic_prefixes))
        ORDER BY coalesce(t.lease_expiry, t.scheduled_for)
        LIMIT p_limit
        FOR UPDATE OF t SKIP LOCKED
    ),
    -- own_share: with live peers, ready stream heads of this instance's partitions
    -- (partition_number mod live count = rank), in the budget the timers left
    own_share AS MATERIALIZED (
        SELECT * FROM (
            SELECT t.seq, t.ctid, 2 AS pass, t.attempts < t.max_attempts AS leasable,
                   t.seq AS run_seq, t.priority AS run_priority, t.stream AS run_stream,
                   t.receptor_name AS run_scope,
                   coalesce(t.lease_expiry, t.scheduled_for, t.created_at) AS due_at
            FROM workpump_receptor_processing t
            WHERE t.completed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
              AND t.instance_id IS NULL AND t.scheduled_for IS NULL
              AND p_live_count > 1 AND t.partition_number % p_live_count = p_rank
              AND (p_topics IS NULL OR t.receptor_name = ANY (p_topics)
                   OR t.receptor_name ^@ ANY (p_topic_prefixes))
            ORDER BY t.priority DESC, t.seq
            LIMIT p_limit - (SELECT count(*) FROM timers WHERE timers.leasable)
            FOR UPDATE OF t SKIP LOCKED
        ) share
        LIMIT p_limit  -- cuts nothing: gives the planner a row estimate
    ),
    -- any_share: ready stream heads of anyone's partitions, in the budget still left, so
    -- no row waits on a busy peer (index wp_receptor_ready)
    any_share AS MATERIALIZED (
        SELECT * FROM (
            SELECT t.seq, t.ctid, 3 AS pass, t.attempts < t.max_attempts AS leasable,
                   t.seq AS run_seq, t.priority AS run_priority, t.stream AS run_stream,
                   t.receptor_name AS run_scope,
                   coalesce(t.lease_expiry, t.scheduled_for, t.created_at) AS due_at
            FROM workpump_receptor_processing t
            WHERE t.completed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
              AND t.instance_id IS NULL AND t.scheduled_for IS NULL
              AND t.seq NOT IN (SELECT own_share.seq FROM own_share)
              AND (p_topics IS NULL OR t.receptor_name = ANY (p_topics)
                   OR t.receptor_name ^@ ANY (p_topic_prefixes))
            ORDER BY t.priority DESC, t.seq
            LIMIT p_limit - (SELECT count(*) FROM timers WHERE timers.leasable)
                          - (SELECT count(*) FROM own_share WHERE own_share.leasable)
            FOR UPDATE OF t SKIP LOCKED
        ) share
        LIMIT p_limit  -- cuts nothing: gives the planner a row estimate
    ),
    -- candidates: every head locked above, once (the three passes are disjoint)
    candidates AS (
        SELECT * FROM timers
        UNION ALL SELECT * FROM own_share
        UNION ALL SELECT * FROM any_share
    ),
    -- run_budget: the rows the heads left in the budget, and how many runs share them
    run_budget AS MATERIALIZED (
        SELECT greatest(p_limit - count(*) FILTER (WHERE c.leasable), 0) AS rows_left,
               count(*) FILTER (WHERE c.leasable AND c.run_stream IS NOT NULL) AS runs
        FROM candidates c
    ),
    -- upcoming: with p_run_max > 1, the undone rows that follow each leasable stream head,
    -- in stream order, no more per head than its share of the budget
    upcoming AS MATERIALIZED (
        SELECT c.seq AS head_seq, n.seq,
               row_number() OVER (PARTITION BY c.seq ORDER BY n.seq) AS position
        FROM candidates c
        CROSS JOIN run_budget b
        CROSS JOIN LATERAL (
            SELECT n.seq FROM workpump_receptor_processing n
            WHERE n.receptor_name = c.run_scope AND n.stream = c.run_stream AND n.completed_at IS NULL
              AND n.stream IS NOT NULL AND n.seq > c.seq
            ORDER BY n.receptor_name, n.stream, n.seq
            LIMIT least(p_run_max - 1, ceil(b.rows_left::numeric / greatest(b.runs, 1)))
        ) n
        WHERE p_run_max > 1 AND c.leasable AND c.run_stream IS NOT NULL AND b.rows_left > 0
    ),
    -- locked: those rows locked, as they are now (a row someone else is writing is
    -- skipped, and ends its run there)
    locked AS MATERIALIZED (
        SELECT l.seq, l.ctid, l.leasable, l.due_at
        FROM upcoming u
        CROSS JOIN LATERAL (
            -- one primary key lookup per row
            SELECT n.seq, n.ctid,
                   coalesce(n.lease_expiry, n.scheduled_for, n.created_at) AS due_at,
                   n.completed_at IS NULL AND n.dead_lettered_at IS NULL
                   AND n.attempts < n.max_attempts
                   AND (n.instance_id IS NULL OR n.lease_expiry <= v_now)
                   AND (n.scheduled_for IS NULL OR n.scheduled_for <= v_now) AS leasable
            FROM workpump_receptor_processing n
            WHERE n.seq = u.seq
            FOR UPDATE OF n SKIP LOCKED
        ) l
    ),
    -- followers: each head's run, the consecutive leasable rows right after it (the
    -- first row that is not ends the run), in the budget the heads left
    followers AS (
        SELECT r.seq, r.ctid, c.pass, true AS leasable, c.seq AS run_seq,
               c.run_priority, c.run_stream, c.run_scope, r.due_at
        FROM (
            SELECT u.head_seq, u.seq, u.position, l.ctid, l.due_at,
                   bool_and(coalesce(l.leasable, false))
                       OVER (PARTITION BY u.head_seq ORDER BY u.position) AS in_run
            FROM upcoming u LEFT JOIN locked l ON l.seq = u.seq
        ) r
        JOIN candidates c ON c.seq = r.head_seq
        WHERE r.in_run
        ORDER BY r.position, c.pass, c.run_priority DESC, c.seq
        LIMIT (SELECT b.rows_left FROM run_budget b)
    ),
    -- leased: the heads and their runs
    leased AS (
        SELECT * FROM candidates
        UNION ALL SELECT * FROM followers
    ),
    -- claimed_heads: each head leased (one attempt more, a new token) or, with its
    -- attempts used up, parked as dead; an expired lease taken over is stamped as an
    -- attempt that ended without an outcome. Rows are found by the ctid of the version
    -- locked above: a TID lookup, never a scan, whatever the table's statistics say
    claimed_heads AS (
        UPDATE workpump_receptor_processing t SET
            attempts = t.attempts + (t.attempts < t.max_attempts)::integer,
            instance_id = CASE WHEN t.attempts < t.max_attempts THEN p_instance_id END,
            lease_expiry = CASE WHEN t.attempts < t.max_attempts THEN v_lease_expiry END,
            lease_token = CASE WHEN t.attempts < t.max_attempts THEN gen_random_uuid() END,
            claimed_at = CASE WHEN t.attempts < t.max_attempts THEN v_now END,
            dead_lettered_at = CASE WHEN t.attempts >= t.max_attempts THEN v_now END,
            lease_renewals = 0,
            scheduled_for = NULL,
            failure_reason = CASE
                WHEN t.attempts >= t.max_attempts THEN 'max_attempts'
                WHEN t.instance_id IS NOT NULL THEN 'lease_expired'
                ELSE t.failure_reason END,
            last_error = CASE
                WHEN t.instance_id IS NOT NULL THEN
                    'attempt ' || t.attempts || ' ended without a reported outcome: the lease'
                    || ' of instance ' || t.instance_id || ' expired at ' || t.lease_expiry
                ELSE t.last_error END
        FROM candidates c WHERE t.ctid = c.ctid
        RETURNING t.seq, t.id AS work_id, t.receptor_name AS topic,
                  NULL::jsonb AS payload, t.stream, t.receptor_name AS scope,
                  t.partition_number, t.attempts, t.max_attempts, t.lease_expiry,
                  t.event_id AS event_id, t.priority, t.claimed_at, t.lease_token,
                  t.dead_lettered_at IS NOT NULL AS dead, t.headers,
                  t.created_at, c.due_at
    ),
    -- claimed_runs: each follower leased the same way (it has attempts left)
    claimed_runs AS (
        UPDATE workpump_receptor_processing t SET
            attempts = t.attempts + (t.attempts < t.max_attempts)::integer,
            instance_id = CASE WHEN t.attempts < t.max_attempts THEN p_instance_id END,
            lease_expiry = CASE WHEN t.attempts < t.max_attempts THEN v_lease_expiry END,
            lease_token = CASE WHEN t.attempts < t.max_attempts THEN gen_random_uuid() END,
            claimed_at = CASE WHEN t.attempts < t.max_attempts THEN v_now END,
            dead_lettered_at = CASE WHEN t.attempts >= t.max_attempts THEN v_now END,
            lease_renewals = 0,
            scheduled_for = NULL,
            failure_reason = CASE
                WHEN t.attempts >= t.max_attempts THEN 'max_attempts'
                WHEN t.instance_id IS NOT NULL THEN 'lease_expired'
                ELSE t.failure_reason END,
            last_error = CASE
                WHEN t.instance_id IS NOT NULL THEN
                    'attempt ' || t.attempts || ' ended without a reported outcome: the lease'
                    || ' of instance ' || t.instance_id || ' expired at ' || t.lease_expiry
                ELSE t.last_error END
        FROM followers c WHERE t.ctid = c.ctid
        RETURNING t.seq, t.id AS work_id, t.receptor_name AS topic,
                  NULL::jsonb AS payload, t.stream, t.receptor_name AS scope,
                  t.partition_number, t.attempts, t.max_attempts, t.lease_expiry,
                  t.event_id AS event_id, t.priority, t.claimed_at, t.lease_token,
                  t.dead_lettered_at IS NOT NULL AS dead, t.headers,
                  t.created_at, c.due_at
    ),
    claimed AS (
        SELECT * FROM claimed_heads
        UNION ALL SELECT * FROM claimed_runs
    ),
    -- pinned: the claimer owns each ordered stream it now works on (sorted: one lock
    -- order for all claimers)
    pinned AS (
        INSERT INTO workpump_active_stream AS s
            (category, scope, stream, partition_number, owner_instance_id, lease_expiry,
             created_at, last_activity_at)
        SELECT DISTINCT ON (c.scope, c.stream)
               'receptor', c.scope, c.stream, c.partition_number, p_instance_id,
               v_lease_expiry, v_now, v_now
        FROM claimed c
        WHERE c.stream IS NOT NULL AND NOT c.dead
        ORDER BY c.scope, c.stream
        ON CONFLICT (category, scope, stream) DO UPDATE
            SET owner_instance_id = excluded.owner_instance_id,
                lease_expiry = excluded.lease_expiry,
                last_activity_at = excluded.last_activity_at
    )
    -- the leased rows (parked ones are not returned), pass by pass as claimed, each
    -- run together after its head, in stream order
    SELECT 'receptor'::text, c.work_id, c.topic, e.payload, c.stream, c.attempts,
           c.max_attempts, c.lease_expiry, c.event_id, e.event_type, c.priority::integer,
           c.claimed_at, c.lease_token, c.headers, c.created_at, c.due_at
    FROM claimed c
    JOIN leased USING (seq)
    JOIN workpump_event e ON e.event_id = c.event_id
    WHERE NOT c.dead
    ORDER BY leased.pass, leased.run_priority DESC, leased.run_seq, c.seq;
END
$$;

-- Lease up to p_max_rows claimable rows of the given categories (all when NULL) and of
-- the topics p_topics names (all when NULL; e.g. '{"outbox": ["emails.welcome"],
-- "inbox": ["stripe.webhook"]}'), or whose topic starts with one of the prefixes
-- p_topic_prefixes names in the same shape (e.g. '{"inbox": ["django.tasks:default:"]}'),
-- to p_instance_id for p_lease_seconds, each with a new
-- lease_token that every later write about the row must pass back. Raises SQLSTATE WP001
-- when p_instance_id is evicted or not registered. A category is only claimed from when
-- its two index probes find something, so an idle system costs a few probes and no writes.
-- headers are the row's, as its producer stored them (NULL when none). created_at is the
-- row's; due_at is when it became claimable: the expiry of the lease this claim took
-- over, else when its retry or deferral fell due, else created_at (schema version 16).
-- has_more is true on the rows of a category that filled its share of the budget (the
-- caller should poll again at once); a NOTICE 'workpump.has_more=true' says the same.
-- Each category's rows are leased by its own function: claim_outbox, claim_inbox,
-- claim_perspective_event, claim_receptor. With p_stream_run_max > 1 a stream head is
-- leased with a run: up to that many rows in all, the head and the consecutive rows that
-- follow it and could be leased now, each with its own token, returned together in stream
-- order; the runs' rows count against p_max_rows (schema version 15).
CREATE FUNCTION workpump.claim_work(
    p_instance_id uuid,
    p_max_rows integer DEFAULT 100,
    p_lease_seconds integer DEFAULT 300,
    p_partition_count integer DEFAULT 10000,
    p_categories text[] DEFAULT NULL,
    p_stale_after_seconds integer DEFAULT 30,
    p_definitively_dead_after_seconds integer DEFAULT 300,
    p_now timestamptz DEFAULT NULL,
    p_topics jsonb DEFAULT NULL,
    p_topic_prefixes jsonb DEFAULT NULL,
    p_stream_run_max integer DEFAULT 1
) RETURNS TABLE (
    category text,
    work_id uuid,
    topic text,
    payload jsonb,
    stream text,
    attempts integer,
    max_attempts integer,
    lease_expiry timestamptz,
    event_id uuid,
    event_type text,
    priority integer,
    claimed_at timestamptz,
    lease_token uuid,
    headers jsonb,
    created_at timestamptz,
    due_at timestamptz,
    has_more boolean
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_categories text[] := coalesce(p_categories,
                                    ARRAY['outbox', 'inbox', 'perspective_event', 'receptor']);
    v_category text;
    v_outbox_topics text[];
    v_outbox_prefixes text[];
    v_inbox_topics text[];
    v_inbox_prefixes text[];
    v_perspective_topics text[];
    v_perspective_prefixes text[];
    v_receptor_topics text[];
    v_receptor_prefixes text[];
    v_with_work text[] := '{}';
    v_full text[] := '{}';
    v_rank integer;
    v_live_count integer;
    v_remaining integer := p_max_rows;
    v_left integer;
    v_quota integer;
    v_rows workpump.leased_work[];
    v_count integer;
    v_any_more boolean := false;
    v_start integer;
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION 'claim_work needs p_instance_id.' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_max_rows IS NULL OR p_max_rows < 1 THEN
        RAISE EXCEPTION 'claim_work needs p_max_rows >= 1, not %.', coalesce(p_max_rows::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_lease_seconds IS NULL OR p_lease_seconds < 1 THEN
        RAISE EXCEPTION 'claim_work needs p_lease_seconds >= 1, not %.', coalesce(p_lease_seconds::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_stream_run_max IS NULL OR p_stream_run_max < 1 THEN
        RAISE EXCEPTION 'claim_work needs p_stream_run_max >= 1, not %.', coalesce(p_stream_run_max::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_partition_count IS NULL OR p_partition_count < 1 THEN
        RAISE EXCEPTION 'claim_work needs p_partition_count >= 1, not %.', coalesce(p_partition_count::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOREACH v_category IN ARRAY v_categories LOOP
        PERFORM workpump.check_category(v_category);
    END LOOP;
    IF p_topics IS NOT NULL AND (
        jsonb_typeof(p_topics) <> 'object'
        OR EXISTS (SELECT 1 FROM jsonb_each(p_topics) e
                   WHERE e.key NOT IN ('outbox', 'inbox', 'perspective_event', 'receptor')
                      OR jsonb_typeof(e.value) <> 'array'
                      OR EXISTS (SELECT 1 FROM jsonb_array_elements(e.value) v
                                 WHERE jsonb_typeof(v) <> 'string'))) THEN
        RAISE EXCEPTION 'claim_work needs p_topics as an object of category: [topic, ...], not %.', p_topics
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'E.g. {"outbox": ["emails.welcome"], "inbox": ["stripe.webhook"]}; categories: outbox, inbox, perspective_event, receptor.';
    END IF;
    IF p_topic_prefixes IS NOT NULL AND (
        jsonb_typeof(p_topic_prefixes) <> 'object'
        OR EXISTS (SELECT 1 FROM jsonb_each(p_topic_prefixes) e
                   WHERE e.key NOT IN ('outbox', 'inbox', 'perspective_event', 'receptor')
                      OR jsonb_typeof(e.value) <> 'array'
                      OR EXISTS (SELECT 1 FROM jsonb_array_elements(e.value) v
                                 WHERE jsonb_typeof(v) <> 'string' OR v #>> '{}' = ''))) THEN
        RAISE EXCEPTION 'claim_work needs p_topic_prefixes as an object of category: [non-empty prefix, ...], not %.', p_topic_prefixes
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'E.g. {"inbox": ["django.tasks:default:"]}; to claim every topic, pass p_topics => NULL.';
    END IF;
    PERFORM workpump.check_instance('claim_work', p_instance_id);
    v_outbox_topics := workpump.claim_topics(p_topics, 'outbox');
    v_inbox_topics := workpump.claim_topics(p_topics, 'inbox');
    v_perspective_topics := workpump.claim_topics(p_topics, 'perspective_event');
    v_receptor_topics := workpump.claim_topics(p_topics, 'receptor');
    v_outbox_prefixes := workpump.claim_topics(p_topic_prefixes, 'outbox');
    v_inbox_prefixes := workpump.claim_topics(p_topic_prefixes, 'inbox');
    v_perspective_prefixes := workpump.claim_topics(p_topic_prefixes, 'perspective_event');
    v_receptor_prefixes := workpump.claim_topics(p_topic_prefixes, 'receptor');

    -- Per-category guards: two index probes each (ready rows, due timers), of the topics
    -- the claimer can run. The ORDER BY of each probe is its index's order: it keeps the
    -- planner on the partial index (an EXISTS may be planned as a scan of the whole table).
    IF 'outbox' = ANY (v_categories)
       AND workpump.any_topic_chosen(v_outbox_topics, v_outbox_prefixes) AND (
        (SELECT 1 FROM workpump_outbox t
                WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                  AND t.instance_id IS NULL AND t.scheduled_for IS NULL
                  AND (v_outbox_topics IS NULL OR t.destination = ANY (v_outbox_topics)
                       OR t.destination ^@ ANY (v_outbox_prefixes))
                ORDER BY t.priority DESC, t.seq LIMIT 1) IS NOT NULL
        OR (SELECT 1 FROM workpump_outbox t
                   WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                     AND (t.instance_id IS NOT NULL OR t.scheduled_for IS NOT NULL)
                     AND coalesce(t.lease_expiry, t.scheduled_for) <= v_now
                     AND (v_outbox_topics IS NULL OR t.destination = ANY (v_outbox_topics)
                       OR t.destination ^@ ANY (v_outbox_prefixes))
                   ORDER BY coalesce(t.lease_expiry, t.scheduled_for) LIMIT 1) IS NOT NULL) THEN
        v_with_work := v_with_work || 'outbox'::text;
    END IF;
    IF 'inbox' = ANY (v_categories)
       AND workpump.any_topic_chosen(v_inbox_topics, v_inbox_prefixes) AND (
        (SELECT 1 FROM workpump_inbox t
                WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                  AND t.instance_id IS NULL AND t.scheduled_for IS NULL
                  AND (v_inbox_topics IS NULL OR t.handler_name = ANY (v_inbox_topics)
                       OR t.handler_name ^@ ANY (v_inbox_prefixes))
                ORDER BY t.priority DESC, t.seq LIMIT 1) IS NOT NULL
        OR (SELECT 1 FROM workpump_inbox t
                   WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                     AND (t.instance_id IS NOT NULL OR t.scheduled_for IS NOT NULL)
                     AND coalesce(t.lease_expiry, t.scheduled_for) <= v_now
                     AND (v_inbox_topics IS NULL OR t.handler_name = ANY (v_inbox_topics)
                       OR t.handler_name ^@ ANY (v_inbox_prefixes))
                   ORDER BY coalesce(t.lease_expiry, t.scheduled_for) LIMIT 1) IS NOT NULL) THEN
        v_with_work := v_with_work || 'inbox'::text;
    END IF;
    IF 'perspective_event' = ANY (v_categories)
       AND workpump.any_topic_chosen(v_perspective_topics, v_perspective_prefixes) AND (
        (SELECT 1 FROM workpump_perspective_event t
                WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                  AND t.instance_id IS NULL AND t.scheduled_for IS NULL
                  AND (v_perspective_topics IS NULL
                       OR t.perspective_name = ANY (v_perspective_topics)
                       OR t.perspective_name ^@ ANY (v_perspective_prefixes))
                ORDER BY t.priority DESC, t.seq LIMIT 1) IS NOT NULL
        OR (SELECT 1 FROM workpump_perspective_event t
                   WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                     AND (t.instance_id IS NOT NULL OR t.scheduled_for IS NOT NULL)
                     AND coalesce(t.lease_expiry, t.scheduled_for) <= v_now
                     AND (v_perspective_topics IS NULL
                          OR t.perspective_name = ANY (v_perspective_topics)
                       OR t.perspective_name ^@ ANY (v_perspective_prefixes))
                   ORDER BY coalesce(t.lease_expiry, t.scheduled_for) LIMIT 1) IS NOT NULL) THEN
        v_with_work := v_with_work || 'perspective_event'::text;
    END IF;
    IF 'receptor' = ANY (v_categories)
       AND workpump.any_topic_chosen(v_receptor_topics, v_receptor_prefixes) AND (
        (SELECT 1 FROM workpump_receptor_processing t
                WHERE t.completed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                  AND t.instance_id IS NULL AND t.scheduled_for IS NULL
                  AND (v_receptor_topics IS NULL OR t.receptor_name = ANY (v_receptor_topics)
                       OR t.receptor_name ^@ ANY (v_receptor_prefixes))
                ORDER BY t.priority DESC, t.seq LIMIT 1) IS NOT NULL
        OR (SELECT 1 FROM workpump_receptor_processing t
                   WHERE t.completed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                     AND (t.instance_id IS NOT NULL OR t.scheduled_for IS NOT NULL)
                     AND coalesce(t.lease_expiry, t.scheduled_for) <= v_now
                     AND (v_receptor_topics IS NULL OR t.receptor_name = ANY (v_receptor_topics)
                       OR t.receptor_name ^@ ANY (v_receptor_prefixes))
                   ORDER BY coalesce(t.lease_expiry, t.scheduled_for) LIMIT 1) IS NOT NULL) THEN
        v_with_work := v_with_work || 'receptor'::text;
    END IF;
    IF cardinality(v_with_work) = 0 THEN
        RETURN;
    END IF;

    -- My rank among live instances (myself always counted as live).
    SELECT count(*)::integer, (count(*) FILTER (WHERE l.id < p_instance_id))::integer
    INTO v_live_count, v_rank
    FROM (
        SELECT workpump.live_instances(
                   v_now - make_interval(secs => p_stale_after_seconds),
                   v_now - make_interval(secs => p_definitively_dead_after_seconds)) AS id
        UNION
        SELECT p_instance_id
    ) l;

    -- The budget is shared among the categories with work, starting the round at a
    -- rotating category (a budget smaller than the categories starves none); leftovers
    -- go to those that filled their share.
    v_left := cardinality(v_with_work);
    v_start := nextval('workpump.claim_rotation_seq') % v_left;
    v_with_work := v_with_work[v_start + 1:] || v_with_work[:v_start];
    FOREACH v_category IN ARRAY v_with_work LOOP
        v_quota := ceil(v_remaining::numeric / v_left)::integer;
        v_left := v_left - 1;
        CONTINUE WHEN v_quota <= 0;
        v_rows := CASE v_category
            WHEN 'outbox' THEN ARRAY(SELECT w FROM workpump.claim_outbox(
                p_instance_id, v_quota, p_lease_seconds, v_rank, v_live_count,
                v_outbox_topics, v_now, v_outbox_prefixes,
                p_stream_run_max) w)
            WHEN 'inbox' THEN ARRAY(SELECT w FROM workpump.claim_inbox(
                p_instance_id, v_quota, p_lease_seconds, v_rank, v_live_count,
                v_inbox_topics, v_now, v_inbox_prefixes,
                p_stream_run_max) w)
            WHEN 'perspective_event' THEN ARRAY(SELECT w FROM workpump.claim_perspective_event(
                p_instance_id, v_quota, p_lease_seconds, v_rank, v_live_count,
                v_perspective_topics, v_now, v_perspective_prefixes,
                p_stream_run_max) w)
            ELSE ARRAY(SELECT w FROM workpump.claim_receptor(
                p_instance_id, v_quota, p_lease_seconds, v_rank, v_live_count,
                v_receptor_topics, v_now, v_receptor_prefixes,
                p_stream_run_max) w)
        END;
        v_count := coalesce(cardinality(v_rows), 0);
        v_remaining := v_remaining - v_count;
        IF v_count >= v_quota THEN
            v_full := v_full || v_category;
        END IF;
        RETURN QUERY SELECT w.*, v_count >= v_quota FROM unnest(v_rows) w;
    END LOOP;
    FOREACH v_category IN ARRAY v_full LOOP
        IF v_remaining <= 0 THEN
            v_any_more := true;
            EXIT;
        END IF;
        v_quota := v_remaining;
        v_rows := CASE v_category
            WHEN 'outbox' THEN ARRAY(SELECT w FROM workpump.claim_outbox(
                p_instance_id, v_quota, p_lease_seconds, v_rank, v_live_count,
                v_outbox_topics, v_now, v_outbox_prefixes,
                p_stream_run_max) w)
            WHEN 'inbox' THEN ARRAY(SELECT w FROM workpump.claim_inbox(
                p_instance_id, v_quota, p_lease_seconds, v_rank, v_live_count,
                v_inbox_topics, v_now, v_inbox_prefixes,
                p_stream_run_max) w)
            WHEN 'perspective_event' THEN ARRAY(SELECT w FROM workpump.claim_perspective_event(
                p_instance_id, v_quota, p_lease_seconds, v_rank, v_live_count,
                v_perspective_topics, v_now, v_perspective_prefixes,
                p_stream_run_max) w)
            ELSE ARRAY(SELECT w FROM workpump.claim_receptor(
                p_instance_id, v_quota, p_lease_seconds, v_rank, v_live_count,
                v_receptor_topics, v_now, v_receptor_prefixes,
                p_stream_run_max) w)
        END;
        v_count := coalesce(cardinality(v_rows), 0);
        v_remaining := v_remaining - v_count;
        v_any_more := v_any_more OR v_count >= v_quota;
        RETURN QUERY SELECT w.*, v_count >= v_quota FROM unnest(v_rows) w;
    END LOOP;
    IF v_any_more THEN
        RAISE NOTICE 'workpump.has_more=true';
    END IF;
END
$$;
