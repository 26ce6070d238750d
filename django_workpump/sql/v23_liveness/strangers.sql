-- Schema version 23 (liveness): advisory locks a stranger cannot turn against the pump,
-- and a lost alive-lock seen after the last beat wherever in its life an instance dies.
--
-- Any role that may connect can take any advisory lock. A session squatting on the
-- alive-lock keys the sequence will hand out next used to make new instances run
-- without their lock (fast cadence, eviction only by heartbeat age), and a squatter on
-- the key of an instance that died kept it "alive" until the definitive cutoff. Now an
-- instance records the backend pid of the session that took its lock (alive_lock_pid)
-- and observers count the lock only while that session holds it; a key held by another
-- session is given up for the next free one. A squatter on a stream's lock made that
-- stream's producers and completions wait forever: a contended stream lock now waits at
-- most the caller's lock_timeout (30 s without one) and then fails naming the stream and
-- the session that holds it. (The maintenance lock is bounded by the pump itself: a
-- pass skipped too often runs without it; every purge is safe to run concurrently.)
--
-- An instance registers with its lock stamped missing (the lock is taken after the
-- first beat); a peer's probe cleared that stamp only if it ran while the lock was
-- held, so an instance that died in its first seconds kept its registration stamp,
-- never newer than its last beat, and waited for the stale cutoff (about 30 s at the
-- defaults) instead of one grace. take_alive_lock now clears the stamp itself, so the
-- first probe after a death stamps the loss after the last beat and the fast rule
-- applies.
--
-- Signatures are unchanged: an instance of the previous release keeps working during a
-- rolling deploy (its take_alive_lock is this one). The alive-locks held while this
-- migration runs are recorded with their holders' pids, so no running instance looks
-- lockless to its peers afterwards.

-- alive_lock_key values whose alive-lock is held by the session that took it for its
-- instance (alive_lock_pid): the same key held by any other session proves nothing.
CREATE OR REPLACE FUNCTION workpump.held_alive_lock_keys() RETURNS SETOF integer
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT si.alive_lock_key
    FROM workpump_service_instance si
    JOIN pg_locks l
      ON l.locktype = 'advisory'
     AND l.granted
     AND l.objsubid = 2
     AND l.classid = workpump.lock_namespace('alive')::oid
     AND l.objid = si.alive_lock_key::oid
     AND l.pid = si.alive_lock_pid
     AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database());
$$;

-- Take this instance's alive-lock on the calling session (the instance's dedicated
-- LISTEN connection) and record that session's pid. A key another session holds (a
-- stranger squatting on the pump's keys, or this instance's own half-dead previous
-- session) is given up for the next key of alive_lock_key_seq that is free. Taking the
-- lock clears alive_lock_lost_at: a loss from now on is stamped by the first probe that
-- sees it, after the last beat. False when the instance is not registered (or was
-- evicted), or no free key turned up in 100,000 draws. The lock lives as long as the
-- session.
CREATE OR REPLACE FUNCTION workpump.take_alive_lock(p_instance_id uuid) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_key integer;
    v_draws integer := 0;
BEGIN
    SELECT alive_lock_key INTO v_key FROM workpump_service_instance
    WHERE instance_id = p_instance_id;
    IF v_key IS NULL THEN
        RETURN false;
    END IF;
    WHILE NOT pg_try_advisory_lock(workpump.lock_namespace('alive'), v_key) LOOP
        v_draws := v_draws + 1;
        IF v_draws > 100000 THEN
            RETURN false;
        END IF;
        v_key := nextval('workpump.alive_lock_key_seq');
    END LOOP;
    UPDATE workpump_service_instance
    SET alive_lock_key = v_key, alive_lock_pid = pg_backend_pid(), alive_lock_lost_at = NULL
    WHERE instance_id = p_instance_id;
    IF NOT FOUND THEN
        -- evicted meanwhile: hold nothing
        PERFORM pg_advisory_unlock(workpump.lock_namespace('alive'), v_key);
        RETURN false;
    END IF;
    RETURN true;
END
$$;

-- Wait for a contended transaction advisory lock, at most the caller's lock_timeout
-- (p_caller_lock_timeout; 30 s when it is 0), then fail with SQLSTATE 55P03 naming what
-- the lock guards (p_what) and the sessions that hold it. The SET clause restores the
-- caller's lock_timeout on return.
CREATE FUNCTION workpump.wait_for_xact_lock(
    p_namespace integer, p_key integer, p_what text, p_caller_lock_timeout text
) RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET lock_timeout = '30s'
AS $$
DECLARE
    v_bound text := CASE WHEN coalesce(p_caller_lock_timeout, '0') <> '0'
                         THEN p_caller_lock_timeout ELSE current_setting('lock_timeout') END;
    v_holders text;
BEGIN
    PERFORM set_config('lock_timeout', v_bound, true);
    PERFORM pg_advisory_xact_lock(p_namespace, p_key);
EXCEPTION WHEN lock_not_available THEN
    SELECT string_agg(DISTINCT l.pid::text, ', ') INTO v_holders
    FROM pg_locks l
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
      AND l.classid = p_namespace::oid AND l.objid = p_key::oid
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database());
    RAISE EXCEPTION 'The lock of % was not granted within % because session % holds it: end that session''s transaction (an open producer transaction holds the lock until it commits) or terminate it, or raise lock_timeout to wait longer.',
        p_what, v_bound, coalesce('pid ' || v_holders, '(gone by now)')
        USING ERRCODE = 'lock_not_available';
END
$$;

-- Serialize the writers of one ordered stream until the end of the transaction, so its
-- rows become heads in commit order. A hash collision only serializes two streams more.
-- Uncontended, one try; contended, a bounded wait (wait_for_xact_lock): any session may
-- take an advisory lock, and one holding a stream's must not stall its writers forever.
CREATE OR REPLACE FUNCTION workpump.lock_stream(p_category text, p_scope text, p_stream text)
RETURNS void
LANGUAGE sql
RETURN CASE
    WHEN pg_try_advisory_xact_lock(
        workpump.lock_namespace('stream'),
        hashtext(p_category || chr(31) || coalesce(p_scope, '') || chr(31) || p_stream))
    THEN NULL
    ELSE workpump.wait_for_xact_lock(
        workpump.lock_namespace('stream'),
        hashtext(p_category || chr(31) || coalesce(p_scope, '') || chr(31) || p_stream),
        format('%s stream %L%s', p_category, p_stream,
               CASE WHEN coalesce(p_scope, '') <> '' THEN format(' of %L', p_scope) ELSE '' END),
        current_setting('lock_timeout'))
END;

-- Serialize the producers of one unique key of one table and topic until the end of the
-- transaction. The namespace sits beside lock_namespace's; a hash collision only
-- serializes two keys more. Contended, a bounded wait, as lock_stream's.
CREATE OR REPLACE FUNCTION workpump.lock_unique_key(p_table text, p_topic text, p_unique_key text)
RETURNS void
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
    SELECT CASE
        WHEN pg_try_advisory_xact_lock(
            1464877403, hashtext(p_table || chr(31) || p_topic || chr(31) || p_unique_key))
        THEN NULL
        ELSE workpump.wait_for_xact_lock(
            1464877403, hashtext(p_table || chr(31) || p_topic || chr(31) || p_unique_key),
            format('unique key %L of %s topic %L', p_unique_key, p_table, p_topic),
            current_setting('lock_timeout'))
    END;
$$;

-- The alive-locks held now, recorded with the sessions that hold them.
UPDATE workpump_service_instance si
SET alive_lock_pid = l.pid
FROM pg_locks l
WHERE l.locktype = 'advisory'
  AND l.granted
  AND l.objsubid = 2
  AND l.classid = workpump.lock_namespace('alive')::oid
  AND l.objid = si.alive_lock_key::oid
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database());
