-- Handler control flow and cancellation, schema version 14.
--
-- Two new terminal states. A row ends 'discarded' when its handler raises
-- workpump.Discard (discard_work), and 'cancelled' when an operator cancels it
-- (cancel_work). Either way its done column is set, so its stream moves on, its unique
-- key is free and retention purges it like a completed row; end_state says how it ended
-- and state_of reports it.
--
-- snooze_work gives a running row back for later without spending its attempt (the
-- handler raised workpump.Snooze); the row stays its stream's head, so the stream waits.
-- A row snoozed p_max_snoozes times is failed instead.
--
-- cancel_work ends undone rows at once. A leased row's holder is told with a NOTIFY on
-- workpump_cancel naming it; the row keeps its lease token, so renew_leases reports that
-- attempt 'cancelled' (the fallback when the NOTIFY is missed), and the attempt's late
-- complete_work or fail_work comes back 'lost'.
--
-- fail_work takes p_retry_delays: a per-row retry delay in seconds (a handler's own
-- backoff), NULL for the default backoff.

DROP FUNCTION workpump.state_of(timestamptz, timestamptz, uuid, timestamptz, timestamptz,
                                timestamptz, timestamptz);
DROP FUNCTION workpump.renew_leases(text, uuid[], uuid[], integer, uuid, timestamptz);
DROP FUNCTION workpump.fail_work(uuid, text, uuid[], uuid[], text[], text[], integer, integer,
                                 timestamptz);

-- The state of a work row, from its columns (admin, status and tests use the same names).
CREATE FUNCTION workpump.state_of(
    p_done_at timestamptz,
    p_dead_lettered_at timestamptz,
    p_instance_id uuid,
    p_lease_expiry timestamptz,
    p_claimed_at timestamptz,
    p_scheduled_for timestamptz,
    p_now timestamptz DEFAULT NULL,
    p_end_state text DEFAULT NULL
) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
RETURN CASE
    -- a done row ended by completing, or as end_state says: 'cancelled', 'discarded'
    WHEN p_done_at IS NOT NULL THEN coalesce(p_end_state, 'done')
    WHEN p_dead_lettered_at IS NOT NULL THEN 'dead'
    -- the claim takes a row over once lease_expiry <= now: so expired means <=
    WHEN p_instance_id IS NOT NULL AND p_lease_expiry > coalesce(p_now, now()) THEN 'leased'
    WHEN p_instance_id IS NOT NULL THEN 'orphaned'
    WHEN p_claimed_at IS NOT NULL THEN 'orphaned'  -- holder evicted mid-attempt
    WHEN p_scheduled_for > coalesce(p_now, now()) THEN 'scheduled'
    ELSE 'pending'
END;

-- Extend the leases of not-done rows to now + p_lease_seconds and count the renewal, for
-- each p_ids[i] still leased under p_lease_tokens[i]. With p_instance_id only rows that
-- instance holds, and the instance must be registered and not tombstoned (SQLSTATE WP001
-- otherwise). Returns the renewed ids with their new expiry and status 'renewed' (the
-- stream leases of their streams move with them), and the ids whose attempt was
-- cancelled (cancel_work) with status 'cancelled' and no expiry: the holder stops it.
CREATE FUNCTION workpump.renew_leases(
    p_category text,
    p_ids uuid[],
    p_lease_tokens uuid[],
    p_lease_seconds integer DEFAULT 300,
    p_instance_id uuid DEFAULT NULL,
    p_now timestamptz DEFAULT NULL
) RETURNS TABLE (work_id uuid, lease_expiry timestamptz, status text)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_now timestamptz := coalesce(p_now, now());
    v_expiry timestamptz;
BEGIN
    IF p_lease_seconds IS NULL OR p_lease_seconds < 1 THEN
        RAISE EXCEPTION 'renew_leases needs p_lease_seconds >= 1, not %.',
            coalesce(p_lease_seconds::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_ids('renew_leases', p_ids);
    PERFORM workpump.check_lease_tokens('renew_leases', p_ids, p_lease_tokens);
    IF p_instance_id IS NOT NULL THEN
        PERFORM workpump.check_instance('renew_leases', p_instance_id);
    END IF;
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;
    v_expiry := v_now + make_interval(secs => p_lease_seconds);
    RETURN QUERY EXECUTE format($q$
        WITH renewed AS (
            -- only leased, undone rows under the attempt's token; only the caller's when
            -- it says who it is
            UPDATE %1$I t
            SET lease_expiry = $3, lease_renewals = t.lease_renewals + 1
            FROM unnest($1::uuid[], $6::uuid[]) i(id, token)
            WHERE t.%2$I = i.id AND t.lease_token = i.token AND t.%3$I IS NULL
              AND t.instance_id IS NOT NULL AND ($2::uuid IS NULL OR t.instance_id = $2)
            RETURNING t.%2$I AS work_id, t.lease_expiry, t.stream, %4$s AS scope,
                      t.instance_id
        ), streams AS (
            -- the streams' leases follow their rows
            UPDATE workpump_active_stream s SET lease_expiry = $3, last_activity_at = $4
            FROM (SELECT DISTINCT r.scope, r.stream, r.instance_id FROM renewed r
                  WHERE r.stream IS NOT NULL) r
            WHERE s.category = $5 AND s.scope = r.scope AND s.stream = r.stream
              AND s.owner_instance_id = r.instance_id
        )
        SELECT r.work_id, r.lease_expiry, 'renewed'::text FROM renewed r
        UNION ALL
        -- attempts an operator cancelled: the row ended, keeping the attempt's token
        SELECT t.%2$I, NULL::timestamptz, 'cancelled'::text
        FROM %1$I t JOIN unnest($1::uuid[], $6::uuid[]) i(id, token)
             ON t.%2$I = i.id AND t.lease_token = i.token
        WHERE t.end_state = 'cancelled'$q$,
        v_meta.tbl, v_meta.key_col, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END)
    USING p_ids, p_instance_id, v_expiry, v_now, p_category, p_lease_tokens;
END
$$;

-- Record failed attempts of rows p_instance_id still holds under p_lease_tokens[i]: the
-- error and reason, the lease released, and a retry scheduled after p_retry_delays[i]
-- seconds (the handler's own backoff; 0 retries at once) or, where that is NULL or not
-- given, after retry_delay_seconds; or the row parked as dead when its attempts are used
-- up. Attempts are not bumped: the claim counted this attempt. Returns every id with
-- 'retry', 'dead' or 'lost'.
CREATE FUNCTION workpump.fail_work(
    p_instance_id uuid,
    p_category text,
    p_ids uuid[],
    p_lease_tokens uuid[],
    p_errors text[],
    p_reasons text[] DEFAULT NULL,
    p_retry_base_seconds integer DEFAULT 30,
    p_retry_max_seconds integer DEFAULT 300,
    p_now timestamptz DEFAULT NULL,
    p_retry_delays double precision[] DEFAULT NULL
) RETURNS TABLE (work_id uuid, status text, scheduled_for timestamptz)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_now timestamptz := coalesce(p_now, now());
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION 'fail_work needs p_instance_id: failure is fenced by the holder.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_ids('fail_work', p_ids);
    PERFORM workpump.check_lease_tokens('fail_work', p_ids, p_lease_tokens);
    IF coalesce(cardinality(p_errors), 0) <> coalesce(cardinality(p_ids), 0)
       OR (p_reasons IS NOT NULL AND cardinality(p_reasons) <> cardinality(p_ids))
       OR (p_retry_delays IS NOT NULL AND cardinality(p_retry_delays) <> cardinality(p_ids)) THEN
        RAISE EXCEPTION 'fail_work needs one error (and one reason and retry delay, when given) per id: got % ids, % errors, % reasons, % delays.',
            coalesce(cardinality(p_ids), 0), coalesce(cardinality(p_errors), 0),
            coalesce(cardinality(p_reasons), 0), coalesce(cardinality(p_retry_delays), 0)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_retry_base_seconds IS NULL OR p_retry_base_seconds < 0
       OR p_retry_max_seconds IS NULL OR p_retry_max_seconds < 0 THEN
        RAISE EXCEPTION 'fail_work needs retry seconds >= 0 (got base %, max %).',
            coalesce(p_retry_base_seconds::text, 'NULL'), coalesce(p_retry_max_seconds::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(p_retry_delays) d
               WHERE d < 0 OR d = 'Infinity'::double precision OR d = 'NaN'::double precision) THEN
        RAISE EXCEPTION 'fail_work needs p_retry_delays of finite seconds >= 0 (or NULL for the default backoff).'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;

    RETURN QUERY EXECUTE format($q$
        WITH input AS (
            SELECT i.n, i.id, i.token, i.error, coalesce(i.reason, 'handler_error') AS reason,
                   i.delay
            FROM unnest($1::uuid[], $9::uuid[], $2::text[],
                        coalesce($3::text[], array_fill(NULL::text, ARRAY[cardinality($1)])),
                        coalesce($10::double precision[],
                                 array_fill(NULL::double precision, ARRAY[cardinality($1)])))
                 WITH ORDINALITY AS i(id, token, error, reason, delay, n)
        ), failed AS (
            -- fenced: only undone rows the caller holds under the attempt's token; dead
            -- when attempts are used up
            UPDATE %1$I t SET
                instance_id = NULL, lease_expiry = NULL, lease_token = NULL,
                lease_renewals = 0, claimed_at = NULL,
                last_error = i.error,
                failure_reason = CASE WHEN t.attempts >= t.max_attempts
                                      THEN 'max_attempts' ELSE i.reason END,
                dead_lettered_at = CASE WHEN t.attempts >= t.max_attempts THEN $5 END,
                scheduled_for = CASE
                    WHEN t.attempts >= t.max_attempts THEN NULL
                    WHEN i.delay IS NOT NULL THEN  -- the handler's own backoff
                        CASE WHEN i.delay = 0 THEN NULL
                             ELSE $5 + make_interval(secs => i.delay) END
                    WHEN $6 = 0 OR $7 = 0 THEN NULL  -- retry at once: straight to ready
                    ELSE $5 + make_interval(secs => workpump.retry_delay_seconds(
                        t.%2$I::text, t.attempts, $6, $7)) END
            FROM input i
            WHERE t.%2$I = i.id AND t.lease_token = i.token AND t.instance_id = $4
              AND t.%3$I IS NULL
            RETURNING t.%2$I AS id, i.token, t.dead_lettered_at IS NOT NULL AS dead,
                      t.scheduled_for, t.stream, %4$s AS scope
        ), streams AS (
            -- the failed rows' streams are no longer worked on by the caller
            UPDATE workpump_active_stream s SET owner_instance_id = NULL, lease_expiry = NULL
            FROM failed f
            WHERE s.category = $8 AND s.scope = f.scope AND s.stream = f.stream
              AND s.owner_instance_id = $4
        ), ready_now AS (
            -- a retry due at once is claimable now: wake the claimers
            SELECT pg_notify('workpump_' || $8, $8)
            WHERE EXISTS (SELECT 1 FROM failed f WHERE NOT f.dead AND f.scheduled_for IS NULL)
        )
        SELECT i.id,
               CASE WHEN f.id IS NULL THEN 'lost' WHEN f.dead THEN 'dead' ELSE 'retry' END,
               f.scheduled_for
        FROM input i LEFT JOIN failed f ON f.id = i.id AND f.token = i.token
        LEFT JOIN ready_now ON true
        ORDER BY i.n$q$,
        v_meta.tbl, v_meta.key_col, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END)
    USING p_ids, p_errors, p_reasons, p_instance_id, v_now, p_retry_base_seconds,
          p_retry_max_seconds, p_category, p_lease_tokens, p_retry_delays;
END
$$;

-- Give rows p_instance_id holds under p_lease_tokens[i] back to run again after
-- p_seconds[i] (0: at once) without spending the attempt: the lease released, attempts
-- given back, snoozes counted. The row stays its stream's head, so the stream waits for
-- it. A row already snoozed p_max_snoozes times is failed instead (reason
-- 'max_snoozes', the attempt counted, retried after p_seconds[i], or dead when its
-- attempts are used up). Returns every id with 'snoozed', 'retry', 'dead' or 'lost'.
CREATE FUNCTION workpump.snooze_work(
    p_instance_id uuid,
    p_category text,
    p_ids uuid[],
    p_lease_tokens uuid[],
    p_seconds double precision[],
    p_max_snoozes integer DEFAULT 25,
    p_now timestamptz DEFAULT NULL
) RETURNS TABLE (work_id uuid, status text, scheduled_for timestamptz)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_now timestamptz := coalesce(p_now, now());
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION 'snooze_work needs p_instance_id: a snooze is fenced by the holder.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_ids('snooze_work', p_ids);
    PERFORM workpump.check_lease_tokens('snooze_work', p_ids, p_lease_tokens);
    IF coalesce(cardinality(p_seconds), 0) <> coalesce(cardinality(p_ids), 0) THEN
        RAISE EXCEPTION 'snooze_work needs one p_seconds per id: got % ids, % seconds.',
            coalesce(cardinality(p_ids), 0), coalesce(cardinality(p_seconds), 0)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(p_seconds) s
               WHERE s IS NULL OR s < 0 OR s = 'Infinity'::double precision
                  OR s = 'NaN'::double precision) THEN
        RAISE EXCEPTION 'snooze_work needs p_seconds of finite seconds >= 0.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_max_snoozes IS NULL OR p_max_snoozes < 0 THEN
        RAISE EXCEPTION 'snooze_work needs p_max_snoozes >= 0, not %.',
            coalesce(p_max_snoozes::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;

    RETURN QUERY EXECUTE format($q$
        WITH input AS (
            SELECT i.n, i.id, i.token, i.seconds
            FROM unnest($1::uuid[], $2::uuid[], $3::double precision[])
                 WITH ORDINALITY AS i(id, token, seconds, n)
        ), old AS (
            -- the row before the update: whether this snooze is over the limit
            SELECT t.seq, t.snoozes >= $4 AS over, t.attempts >= t.max_attempts AS last
            FROM %1$I t JOIN input i ON t.%2$I = i.id AND t.lease_token = i.token
            WHERE t.instance_id = $5 AND t.%3$I IS NULL
            FOR UPDATE OF t
        ), snoozed AS (
            UPDATE %1$I t SET
                instance_id = NULL, lease_expiry = NULL, lease_token = NULL,
                lease_renewals = 0, claimed_at = NULL,
                attempts = CASE WHEN o.over THEN t.attempts ELSE greatest(t.attempts - 1, 0) END,
                snoozes = CASE WHEN o.over THEN t.snoozes ELSE t.snoozes + 1 END,
                last_error = CASE WHEN o.over
                    THEN format('the handler snoozed %%s times, the maximum (MAX_SNOOZES); this snooze counts as a failed attempt', t.snoozes)
                    ELSE t.last_error END,
                failure_reason = CASE WHEN o.over AND o.last THEN 'max_attempts'
                                      WHEN o.over THEN 'max_snoozes'
                                      ELSE t.failure_reason END,
                dead_lettered_at = CASE WHEN o.over AND o.last THEN $6 END,
                scheduled_for = CASE
                    WHEN o.over AND o.last THEN NULL
                    WHEN i.seconds = 0 THEN NULL
                    ELSE $6 + make_interval(secs => i.seconds) END
            FROM old o, input i
            WHERE t.seq = o.seq AND t.%2$I = i.id
            RETURNING t.%2$I AS id, i.token, o.over,
                      t.dead_lettered_at IS NOT NULL AS dead, t.scheduled_for, t.stream,
                      %4$s AS scope
        ), streams AS (
            -- the caller no longer works on these streams (their head waits, unleased)
            UPDATE workpump_active_stream s SET owner_instance_id = NULL, lease_expiry = NULL
            FROM snoozed z
            WHERE s.category = $7 AND s.scope = z.scope AND s.stream = z.stream
              AND s.owner_instance_id = $5
        ), ready_now AS (
            SELECT pg_notify('workpump_' || $7, $7)
            WHERE EXISTS (SELECT 1 FROM snoozed z WHERE NOT z.dead AND z.scheduled_for IS NULL)
        )
        SELECT i.id,
               CASE WHEN z.id IS NULL THEN 'lost' WHEN z.dead THEN 'dead'
                    WHEN z.over THEN 'retry' ELSE 'snoozed' END,
               z.scheduled_for
        FROM input i LEFT JOIN snoozed z ON z.id = i.id AND z.token = i.token
        LEFT JOIN ready_now ON true
        ORDER BY i.n$q$,
        v_meta.tbl, v_meta.key_col, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END)
    USING p_ids, p_lease_tokens, p_seconds, p_max_snoozes, p_instance_id, v_now, p_category;
END
$$;

-- End rows p_instance_id holds under p_lease_tokens[i] as 'discarded' (the handler
-- raised workpump.Discard): done, with p_reasons[i] kept as the last error and
-- failure_reason 'discarded'. Discarded heads hand over to the next row of their stream.
-- Returns every id with 'discarded' or 'lost'.
CREATE FUNCTION workpump.discard_work(
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
        UPDATE workpump_active_stream s SET owner_instance_id = NULL, lease_expiry = NULL
        FROM unnest(v_scopes, v_streams) u(scope, stream)
        WHERE s.category = p_category AND s.scope = u.scope AND s.stream = u.stream
          AND s.owner_instance_id = p_instance_id;
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
CREATE FUNCTION workpump.cancel_work(
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
