-- Schema version 18: an ended head's stream is locked before its rows.
--
-- complete_work updates its rows, then takes the stream's lock to promote the next row
-- (promote_stream_heads), and that next row is often the following row of the same
-- run, held by the same instance. discard_work and cancel_work did the same: when a
-- handler discarded a row of a run while the rows before it were being completed, the
-- discard held the row and waited for the stream's lock, the completion held that lock
-- and waited for the row, and the server broke the deadlock by rolling one of them back
-- (after deadlock_timeout, a second by default). Both now take the locks of their
-- rows' streams first, so they queue behind a completion of the same stream instead.

-- Take the stream locks of the rows p_ids names, in promote_stream_heads's order
-- (scope, stream), before any of those rows is updated. Reading a row's stream needs no
-- row lock: a row never changes streams.
CREATE OR REPLACE FUNCTION workpump.lock_streams_of(p_category text, p_ids uuid[])
RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
BEGIN
    EXECUTE format($q$
        SELECT workpump.lock_stream($1, s.scope, s.stream)
        FROM (SELECT DISTINCT %3$s AS scope, t.stream FROM %1$I t
              WHERE t.%2$I = ANY ($2) AND t.stream IS NOT NULL
              ORDER BY 1, 2) s$q$,
        v_meta.tbl, v_meta.key_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END)
    USING p_category, p_ids;
END
$$;

-- End rows p_instance_id holds under p_lease_tokens[i] as 'discarded' (the handler
-- raised workpump.Discard): done, with p_reasons[i] kept as the last error and
-- failure_reason 'discarded'. Discarded heads hand over to the next row of their stream
-- as completed ones do (complete_work); the rows' streams are locked before the rows
-- (lock_streams_of). Returns every id with 'discarded' or 'lost'.
CREATE OR REPLACE FUNCTION workpump.discard_work(
    p_instance_id uuid,
    p_category text,
    p_ids uuid[],
    p_lease_tokens uuid[],
    p_reasons text[],
    p_now timestamptz DEFAULT NULL
) RETURNS TABLE (work_id uuid, status text)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_now timestamptz := coalesce(p_now, now());
    v_ids uuid[];
    v_tokens uuid[];
    v_scopes text[];
    v_streams text[];
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION 'discard_work needs p_instance_id: a discard is fenced by the holder.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_ids('discard_work', p_ids);
    PERFORM workpump.check_lease_tokens('discard_work', p_ids, p_lease_tokens);
    IF coalesce(cardinality(p_reasons), 0) <> coalesce(cardinality(p_ids), 0) THEN
        RAISE EXCEPTION 'discard_work needs one reason per id: got % ids, % reasons.',
            coalesce(cardinality(p_ids), 0), coalesce(cardinality(p_reasons), 0)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;

    -- the streams' locks before the rows' (lock_streams_of)
    PERFORM workpump.lock_streams_of(p_category, p_ids);

    EXECUTE format($q$
        WITH ended AS (
            -- fenced: only undone rows the caller holds under the attempt's token
            UPDATE %1$I t
            SET %3$I = $3, end_state = 'discarded', failure_reason = 'discarded',
                last_error = i.reason, instance_id = NULL, lease_expiry = NULL,
                lease_token = NULL, scheduled_for = NULL
            FROM unnest($1::uuid[], $5::uuid[], $4::text[]) AS i(id, token, reason)
            WHERE t.%2$I = i.id AND t.lease_token = i.token AND t.instance_id = $2
              AND t.%3$I IS NULL
            RETURNING t.%2$I AS id, i.token, t.stream, %4$s AS scope
        )
        SELECT coalesce(array_agg(e.id), '{}'), coalesce(array_agg(e.token), '{}'),
               coalesce(array_agg(e.scope), '{}'), coalesce(array_agg(e.stream), '{}')
        FROM ended e$q$,
        v_meta.tbl, v_meta.key_col, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END)
    INTO v_ids, v_tokens, v_scopes, v_streams
    USING p_ids, p_instance_id, v_now, p_reasons, p_lease_tokens;

    IF EXISTS (SELECT 1 FROM unnest(v_streams) s WHERE s IS NOT NULL) THEN
        PERFORM workpump.promote_stream_heads(p_category, v_scopes, v_streams);
        -- the caller keeps the streams whose new head it holds (its run goes on)
        PERFORM workpump.hand_over_streams(p_category, p_instance_id, v_scopes, v_streams);
    END IF;

    RETURN QUERY
    SELECT i.id,
           CASE WHEN EXISTS (SELECT 1 FROM unnest(v_ids, v_tokens) d(id, token)
                             WHERE d.id = i.id AND d.token = i.token)
                THEN 'discarded' ELSE 'lost' END
    FROM unnest(p_ids, p_lease_tokens) i(id, token);
END
$$;

-- Cancel undone rows (pending, scheduled, leased, orphaned or dead): each ends
-- 'cancelled' at once and never runs (again); its stream moves on. A leased row keeps
-- its attempt's lease token, so that attempt's complete_work and fail_work come back
-- 'lost' and its renewal 'cancelled'; its holder is told at once by a NOTIFY on
-- workpump_cancel, payload {"instance": <holder>, "category": ..., "work": [[id, token],
-- ...]} (at most 100 rows each), delivered when the caller commits. Returns each
-- cancelled id with its holder (NULL when no instance held it); ids of no undone row are
-- not returned.
-- The rows' streams are locked before the rows (lock_streams_of).
CREATE OR REPLACE FUNCTION workpump.cancel_work(
    p_category text, p_ids uuid[], p_now timestamptz DEFAULT NULL
) RETURNS TABLE (work_id uuid, holder uuid)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_now timestamptz := coalesce(p_now, now());
    v_ids uuid[];
    v_holders uuid[];
    v_tokens uuid[];
    v_scopes text[];
    v_streams text[];
BEGIN
    PERFORM workpump.check_ids('cancel_work', p_ids);
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;
    -- the streams' locks before the rows' (lock_streams_of)
    PERFORM workpump.lock_streams_of(p_category, p_ids);
    EXECUTE format($q$
        WITH ended AS (
            UPDATE %1$I t
            SET %3$I = $2, end_state = 'cancelled', failure_reason = 'cancelled',
                instance_id = NULL, lease_expiry = NULL, lease_renewals = 0,
                scheduled_for = NULL
            FROM (SELECT o.seq, o.instance_id AS holder FROM %1$I o WHERE o.%2$I = ANY ($1)) old
            WHERE t.seq = old.seq AND t.%3$I IS NULL
            RETURNING t.%2$I AS id, old.holder, t.lease_token AS token, t.stream,
                      %4$s AS scope
        )
        SELECT coalesce(array_agg(e.id), '{}'), coalesce(array_agg(e.holder), '{}'),
               coalesce(array_agg(e.token), '{}'), coalesce(array_agg(e.scope), '{}'),
               coalesce(array_agg(e.stream), '{}')
        FROM ended e$q$,
        v_meta.tbl, v_meta.key_col, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END)
    INTO v_ids, v_holders, v_tokens, v_scopes, v_streams
    USING p_ids, v_now;

    IF EXISTS (SELECT 1 FROM unnest(v_streams) s WHERE s IS NOT NULL) THEN
        PERFORM workpump.promote_stream_heads(p_category, v_scopes, v_streams);
        -- a cancelled row's holder no longer works on its stream
        UPDATE workpump_active_stream s SET owner_instance_id = NULL, lease_expiry = NULL
        FROM unnest(v_scopes, v_streams, v_holders) u(scope, stream, holder)
        WHERE s.category = p_category AND s.scope = u.scope AND s.stream = u.stream
          AND s.owner_instance_id = u.holder;
    END IF;

    -- tell each holder which of its attempts to stop
    PERFORM pg_notify('workpump_cancel', json_build_object(
                'instance', c.holder, 'category', p_category,
                'work', json_agg(json_build_array(c.id, c.token)))::text)
    FROM (SELECT u.id, u.holder, u.token, (row_number() OVER (PARTITION BY u.holder) - 1) / 100 AS chunk
          FROM unnest(v_ids, v_holders, v_tokens) u(id, holder, token)
          WHERE u.holder IS NOT NULL) c
    GROUP BY c.holder, c.chunk;

    RETURN QUERY SELECT u.id, u.holder FROM unnest(v_ids, v_holders) u(id, holder);
END
$$;
