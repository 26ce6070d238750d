-- Bulk producers, schema version 12: send_many and emit_many store many rows in one
-- call, so an import, a fan-out or a backfill pays one round trip per chunk, not one per
-- row.
--
-- The rows of one call are inserted in list order, so within a stream they keep that
-- order after anything already sent (seq order is list order). Before inserting, a call
-- takes the stream lock of every stream it writes in one sorted order, (scope, stream),
-- the order promote_stream_heads takes them in: two bulk producers writing overlapping
-- streams, or a bulk producer and a completion, wait for each other instead of
-- deadlocking. The insert trigger takes each lock again, which is free once held. The
-- same checks as send and emit apply to every row; one bad row refuses the whole call.

-- The insert trigger before_insert_work fires only for rows that need it: rows with a
-- stream (the stream lock and the head decision) or without a partition number. An
-- unordered row that names its partition, as every producer's does, is a head by the
-- column's default, so a bulk insert makes no function call per such row.
DROP TRIGGER workpump_outbox_before_insert ON workpump_outbox;
CREATE TRIGGER workpump_outbox_before_insert BEFORE INSERT ON workpump_outbox
    FOR EACH ROW WHEN (NEW.stream IS NOT NULL OR NEW.partition_number IS NULL)
    EXECUTE FUNCTION workpump.before_insert_work('outbox');
DROP TRIGGER workpump_inbox_before_insert ON workpump_inbox;
CREATE TRIGGER workpump_inbox_before_insert BEFORE INSERT ON workpump_inbox
    FOR EACH ROW WHEN (NEW.stream IS NOT NULL OR NEW.partition_number IS NULL)
    EXECUTE FUNCTION workpump.before_insert_work('inbox');
DROP TRIGGER workpump_perspective_event_before_insert ON workpump_perspective_event;
CREATE TRIGGER workpump_perspective_event_before_insert BEFORE INSERT ON workpump_perspective_event
    FOR EACH ROW WHEN (NEW.stream IS NOT NULL OR NEW.partition_number IS NULL)
    EXECUTE FUNCTION workpump.before_insert_work('perspective_event');
DROP TRIGGER workpump_receptor_processing_before_insert ON workpump_receptor_processing;
CREATE TRIGGER workpump_receptor_processing_before_insert BEFORE INSERT ON workpump_receptor_processing
    FOR EACH ROW WHEN (NEW.stream IS NOT NULL OR NEW.partition_number IS NULL)
    EXECUTE FUNCTION workpump.before_insert_work('receptor');

-- Raise unless every payload of a bulk call is a JSON object within the size and nesting
-- limits (check_new_work and check_payload, as one set query); p_what names the topic
-- noun, as in send and emit. Errors name the payload's index in the list, from 0.
CREATE FUNCTION workpump.check_payloads(
    p_what text, p_topic text, p_payloads jsonb[], p_max_bytes bigint, p_max_depth integer
) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    v_bad record;
    v_path jsonpath;
BEGIN
    -- the limits themselves, with check_payload's words (on an empty object)
    PERFORM workpump.check_payload(p_what, p_topic, '{}'::jsonb, p_max_bytes, p_max_depth);
    SELECT u.i - 1 AS i, u.p INTO v_bad
    FROM unnest(p_payloads) WITH ORDINALITY u(p, i)
    WHERE u.p IS NULL OR jsonb_typeof(u.p) <> 'object'
    ORDER BY u.i LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'Payload % of % % must be a JSON object, not %.',
            v_bad.i, p_what, quote_literal(p_topic), coalesce(jsonb_typeof(v_bad.p), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT u.i - 1 AS i, octet_length(u.p::text) AS bytes INTO v_bad
    FROM unnest(p_payloads) WITH ORDINALITY u(p, i)
    WHERE octet_length(u.p::text) > p_max_bytes
    ORDER BY u.i LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'Payload % of % % is % bytes of JSON, over p_max_payload_bytes (%): store large data elsewhere and send a reference to it.',
            v_bad.i, p_what, quote_literal(p_topic), v_bad.bytes, p_max_bytes
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- a container at level p_max_depth (the root is level 0) is one level too deep
    v_path := format('strict $.**{%s} ? (@.type() == "object" || @.type() == "array")',
                     p_max_depth)::jsonpath;
    SELECT u.i - 1 AS i INTO v_bad
    FROM unnest(p_payloads) WITH ORDINALITY u(p, i)
    WHERE jsonb_path_exists(u.p, v_path)
    ORDER BY u.i LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'Payload % of % % nests objects and arrays more than p_max_payload_depth (%) levels deep: flatten it, e.g. into a list of records that name their parent.',
            v_bad.i, p_what, quote_literal(p_topic), p_max_depth
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;

-- Raise unless p_streams is NULL (no ordering) or parallel to p_payloads, each key NULL
-- or non-blank and at most 512 bytes.
CREATE FUNCTION workpump.check_streams(
    p_what text, p_topic text, p_payloads jsonb[], p_streams text[]
) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    v_bad record;
BEGIN
    IF p_streams IS NULL THEN
        RETURN;
    END IF;
    IF coalesce(cardinality(p_streams), 0) <> coalesce(cardinality(p_payloads), 0) THEN
        RAISE EXCEPTION 'p_streams of % % must hold one stream key (or NULL) per payload: got % payloads and % streams.',
            p_what, quote_literal(p_topic), coalesce(cardinality(p_payloads), 0),
            coalesce(cardinality(p_streams), 0)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass NULL for no ordering, or a list parallel to p_payloads.';
    END IF;
    SELECT u.i - 1 AS i, octet_length(u.s) AS bytes INTO v_bad
    FROM unnest(p_streams) WITH ORDINALITY u(s, i)
    WHERE btrim(u.s) = '' OR octet_length(u.s) > 512
    ORDER BY u.i LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'Stream % of % % is empty or over 512 bytes (% bytes): pass NULL for no ordering, or a shorter key, e.g. a hash of the long one.',
            v_bad.i, p_what, quote_literal(p_topic), v_bad.bytes
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;

-- Store one outbox message for p_destination per payload, in list order; return their
-- message ids in the same order. p_streams is NULL or parallel to p_payloads (NULL
-- entries: no ordering); p_message_ids likewise (NULL: fresh ids).
CREATE FUNCTION workpump.send_many(
    p_destination text,
    p_payloads jsonb[],
    p_streams text[] DEFAULT NULL,
    p_priority integer DEFAULT 0,
    p_scheduled_for timestamptz DEFAULT NULL,
    p_max_attempts integer DEFAULT 10,
    p_message_ids uuid[] DEFAULT NULL,
    p_partition_count integer DEFAULT 10000,
    p_max_payload_bytes bigint DEFAULT 1048576,
    p_max_payload_depth integer DEFAULT 100
) RETURNS uuid[]
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_ids uuid[];
BEGIN
    PERFORM workpump.check_new_work('outbox destination', p_destination, '{}'::jsonb,
                                    p_priority, p_max_attempts, p_partition_count);
    IF p_payloads IS NULL THEN
        RAISE EXCEPTION 'p_payloads of outbox destination % must be an array of JSON objects, not NULL.',
            quote_literal(p_destination)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_payloads('outbox destination', p_destination, p_payloads,
                                    p_max_payload_bytes, p_max_payload_depth);
    PERFORM workpump.check_streams('outbox destination', p_destination, p_payloads, p_streams);
    IF p_message_ids IS NOT NULL
       AND cardinality(p_message_ids) <> coalesce(cardinality(p_payloads), 0) THEN
        RAISE EXCEPTION 'p_message_ids of outbox destination % must be parallel to p_payloads: got % payloads and % ids.',
            quote_literal(p_destination), coalesce(cardinality(p_payloads), 0),
            cardinality(p_message_ids)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass NULL for fresh ids.';
    END IF;
    IF coalesce(cardinality(p_payloads), 0) = 0 THEN
        RETURN '{}'::uuid[];
    END IF;
    -- every stream of this call, locked in one order (see the file's head)
    PERFORM workpump.lock_stream('outbox', '', s.stream)
    FROM (SELECT DISTINCT u.stream FROM unnest(p_streams) u(stream)
          WHERE u.stream IS NOT NULL ORDER BY u.stream) s;

    -- unnest, not subscripts: p_payloads[i] walks the array from its start every time
    WITH new_rows AS MATERIALIZED (
        SELECT u.i, coalesce(u.id, gen_random_uuid()) AS id, u.payload, u.stream
        FROM unnest(p_payloads, p_streams, p_message_ids) WITH ORDINALITY u(payload, stream, id, i)
    ), inserted AS (
        INSERT INTO workpump_outbox (message_id, destination, payload, stream,
                                     partition_number, priority, scheduled_for, max_attempts)
        SELECT r.id, p_destination, r.payload, r.stream,
               workpump.partition_of(coalesce(r.stream, r.id::text), p_partition_count),
               p_priority, p_scheduled_for, p_max_attempts
        FROM new_rows r
        ORDER BY r.i
    )
    SELECT array_agg(r.id ORDER BY r.i) INTO v_ids FROM new_rows r;
    RETURN v_ids;
END
$$;

-- Store one event of p_event_type per payload, in list order, and one work row per
-- event and subscriber (as emit: p_subscribers NULL means workpump_subscription's);
-- return the event ids in list order. p_streams and p_event_ids as in send_many.
CREATE FUNCTION workpump.emit_many(
    p_event_type text,
    p_payloads jsonb[],
    p_streams text[] DEFAULT NULL,
    p_subscribers jsonb DEFAULT NULL,
    p_event_ids uuid[] DEFAULT NULL,
    p_priority integer DEFAULT 0,
    p_partition_count integer DEFAULT 10000,
    p_max_payload_bytes bigint DEFAULT 1048576,
    p_max_payload_depth integer DEFAULT 100
) RETURNS uuid[]
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_ids uuid[];
    v_subscribers jsonb := p_subscribers;
    v_bad jsonb;
BEGIN
    PERFORM workpump.check_new_work('event type', p_event_type, '{}'::jsonb, p_priority, 1,
                                    p_partition_count);
    IF p_payloads IS NULL THEN
        RAISE EXCEPTION 'p_payloads of event type % must be an array of JSON objects, not NULL.',
            quote_literal(p_event_type)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_payloads('event type', p_event_type, p_payloads,
                                    p_max_payload_bytes, p_max_payload_depth);
    PERFORM workpump.check_streams('event type', p_event_type, p_payloads, p_streams);
    IF p_event_ids IS NOT NULL
       AND cardinality(p_event_ids) <> coalesce(cardinality(p_payloads), 0) THEN
        RAISE EXCEPTION 'p_event_ids of event type % must be parallel to p_payloads: got % payloads and % ids.',
            quote_literal(p_event_type), coalesce(cardinality(p_payloads), 0),
            cardinality(p_event_ids)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass NULL for fresh ids.';
    END IF;
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
    IF coalesce(cardinality(p_payloads), 0) = 0 THEN
        RETURN '{}'::uuid[];
    END IF;
    -- every (subscriber, stream) of this call, locked in one order per category
    PERFORM workpump.lock_stream(l.category, l.scope, l.stream)
    FROM (SELECT DISTINCT s->>'category' AS category, s->>'name' AS scope, u.stream
          FROM jsonb_array_elements(v_subscribers) s CROSS JOIN unnest(p_streams) u(stream)
          WHERE u.stream IS NOT NULL
          ORDER BY 1, 2, 3) l;

    -- unnest, not subscripts: p_payloads[i] walks the array from its start every time
    SELECT array_agg(coalesce(u.id, gen_random_uuid()) ORDER BY u.i)
    INTO v_ids
    FROM unnest(p_payloads, p_event_ids) WITH ORDINALITY u(payload, id, i);

    INSERT INTO workpump_event (event_id, event_type, payload, stream)
    SELECT u.id, p_event_type, u.payload, u.stream
    FROM unnest(v_ids, p_payloads, p_streams) WITH ORDINALITY u(id, payload, stream, i)
    ORDER BY u.i;

    INSERT INTO workpump_perspective_event (event_work_id, perspective_name, event_id, stream,
                                            partition_number, priority, max_attempts)
    SELECT gen_random_uuid(), s.value->>'name', u.id, u.stream,
           workpump.partition_of(coalesce(u.stream, u.id::text), p_partition_count),
           p_priority, coalesce((s.value->>'max_attempts')::integer, 10)
    FROM unnest(v_ids, p_streams) WITH ORDINALITY u(id, stream, i)
    CROSS JOIN jsonb_array_elements(v_subscribers) WITH ORDINALITY s(value, n)
    WHERE s.value->>'category' = 'perspective_event'
    ORDER BY u.i, s.n;

    INSERT INTO workpump_receptor_processing (id, receptor_name, event_id, stream,
                                              partition_number, priority, max_attempts)
    SELECT gen_random_uuid(), s.value->>'name', u.id, u.stream,
           workpump.partition_of(coalesce(u.stream, u.id::text), p_partition_count),
           p_priority, coalesce((s.value->>'max_attempts')::integer, 10)
    FROM unnest(v_ids, p_streams) WITH ORDINALITY u(id, stream, i)
    CROSS JOIN jsonb_array_elements(v_subscribers) WITH ORDINALITY s(value, n)
    WHERE s.value->>'category' = 'receptor'
    ORDER BY u.i, s.n;
    RETURN v_ids;
END
$$;
