-- Schema version 23: a row whose last attempt timed out is dead with reason 'timeout'.
--
-- fail_work parked every row whose attempts were used up with reason 'max_attempts',
-- so a handler that ran out its timeout on its last attempt read 'max_attempts' while
-- its log line and metric said 'timeout'; a row dead-lettered for a not-retryable
-- exception or an undecodable payload on its last attempt read 'max_attempts' too.
-- Those reasons are now kept; any other becomes 'max_attempts' as before.

-- Record failed attempts of rows p_instance_id still holds under p_lease_tokens[i]: the
-- error and reason, the lease released, and a retry scheduled after p_retry_delays[i]
-- seconds (the handler's own backoff; 0 retries at once) or, where that is NULL or not
-- given, after retry_delay_seconds; or the row parked as dead when its attempts are used
-- up, with reason 'max_attempts' unless the last attempt's own reason says why it
-- could not succeed ('timeout', 'not_retryable', 'undecodable_payload'). Attempts are
-- not bumped: the claim counted this attempt. Returns every id with 'retry', 'dead' or
-- 'lost'.
CREATE OR REPLACE FUNCTION workpump.fail_work(
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
                failure_reason = CASE
                    WHEN t.attempts >= t.max_attempts
                         AND i.reason NOT IN ('timeout', 'not_retryable', 'undecodable_payload')
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
