-- Housekeeping and operator actions (docs/admin.md). Maintenance deletes only
-- processed rows past retention: no row is ever deleted unprocessed.

-- Take the maintenance lock for this session; false when another instance runs it.
CREATE FUNCTION workpump.try_maintenance_lock() RETURNS boolean
LANGUAGE sql
SET search_path FROM CURRENT
AS $$ SELECT pg_try_advisory_lock(workpump.lock_namespace('maintenance'), 0); $$;

CREATE FUNCTION workpump.release_maintenance_lock() RETURNS boolean
LANGUAGE sql
SET search_path FROM CURRENT
AS $$ SELECT pg_advisory_unlock(workpump.lock_namespace('maintenance'), 0); $$;

-- Delete up to p_batch rows of a category processed before p_processed_before.
CREATE FUNCTION workpump.purge_processed(
    p_category text,
    p_processed_before timestamptz,
    p_batch integer DEFAULT 1000
) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_count integer;
BEGIN
    IF p_processed_before IS NULL OR p_batch IS NULL OR p_batch < 1 THEN
        RAISE EXCEPTION 'purge_processed needs p_processed_before and p_batch >= 1.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    EXECUTE format($q$
        DELETE FROM %1$I t WHERE t.seq IN (
            -- oldest processed rows first, through the _done index
            SELECT d.seq FROM %1$I d
            WHERE d.%2$I IS NOT NULL AND d.%2$I < $1
            ORDER BY d.%2$I LIMIT $2
            FOR UPDATE SKIP LOCKED)$q$,
        v_meta.tbl, v_meta.done_col)
    USING p_processed_before, p_batch;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

-- Delete up to p_batch events created before p_created_before that no work row points at.
CREATE FUNCTION workpump.purge_events(
    p_created_before timestamptz,
    p_batch integer DEFAULT 1000
) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_count integer;
BEGIN
    DELETE FROM workpump_event e WHERE e.seq IN (
        SELECT o.seq FROM workpump_event o
        WHERE o.created_at < p_created_before
          AND NOT EXISTS (SELECT 1 FROM workpump_perspective_event p WHERE p.event_id = o.event_id)
          AND NOT EXISTS (SELECT 1 FROM workpump_receptor_processing r WHERE r.event_id = o.event_id)
        ORDER BY o.created_at LIMIT p_batch
        FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

-- Delete tombstones older than p_evicted_before.
CREATE FUNCTION workpump.purge_evictions(p_evicted_before timestamptz) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_count integer;
BEGIN
    DELETE FROM workpump_eviction WHERE evicted_at < p_evicted_before;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

-- Delete stream-ownership rows that nobody owns and whose stream has no undone row.
CREATE FUNCTION workpump.purge_idle_streams(p_batch integer DEFAULT 1000) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_count integer;
BEGIN
    DELETE FROM workpump_active_stream s WHERE s.id IN (
        SELECT a.id FROM workpump_active_stream a
        WHERE a.owner_instance_id IS NULL
          AND NOT CASE a.category
              WHEN 'outbox' THEN EXISTS (SELECT 1 FROM workpump_outbox t
                  WHERE t.stream = a.stream AND t.processed_at IS NULL)
              WHEN 'inbox' THEN EXISTS (SELECT 1 FROM workpump_inbox t
                  WHERE t.stream = a.stream AND t.processed_at IS NULL)
              WHEN 'perspective_event' THEN EXISTS (SELECT 1 FROM workpump_perspective_event t
                  WHERE t.perspective_name = a.scope AND t.stream = a.stream
                    AND t.processed_at IS NULL)
              ELSE EXISTS (SELECT 1 FROM workpump_receptor_processing t
                  WHERE t.receptor_name = a.scope AND t.stream = a.stream
                    AND t.completed_at IS NULL)
          END
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

-- Operator actions. Each acts on undone rows only and returns the ids it changed.

-- Make scheduled (retry or deferred) rows claimable now.
CREATE FUNCTION workpump.retry_now(
    p_category text, p_ids uuid[], p_now timestamptz DEFAULT NULL
) RETURNS SETOF uuid
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
BEGIN
    PERFORM workpump.check_ids('retry_now', p_ids);
    RETURN QUERY EXECUTE format($q$
        UPDATE %1$I t SET scheduled_for = NULL
        WHERE t.%2$I = ANY ($1) AND t.%3$I IS NULL AND t.dead_lettered_at IS NULL
          AND t.instance_id IS NULL AND t.scheduled_for IS NOT NULL
        RETURNING t.%2$I$q$, v_meta.tbl, v_meta.key_col, v_meta.done_col)
    USING p_ids;
    IF FOUND THEN
        PERFORM pg_notify('workpump_' || p_category, p_category);
    END IF;
END
$$;

-- Release leases. Rows held by a live instance (liveness rule, default thresholds) are
-- skipped unless p_force: taking work from a live holder runs it twice.
CREATE FUNCTION workpump.release_leases(
    p_category text,
    p_ids uuid[],
    p_force boolean DEFAULT false,
    p_stale_after_seconds integer DEFAULT 30,
    p_definitively_dead_after_seconds integer DEFAULT 300,
    p_now timestamptz DEFAULT NULL
) RETURNS SETOF uuid
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_now timestamptz := coalesce(p_now, now());
BEGIN
    PERFORM workpump.check_ids('release_leases', p_ids);
    RETURN QUERY EXECUTE format($q$
        WITH released AS (
            UPDATE %1$I t
            SET instance_id = NULL, lease_expiry = NULL, lease_renewals = 0,
                failure_reason = 'operator_released',
                last_error = format('attempt %%s ended without a reported outcome: lease of instance %%s released by an operator at %%s',
                                    t.attempts, t.instance_id, $3)
            FROM (SELECT o.seq, o.instance_id AS holder FROM %1$I o WHERE o.%2$I = ANY ($1)) old
            WHERE t.seq = old.seq AND t.%3$I IS NULL AND t.instance_id IS NOT NULL
              AND ($2 OR t.instance_id NOT IN (SELECT workpump.live_instances($4, $5)))
            RETURNING t.%2$I AS id, t.stream, %4$s AS scope, old.holder
        ), streams AS (
            -- the old holder no longer works on these streams
            UPDATE workpump_active_stream s SET owner_instance_id = NULL, lease_expiry = NULL
            FROM released r
            WHERE s.category = $6 AND s.scope = r.scope AND s.stream = r.stream
              AND s.owner_instance_id = r.holder
        )
        SELECT r.id FROM released r$q$, v_meta.tbl, v_meta.key_col, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END)
    USING p_ids, coalesce(p_force, false), v_now,
          v_now - make_interval(secs => p_stale_after_seconds),
          v_now - make_interval(secs => p_definitively_dead_after_seconds), p_category;
    IF FOUND THEN
        PERFORM pg_notify('workpump_' || p_category, p_category);
    END IF;
END
$$;

-- Park rows as dead (they keep blocking their stream until re-queued).
CREATE FUNCTION workpump.dead_letter(
    p_category text, p_ids uuid[], p_reason text DEFAULT 'operator', p_now timestamptz DEFAULT NULL
) RETURNS SETOF uuid
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
BEGIN
    PERFORM workpump.check_ids('dead_letter', p_ids);
    RETURN QUERY EXECUTE format($q$
        WITH parked AS (
            UPDATE %1$I t
            SET dead_lettered_at = $2, failure_reason = $3, instance_id = NULL,
                lease_expiry = NULL, lease_renewals = 0, scheduled_for = NULL
            FROM (SELECT o.seq, o.instance_id AS holder FROM %1$I o WHERE o.%2$I = ANY ($1)) old
            WHERE t.seq = old.seq AND t.%3$I IS NULL AND t.dead_lettered_at IS NULL
            RETURNING t.%2$I AS id, t.stream, %4$s AS scope, old.holder
        ), streams AS (
            -- a parked row's holder no longer works on its stream
            UPDATE workpump_active_stream s SET owner_instance_id = NULL, lease_expiry = NULL
            FROM parked p
            WHERE s.category = $4 AND s.scope = p.scope AND s.stream = p.stream
              AND s.owner_instance_id = p.holder
        )
        SELECT p.id FROM parked p$q$, v_meta.tbl, v_meta.key_col, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END)
    USING p_ids, coalesce(p_now, now()), coalesce(p_reason, 'operator'), p_category;
END
$$;

-- Give dead rows a fresh set of attempts; their last error stays for history.
CREATE FUNCTION workpump.requeue_dead(
    p_category text, p_ids uuid[], p_now timestamptz DEFAULT NULL
) RETURNS SETOF uuid
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
BEGIN
    PERFORM workpump.check_ids('requeue_dead', p_ids);
    RETURN QUERY EXECUTE format($q$
        UPDATE %1$I t
        SET dead_lettered_at = NULL, attempts = 0, scheduled_for = NULL, claimed_at = NULL
        WHERE t.%2$I = ANY ($1) AND t.%3$I IS NULL AND t.dead_lettered_at IS NOT NULL
        RETURNING t.%2$I$q$, v_meta.tbl, v_meta.key_col, v_meta.done_col)
    USING p_ids;
    IF FOUND THEN
        PERFORM pg_notify('workpump_' || p_category, p_category);
    END IF;
END
$$;
