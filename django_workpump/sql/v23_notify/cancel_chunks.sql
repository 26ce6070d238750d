-- Schema version 23 (notify): cancel_work tells a holder in notifications of at most 50
-- attempts, not 100.
--
-- A [work id, lease token] pair takes 82 bytes of a workpump_cancel payload, so 100 of
-- them came to about 8270 bytes, over PostgreSQL's 8000-byte NOTIFY limit: cancelling 97
-- or more running rows of one instance in one call failed with "payload string too long"
-- and cancelled nothing. 50 pairs take about 4200 bytes.

-- Cancel undone rows (pending, scheduled, leased, orphaned or dead): each ends
-- 'cancelled' at once and never runs (again); its stream moves on. A leased row keeps
-- its attempt's lease token, so that attempt's complete_work and fail_work come back
-- 'lost' and its renewal 'cancelled'; its holder is told at once by a NOTIFY on
-- workpump_cancel, payload {"instance": <holder>, "category": ..., "work": [[id, token],
-- ...]} (at most 50 rows each: under the 8000-byte limit of a NOTIFY payload), delivered
-- when the caller commits. Returns each cancelled id with its holder (NULL when no
-- instance held it); ids of no undone row are not returned.
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
    FROM (SELECT u.id, u.holder, u.token, (row_number() OVER (PARTITION BY u.holder) - 1) / 50 AS chunk
          FROM unnest(v_ids, v_holders, v_tokens) u(id, holder, token)
          WHERE u.holder IS NOT NULL) c
    GROUP BY c.holder, c.chunk;

    RETURN QUERY SELECT u.id, u.holder FROM unnest(v_ids, v_holders) u(id, holder);
END
$$;
