-- Producers, schema version 13: headers that travel with the work.
--
-- send, receive and emit take p_headers, a JSON object of string values (at most 8192
-- bytes of JSON) stored in the row's headers column and returned by the claim, e.g. the
-- W3C trace context {"traceparent": "00-...", "tracestate": "..."} that links a
-- handler's span to its producer's (docs/tracing.md). emit copies them to the row of
-- every subscriber. NULL, the default, stores none. The parameter comes last, so every
-- call of version 10, by position or by name, means what it meant.

DROP FUNCTION workpump.send(text, jsonb, text, integer, timestamptz, integer, uuid, integer,
                            bigint, integer, text, interval, text, timestamptz);
DROP FUNCTION workpump.emit(text, jsonb, text, jsonb, uuid, integer, integer, bigint, integer,
                            text, interval, text, timestamptz);
DROP FUNCTION workpump.receive(uuid, text, jsonb, text, integer, timestamptz, integer, integer,
                               bigint, integer, boolean, text, interval, text, timestamptz);

-- Raise unless p_headers is NULL or a JSON object of strings of at most 8192 bytes.
-- p_what names the producer's topic noun ('outbox destination', 'event type').
CREATE FUNCTION workpump.check_headers(p_what text, p_topic text, p_headers jsonb)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_headers IS NULL THEN
        RETURN;
    END IF;
    IF jsonb_typeof(p_headers) <> 'object'
       OR EXISTS (SELECT 1 FROM jsonb_each(p_headers) h WHERE jsonb_typeof(h.value) <> 'string')
    THEN
        RAISE EXCEPTION 'p_headers of % % must be a JSON object of strings, not %.',
            p_what, quote_literal(p_topic), left(p_headers::text, 200)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'E.g. {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}, or NULL for none.';
    END IF;
    IF octet_length(p_headers::text) > 8192 THEN
        RAISE EXCEPTION 'p_headers of % % are % bytes of JSON, over the limit of 8192 bytes.',
            p_what, quote_literal(p_topic), octet_length(p_headers::text)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Headers carry small metadata such as a trace context; put data in the payload.';
    END IF;
END
$$;

-- Store an outbox message for p_destination; return its message id. With p_unique_key,
-- return the id of the row that holds the key instead, writing nothing: an unprocessed
-- row with that key, or (with p_unique_for) one created within the window
-- (unique_key_holder). p_headers are stored with the row (check_headers).
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
    p_now timestamptz DEFAULT NULL,
    p_headers jsonb DEFAULT NULL
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
    PERFORM workpump.check_headers('outbox destination', p_destination, p_headers);
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
                                         max_attempts, unique_key, headers)
            VALUES (v_id, p_destination, p_payload, p_stream,
                    workpump.partition_of(coalesce(p_stream, v_id::text), p_partition_count),
                    p_priority, p_scheduled_for, p_max_attempts, p_unique_key, p_headers)
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
                                 priority, scheduled_for, max_attempts, headers)
    VALUES (v_id, p_destination, p_payload, p_stream,
            workpump.partition_of(coalesce(p_stream, v_id::text), p_partition_count),
            p_priority, p_scheduled_for, p_max_attempts, p_headers);
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
    p_now timestamptz DEFAULT NULL,
    p_headers jsonb DEFAULT NULL
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
    PERFORM workpump.check_headers('inbox handler', p_handler_name, p_headers);
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
                                priority, scheduled_for, max_attempts, unique_key, headers)
    VALUES (p_message_id, p_handler_name, p_payload, p_stream,
            workpump.partition_of(coalesce(p_stream, p_message_id::text), p_partition_count),
            p_priority, p_scheduled_for, p_max_attempts, p_unique_key, p_headers);
    RETURN true;
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
    p_now timestamptz DEFAULT NULL,
    p_headers jsonb DEFAULT NULL
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
    PERFORM workpump.check_headers('event type', p_event_type, p_headers);
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

    -- every subscriber's row carries the event's headers (its trace context)
    INSERT INTO workpump_perspective_event (event_work_id, perspective_name, event_id, stream,
                                            partition_number, priority, max_attempts, headers)
    SELECT gen_random_uuid(), s->>'name', v_id, p_stream, v_partition, p_priority,
           coalesce((s->>'max_attempts')::integer, 10), p_headers
    FROM jsonb_array_elements(v_subscribers) s
    WHERE s->>'category' = 'perspective_event';

    INSERT INTO workpump_receptor_processing (id, receptor_name, event_id, stream,
                                              partition_number, priority, max_attempts, headers)
    SELECT gen_random_uuid(), s->>'name', v_id, p_stream, v_partition, p_priority,
           coalesce((s->>'max_attempts')::integer, 10), p_headers
    FROM jsonb_array_elements(v_subscribers) s
    WHERE s->>'category' = 'receptor';
    RETURN v_id;
END
$$;
