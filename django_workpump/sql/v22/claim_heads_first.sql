-- Schema version 22: the claim statements lease the heads first, and look for runs
-- only when an ordered stream's head was leased.
--
-- Each claim_<category> ran one statement that found the heads, their runs (the rows
-- that follow a stream head) and the streams to own, whether or not any head had a
-- stream. Its run and ownership parts, never executed for a row without a stream, were
-- still set up and torn down on every call, and on the idle server backend a NOTIFY
-- wake-up meets that is most of their cost. The heads are now leased by a statement of
-- their own; the runs and the owned streams by a second, only when one of the leased
-- heads has a stream. One row sent 20 ms before each one-row claim, the versions
-- interleaved in one database (PostgreSQL 18): 1.41 to 1.24 ms at the median for a row
-- without a stream, 1.42 to 1.55 ms for a stream head. The same rows are leased, with
-- the same budget, and returned in the same order.

-- The outbox claim: rows of workpump.send, whose topic is the destination.
-- Lease up to p_limit claimable rows of the topics in p_topics (NULL: any), or of a topic
-- starting with one of p_topic_prefixes, to p_instance_id until p_now + p_lease_seconds,
-- each with a new lease token; rows whose attempts are used up are parked as dead instead.
-- Each row comes with its created_at and due_at (see claim_work). Called by
-- claim_work, which checks the instance and the input and computes p_rank and
-- p_live_count.
CREATE OR REPLACE FUNCTION workpump.claim_outbox(
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
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_lease_expiry timestamptz := v_now + make_interval(secs => p_lease_seconds);
    v_heads workpump.leased_work[];  -- the heads leased, in the order they are returned
    v_head workpump.leased_work;
    v_head_seqs bigint[];  -- their seqs, in the same order
    v_stream_seqs bigint[];  -- of those, the heads of ordered streams, and their passes
    v_stream_passes integer[];
BEGIN
    -- The heads: locked and leased (or parked as dead) in one statement; what is
    -- returned, and what their runs need, is kept in arrays.
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
                  t.created_at, c.due_at, c.pass
    )
    SELECT coalesce(array_agg(ROW(
               'outbox'::text, c.work_id, c.topic, c.payload, c.stream, c.attempts,
               c.max_attempts, c.lease_expiry, c.event_id, NULL::text, c.priority::integer,
               c.claimed_at, c.lease_token, c.headers, c.created_at, c.due_at
               )::workpump.leased_work ORDER BY c.pass, c.priority DESC, c.seq)
               FILTER (WHERE NOT c.dead), '{}'),
           coalesce(array_agg(c.seq ORDER BY c.pass, c.priority DESC, c.seq)
               FILTER (WHERE NOT c.dead), '{}'),
           array_agg(c.seq ORDER BY c.pass, c.priority DESC, c.seq)
               FILTER (WHERE NOT c.dead AND c.stream IS NOT NULL),
           array_agg(c.pass ORDER BY c.pass, c.priority DESC, c.seq)
               FILTER (WHERE NOT c.dead AND c.stream IS NOT NULL)
    INTO v_heads, v_head_seqs, v_stream_seqs, v_stream_passes
    FROM claimed_heads c;
    IF v_stream_seqs IS NULL THEN
        -- No ordered stream among them: no run to add and no stream to own, so the
        -- statement below (a fifth of a one-row claim, cold) is not run.
        FOREACH v_head IN ARRAY v_heads LOOP
            RETURN NEXT v_head;
        END LOOP;
        RETURN;
    END IF;

    -- The runs of the stream heads, and the streams this instance now owns.
    RETURN QUERY
    WITH
    -- heads: the leased heads of ordered streams, with what their runs need
    heads AS MATERIALIZED (
        SELECT t.seq, u.pass, t.priority AS run_priority, t.stream AS run_stream,
               ''::text AS run_scope, t.partition_number
        FROM unnest(v_stream_seqs, v_stream_passes) u(seq, pass)
        JOIN workpump_outbox t ON t.seq = u.seq
    ),
    -- run_budget: the rows the heads left in the budget, and how many runs share them
    run_budget AS MATERIALIZED (
        SELECT greatest(p_limit - cardinality(v_heads), 0) AS rows_left,
               cardinality(v_stream_seqs) AS runs
    ),
    -- upcoming: with p_run_max > 1, the undone rows that follow each stream head,
    -- in stream order, no more per head than its share of the budget
    upcoming AS MATERIALIZED (
        SELECT c.seq AS head_seq, n.seq,
               row_number() OVER (PARTITION BY c.seq ORDER BY n.seq) AS position
        FROM heads c
        CROSS JOIN run_budget b
        CROSS JOIN LATERAL (
            SELECT n.seq FROM workpump_outbox n
            WHERE n.stream = c.run_stream AND n.processed_at IS NULL
              AND n.stream IS NOT NULL AND n.seq > c.seq
            ORDER BY n.stream, n.seq
            LIMIT least(p_run_max - 1, ceil(b.rows_left::numeric / greatest(b.runs, 1)))
        ) n
        WHERE p_run_max > 1 AND b.rows_left > 0
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
        JOIN heads c ON c.seq = r.head_seq
        WHERE r.in_run
        ORDER BY r.position, c.pass, c.run_priority DESC, c.seq
        LIMIT (SELECT b.rows_left FROM run_budget b)
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
                  t.created_at, c.due_at, c.run_seq
    ),
    -- pinned: the claimer owns each ordered stream it now works on (sorted: one lock
    -- order for all claimers)
    pinned AS (
        INSERT INTO workpump_active_stream AS s
            (category, scope, stream, partition_number, owner_instance_id, lease_expiry,
             created_at, last_activity_at)
        SELECT DISTINCT ON (c.run_scope, c.run_stream)
               'outbox', c.run_scope, c.run_stream, c.partition_number, p_instance_id,
               v_lease_expiry, v_now, v_now
        FROM heads c
        ORDER BY c.run_scope, c.run_stream
        ON CONFLICT (category, scope, stream) DO UPDATE
            SET owner_instance_id = excluded.owner_instance_id,
                lease_expiry = excluded.lease_expiry,
                last_activity_at = excluded.last_activity_at
    )
    -- the heads as leased above, each run right after its head, in stream order
    SELECT o.category, o.work_id, o.topic, o.payload, o.stream, o.attempts, o.max_attempts,
           o.lease_expiry, o.event_id, o.event_type, o.priority, o.claimed_at,
           o.lease_token, o.headers, o.created_at, o.due_at
    FROM (
        SELECT h.*, h.seq_position AS run_position, 0::bigint AS seq
        FROM unnest(v_heads) WITH ORDINALITY h(category, work_id, topic, payload, stream,
             attempts, max_attempts, lease_expiry, event_id, event_type, priority,
             claimed_at, lease_token, headers, created_at, due_at, seq_position)
        UNION ALL
        SELECT 'outbox'::text, r.work_id, r.topic, r.payload, r.stream, r.attempts,
               r.max_attempts, r.lease_expiry, r.event_id, NULL::text, r.priority::integer,
               r.claimed_at, r.lease_token, r.headers, r.created_at, r.due_at, p.position,
               p.position, r.seq
        FROM claimed_runs r
        JOIN unnest(v_head_seqs) WITH ORDINALITY p(seq, position) ON p.seq = r.run_seq
        WHERE NOT r.dead
    ) o
    ORDER BY o.run_position, o.seq;
END
$$;

-- The inbox claim: rows of workpump.receive, whose topic is the handler_name.
-- Lease up to p_limit claimable rows of the topics in p_topics (NULL: any), or of a topic
-- starting with one of p_topic_prefixes, to p_instance_id until p_now + p_lease_seconds,
-- each with a new lease token; rows whose attempts are used up are parked as dead instead.
-- Each row comes with its created_at and due_at (see claim_work). Called by
-- claim_work, which checks the instance and the input and computes p_rank and
-- p_live_count.
CREATE OR REPLACE FUNCTION workpump.claim_inbox(
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
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_lease_expiry timestamptz := v_now + make_interval(secs => p_lease_seconds);
    v_heads workpump.leased_work[];  -- the heads leased, in the order they are returned
    v_head workpump.leased_work;
    v_head_seqs bigint[];  -- their seqs, in the same order
    v_stream_seqs bigint[];  -- of those, the heads of ordered streams, and their passes
    v_stream_passes integer[];
BEGIN
    -- The heads: locked and leased (or parked as dead) in one statement; what is
    -- returned, and what their runs need, is kept in arrays.
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
                  t.created_at, c.due_at, c.pass
    )
    SELECT coalesce(array_agg(ROW(
               'inbox'::text, c.work_id, c.topic, c.payload, c.stream, c.attempts,
               c.max_attempts, c.lease_expiry, c.event_id, NULL::text, c.priority::integer,
               c.claimed_at, c.lease_token, c.headers, c.created_at, c.due_at
               )::workpump.leased_work ORDER BY c.pass, c.priority DESC, c.seq)
               FILTER (WHERE NOT c.dead), '{}'),
           coalesce(array_agg(c.seq ORDER BY c.pass, c.priority DESC, c.seq)
               FILTER (WHERE NOT c.dead), '{}'),
           array_agg(c.seq ORDER BY c.pass, c.priority DESC, c.seq)
               FILTER (WHERE NOT c.dead AND c.stream IS NOT NULL),
           array_agg(c.pass ORDER BY c.pass, c.priority DESC, c.seq)
               FILTER (WHERE NOT c.dead AND c.stream IS NOT NULL)
    INTO v_heads, v_head_seqs, v_stream_seqs, v_stream_passes
    FROM claimed_heads c;
    IF v_stream_seqs IS NULL THEN
        -- No ordered stream among them: no run to add and no stream to own, so the
        -- statement below (a fifth of a one-row claim, cold) is not run.
        FOREACH v_head IN ARRAY v_heads LOOP
            RETURN NEXT v_head;
        END LOOP;
        RETURN;
    END IF;

    -- The runs of the stream heads, and the streams this instance now owns.
    RETURN QUERY
    WITH
    -- heads: the leased heads of ordered streams, with what their runs need
    heads AS MATERIALIZED (
        SELECT t.seq, u.pass, t.priority AS run_priority, t.stream AS run_stream,
               ''::text AS run_scope, t.partition_number
        FROM unnest(v_stream_seqs, v_stream_passes) u(seq, pass)
        JOIN workpump_inbox t ON t.seq = u.seq
    ),
    -- run_budget: the rows the heads left in the budget, and how many runs share them
    run_budget AS MATERIALIZED (
        SELECT greatest(p_limit - cardinality(v_heads), 0) AS rows_left,
               cardinality(v_stream_seqs) AS runs
    ),
    -- upcoming: with p_run_max > 1, the undone rows that follow each stream head,
    -- in stream order, no more per head than its share of the budget
    upcoming AS MATERIALIZED (
        SELECT c.seq AS head_seq, n.seq,
               row_number() OVER (PARTITION BY c.seq ORDER BY n.seq) AS position
        FROM heads c
        CROSS JOIN run_budget b
        CROSS JOIN LATERAL (
            SELECT n.seq FROM workpump_inbox n
            WHERE n.stream = c.run_stream AND n.processed_at IS NULL
              AND n.stream IS NOT NULL AND n.seq > c.seq
            ORDER BY n.stream, n.seq
            LIMIT least(p_run_max - 1, ceil(b.rows_left::numeric / greatest(b.runs, 1)))
        ) n
        WHERE p_run_max > 1 AND b.rows_left > 0
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
        JOIN heads c ON c.seq = r.head_seq
        WHERE r.in_run
        ORDER BY r.position, c.pass, c.run_priority DESC, c.seq
        LIMIT (SELECT b.rows_left FROM run_budget b)
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
                  t.created_at, c.due_at, c.run_seq
    ),
    -- pinned: the claimer owns each ordered stream it now works on (sorted: one lock
    -- order for all claimers)
    pinned AS (
        INSERT INTO workpump_active_stream AS s
            (category, scope, stream, partition_number, owner_instance_id, lease_expiry,
             created_at, last_activity_at)
        SELECT DISTINCT ON (c.run_scope, c.run_stream)
               'inbox', c.run_scope, c.run_stream, c.partition_number, p_instance_id,
               v_lease_expiry, v_now, v_now
        FROM heads c
        ORDER BY c.run_scope, c.run_stream
        ON CONFLICT (category, scope, stream) DO UPDATE
            SET owner_instance_id = excluded.owner_instance_id,
                lease_expiry = excluded.lease_expiry,
                last_activity_at = excluded.last_activity_at
    )
    -- the heads as leased above, each run right after its head, in stream order
    SELECT o.category, o.work_id, o.topic, o.payload, o.stream, o.attempts, o.max_attempts,
           o.lease_expiry, o.event_id, o.event_type, o.priority, o.claimed_at,
           o.lease_token, o.headers, o.created_at, o.due_at
    FROM (
        SELECT h.*, h.seq_position AS run_position, 0::bigint AS seq
        FROM unnest(v_heads) WITH ORDINALITY h(category, work_id, topic, payload, stream,
             attempts, max_attempts, lease_expiry, event_id, event_type, priority,
             claimed_at, lease_token, headers, created_at, due_at, seq_position)
        UNION ALL
        SELECT 'inbox'::text, r.work_id, r.topic, r.payload, r.stream, r.attempts,
               r.max_attempts, r.lease_expiry, r.event_id, NULL::text, r.priority::integer,
               r.claimed_at, r.lease_token, r.headers, r.created_at, r.due_at, p.position,
               p.position, r.seq
        FROM claimed_runs r
        JOIN unnest(v_head_seqs) WITH ORDINALITY p(seq, position) ON p.seq = r.run_seq
        WHERE NOT r.dead
    ) o
    ORDER BY o.run_position, o.seq;
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
CREATE OR REPLACE FUNCTION workpump.claim_perspective_event(
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
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_lease_expiry timestamptz := v_now + make_interval(secs => p_lease_seconds);
    v_heads workpump.leased_work[];  -- the heads leased, in the order they are returned
    v_head workpump.leased_work;
    v_head_seqs bigint[];  -- their seqs, in the same order
    v_stream_seqs bigint[];  -- of those, the heads of ordered streams, and their passes
    v_stream_passes integer[];
BEGIN
    -- The heads: locked and leased (or parked as dead) in one statement; what is
    -- returned, and what their runs need, is kept in arrays.
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
                  t.created_at, c.due_at, c.pass
    )
    SELECT coalesce(array_agg(ROW(
               'perspective_event'::text, c.work_id, c.topic, e.payload, c.stream,
               c.attempts, c.max_attempts, c.lease_expiry, c.event_id, e.event_type,
               c.priority::integer, c.claimed_at, c.lease_token, c.headers, c.created_at,
               c.due_at
               )::workpump.leased_work ORDER BY c.pass, c.priority DESC, c.seq)
               FILTER (WHERE NOT c.dead), '{}'),
           coalesce(array_agg(c.seq ORDER BY c.pass, c.priority DESC, c.seq)
               FILTER (WHERE NOT c.dead), '{}'),
           array_agg(c.seq ORDER BY c.pass, c.priority DESC, c.seq)
               FILTER (WHERE NOT c.dead AND c.stream IS NOT NULL),
           array_agg(c.pass ORDER BY c.pass, c.priority DESC, c.seq)
               FILTER (WHERE NOT c.dead AND c.stream IS NOT NULL)
    INTO v_heads, v_head_seqs, v_stream_seqs, v_stream_passes
    FROM claimed_heads c
    JOIN workpump_event e ON e.event_id = c.event_id;
    IF v_stream_seqs IS NULL THEN
        -- No ordered stream among them: no run to add and no stream to own, so the
        -- statement below (a fifth of a one-row claim, cold) is not run.
        FOREACH v_head IN ARRAY v_heads LOOP
            RETURN NEXT v_head;
        END LOOP;
        RETURN;
    END IF;

    -- The runs of the stream heads, and the streams this instance now owns.
    RETURN QUERY
    WITH
    -- heads: the leased heads of ordered streams, with what their runs need
    heads AS MATERIALIZED (
        SELECT t.seq, u.pass, t.priority AS run_priority, t.stream AS run_stream,
               t.perspective_name AS run_scope, t.partition_number
        FROM unnest(v_stream_seqs, v_stream_passes) u(seq, pass)
        JOIN workpump_perspective_event t ON t.seq = u.seq
    ),
    -- run_budget: the rows the heads left in the budget, and how many runs share them
    run_budget AS MATERIALIZED (
        SELECT greatest(p_limit - cardinality(v_heads), 0) AS rows_left,
               cardinality(v_stream_seqs) AS runs
    ),
    -- upcoming: with p_run_max > 1, the undone rows that follow each stream head,
    -- in stream order, no more per head than its share of the budget
    upcoming AS MATERIALIZED (
        SELECT c.seq AS head_seq, n.seq,
               row_number() OVER (PARTITION BY c.seq ORDER BY n.seq) AS position
        FROM heads c
        CROSS JOIN run_budget b
        CROSS JOIN LATERAL (
            SELECT n.seq FROM workpump_perspective_event n
            WHERE n.perspective_name = c.run_scope AND n.stream = c.run_stream AND n.processed_at IS NULL
              AND n.stream IS NOT NULL AND n.seq > c.seq
            ORDER BY n.perspective_name, n.stream, n.seq
            LIMIT least(p_run_max - 1, ceil(b.rows_left::numeric / greatest(b.runs, 1)))
        ) n
        WHERE p_run_max > 1 AND b.rows_left > 0
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
        JOIN heads c ON c.seq = r.head_seq
        WHERE r.in_run
        ORDER BY r.position, c.pass, c.run_priority DESC, c.seq
        LIMIT (SELECT b.rows_left FROM run_budget b)
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
                  t.created_at, c.due_at, c.run_seq
    ),
    -- pinned: the claimer owns each ordered stream it now works on (sorted: one lock
    -- order for all claimers)
    pinned AS (
        INSERT INTO workpump_active_stream AS s
            (category, scope, stream, partition_number, owner_instance_id, lease_expiry,
             created_at, last_activity_at)
        SELECT DISTINCT ON (c.run_scope, c.run_stream)
               'perspective_event', c.run_scope, c.run_stream, c.partition_number, p_instance_id,
               v_lease_expiry, v_now, v_now
        FROM heads c
        ORDER BY c.run_scope, c.run_stream
        ON CONFLICT (category, scope, stream) DO UPDATE
            SET owner_instance_id = excluded.owner_instance_id,
                lease_expiry = excluded.lease_expiry,
                last_activity_at = excluded.last_activity_at
    )
    -- the heads as leased above, each run right after its head, in stream order
    SELECT o.category, o.work_id, o.topic, o.payload, o.stream, o.attempts, o.max_attempts,
           o.lease_expiry, o.event_id, o.event_type, o.priority, o.claimed_at,
           o.lease_token, o.headers, o.created_at, o.due_at
    FROM (
        SELECT h.*, h.seq_position AS run_position, 0::bigint AS seq
        FROM unnest(v_heads) WITH ORDINALITY h(category, work_id, topic, payload, stream,
             attempts, max_attempts, lease_expiry, event_id, event_type, priority,
             claimed_at, lease_token, headers, created_at, due_at, seq_position)
        UNION ALL
        SELECT 'perspective_event'::text, r.work_id, r.topic, e.payload, r.stream,
               r.attempts, r.max_attempts, r.lease_expiry, r.event_id, e.event_type,
               r.priority::integer, r.claimed_at, r.lease_token, r.headers, r.created_at,
               r.due_at, p.position, p.position, r.seq
        FROM claimed_runs r
        JOIN workpump_event e ON e.event_id = r.event_id
        JOIN unnest(v_head_seqs) WITH ORDINALITY p(seq, position) ON p.seq = r.run_seq
        WHERE NOT r.dead
    ) o
    ORDER BY o.run_position, o.seq;
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
CREATE OR REPLACE FUNCTION workpump.claim_receptor(
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
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_lease_expiry timestamptz := v_now + make_interval(secs => p_lease_seconds);
    v_heads workpump.leased_work[];  -- the heads leased, in the order they are returned
    v_head workpump.leased_work;
    v_head_seqs bigint[];  -- their seqs, in the same order
    v_stream_seqs bigint[];  -- of those, the heads of ordered streams, and their passes
    v_stream_passes integer[];
BEGIN
    -- The heads: locked and leased (or parked as dead) in one statement; what is
    -- returned, and what their runs need, is kept in arrays.
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
                  t.created_at, c.due_at, c.pass
    )
    SELECT coalesce(array_agg(ROW(
               'receptor'::text, c.work_id, c.topic, e.payload, c.stream, c.attempts,
               c.max_attempts, c.lease_expiry, c.event_id, e.event_type,
               c.priority::integer, c.claimed_at, c.lease_token, c.headers, c.created_at,
               c.due_at
               )::workpump.leased_work ORDER BY c.pass, c.priority DESC, c.seq)
               FILTER (WHERE NOT c.dead), '{}'),
           coalesce(array_agg(c.seq ORDER BY c.pass, c.priority DESC, c.seq)
               FILTER (WHERE NOT c.dead), '{}'),
           array_agg(c.seq ORDER BY c.pass, c.priority DESC, c.seq)
               FILTER (WHERE NOT c.dead AND c.stream IS NOT NULL),
           array_agg(c.pass ORDER BY c.pass, c.priority DESC, c.seq)
               FILTER (WHERE NOT c.dead AND c.stream IS NOT NULL)
    INTO v_heads, v_head_seqs, v_stream_seqs, v_stream_passes
    FROM claimed_heads c
    JOIN workpump_event e ON e.event_id = c.event_id;
    IF v_stream_seqs IS NULL THEN
        -- No ordered stream among them: no run to add and no stream to own, so the
        -- statement below (a fifth of a one-row claim, cold) is not run.
        FOREACH v_head IN ARRAY v_heads LOOP
            RETURN NEXT v_head;
        END LOOP;
        RETURN;
    END IF;

    -- The runs of the stream heads, and the streams this instance now owns.
    RETURN QUERY
    WITH
    -- heads: the leased heads of ordered streams, with what their runs need
    heads AS MATERIALIZED (
        SELECT t.seq, u.pass, t.priority AS run_priority, t.stream AS run_stream,
               t.receptor_name AS run_scope, t.partition_number
        FROM unnest(v_stream_seqs, v_stream_passes) u(seq, pass)
        JOIN workpump_receptor_processing t ON t.seq = u.seq
    ),
    -- run_budget: the rows the heads left in the budget, and how many runs share them
    run_budget AS MATERIALIZED (
        SELECT greatest(p_limit - cardinality(v_heads), 0) AS rows_left,
               cardinality(v_stream_seqs) AS runs
    ),
    -- upcoming: with p_run_max > 1, the undone rows that follow each stream head,
    -- in stream order, no more per head than its share of the budget
    upcoming AS MATERIALIZED (
        SELECT c.seq AS head_seq, n.seq,
               row_number() OVER (PARTITION BY c.seq ORDER BY n.seq) AS position
        FROM heads c
        CROSS JOIN run_budget b
        CROSS JOIN LATERAL (
            SELECT n.seq FROM workpump_receptor_processing n
            WHERE n.receptor_name = c.run_scope AND n.stream = c.run_stream AND n.completed_at IS NULL
              AND n.stream IS NOT NULL AND n.seq > c.seq
            ORDER BY n.receptor_name, n.stream, n.seq
            LIMIT least(p_run_max - 1, ceil(b.rows_left::numeric / greatest(b.runs, 1)))
        ) n
        WHERE p_run_max > 1 AND b.rows_left > 0
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
        JOIN heads c ON c.seq = r.head_seq
        WHERE r.in_run
        ORDER BY r.position, c.pass, c.run_priority DESC, c.seq
        LIMIT (SELECT b.rows_left FROM run_budget b)
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
                  t.created_at, c.due_at, c.run_seq
    ),
    -- pinned: the claimer owns each ordered stream it now works on (sorted: one lock
    -- order for all claimers)
    pinned AS (
        INSERT INTO workpump_active_stream AS s
            (category, scope, stream, partition_number, owner_instance_id, lease_expiry,
             created_at, last_activity_at)
        SELECT DISTINCT ON (c.run_scope, c.run_stream)
               'receptor', c.run_scope, c.run_stream, c.partition_number, p_instance_id,
               v_lease_expiry, v_now, v_now
        FROM heads c
        ORDER BY c.run_scope, c.run_stream
        ON CONFLICT (category, scope, stream) DO UPDATE
            SET owner_instance_id = excluded.owner_instance_id,
                lease_expiry = excluded.lease_expiry,
                last_activity_at = excluded.last_activity_at
    )
    -- the heads as leased above, each run right after its head, in stream order
    SELECT o.category, o.work_id, o.topic, o.payload, o.stream, o.attempts, o.max_attempts,
           o.lease_expiry, o.event_id, o.event_type, o.priority, o.claimed_at,
           o.lease_token, o.headers, o.created_at, o.due_at
    FROM (
        SELECT h.*, h.seq_position AS run_position, 0::bigint AS seq
        FROM unnest(v_heads) WITH ORDINALITY h(category, work_id, topic, payload, stream,
             attempts, max_attempts, lease_expiry, event_id, event_type, priority,
             claimed_at, lease_token, headers, created_at, due_at, seq_position)
        UNION ALL
        SELECT 'receptor'::text, r.work_id, r.topic, e.payload, r.stream, r.attempts,
               r.max_attempts, r.lease_expiry, r.event_id, e.event_type,
               r.priority::integer, r.claimed_at, r.lease_token, r.headers, r.created_at,
               r.due_at, p.position, p.position, r.seq
        FROM claimed_runs r
        JOIN workpump_event e ON e.event_id = r.event_id
        JOIN unnest(v_head_seqs) WITH ORDINALITY p(seq, position) ON p.seq = r.run_seq
        WHERE NOT r.dead
    ) o
    ORDER BY o.run_position, o.seq;
END
$$;
