-- Liveness (docs/architecture.md, Liveness): the alive-lock, the one rule that says who is live, the
-- heartbeat, eviction of stale instances and graceful deregistration.
--
-- The liveness rule, used by every reader (rank, reaping, notify targets): an instance
-- is live iff its heartbeat is fresher than the stale cutoff, or its alive-lock is held
-- and its heartbeat is fresher than the definitive-dead cutoff.

-- alive_lock_key values whose alive-lock some session of this database holds now.
CREATE FUNCTION workpump.held_alive_lock_keys() RETURNS SETOF integer
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT l.objid::text::integer
    FROM pg_locks l
    WHERE l.locktype = 'advisory'
      AND l.granted
      AND l.objsubid = 2
      AND l.classid = workpump.lock_namespace('alive')::oid
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database());
$$;

-- Take this instance's alive-lock on the calling session (the instance's dedicated
-- LISTEN connection). False when the instance is not registered yet or another session
-- holds the lock (a duplicate start). The lock lives as long as the session.
CREATE FUNCTION workpump.take_alive_lock(p_instance_id uuid) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_key integer;
BEGIN
    SELECT alive_lock_key INTO v_key FROM workpump_service_instance
    WHERE instance_id = p_instance_id;
    IF v_key IS NULL THEN
        RETURN false;
    END IF;
    RETURN pg_try_advisory_lock(workpump.lock_namespace('alive'), v_key);
END
$$;

-- Is this instance's alive-lock held by any session (read from pg_locks)?
CREATE FUNCTION workpump.alive_lock_held(p_instance_id uuid) RETURNS boolean
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT EXISTS (
        SELECT 1 FROM workpump_service_instance si
        WHERE si.instance_id = p_instance_id
          AND si.alive_lock_key IN (SELECT workpump.held_alive_lock_keys())
    );
$$;

-- The live instances under the liveness rule.
CREATE FUNCTION workpump.live_instances(
    p_stale_cutoff timestamptz,
    p_definitive_dead_cutoff timestamptz DEFAULT NULL
) RETURNS SETOF uuid
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT si.instance_id
    FROM workpump_service_instance si
    WHERE si.last_heartbeat_at >= p_stale_cutoff
       OR (si.last_heartbeat_at >= coalesce(p_definitive_dead_cutoff, '-infinity')
           AND si.alive_lock_key IN (SELECT workpump.held_alive_lock_keys()));
$$;

-- Evict the instances whose heartbeat is older than p_stale_cutoff, except those whose
-- alive-lock is held, unless their heartbeat is also older than p_definitive_dead_cutoff
-- (NULL: the lock always protects). For each evicted instance: a tombstone, every lease
-- it held released (the open attempt stamped), its streams released, and one NOTIFY on
-- workpump_orphan so live peers claim the work at once. Returns the evicted ids.
-- A server that started after p_stale_cutoff evicts nobody: a restart drops every
-- alive-lock and interrupts every heartbeat, so neither is evidence of death yet.
CREATE FUNCTION workpump.cleanup_stale_instances(
    p_stale_cutoff timestamptz,
    p_definitive_dead_cutoff timestamptz DEFAULT NULL,
    p_now timestamptz DEFAULT NULL
) RETURNS TABLE (instance_id uuid)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_evicted uuid[];
    v_category text;
    v_meta record;
BEGIN
    IF p_stale_cutoff IS NULL THEN
        RAISE EXCEPTION 'cleanup_stale_instances needs p_stale_cutoff.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- (a p_now before the server's start, as in tests, is a time before the restart)
    IF pg_postmaster_start_time() <= v_now AND pg_postmaster_start_time() > p_stale_cutoff THEN
        RETURN;
    END IF;

    WITH evicted AS (
        -- stale, and not protected by a held alive-lock (or past the definitive cutoff)
        DELETE FROM workpump_service_instance si
        WHERE si.last_heartbeat_at < p_stale_cutoff
          AND ((p_definitive_dead_cutoff IS NOT NULL
                AND si.last_heartbeat_at < p_definitive_dead_cutoff)
               OR si.alive_lock_key NOT IN (SELECT workpump.held_alive_lock_keys()))
        RETURNING si.instance_id, si.service_name, si.host_name, si.process_id,
                  si.last_heartbeat_at
    ), tombstones AS (
        -- a tombstone per evicted instance: its next heartbeat is refused
        INSERT INTO workpump_eviction (instance_id, evicted_at, reason)
        SELECT e.instance_id, v_now,
               format('%s@%s pid %s: last heartbeat %s is older than the stale cutoff %s',
                      e.service_name, e.host_name, e.process_id, e.last_heartbeat_at,
                      p_stale_cutoff)
        FROM evicted e
        ON CONFLICT ON CONSTRAINT workpump_eviction_pkey DO NOTHING
    )
    SELECT coalesce(array_agg(e.instance_id ORDER BY e.instance_id), '{}') INTO v_evicted
    FROM evicted e;

    IF cardinality(v_evicted) = 0 THEN
        RETURN;
    END IF;

    FOREACH v_category IN ARRAY ARRAY['outbox', 'inbox', 'perspective_event', 'receptor'] LOOP
        v_meta := workpump.work_table(v_category);
        -- release every lease of the evicted instances; claimed_at stays set so the
        -- attempt still reads as open (orphaned) until the row is claimed again
        EXECUTE format(
            $q$UPDATE %1$I t
               SET instance_id = NULL, lease_expiry = NULL, lease_renewals = 0,
                   failure_reason = 'instance_evicted',
                   last_error = format('attempt %%s ended without a reported outcome: instance %%s was evicted at %%s',
                                       t.attempts, t.instance_id, $2)
               WHERE t.instance_id = ANY ($1)$q$,
            v_meta.tbl)
        USING v_evicted, v_now;
    END LOOP;

    UPDATE workpump_active_stream s
    SET owner_instance_id = NULL, lease_expiry = NULL
    WHERE s.owner_instance_id = ANY (v_evicted);

    PERFORM pg_notify('workpump_orphan', 'evicted');
    RETURN QUERY SELECT unnest(v_evicted);
END
$$;

-- cleanup_stale_instances with a 100 ms lock timeout, restored when this returns (a SET
-- clause, so the caller's own lock_timeout is untouched either way).
CREATE FUNCTION workpump.reap_without_waiting(
    p_stale_cutoff timestamptz,
    p_definitive_dead_cutoff timestamptz,
    p_now timestamptz DEFAULT NULL
) RETURNS SETOF uuid
LANGUAGE sql
SET search_path FROM CURRENT
SET lock_timeout = '100ms'
AS $$
    SELECT instance_id FROM workpump.cleanup_stale_instances(p_stale_cutoff, p_definitive_dead_cutoff, p_now);
$$;

-- Record a heartbeat: upsert the instance row with last_heartbeat_at = now. False, with
-- nothing written, when the instance was evicted (it must stop claiming and exit). Then,
-- if another instance looks stale, evict the stale ones without waiting on row locks.
CREATE FUNCTION workpump.record_heartbeat(
    p_instance_id uuid,
    p_service_name text,
    p_host_name text,
    p_process_id integer,
    p_metadata jsonb DEFAULT '{}',
    p_stale_after_seconds integer DEFAULT 30,
    p_definitively_dead_after_seconds integer DEFAULT 300,
    p_now timestamptz DEFAULT NULL
) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_stale_cutoff timestamptz := v_now - make_interval(secs => p_stale_after_seconds);
    v_dead_cutoff timestamptz := v_now - make_interval(secs => p_definitively_dead_after_seconds);
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION 'record_heartbeat needs p_instance_id.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_stale_after_seconds IS NULL OR p_stale_after_seconds <= 0
       OR p_definitively_dead_after_seconds IS NULL
       OR p_definitively_dead_after_seconds < p_stale_after_seconds THEN
        RAISE EXCEPTION 'record_heartbeat needs 0 < p_stale_after_seconds (%) <= p_definitively_dead_after_seconds (%).',
            p_stale_after_seconds, p_definitively_dead_after_seconds
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF EXISTS (SELECT 1 FROM workpump_eviction WHERE instance_id = p_instance_id) THEN
        RETURN false;
    END IF;

    UPDATE workpump_service_instance
    SET last_heartbeat_at = v_now, metadata = coalesce(p_metadata, '{}'),
        service_name = p_service_name, host_name = p_host_name, process_id = p_process_id
    WHERE instance_id = p_instance_id;
    IF NOT FOUND THEN
        -- only a new registration draws an alive-lock key, so keys are not burnt per beat
        INSERT INTO workpump_service_instance (instance_id, service_name, host_name, process_id,
                                               started_at, last_heartbeat_at, metadata,
                                               alive_lock_key)
        VALUES (p_instance_id, p_service_name, p_host_name, p_process_id, v_now, v_now,
                coalesce(p_metadata, '{}'), nextval('workpump.alive_lock_key_seq'))
        ON CONFLICT (instance_id) DO UPDATE
            SET last_heartbeat_at = excluded.last_heartbeat_at, metadata = excluded.metadata;
    END IF;

    -- An eviction that committed while this beat waited for the row must still win:
    -- look again with a fresh snapshot and undo the resurrection.
    IF EXISTS (SELECT 1 FROM workpump_eviction WHERE instance_id = p_instance_id) THEN
        DELETE FROM workpump_service_instance WHERE instance_id = p_instance_id;
        RETURN false;
    END IF;

    IF EXISTS (SELECT 1 FROM workpump_service_instance
               WHERE last_heartbeat_at < v_stale_cutoff AND instance_id <> p_instance_id) THEN
        BEGIN
            -- a heartbeat never waits on a claim's row locks: give up and let the next
            -- beat or maintenance reap
            PERFORM workpump.reap_without_waiting(v_stale_cutoff, v_dead_cutoff, v_now);
        EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
            NULL;
        END;
    END IF;
    RETURN true;
END
$$;

-- Graceful shutdown: release every row this instance holds (they never started, so the
-- attempt is given back) and its streams, then delete its instance row. Returns the
-- number of rows released.
CREATE FUNCTION workpump.deregister_instance(
    p_instance_id uuid,
    p_now timestamptz DEFAULT NULL
) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_category text;
    v_meta record;
    v_count integer;
    v_total integer := 0;
BEGIN
    FOREACH v_category IN ARRAY ARRAY['outbox', 'inbox', 'perspective_event', 'receptor'] LOOP
        v_meta := workpump.work_table(v_category);
        EXECUTE format(
            $q$UPDATE %1$I t
               SET instance_id = NULL, lease_expiry = NULL, lease_renewals = 0,
                   claimed_at = NULL, attempts = greatest(t.attempts - 1, 0)
               WHERE t.instance_id = $1 AND t.%2$I IS NULL$q$,
            v_meta.tbl, v_meta.done_col)
        USING p_instance_id;
        GET DIAGNOSTICS v_count = ROW_COUNT;
        v_total := v_total + v_count;
    END LOOP;
    UPDATE workpump_active_stream SET owner_instance_id = NULL, lease_expiry = NULL
    WHERE owner_instance_id = p_instance_id;
    DELETE FROM workpump_service_instance WHERE instance_id = p_instance_id;
    IF v_total > 0 THEN
        PERFORM pg_notify('workpump_orphan', 'released');
    END IF;
    RETURN v_total;
END
$$;
