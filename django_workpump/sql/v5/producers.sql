-- Producers, schema version 6: payloads are checked at the door. A payload larger than
-- p_max_payload_bytes or nested deeper than p_max_payload_depth is refused here, so no
-- row is stored that the pump cannot decode; before, such a row was claimed, failed to
-- decode after the claim had committed, and took its batch-mates' attempts with it.
-- The bodies are those of v1/producers.sql plus the payload check and its parameters.

DROP FUNCTION workpump.send(text, jsonb, text, integer, timestamptz, integer, uuid, integer);
DROP FUNCTION workpump.receive(uuid, text, jsonb, text, integer, timestamptz, integer, integer);
DROP FUNCTION workpump.emit(text, jsonb, text, jsonb, uuid, integer, integer);

-- Refuse a payload over p_max_bytes bytes of JSON text (as PostgreSQL prints it) or with
-- objects and arrays nested more than p_max_depth levels deep (the payload object is
-- level 1). The depth probe walks at most p_max_depth levels, whatever lies below.
CREATE FUNCTION workpump.check_payload(
    p_what text, p_topic text, p_payload jsonb, p_max_bytes bigint, p_max_depth integer
) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    v_bytes bigint;
BEGIN
    IF p_max_bytes IS NULL OR p_max_bytes < 1 THEN
        RAISE EXCEPTION 'p_max_payload_bytes must be at least 1, not %.',
            coalesce(p_max_bytes::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass WORKPUMP[''MAX_PAYLOAD_BYTES''] (1048576 by default).';
    END IF;
    IF p_max_depth IS NULL OR p_max_depth NOT BETWEEN 1 AND 512 THEN
        RAISE EXCEPTION 'p_max_payload_depth must be between 1 and 512 (the deepest payload the pump decodes), not %.',
            coalesce(p_max_depth::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Leave it out for the default of 100.';
    END IF;
    v_bytes := octet_length(p_payload::text);
    IF v_bytes > p_max_bytes THEN
        RAISE EXCEPTION 'The payload of % % is % bytes of JSON, over p_max_payload_bytes (%): store large data elsewhere and send a reference to it.',
            p_what, quote_literal(p_topic), v_bytes, p_max_bytes
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- a container at level p_max_depth (the root is level 0) is one level too deep
    IF jsonb_path_exists(p_payload, format(
            'strict $.**{%s} ? (@.type() == "object" || @.type() == "array")',
            p_max_depth)::jsonpath) THEN
        RAISE EXCEPTION 'The payload of % % nests objects and arrays more than p_max_payload_depth (%) levels deep: flatten it, e.g. into a list of records that name their parent.',
            p_what, quote_literal(p_topic), p_max_depth
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;

-- Store an outbox message for p_destination; return its message id.
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
    p_max_payload_depth integer DEFAULT 100
) RETURNS uuid
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_id uuid := coalesce(p_message_id, gen_random_uuid());
BEGIN
    PERFORM workpump.check_new_work('outbox destination', p_destination, p_payload,
                                    p_priority, p_max_attempts, p_partition_count);
    PERFORM workpump.check_payload('outbox destination', p_destination, p_payload,
                                   p_max_payload_bytes, p_max_payload_depth);
    INSERT INTO workpump_outbox (message_id, destination, payload, stream, partition_number,
                                 priority, scheduled_for, max_attempts)
    VALUES (v_id, p_destination, p_payload, p_stream,
            workpump.partition_of(coalesce(p_stream, v_id::text), p_partition_count),
            p_priority, p_scheduled_for, p_max_attempts);
    RETURN v_id;
END
$$;

-- Store an inbox message once per message id, ever: false (and nothing written) when
-- the id was received before, even if that row has since been processed and purged.
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
    p_max_payload_depth integer DEFAULT 100
) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_message_id IS NULL THEN
        RAISE EXCEPTION 'An inbox message needs a message id: it is what deduplicates it.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_new_work('inbox handler', p_handler_name, p_payload,
                                    p_priority, p_max_attempts, p_partition_count);
    PERFORM workpump.check_payload('inbox handler', p_handler_name, p_payload,
                                   p_max_payload_bytes, p_max_payload_depth);
    -- A concurrent receive of the same id waits here for the first one's transaction.
    INSERT INTO workpump_inbox_dedup (message_id) VALUES (p_message_id)
    ON CONFLICT (message_id) DO NOTHING;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO workpump_inbox (message_id, handler_name, payload, stream, partition_number,
                                priority, scheduled_for, max_attempts)
    VALUES (p_message_id, p_handler_name, p_payload, p_stream,
            workpump.partition_of(coalesce(p_stream, p_message_id::text), p_partition_count),
            p_priority, p_scheduled_for, p_max_attempts);
    RETURN true;
END
$$;

-- Store an event and one work row per subscriber. p_subscribers is a JSON array of
-- {"category": "perspective_event"|"receptor", "name": ..., "max_attempts": n}.
-- With no subscribers the event is stored and no work is created.
CREATE FUNCTION workpump.emit(
    p_event_type text,
    p_payload jsonb,
    p_stream text DEFAULT NULL,
    p_subscribers jsonb DEFAULT '[]',
    p_event_id uuid DEFAULT NULL,
    p_priority integer DEFAULT 0,
    p_partition_count integer DEFAULT 10000,
    p_max_payload_bytes bigint DEFAULT 1048576,
    p_max_payload_depth integer DEFAULT 100
) RETURNS uuid
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_id uuid := coalesce(p_event_id, gen_random_uuid());
    v_partition integer;
    v_bad jsonb;
BEGIN
    PERFORM workpump.check_new_work('event type', p_event_type, p_payload, p_priority, 1,
                                    p_partition_count);
    PERFORM workpump.check_payload('event type', p_event_type, p_payload,
                                   p_max_payload_bytes, p_max_payload_depth);
    v_partition := workpump.partition_of(coalesce(p_stream, v_id::text), p_partition_count);
    IF p_subscribers IS NULL OR jsonb_typeof(p_subscribers) <> 'array' THEN
        RAISE EXCEPTION 'p_subscribers must be a JSON array of {"category", "name", "max_attempts"}.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT s INTO v_bad FROM jsonb_array_elements(p_subscribers) s
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

    INSERT INTO workpump_event (event_id, event_type, payload, stream)
    VALUES (v_id, p_event_type, p_payload, p_stream);

    INSERT INTO workpump_perspective_event (event_work_id, perspective_name, event_id, stream,
                                            partition_number, priority, max_attempts)
    SELECT gen_random_uuid(), s->>'name', v_id, p_stream, v_partition, p_priority,
           coalesce((s->>'max_attempts')::integer, 10)
    FROM jsonb_array_elements(p_subscribers) s
    WHERE s->>'category' = 'perspective_event';

    INSERT INTO workpump_receptor_processing (id, receptor_name, event_id, stream,
                                              partition_number, priority, max_attempts)
    SELECT gen_random_uuid(), s->>'name', v_id, p_stream, v_partition, p_priority,
           coalesce((s->>'max_attempts')::integer, 10)
    FROM jsonb_array_elements(p_subscribers) s
    WHERE s->>'category' = 'receptor';
    RETURN v_id;
END
$$;
