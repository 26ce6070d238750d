-- Claiming (docs/architecture.md, Claiming).
--
-- A row is claimable iff it is its stream's head, not done, not dead, and either ready
-- (unowned, not scheduled) or its timer passed (lease expired, or retry/deferral due).
-- Ready rows are found through the _ready index, timers through the _timer index; both are
-- partial indexes whose predicates the queries below repeat word for word.

CREATE TYPE workpump.claimed_work AS (
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
    claimed_at timestamptz
);

-- Lease up to p_limit claimable rows of one category to p_instance_id, in three passes:
-- expired leases and due timers first, then ready rows of this instance's partition
-- share, then (only if the budget is not used up) ready rows of anyone's share.
-- Rows that already used max_attempts are dead-lettered instead of leased.
CREATE FUNCTION workpump.claim_category(
    p_category text,
    p_instance_id uuid,
    p_limit integer,
    p_lease_expiry timestamptz,
    p_now timestamptz,
    p_rank integer DEFAULT 0,
    p_live_count integer DEFAULT 1
) RETURNS SETOF workpump.claimed_work
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_has_event boolean := v_meta.scope_col IS NOT NULL;
    v_candidates text[];
    v_candidate text;
    v_statement text;
    v_remaining integer := p_limit;
    v_count integer;
BEGIN
    v_candidates := ARRAY[
        -- timers: leases that expired, retries and deferrals that fell due
        format($q$
            SELECT t.seq FROM %1$I t
            WHERE t.%2$I IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
              AND (t.instance_id IS NOT NULL OR t.scheduled_for IS NOT NULL)
              AND coalesce(t.lease_expiry, t.scheduled_for) <= $4
            ORDER BY coalesce(t.lease_expiry, t.scheduled_for)
            LIMIT $2
            FOR UPDATE OF t SKIP LOCKED$q$, v_meta.tbl, v_meta.done_col)
    ];
    IF p_live_count > 1 THEN
        -- this instance's share: partition_number mod live_count = rank
        v_candidates := v_candidates || format($q$
            SELECT t.seq FROM %1$I t
            WHERE t.%2$I IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
              AND t.instance_id IS NULL AND t.scheduled_for IS NULL
              AND t.partition_number %% $6 = $5
            ORDER BY t.priority DESC, t.seq
            LIMIT $2
            FOR UPDATE OF t SKIP LOCKED$q$, v_meta.tbl, v_meta.done_col);
    END IF;
    -- anyone's share: no row waits on a busy peer
    v_candidates := v_candidates || format($q$
        SELECT t.seq FROM %1$I t
        WHERE t.%2$I IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
          AND t.instance_id IS NULL AND t.scheduled_for IS NULL
        ORDER BY t.priority DESC, t.seq
        LIMIT $2
        FOR UPDATE OF t SKIP LOCKED$q$, v_meta.tbl, v_meta.done_col);

    FOREACH v_candidate IN ARRAY v_candidates LOOP
        EXIT WHEN v_remaining <= 0;
        v_statement := format($q$
            WITH cand AS (%1$s),
            claimed AS (
                -- lease each candidate (one attempt more), or park it when its attempts
                -- are used up; an expired lease taken over is stamped as an attempt
                -- that ended without an outcome
                UPDATE %2$I t SET
                    attempts = t.attempts + (t.attempts < t.max_attempts)::integer,
                    instance_id = CASE WHEN t.attempts < t.max_attempts THEN $1 END,
                    lease_expiry = CASE WHEN t.attempts < t.max_attempts THEN $3 END,
                    claimed_at = CASE WHEN t.attempts < t.max_attempts THEN $4 END,
                    dead_lettered_at = CASE WHEN t.attempts >= t.max_attempts THEN $4 END,
                    lease_renewals = 0,
                    scheduled_for = NULL,
                    failure_reason = CASE
                        WHEN t.attempts >= t.max_attempts THEN 'max_attempts'
                        WHEN t.instance_id IS NOT NULL THEN 'lease_expired'
                        ELSE t.failure_reason END,
                    last_error = CASE
                        WHEN t.instance_id IS NOT NULL THEN format(
                            'attempt %%s ended without a reported outcome: the lease of instance %%s expired at %%s',
                            t.attempts, t.instance_id, t.lease_expiry)
                        ELSE t.last_error END
                FROM cand WHERE t.seq = cand.seq
                RETURNING t.seq, t.%3$I AS work_id, t.%4$I AS topic, %5$s AS payload,
                          t.stream, %6$s AS scope, t.partition_number, t.attempts,
                          t.max_attempts, t.lease_expiry, %7$s AS event_id, t.priority,
                          t.claimed_at, t.dead_lettered_at IS NOT NULL AS dead
            ),
            pinned AS (
                -- the claimer owns each ordered stream it now works on (sorted: one
                -- lock order for all claimers)
                INSERT INTO workpump_active_stream AS s
                    (category, scope, stream, partition_number, owner_instance_id,
                     lease_expiry, created_at, last_activity_at)
                SELECT DISTINCT ON (c.scope, c.stream)
                       $7, c.scope, c.stream, c.partition_number, $1, $3, $4, $4
                FROM claimed c
                WHERE c.stream IS NOT NULL AND NOT c.dead
                ORDER BY c.scope, c.stream
                ON CONFLICT (category, scope, stream) DO UPDATE
                    SET owner_instance_id = excluded.owner_instance_id,
                        lease_expiry = excluded.lease_expiry,
                        last_activity_at = excluded.last_activity_at
            )
            SELECT $7::text, c.work_id, c.topic, %8$s, c.stream, c.attempts, c.max_attempts,
                   c.lease_expiry, c.event_id, %9$s, c.priority::integer, c.claimed_at
            FROM claimed c %10$s
            WHERE NOT c.dead
            ORDER BY c.priority DESC, c.seq$q$,
            v_candidate,
            v_meta.tbl,
            v_meta.key_col,
            v_meta.topic_col,
            CASE WHEN v_has_event THEN 'NULL::jsonb' ELSE 't.payload' END,
            CASE WHEN v_has_event THEN 't.' || quote_ident(v_meta.scope_col) ELSE '''''' END,
            CASE WHEN v_has_event THEN 't.event_id' ELSE 'NULL::uuid' END,
            CASE WHEN v_has_event THEN 'e.payload' ELSE 'c.payload' END,
            CASE WHEN v_has_event THEN 'e.event_type' ELSE 'NULL::text' END,
            CASE WHEN v_has_event THEN 'JOIN workpump_event e ON e.event_id = c.event_id'
                 ELSE '' END);
        RETURN QUERY EXECUTE v_statement
            USING p_instance_id, v_remaining, p_lease_expiry, p_now, p_rank, p_live_count,
                  p_category;
        GET DIAGNOSTICS v_count = ROW_COUNT;
        v_remaining := v_remaining - v_count;
    END LOOP;
END
$$;

-- Lease up to p_max_rows claimable rows of the given categories (all when NULL) to
-- p_instance_id for p_lease_seconds. A category is only claimed from when its two
-- index probes find something, so an idle system costs a few probes and no writes.
-- has_more is true on the rows of a category that filled its share of the budget (the
-- caller should poll again at once); a NOTICE 'workpump.has_more=true' says the same.
CREATE FUNCTION workpump.claim_work(
    p_instance_id uuid,
    p_max_rows integer DEFAULT 100,
    p_lease_seconds integer DEFAULT 300,
    p_partition_count integer DEFAULT 10000,
    p_categories text[] DEFAULT NULL,
    p_stale_after_seconds integer DEFAULT 30,
    p_definitively_dead_after_seconds integer DEFAULT 300,
    p_now timestamptz DEFAULT NULL
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
    v_with_work text[] := '{}';
    v_full text[] := '{}';
    v_rank integer;
    v_live_count integer;
    v_remaining integer := p_max_rows;
    v_left integer;
    v_quota integer;
    v_rows workpump.claimed_work[];
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
    IF p_partition_count IS NULL OR p_partition_count < 1 THEN
        RAISE EXCEPTION 'claim_work needs p_partition_count >= 1, not %.', coalesce(p_partition_count::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOREACH v_category IN ARRAY v_categories LOOP
        PERFORM workpump.check_category(v_category);
    END LOOP;

    -- Per-category guards: two index probes each (ready rows, due timers). The ORDER BY
    -- of each probe is its index's order: it keeps the planner on the partial index
    -- (an EXISTS may be planned as a scan of the whole table).
    IF 'outbox' = ANY (v_categories) AND (
        (SELECT 1 FROM workpump_outbox t
                WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                  AND t.instance_id IS NULL AND t.scheduled_for IS NULL
                ORDER BY t.priority DESC, t.seq LIMIT 1) IS NOT NULL
        OR (SELECT 1 FROM workpump_outbox t
                   WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                     AND (t.instance_id IS NOT NULL OR t.scheduled_for IS NOT NULL)
                     AND coalesce(t.lease_expiry, t.scheduled_for) <= v_now
                   ORDER BY coalesce(t.lease_expiry, t.scheduled_for) LIMIT 1) IS NOT NULL) THEN
        v_with_work := v_with_work || 'outbox'::text;
    END IF;
    IF 'inbox' = ANY (v_categories) AND (
        (SELECT 1 FROM workpump_inbox t
                WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                  AND t.instance_id IS NULL AND t.scheduled_for IS NULL
                ORDER BY t.priority DESC, t.seq LIMIT 1) IS NOT NULL
        OR (SELECT 1 FROM workpump_inbox t
                   WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                     AND (t.instance_id IS NOT NULL OR t.scheduled_for IS NOT NULL)
                     AND coalesce(t.lease_expiry, t.scheduled_for) <= v_now
                   ORDER BY coalesce(t.lease_expiry, t.scheduled_for) LIMIT 1) IS NOT NULL) THEN
        v_with_work := v_with_work || 'inbox'::text;
    END IF;
    IF 'perspective_event' = ANY (v_categories) AND (
        (SELECT 1 FROM workpump_perspective_event t
                WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                  AND t.instance_id IS NULL AND t.scheduled_for IS NULL
                ORDER BY t.priority DESC, t.seq LIMIT 1) IS NOT NULL
        OR (SELECT 1 FROM workpump_perspective_event t
                   WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                     AND (t.instance_id IS NOT NULL OR t.scheduled_for IS NOT NULL)
                     AND coalesce(t.lease_expiry, t.scheduled_for) <= v_now
                   ORDER BY coalesce(t.lease_expiry, t.scheduled_for) LIMIT 1) IS NOT NULL) THEN
        v_with_work := v_with_work || 'perspective_event'::text;
    END IF;
    IF 'receptor' = ANY (v_categories) AND (
        (SELECT 1 FROM workpump_receptor_processing t
                WHERE t.completed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                  AND t.instance_id IS NULL AND t.scheduled_for IS NULL
                ORDER BY t.priority DESC, t.seq LIMIT 1) IS NOT NULL
        OR (SELECT 1 FROM workpump_receptor_processing t
                   WHERE t.completed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                     AND (t.instance_id IS NOT NULL OR t.scheduled_for IS NOT NULL)
                     AND coalesce(t.lease_expiry, t.scheduled_for) <= v_now
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
        v_rows := ARRAY(SELECT w FROM workpump.claim_category(
            v_category, p_instance_id, v_quota,
            v_now + make_interval(secs => p_lease_seconds), v_now, v_rank, v_live_count) w);
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
        v_rows := ARRAY(SELECT w FROM workpump.claim_category(
            v_category, p_instance_id, v_quota,
            v_now + make_interval(secs => p_lease_seconds), v_now, v_rank, v_live_count) w);
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
