-- Schema version 4: an instance that died holding its alive-lock is evicted one grace
-- after its lock was seen missing, whatever the age of its last heartbeat.
--
-- Version 3 evicted such an instance only once its heartbeat was also older than the
-- stale cutoff, although its lock vanished the moment its process died: failover took
-- up to the stale cutoff plus a probe. Now a missing lock alone evicts, once the grace
-- from its first sighting has passed, provided the instance has not beaten since that
-- sighting. A live instance that loses its lock (listener blip, pooler or server
-- restart) beats at once, and its beat stamps alive_lock_lost_at itself: from then on
-- only its heartbeat's age can evict it, as in heartbeat-table mode. An instance that
-- never holds its lock (heartbeat-table mode) stamps itself on every beat, so this rule
-- never applies to it. With a grace of 0 (heartbeat-table mode observers) the rule is
-- off and version 3's stands.
--
-- Failover for a process that dies holding its lock is therefore at most one stale-peer
-- probe interval (to see the lock missing) plus the grace (one fast heartbeat interval)
-- plus one claim, which the orphan NOTIFY starts at once.
--
-- record_heartbeat and cleanup_stale_instances keep their signatures (an instance of
-- the previous release keeps working during a rolling deploy); stale_peer_exists stays
-- for the same reason, and next_eviction_in is the probe that knows the new rule.

-- The eviction rule, in one place: may an instance with this heartbeat and alive-lock
-- state be evicted at the given cutoffs? p_lock_lost_cutoff is now minus the grace;
-- p_fast_lock_loss turns on the rule for a lock lost with no beat since (grace > 0).
CREATE FUNCTION workpump.instance_evictable(
    p_last_heartbeat_at timestamptz,
    p_alive_lock_lost_at timestamptz,
    p_alive_lock_held boolean,
    p_stale_cutoff timestamptz,
    p_definitive_dead_cutoff timestamptz,
    p_lock_lost_cutoff timestamptz,
    p_fast_lock_loss boolean
) RETURNS boolean
LANGUAGE sql IMMUTABLE
RETURN coalesce(
        -- stale, and silent past the definitive cutoff (nothing protects it) or its lock
        -- missing for the whole grace
        (p_last_heartbeat_at < p_stale_cutoff
         AND ((p_definitive_dead_cutoff IS NOT NULL
               AND p_last_heartbeat_at < p_definitive_dead_cutoff)
              OR (NOT p_alive_lock_held AND p_alive_lock_lost_at <= p_lock_lost_cutoff)))
        -- the fast rule: its lock missing for the whole grace, and no beat since the lock
        -- was first seen missing
        OR (p_fast_lock_loss AND NOT p_alive_lock_held
            AND p_alive_lock_lost_at <= p_lock_lost_cutoff
            AND p_last_heartbeat_at < p_alive_lock_lost_at),
        false);

-- The short-cadence probe: note alive-lock changes, then say in how many seconds the
-- first peer other than p_instance_id becomes evictable: 0 when one is evictable now,
-- NULL when no peer is on its way (every lock held, every heartbeat fresh). A read
-- unless some lock state changed. The probe reaps at 0 and otherwise looks again no
-- later than the answer, so a lost lock is acted on when its grace ends, not at the
-- next regular probe.
CREATE FUNCTION workpump.next_eviction_in(
    p_instance_id uuid,
    p_stale_after_seconds integer,
    p_definitively_dead_after_seconds integer,
    p_lock_loss_grace_seconds double precision,
    p_now timestamptz DEFAULT NULL
) RETURNS double precision
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_stale interval := make_interval(secs => p_stale_after_seconds);
    v_dead interval := make_interval(secs => p_definitively_dead_after_seconds);
    v_grace interval := make_interval(secs => p_lock_loss_grace_seconds);
    v_fast boolean := p_lock_loss_grace_seconds > 0;
    v_held integer[];
    v_due timestamptz;
BEGIN
    IF p_stale_after_seconds IS NULL OR p_stale_after_seconds <= 0
       OR p_definitively_dead_after_seconds IS NULL
       OR p_definitively_dead_after_seconds < p_stale_after_seconds
       OR p_lock_loss_grace_seconds IS NULL OR p_lock_loss_grace_seconds < 0 THEN
        RAISE EXCEPTION 'next_eviction_in needs 0 < p_stale_after_seconds (%) <= p_definitively_dead_after_seconds (%) and p_lock_loss_grace_seconds >= 0 (%).',
            p_stale_after_seconds, p_definitively_dead_after_seconds,
            coalesce(p_lock_loss_grace_seconds::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.observe_alive_locks(v_now);
    v_held := ARRAY(SELECT workpump.held_alive_lock_keys());

    SELECT min(CASE
        WHEN workpump.instance_evictable(si.last_heartbeat_at, si.alive_lock_lost_at,
                                         si.alive_lock_key = ANY (v_held),
                                         v_now - v_stale, v_now - v_dead, v_now - v_grace,
                                         v_fast)
            THEN v_now
        -- otherwise the earliest time the rule could hold, if nothing changes meanwhile
        ELSE least(
            si.last_heartbeat_at + v_dead,
            CASE WHEN si.alive_lock_key = ANY (v_held) THEN NULL
                 WHEN v_fast AND si.last_heartbeat_at < si.alive_lock_lost_at
                     THEN si.alive_lock_lost_at + v_grace
                 ELSE greatest(si.alive_lock_lost_at + v_grace, si.last_heartbeat_at + v_stale)
            END)
        END)
    INTO v_due
    FROM workpump_service_instance si
    WHERE si.instance_id <> p_instance_id;

    -- (greatest ignores a NULL: no peer on its way must stay NULL, not become 0)
    RETURN CASE WHEN v_due IS NOT NULL
                THEN greatest(extract(epoch FROM v_due - v_now), 0)::double precision END;
END
$$;

-- Evict the instances instance_evictable names at these cutoffs (grace counted from
-- when each alive-lock was first seen missing). For each evicted instance: a tombstone,
-- every lease it held released (the open attempt stamped), its streams released, and
-- one NOTIFY on workpump_orphan so live peers claim the work at once. Returns the
-- evicted ids. A server that started after p_stale_cutoff evicts nobody: a restart drops
-- every alive-lock and interrupts every heartbeat, so neither is evidence of death yet.
CREATE OR REPLACE FUNCTION workpump.cleanup_stale_instances(
    p_stale_cutoff timestamptz,
    p_definitive_dead_cutoff timestamptz DEFAULT NULL,
    p_now timestamptz DEFAULT NULL,
    p_lock_loss_grace_seconds double precision DEFAULT 0
) RETURNS TABLE (instance_id uuid)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_lock_lost_cutoff timestamptz;
    v_fast boolean := p_lock_loss_grace_seconds > 0;
    v_held integer[];
    v_evicted uuid[];
    v_category text;
    v_meta record;
BEGIN
    IF p_stale_cutoff IS NULL THEN
        RAISE EXCEPTION 'cleanup_stale_instances needs p_stale_cutoff.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_lock_loss_grace_seconds IS NULL OR p_lock_loss_grace_seconds < 0 THEN
        RAISE EXCEPTION 'cleanup_stale_instances needs p_lock_loss_grace_seconds >= 0, not %.',
            coalesce(p_lock_loss_grace_seconds::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- (a p_now before the server's start, as in tests, is a time before the restart)
    IF pg_postmaster_start_time() <= v_now AND pg_postmaster_start_time() > p_stale_cutoff THEN
        RETURN;
    END IF;
    v_lock_lost_cutoff := v_now - make_interval(secs => p_lock_loss_grace_seconds);
    IF NOT EXISTS (SELECT 1 FROM workpump_service_instance si
                   WHERE si.last_heartbeat_at < p_stale_cutoff
                      OR (v_fast AND si.last_heartbeat_at < si.alive_lock_lost_at
                          AND si.alive_lock_lost_at <= v_lock_lost_cutoff)) THEN
        RETURN;  -- nobody to evict: a no-op, stamps included (the probe takes them)
    END IF;
    PERFORM workpump.observe_alive_locks(v_now);
    v_held := ARRAY(SELECT workpump.held_alive_lock_keys());

    WITH evicted AS (
        -- every instance the rule names
        DELETE FROM workpump_service_instance si
        WHERE workpump.instance_evictable(si.last_heartbeat_at, si.alive_lock_lost_at,
                                          si.alive_lock_key = ANY (v_held), p_stale_cutoff,
                                          p_definitive_dead_cutoff, v_lock_lost_cutoff, v_fast)
        RETURNING si.instance_id, si.service_name, si.host_name, si.process_id,
                  si.last_heartbeat_at, si.alive_lock_lost_at
    ), tombstones AS (
        -- a tombstone per evicted instance: its next heartbeat is refused
        INSERT INTO workpump_eviction (instance_id, evicted_at, reason)
        SELECT e.instance_id, v_now,
               CASE WHEN e.last_heartbeat_at >= p_stale_cutoff
                    THEN format('%s@%s pid %s: its alive-lock has been missing since %s with no heartbeat since (last %s)',
                                e.service_name, e.host_name, e.process_id,
                                e.alive_lock_lost_at, e.last_heartbeat_at)
                    ELSE format('%s@%s pid %s: last heartbeat %s is older than the stale cutoff %s%s',
                                e.service_name, e.host_name, e.process_id, e.last_heartbeat_at,
                                p_stale_cutoff,
                                CASE WHEN e.alive_lock_lost_at IS NOT NULL
                                     THEN format(' and its alive-lock has been missing since %s',
                                                 e.alive_lock_lost_at)
                                     ELSE '' END)
               END
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

-- Record a heartbeat: upsert the instance row with last_heartbeat_at = now, and stamp
-- alive_lock_lost_at with now when this instance's alive-lock is not held (clear it when
-- it is): a beat without the lock proves the instance outlived the loss, so only its
-- heartbeat's age can evict it from here on. False, with nothing written, when the
-- instance was evicted (it must stop claiming and exit). Then, if another instance may
-- be evictable, evict without waiting on row locks.
CREATE OR REPLACE FUNCTION workpump.record_heartbeat(
    p_instance_id uuid,
    p_service_name text,
    p_host_name text,
    p_process_id integer,
    p_metadata jsonb DEFAULT '{}',
    p_stale_after_seconds integer DEFAULT 30,
    p_definitively_dead_after_seconds integer DEFAULT 300,
    p_now timestamptz DEFAULT NULL,
    p_lock_loss_grace_seconds double precision DEFAULT 0
) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_stale_cutoff timestamptz := v_now - make_interval(secs => p_stale_after_seconds);
    v_dead_cutoff timestamptz := v_now - make_interval(secs => p_definitively_dead_after_seconds);
    v_held integer[];
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
    IF p_lock_loss_grace_seconds IS NULL OR p_lock_loss_grace_seconds < 0 THEN
        RAISE EXCEPTION 'record_heartbeat needs p_lock_loss_grace_seconds >= 0, not %.',
            coalesce(p_lock_loss_grace_seconds::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF EXISTS (SELECT 1 FROM workpump_eviction WHERE instance_id = p_instance_id) THEN
        RETURN false;
    END IF;
    v_held := ARRAY(SELECT workpump.held_alive_lock_keys());

    UPDATE workpump_service_instance
    SET last_heartbeat_at = v_now, metadata = coalesce(p_metadata, '{}'),
        service_name = p_service_name, host_name = p_host_name, process_id = p_process_id,
        alive_lock_lost_at = CASE WHEN alive_lock_key = ANY (v_held) THEN NULL ELSE v_now END
    WHERE instance_id = p_instance_id;
    IF NOT FOUND THEN
        -- only a new registration draws an alive-lock key, so keys are not burnt per beat;
        -- its lock is taken after this beat, so it starts stamped as missing
        INSERT INTO workpump_service_instance (instance_id, service_name, host_name, process_id,
                                               started_at, last_heartbeat_at, metadata,
                                               alive_lock_key, alive_lock_lost_at)
        VALUES (p_instance_id, p_service_name, p_host_name, p_process_id, v_now, v_now,
                coalesce(p_metadata, '{}'), nextval('workpump.alive_lock_key_seq'), v_now)
        ON CONFLICT (instance_id) DO UPDATE
            SET last_heartbeat_at = excluded.last_heartbeat_at, metadata = excluded.metadata,
                alive_lock_lost_at = CASE WHEN workpump_service_instance.alive_lock_key = ANY (v_held)
                                          THEN NULL ELSE excluded.last_heartbeat_at END;
    END IF;

    -- An eviction that committed while this beat waited for the row must still win:
    -- look again with a fresh snapshot and undo the resurrection.
    IF EXISTS (SELECT 1 FROM workpump_eviction WHERE instance_id = p_instance_id) THEN
        DELETE FROM workpump_service_instance WHERE instance_id = p_instance_id;
        RETURN false;
    END IF;

    -- a peer is stale, or (the fast rule) lost its lock a grace ago with no beat since
    IF EXISTS (SELECT 1 FROM workpump_service_instance si
               WHERE si.instance_id <> p_instance_id
                 AND (si.last_heartbeat_at < v_stale_cutoff
                      OR (p_lock_loss_grace_seconds > 0
                          AND si.last_heartbeat_at < si.alive_lock_lost_at
                          AND si.alive_lock_lost_at
                              <= v_now - make_interval(secs => p_lock_loss_grace_seconds)))) THEN
        BEGIN
            -- a heartbeat never waits on a claim's row locks: give up and let the next
            -- beat or maintenance reap
            PERFORM workpump.reap_without_waiting(v_stale_cutoff, v_dead_cutoff, v_now,
                                                  p_lock_loss_grace_seconds);
        EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
            NULL;
        END;
    END IF;
    RETURN true;
END
$$;
