-- Producers, schema version 10: unique keys, and subscriptions kept in the database.
--
-- send, receive and emit take p_unique_key: at most one outbox or inbox row per (topic,
-- key) that is not yet processed, and at most one event per (event type, key) whose
-- work is not all done; with p_unique_for, also none created within that window. A duplicate writes
-- nothing and returns the id of the row that holds the key (receive: false) with
-- p_on_conflict => 'return', or raises unique_violation with 'raise'. Producers of one key serialize
-- on an advisory lock until the end of their transactions, so the second looks after the
-- first committed or rolled back; the partial unique indexes workpump_outbox_unique_key
-- and workpump_inbox_unique_key back this up. A dead-lettered row is not done: it holds its
-- key until it is requeued and processed, or purged by DEAD_RETENTION_SECONDS.
--
-- workpump_subscription holds the perspectives and receptors of each event type, synced
-- from the Python registry (replaced on migrate, upserted at runworkpump start). emit
-- fans out from it when p_subscribers is NULL, now the default, so a producer outside
-- Python creates the same work as django_workpump.emit; an explicit '[]' means none.

DROP FUNCTION workpump.send(text, jsonb, text, integer, timestamptz, integer, uuid, integer,
                            bigint, integer);
DROP FUNCTION workpump.emit(text, jsonb, text, jsonb, uuid, integer, integer, bigint, integer);
DROP FUNCTION workpump.receive(uuid, text, jsonb, text, integer, timestamptz, integer, integer,
                               bigint, integer, boolean);

-- Raise unless a unique key, its window and the conflict policy are valid. p_what names
-- the producer's topic noun ('outbox destination', 'event type').
CREATE FUNCTION workpump.check_unique_key(
    p_what text, p_topic text, p_unique_key text, p_unique_for interval, p_on_conflict text
) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_unique_key IS NULL THEN
        IF p_unique_for IS NOT NULL THEN
            RAISE EXCEPTION 'p_unique_for of % % needs p_unique_key: the window applies to a key.',
                p_what, quote_literal(p_topic)
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Pass p_unique_key too, or leave p_unique_for out.';
        END IF;
    ELSIF btrim(p_unique_key) = '' THEN
        RAISE EXCEPTION 'p_unique_key of % % is empty; pass NULL for no unique key.',
            p_what, quote_literal(p_topic)
            USING ERRCODE = 'invalid_parameter_value';
    ELSIF octet_length(p_unique_key) > 512 THEN
        RAISE EXCEPTION 'p_unique_key of % % is % bytes, over the limit of 512 bytes: use a shorter key, e.g. a hash of the long one.',
            p_what, quote_literal(p_topic), octet_length(p_unique_key)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_unique_for < interval '0' THEN
        RAISE EXCEPTION 'p_unique_for of % % must not be negative, not %.',
            p_what, quote_literal(p_topic), p_unique_for
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_on_conflict IS NULL OR p_on_conflict NOT IN ('return', 'raise') THEN
        RAISE EXCEPTION 'p_on_conflict must be ''return'' or ''raise'', not %.',
            coalesce(quote_literal(p_on_conflict), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;

-- Serialize the producers of one unique key of one table and topic until the end of the
-- transaction. The namespace sits beside lock_namespace's; a hash collision only
-- serializes two keys more.
CREATE FUNCTION workpump.lock_unique_key(p_table text, p_topic text, p_unique_key text)
RETURNS void
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
    SELECT pg_advisory_xact_lock(
        1464877403,
        hashtext(p_table || chr(31) || p_topic || chr(31) || p_unique_key)
    );
$$;

-- The id of the row that holds p_unique_key for p_topic, or NULL. p_kind is 'outbox',
-- 'inbox' or 'event'. A message holds its key until it is processed (a dead row is not
-- processed: it holds it too), an event while any of its work is not done; with
-- p_unique_for, any of them created within the window holds it as well.
CREATE FUNCTION workpump.unique_key_holder(
    p_kind text,
    p_topic text,
    p_unique_key text,
    p_unique_for interval DEFAULT NULL,
    p_now timestamptz DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_since timestamptz := coalesce(p_now, now()) - p_unique_for;
    v_holder uuid;
BEGIN
    IF p_kind = 'outbox' THEN
        SELECT o.message_id INTO v_holder FROM workpump_outbox o
        WHERE o.destination = p_topic AND o.unique_key = p_unique_key
          AND (o.processed_at IS NULL OR o.created_at >= v_since)
        ORDER BY o.processed_at IS NULL DESC, o.seq DESC
        LIMIT 1;
    ELSIF p_kind = 'inbox' THEN
        SELECT i.message_id INTO v_holder FROM workpump_inbox i
        WHERE i.handler_name = p_topic AND i.unique_key = p_unique_key
          AND (i.processed_at IS NULL OR i.created_at >= v_since)
        ORDER BY i.processed_at IS NULL DESC, i.seq DESC
        LIMIT 1;
    ELSIF p_kind = 'event' THEN
        SELECT e.event_id INTO v_holder FROM workpump_event e
        WHERE e.event_type = p_topic AND e.unique_key = p_unique_key
          AND (e.created_at >= v_since
               OR EXISTS (SELECT 1 FROM workpump_perspective_event p
                          WHERE p.event_id = e.event_id AND p.processed_at IS NULL)
               OR EXISTS (SELECT 1 FROM workpump_receptor_processing r
                          WHERE r.event_id = e.event_id AND r.completed_at IS NULL))
        ORDER BY e.seq DESC
        LIMIT 1;
    ELSE
        RAISE EXCEPTION 'p_kind must be outbox, inbox or event, not %.',
            coalesce(quote_literal(p_kind), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN v_holder;
END
$$;

-- Store an outbox message for p_destination; return its message id. With p_unique_key,
-- return the id of the row that holds the key instead, writing nothing: an unprocessed
-- row with that key, or (with p_unique_for) one created within the window
-- (unique_key_holder).
CREATE FUNCTION workpump.send(
    p_destination text,
    p_payload jsonb,
    p_stream text DEFAULT NULL,
    p_priority integer DEFAULT 0,
    p_scheduled_for timestamptz DEFAULT NULL,
    p_max_attempts integer DEFAULT 10,
    p_message_id uuid DEFAULT NULL,
    p_partition_count integer DEFAULT 10000,
    p_max_payload_bytes bigint DEFAULT 1048576,
    p_max_payload_depth integer DEFAULT 100,
    p_unique_key text DEFAULT NULL,
    p_unique_for interval DEFAULT NULL,
    p_on_conflict text DEFAULT 'return',
    p_now timestamptz DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_id uuid := coalesce(p_message_id, gen_random_uuid());
    v_holder uuid;
BEGIN
    PERFORM workpump.check_new_work('outbox destination', p_destination, p_payload,
                                    p_priority, p_max_attempts, p_partition_count);
    PERFORM workpump.check_payload('outbox destination', p_destination, p_payload,
                                   p_max_payload_bytes, p_max_payload_depth);
    PERFORM workpump.check_unique_key('outbox destination', p_destination, p_unique_key,
                                      p_unique_for, p_on_conflict);
    IF p_unique_key IS NOT NULL THEN
        -- a racer of the same key waits here until this transaction ends
        PERFORM workpump.lock_unique_key('workpump_outbox', p_destination, p_unique_key);
        v_holder := workpump.unique_key_holder('outbox', p_destination, p_unique_key,
                                               p_unique_for, p_now);
        IF v_holder IS NULL THEN
            INSERT INTO workpump_outbox (message_id, destination, payload, stream,
                                         partition_number, priority, scheduled_for,
                                         max_attempts, unique_key)
            VALUES (v_id, p_destination, p_payload, p_stream,
                    workpump.partition_of(coalesce(p_stream, v_id::text), p_partition_count),
                    p_priority, p_scheduled_for, p_max_attempts, p_unique_key)
            ON CONFLICT (destination, unique_key)
                WHERE processed_at IS NULL AND unique_key IS NOT NULL DO NOTHING;
            IF FOUND THEN
                RETURN v_id;
            END IF;
            -- a holder written past the lock (a plain INSERT): the index found it
            SELECT o.message_id INTO v_holder FROM workpump_outbox o
            WHERE o.destination = p_destination AND o.unique_key = p_unique_key
              AND o.processed_at IS NULL;
        END IF;
        IF p_on_conflict = 'raise' THEN
            RAISE EXCEPTION 'Outbox destination % already holds unique key % in message %.',
                quote_literal(p_destination), quote_literal(p_unique_key), v_holder
                USING ERRCODE = 'unique_violation',
                      HINT = 'Pass p_on_conflict => ''return'' to get the holder''s id instead.';
        END IF;
        RETURN v_holder;
    END IF;
    INSERT INTO workpump_outbox (message_id, destination, payload, stream, partition_number,
                                 priority, scheduled_for, max_attempts)
    VALUES (v_id, p_destination, p_payload, p_stream,
            workpump.partition_of(coalesce(p_stream, v_id::text), p_partition_count),
            p_priority, p_scheduled_for, p_max_attempts);
    RETURN v_id;
END
$$;

-- Store an inbox message once per message id: false, with nothing written, when the id
-- was received before (within the de-duplication window), or when p_unique_key is held
-- (unique_key_holder; p_on_conflict => 'raise' raises unique_violation instead).
-- p_deduplicate => false skips the de-duplication row, for producers whose ids are fresh
-- UUIDs (task enqueues): a repeated id then fails on the inbox's unique message_id.
CREATE FUNCTION workpump.receive(
    p_message_id uuid,
    p_handler_name text,
    p_payload jsonb,
    p_stream text DEFAULT NULL,
    p_priority integer DEFAULT 0,
    p_scheduled_for timestamptz DEFAULT NULL,
    p_max_attempts integer DEFAULT 10,
    p_partition_count integer DEFAULT 10000,
    p_max_payload_bytes bigint DEFAULT 1048576,
    p_max_payload_depth integer DEFAULT 100,
    p_deduplicate boolean DEFAULT true,
    p_unique_key text DEFAULT NULL,
    p_unique_for interval DEFAULT NULL,
    p_on_conflict text DEFAULT 'return',
    p_now timestamptz DEFAULT NULL
) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_holder uuid;
BEGIN
    IF p_message_id IS NULL THEN
        RAISE EXCEPTION 'An inbox message needs a message id: it is what deduplicates it.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_new_work('inbox handler', p_handler_name, p_payload,
                                    p_priority, p_max_attempts, p_partition_count);
    PERFORM workpump.check_payload('inbox handler', p_handler_name, p_payload,
                                   p_max_payload_bytes, p_max_payload_depth);
    PERFORM workpump.check_unique_key('inbox handler', p_handler_name, p_unique_key,
                                      p_unique_for, p_on_conflict);
    IF p_unique_key IS NOT NULL THEN
        -- a racer of the same key waits here until this transaction ends
        PERFORM workpump.lock_unique_key('workpump_inbox', p_handler_name, p_unique_key);
        v_holder := workpump.unique_key_holder('inbox', p_handler_name, p_unique_key,
                                               p_unique_for, p_now);
        IF v_holder IS NOT NULL THEN
            IF p_on_conflict = 'raise' THEN
                RAISE EXCEPTION 'Inbox handler % already holds unique key % in message %.',
                    quote_literal(p_handler_name), quote_literal(p_unique_key), v_holder
                    USING ERRCODE = 'unique_violation',
                          HINT = 'Pass p_on_conflict => ''return'' to get false instead.';
            END IF;
            RETURN false;
        END IF;
    END IF;
    IF coalesce(p_deduplicate, true) THEN
        -- A concurrent receive of the same id waits here for the first one's transaction.
        INSERT INTO workpump_inbox_dedup (message_id) VALUES (p_message_id)
        ON CONFLICT (message_id) DO NOTHING;
        IF NOT FOUND THEN
            RETURN false;
        END IF;
    END IF;
    -- a holder of the key this snapshot could not see (REPEATABLE READ) fails the
    -- partial unique index workpump_inbox_unique_key here
    INSERT INTO workpump_inbox (message_id, handler_name, payload, stream, partition_number,
                                priority, scheduled_for, max_attempts, unique_key)
    VALUES (p_message_id, p_handler_name, p_payload, p_stream,
            workpump.partition_of(coalesce(p_stream, p_message_id::text), p_partition_count),
            p_priority, p_scheduled_for, p_max_attempts, p_unique_key);
    RETURN true;
END
$$;

-- Upsert the subscriptions of the registry, a JSON array of {"event_type", "category",
-- "name", "max_attempts"}; with p_replace, delete every other subscription too. Returns
-- how many rows it inserted or changed.
CREATE FUNCTION workpump.sync_subscriptions(
    p_subscriptions jsonb,
    p_replace boolean DEFAULT false,
    p_now timestamptz DEFAULT NULL
) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_bad jsonb;
    v_count integer;
BEGIN
    IF p_subscriptions IS NULL OR jsonb_typeof(p_subscriptions) <> 'array' THEN
        RAISE EXCEPTION 'p_subscriptions must be a JSON array of {"event_type", "category", "name", "max_attempts"}.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT s INTO v_bad FROM jsonb_array_elements(p_subscriptions) s
    WHERE coalesce(btrim(s->>'event_type'), '') = ''
       OR s->>'category' IS DISTINCT FROM 'perspective_event'
      AND s->>'category' IS DISTINCT FROM 'receptor'
       OR coalesce(btrim(s->>'name'), '') = ''
       OR coalesce((s->>'max_attempts')::integer, 0) < 1
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'Bad subscription %: it needs an event_type, a category (perspective_event or receptor), a name and max_attempts >= 1.',
            v_bad
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_replace THEN
        -- the registry is the whole truth: what it no longer names goes
        DELETE FROM workpump_subscription w
        WHERE NOT EXISTS (
            SELECT 1 FROM jsonb_array_elements(p_subscriptions) s
            WHERE s->>'event_type' = w.event_type AND s->>'category' = w.category
              AND s->>'name' = w.name);
    END IF;
    INSERT INTO workpump_subscription AS w (event_type, category, name, max_attempts,
                                            updated_at)
    SELECT DISTINCT ON (s->>'event_type', s->>'category', s->>'name')
           s->>'event_type', s->>'category', s->>'name', (s->>'max_attempts')::integer,
           coalesce(p_now, now())
    FROM jsonb_array_elements(p_subscriptions) s
    ON CONFLICT (event_type, category, name) DO UPDATE
        SET max_attempts = excluded.max_attempts, updated_at = excluded.updated_at
        WHERE w.max_attempts IS DISTINCT FROM excluded.max_attempts;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

-- Store an event and one work row per subscriber; return its event id. p_subscribers is
-- a JSON array of {"category": "perspective_event"|"receptor", "name": ...,
-- "max_attempts": n}; NULL (the default) means the subscribers workpump_subscription
-- lists for the event type, '[]' none. With p_unique_key, return the id of the event
-- that holds the key instead, writing nothing: one with work not yet done, or (with
-- p_unique_for) one created within the window (unique_key_holder).
CREATE FUNCTION workpump.emit(
    p_event_type text,
    p_payload jsonb,
    p_stream text DEFAULT NULL,
    p_subscribers jsonb DEFAULT NULL,
    p_event_id uuid DEFAULT NULL,
    p_priority integer DEFAULT 0,
    p_partition_count integer DEFAULT 10000,
    p_max_payload_bytes bigint DEFAULT 1048576,
    p_max_payload_depth integer DEFAULT 100,
    p_unique_key text DEFAULT NULL,
    p_unique_for interval DEFAULT NULL,
    p_on_conflict text DEFAULT 'return',
    p_now timestamptz DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_id uuid := coalesce(p_event_id, gen_random_uuid());
    v_partition integer;
    v_subscribers jsonb := p_subscribers;
    v_bad jsonb;
    v_holder uuid;
BEGIN
    PERFORM workpump.check_new_work('event type', p_event_type, p_payload, p_priority, 1,
                                    p_partition_count);
    PERFORM workpump.check_payload('event type', p_event_type, p_payload,
                                   p_max_payload_bytes, p_max_payload_depth);
    PERFORM workpump.check_unique_key('event type', p_event_type, p_unique_key,
                                      p_unique_for, p_on_conflict);
    v_partition := workpump.partition_of(coalesce(p_stream, v_id::text), p_partition_count);
    IF v_subscribers IS NULL THEN
        SELECT coalesce(jsonb_agg(jsonb_build_object(
                   'category', s.category, 'name', s.name, 'max_attempts', s.max_attempts)
                   ORDER BY s.category, s.name), '[]')
        INTO v_subscribers
        FROM workpump_subscription s WHERE s.event_type = p_event_type;
    END IF;
    IF jsonb_typeof(v_subscribers) <> 'array' THEN
        RAISE EXCEPTION 'p_subscribers must be NULL or a JSON array of {"category", "name", "max_attempts"}.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT s INTO v_bad FROM jsonb_array_elements(v_subscribers) s
    WHERE s->>'category' IS DISTINCT FROM 'perspective_event'
      AND s->>'category' IS DISTINCT FROM 'receptor'
       OR coalesce(btrim(s->>'name'), '') = ''
       OR coalesce((s->>'max_attempts')::integer, 10) < 1
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'Bad subscriber % of event %: it needs a category (perspective_event or receptor), a name and max_attempts >= 1.',
            v_bad, quote_literal(p_event_type)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    IF p_unique_key IS NOT NULL THEN
        -- a racer of the same key waits here until this transaction ends
        PERFORM workpump.lock_unique_key('workpump_event', p_event_type, p_unique_key);
        v_holder := workpump.unique_key_holder('event', p_event_type, p_unique_key,
                                               p_unique_for, p_now);
        IF v_holder IS NOT NULL THEN
            IF p_on_conflict = 'raise' THEN
                RAISE EXCEPTION 'Event type % already holds unique key % in event %.',
                    quote_literal(p_event_type), quote_literal(p_unique_key), v_holder
                    USING ERRCODE = 'unique_violation',
                          HINT = 'Pass p_on_conflict => ''return'' to get the holder''s id instead.';
            END IF;
            RETURN v_holder;
        END IF;
    END IF;

    INSERT INTO workpump_event (event_id, event_type, payload, stream, unique_key)
    VALUES (v_id, p_event_type, p_payload, p_stream, p_unique_key);

    INSERT INTO workpump_perspective_event (event_work_id, perspective_name, event_id, stream,
                                            partition_number, priority, max_attempts)
    SELECT gen_random_uuid(), s->>'name', v_id, p_stream, v_partition, p_priority,
           coalesce((s->>'max_attempts')::integer, 10)
    FROM jsonb_array_elements(v_subscribers) s
    WHERE s->>'category' = 'perspective_event';

    INSERT INTO workpump_receptor_processing (id, receptor_name, event_id, stream,
                                              partition_number, priority, max_attempts)
    SELECT gen_random_uuid(), s->>'name', v_id, p_stream, v_partition, p_priority,
           coalesce((s->>'max_attempts')::integer, 10)
    FROM jsonb_array_elements(v_subscribers) s
    WHERE s->>'category' = 'receptor';
    RETURN v_id;
END
$$;
