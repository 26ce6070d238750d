-- Shared helpers of the workpump schema: categories, partitions, lock keys, states.
-- Every function sets search_path FROM CURRENT: the migration runs with the search_path
-- under which Django created the tables, so unqualified table names resolve there.

CREATE SCHEMA IF NOT EXISTS workpump;

CREATE SEQUENCE IF NOT EXISTS workpump.alive_lock_key_seq AS integer MINVALUE 1 CYCLE;
-- Round-robin start of claim_work's category loop, so a small budget starves none.
CREATE SEQUENCE IF NOT EXISTS workpump.claim_rotation_seq AS integer MINVALUE 0 MAXVALUE 1023 CYCLE;

-- Raise unless p_category names one of the four work categories; return it.
CREATE FUNCTION workpump.check_category(p_category text) RETURNS text
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_category IS NULL
       OR p_category NOT IN ('outbox', 'inbox', 'perspective_event', 'receptor') THEN
        RAISE EXCEPTION 'Unknown workpump category %.', coalesce(quote_literal(p_category), 'NULL')
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Valid categories: outbox, inbox, perspective_event, receptor.';
    END IF;
    RETURN p_category;
END
$$;

-- The table behind a category and the names of its key, done-marker, topic and
-- ordering-scope columns (scope_col is NULL where the stream alone orders rows).
CREATE FUNCTION workpump.work_table(
    p_category text,
    OUT tbl text, OUT key_col text, OUT done_col text, OUT topic_col text, OUT scope_col text
)
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    CASE workpump.check_category(p_category)
        WHEN 'outbox' THEN
            tbl := 'workpump_outbox'; key_col := 'message_id'; done_col := 'processed_at';
            topic_col := 'destination'; scope_col := NULL;
        WHEN 'inbox' THEN
            tbl := 'workpump_inbox'; key_col := 'message_id'; done_col := 'processed_at';
            topic_col := 'handler_name'; scope_col := NULL;
        WHEN 'perspective_event' THEN
            tbl := 'workpump_perspective_event'; key_col := 'event_work_id';
            done_col := 'processed_at'; topic_col := 'perspective_name';
            scope_col := 'perspective_name';
        ELSE
            tbl := 'workpump_receptor_processing'; key_col := 'id'; done_col := 'completed_at';
            topic_col := 'receptor_name'; scope_col := 'receptor_name';
    END CASE;
END
$$;

-- A documented, portable hash of a stream key into [0, p_partition_count): the first 32
-- bits of its MD5, so application code can compute the same number
-- (int(md5(key).hexdigest()[:8], 16) % count).
CREATE FUNCTION workpump.partition_of(p_key text, p_partition_count integer DEFAULT 10000)
RETURNS integer
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN (('x' || left(md5(p_key), 8))::bit(32)::bigint % p_partition_count)::integer;

-- Advisory-lock namespaces (first half of the two-int key; objsubid 2 in pg_locks keeps
-- them apart from single-bigint application locks).
CREATE FUNCTION workpump.lock_namespace(p_purpose text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE p_purpose
    WHEN 'alive' THEN 1464877377        -- instance alive-locks; second half: alive_lock_key
    WHEN 'stream' THEN 1464877395       -- producers and completions of one ordered stream
    WHEN 'maintenance' THEN 1464877421  -- one maintenance pass at a time
END;

-- Serialize the writers of one ordered stream until the end of the transaction, so its
-- rows become heads in commit order. A hash collision only serializes two streams more.
CREATE FUNCTION workpump.lock_stream(p_category text, p_scope text, p_stream text) RETURNS void
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
    SELECT pg_advisory_xact_lock(
        workpump.lock_namespace('stream'),
        hashtext(p_category || chr(31) || coalesce(p_scope, '') || chr(31) || p_stream)
    );
$$;

-- The state of a work row, from its columns (admin, status and tests use the same names).
CREATE FUNCTION workpump.state_of(
    p_done_at timestamptz,
    p_dead_lettered_at timestamptz,
    p_instance_id uuid,
    p_lease_expiry timestamptz,
    p_claimed_at timestamptz,
    p_scheduled_for timestamptz,
    p_now timestamptz DEFAULT NULL
) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
RETURN CASE
    WHEN p_done_at IS NOT NULL THEN 'done'
    WHEN p_dead_lettered_at IS NOT NULL THEN 'dead'
    -- the claim takes a row over once lease_expiry <= now: so expired means <=
    WHEN p_instance_id IS NOT NULL AND p_lease_expiry > coalesce(p_now, now()) THEN 'leased'
    WHEN p_instance_id IS NOT NULL THEN 'orphaned'
    WHEN p_claimed_at IS NOT NULL THEN 'orphaned'  -- holder evicted mid-attempt
    WHEN p_scheduled_for > coalesce(p_now, now()) THEN 'scheduled'
    ELSE 'pending'
END;
