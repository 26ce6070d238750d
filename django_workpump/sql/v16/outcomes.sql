-- Schema version 16, part 2: a stream keeps its owner while its run goes on.
--
-- With stream runs (version 15) the row after a completed head is often leased already,
-- to the same instance, as part of its run. complete_work and discard_work used to
-- clear the stream's owner whenever the head ended; now the owner stays while it holds
-- the stream's new head, with the stream lease set to that row's, and is cleared as
-- before otherwise. Every other way a row leaves its holder (failure, snooze, release,
-- eviction, an operator) clears the owner as before.

-- After p_instance_id ended heads of these streams and the next rows were promoted:
-- each stream it owns stays its own, with the new head's lease, while it holds that
-- head; otherwise the stream has no owner.
CREATE FUNCTION workpump.hand_over_streams(
    p_category text, p_instance_id uuid, p_scopes text[], p_streams text[]
) RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
BEGIN
    EXECUTE format($q$
        UPDATE workpump_active_stream s
        SET owner_instance_id = CASE WHEN h.instance_id = $3 THEN s.owner_instance_id END,
            lease_expiry = CASE WHEN h.instance_id = $3 THEN h.lease_expiry END
        FROM (SELECT DISTINCT u.scope, u.stream
              FROM unnest($1::text[], $2::text[]) u(scope, stream)
              WHERE u.stream IS NOT NULL) u
        LEFT JOIN LATERAL (
            -- the stream's head now: its earliest undone row, through the _stream index
            SELECT n.instance_id, n.lease_expiry FROM %1$I n
            WHERE %3$s n.stream = u.stream AND n.%2$I IS NULL
            ORDER BY n.seq LIMIT 1
        ) h ON true
        WHERE s.category = $4 AND s.scope = u.scope AND s.stream = u.stream
          AND s.owner_instance_id = $3$q$,
        v_meta.tbl, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''
             ELSE format('n.%I = u.scope AND', v_meta.scope_col) END)
    USING p_scopes, p_streams, p_instance_id, p_category;
END
$$;

-- Mark rows done that p_instance_id still holds under p_lease_tokens[i], storing
-- p_results[i] (jsonb, may be NULL) as the result of p_ids[i]. Returns every id with
-- 'done' or 'lost' (not held by the caller under that token any more, or already done).
-- Completed heads hand over to the next row of their stream; the caller stays the
-- stream's owner while it holds that row (the next of its run: hand_over_streams).
CREATE OR REPLACE FUNCTION workpump.complete_work(
    p_instance_id uuid,
    p_category text,
    p_ids uuid[],
    p_lease_tokens uuid[],
    p_results jsonb[] DEFAULT NULL,
    p_now timestamptz DEFAULT NULL
) RETURNS TABLE (work_id uuid, status text)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_now timestamptz := coalesce(p_now, now());
    v_done_ids uuid[];
    v_done_tokens uuid[];
    v_scopes text[];
    v_streams text[];
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION 'complete_work needs p_instance_id: completion is fenced by the holder.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_ids('complete_work', p_ids);
    PERFORM workpump.check_lease_tokens('complete_work', p_ids, p_lease_tokens);
    IF p_results IS NOT NULL AND cardinality(p_results) <> cardinality(p_ids) THEN
        RAISE EXCEPTION 'complete_work got % ids but % results.', cardinality(p_ids), cardinality(p_results)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;

    EXECUTE format($q$
        WITH done AS (
            -- fenced: only undone rows the caller holds under the attempt's token
            UPDATE %1$I t
            SET %3$I = $3, instance_id = NULL, lease_expiry = NULL, lease_token = NULL,
                result = i.result
            FROM unnest($1::uuid[], $5::uuid[],
                        coalesce($4::jsonb[], array_fill(NULL::jsonb, ARRAY[cardinality($1)])))
                 AS i(id, token, result)
            WHERE t.%2$I = i.id AND t.lease_token = i.token AND t.instance_id = $2
              AND t.%3$I IS NULL
            RETURNING t.%2$I AS id, i.token, t.stream, %4$s AS scope
        )
        SELECT coalesce(array_agg(d.id), '{}'), coalesce(array_agg(d.token), '{}'),
               coalesce(array_agg(d.scope), '{}'), coalesce(array_agg(d.stream), '{}')
        FROM done d$q$,
        v_meta.tbl, v_meta.key_col, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END)
    INTO v_done_ids, v_done_tokens, v_scopes, v_streams
    USING p_ids, p_instance_id, v_now, p_results, p_lease_tokens;

    IF EXISTS (SELECT 1 FROM unnest(v_streams) s WHERE s IS NOT NULL) THEN
        PERFORM workpump.promote_stream_heads(p_category, v_scopes, v_streams);
        -- the caller keeps the streams whose new head it holds (its run goes on)
        PERFORM workpump.hand_over_streams(p_category, p_instance_id, v_scopes, v_streams);
    END IF;

    RETURN QUERY
    SELECT i.id,
           CASE WHEN EXISTS (SELECT 1 FROM unnest(v_done_ids, v_done_tokens) d(id, token)
                             WHERE d.id = i.id AND d.token = i.token)
                THEN 'done' ELSE 'lost' END
    FROM unnest(p_ids, p_lease_tokens) i(id, token);
END
$$;

-- End rows p_instance_id holds under p_lease_tokens[i] as 'discarded' (the handler
-- raised workpump.Discard): done, with p_reasons[i] kept as the last error and
-- failure_reason 'discarded'. Discarded heads hand over to the next row of their stream
-- as completed ones do (complete_work). Returns every id with 'discarded' or 'lost'.
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
