-- Schema version 17: the purges delete at most their batch.
--
-- Each purge deleted `WHERE key IN (SELECT ... LIMIT batch FOR UPDATE SKIP LOCKED)`.
-- When the planner ran that sub-select again for each outer row (a nested loop, chosen
-- with some table statistics), a row the statement had already deleted was skipped
-- by the lock and the LIMIT reached past it: one call deleted more than its batch, up
-- to every row that qualified. The keys are now chosen once (an ARRAY sub-select is
-- an init plan, run once) and the rows with those keys deleted.

-- Delete up to p_batch rows of a category processed before p_processed_before.
CREATE OR REPLACE FUNCTION workpump.purge_processed(
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
        DELETE FROM %1$I t WHERE t.seq = ANY (ARRAY(
            -- oldest processed rows first, through the _done index
            SELECT d.seq FROM %1$I d
            WHERE d.%2$I IS NOT NULL AND d.%2$I < $1
            ORDER BY d.%2$I LIMIT $2
            FOR UPDATE SKIP LOCKED))$q$,
        v_meta.tbl, v_meta.done_col)
    USING p_processed_before, p_batch;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

-- Delete up to p_batch events created before p_created_before that no work row points at.
CREATE OR REPLACE FUNCTION workpump.purge_events(
    p_created_before timestamptz,
    p_batch integer DEFAULT 1000
) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_count integer;
BEGIN
    DELETE FROM workpump_event e WHERE e.seq = ANY (ARRAY(
        SELECT o.seq FROM workpump_event o
        WHERE o.created_at < p_created_before
          AND NOT EXISTS (SELECT 1 FROM workpump_perspective_event p WHERE p.event_id = o.event_id)
          AND NOT EXISTS (SELECT 1 FROM workpump_receptor_processing r WHERE r.event_id = o.event_id)
        ORDER BY o.created_at LIMIT p_batch
        FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

-- Delete stream-ownership rows that nobody owns and whose stream has no undone row.
CREATE OR REPLACE FUNCTION workpump.purge_idle_streams(p_batch integer DEFAULT 1000) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_count integer;
BEGIN
    DELETE FROM workpump_active_stream s WHERE s.id = ANY (ARRAY(
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
        FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

-- Delete up to p_batch dead rows (dead-lettered, never done) dead-lettered before
-- p_dead_before, oldest first. A dead row that headed an ordered stream was blocking it;
-- once purged, the stream's next row becomes its head and runs.
CREATE OR REPLACE FUNCTION workpump.purge_dead(
    p_category text,
    p_dead_before timestamptz,
    p_batch integer DEFAULT 1000
) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_count integer;
    v_scopes text[];
    v_streams text[];
BEGIN
    IF p_dead_before IS NULL OR p_batch IS NULL OR p_batch < 1 THEN
        RAISE EXCEPTION 'purge_dead needs p_dead_before and p_batch >= 1.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    EXECUTE format($q$
        WITH purged AS (
            -- oldest dead rows first, through the _dead index
            DELETE FROM %1$I t WHERE t.seq = ANY (ARRAY(
                SELECT d.seq FROM %1$I d
                WHERE d.%2$I IS NULL AND d.dead_lettered_at IS NOT NULL
                  AND d.dead_lettered_at < $1
                ORDER BY d.dead_lettered_at LIMIT $2
                FOR UPDATE SKIP LOCKED))
            RETURNING t.stream, t.stream_head, %3$s AS scope
        )
        -- the streams whose blocking head went: their next rows are promoted below
        SELECT count(*)::integer,
               array_agg(p.scope) FILTER (WHERE p.stream_head AND p.stream IS NOT NULL),
               array_agg(p.stream) FILTER (WHERE p.stream_head AND p.stream IS NOT NULL)
        FROM purged p$q$,
        v_meta.tbl, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN 'NULL::text'
             ELSE format('t.%I', v_meta.scope_col) END)
    INTO v_count, v_scopes, v_streams
    USING p_dead_before, p_batch;
    IF v_streams IS NOT NULL THEN
        PERFORM workpump.promote_stream_heads(p_category, v_scopes, v_streams);
    END IF;
    RETURN v_count;
END
$$;

-- Delete up to p_batch received message ids first seen before p_seen_before whose inbox
-- row is gone (purged by retention). A message delivered again after that is accepted
-- as new: the retention is the de-duplication window.
CREATE OR REPLACE FUNCTION workpump.purge_inbox_dedup(
    p_seen_before timestamptz,
    p_batch integer DEFAULT 1000
) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_count integer;
BEGIN
    IF p_seen_before IS NULL OR p_batch IS NULL OR p_batch < 1 THEN
        RAISE EXCEPTION 'purge_inbox_dedup needs p_seen_before and p_batch >= 1.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    DELETE FROM workpump_inbox_dedup d WHERE d.message_id = ANY (ARRAY(
        -- oldest first, through wp_inbox_dedup_seen; never the id of a row still stored
        SELECT o.message_id FROM workpump_inbox_dedup o
        WHERE o.first_seen_at < p_seen_before
          AND NOT EXISTS (SELECT 1 FROM workpump_inbox i WHERE i.message_id = o.message_id)
        ORDER BY o.first_seen_at LIMIT p_batch
        FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;
