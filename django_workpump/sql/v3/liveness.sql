-- Schema version 3: a grace period for an instance whose alive-lock just went missing.
--
-- In lock mode an instance beats slowly, so its heartbeat is often past the stale cutoff
-- and only its alive-lock keeps it live. When its LISTEN connection drops (a network
-- blip, a pooler or proxy restart, pg_terminate_backend) the lock goes with it, and a
-- peer probing at that moment used to evict a live instance before it could beat. A
-- peer cannot tell that blip from a death at the instant the lock vanishes; only time
-- can. So the first observer stamps alive_lock_lost_at, and eviction for a missing lock
-- waits p_lock_loss_grace_seconds from that stamp: enough for a live instance, which
-- beats at once on losing its listener, to prove itself. The stamp is taken by the
-- short-cadence probe (stale_peer_exists) as well as by eviction, so for an instance
-- that died with a fresh heartbeat the grace has long run out by the time it is stale:
-- failover is not slowed. With a grace of 0 the rule is exactly version 1's.

DROP FUNCTION workpump.record_heartbeat(uuid, text, text, integer, jsonb, integer, integer, timestamptz);
DROP FUNCTION workpump.reap_without_waiting(timestamptz, timestamptz, timestamptz);
DROP FUNCTION workpump.cleanup_stale_instances(timestamptz, timestamptz, timestamptz);

-- Stamp alive_lock_lost_at on instances whose alive-lock is not held and clear it on
-- those that hold it again. A read unless some instance's lock state changed since it
-- was last seen: the probe that calls it runs every few seconds on every instance.
CREATE FUNCTION workpump.observe_alive_locks(p_now timestamptz DEFAULT NULL) RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_held integer[] := ARRAY(SELECT workpump.held_alive_lock_keys());
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM workpump_service_instance si
        WHERE (si.alive_lock_lost_at IS NULL) <> (si.alive_lock_key = ANY (v_held))
    ) THEN
        RETURN;
    END IF;
    UPDATE workpump_service_instance si
    SET alive_lock_lost_at = CASE WHEN si.alive_lock_key = ANY (v_held) THEN NULL
                                  ELSE coalesce(p_now, now()) END
    WHERE (si.alive_lock_lost_at IS NULL) <> (si.alive_lock_key = ANY (v_held));
END
$$;

-- The short-cadence probe: note alive-lock changes, then say whether any instance other
-- than p_instance_id has a heartbeat older than the stale cutoff.
CREATE FUNCTION workpump.stale_peer_exists(
    p_instance_id uuid,
    p_stale_after_seconds integer,
    p_now timestamptz DEFAULT NULL
) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
BEGIN
    PERFORM workpump.observe_alive_locks(v_now);
    RETURN EXISTS (
        SELECT 1 FROM workpump_service_instance
        WHERE last_heartbeat_at < v_now - make_interval(secs => p_stale_after_seconds)
          AND instance_id <> p_instance_id);
END
$$;

-- Evict the instances whose heartbeat is older than p_stale_cutoff, except those whose
-- alive-lock is held or was first seen missing less than p_lock_loss_grace_seconds ago,
-- unless their heartbeat is also older than p_definitive_dead_cutoff (NULL: the lock
-- always protects). For each evicted instance: a tombstone, every lease it held released
-- (the open attempt stamped), its streams released, and one NOTIFY on workpump_orphan so
-- live peers claim the work at once. Returns the evicted ids.
-- A server that started after p_stale_cutoff evicts nobody: a restart drops every
-- alive-lock and interrupts every heartbeat, so neither is evidence of death yet.
CREATE FUNCTION workpump.cleanup_stale_instances(
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
    IF NOT EXISTS (SELECT 1 FROM workpump_service_instance si
                   WHERE si.last_heartbeat_at < p_stale_cutoff) THEN
        RETURN;  -- nobody to evict: a no-op, stamps included (the probe takes them)
    END IF;
    PERFORM workpump.observe_alive_locks(v_now);
    v_lock_lost_cutoff := v_now - make_interval(secs => p_lock_loss_grace_seconds);

    WITH evicted AS (
        -- stale, and not protected by a held (or only just lost) alive-lock, or past the
        -- definitive cutoff
        DELETE FROM workpump_service_instance si
        WHERE si.last_heartbeat_at < p_stale_cutoff
          AND ((p_definitive_dead_cutoff IS NOT NULL
                AND si.last_heartbeat_at < p_definitive_dead_cutoff)
               OR (si.alive_lock_key NOT IN (SELECT workpump.held_alive_lock_keys())
                   AND si.alive_lock_lost_at <= v_lock_lost_cutoff))
        RETURNING si.instance_id, si.service_name, si.host_name, si.process_id,
                  si.last_heartbeat_at, si.alive_lock_lost_at
    ), tombstones AS (
        -- a tombstone per evicted instance: its next heartbeat is refused
        INSERT INTO workpump_eviction (instance_id, evicted_at, reason)
        SELECT e.instance_id, v_now,
               format('%s@%s pid %s: last heartbeat %s is older than the stale cutoff %s%s',
                      e.service_name, e.host_name, e.process_id, e.last_heartbeat_at,
                      p_stale_cutoff,
                      CASE WHEN e.alive_lock_lost_at IS NOT NULL
                           THEN format(' and its alive-lock has been missing since %s',
                                       e.alive_lock_lost_at)
                           ELSE '' END)
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
    p_now timestamptz DEFAULT NULL,
    p_lock_loss_grace_seconds double precision DEFAULT 0
) RETURNS SETOF uuid
LANGUAGE sql
SET search_path FROM CURRENT
SET lock_timeout = '100ms'
AS $$
    SELECT instance_id
    FROM workpump.cleanup_stale_instances(p_stale_cutoff, p_definitive_dead_cutoff, p_now,
                                          p_lock_loss_grace_seconds);
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
            PERFORM workpump.reap_without_waiting(v_stale_cutoff, v_dead_cutoff, v_now,
                                                  p_lock_loss_grace_seconds);
        EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
            NULL;
        END;
    END IF;
    RETURN true;
END
$$;
