-- Periodic work (docs/periodic.md): each slot of a schedule becomes exactly one outbox
-- row, however many instances race to fire it. The slots themselves (cron in a time
-- zone, or an interval aligned to the epoch) are computed by the pump; these functions
-- keep the one fact every instance must agree on, the last slot handled, and move it
-- forward only with a conditional UPDATE, so that one caller wins each slot.

-- Register a schedule as the code defines it (at pump start): insert it, or update its
-- definition keeping last_slot and paused. Returns true when the row was created.
CREATE FUNCTION workpump.upsert_periodic(
    p_name text,
    p_cron text DEFAULT NULL,
    p_every_seconds integer DEFAULT NULL,
    p_timezone text DEFAULT 'UTC',
    p_catch_up text DEFAULT 'latest',
    p_payload jsonb DEFAULT '{}',
    p_priority integer DEFAULT 0,
    p_max_attempts integer DEFAULT 10,
    p_next_fire_at timestamptz DEFAULT NULL,
    p_now timestamptz DEFAULT NULL
) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_created boolean;
BEGIN
    IF coalesce(btrim(p_name), '') = '' THEN
        RAISE EXCEPTION 'upsert_periodic needs p_name, the outbox destination of the schedule.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF (p_cron IS NULL) = (p_every_seconds IS NULL) THEN
        RAISE EXCEPTION 'Periodic schedule % needs exactly one of p_cron and p_every_seconds.',
            quote_literal(p_name)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO workpump_periodic_schedule AS s (
        name, cron, every_seconds, timezone, catch_up, payload, priority, max_attempts,
        paused, next_fire_at, created_at, registered_at, updated_at)
    VALUES (p_name, p_cron, p_every_seconds, coalesce(p_timezone, 'UTC'),
            coalesce(p_catch_up, 'latest'), coalesce(p_payload, '{}'), coalesce(p_priority, 0),
            coalesce(p_max_attempts, 10), false, p_next_fire_at, v_now, v_now, v_now)
    ON CONFLICT (name) DO UPDATE
    SET cron = excluded.cron, every_seconds = excluded.every_seconds,
        timezone = excluded.timezone, catch_up = excluded.catch_up,
        payload = excluded.payload, priority = excluded.priority,
        max_attempts = excluded.max_attempts,
        next_fire_at = coalesce(excluded.next_fire_at, s.next_fire_at),
        registered_at = v_now,
        updated_at = CASE
            WHEN (s.cron, s.every_seconds, s.timezone, s.catch_up, s.payload, s.priority,
                  s.max_attempts)
                 IS DISTINCT FROM
                 (excluded.cron, excluded.every_seconds, excluded.timezone, excluded.catch_up,
                  excluded.payload, excluded.priority, excluded.max_attempts)
            THEN v_now ELSE s.updated_at END
    RETURNING (xmax = 0) INTO v_created;
    RETURN v_created;
END
$$;

-- Fire slot p_slot of schedule p_name: advance last_slot to it and send the outbox row
-- (destination p_name, the schedule's payload plus "slot": the slot in ISO-8601 UTC,
-- its priority and max_attempts) through workpump.send, in one transaction. Only the
-- caller whose UPDATE moved last_slot forward sends: a racing caller waits for the
-- winner's commit, finds last_slot no longer before p_slot, and sends nothing. Returns
-- the message id, or NULL when nothing was sent (slot already handled or later than
-- now, schedule paused or unknown).
CREATE FUNCTION workpump.fire_periodic(
    p_name text,
    p_slot timestamptz,
    p_next_fire_at timestamptz DEFAULT NULL,
    p_partition_count integer DEFAULT 10000,
    p_max_payload_bytes bigint DEFAULT 1048576,
    p_now timestamptz DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_won record;
    v_id uuid;
BEGIN
    IF p_name IS NULL OR p_slot IS NULL THEN
        RAISE EXCEPTION 'fire_periodic needs p_name and p_slot.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- the race: only a not-paused schedule whose last slot is before p_slot advances,
    -- and the row lock makes every other caller re-check after the winner commits
    UPDATE workpump_periodic_schedule s
    SET last_slot = p_slot, last_fired_at = v_now,
        next_fire_at = coalesce(p_next_fire_at, s.next_fire_at)
    WHERE s.name = p_name AND NOT s.paused
      AND (s.last_slot IS NULL OR s.last_slot < p_slot)
      AND p_slot <= v_now
    RETURNING s.payload, s.priority, s.max_attempts INTO v_won;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- the winner sends: the insert triggers NOTIFY the claimers at commit
    v_id := workpump.send(
        p_destination => p_name,
        p_payload => v_won.payload || jsonb_build_object(
            'slot', to_char(p_slot AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')),
        p_priority => v_won.priority,
        p_max_attempts => v_won.max_attempts,
        p_partition_count => p_partition_count,
        p_max_payload_bytes => p_max_payload_bytes);
    UPDATE workpump_periodic_schedule SET last_message_id = v_id WHERE name = p_name;
    RETURN v_id;
END
$$;

-- Mark slot p_slot of p_name as handled without sending anything (a slot missed under
-- catch_up 'none', or one that fell due while the schedule was paused). Returns true
-- when last_slot moved forward.
CREATE FUNCTION workpump.skip_periodic(
    p_name text,
    p_slot timestamptz,
    p_next_fire_at timestamptz DEFAULT NULL,
    p_now timestamptz DEFAULT NULL
) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    UPDATE workpump_periodic_schedule s
    SET last_slot = p_slot, next_fire_at = coalesce(p_next_fire_at, s.next_fire_at)
    WHERE s.name = p_name
      AND (s.last_slot IS NULL OR s.last_slot < p_slot)
      AND p_slot <= coalesce(p_now, now());
    RETURN FOUND;
END
$$;

-- Pause (p_paused true) or resume schedules by name; returns the names whose flag
-- changed. A paused schedule fires nothing; the slots it misses are skipped.
CREATE FUNCTION workpump.pause_periodic(
    p_names text[], p_paused boolean DEFAULT true, p_now timestamptz DEFAULT NULL
) RETURNS SETOF text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN QUERY
    UPDATE workpump_periodic_schedule s
    SET paused = coalesce(p_paused, true), updated_at = coalesce(p_now, now())
    WHERE s.name = ANY (p_names) AND s.paused IS DISTINCT FROM coalesce(p_paused, true)
    RETURNING s.name;
END
$$;
