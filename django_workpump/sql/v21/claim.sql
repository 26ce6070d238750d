-- Schema version 21: claim_work in fewer statements.
--
-- A claim woken by a NOTIFY runs on an idle server backend, where every statement
-- claim_work runs costs far more than back to back. One row sent 20 ms before each
-- single-row claim of one category, on PostgreSQL 15, the steps taken out one at a time
-- and interleaved in one database: the claim took 2.5 ms at the median, its claim_outbox
-- statement alone 1.5 ms. What went:
-- - the two index probes when only one category has topics to claim (0.27 ms): its
--   claim statement finds what they would;
-- - the category checks (a statement each), the topic and prefix checks, the topic
--   reads, check_instance and the live count: one statement now (check_category and
--   check_instance only run to raise);
-- - the rotation (a sequence read) with one category, and the array each category's rows
--   were gathered in and unnested from: each category's rows are returned as they come.

-- Lease up to p_max_rows claimable rows of the given categories (all when NULL) and of
-- the topics p_topics names (all when NULL; e.g. '{"outbox": ["emails.welcome"],
-- "inbox": ["stripe.webhook"]}'), or whose topic starts with one of the prefixes
-- p_topic_prefixes names in the same shape (e.g. '{"inbox": ["django.tasks:default:"]}'),
-- to p_instance_id for p_lease_seconds, each with a new
-- lease_token that every later write about the row must pass back. Raises SQLSTATE WP001
-- when p_instance_id is evicted or not registered. Of two or more categories with topics
-- to claim, a category is only claimed from when its two index probes find something;
-- one category's claim statement is its own probe. Either way an idle claim writes nothing.
-- headers are the row's, as its producer stored them (NULL when none). created_at is the
-- row's; due_at is when it became claimable: the expiry of the lease this claim took
-- over, else when its retry or deferral fell due, else created_at (schema version 16).
-- has_more is true on the rows of a category that filled its share of the budget (the
-- caller should poll again at once); a NOTICE 'workpump.has_more=true' says the same.
-- Each category's rows are leased by its own function: claim_outbox, claim_inbox,
-- claim_perspective_event, claim_receptor. With p_stream_run_max > 1 a stream head is
-- leased with a run: up to that many rows in all, the head and the consecutive rows that
-- follow it and could be leased now, each with its own token, returned together in stream
-- order; the runs' rows count against p_max_rows (schema version 15).
CREATE OR REPLACE FUNCTION workpump.claim_work(
    p_instance_id uuid,
    p_max_rows integer DEFAULT 100,
    p_lease_seconds integer DEFAULT 300,
    p_partition_count integer DEFAULT 10000,
    p_categories text[] DEFAULT NULL,
    p_stale_after_seconds integer DEFAULT 30,
    p_definitively_dead_after_seconds integer DEFAULT 300,
    p_now timestamptz DEFAULT NULL,
    p_topics jsonb DEFAULT NULL,
    p_topic_prefixes jsonb DEFAULT NULL,
    p_stream_run_max integer DEFAULT 1
) RETURNS TABLE (
    category text,
    work_id uuid,
    topic text,
    payload jsonb,
    stream text,
    attempts integer,
    max_attempts integer,
    lease_expiry timestamptz,
    event_id uuid,
    event_type text,
    priority integer,
    claimed_at timestamptz,
    lease_token uuid,
    headers jsonb,
    created_at timestamptz,
    due_at timestamptz,
    has_more boolean
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_categories text[] := coalesce(p_categories,
                                    ARRAY['outbox', 'inbox', 'perspective_event', 'receptor']);
    v_category text;
    v_outbox_topics text[];
    v_outbox_prefixes text[];
    v_inbox_topics text[];
    v_inbox_prefixes text[];
    v_perspective_topics text[];
    v_perspective_prefixes text[];
    v_receptor_topics text[];
    v_receptor_prefixes text[];
    v_topics_valid boolean;
    v_prefixes_valid boolean;
    v_evicted boolean;
    v_registered boolean;
    v_chosen text[] := '{}';
    v_with_work text[] := '{}';
    v_rounds text[];
    v_step integer := 1;
    v_first_round integer;
    v_rank integer;
    v_live_count integer;
    v_remaining integer := p_max_rows;
    v_quota integer;
    v_count integer;
    v_any_more boolean := false;
    v_start integer;
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION 'claim_work needs p_instance_id.' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_max_rows IS NULL OR p_max_rows < 1 THEN
        RAISE EXCEPTION 'claim_work needs p_max_rows >= 1, not %.', coalesce(p_max_rows::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_lease_seconds IS NULL OR p_lease_seconds < 1 THEN
        RAISE EXCEPTION 'claim_work needs p_lease_seconds >= 1, not %.', coalesce(p_lease_seconds::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_stream_run_max IS NULL OR p_stream_run_max < 1 THEN
        RAISE EXCEPTION 'claim_work needs p_stream_run_max >= 1, not %.', coalesce(p_stream_run_max::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_partition_count IS NULL OR p_partition_count < 1 THEN
        RAISE EXCEPTION 'claim_work needs p_partition_count >= 1, not %.', coalesce(p_partition_count::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- An expression, not a statement; check_category names the culprit.
    IF array_position(v_categories, NULL) IS NOT NULL
       OR NOT v_categories <@ ARRAY['outbox', 'inbox', 'perspective_event', 'receptor'] THEN
        FOREACH v_category IN ARRAY v_categories LOOP
            PERFORM workpump.check_category(v_category);
        END LOOP;
    END IF;

    -- One statement for all the claim must know first: whether the topic and prefix
    -- objects are well-formed, each category's topics and prefixes (the strings of its
    -- array, read so that a malformed object cannot fail the read before it is reported), whether this instance may claim, and its
    -- rank among live instances by live_instances's rule (pg_locks is read only when an
    -- instance's heartbeat is stale but short of the definitive-dead cutoff).
    SELECT
        p_topics IS NULL OR (
            jsonb_typeof(p_topics) = 'object'
            AND NOT EXISTS (SELECT 1 FROM jsonb_each(p_topics) e
                            WHERE e.key NOT IN ('outbox', 'inbox', 'perspective_event', 'receptor')
                               OR jsonb_typeof(e.value) <> 'array'
                               OR EXISTS (SELECT 1 FROM jsonb_array_elements(e.value) v
                                          WHERE jsonb_typeof(v) <> 'string'))),
        p_topic_prefixes IS NULL OR (
            jsonb_typeof(p_topic_prefixes) = 'object'
            AND NOT EXISTS (SELECT 1 FROM jsonb_each(p_topic_prefixes) e
                            WHERE e.key NOT IN ('outbox', 'inbox', 'perspective_event', 'receptor')
                               OR jsonb_typeof(e.value) <> 'array'
                               OR EXISTS (SELECT 1 FROM jsonb_array_elements(e.value) v
                                          WHERE jsonb_typeof(v) <> 'string' OR v #>> '{}' = ''))),
        CASE WHEN jsonb_typeof(p_topics -> 'outbox') = 'array'
             THEN ARRAY(SELECT v #>> '{}' FROM jsonb_array_elements(p_topics -> 'outbox') v
                        WHERE jsonb_typeof(v) = 'string')
             ELSE '{}'::text[] END,
        CASE WHEN jsonb_typeof(p_topic_prefixes -> 'outbox') = 'array'
             THEN ARRAY(SELECT v #>> '{}' FROM jsonb_array_elements(p_topic_prefixes -> 'outbox') v
                        WHERE jsonb_typeof(v) = 'string')
             ELSE '{}'::text[] END,
        CASE WHEN jsonb_typeof(p_topics -> 'inbox') = 'array'
             THEN ARRAY(SELECT v #>> '{}' FROM jsonb_array_elements(p_topics -> 'inbox') v
                        WHERE jsonb_typeof(v) = 'string')
             ELSE '{}'::text[] END,
        CASE WHEN jsonb_typeof(p_topic_prefixes -> 'inbox') = 'array'
             THEN ARRAY(SELECT v #>> '{}' FROM jsonb_array_elements(p_topic_prefixes -> 'inbox') v
                        WHERE jsonb_typeof(v) = 'string')
             ELSE '{}'::text[] END,
        CASE WHEN jsonb_typeof(p_topics -> 'perspective_event') = 'array'
             THEN ARRAY(SELECT v #>> '{}' FROM jsonb_array_elements(p_topics -> 'perspective_event') v
                        WHERE jsonb_typeof(v) = 'string')
             ELSE '{}'::text[] END,
        CASE WHEN jsonb_typeof(p_topic_prefixes -> 'perspective_event') = 'array'
             THEN ARRAY(SELECT v #>> '{}' FROM jsonb_array_elements(p_topic_prefixes -> 'perspective_event') v
                        WHERE jsonb_typeof(v) = 'string')
             ELSE '{}'::text[] END,
        CASE WHEN jsonb_typeof(p_topics -> 'receptor') = 'array'
             THEN ARRAY(SELECT v #>> '{}' FROM jsonb_array_elements(p_topics -> 'receptor') v
                        WHERE jsonb_typeof(v) = 'string')
             ELSE '{}'::text[] END,
        CASE WHEN jsonb_typeof(p_topic_prefixes -> 'receptor') = 'array'
             THEN ARRAY(SELECT v #>> '{}' FROM jsonb_array_elements(p_topic_prefixes -> 'receptor') v
                        WHERE jsonb_typeof(v) = 'string')
             ELSE '{}'::text[] END,
        EXISTS (SELECT 1 FROM workpump_eviction e WHERE e.instance_id = p_instance_id),
        live.registered, live.live_count, live.rank
    INTO v_topics_valid, v_prefixes_valid,
         v_outbox_topics, v_outbox_prefixes, v_inbox_topics, v_inbox_prefixes,
         v_perspective_topics, v_perspective_prefixes, v_receptor_topics, v_receptor_prefixes,
         v_evicted, v_registered, v_live_count, v_rank
    FROM (
        SELECT count(*) FILTER (WHERE si.instance_id = p_instance_id) > 0 AS registered,
               count(*)::integer AS live_count,
               (count(*) FILTER (WHERE si.instance_id < p_instance_id))::integer AS rank
        FROM workpump_service_instance si
        WHERE si.instance_id = p_instance_id
           OR si.last_heartbeat_at >= v_now - make_interval(secs => p_stale_after_seconds)
           OR (si.last_heartbeat_at >= v_now - make_interval(secs => p_definitively_dead_after_seconds)
               AND si.alive_lock_key IN (SELECT workpump.held_alive_lock_keys()))
    ) live;
    IF NOT v_topics_valid THEN
        RAISE EXCEPTION 'claim_work needs p_topics as an object of category: [topic, ...], not %.', p_topics
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'E.g. {"outbox": ["emails.welcome"], "inbox": ["stripe.webhook"]}; categories: outbox, inbox, perspective_event, receptor.';
    END IF;
    IF NOT v_prefixes_valid THEN
        RAISE EXCEPTION 'claim_work needs p_topic_prefixes as an object of category: [non-empty prefix, ...], not %.', p_topic_prefixes
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'E.g. {"inbox": ["django.tasks:default:"]}; to claim every topic, pass p_topics => NULL.';
    END IF;
    IF v_evicted OR NOT v_registered THEN
        PERFORM workpump.check_instance('claim_work', p_instance_id);  -- raises WP001
    END IF;
    IF p_topics IS NULL THEN  -- every topic
        v_outbox_topics := NULL;
        v_inbox_topics := NULL;
        v_perspective_topics := NULL;
        v_receptor_topics := NULL;
    END IF;
    IF p_topic_prefixes IS NULL THEN  -- none
        v_outbox_prefixes := NULL;
        v_inbox_prefixes := NULL;
        v_perspective_prefixes := NULL;
        v_receptor_prefixes := NULL;
    END IF;

    -- The categories with something to claim: each asked for with a topic chosen.
    IF 'outbox' = ANY (v_categories)
       AND workpump.any_topic_chosen(v_outbox_topics, v_outbox_prefixes) THEN
        v_chosen := v_chosen || 'outbox'::text;
    END IF;
    IF 'inbox' = ANY (v_categories)
       AND workpump.any_topic_chosen(v_inbox_topics, v_inbox_prefixes) THEN
        v_chosen := v_chosen || 'inbox'::text;
    END IF;
    IF 'perspective_event' = ANY (v_categories)
       AND workpump.any_topic_chosen(v_perspective_topics, v_perspective_prefixes) THEN
        v_chosen := v_chosen || 'perspective_event'::text;
    END IF;
    IF 'receptor' = ANY (v_categories)
       AND workpump.any_topic_chosen(v_receptor_topics, v_receptor_prefixes) THEN
        v_chosen := v_chosen || 'receptor'::text;
    END IF;
    IF cardinality(v_chosen) = 1 THEN
        -- Its claim statement finds what the probes would: they would only add a
        -- statement to every claim that has work.
        v_with_work := v_chosen;
    ELSIF cardinality(v_chosen) > 1 THEN
        -- Per-category guards: two index probes each (ready rows, due timers), of the
        -- topics the claimer can run, so the budget goes to the categories with work.
        -- The ORDER BY of each probe is its index's order: it keeps the planner on the
        -- partial index (an EXISTS may be planned as a scan of the whole table).
        IF 'outbox' = ANY (v_chosen) AND (
            (SELECT 1 FROM workpump_outbox t
                    WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                      AND t.instance_id IS NULL AND t.scheduled_for IS NULL
                      AND (v_outbox_topics IS NULL OR t.destination = ANY (v_outbox_topics)
                           OR t.destination ^@ ANY (v_outbox_prefixes))
                    ORDER BY t.priority DESC, t.seq LIMIT 1) IS NOT NULL
            OR (SELECT 1 FROM workpump_outbox t
                       WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                         AND (t.instance_id IS NOT NULL OR t.scheduled_for IS NOT NULL)
                         AND coalesce(t.lease_expiry, t.scheduled_for) <= v_now
                         AND (v_outbox_topics IS NULL OR t.destination = ANY (v_outbox_topics)
                           OR t.destination ^@ ANY (v_outbox_prefixes))
                       ORDER BY coalesce(t.lease_expiry, t.scheduled_for) LIMIT 1) IS NOT NULL) THEN
            v_with_work := v_with_work || 'outbox'::text;
        END IF;
        IF 'inbox' = ANY (v_chosen) AND (
            (SELECT 1 FROM workpump_inbox t
                    WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                      AND t.instance_id IS NULL AND t.scheduled_for IS NULL
                      AND (v_inbox_topics IS NULL OR t.handler_name = ANY (v_inbox_topics)
                           OR t.handler_name ^@ ANY (v_inbox_prefixes))
                    ORDER BY t.priority DESC, t.seq LIMIT 1) IS NOT NULL
            OR (SELECT 1 FROM workpump_inbox t
                       WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                         AND (t.instance_id IS NOT NULL OR t.scheduled_for IS NOT NULL)
                         AND coalesce(t.lease_expiry, t.scheduled_for) <= v_now
                         AND (v_inbox_topics IS NULL OR t.handler_name = ANY (v_inbox_topics)
                           OR t.handler_name ^@ ANY (v_inbox_prefixes))
                       ORDER BY coalesce(t.lease_expiry, t.scheduled_for) LIMIT 1) IS NOT NULL) THEN
            v_with_work := v_with_work || 'inbox'::text;
        END IF;
        IF 'perspective_event' = ANY (v_chosen) AND (
            (SELECT 1 FROM workpump_perspective_event t
                    WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                      AND t.instance_id IS NULL AND t.scheduled_for IS NULL
                      AND (v_perspective_topics IS NULL
                           OR t.perspective_name = ANY (v_perspective_topics)
                           OR t.perspective_name ^@ ANY (v_perspective_prefixes))
                    ORDER BY t.priority DESC, t.seq LIMIT 1) IS NOT NULL
            OR (SELECT 1 FROM workpump_perspective_event t
                       WHERE t.processed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                         AND (t.instance_id IS NOT NULL OR t.scheduled_for IS NOT NULL)
                         AND coalesce(t.lease_expiry, t.scheduled_for) <= v_now
                         AND (v_perspective_topics IS NULL
                              OR t.perspective_name = ANY (v_perspective_topics)
                           OR t.perspective_name ^@ ANY (v_perspective_prefixes))
                       ORDER BY coalesce(t.lease_expiry, t.scheduled_for) LIMIT 1) IS NOT NULL) THEN
            v_with_work := v_with_work || 'perspective_event'::text;
        END IF;
        IF 'receptor' = ANY (v_chosen) AND (
            (SELECT 1 FROM workpump_receptor_processing t
                    WHERE t.completed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                      AND t.instance_id IS NULL AND t.scheduled_for IS NULL
                      AND (v_receptor_topics IS NULL OR t.receptor_name = ANY (v_receptor_topics)
                           OR t.receptor_name ^@ ANY (v_receptor_prefixes))
                    ORDER BY t.priority DESC, t.seq LIMIT 1) IS NOT NULL
            OR (SELECT 1 FROM workpump_receptor_processing t
                       WHERE t.completed_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                         AND (t.instance_id IS NOT NULL OR t.scheduled_for IS NOT NULL)
                         AND coalesce(t.lease_expiry, t.scheduled_for) <= v_now
                         AND (v_receptor_topics IS NULL OR t.receptor_name = ANY (v_receptor_topics)
                           OR t.receptor_name ^@ ANY (v_receptor_prefixes))
                       ORDER BY coalesce(t.lease_expiry, t.scheduled_for) LIMIT 1) IS NOT NULL) THEN
            v_with_work := v_with_work || 'receptor'::text;
        END IF;
    END IF;
    IF cardinality(v_with_work) = 0 THEN
        RETURN;
    END IF;

    -- The budget is shared among the categories with work, starting the round at a
    -- rotating category (a budget smaller than the categories starves none); leftovers
    -- go, in a second round, to those that filled their share. Each category's rows are
    -- returned as its claim statement gives them, has_more counted over them (a window
    -- over the function scan, which keeps their order).
    v_first_round := cardinality(v_with_work);
    IF v_first_round > 1 THEN
        v_start := nextval('workpump.claim_rotation_seq') % v_first_round;
        v_with_work := v_with_work[v_start + 1:] || v_with_work[:v_start];
    END IF;
    v_rounds := v_with_work;
    WHILE v_step <= cardinality(v_rounds) LOOP
        v_category := v_rounds[v_step];
        IF v_step <= v_first_round THEN
            v_quota := ceil(v_remaining::numeric / (v_first_round - v_step + 1))::integer;
        ELSIF v_remaining <= 0 THEN
            v_any_more := true;
            EXIT;
        ELSE
            v_quota := v_remaining;
        END IF;
        IF v_quota > 0 THEN
            IF v_category = 'outbox' THEN
                RETURN QUERY SELECT w.*, count(*) OVER () >= v_quota
                FROM workpump.claim_outbox(
                    p_instance_id, v_quota, p_lease_seconds, v_rank, v_live_count,
                    v_outbox_topics, v_now, v_outbox_prefixes, p_stream_run_max) w;
            ELSIF v_category = 'inbox' THEN
                RETURN QUERY SELECT w.*, count(*) OVER () >= v_quota
                FROM workpump.claim_inbox(
                    p_instance_id, v_quota, p_lease_seconds, v_rank, v_live_count,
                    v_inbox_topics, v_now, v_inbox_prefixes, p_stream_run_max) w;
            ELSIF v_category = 'perspective_event' THEN
                RETURN QUERY SELECT w.*, count(*) OVER () >= v_quota
                FROM workpump.claim_perspective_event(
                    p_instance_id, v_quota, p_lease_seconds, v_rank, v_live_count,
                    v_perspective_topics, v_now, v_perspective_prefixes, p_stream_run_max) w;
            ELSE
                RETURN QUERY SELECT w.*, count(*) OVER () >= v_quota
                FROM workpump.claim_receptor(
                    p_instance_id, v_quota, p_lease_seconds, v_rank, v_live_count,
                    v_receptor_topics, v_now, v_receptor_prefixes, p_stream_run_max) w;
            END IF;
            GET DIAGNOSTICS v_count = ROW_COUNT;
            v_remaining := v_remaining - v_count;
            IF v_count >= v_quota THEN
                IF v_step <= v_first_round THEN
                    v_rounds := v_rounds || v_category;  -- it gets a share of the leftovers
                ELSE
                    v_any_more := true;
                END IF;
            END IF;
        END IF;
        v_step := v_step + 1;
    END LOOP;
    IF v_any_more THEN
        RAISE NOTICE 'workpump.has_more=true';
    END IF;
END
$$;
