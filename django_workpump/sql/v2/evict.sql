-- Operator eviction of one instance (docs/admin.md, instances page): the same effects as
-- cleanup_stale_instances, for a named instance whatever its heartbeat.

-- Evict p_instance_id: tombstone it (its next heartbeat is refused and it exits),
-- release every lease it holds (the open attempt stamped), release its streams and
-- NOTIFY workpump_orphan. Returns the number of rows released (0 when it was evicted
-- before; an unknown id is tombstoned all the same, so it can never register).
CREATE FUNCTION workpump.evict_instance(
    p_instance_id uuid,
    p_reason text DEFAULT 'evicted by an operator',
    p_now timestamptz DEFAULT NULL
) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_category text;
    v_meta record;
    v_count integer;
    v_total integer := 0;
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION 'evict_instance needs p_instance_id.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    DELETE FROM workpump_service_instance WHERE instance_id = p_instance_id;
    IF NOT FOUND AND EXISTS (SELECT 1 FROM workpump_eviction WHERE instance_id = p_instance_id) THEN
        RETURN 0;  -- evicted before: nothing left to release
    END IF;
    INSERT INTO workpump_eviction (instance_id, evicted_at, reason)
    VALUES (p_instance_id, v_now, coalesce(p_reason, 'evicted by an operator'))
    ON CONFLICT (instance_id) DO NOTHING;

    FOREACH v_category IN ARRAY ARRAY['outbox', 'inbox', 'perspective_event', 'receptor'] LOOP
        v_meta := workpump.work_table(v_category);
        -- claimed_at stays set: the attempt reads as orphaned until re-claimed
        EXECUTE format(
            $q$UPDATE %1$I t
               SET instance_id = NULL, lease_expiry = NULL, lease_renewals = 0,
                   failure_reason = 'instance_evicted',
                   last_error = format('attempt %%s ended without a reported outcome: instance %%s was evicted at %%s (%%s)',
                                       t.attempts, t.instance_id, $2, $3)
               WHERE t.instance_id = $1$q$,
            v_meta.tbl)
        USING p_instance_id, v_now, coalesce(p_reason, 'evicted by an operator');
        GET DIAGNOSTICS v_count = ROW_COUNT;
        v_total := v_total + v_count;
    END LOOP;
    UPDATE workpump_active_stream SET owner_instance_id = NULL, lease_expiry = NULL
    WHERE owner_instance_id = p_instance_id;
    PERFORM pg_notify('workpump_orphan', 'evicted');
    RETURN v_total;
END
$$;
