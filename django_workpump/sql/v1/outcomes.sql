-- What happens to a leased row afterwards (docs/architecture.md: Leases; Failure): renewal, completion,
-- failure, release. Every write is fenced by the caller's instance id: a worker that
-- lost its lease changes nothing, and is told which ids it lost.

CREATE FUNCTION workpump.check_ids(p_function text, p_ids uuid[]) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF array_position(p_ids, NULL) IS NOT NULL THEN
        RAISE EXCEPTION '% got a NULL work id.', p_function
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass the ids of rows claimed by claim_work.';
    END IF;
END
$$;

-- Make the earliest undone row of each given ordered stream its head, under the
-- stream lock that producers take too; NOTIFY the category when a head became ready.
-- Called after the old heads were marked done in the same transaction.
CREATE FUNCTION workpump.promote_stream_heads(
    p_category text, p_scopes text[], p_streams text[]
) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_count integer;
BEGIN
    -- lock in one order for every caller; a separate statement so the promotion below
    -- sees rows that producers committed while this waited
    PERFORM workpump.lock_stream(p_category, s.scope, s.stream)
    FROM (SELECT DISTINCT u.scope, u.stream FROM unnest(p_scopes, p_streams) u(scope, stream)
          WHERE u.stream IS NOT NULL ORDER BY u.scope, u.stream) s;

    EXECUTE format($q$
        UPDATE %1$I t SET stream_head = true
        FROM (SELECT DISTINCT u.scope, u.stream
              FROM unnest($1::text[], $2::text[]) u(scope, stream)
              WHERE u.stream IS NOT NULL) s
        CROSS JOIN LATERAL (
            -- the earliest undone row of the stream, through the _stream index
            SELECT n.seq FROM %1$I n
            WHERE %3$s n.stream = s.stream AND n.%2$I IS NULL
            ORDER BY n.seq LIMIT 1
        ) h
        WHERE t.seq = h.seq AND NOT t.stream_head$q$,
        v_meta.tbl, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''
             ELSE format('n.%I = s.scope AND', v_meta.scope_col) END)
    USING p_scopes, p_streams;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    IF v_count > 0 THEN
        PERFORM pg_notify('workpump_' || p_category, p_category);
    END IF;
    RETURN v_count;
END
$$;

-- Extend the leases of not-done rows to now + p_lease_seconds and count the renewal.
-- With p_instance_id only rows that instance still holds. Returns the renewed ids with
-- their new expiry; the stream leases of their streams move with them.
CREATE FUNCTION workpump.renew_leases(
    p_category text,
    p_ids uuid[],
    p_lease_seconds integer DEFAULT 300,
    p_instance_id uuid DEFAULT NULL,
    p_now timestamptz DEFAULT NULL
) RETURNS TABLE (work_id uuid, lease_expiry timestamptz)
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
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;
    v_expiry := v_now + make_interval(secs => p_lease_seconds);
    RETURN QUERY EXECUTE format($q$
        WITH renewed AS (
            -- only leased, undone rows; only the caller's when it says who it is
            UPDATE %1$I t
            SET lease_expiry = $3, lease_renewals = t.lease_renewals + 1
            WHERE t.%2$I = ANY ($1) AND t.%3$I IS NULL AND t.instance_id IS NOT NULL
              AND ($2::uuid IS NULL OR t.instance_id = $2)
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
        SELECT r.work_id, r.lease_expiry FROM renewed r$q$,
        v_meta.tbl, v_meta.key_col, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END)
    USING p_ids, p_instance_id, v_expiry, v_now, p_category;
END
$$;

-- Mark rows done that p_instance_id still holds, storing p_results[i] (jsonb, may be
-- NULL) as the result of p_ids[i]. Returns every id with 'done' or 'lost' (not held by
-- the caller any more, or already done). Completed heads hand over to the next row of
-- their stream.
CREATE FUNCTION workpump.complete_work(
    p_instance_id uuid,
    p_category text,
    p_ids uuid[],
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
    v_done uuid[];
    v_scopes text[];
    v_streams text[];
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION 'complete_work needs p_instance_id: completion is fenced by the holder.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_ids('complete_work', p_ids);
    IF p_results IS NOT NULL AND cardinality(p_results) <> cardinality(p_ids) THEN
        RAISE EXCEPTION 'complete_work got % ids but % results.', cardinality(p_ids), cardinality(p_results)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;

    EXECUTE format($q$
        WITH done AS (
            -- fenced: only undone rows the caller holds
            UPDATE %1$I t
            SET %3$I = $3, instance_id = NULL, lease_expiry = NULL, result = i.result
            FROM unnest($1::uuid[], coalesce($4::jsonb[], array_fill(NULL::jsonb, ARRAY[cardinality($1)])))
                 AS i(id, result)
            WHERE t.%2$I = i.id AND t.instance_id = $2 AND t.%3$I IS NULL
            RETURNING t.%2$I AS id, t.stream, %4$s AS scope
        )
        SELECT coalesce(array_agg(d.id), '{}'), coalesce(array_agg(d.scope), '{}'),
               coalesce(array_agg(d.stream), '{}')
        FROM done d$q$,
        v_meta.tbl, v_meta.key_col, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END)
    INTO v_done, v_scopes, v_streams
    USING p_ids, p_instance_id, v_now, p_results;

    IF EXISTS (SELECT 1 FROM unnest(v_streams) s WHERE s IS NOT NULL) THEN
        PERFORM workpump.promote_stream_heads(p_category, v_scopes, v_streams);
        -- the claimer no longer works on these streams
        UPDATE workpump_active_stream s SET owner_instance_id = NULL, lease_expiry = NULL
        FROM unnest(v_scopes, v_streams) u(scope, stream)
        WHERE s.category = p_category AND s.scope = u.scope AND s.stream = u.stream
          AND s.owner_instance_id = p_instance_id;
    END IF;

    RETURN QUERY
    SELECT i.id, CASE WHEN i.id = ANY (v_done) THEN 'done' ELSE 'lost' END
    FROM unnest(p_ids) i(id);
END
$$;

-- Seconds until the retry after failed attempt number p_attempts: p_base * 2^(n-1),
-- capped at p_max, plus up to 10% jitter that is stable for a row and attempt (so peers
-- do not retry in lockstep and tests can predict the range).
CREATE FUNCTION workpump.retry_delay_seconds(
    p_key text, p_attempts integer, p_base_seconds integer, p_max_seconds integer
) RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN least(p_base_seconds * 2 ^ greatest(p_attempts - 1, 0), p_max_seconds)
       * (1 + (abs(hashtext(p_key || ':' || p_attempts)) % 1000) / 10000.0);

-- Record failed attempts of rows p_instance_id still holds: the error and reason, the
-- lease released, and a retry scheduled after retry_delay_seconds, or the row parked
-- as dead when its attempts are used up. Attempts are not bumped: the claim counted
-- this attempt. Returns every id with 'retry', 'dead' or 'lost'.
CREATE FUNCTION workpump.fail_work(
    p_instance_id uuid,
    p_category text,
    p_ids uuid[],
    p_errors text[],
    p_reasons text[] DEFAULT NULL,
    p_retry_base_seconds integer DEFAULT 30,
    p_retry_max_seconds integer DEFAULT 300,
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
        RAISE EXCEPTION 'fail_work needs p_instance_id: failure is fenced by the holder.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_ids('fail_work', p_ids);
    IF coalesce(cardinality(p_errors), 0) <> coalesce(cardinality(p_ids), 0)
       OR (p_reasons IS NOT NULL AND cardinality(p_reasons) <> cardinality(p_ids)) THEN
        RAISE EXCEPTION 'fail_work needs one error (and one reason, when given) per id: got % ids, % errors, % reasons.',
            coalesce(cardinality(p_ids), 0), coalesce(cardinality(p_errors), 0),
            coalesce(cardinality(p_reasons), 0)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_retry_base_seconds IS NULL OR p_retry_base_seconds < 0
       OR p_retry_max_seconds IS NULL OR p_retry_max_seconds < 0 THEN
        RAISE EXCEPTION 'fail_work needs retry seconds >= 0 (got base %, max %).',
            coalesce(p_retry_base_seconds::text, 'NULL'), coalesce(p_retry_max_seconds::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;

    RETURN QUERY EXECUTE format($q$
        WITH input AS (
            SELECT i.id, i.error, coalesce(i.reason, 'handler_error') AS reason
            FROM unnest($1::uuid[], $2::text[],
                        coalesce($3::text[], array_fill(NULL::text, ARRAY[cardinality($1)])))
                 AS i(id, error, reason)
        ), failed AS (
            -- fenced: only undone rows the caller holds; dead when attempts are used up
            UPDATE %1$I t SET
                instance_id = NULL, lease_expiry = NULL, lease_renewals = 0, claimed_at = NULL,
                last_error = i.error,
                failure_reason = CASE WHEN t.attempts >= t.max_attempts
                                      THEN 'max_attempts' ELSE i.reason END,
                dead_lettered_at = CASE WHEN t.attempts >= t.max_attempts THEN $5 END,
                scheduled_for = CASE
                    WHEN t.attempts >= t.max_attempts THEN NULL
                    WHEN $6 = 0 OR $7 = 0 THEN NULL  -- retry at once: straight to ready
                    ELSE $5 + make_interval(secs => workpump.retry_delay_seconds(
                        t.%2$I::text, t.attempts, $6, $7)) END
            FROM input i
            WHERE t.%2$I = i.id AND t.instance_id = $4 AND t.%3$I IS NULL
            RETURNING t.%2$I AS id, t.dead_lettered_at IS NOT NULL AS dead, t.scheduled_for,
                      t.stream, %4$s AS scope
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
        FROM input i LEFT JOIN failed f ON f.id = i.id
        LEFT JOIN ready_now ON true$q$,
        v_meta.tbl, v_meta.key_col, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END)
    USING p_ids, p_errors, p_reasons, p_instance_id, v_now, p_retry_base_seconds,
          p_retry_max_seconds, p_category;
END
$$;

-- Hand back rows p_instance_id holds but never started (prefetched, or behind a failed
-- row of the same stream): lease released and the attempt given back. Returns every id
-- with 'released' or 'lost'.
CREATE FUNCTION workpump.release_work(
    p_instance_id uuid,
    p_category text,
    p_ids uuid[],
    p_now timestamptz DEFAULT NULL
) RETURNS TABLE (work_id uuid, status text)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_released uuid[];
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION 'release_work needs p_instance_id: release is fenced by the holder.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_ids('release_work', p_ids);
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;
    EXECUTE format($q$
        WITH released AS (
            UPDATE %1$I t
            SET instance_id = NULL, lease_expiry = NULL, lease_renewals = 0, claimed_at = NULL,
                attempts = greatest(t.attempts - 1, 0)
            WHERE t.%2$I = ANY ($1) AND t.instance_id = $2 AND t.%3$I IS NULL
            RETURNING t.%2$I AS id, t.stream, %4$s AS scope
        ), streams AS (
            -- the caller no longer works on these streams
            UPDATE workpump_active_stream s SET owner_instance_id = NULL, lease_expiry = NULL
            FROM released r
            WHERE s.category = $3 AND s.scope = r.scope AND s.stream = r.stream
              AND s.owner_instance_id = $2
        )
        SELECT coalesce(array_agg(r.id), '{}') FROM released r$q$,
        v_meta.tbl, v_meta.key_col, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END)
    INTO v_released
    USING p_ids, p_instance_id, p_category;
    IF cardinality(v_released) > 0 THEN
        PERFORM pg_notify('workpump_' || p_category, p_category);
    END IF;
    RETURN QUERY
    SELECT i.id, CASE WHEN i.id = ANY (v_released) THEN 'released' ELSE 'lost' END
    FROM unnest(p_ids) i(id);
END
$$;
