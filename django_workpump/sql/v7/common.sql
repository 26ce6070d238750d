-- Schema version 5, shared checks: which instances may claim and renew, and the lease
-- tokens that tell one attempt of a row from the next.

-- Raise SQLSTATE WP001 unless p_instance_id is registered and not tombstoned. Eviction
-- takes effect at the evicted instance's next claim or renewal, not only at its next
-- heartbeat; an instance that never registered is invisible to the peers that would
-- evict it, so it may not hold leases either.
CREATE FUNCTION workpump.check_instance(p_function text, p_instance_id uuid) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    v_evicted_at timestamptz;
    v_reason text;
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION '% needs p_instance_id.', p_function
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT e.evicted_at, e.reason INTO v_evicted_at, v_reason
    FROM workpump_eviction e WHERE e.instance_id = p_instance_id;
    IF FOUND THEN
        RAISE EXCEPTION '% refused instance %: it was evicted at % (%).',
            p_function, p_instance_id, v_evicted_at, v_reason
            USING ERRCODE = 'WP001',
                  HINT = 'An evicted instance must stop; a restarted process registers under a new id.';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM workpump_service_instance si
                   WHERE si.instance_id = p_instance_id) THEN
        RAISE EXCEPTION '% refused instance %: it is not registered.', p_function, p_instance_id
            USING ERRCODE = 'WP001',
                  HINT = 'Register it with workpump.record_heartbeat first (runworkpump does at start).';
    END IF;
END
$$;

-- Raise unless p_lease_tokens holds one non-NULL token per id of p_ids: every write after
-- a claim names the attempt it reports on, so an older attempt cannot stand for a newer.
CREATE FUNCTION workpump.check_lease_tokens(
    p_function text, p_ids uuid[], p_lease_tokens uuid[]
) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF coalesce(cardinality(p_lease_tokens), 0) <> coalesce(cardinality(p_ids), 0) THEN
        RAISE EXCEPTION '% needs one lease token per id: got % ids and % tokens.',
            p_function, coalesce(cardinality(p_ids), 0), coalesce(cardinality(p_lease_tokens), 0)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass p_lease_tokens, parallel to p_ids, as claim_work returned them.';
    END IF;
    IF array_position(p_lease_tokens, NULL) IS NOT NULL THEN
        RAISE EXCEPTION '% got a NULL lease token.', p_function
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass the lease_token claim_work returned with each row.';
    END IF;
END
$$;
