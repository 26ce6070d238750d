-- Schema version 6: nothing grows without bound, and every function's search_path is
-- pinned.
--
-- Received message ids (workpump_inbox_dedup) were kept forever and dead rows until an
-- operator acted; both now have a purge the maintenance worker calls (retention settings
-- INBOX_DEDUP_RETENTION_SECONDS and DEAD_RETENTION_SECONDS). Task enqueues use receive
-- with p_deduplicate => false: a task's id is a fresh UUID, so a de-duplication row
-- would only be written to be purged.
--
-- Functions used to capture the migrating session's search_path ("$user", public by
-- default): a schema named after the calling role, or a temporary table, could shadow
-- a table or a built-in the function meant. pin_search_path sets every function's
-- search_path to pg_catalog, the schema that holds the workpump tables, and pg_temp
-- last; every later migration that creates functions calls it once more.

-- Delete up to p_batch dead rows (dead-lettered, never done) dead-lettered before
-- p_dead_before, oldest first. A dead row that headed an ordered stream was blocking it;
-- once purged, the stream's next row becomes its head and runs.
CREATE FUNCTION workpump.purge_dead(
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
            DELETE FROM %1$I t WHERE t.seq IN (
                SELECT d.seq FROM %1$I d
                WHERE d.%2$I IS NULL AND d.dead_lettered_at IS NOT NULL
                  AND d.dead_lettered_at < $1
                ORDER BY d.dead_lettered_at LIMIT $2
                FOR UPDATE SKIP LOCKED)
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
CREATE FUNCTION workpump.purge_inbox_dedup(
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
    DELETE FROM workpump_inbox_dedup d WHERE d.message_id IN (
        -- oldest first, through wp_inbox_dedup_seen; never the id of a row still stored
        SELECT o.message_id FROM workpump_inbox_dedup o
        WHERE o.first_seen_at < p_seen_before
          AND NOT EXISTS (SELECT 1 FROM workpump_inbox i WHERE i.message_id = o.message_id)
        ORDER BY o.first_seen_at LIMIT p_batch
        FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

DROP FUNCTION workpump.receive(uuid, text, jsonb, text, integer, timestamptz, integer, integer,
                               bigint, integer);

-- Store an inbox message once per message id: false, with nothing written, when the id
-- was received before (within the de-duplication window). p_deduplicate => false skips
-- the de-duplication row, for producers whose ids are fresh UUIDs (task enqueues): a
-- repeated id then fails on the inbox's unique message_id instead.
CREATE FUNCTION workpump.receive(
    p_message_id uuid,
    p_handler_name text,
    p_payload jsonb,
    p_stream text DEFAULT NULL,
    p_priority integer DEFAULT 0,
    p_scheduled_for timestamptz DEFAULT NULL,
    p_max_attempts integer DEFAULT 10,
    p_partition_count integer DEFAULT 10000,
    p_max_payload_bytes bigint DEFAULT 1048576,
    p_max_payload_depth integer DEFAULT 100,
    p_deduplicate boolean DEFAULT true
) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_message_id IS NULL THEN
        RAISE EXCEPTION 'An inbox message needs a message id: it is what deduplicates it.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_new_work('inbox handler', p_handler_name, p_payload,
                                    p_priority, p_max_attempts, p_partition_count);
    PERFORM workpump.check_payload('inbox handler', p_handler_name, p_payload,
                                   p_max_payload_bytes, p_max_payload_depth);
    IF coalesce(p_deduplicate, true) THEN
        -- A concurrent receive of the same id waits here for the first one's transaction.
        INSERT INTO workpump_inbox_dedup (message_id) VALUES (p_message_id)
        ON CONFLICT (message_id) DO NOTHING;
        IF NOT FOUND THEN
            RETURN false;
        END IF;
    END IF;
    INSERT INTO workpump_inbox (message_id, handler_name, payload, stream, partition_number,
                                priority, scheduled_for, max_attempts)
    VALUES (p_message_id, p_handler_name, p_payload, p_stream,
            workpump.partition_of(coalesce(p_stream, p_message_id::text), p_partition_count),
            p_priority, p_scheduled_for, p_max_attempts);
    RETURN true;
END
$$;

-- Pin the search_path of every workpump function that sets one: pg_catalog first (no
-- built-in can be shadowed), then the schema of the workpump tables, then pg_temp (a
-- temporary table can shadow nothing). Idempotent; returns how many functions it set.
CREATE FUNCTION workpump.pin_search_path() RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_schema name;
    v_path text;
    v_function record;
    v_count integer := 0;
BEGIN
    SELECT n.nspname INTO v_schema
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE c.relname = 'workpump_outbox' AND c.relkind IN ('r', 'p')
    ORDER BY n.nspname = current_schema() DESC
    LIMIT 1;
    IF v_schema IS NULL THEN
        RAISE EXCEPTION 'pin_search_path found no workpump_outbox table: run the workpump migrations first.'
            USING ERRCODE = 'undefined_table';
    END IF;
    v_path := format('pg_catalog, %I, pg_temp', v_schema);
    FOR v_function IN
        SELECT p.oid::regprocedure AS signature
        FROM pg_proc p
        WHERE p.pronamespace = 'workpump'::regnamespace
          AND p.proname <> 'pin_search_path'
          AND EXISTS (SELECT 1 FROM unnest(p.proconfig) c WHERE c LIKE 'search_path=%')
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %s', v_function.signature, v_path);
        v_count := v_count + 1;
    END LOOP;
    RETURN v_count;
END
$$;

SELECT workpump.pin_search_path();
