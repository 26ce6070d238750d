-- The workpump schema as it is now, whole: read this file to know what a function does.
--
-- The schema migration (migrations/0002_schema.py) loads this file whole, in one
-- statement, on a database whose tables the model migration created. Until 0.1.0 is
-- released a change to the schema is made here alone; after that, here AND in a delta,
-- sql/deltas/<version>.sql, with a migration that loads it (docs/design-decisions.md).
-- tests/sql/test_schema.py builds one database with the migrations and one with the model
-- migration and this file, and fails when their catalogs differ.
--
-- Not here: the tables, their indexes and their constraints. Django's model migrations
-- create them (django_workpump/models.py), and this file expects them to exist; what it
-- adds to them is the insert triggers of the four work tables.
--
-- Functions say SET search_path FROM CURRENT, and the statement at the end pins each of
-- them to pg_catalog, <the schema of the tables>, pg_temp. (The few pure expressions
-- that name no table set no search_path, so the planner can inline them.)

-- --------------------------------------------------------------------------------------
-- The schema and its sequences
-- --------------------------------------------------------------------------------------

CREATE SCHEMA workpump;

-- The second half of each instance's alive-lock key, drawn when it registers.
CREATE SEQUENCE workpump.alive_lock_key_seq AS integer MINVALUE 1 CYCLE;

-- One category a claim takes rows of, with the topics and topic prefixes chosen of it
-- and its paused topics (NULL: none) (claim_work).
CREATE TYPE workpump.topic_choice AS (
    category text, topics text[], prefixes text[], paused text[]
);

-- Round-robin start of claim_work's category loop, so a small budget starves none.
CREATE SEQUENCE workpump.claim_rotation_seq AS integer MINVALUE 0 MAXVALUE 1023 CYCLE;

-- --------------------------------------------------------------------------------------
-- Types
-- --------------------------------------------------------------------------------------
-- The row a claim leases, or parks as dead (claim_work adds has_more).

-- A batch member's change of outcome (NULL: pending), and when (count_batch_changes).
CREATE TYPE workpump.batch_change AS (batch_id uuid, old text, new text, at timestamptz);

CREATE TYPE workpump.leased_work AS (
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
    last_error text,  -- NULL but on a row the claim parked as dead (see claim_work)
    checkpoint jsonb,  -- the row's last checkpoint (checkpoint_work); NULL on a parked row
    -- in a chain's run (send(after=...)): the row of this claim it waits for, which
    -- must complete on the claimer first; NULL on every other row
    after_id uuid
);

-- A group of flow-controlled rows: the claim's flow pass takes them round-robin.
CREATE TYPE workpump.flow_group AS (topic text, ckey text, fkey text);

-- --------------------------------------------------------------------------------------
-- Shared helpers
-- --------------------------------------------------------------------------------------
-- Categories and their tables, the partition hash, advisory-lock keys, row states, and
-- the checks the claim and the outcome functions share.

-- Raise unless p_category names one of the four work categories; return it.
CREATE FUNCTION workpump.check_category(p_category text) RETURNS text
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_category IS NULL
       OR p_category NOT IN ('outbox', 'inbox', 'perspective_event', 'receptor') THEN
        RAISE EXCEPTION 'Unknown workpump category %.', coalesce(quote_literal(p_category), 'NULL')
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Valid categories: outbox, inbox, perspective_event, receptor.';
    END IF;
    RETURN p_category;
END
$$;

-- The table behind a category and the names of its key, done-marker, topic and
-- ordering-scope columns (scope_col is NULL where the stream alone orders rows). Every
-- work table names the first three alike: work_id, done_at, topic.
CREATE FUNCTION workpump.work_table(
    p_category text,
    OUT tbl text, OUT key_col text, OUT done_col text, OUT topic_col text, OUT scope_col text
)
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    key_col := 'work_id'; done_col := 'done_at'; topic_col := 'topic';
    CASE workpump.check_category(p_category)
        WHEN 'outbox' THEN
            tbl := 'workpump_outbox'; scope_col := NULL;
        WHEN 'inbox' THEN
            tbl := 'workpump_inbox'; scope_col := NULL;
        WHEN 'perspective_event' THEN
            tbl := 'workpump_perspective_event'; scope_col := 'topic';
        ELSE
            tbl := 'workpump_receptor_processing'; scope_col := 'topic';
    END CASE;
END
$$;

-- A documented, portable hash of a stream key into [0, p_partition_count): the first 32
-- bits of its MD5, so application code can compute the same number
-- (int(md5(key).hexdigest()[:8], 16) % count).
CREATE FUNCTION workpump.partition_of(p_key text, p_partition_count integer DEFAULT 10000)
RETURNS integer
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN (('x' || left(md5(p_key), 8))::bit(32)::bigint % p_partition_count)::integer;

-- Advisory-lock namespaces (first half of the two-int key; objsubid 2 in pg_locks keeps
-- them apart from single-bigint application locks).
CREATE FUNCTION workpump.lock_namespace(p_purpose text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE p_purpose
    WHEN 'alive' THEN 1464877377        -- instance alive-locks; second half: alive_lock_key
    WHEN 'stream' THEN 1464877395       -- producers and completions of one ordered stream
    WHEN 'maintenance' THEN 1464877421  -- one maintenance pass at a time
    WHEN 'flow' THEN 1464877433         -- a topic's flow rule against its producers
END;

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
CREATE FUNCTION workpump.lock_stream(p_category text, p_scope text, p_stream text)
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

-- The state of a work row, from its columns (admin, status and tests use the same names).
CREATE FUNCTION workpump.state_of(
    p_done_at timestamptz,
    p_dead_lettered_at timestamptz,
    p_instance_id uuid,
    p_lease_expiry timestamptz,
    p_claimed_at timestamptz,
    p_scheduled_for timestamptz,
    p_end_state text DEFAULT NULL,
    p_now timestamptz DEFAULT NULL
) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
RETURN CASE
    -- a done row ended by completing, or as end_state says: 'cancelled', 'discarded'
    WHEN p_done_at IS NOT NULL THEN coalesce(p_end_state, 'done')
    WHEN p_dead_lettered_at IS NOT NULL THEN 'dead'
    -- the claim takes a row over once lease_expiry <= now: so expired means <=
    WHEN p_instance_id IS NOT NULL AND p_lease_expiry > coalesce(p_now, now()) THEN 'leased'
    WHEN p_instance_id IS NOT NULL THEN 'orphaned'
    WHEN p_claimed_at IS NOT NULL THEN 'orphaned'  -- holder evicted mid-attempt
    WHEN p_scheduled_for > coalesce(p_now, now()) THEN 'scheduled'
    ELSE 'pending'
END;

-- Raise SQLSTATE WP001 unless p_instance_id is registered and not tombstoned. Eviction
-- takes effect at the evicted instance's next claim or renewal, not only at its next
-- heartbeat; an instance that never registered is invisible to the peers that would
-- evict it, so it may not hold leases either.
CREATE FUNCTION workpump.check_instance(p_function text, p_instance_id uuid) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    v_evicted_at timestamptz;
    v_reason text;
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION '% needs p_instance_id.', p_function
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT e.evicted_at, e.reason INTO v_evicted_at, v_reason
    FROM workpump_eviction e WHERE e.instance_id = p_instance_id;
    IF FOUND THEN
        RAISE EXCEPTION '% refused instance %: it was evicted at % (%).',
            p_function, p_instance_id, v_evicted_at, v_reason
            USING ERRCODE = 'WP001',
                  HINT = 'An evicted instance must stop; a restarted process registers under a new id.';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM workpump_service_instance si
                   WHERE si.instance_id = p_instance_id) THEN
        RAISE EXCEPTION '% refused instance %: it is not registered.', p_function, p_instance_id
            USING ERRCODE = 'WP001',
                  HINT = 'Register it with workpump.record_heartbeat first (runworkpump does at start).';
    END IF;
END
$$;

-- Raise unless p_lease_tokens holds one non-NULL token per id of p_ids: every write after
-- a claim names the attempt it reports on, so an older attempt cannot stand for a newer.
CREATE FUNCTION workpump.check_lease_tokens(
    p_function text, p_ids uuid[], p_lease_tokens uuid[]
) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF coalesce(cardinality(p_lease_tokens), 0) <> coalesce(cardinality(p_ids), 0) THEN
        RAISE EXCEPTION '% needs one lease token per id: got % ids and % tokens.',
            p_function, coalesce(cardinality(p_ids), 0), coalesce(cardinality(p_lease_tokens), 0)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass p_lease_tokens, parallel to p_ids, as claim_work returned them.';
    END IF;
    IF array_position(p_lease_tokens, NULL) IS NOT NULL THEN
        RAISE EXCEPTION '% got a NULL lease token.', p_function
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass the lease_token claim_work returned with each row.';
    END IF;
END
$$;

-- Raise when p_ids holds a NULL work id.
CREATE FUNCTION workpump.check_ids(p_function text, p_ids uuid[]) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF array_position(p_ids, NULL) IS NOT NULL THEN
        RAISE EXCEPTION '% got a NULL work id.', p_function
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass the ids of rows claimed by claim_work.';
    END IF;
END
$$;

-- Attempt logs: the log records a handler emitted while an attempt ran, stored with the
-- attempt's outcome (complete_work, discard_work, fail_work: p_logs, one jsonb array per
-- id, NULL for none) in the same statement, only for the rows that outcome was written
-- for, so a fenced-out attempt's records never land. Each record is an object
-- {"at": epoch seconds, "level": logging's number, "logger": text, "message": text}; the
-- caller bounds and cleans them (django_workpump/attempt_logs.py), and these caps hold
-- whoever calls.
CREATE FUNCTION workpump.check_attempt_logs(p_function text, p_ids uuid[], p_logs jsonb[])
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_logs IS NULL THEN
        RETURN;
    END IF;
    IF cardinality(p_logs) <> coalesce(cardinality(p_ids), 0) THEN
        RAISE EXCEPTION '% needs one p_logs entry (a JSON array, or NULL) per id: got % ids and % entries.',
            p_function, coalesce(cardinality(p_ids), 0), cardinality(p_logs)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(p_logs) l(logs)
               WHERE l.logs IS NOT NULL AND jsonb_typeof(l.logs) <> 'array')
       OR EXISTS (SELECT 1 FROM unnest(p_logs) l(logs)
                  CROSS JOIN LATERAL jsonb_array_elements(
                      CASE WHEN jsonb_typeof(l.logs) = 'array' THEN l.logs END) r(rec)
                  WHERE jsonb_typeof(r.rec) IS DISTINCT FROM 'object'
                     OR jsonb_typeof(r.rec -> 'at') IS DISTINCT FROM 'number'
                     OR jsonb_typeof(r.rec -> 'level') IS DISTINCT FROM 'number'
                     OR jsonb_typeof(r.rec -> 'logger') IS DISTINCT FROM 'string'
                     OR jsonb_typeof(r.rec -> 'message') IS DISTINCT FROM 'string'
                     OR (r.rec ->> 'at')::numeric NOT BETWEEN 0 AND 32503680000
                     OR (r.rec ->> 'level')::numeric NOT BETWEEN 0 AND 1000) THEN
        RAISE EXCEPTION '% got an attempt log that is not a JSON array of records {"at": epoch seconds, "level": 0-1000, "logger": text, "message": text}.',
            p_function
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;

-- The CTE (", logged AS (...)") that stores the records of p_source's rows: p_source is
-- a CTE of the rows an outcome was written for, with their id, token, attempts and
-- logs. At most 200 records per attempt, each message cut at 8000 characters.
CREATE FUNCTION workpump.attempt_logs_cte(p_category text, p_source text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN format($c$, logged AS (
            INSERT INTO workpump_attempt_log
                (category, work_id, attempt, lease_token, logged_at, level, logger, message)
            SELECT %1$L, s.id, s.attempts, s.token,
                   to_timestamp((r.rec ->> 'at')::double precision),
                   floor((r.rec ->> 'level')::numeric)::integer,
                   left(r.rec ->> 'logger', 200), left(r.rec ->> 'message', 8000)
            FROM %2$I s CROSS JOIN LATERAL jsonb_array_elements(s.logs) WITH ORDINALITY r(rec, n)
            WHERE s.logs IS NOT NULL AND r.n <= 200
            ORDER BY s.id, r.n
        )$c$, p_category, p_source);

-- A work row's attempt logs go with it: the statement trigger after a delete on each
-- work table (retention's purges, an operator's delete) deletes the logs of its rows.
CREATE FUNCTION workpump.delete_attempt_logs() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    DELETE FROM workpump_attempt_log l
    WHERE l.work_id = ANY (ARRAY(SELECT d.work_id FROM deleted_rows d))
      AND l.category = TG_ARGV[0];
    RETURN NULL;
END
$$;

-- --------------------------------------------------------------------------------------
-- Flow control
-- --------------------------------------------------------------------------------------
-- Concurrency caps, rate limits, fairness weights and pauses (docs/flow-control.md), kept
-- in workpump_flow_rule and enforced by the claim's flow pass on every instance. A row is
-- flow-controlled (flow_controlled) iff it carries a concurrency or fairness key, or its
-- topic had a rule when it was stored; such rows never sit in the fast indexes (_ready,
-- _timer), so a rule costs the rows it does not govern nothing. A rule of a topic that
-- is created later flags the topic's undone rows in its own transaction (set_flow_rule),
-- under an exclusive advisory lock of the topic that every producer of the topic takes
-- shared (flow_flag): a row stored concurrently is either seen by that update or sees the
-- rule itself.

-- Keys: '' is none; at most 200 characters, no control characters.
CREATE FUNCTION workpump.check_flow_key(p_what text, p_topic text, p_kind text, p_key text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_key IS NOT NULL AND (length(p_key) > 200 OR p_key ~ '[[:cntrl:]]') THEN
        RAISE EXCEPTION 'The % of % % must be at most 200 characters without control characters, not %.',
            p_kind, p_what, quote_literal(p_topic), quote_literal(left(p_key, 60))
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Use a short name such as ''partner:acme'' or ''tenant:42''.';
    END IF;
END
$$;

-- Whether a new row of p_topic with these keys is flow-controlled. A row without keys
-- takes the topic's flow lock shared until its transaction ends: set_flow_rule takes it
-- exclusive, so either it flags this row or this lookup sees its rule.
CREATE FUNCTION workpump.flow_flag(
    p_category text, p_topic text, p_concurrency_key text, p_fairness_key text
) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF coalesce(p_concurrency_key, '') <> '' OR coalesce(p_fairness_key, '') <> '' THEN
        RETURN true;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(workpump.lock_namespace('flow'),
                                         hashtext(p_category || chr(31) || p_topic));
    RETURN EXISTS (SELECT 1 FROM workpump_flow_rule r
                   WHERE r.kind = 'topic' AND r.category = p_category AND r.name = p_topic);
END
$$;

-- Whether a row of these topics (of p_category) or of these concurrency keys is under a
-- concurrency cap: its topic's concurrency or key_concurrency, its key's concurrency, set
-- by the code or the operator (flow_rule_effective's cap, key_cap: a stored value, even a
-- hostile negative one, is a cap). The end of such a row may let a capped row start, on
-- any instance: complete_work, discard_work and fail_work then wake the claimers (NOTIFY
-- 'ended'). Rows limited by a rate or a fairness key alone free nothing another claim
-- waits for. Two lookups of the rule's unique key, not a read of flow_rule_effective():
-- every completion of a fairness key's rows asks, and under a flood that function's call
-- took a third of the completion.
CREATE FUNCTION workpump.flow_capped(p_category text, p_topics text[], p_keys text[])
RETURNS boolean
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN EXISTS (
               SELECT 1 FROM workpump_flow_rule r
               WHERE r.kind = 'topic' AND r.category = p_category AND r.name = ANY (p_topics)
                 AND num_nonnulls(r.override_concurrency, r.declared_concurrency,
                                  r.override_key_concurrency, r.declared_key_concurrency) > 0)
        OR EXISTS (
               SELECT 1 FROM workpump_flow_rule r
               WHERE r.kind = 'key' AND r.category = '' AND r.name = ANY (p_keys)
                 AND num_nonnulls(r.override_concurrency, r.declared_concurrency) > 0);
END
$$;

-- A token bucket's tokens at p_now: refilled at p_rate per second since p_tokens_at, up
-- to its burst (a full bucket when it was never used). NULL when there is no rate.
CREATE FUNCTION workpump.flow_tokens(
    p_tokens double precision, p_tokens_at timestamptz, p_rate double precision,
    p_burst double precision, p_now timestamptz
) RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE WHEN p_rate IS NOT NULL THEN
    least(p_burst, coalesce(p_tokens, p_burst)
                   + greatest(p_rate, 0)
                     * greatest(extract(epoch FROM p_now - coalesce(p_tokens_at, p_now)), 0))
END;

-- The rule's effective limits: an operator's override wins over the code's declaration.
-- Stored values may be hostile: a negative cap counts as 0, a burst as at least 1.
-- PL/pgSQL, so its plan is kept: each flow claim reads it three times, and a SQL
-- function with a search_path of its own is never inlined (it was planned per call).
CREATE FUNCTION workpump.flow_rule_effective() RETURNS TABLE (
    id bigint, kind text, category text, name text, paused boolean, weight integer,
    cap integer, key_cap integer, rate double precision, burst double precision,
    tokens double precision, tokens_at timestamptz
)
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
BEGIN
RETURN QUERY
SELECT r.id, r.kind::text, r.category::text, r.name::text, r.paused, greatest(r.weight, 1) AS weight,
       CASE WHEN coalesce(r.override_concurrency, r.declared_concurrency) IS NOT NULL
            THEN greatest(coalesce(r.override_concurrency, r.declared_concurrency), 0) END
           AS cap,
       CASE WHEN coalesce(r.override_key_concurrency, r.declared_key_concurrency) IS NOT NULL
            THEN greatest(coalesce(r.override_key_concurrency, r.declared_key_concurrency), 0)
       END AS key_cap,
       CASE WHEN coalesce(r.override_rate, r.declared_rate) IS NOT NULL
            THEN greatest(coalesce(r.override_rate, r.declared_rate), 0) END AS rate,
       greatest(coalesce(r.override_burst, r.declared_burst,
                         ceil(coalesce(r.override_rate, r.declared_rate))), 1)::double precision
           AS burst,
       r.tokens, r.tokens_at
FROM workpump_flow_rule r;
END
$$;

-- Create or change the rule of a topic (p_kind 'topic', p_category, p_name the topic),
-- a key (p_kind 'key', p_name the key: a concurrency key's cap and rate hold across every
-- topic and category; a fairness key's weight and pause within each topic) or a category
-- (p_kind 'category', pause only). p_set names what to set: concurrency, rate (starts
-- per second), burst, key_concurrency (the cap of each concurrency key of a topic),
-- weight, paused; a JSON null clears a value. With p_declared the code's declared values
-- are set (runworkpump start), else the operator's overrides, which win. A new topic
-- rule flags the topic's undone rows; a change of paused wakes the claimers. Returns the
-- rule's id.
CREATE FUNCTION workpump.set_flow_rule(
    p_kind text,
    p_category text,
    p_name text,
    p_set jsonb,
    p_declared boolean DEFAULT false,
    p_now timestamptz DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_category text := CASE WHEN p_kind = 'key' THEN '' ELSE p_category END;
    v_name text := CASE WHEN p_kind = 'category' THEN '' ELSE p_name END;
    v_id bigint;
    v_created boolean := false;
    v_was_paused boolean;
    v_was_limited boolean;
    v_meta record;
    v_bad text;
    v_lock integer;
    v_flagged integer;
    v_left boolean;
    v_idle integer;
BEGIN
    IF p_kind IS NULL OR p_kind NOT IN ('topic', 'key', 'category') THEN
        RAISE EXCEPTION 'A flow rule is of a topic, a key or a category, not %.',
            coalesce(quote_literal(p_kind), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_kind <> 'key' THEN
        PERFORM workpump.check_category(v_category);
    END IF;
    IF p_kind <> 'category' AND (v_name IS NULL OR btrim(v_name) = '') THEN
        RAISE EXCEPTION 'A flow rule of a % needs its name.', p_kind
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_flow_key('flow rule', v_name, p_kind, v_name);
    IF p_set IS NULL OR jsonb_typeof(p_set) <> 'object' THEN
        RAISE EXCEPTION 'p_set must be a JSON object of what to set, not %.', p_set
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT k INTO v_bad FROM jsonb_object_keys(p_set) k
    WHERE k NOT IN ('concurrency', 'rate', 'burst', 'key_concurrency', 'weight', 'paused')
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'A flow rule has no setting %.', quote_literal(v_bad)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Settings: concurrency, rate, burst, key_concurrency, weight, paused.';
    END IF;
    SELECT e.key INTO v_bad FROM jsonb_each(p_set) e
    WHERE e.value <> 'null'::jsonb AND CASE
        WHEN e.key = 'paused' THEN jsonb_typeof(e.value) <> 'boolean'
        WHEN e.key = 'rate' THEN jsonb_typeof(e.value) <> 'number' OR e.value::numeric <= 0
        WHEN e.key = 'weight' THEN jsonb_typeof(e.value) <> 'number'
             OR e.value::numeric <> trunc(e.value::numeric) OR e.value::numeric NOT BETWEEN 1 AND 1000
        ELSE jsonb_typeof(e.value) <> 'number'
             OR e.value::numeric <> trunc(e.value::numeric)
             OR e.value::numeric NOT BETWEEN CASE WHEN e.key = 'burst' THEN 1 ELSE 0 END
                                         AND 2147483647 END
    LIMIT 1;
    IF FOUND OR (p_set ? 'paused' AND p_set -> 'paused' = 'null'::jsonb)
       OR (p_set ? 'weight' AND p_set -> 'weight' = 'null'::jsonb) THEN
        RAISE EXCEPTION 'Bad flow rule setting %: %.', quote_literal(coalesce(v_bad, 'paused/weight')),
            p_set -> coalesce(v_bad, 'paused')
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'concurrency, key_concurrency: integers >= 0; burst: an integer >= 1; rate: a number > 0 (per second); weight: 1 to 1000; paused: true or false.';
    END IF;
    IF p_kind = 'category' AND EXISTS (SELECT 1 FROM jsonb_object_keys(p_set) k WHERE k <> 'paused') THEN
        RAISE EXCEPTION 'A category can only be paused or resumed.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    IF p_kind = 'topic' THEN
        -- producers of the topic hold this lock shared (flow_flag)
        v_lock := hashtext(v_category || chr(31) || v_name);
        IF NOT pg_try_advisory_xact_lock(workpump.lock_namespace('flow'), v_lock) THEN
            PERFORM workpump.wait_for_xact_lock(
                workpump.lock_namespace('flow'), v_lock,
                format('the flow rule of %s topic %L', v_category, v_name),
                current_setting('lock_timeout'));
        END IF;
    END IF;
    INSERT INTO workpump_flow_rule AS r (kind, category, name, weight, paused, updated_at)
    VALUES (p_kind, v_category, v_name, 1, false, coalesce(p_now, now()))
    ON CONFLICT (kind, category, name) DO NOTHING
    RETURNING r.id INTO v_id;
    v_created := v_id IS NOT NULL;
    SELECT r.id, r.paused,
           NOT v_created AND num_nonnulls(r.override_concurrency, r.declared_concurrency,
                                          r.override_rate, r.declared_rate,
                                          r.override_key_concurrency,
                                          r.declared_key_concurrency) > 0
    INTO v_id, v_was_paused, v_was_limited
    FROM workpump_flow_rule r
    WHERE r.kind = p_kind AND r.category = v_category AND r.name = v_name
    FOR UPDATE;
    UPDATE workpump_flow_rule r SET
        declared_concurrency = CASE WHEN p_declared AND p_set ? 'concurrency'
            THEN (p_set ->> 'concurrency')::integer ELSE r.declared_concurrency END,
        declared_rate = CASE WHEN p_declared AND p_set ? 'rate'
            THEN (p_set ->> 'rate')::double precision ELSE r.declared_rate END,
        declared_burst = CASE WHEN p_declared AND p_set ? 'burst'
            THEN (p_set ->> 'burst')::integer ELSE r.declared_burst END,
        declared_key_concurrency = CASE WHEN p_declared AND p_set ? 'key_concurrency'
            THEN (p_set ->> 'key_concurrency')::integer ELSE r.declared_key_concurrency END,
        override_concurrency = CASE WHEN NOT p_declared AND p_set ? 'concurrency'
            THEN (p_set ->> 'concurrency')::integer ELSE r.override_concurrency END,
        override_rate = CASE WHEN NOT p_declared AND p_set ? 'rate'
            THEN (p_set ->> 'rate')::double precision ELSE r.override_rate END,
        override_burst = CASE WHEN NOT p_declared AND p_set ? 'burst'
            THEN (p_set ->> 'burst')::integer ELSE r.override_burst END,
        override_key_concurrency = CASE WHEN NOT p_declared AND p_set ? 'key_concurrency'
            THEN (p_set ->> 'key_concurrency')::integer ELSE r.override_key_concurrency END,
        weight = CASE WHEN p_set ? 'weight' THEN (p_set ->> 'weight')::integer ELSE r.weight END,
        paused = CASE WHEN p_set ? 'paused' THEN (p_set ->> 'paused')::boolean ELSE r.paused END,
        updated_at = coalesce(p_now, now())
    WHERE r.id = v_id;

    IF p_kind = 'topic' AND NOT v_was_limited AND EXISTS (
        SELECT 1 FROM workpump_flow_rule r
        WHERE r.id = v_id
          AND num_nonnulls(r.override_concurrency, r.declared_concurrency, r.override_rate,
                           r.declared_rate, r.override_key_concurrency,
                           r.declared_key_concurrency) > 0) THEN
        -- The topic's first limit: its rows stored before leave the fast indexes, so the
        -- flow pass counts them (a pause alone needs no flags: claim_work leaves a paused
        -- topic out of the claimer's list, and the maintenance pass flags the rows for
        -- claimers of every topic or of a prefix). In batches
        -- that skip the rows another transaction holds (a claim leasing them, a
        -- completion): waiting for those in turn took seconds under load, and could
        -- deadlock with a completion of rows already flagged here. A skipped row is
        -- flagged by a later pass once its holder is done (a completed one no longer
        -- needs it); a pass that flags nothing while such rows remain waits 10 ms, 20
        -- times at most: a holder may be waiting for this transaction. What is left then
        -- (rows leased right now) the maintenance pass flags (flag_flow_stragglers).
        v_meta := workpump.work_table(v_category);
        v_idle := 0;
        LOOP
            EXECUTE format('UPDATE %1$I t SET flow_controlled = true
                            FROM (SELECT ctid FROM %1$I WHERE %2$I = $1 AND %3$I IS NULL
                                  AND NOT flow_controlled LIMIT 10000
                                  FOR UPDATE SKIP LOCKED) c
                            WHERE t.ctid = c.ctid',
                           v_meta.tbl, v_meta.topic_col, v_meta.done_col)
            USING v_name;
            GET DIAGNOSTICS v_flagged = ROW_COUNT;
            IF v_flagged = 0 THEN
                EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I WHERE %I = $1 AND %I IS NULL
                                               AND NOT flow_controlled)',
                               v_meta.tbl, v_meta.topic_col, v_meta.done_col)
                INTO v_left USING v_name;
                v_idle := v_idle + 1;
                EXIT WHEN NOT v_left OR v_idle > 20;
                PERFORM pg_sleep(0.01);
            END IF;
        END LOOP;
    END IF;
    IF p_set ? 'paused' AND v_was_paused IS DISTINCT FROM (p_set ->> 'paused')::boolean THEN
        -- wake the claimers: a resumed rule's rows are claimable now (at commit)
        PERFORM pg_notify('workpump_' || c, c)
        FROM unnest(CASE WHEN p_kind = 'key'
                         THEN ARRAY['outbox', 'inbox', 'perspective_event', 'receptor']
                         ELSE ARRAY[v_category] END) c;
    END IF;
    RETURN v_id;
END
$$;

-- Flag the undone rows of topics with a rule that are not flagged yet, up to p_batch per
-- category, skipping rows another transaction holds; returns how many. The maintenance
-- pass runs it: set_flow_rule leaves a row leased at the very moment its topic's first
-- rule was created, and a row stored by hand (an INSERT naming a partition and no
-- stream) is not flagged at all. Reads the fast indexes (_ready, _timer) only.
CREATE FUNCTION workpump.flag_flow_stragglers(p_batch integer DEFAULT 1000)
RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_category text;
    v_meta record;
    v_topics text[];
    v_count integer;
    v_total integer := 0;
BEGIN
    FOREACH v_category IN ARRAY ARRAY['outbox', 'inbox', 'perspective_event', 'receptor'] LOOP
        v_topics := ARRAY(SELECT r.name FROM workpump_flow_rule r
                          WHERE r.kind = 'topic' AND r.category = v_category);
        CONTINUE WHEN cardinality(v_topics) = 0;
        v_meta := workpump.work_table(v_category);
        EXECUTE format($q$
            UPDATE %1$I t SET flow_controlled = true
            FROM (SELECT s.ctid FROM %1$I s
                  WHERE s.%2$I IS NULL AND s.dead_lettered_at IS NULL AND s.stream_head
                    AND NOT s.flow_controlled AND s.%3$I = ANY ($1)
                  LIMIT $2
                  FOR UPDATE SKIP LOCKED) c
            WHERE t.ctid = c.ctid$q$,
            v_meta.tbl, v_meta.done_col, v_meta.topic_col)
        USING v_topics, p_batch;
        GET DIAGNOSTICS v_count = ROW_COUNT;
        v_total := v_total + v_count;
    END LOOP;
    RETURN v_total;
END
$$;

-- Set the code's declarations (p_rules: a JSON array of {"kind", "category", "name",
-- "concurrency", "rate", "burst", "key_concurrency"}; absent keys are no limit) and clear
-- the declared values of every other rule: what the code no longer declares is gone,
-- while operator overrides, pauses and weights stay. Returns the number of rules declared.
CREATE FUNCTION workpump.sync_flow_rules(
    p_rules jsonb,
    p_now timestamptz DEFAULT NULL
) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_rule jsonb;
    v_ids bigint[] := '{}';
BEGIN
    IF p_rules IS NULL OR jsonb_typeof(p_rules) <> 'array' THEN
        RAISE EXCEPTION 'p_rules must be a JSON array of flow rules.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR v_rule IN SELECT r FROM jsonb_array_elements(p_rules) r
                  ORDER BY r ->> 'kind', r ->> 'category', r ->> 'name' LOOP
        v_ids := v_ids || workpump.set_flow_rule(
            v_rule ->> 'kind', v_rule ->> 'category', v_rule ->> 'name',
            jsonb_build_object(
                'concurrency', v_rule -> 'concurrency', 'rate', v_rule -> 'rate',
                'burst', v_rule -> 'burst', 'key_concurrency', v_rule -> 'key_concurrency'),
            true, p_now);
    END LOOP;
    UPDATE workpump_flow_rule r
    SET declared_concurrency = NULL, declared_rate = NULL, declared_burst = NULL,
        declared_key_concurrency = NULL, updated_at = coalesce(p_now, now())
    WHERE r.id <> ALL (v_ids)
      AND num_nonnulls(r.declared_concurrency, r.declared_rate, r.declared_burst,
                       r.declared_key_concurrency) > 0;
    RETURN cardinality(v_ids);
END
$$;

-- The rows of concurrency key p_key held now (leased, lease unexpired, undone), summed
-- over the four work tables (their _flowheld indexes): a key's cap holds across them.
DO $build$
BEGIN
    EXECUTE format($f$
CREATE FUNCTION workpump.flow_key_in_flight(p_key text, p_now timestamptz)
RETURNS bigint
LANGUAGE sql STABLE
SET search_path FROM CURRENT
RETURN %s$f$,
        (SELECT string_agg(format(
            '(SELECT count(*) FROM %I h WHERE h.%I IS NULL AND h.instance_id IS NOT NULL'
            ' AND h.flow_controlled AND h.concurrency_key = p_key AND h.lease_expiry > p_now)',
            m.tbl, m.done_col), ' + ' ORDER BY c)
         FROM unnest(ARRAY['outbox', 'inbox', 'perspective_event', 'receptor']) c
         CROSS JOIN LATERAL workpump.work_table(c) m));
END
$build$;

-- Why a flow-controlled row waits now, or NULL when no rule holds it back (admin, status):
-- e.g. 'waiting: concurrency cap partner:acme 5/5'.
CREATE FUNCTION workpump.flow_reason(
    p_category text, p_topic text, p_concurrency_key text, p_fairness_key text,
    p_now timestamptz DEFAULT NULL
) RETURNS text
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_meta record := workpump.work_table(p_category);
    v_rule record;
    v_held bigint;
    v_tokens double precision;
BEGIN
    IF EXISTS (SELECT 1 FROM workpump_flow_rule r WHERE r.kind = 'category'
               AND r.category = p_category AND r.paused) THEN
        RETURN format('waiting: category %s paused', p_category);
    END IF;
    SELECT * INTO v_rule FROM workpump.flow_rule_effective() r
    WHERE r.kind = 'topic' AND r.category = p_category AND r.name = p_topic;
    IF FOUND THEN
        IF v_rule.paused THEN
            RETURN format('waiting: topic %s paused', p_topic);
        END IF;
        IF v_rule.cap IS NOT NULL OR (v_rule.key_cap IS NOT NULL AND p_concurrency_key <> '') THEN
            EXECUTE format('SELECT count(*) FROM %I h WHERE h.%I IS NULL AND h.instance_id IS NOT NULL
                            AND h.flow_controlled AND h.%I = $1 AND h.lease_expiry > $2
                            AND ($3 IS NULL OR h.concurrency_key = $3)',
                           v_meta.tbl, v_meta.done_col, v_meta.topic_col)
            INTO v_held USING p_topic, v_now, NULL::text;
            IF v_rule.cap IS NOT NULL AND v_held >= v_rule.cap THEN
                RETURN format('waiting: concurrency cap %s %s/%s', p_topic, v_held, v_rule.cap);
            END IF;
        END IF;
        v_tokens := workpump.flow_tokens(v_rule.tokens, v_rule.tokens_at, v_rule.rate,
                                         v_rule.burst, v_now);
        IF v_tokens < 1 THEN
            RETURN format('waiting: rate limit %s %s/s', p_topic, v_rule.rate);
        END IF;
        IF v_rule.key_cap IS NOT NULL AND p_concurrency_key <> '' THEN
            EXECUTE format('SELECT count(*) FROM %I h WHERE h.%I IS NULL AND h.instance_id IS NOT NULL
                            AND h.flow_controlled AND h.%I = $1 AND h.lease_expiry > $2
                            AND h.concurrency_key = $3',
                           v_meta.tbl, v_meta.done_col, v_meta.topic_col)
            INTO v_held USING p_topic, v_now, p_concurrency_key;
            IF v_held >= v_rule.key_cap THEN
                RETURN format('waiting: concurrency cap %s %s/%s',
                              p_concurrency_key, v_held, v_rule.key_cap);
            END IF;
        END IF;
    END IF;
    IF p_concurrency_key <> '' THEN
        SELECT * INTO v_rule FROM workpump.flow_rule_effective() r
        WHERE r.kind = 'key' AND r.name = p_concurrency_key;
        IF FOUND THEN
            IF v_rule.paused THEN
                RETURN format('waiting: key %s paused', p_concurrency_key);
            END IF;
            IF v_rule.cap IS NOT NULL THEN
                v_held := workpump.flow_key_in_flight(p_concurrency_key, v_now);
                IF v_held >= v_rule.cap THEN
                    RETURN format('waiting: concurrency cap %s %s/%s',
                                  p_concurrency_key, v_held, v_rule.cap);
                END IF;
            END IF;
            v_tokens := workpump.flow_tokens(v_rule.tokens, v_rule.tokens_at, v_rule.rate,
                                             v_rule.burst, v_now);
            IF v_tokens < 1 THEN
                RETURN format('waiting: rate limit %s %s/s', p_concurrency_key, v_rule.rate);
            END IF;
        END IF;
    END IF;
    IF p_fairness_key <> '' AND EXISTS (
        SELECT 1 FROM workpump_flow_rule r
        WHERE r.kind = 'key' AND r.name = p_fairness_key AND r.paused) THEN
        RETURN format('waiting: key %s paused', p_fairness_key);
    END IF;
    RETURN NULL;
END
$$;

-- Every flow rule as it stands now (workpump_status, the metrics, the admin): its
-- effective limits, its rows held now (a topic's in its table, a concurrency key's in
-- every table; NULL for a category), its whole tokens left (NULL: no rate), and its
-- heads waiting unleased (a topic's, flagged or not; a key's), counted up to
-- p_waiting_cap + 1. With p_category and p_topic, only the rules that hold that topic
-- back: its own and its category's (the console's topic page).
CREATE FUNCTION workpump.flow_rule_status(
    p_waiting_cap integer DEFAULT 10000,
    p_category text DEFAULT NULL,
    p_topic text DEFAULT NULL,
    p_now timestamptz DEFAULT NULL
) RETURNS TABLE (
    id bigint, kind text, category text, name text, concurrency integer,
    key_concurrency integer, rate double precision, burst double precision,
    weight integer, paused boolean, in_flight bigint, tokens double precision,
    waiting bigint
)
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_rule record;
    v_meta record;
    v_category text;
    v_count bigint;
BEGIN
    FOR v_rule IN SELECT * FROM workpump.flow_rule_effective() r
                  WHERE p_topic IS NULL
                     OR (r.category = p_category
                         AND (r.kind = 'category' OR (r.kind = 'topic' AND r.name = p_topic)))
                  ORDER BY r.kind, r.category, r.name LOOP
        id := v_rule.id; kind := v_rule.kind; category := v_rule.category;
        name := v_rule.name; concurrency := v_rule.cap; key_concurrency := v_rule.key_cap;
        rate := v_rule.rate; burst := CASE WHEN v_rule.rate IS NOT NULL THEN v_rule.burst END;
        weight := v_rule.weight; paused := v_rule.paused;
        tokens := floor(workpump.flow_tokens(v_rule.tokens, v_rule.tokens_at, v_rule.rate,
                                             v_rule.burst, v_now));
        in_flight := NULL;
        waiting := NULL;
        IF v_rule.kind = 'topic' THEN
            v_meta := workpump.work_table(v_rule.category);
            EXECUTE format(
                'SELECT (SELECT count(*) FROM %1$I h WHERE h.%2$I IS NULL
                           AND h.instance_id IS NOT NULL AND h.flow_controlled
                           AND h.%3$I = $1 AND h.lease_expiry > $2),
                        (SELECT count(*) FROM (
                            SELECT 1 FROM %1$I t WHERE t.%2$I IS NULL
                              AND t.dead_lettered_at IS NULL AND t.stream_head
                              AND t.%3$I = $1
                              AND (t.instance_id IS NULL OR t.lease_expiry <= $2)
                            LIMIT $3 + 1) w)',
                v_meta.tbl, v_meta.done_col, v_meta.topic_col)
            INTO in_flight, waiting USING v_rule.name, v_now, p_waiting_cap;
        ELSIF v_rule.kind = 'key' THEN
            in_flight := workpump.flow_key_in_flight(v_rule.name, v_now);
            waiting := 0;
            FOREACH v_category IN ARRAY ARRAY['outbox', 'inbox', 'perspective_event', 'receptor'] LOOP
                v_meta := workpump.work_table(v_category);
                EXECUTE format(
                    'SELECT count(*) FROM (
                        (SELECT 1 FROM %1$I t WHERE t.%2$I IS NULL
                           AND t.dead_lettered_at IS NULL AND t.stream_head
                           AND t.flow_controlled AND t.instance_id IS NULL
                           AND (t.concurrency_key = $1 OR t.fairness_key = $1)
                         LIMIT $3 + 1)
                        UNION ALL
                        (SELECT 1 FROM %1$I t WHERE t.%2$I IS NULL
                           AND t.dead_lettered_at IS NULL AND t.stream_head
                           AND t.flow_controlled AND t.instance_id IS NOT NULL
                           AND t.lease_expiry <= $2
                           AND (t.concurrency_key = $1 OR t.fairness_key = $1)
                         LIMIT $3 + 1)
                        LIMIT $3 + 1) w',
                    v_meta.tbl, v_meta.done_col)
                INTO v_count USING v_rule.name, v_now, p_waiting_cap;
                waiting := least(waiting + v_count, p_waiting_cap + 1);
            END LOOP;
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$;

-- --------------------------------------------------------------------------------------
-- Producers
-- --------------------------------------------------------------------------------------
-- Producing work: one call per message, inside the caller's transaction (transactional
-- outbox). Everything a producer passes is validated here too, so a non-Django producer
-- gets the same clear errors as django_workpump.send/receive/emit; payloads over a size
-- or nesting limit are refused at the door, so no row is stored that the pump cannot
-- decode.

-- Raise unless the topic, payload, priority, max_attempts and partition count of new
-- work are valid.
CREATE FUNCTION workpump.check_new_work(
    p_what text, p_topic text, p_payload jsonb, p_priority integer, p_max_attempts integer,
    p_partition_count integer
) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_topic IS NULL OR btrim(p_topic) = '' THEN
        RAISE EXCEPTION 'The % of new work must be a non-empty name.', p_what
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_payload IS NULL OR jsonb_typeof(p_payload) <> 'object' THEN
        RAISE EXCEPTION 'The payload of % % must be a JSON object, not %.',
            p_what, quote_literal(p_topic), coalesce(jsonb_typeof(p_payload), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_priority IS NULL OR p_priority NOT BETWEEN -32768 AND 32767 THEN
        RAISE EXCEPTION 'The priority of % % must be a smallint, not %.',
            p_what, quote_literal(p_topic), coalesce(p_priority::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_max_attempts IS NULL OR p_max_attempts < 1 THEN
        RAISE EXCEPTION 'max_attempts of % % must be at least 1, not %.',
            p_what, quote_literal(p_topic), coalesce(p_max_attempts::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_partition_count IS NULL OR p_partition_count < 1 THEN
        RAISE EXCEPTION 'p_partition_count must be at least 1, not %.',
            coalesce(p_partition_count::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass WORKPUMP[''PARTITION_COUNT''] (10000 by default).';
    END IF;
END
$$;

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

-- Raise unless p_scheduled_for is NULL or a finite time within years 1 to 9999 (UTC):
-- past them Python's datetime cannot read the row back, and a row due at 'infinity' would
-- never run and would hold back its stream. p_what names the producer's topic noun.
CREATE FUNCTION workpump.check_scheduled_for(p_what text, p_topic text,
                                             p_scheduled_for timestamptz)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_scheduled_for IS NOT NULL
       AND (NOT isfinite(p_scheduled_for)
            OR p_scheduled_for < '0001-01-01 00:00:00+00'::timestamptz
            OR p_scheduled_for >= '10000-01-01 00:00:00+00'::timestamptz) THEN
        RAISE EXCEPTION 'p_scheduled_for of % % is %, outside years 1 to 9999 (UTC): no pump could read the row or reach that time.',
            p_what, quote_literal(p_topic), p_scheduled_for
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass a time before 10000-01-01 00:00:00+00, or NULL to run it now.';
    END IF;
END
$$;

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
-- serializes two keys more. Contended, a bounded wait, as lock_stream's.
CREATE FUNCTION workpump.lock_unique_key(p_table text, p_topic text, p_unique_key text)
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
        SELECT o.work_id INTO v_holder FROM workpump_outbox o
        WHERE o.topic = p_topic AND o.unique_key = p_unique_key
          AND (o.done_at IS NULL OR o.created_at >= v_since)
        ORDER BY o.done_at IS NULL DESC, o.seq DESC
        LIMIT 1;
    ELSIF p_kind = 'inbox' THEN
        SELECT i.work_id INTO v_holder FROM workpump_inbox i
        WHERE i.topic = p_topic AND i.unique_key = p_unique_key
          AND (i.done_at IS NULL OR i.created_at >= v_since)
        ORDER BY i.done_at IS NULL DESC, i.seq DESC
        LIMIT 1;
    ELSIF p_kind = 'event' THEN
        SELECT e.event_id INTO v_holder FROM workpump_event e
        WHERE e.event_type = p_topic AND e.unique_key = p_unique_key
          AND (e.created_at >= v_since
               OR EXISTS (SELECT 1 FROM workpump_perspective_event p
                          WHERE p.event_id = e.event_id AND p.done_at IS NULL)
               OR EXISTS (SELECT 1 FROM workpump_receptor_processing r
                          WHERE r.event_id = e.event_id AND r.done_at IS NULL))
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
-- (unique_key_holder). p_headers are stored with the row (check_headers).
-- p_scheduled_for must fall within years 1 to 9999 in UTC (check_scheduled_for).
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
    p_headers jsonb DEFAULT NULL,
    p_batch_id uuid DEFAULT NULL,
    p_after uuid[] DEFAULT NULL,
    p_after_policy text DEFAULT 'cancel',
    p_concurrency_key text DEFAULT NULL,
    p_fairness_key text DEFAULT NULL,
    p_now timestamptz DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_id uuid := coalesce(p_message_id, gen_random_uuid());
    v_holder uuid;
    v_waiting uuid[];
    v_failed_id uuid;
    v_failed_outcome text;
    v_scheduled_for timestamptz := p_scheduled_for;
    v_flow boolean;
BEGIN
    PERFORM workpump.check_new_work('outbox destination', p_destination, p_payload,
                                    p_priority, p_max_attempts, p_partition_count);
    PERFORM workpump.check_flow_key('outbox destination', p_destination, 'concurrency_key',
                                    p_concurrency_key);
    PERFORM workpump.check_flow_key('outbox destination', p_destination, 'fairness_key',
                                    p_fairness_key);
    v_flow := workpump.flow_flag('outbox', p_destination, p_concurrency_key, p_fairness_key);
    IF coalesce(cardinality(p_after), 0) > 0 THEN
        IF p_unique_key IS NOT NULL OR p_scheduled_for IS NOT NULL THEN
            RAISE EXCEPTION 'Outbox message to % cannot combine after with %.',
                quote_literal(p_destination),
                CASE WHEN p_unique_key IS NOT NULL THEN 'a unique key' ELSE 'a scheduled time' END
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'A row sent with after= becomes claimable when its dependencies are done.';
        END IF;
        SELECT f.waiting, f.failed_id, f.failed_outcome
        INTO v_waiting, v_failed_id, v_failed_outcome
        FROM workpump.flag_dependencies(p_destination, p_after, p_after_policy) f;
        IF cardinality(v_waiting) > 0 THEN
            v_scheduled_for := 'infinity';  -- ready when the last dependency ends
        END IF;
    END IF;
    PERFORM workpump.check_scheduled_for('outbox destination', p_destination, p_scheduled_for);
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
            INSERT INTO workpump_outbox (work_id, topic, payload, stream,
                                         partition_number, priority, scheduled_for,
                                         max_attempts, unique_key, headers, batch_id,
                                         concurrency_key, fairness_key, flow_controlled)
            VALUES (v_id, p_destination, p_payload, p_stream,
                    workpump.partition_of(coalesce(p_stream, v_id::text), p_partition_count),
                    p_priority, p_scheduled_for, p_max_attempts, p_unique_key, p_headers,
                    p_batch_id, coalesce(p_concurrency_key, ''), coalesce(p_fairness_key, ''),
                    v_flow)
            ON CONFLICT (topic, unique_key)
                WHERE done_at IS NULL AND unique_key IS NOT NULL DO NOTHING;
            IF FOUND THEN
                IF p_batch_id IS NOT NULL THEN
                    PERFORM workpump.add_to_batch(p_batch_id, 1);  -- a member only if stored
                END IF;
                RETURN v_id;
            END IF;
            -- a holder written past the lock (a plain INSERT): the index found it
            SELECT o.work_id INTO v_holder FROM workpump_outbox o
            WHERE o.topic = p_destination AND o.unique_key = p_unique_key
              AND o.done_at IS NULL;
        END IF;
        IF p_on_conflict = 'raise' THEN
            RAISE EXCEPTION 'Outbox destination % already holds unique key % in message %.',
                quote_literal(p_destination), quote_literal(p_unique_key), v_holder
                USING ERRCODE = 'unique_violation',
                      HINT = 'Pass p_on_conflict => ''return'' to get the holder''s id instead.';
        END IF;
        RETURN v_holder;
    END IF;
    IF p_batch_id IS NOT NULL THEN
        PERFORM workpump.add_to_batch(p_batch_id, 1);
    END IF;
    INSERT INTO workpump_outbox (work_id, topic, payload, stream, partition_number,
                                 priority, scheduled_for, max_attempts, headers, batch_id,
                                 concurrency_key, fairness_key, flow_controlled)
    VALUES (v_id, p_destination, p_payload, p_stream,
            workpump.partition_of(coalesce(p_stream, v_id::text), p_partition_count),
            p_priority, v_scheduled_for, p_max_attempts, p_headers, p_batch_id,
            coalesce(p_concurrency_key, ''), coalesce(p_fairness_key, ''), v_flow);
    IF v_waiting IS NOT NULL THEN
        IF v_failed_id IS NOT NULL AND p_after_policy = 'cancel' THEN
            PERFORM workpump.cancel_dependent(v_id, v_failed_id, v_failed_outcome,
                                              coalesce(p_now, now()));
        ELSE
            INSERT INTO workpump_dependency (category, dependent_id, dependency_id, policy)
            SELECT 'outbox', v_id, w.id, p_after_policy FROM unnest(v_waiting) w(id)
            ON CONFLICT DO NOTHING;
        END IF;
    END IF;
    RETURN v_id;
END
$$;

-- Store an inbox message once per message id: false, with nothing written, when the id
-- was received before (within the de-duplication window), or when p_unique_key is held
-- (unique_key_holder; p_on_conflict => 'raise' raises unique_violation instead).
-- p_deduplicate => false skips the de-duplication row, for producers whose ids are fresh
-- UUIDs (task enqueues): a repeated id then fails on the inbox's unique work_id.
-- p_scheduled_for must fall within years 1 to 9999 in UTC (check_scheduled_for).
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
    p_headers jsonb DEFAULT NULL,
    p_concurrency_key text DEFAULT NULL,
    p_fairness_key text DEFAULT NULL,
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
    PERFORM workpump.check_flow_key('inbox handler', p_handler_name, 'concurrency_key',
                                    p_concurrency_key);
    PERFORM workpump.check_flow_key('inbox handler', p_handler_name, 'fairness_key',
                                    p_fairness_key);
    PERFORM workpump.check_scheduled_for('inbox handler', p_handler_name, p_scheduled_for);
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
    INSERT INTO workpump_inbox (work_id, topic, payload, stream, partition_number,
                                priority, scheduled_for, max_attempts, unique_key, headers,
                                concurrency_key, fairness_key, flow_controlled)
    VALUES (p_message_id, p_handler_name, p_payload, p_stream,
            workpump.partition_of(coalesce(p_stream, p_message_id::text), p_partition_count),
            p_priority, p_scheduled_for, p_max_attempts, p_unique_key, p_headers,
            coalesce(p_concurrency_key, ''), coalesce(p_fairness_key, ''),
            workpump.flow_flag('inbox', p_handler_name, p_concurrency_key, p_fairness_key));
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

-- The subscribers an event of p_event_type fans out to: p_subscribers as given (a JSON
-- array of {"category", "name", "max_attempts"}), or when NULL those of
-- workpump_subscription. Raises on a malformed list, naming the bad subscriber.
CREATE FUNCTION workpump.event_subscribers(p_event_type text, p_subscribers jsonb)
RETURNS jsonb
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_subscribers jsonb := p_subscribers;
    v_bad jsonb;
BEGIN
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
    RETURN v_subscribers;
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
    p_headers jsonb DEFAULT NULL,
    p_concurrency_key text DEFAULT NULL,
    p_fairness_key text DEFAULT NULL,
    p_now timestamptz DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_id uuid := coalesce(p_event_id, gen_random_uuid());
    v_partition integer;
    v_subscribers jsonb := p_subscribers;
    v_holder uuid;
BEGIN
    PERFORM workpump.check_flow_key('event type', p_event_type, 'concurrency_key',
                                    p_concurrency_key);
    PERFORM workpump.check_flow_key('event type', p_event_type, 'fairness_key',
                                    p_fairness_key);
    PERFORM workpump.check_new_work('event type', p_event_type, p_payload, p_priority, 1,
                                    p_partition_count);
    PERFORM workpump.check_payload('event type', p_event_type, p_payload,
                                   p_max_payload_bytes, p_max_payload_depth);
    PERFORM workpump.check_headers('event type', p_event_type, p_headers);
    PERFORM workpump.check_unique_key('event type', p_event_type, p_unique_key,
                                      p_unique_for, p_on_conflict);
    v_partition := workpump.partition_of(coalesce(p_stream, v_id::text), p_partition_count);
    v_subscribers := workpump.event_subscribers(p_event_type, p_subscribers);

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
    INSERT INTO workpump_perspective_event (work_id, topic, event_id, stream,
                                            partition_number, priority, max_attempts, headers,
                                            concurrency_key, fairness_key, flow_controlled)
    SELECT gen_random_uuid(), s->>'name', v_id, p_stream, v_partition, p_priority,
           coalesce((s->>'max_attempts')::integer, 10), p_headers,
           coalesce(p_concurrency_key, ''), coalesce(p_fairness_key, ''),
           workpump.flow_flag('perspective_event', s->>'name', p_concurrency_key,
                              p_fairness_key)
    FROM jsonb_array_elements(v_subscribers) s
    WHERE s->>'category' = 'perspective_event';

    INSERT INTO workpump_receptor_processing (work_id, topic, event_id, stream,
                                              partition_number, priority, max_attempts, headers,
                                              concurrency_key, fairness_key, flow_controlled)
    SELECT gen_random_uuid(), s->>'name', v_id, p_stream, v_partition, p_priority,
           coalesce((s->>'max_attempts')::integer, 10), p_headers,
           coalesce(p_concurrency_key, ''), coalesce(p_fairness_key, ''),
           workpump.flow_flag('receptor', s->>'name', p_concurrency_key, p_fairness_key)
    FROM jsonb_array_elements(v_subscribers) s
    WHERE s->>'category' = 'receptor';
    RETURN v_id;
END
$$;

-- Bulk producers: send_many and emit_many store a list of payloads in one call, in list
-- order, after taking the stream lock of every stream they write in one sorted order,
-- (scope, stream), the order promote_stream_heads takes them in, so concurrent bulk
-- producers and completions wait for each other instead of deadlocking.

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
-- p_scheduled_for must fall within years 1 to 9999 in UTC (check_scheduled_for).
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
    p_max_payload_depth integer DEFAULT 100,
    p_batch_id uuid DEFAULT NULL,
    p_concurrency_key text DEFAULT NULL,
    p_fairness_key text DEFAULT NULL
) RETURNS uuid[]
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_ids uuid[];
    v_flow boolean;
BEGIN
    PERFORM workpump.check_flow_key('outbox destination', p_destination, 'concurrency_key',
                                    p_concurrency_key);
    PERFORM workpump.check_flow_key('outbox destination', p_destination, 'fairness_key',
                                    p_fairness_key);
    PERFORM workpump.check_new_work('outbox destination', p_destination, '{}'::jsonb,
                                    p_priority, p_max_attempts, p_partition_count);
    PERFORM workpump.check_scheduled_for('outbox destination', p_destination, p_scheduled_for);
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
    IF p_batch_id IS NOT NULL THEN
        PERFORM workpump.add_to_batch(p_batch_id, cardinality(p_payloads));
    END IF;
    v_flow := workpump.flow_flag('outbox', p_destination, p_concurrency_key, p_fairness_key);
    -- every stream of this call, locked in one order (see the file's head)
    PERFORM workpump.lock_stream('outbox', '', s.stream)
    FROM (SELECT DISTINCT u.stream FROM unnest(p_streams) u(stream)
          WHERE u.stream IS NOT NULL ORDER BY u.stream) s;

    -- unnest, not subscripts: p_payloads[i] walks the array from its start every time
    WITH new_rows AS MATERIALIZED (
        SELECT u.i, coalesce(u.id, gen_random_uuid()) AS id, u.payload, u.stream
        FROM unnest(p_payloads, p_streams, p_message_ids) WITH ORDINALITY u(payload, stream, id, i)
    ), inserted AS (
        INSERT INTO workpump_outbox (work_id, topic, payload, stream, partition_number,
                                     priority, scheduled_for, max_attempts, batch_id,
                                     concurrency_key, fairness_key, flow_controlled)
        SELECT r.id, p_destination, r.payload, r.stream,
               workpump.partition_of(coalesce(r.stream, r.id::text), p_partition_count),
               p_priority, p_scheduled_for, p_max_attempts, p_batch_id,
               coalesce(p_concurrency_key, ''), coalesce(p_fairness_key, ''), v_flow
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
    p_max_payload_depth integer DEFAULT 100,
    p_concurrency_key text DEFAULT NULL,
    p_fairness_key text DEFAULT NULL
) RETURNS uuid[]
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_ids uuid[];
    v_subscribers jsonb := p_subscribers;
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
    PERFORM workpump.check_flow_key('event type', p_event_type, 'concurrency_key',
                                    p_concurrency_key);
    PERFORM workpump.check_flow_key('event type', p_event_type, 'fairness_key',
                                    p_fairness_key);
    IF p_event_ids IS NOT NULL
       AND cardinality(p_event_ids) <> coalesce(cardinality(p_payloads), 0) THEN
        RAISE EXCEPTION 'p_event_ids of event type % must be parallel to p_payloads: got % payloads and % ids.',
            quote_literal(p_event_type), coalesce(cardinality(p_payloads), 0),
            cardinality(p_event_ids)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass NULL for fresh ids.';
    END IF;
    v_subscribers := workpump.event_subscribers(p_event_type, p_subscribers);
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

    INSERT INTO workpump_perspective_event (work_id, topic, event_id, stream,
                                            partition_number, priority, max_attempts,
                                            concurrency_key, fairness_key, flow_controlled)
    SELECT gen_random_uuid(), s.value->>'name', u.id, u.stream,
           workpump.partition_of(coalesce(u.stream, u.id::text), p_partition_count),
           p_priority, coalesce((s.value->>'max_attempts')::integer, 10),
           coalesce(p_concurrency_key, ''), coalesce(p_fairness_key, ''), s.flow
    FROM unnest(v_ids, p_streams) WITH ORDINALITY u(id, stream, i)
    CROSS JOIN (
        -- each subscriber's flow flag once, not once per event
        SELECT s.value, s.n,
               workpump.flow_flag('perspective_event', s.value->>'name', p_concurrency_key,
                                  p_fairness_key) AS flow
        FROM jsonb_array_elements(v_subscribers) WITH ORDINALITY s(value, n)
        WHERE s.value->>'category' = 'perspective_event'
        OFFSET 0
    ) s
    ORDER BY u.i, s.n;

    INSERT INTO workpump_receptor_processing (work_id, topic, event_id, stream,
                                              partition_number, priority, max_attempts,
                                              concurrency_key, fairness_key, flow_controlled)
    SELECT gen_random_uuid(), s.value->>'name', u.id, u.stream,
           workpump.partition_of(coalesce(u.stream, u.id::text), p_partition_count),
           p_priority, coalesce((s.value->>'max_attempts')::integer, 10),
           coalesce(p_concurrency_key, ''), coalesce(p_fairness_key, ''), s.flow
    FROM unnest(v_ids, p_streams) WITH ORDINALITY u(id, stream, i)
    CROSS JOIN (
        -- each subscriber's flow flag once, not once per event
        SELECT s.value, s.n,
               workpump.flow_flag('receptor', s.value->>'name', p_concurrency_key,
                                  p_fairness_key) AS flow
        FROM jsonb_array_elements(v_subscribers) WITH ORDINALITY s(value, n)
        WHERE s.value->>'category' = 'receptor'
        OFFSET 0
    ) s
    ORDER BY u.i, s.n;
    RETURN v_ids;
END
$$;

-- --------------------------------------------------------------------------------------
-- Insert triggers of the work tables
-- --------------------------------------------------------------------------------------
-- Before each row with a stream or without a partition number (or with an unflagged flow
-- key): flag a flow-controlled row (flow_flag), fill partition_number and decide
-- stream_head (an unordered row is a head by the column's default). A row is
-- its stream's head iff no undone row of its ordering scope exists; the stream lock makes that check
-- and complete_work's promotion of the next head mutually exclusive, so exactly one
-- undone row per stream is a head, and rows become heads in commit order.
--
-- After each statement: one NOTIFY per category, delivered at commit.

-- Before each row of a work table; TG_ARGV[0] is its category.
CREATE FUNCTION workpump.before_insert_work() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_category text := TG_ARGV[0];
BEGIN
    IF NOT NEW.flow_controlled THEN
        -- a row stored without the producer functions (which flag it themselves): its
        -- keys or its topic's rule make it flow-controlled (flow_flag)
        NEW.flow_controlled := workpump.flow_flag(v_category, NEW.topic, NEW.concurrency_key,
                                                  NEW.fairness_key);
    END IF;
    IF NEW.partition_number IS NULL THEN
        NEW.partition_number := workpump.partition_of(
            coalesce(NEW.stream, NEW.seq::text),
            coalesce(nullif(current_setting('workpump.partition_count', true), '')::integer, 10000)
        );
    END IF;
    IF NEW.stream IS NULL THEN
        NEW.stream_head := true;
        RETURN NEW;
    END IF;
    -- Each branch is its own statement so plpgsql only parses the columns of this table.
    IF v_category = 'outbox' THEN
        PERFORM workpump.lock_stream(v_category, '', NEW.stream);
        NEW.stream_head := NOT EXISTS (
            SELECT 1 FROM workpump_outbox
            WHERE stream = NEW.stream AND done_at IS NULL);
    ELSIF v_category = 'inbox' THEN
        PERFORM workpump.lock_stream(v_category, '', NEW.stream);
        NEW.stream_head := NOT EXISTS (
            SELECT 1 FROM workpump_inbox
            WHERE stream = NEW.stream AND done_at IS NULL);
    ELSIF v_category = 'perspective_event' THEN
        PERFORM workpump.lock_stream(v_category, NEW.topic, NEW.stream);
        NEW.stream_head := NOT EXISTS (
            SELECT 1 FROM workpump_perspective_event
            WHERE topic = NEW.topic AND stream = NEW.stream
              AND done_at IS NULL);
    ELSE
        PERFORM workpump.lock_stream(v_category, NEW.topic, NEW.stream);
        NEW.stream_head := NOT EXISTS (
            SELECT 1 FROM workpump_receptor_processing
            WHERE topic = NEW.topic AND stream = NEW.stream
              AND done_at IS NULL);
    END IF;
    RETURN NEW;
END
$$;

-- After each INSERT statement on a work table: NOTIFY workpump_<category>.
CREATE FUNCTION workpump.notify_inserted_work() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    -- Statement-level: fires once per INSERT statement, and not at all for an empty one.
    IF EXISTS (SELECT 1 FROM inserted_rows) THEN
        PERFORM pg_notify('workpump_' || TG_ARGV[0], TG_ARGV[0]);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER workpump_outbox_before_insert BEFORE INSERT ON workpump_outbox
    FOR EACH ROW WHEN (NEW.stream IS NOT NULL OR NEW.partition_number IS NULL
                       OR (NOT NEW.flow_controlled
                           AND (NEW.concurrency_key <> '' OR NEW.fairness_key <> '')))
    EXECUTE FUNCTION workpump.before_insert_work('outbox');
CREATE TRIGGER workpump_inbox_before_insert BEFORE INSERT ON workpump_inbox
    FOR EACH ROW WHEN (NEW.stream IS NOT NULL OR NEW.partition_number IS NULL
                       OR (NOT NEW.flow_controlled
                           AND (NEW.concurrency_key <> '' OR NEW.fairness_key <> '')))
    EXECUTE FUNCTION workpump.before_insert_work('inbox');
CREATE TRIGGER workpump_perspective_event_before_insert BEFORE INSERT ON workpump_perspective_event
    FOR EACH ROW WHEN (NEW.stream IS NOT NULL OR NEW.partition_number IS NULL
                       OR (NOT NEW.flow_controlled
                           AND (NEW.concurrency_key <> '' OR NEW.fairness_key <> '')))
    EXECUTE FUNCTION workpump.before_insert_work('perspective_event');
CREATE TRIGGER workpump_receptor_processing_before_insert BEFORE INSERT ON workpump_receptor_processing
    FOR EACH ROW WHEN (NEW.stream IS NOT NULL OR NEW.partition_number IS NULL
                       OR (NOT NEW.flow_controlled
                           AND (NEW.concurrency_key <> '' OR NEW.fairness_key <> '')))
    EXECUTE FUNCTION workpump.before_insert_work('receptor');

CREATE TRIGGER workpump_outbox_notify AFTER INSERT ON workpump_outbox
    REFERENCING NEW TABLE AS inserted_rows
    FOR EACH STATEMENT EXECUTE FUNCTION workpump.notify_inserted_work('outbox');
CREATE TRIGGER workpump_inbox_notify AFTER INSERT ON workpump_inbox
    REFERENCING NEW TABLE AS inserted_rows
    FOR EACH STATEMENT EXECUTE FUNCTION workpump.notify_inserted_work('inbox');
CREATE TRIGGER workpump_perspective_event_notify AFTER INSERT ON workpump_perspective_event
    REFERENCING NEW TABLE AS inserted_rows
    FOR EACH STATEMENT EXECUTE FUNCTION workpump.notify_inserted_work('perspective_event');
CREATE TRIGGER workpump_receptor_processing_notify AFTER INSERT ON workpump_receptor_processing
    REFERENCING NEW TABLE AS inserted_rows
    FOR EACH STATEMENT EXECUTE FUNCTION workpump.notify_inserted_work('receptor');

CREATE TRIGGER workpump_outbox_attempt_logs AFTER DELETE ON workpump_outbox
    REFERENCING OLD TABLE AS deleted_rows
    FOR EACH STATEMENT EXECUTE FUNCTION workpump.delete_attempt_logs('outbox');
CREATE TRIGGER workpump_inbox_attempt_logs AFTER DELETE ON workpump_inbox
    REFERENCING OLD TABLE AS deleted_rows
    FOR EACH STATEMENT EXECUTE FUNCTION workpump.delete_attempt_logs('inbox');
CREATE TRIGGER workpump_perspective_event_attempt_logs AFTER DELETE ON workpump_perspective_event
    REFERENCING OLD TABLE AS deleted_rows
    FOR EACH STATEMENT EXECUTE FUNCTION workpump.delete_attempt_logs('perspective_event');
CREATE TRIGGER workpump_receptor_processing_attempt_logs AFTER DELETE ON workpump_receptor_processing
    REFERENCING OLD TABLE AS deleted_rows
    FOR EACH STATEMENT EXECUTE FUNCTION workpump.delete_attempt_logs('receptor');

-- --------------------------------------------------------------------------------------
-- Liveness
-- --------------------------------------------------------------------------------------
-- The alive-lock, the rule that says who is live, the heartbeat, eviction of dead
-- instances and graceful deregistration.
--
-- An instance is live iff its heartbeat is fresher than the stale cutoff, or its
-- alive-lock is held and its heartbeat is fresher than the definitive-dead cutoff. A lock
-- seen missing is stamped on the instance row (alive_lock_lost_at) and counts only once
-- a grace (one fast heartbeat interval) has passed: a live instance that lost its
-- listener beats at once and proves itself. An instance whose lock has been missing for
-- the grace, with no beat since it was first seen missing, is evicted however fresh its
-- heartbeat; instance_evictable holds the whole rule. A grace of 0 turns the lock-loss
-- rules off (heartbeat_table_only observers).
--
-- Any role that may connect can take advisory locks: a lock counts only while the
-- session that took it for its instance (alive_lock_pid) holds it, and take_alive_lock
-- skips keys other sessions hold. Taking the lock clears alive_lock_lost_at, so the
-- loss of a lock is stamped after the instance's last beat wherever in its life it dies.

-- alive_lock_key values whose alive-lock is held by the session that took it for its
-- instance (alive_lock_pid): the same key held by any other session proves nothing.
CREATE FUNCTION workpump.held_alive_lock_keys() RETURNS SETOF integer
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
CREATE FUNCTION workpump.take_alive_lock(p_instance_id uuid) RETURNS boolean
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
-- than p_instance_id has a heartbeat older than the stale cutoff. (The pump probes with
-- next_eviction_in, which also says when.)
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
CREATE FUNCTION workpump.cleanup_stale_instances(
    p_stale_cutoff timestamptz,
    p_definitive_dead_cutoff timestamptz DEFAULT NULL,
    p_lock_loss_grace_seconds double precision DEFAULT 0,
    p_now timestamptz DEFAULT NULL
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

-- cleanup_stale_instances with a 100 ms lock timeout, restored when this returns (a SET
-- clause, so the caller's own lock_timeout is untouched either way).
CREATE FUNCTION workpump.reap_without_waiting(
    p_stale_cutoff timestamptz,
    p_definitive_dead_cutoff timestamptz,
    p_lock_loss_grace_seconds double precision DEFAULT 0,
    p_now timestamptz DEFAULT NULL
) RETURNS SETOF uuid
LANGUAGE sql
SET search_path FROM CURRENT
SET lock_timeout = '100ms'
AS $$
    SELECT instance_id
    FROM workpump.cleanup_stale_instances(p_stale_cutoff, p_definitive_dead_cutoff,
                                          p_lock_loss_grace_seconds, p_now);
$$;

-- Record a heartbeat: upsert the instance row with last_heartbeat_at = now, and stamp
-- alive_lock_lost_at with now when this instance's alive-lock is not held (clear it when
-- it is): a beat without the lock proves the instance outlived the loss, so only its
-- heartbeat's age can evict it from here on. False, with nothing written, when the
-- instance was evicted (it must stop claiming and exit). Then, if another instance may
-- be evictable, evict without waiting on row locks.
CREATE FUNCTION workpump.record_heartbeat(
    p_instance_id uuid,
    p_service_name text,
    p_host_name text,
    p_process_id integer,
    p_metadata jsonb DEFAULT '{}',
    p_stale_after_seconds integer DEFAULT 30,
    p_definitively_dead_after_seconds integer DEFAULT 300,
    p_lock_loss_grace_seconds double precision DEFAULT 0,
    p_now timestamptz DEFAULT NULL
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
            PERFORM workpump.reap_without_waiting(v_stale_cutoff, v_dead_cutoff,
                                                  p_lock_loss_grace_seconds, v_now);
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

-- --------------------------------------------------------------------------------------
-- Claiming
-- --------------------------------------------------------------------------------------
-- A row is claimable iff it is its stream's head, not done, not dead, of a topic the
-- claimer names, and either ready (unowned, not scheduled) or its timer passed (lease
-- expired, or retry/deferral due). Ready rows are found through the _ready index, timers
-- through the _timer index; both are partial indexes whose predicates the queries below
-- repeat word for word. A stream whose head the claimer cannot run waits whole. Each
-- claimed row gets a fresh lease token; an evicted or unregistered instance claims
-- nothing (SQLSTATE WP001). Each claim statement is planned once per session (a generic
-- plan, without JIT): planning it on every call cost as much as running it.

-- One claim for every category. claim_<category> leases up to p_limit claimable rows of
-- the topics in p_topics (NULL: any), or of a topic starting with one of p_topic_prefixes,
-- to p_instance_id until p_now + p_lease_seconds, each with a new lease token; rows whose
-- attempts are used up are parked as dead instead, and returned first, without a lease
-- token, with their last_error. Each row comes with its created_at and due_at (see
-- claim_work). Called by claim_work, which checks the instance and the input and computes
-- p_rank and p_live_count.
--
-- The four functions are built from the one template below when the schema is loaded:
-- the tables share their row shape, and what differs (the table; whether the row is the
-- fan-out of an event, whose topic then scopes its streams and whose payload and type
-- come from the event) is filled in by define_claim from work_table. Each is static SQL,
-- planned once per session, as a hand-written copy would be. To change how rows are
-- claimed, change the template and run define_claim again for each category.
CREATE FUNCTION workpump.define_claim(p_category text) RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $define$
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_from_event boolean := v_meta.scope_col IS NOT NULL;
    v_alias text;
    -- leases a row locked as t (one attempt more, a new token), or parks it as dead when
    -- its attempts are used up; an expired lease taken over is stamped as an attempt that
    -- ended without an outcome. A row leased while it waits for its dependency (a
    -- chain's run) keeps waiting: its lease alone never makes it due.
    v_lease_set text := $lease$attempts = t.attempts + (t.attempts < t.max_attempts)::integer,
            instance_id = CASE WHEN t.attempts < t.max_attempts THEN p_instance_id END,
            lease_expiry = CASE WHEN t.attempts < t.max_attempts THEN v_lease_expiry END,
            lease_token = CASE WHEN t.attempts < t.max_attempts THEN gen_random_uuid() END,
            claimed_at = CASE WHEN t.attempts < t.max_attempts THEN v_now END,
            claim_due_at = CASE WHEN t.attempts < t.max_attempts THEN c.due_at END,
            dead_lettered_at = CASE WHEN t.attempts >= t.max_attempts THEN v_now END,
            lease_renewals = 0,
            scheduled_for = CASE WHEN t.scheduled_for = 'infinity' THEN t.scheduled_for END,
            failure_reason = CASE
                WHEN t.attempts >= t.max_attempts THEN 'max_attempts'
                WHEN t.instance_id IS NOT NULL THEN 'lease_expired'
                ELSE t.failure_reason END,
            last_error = CASE
                WHEN t.instance_id IS NOT NULL THEN
                    'attempt ' || t.attempts || ' ended without a reported outcome: the lease'
                    || ' of instance ' || t.instance_id || ' expired at ' || t.lease_expiry
                ELSE t.last_error END$lease$;
    -- a flow-controlled stream head (of a row t) that no lease holds and that may be
    -- leased at v_now (the _flow index's predicate and more). A leased head is not in
    -- _flow: its lease would add a second entry of that wide index, which a claim pays
    -- for per row; it is in the narrow _flowtimer, by lease_expiry, where v_flow_expired
    -- finds it once its lease expired
    v_flow_due text := $due$t.done_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
          AND t.flow_controlled AND t.instance_id IS NULL
          AND (t.scheduled_for IS NULL OR t.scheduled_for <= v_now)$due$;
    -- a flow-controlled stream head whose lease expired by v_now (the _flowtimer index's
    -- predicate and more): it may be leased again
    v_flow_expired text := $due$t.done_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
          AND t.flow_controlled AND t.instance_id IS NOT NULL AND t.lease_expiry <= v_now
          AND (t.scheduled_for IS NULL OR t.scheduled_for <= v_now)$due$;
    -- the first heads of a flow pass's group a that {heads} selects, in claim order, at
    -- most what the group may start, locked (a row another claimer holds is skipped)
    v_group_picks text := $picks$
                SELECT t.seq, t.ctid, t.priority, t.topic AS topic,
                       t.concurrency_key AS ckey, t.fairness_key AS fkey,
                       coalesce(t.lease_expiry, t.scheduled_for, t.created_at) AS due_at
                FROM {table} t
                WHERE {heads}
                  AND t.topic = a.topic AND t.concurrency_key = a.ckey
                  AND t.fairness_key = a.fkey
                ORDER BY t.priority DESC, t.seq
                LIMIT a.allow
                FOR UPDATE OF t SKIP LOCKED$picks$;
    -- whether a flow-controlled head of these topics may be leased at v_now (the claim's
    -- guard of its flow pass, and claimable_<category>'s probe of it); ordered by
    -- the _flow index's key, which keeps the planner on that index (an EXISTS was
    -- planned as a scan of the whole table). Named topics are looked up one by one,
    -- each a descent of the index: filtered in one walk, a claimer of other topics read
    -- every flow-controlled row queued (8.6 ms a claim behind 30,000 of them). Each
    -- probe reads from the newest end: a group is drained from its oldest rows, whose
    -- index entries stay until VACUUM, so from the oldest end a probe stepped over
    -- every row done since (0.2 ms behind 35,000, in every claim of a drain).
    v_flow_ready_probe text := $probe$(CASE WHEN p_topics IS NULL
         THEN (SELECT 1 FROM {table} t WHERE {flow_due}
               ORDER BY t.topic DESC, t.concurrency_key DESC, t.fairness_key DESC
               LIMIT 1) IS NOT NULL
         ELSE EXISTS (SELECT 1 FROM unnest(p_topics) u(topic)
                      WHERE (SELECT 1 FROM {table} t WHERE {flow_due} AND t.topic = u.topic
                             ORDER BY t.topic DESC, t.concurrency_key DESC,
                                      t.fairness_key DESC
                             LIMIT 1) IS NOT NULL)
              OR (p_topic_prefixes IS NOT NULL
                  AND (SELECT 1 FROM {table} t
                       WHERE {flow_due} AND t.topic ^@ ANY (p_topic_prefixes)
                       ORDER BY t.topic DESC, t.concurrency_key DESC, t.fairness_key DESC
                       LIMIT 1) IS NOT NULL) END
         OR (SELECT 1 FROM {table} t
             WHERE {flow_expired}
               AND (p_topics IS NULL OR t.topic = ANY (p_topics)
                    OR t.topic ^@ ANY (p_topic_prefixes))
             ORDER BY t.lease_expiry LIMIT 1) IS NOT NULL)$probe$;
    -- what a leased row reports (then: its pass and last_error, or its run's head)
    v_leased_columns text := $columns$t.seq, t.work_id AS work_id, t.topic AS topic,
                  {t.payload} AS payload, t.stream, {t.scope} AS scope,
                  t.partition_number, t.attempts, t.max_attempts, t.lease_expiry,
                  {t.event_id} AS event_id, t.priority, t.claimed_at, t.lease_token,
                  t.dead_lettered_at IS NOT NULL AS dead, t.headers,
                  t.created_at, c.due_at, t.checkpoint$columns$;
    -- whether claim_<category>'s fast passes would find anything: a ready row or a due
    -- timer, not flow-controlled, of the topics chosen; with p_flow, or a due flow-
    -- controlled head (inline: a function of its own cost more to call than the probe
    -- to run). The ORDER BY of each probe is its index's order: it keeps the planner on
    -- the partial index (an EXISTS may be planned as a scan of the whole table).
    v_probe text := $template$
CREATE OR REPLACE FUNCTION workpump.claimable_{category}(
    p_topics text[],
    p_topic_prefixes text[],
    p_flow boolean,
    p_now timestamptz
) RETURNS boolean
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_now timestamptz := p_now;
BEGIN
    RETURN (p_flow AND {flow_ready})
        OR (SELECT 1 FROM {table} t
            WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
              AND t.instance_id IS NULL AND t.scheduled_for IS NULL AND NOT t.flow_controlled
              AND (p_topics IS NULL OR t.topic = ANY (p_topics)
                   OR t.topic ^@ ANY (p_topic_prefixes))
            ORDER BY t.priority DESC, t.seq LIMIT 1) IS NOT NULL
        OR (SELECT 1 FROM {table} t
            WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
              AND (t.instance_id IS NOT NULL OR t.scheduled_for IS NOT NULL)
              AND NOT t.flow_controlled
              AND coalesce(t.lease_expiry, t.scheduled_for) <= p_now
              AND (t.scheduled_for IS NULL OR t.scheduled_for <= p_now)
              AND (p_topics IS NULL OR t.topic = ANY (p_topics)
                   OR t.topic ^@ ANY (p_topic_prefixes))
            ORDER BY coalesce(t.lease_expiry, t.scheduled_for) LIMIT 1) IS NOT NULL;
END
$$;
$template$;
    -- The flow pass: leases up to p_limit flow-controlled heads, each group (topic,
    -- concurrency key, fairness key) within what its rules allow now, the groups taken
    -- round-robin (a fairness key's weight is its rows per round; a group's rounds start
    -- after the rows it holds), priority then FIFO within a group. Exact across
    -- claimers: the rules that limit what it takes are locked (in id order) before it
    -- counts, so claimers of one limited group take turns. p_underserved_only: only the
    -- groups that hold fewer rows than the one holding most, one round each (claim_work).
    v_flow_claim text := $template$
CREATE OR REPLACE FUNCTION workpump.flow_claim_{category}(
    p_instance_id uuid,
    p_limit integer,
    p_lease_expiry timestamptz,
    p_topics text[] DEFAULT NULL,
    p_topic_prefixes text[] DEFAULT NULL,
    p_underserved_only boolean DEFAULT false,
    p_now timestamptz DEFAULT NULL
) RETURNS SETOF workpump.leased_work
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
SET jit = off
-- a plan kept from a near-empty table (a fresh install, a truncate) would scan the
-- whole table for the rows it leases once the table grew, on every claim until the
-- next ANALYZE: every table is reached through its indexes
SET enable_seqscan = off
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_lease_expiry timestamptz := p_lease_expiry;
    v_groups workpump.flow_group[];
    v_rows workpump.leased_work[];
    v_topics text[];  -- of each leased row, for the token buckets
    v_keys text[];
    v_wait_ms integer;
    v_one_group boolean;
    v_limited boolean;  -- a rule caps or rates these groups
    v_expired boolean;  -- some flow-controlled head's lease expired
BEGIN
    -- whether any flow-controlled head's lease expired (one descent of _flowtimer)
    v_expired := EXISTS (SELECT 1 FROM {table} t WHERE {flow_expired});
    -- the groups with a due head, one descent of _flow each (a loose index scan), from
    -- the newest end as the probe reads (a group's done rows are at its oldest end)
    WITH RECURSIVE g AS (
        (SELECT t.topic AS topic, t.concurrency_key AS ckey, t.fairness_key AS fkey
         FROM {table} t
         WHERE {flow_due}
         ORDER BY t.topic DESC, t.concurrency_key DESC, t.fairness_key DESC LIMIT 1)
        UNION ALL
        SELECT n.topic, n.ckey, n.fkey
        FROM g CROSS JOIN LATERAL (
            SELECT t.topic AS topic, t.concurrency_key AS ckey, t.fairness_key AS fkey
            FROM {table} t
            WHERE {flow_due}
              AND (t.topic, t.concurrency_key, t.fairness_key) < (g.topic, g.ckey, g.fkey)
            ORDER BY t.topic DESC, t.concurrency_key DESC, t.fairness_key DESC LIMIT 1
        ) n
    )
    SELECT array_agg(ROW(g.topic, g.ckey, g.fkey)::workpump.flow_group
                     ORDER BY g.topic, g.ckey, g.fkey)
    INTO v_groups
    FROM (SELECT g.topic, g.ckey, g.fkey FROM g
          UNION
          -- and those of a head whose lease expired (_flowtimer; in most claims none)
          SELECT t.topic, t.concurrency_key, t.fairness_key
          FROM {table} t WHERE v_expired AND {flow_expired}) g
    WHERE p_topics IS NULL OR g.topic = ANY (p_topics) OR g.topic ^@ ANY (p_topic_prefixes);
    IF v_groups IS NULL THEN
        RETURN;
    END IF;
    v_one_group := cardinality(v_groups) = 1;

    -- the rules that cap or rate what these groups may take, locked in one order
    PERFORM 1 FROM workpump_flow_rule r
    WHERE ((r.kind = 'topic' AND r.category = '{category}'
            AND r.name IN (SELECT g.topic FROM unnest(v_groups) g))
           OR (r.kind = 'key'
               AND r.name IN (SELECT g.ckey FROM unnest(v_groups) g WHERE g.ckey <> '')))
      AND num_nonnulls(r.override_concurrency, r.declared_concurrency, r.override_rate,
                       r.declared_rate, r.override_key_concurrency,
                       r.declared_key_concurrency) > 0
    ORDER BY r.id
    FOR UPDATE OF r;
    -- none does: no bucket to pay or wait for below (two statements a claim spared)
    v_limited := FOUND;

    WITH
    grp AS MATERIALIZED (
        SELECT g.topic, g.ckey, g.fkey FROM unnest(v_groups) g
    ),
    rules AS MATERIALIZED (
        SELECT r.kind, r.name, r.paused, r.weight, r.cap, r.key_cap, r.rate,
               floor(workpump.flow_tokens(r.tokens, r.tokens_at, r.rate, r.burst, v_now))
                   AS tokens
        FROM workpump.flow_rule_effective() r
        WHERE (r.kind = 'topic' AND r.category = '{category}'
               AND r.name IN (SELECT grp.topic FROM grp))
           OR (r.kind = 'key' AND (r.name IN (SELECT grp.ckey FROM grp WHERE grp.ckey <> '')
                                   OR r.name IN (SELECT grp.fkey FROM grp WHERE grp.fkey <> '')))
    ),
    -- what each topic may still start: its cap less its rows held now, its whole tokens
    -- (least() ignores NULL: no limit)
    topic_allow AS MATERIALIZED (
        SELECT d.topic, r.key_cap,
               CASE WHEN r.paused THEN 0 ELSE least(
                   r.cap - CASE WHEN r.cap IS NOT NULL THEN (
                       SELECT count(*) FROM {table} h
                       WHERE h.done_at IS NULL AND h.instance_id IS NOT NULL AND h.flow_controlled AND h.lease_expiry > v_now AND h.topic = d.topic) END,
                   r.tokens) END AS allow
        FROM (SELECT DISTINCT grp.topic FROM grp) d
        LEFT JOIN rules r ON r.kind = 'topic' AND r.name = d.topic
    ),
    -- what each concurrency key may still start, across every topic and category
    key_allow AS MATERIALIZED (
        SELECT d.ckey,
               CASE WHEN r.paused THEN 0 ELSE least(
                   r.cap - CASE WHEN r.cap IS NOT NULL
                                THEN workpump.flow_key_in_flight(d.ckey, v_now) END,
                   r.tokens) END AS allow
        FROM (SELECT DISTINCT grp.ckey FROM grp WHERE grp.ckey <> '') d
        LEFT JOIN rules r ON r.kind = 'key' AND r.name = d.ckey
    ),
    -- what each concurrency key may still start within a topic (its key_concurrency)
    topic_key_allow AS MATERIALIZED (
        SELECT d.topic, d.ckey,
               ta.key_cap - (SELECT count(*) FROM {table} h
                             WHERE h.done_at IS NULL AND h.instance_id IS NOT NULL AND h.flow_controlled AND h.lease_expiry > v_now AND h.topic = d.topic
                               AND h.concurrency_key = d.ckey) AS allow
        FROM (SELECT DISTINCT grp.topic, grp.ckey FROM grp WHERE grp.ckey <> '') d
        JOIN topic_allow ta ON ta.topic = d.topic
        WHERE ta.key_cap IS NOT NULL
    ),
    -- the rows each group holds now, on every instance: a group's rounds count them, so
    -- a group that holds rows takes its turn after those that hold fewer, also in a
    -- claim smaller than the number of groups (one group: no turns to order)
    held AS MATERIALIZED (
        SELECT h.topic, h.concurrency_key AS ckey, h.fairness_key AS fkey, count(*) AS n
        FROM {table} h
        WHERE (NOT v_one_group OR p_underserved_only)
          AND h.done_at IS NULL AND h.instance_id IS NOT NULL AND h.flow_controlled
          AND h.lease_expiry > v_now
          AND (h.concurrency_key, h.topic) IN (SELECT grp.ckey, grp.topic FROM grp)
        GROUP BY h.topic, h.concurrency_key, h.fairness_key
    ),
    -- p_underserved_only: only the groups that hold fewer rows than the group that holds
    -- the most, one round each
    group_allow AS MATERIALIZED (
        SELECT g.topic, g.ckey, g.fkey, coalesce(f.weight, 1) AS weight,
               coalesce(hd.n, 0) AS held,
               ta.allow AS topic_allow, ka.allow AS key_allow, tk.allow AS topic_key_allow,
               least(p_limit, ta.allow, ka.allow, tk.allow,
                     CASE WHEN p_underserved_only THEN coalesce(f.weight, 1) END)::bigint AS allow
        FROM grp g
        JOIN topic_allow ta ON ta.topic = g.topic
        LEFT JOIN key_allow ka ON ka.ckey = g.ckey
        LEFT JOIN topic_key_allow tk ON tk.topic = g.topic AND tk.ckey = g.ckey
        LEFT JOIN held hd ON hd.topic = g.topic AND hd.ckey = g.ckey AND hd.fkey = g.fkey
        LEFT JOIN rules f ON f.kind = 'key' AND f.name = g.fkey AND g.fkey <> ''
        WHERE NOT coalesce(f.paused, false)
          AND NOT (p_underserved_only
                   AND coalesce(hd.n, 0) >= coalesce((SELECT max(m.n) FROM held m), 0))
    ),
    -- each group's first rows, as many as it may start, numbered into rounds after the
    -- rows it holds
    picks AS MATERIALIZED (
        SELECT p.*, a.topic_allow, a.key_allow, a.topic_key_allow,
               ceil((a.held + row_number() OVER (PARTITION BY a.topic, a.ckey, a.fkey
                                                 ORDER BY p.priority DESC, p.seq))::numeric
                    / a.weight) AS round
        FROM group_allow a
        CROSS JOIN LATERAL (
            SELECT u.* FROM ({group_picks_due}) u
            UNION ALL
            -- the group's heads whose lease expired, in the same order (a one-time
            -- filter: read only when there are such heads)
            SELECT x.* FROM ({group_picks_expired}) x
            ORDER BY priority DESC, seq
            LIMIT a.allow
        ) p
        WHERE a.allow > 0
    ),
    -- the limits groups share (a topic's, a key's), in round order, then the budget
    within_topic AS (
        SELECT p.*, row_number() OVER (PARTITION BY p.ckey
                                       ORDER BY p.round, p.priority DESC, p.seq) AS n1
        FROM (SELECT p.*, row_number() OVER (PARTITION BY p.topic
                                             ORDER BY p.round, p.priority DESC, p.seq) AS n0
              FROM picks p) p
        WHERE p.topic_allow IS NULL OR p.n0 <= p.topic_allow
    ),
    within_key AS (
        SELECT p.*, row_number() OVER (PARTITION BY p.topic, p.ckey
                                       ORDER BY p.round, p.priority DESC, p.seq) AS n2
        FROM within_topic p
        WHERE p.key_allow IS NULL OR p.n1 <= p.key_allow
    ),
    -- one group: its picks are within every limit already, and the shared limits' sorts
    -- are skipped (a one-time filter)
    chosen AS (
        SELECT p.ctid, p.due_at, p.round, p.priority, p.seq FROM picks p WHERE v_one_group
        UNION ALL
        SELECT p.ctid, p.due_at, p.round, p.priority, p.seq FROM (
            SELECT p.*, row_number() OVER (ORDER BY p.round, p.priority DESC, p.seq) AS n3
            FROM within_key p
            WHERE p.topic_key_allow IS NULL OR p.n2 <= p.topic_key_allow
        ) p
        WHERE NOT v_one_group AND p.n3 <= p_limit
    ),
    -- each row by the ctid of the version locked above: TID lookups, never a scan
    claimed AS (
        UPDATE {table} t SET
            {lease_set}
        FROM chosen c
        WHERE t.ctid = ANY (ARRAY(SELECT chosen.ctid FROM chosen)) AND t.ctid = c.ctid
        RETURNING {leased_columns}, c.round, t.last_error, t.concurrency_key
    )
    SELECT array_agg(ROW(
               '{category}'::text, c.work_id, c.topic, {c.payload}, c.stream,
               c.attempts, c.max_attempts,
               CASE WHEN NOT c.dead THEN c.lease_expiry END, c.event_id, {c.event_type},
               c.priority::integer, CASE WHEN NOT c.dead THEN c.claimed_at END,
               CASE WHEN NOT c.dead THEN c.lease_token END,
               CASE WHEN NOT c.dead THEN c.headers END, c.created_at, c.due_at,
               CASE WHEN c.dead THEN c.last_error END,
               CASE WHEN NOT c.dead THEN c.checkpoint END, NULL::uuid
               )::workpump.leased_work ORDER BY c.round, c.priority DESC, c.seq),
           array_agg(c.topic) FILTER (WHERE NOT c.dead),
           array_agg(c.concurrency_key) FILTER (WHERE NOT c.dead)
    INTO v_rows, v_topics, v_keys
    FROM claimed c{c.event_join};

    IF v_limited AND v_topics IS NOT NULL THEN
        -- the token buckets pay for the rows started (their rules are locked above)
        UPDATE workpump_flow_rule r
        SET tokens = workpump.flow_tokens(e.tokens, e.tokens_at, e.rate, e.burst, v_now)
                     - d.taken,
            tokens_at = greatest(coalesce(e.tokens_at, v_now), v_now)
        FROM (SELECT 'topic' AS kind, '{category}' AS category, u.name, count(*) AS taken
              FROM unnest(v_topics) u(name) GROUP BY u.name
              UNION ALL
              SELECT 'key', '', u.name, count(*)
              FROM unnest(v_keys) u(name) WHERE u.name <> '' GROUP BY u.name) d,
             workpump.flow_rule_effective() e
        WHERE r.kind = d.kind AND r.category = d.category AND r.name = d.name
          AND e.id = r.id AND e.rate IS NOT NULL;
    END IF;
    -- when a rate held a group back, say when its bucket holds a token again: the pump
    -- polls then (NOTICE workpump.flow_wait_ms), not after its idle backoff
    IF v_limited THEN
        SELECT ceil(min((1 - workpump.flow_tokens(e.tokens, e.tokens_at, e.rate, e.burst,
                                                  v_now))
                        / e.rate) * 1000)
        INTO v_wait_ms
        FROM workpump.flow_rule_effective() e
        WHERE e.rate > 0
          AND ((e.kind = 'topic' AND e.category = '{category}'
                AND e.name IN (SELECT g.topic FROM unnest(v_groups) g))
               OR (e.kind = 'key'
                   AND e.name IN (SELECT g.ckey FROM unnest(v_groups) g WHERE g.ckey <> '')))
          AND workpump.flow_tokens(e.tokens, e.tokens_at, e.rate, e.burst, v_now) < 1;
    END IF;
    IF v_wait_ms IS NOT NULL THEN
        RAISE NOTICE 'workpump.flow_wait_ms=%', greatest(v_wait_ms, 10);
    END IF;
    -- rows of fairness keys were in reach: the pump's next claim is for its free slots
    -- plus the prefetch only (NOTICE workpump.flow_fair), so another key's row stored
    -- meanwhile waits for the next claim, not behind a queue of this one's
    IF EXISTS (SELECT 1 FROM unnest(v_groups) g WHERE g.fkey <> '') THEN
        RAISE NOTICE 'workpump.flow_fair';
    END IF;
    RETURN QUERY SELECT * FROM unnest(v_rows);
END
$$;
$template$;
    -- chain_runs: an outbox row leased above that is the only dependency of its only
    -- dependent (send(after=...)) takes that dependent along, leased right behind it,
    -- and so on down the chain, in the budget left and up to p_run_max rows a run. The
    -- claimer starts each once the row before it completed there, and releases the
    -- rest unstarted when one does not (docs/architecture.md, "Chains").
    v_chain_runs text := $chain$
    IF v_chain_heads IS NOT NULL AND p_run_max > 1 AND v_limit > v_returned THEN
        RETURN QUERY
        WITH RECURSIVE
        -- chain: each head's dependents down the chain, up to its share of the budget
        chain AS (
            SELECT h.id AS head_id, h.id, NULL::uuid AS after_id, 0 AS depth,
                   least(p_run_max - 1, ceil((v_limit - v_returned)::numeric
                                             / cardinality(v_chain_heads)))::integer AS room
            FROM unnest(v_chain_heads) h(id)
            UNION ALL
            SELECT c.head_id, d.dependent_id, c.id, c.depth + 1, c.room
            FROM chain c
            JOIN workpump_dependency d ON d.category = 'outbox' AND d.dependency_id = c.id
            WHERE c.depth < c.room
              AND NOT EXISTS (SELECT 1 FROM workpump_dependency o
                              WHERE o.category = 'outbox' AND o.dependency_id = c.id
                                AND o.dependent_id <> d.dependent_id)
              AND NOT EXISTS (SELECT 1 FROM workpump_dependency o
                              WHERE o.category = 'outbox' AND o.dependent_id = d.dependent_id
                                AND o.dependency_id <> c.id)
        ),
        -- locked: those rows locked, as they are now; one that may not be leased (taken,
        -- ended, no longer waiting, of a topic not claimed here) ends its run there
        locked AS MATERIALIZED (
            SELECT c.head_id, c.after_id, c.depth, l.ctid,
                   coalesce(l.leasable, false) AS leasable
            FROM chain c
            LEFT JOIN LATERAL (
                SELECT n.ctid,
                       n.done_at IS NULL AND n.dead_lettered_at IS NULL
                       AND n.instance_id IS NULL AND n.scheduled_for = 'infinity'
                       AND n.stream IS NULL AND NOT n.flow_controlled
                       AND n.attempts < n.max_attempts
                       AND (p_topics IS NULL OR n.topic = ANY (p_topics)
                            OR n.topic ^@ ANY (p_topic_prefixes))
                       AND (p_paused_topics IS NULL OR n.topic <> ALL (p_paused_topics))
                       AS leasable
                FROM workpump_outbox n
                WHERE n.work_id = c.id
                FOR UPDATE OF n SKIP LOCKED
            ) l ON true
            WHERE c.depth > 0
        ),
        -- followers: each chain's run, its leasable rows from the head down (the first
        -- that is not ends it); due now, when it may run
        followers AS (
            SELECT r.ctid, r.after_id, r.head_id, r.depth, v_now AS due_at
            FROM (SELECT l.*, bool_and(l.leasable)
                                  OVER (PARTITION BY l.head_id ORDER BY l.depth) AS in_run
                  FROM locked l) r
            WHERE r.in_run
        ),
        -- claimed_chains: each follower leased as the heads are; it keeps waiting
        -- (scheduled_for 'infinity'), so a lease that runs out does not make it
        -- claimable before its dependency ends
        claimed_chains AS (
            UPDATE workpump_outbox t SET
                {lease_set}
            FROM followers c WHERE t.ctid = c.ctid
            RETURNING {leased_columns}, c.after_id, c.head_id, c.depth
        )
        -- each chain's rows in chain order, after every head
        SELECT 'outbox'::text, c.work_id, c.topic, c.payload, c.stream, c.attempts,
               c.max_attempts, c.lease_expiry, c.event_id, NULL::text, c.priority::integer,
               c.claimed_at, c.lease_token, c.headers, c.created_at, c.due_at, NULL::text,
               c.checkpoint, c.after_id
        FROM claimed_chains c
        ORDER BY array_position(v_chain_heads, c.head_id), c.depth;
    END IF;
$chain$;
    v_claim text := $template$
CREATE OR REPLACE FUNCTION workpump.claim_{category}(
    p_instance_id uuid,
    p_limit integer,
    p_lease_seconds integer DEFAULT 300,
    p_rank integer DEFAULT 0,
    p_live_count integer DEFAULT 1,
    p_topics text[] DEFAULT NULL,
    p_topic_prefixes text[] DEFAULT NULL,
    p_run_max integer DEFAULT 1,
    p_paused_topics text[] DEFAULT NULL,
    p_underserved_only boolean DEFAULT false,
    p_now timestamptz DEFAULT NULL
) RETURNS SETOF workpump.leased_work
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
SET jit = off
SET enable_seqscan = off  -- as in flow_claim_{category}: never a kept scan
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_lease_expiry timestamptz := v_now + make_interval(secs => p_lease_seconds);
    v_heads workpump.leased_work[];  -- the heads leased, in the order they are returned
    v_head workpump.leased_work;
    v_head_seqs bigint[];  -- their seqs, in the same order
    v_stream_seqs bigint[];  -- of those, the heads of ordered streams, and their passes
    v_stream_passes integer[];
    v_parked workpump.leased_work[];  -- the heads parked as dead instead (NULL: none)
    v_flow workpump.leased_work[] := '{}';  -- the flow pass's rows, leased or parked
    v_limit integer := p_limit;  -- the budget the flow pass left to the others
    v_chain_heads uuid[];  -- the leased heads that may start a chain's run (or NULL)
    v_returned integer;  -- the heads and stream runs returned
BEGIN
    -- The flow pass first (flow_claim_{category}), when a flow-controlled head of these
    -- topics is due: it takes rows within their limits, and half the budget at most
    -- while the fast passes have work too, so neither kind starves the other.
    IF {flow_ready} THEN
        IF p_limit > 1 AND NOT p_underserved_only
           AND workpump.claimable_{category}(p_topics, p_topic_prefixes, false, v_now) THEN
            v_limit := ceil(p_limit / 2.0)::integer;
        END IF;
        v_flow := ARRAY(SELECT f FROM workpump.flow_claim_{category}(
            p_instance_id, v_limit, v_lease_expiry, p_topics, p_topic_prefixes,
            p_underserved_only, v_now) f);
        v_limit := p_limit - (SELECT count(*) FROM unnest(v_flow) f
                              WHERE f.lease_token IS NOT NULL)::integer;
    END IF;
    IF p_underserved_only THEN
        v_limit := 0;  -- the other passes' rows are no group's turn
    END IF;

    -- The heads: locked and leased (or parked as dead) in one statement; what is
    -- returned, and what their runs need, is kept in arrays. The flow pass may
    -- have taken the whole budget: then no statement (an UPDATE fires the table's
    -- statement triggers even when it changes no row).
    IF v_limit > 0 THEN
        WITH
        -- timers: stream heads whose lease expired or whose retry or deferral fell due, the
        -- longest due first (the table's _timer index); a row of a chain's run keeps
        -- waiting for its dependency even when its lease ran out
        timers AS MATERIALIZED (
            SELECT t.seq, t.ctid, 1 AS pass, t.attempts < t.max_attempts AS leasable,
                   t.seq AS run_seq, t.priority AS run_priority, t.stream AS run_stream,
                   {t.scope} AS run_scope,
                   coalesce(t.lease_expiry, t.scheduled_for, t.created_at) AS due_at
            FROM {table} t
            WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
              AND (t.instance_id IS NOT NULL OR t.scheduled_for IS NOT NULL)
              AND NOT t.flow_controlled
              AND coalesce(t.lease_expiry, t.scheduled_for) <= v_now
              AND (t.scheduled_for IS NULL OR t.scheduled_for <= v_now)
              AND (p_topics IS NULL OR t.topic = ANY (p_topics)
                   OR t.topic ^@ ANY (p_topic_prefixes))
              AND (p_paused_topics IS NULL OR t.topic <> ALL (p_paused_topics))
            ORDER BY coalesce(t.lease_expiry, t.scheduled_for)
            LIMIT v_limit
            FOR UPDATE OF t SKIP LOCKED
        ),
        -- own_share: with live peers, ready stream heads of this instance's partitions
        -- (partition_number mod live count = rank), in the budget the timers left
        own_share AS MATERIALIZED (
            SELECT * FROM (
                SELECT t.seq, t.ctid, 2 AS pass, t.attempts < t.max_attempts AS leasable,
                       t.seq AS run_seq, t.priority AS run_priority, t.stream AS run_stream,
                       {t.scope} AS run_scope,
                       coalesce(t.lease_expiry, t.scheduled_for, t.created_at) AS due_at
                FROM {table} t
                WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                  AND t.instance_id IS NULL AND t.scheduled_for IS NULL AND NOT t.flow_controlled
                  AND p_live_count > 1 AND t.partition_number % p_live_count = p_rank
                  AND (p_topics IS NULL OR t.topic = ANY (p_topics)
                       OR t.topic ^@ ANY (p_topic_prefixes))
                  AND (p_paused_topics IS NULL OR t.topic <> ALL (p_paused_topics))
                ORDER BY t.priority DESC, t.seq
                LIMIT v_limit - (SELECT count(*) FROM timers WHERE timers.leasable)
                FOR UPDATE OF t SKIP LOCKED
            ) share
            LIMIT p_limit  -- cuts nothing: gives the planner a row estimate
        ),
        -- any_share: ready stream heads of anyone's partitions, in the budget still left, so
        -- no row waits on a busy peer (the table's _ready index)
        any_share AS MATERIALIZED (
            SELECT * FROM (
                SELECT t.seq, t.ctid, 3 AS pass, t.attempts < t.max_attempts AS leasable,
                       t.seq AS run_seq, t.priority AS run_priority, t.stream AS run_stream,
                       {t.scope} AS run_scope,
                       coalesce(t.lease_expiry, t.scheduled_for, t.created_at) AS due_at
                FROM {table} t
                WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
                  AND t.instance_id IS NULL AND t.scheduled_for IS NULL AND NOT t.flow_controlled
                  AND t.seq NOT IN (SELECT own_share.seq FROM own_share)
                  AND (p_topics IS NULL OR t.topic = ANY (p_topics)
                       OR t.topic ^@ ANY (p_topic_prefixes))
                  AND (p_paused_topics IS NULL OR t.topic <> ALL (p_paused_topics))
                ORDER BY t.priority DESC, t.seq
                LIMIT v_limit - (SELECT count(*) FROM timers WHERE timers.leasable)
                              - (SELECT count(*) FROM own_share WHERE own_share.leasable)
                FOR UPDATE OF t SKIP LOCKED
            ) share
            LIMIT p_limit  -- cuts nothing: gives the planner a row estimate
        ),
        -- candidates: every head locked above, once (the three passes are disjoint)
        candidates AS (
            SELECT * FROM timers
            UNION ALL SELECT * FROM own_share
            UNION ALL SELECT * FROM any_share
        ),
        -- claimed_heads: each head leased (one attempt more, a new token) or, with its
        -- attempts used up, parked as dead; an expired lease taken over is stamped as an
        -- attempt that ended without an outcome. Rows are found by the ctid of the version
        -- locked above: a TID lookup, never a scan, whatever the table's statistics say
        claimed_heads AS (
            UPDATE {table} t SET
                {lease_set}
            FROM candidates c WHERE t.ctid = c.ctid
            RETURNING {leased_columns}, c.pass, t.last_error, {t.chains} AS chains
        )
        SELECT coalesce(array_agg(ROW(
                   '{category}'::text, c.work_id, c.topic, {c.payload}, c.stream,
                   c.attempts, c.max_attempts, c.lease_expiry, c.event_id, {c.event_type},
                   c.priority::integer, c.claimed_at, c.lease_token, c.headers, c.created_at,
                   c.due_at, NULL::text, c.checkpoint, NULL::uuid
                   )::workpump.leased_work ORDER BY c.pass, c.priority DESC, c.seq)
                   FILTER (WHERE NOT c.dead), '{}'),
               coalesce(array_agg(c.seq ORDER BY c.pass, c.priority DESC, c.seq)
                   FILTER (WHERE NOT c.dead), '{}'),
               array_agg(c.seq ORDER BY c.pass, c.priority DESC, c.seq)
                   FILTER (WHERE NOT c.dead AND c.stream IS NOT NULL),
               array_agg(c.pass ORDER BY c.pass, c.priority DESC, c.seq)
                   FILTER (WHERE NOT c.dead AND c.stream IS NOT NULL),
               array_agg(ROW(
                   '{category}'::text, c.work_id, c.topic, NULL::jsonb, c.stream,
                   c.attempts, c.max_attempts, NULL::timestamptz, c.event_id, {c.event_type},
                   c.priority::integer, NULL::timestamptz, NULL::uuid, NULL::jsonb, c.created_at,
                   c.due_at, c.last_error, NULL::jsonb, NULL::uuid
                   )::workpump.leased_work ORDER BY c.seq)
                   FILTER (WHERE c.dead),
               array_agg(c.work_id ORDER BY c.pass, c.priority DESC, c.seq)
                   FILTER (WHERE NOT c.dead AND c.chains)
        INTO v_heads, v_head_seqs, v_stream_seqs, v_stream_passes, v_parked, v_chain_heads
        FROM claimed_heads c{c.event_join};
    ELSE
        v_heads := '{}';
        v_head_seqs := '{}';
    END IF;
    -- Parked rows come first, without a lease token and with the last_error they were
    -- parked with: claim_work passes them on to a caller that asks, to log them. Then
    -- the flow pass's leased rows (heads of runs of one), then the others.
    IF cardinality(v_flow) > 0 THEN
        v_parked := ARRAY(SELECT f FROM unnest(v_flow) f WHERE f.lease_token IS NULL)
                    || coalesce(v_parked, '{}');
    END IF;
    IF cardinality(v_parked) > 0 THEN
        -- they ended: wake their waiters (workpump.wait)
        PERFORM workpump.notify_ended(ARRAY(SELECT p.work_id FROM unnest(v_parked) p));
        FOREACH v_head IN ARRAY v_parked LOOP
            RETURN NEXT v_head;
        END LOOP;
    END IF;
    FOREACH v_head IN ARRAY v_flow LOOP
        IF v_head.lease_token IS NOT NULL THEN
            RETURN NEXT v_head;
        END IF;
    END LOOP;
    IF v_stream_seqs IS NULL THEN
        -- No ordered stream among them: no run to add and no stream to own, so the
        -- statement below (a fifth of a one-row claim, cold) is not run.
        FOREACH v_head IN ARRAY v_heads LOOP
            RETURN NEXT v_head;
        END LOOP;
        v_returned := cardinality(v_heads);
    ELSE
        -- The runs of the stream heads, and the streams this instance now owns.
        RETURN QUERY
        WITH
        -- heads: the leased heads of ordered streams, with what their runs need
        heads AS MATERIALIZED (
            SELECT t.seq, u.pass, t.priority AS run_priority, t.stream AS run_stream,
                   {t.scope} AS run_scope, t.partition_number
            FROM unnest(v_stream_seqs, v_stream_passes) u(seq, pass)
            JOIN {table} t ON t.seq = u.seq
        ),
        -- run_budget: the rows the heads left in the budget, and how many runs share them
        run_budget AS MATERIALIZED (
            SELECT greatest(v_limit - cardinality(v_heads), 0) AS rows_left,
                   cardinality(v_stream_seqs) AS runs
        ),
        -- upcoming: with p_run_max > 1, the undone rows that follow each stream head,
        -- in stream order, no more per head than its share of the budget
        upcoming AS MATERIALIZED (
            SELECT c.seq AS head_seq, n.seq,
                   row_number() OVER (PARTITION BY c.seq ORDER BY n.seq) AS position
            FROM heads c
            CROSS JOIN run_budget b
            CROSS JOIN LATERAL (
                SELECT n.seq FROM {table} n
                WHERE {n.scope_match}n.stream = c.run_stream AND n.done_at IS NULL
                  AND n.stream IS NOT NULL AND n.seq > c.seq
                ORDER BY {n.scope_order}n.stream, n.seq
                LIMIT least(p_run_max - 1, ceil(b.rows_left::numeric / greatest(b.runs, 1)))
            ) n
            WHERE p_run_max > 1 AND b.rows_left > 0
        ),
        -- locked: those rows locked, as they are now (a row someone else is writing is
        -- skipped, and ends its run there)
        locked AS MATERIALIZED (
            SELECT l.seq, l.ctid, l.leasable, l.due_at
            FROM upcoming u
            CROSS JOIN LATERAL (
                -- one primary key lookup per row
                SELECT n.seq, n.ctid,
                       coalesce(n.lease_expiry, n.scheduled_for, n.created_at) AS due_at,
                       n.done_at IS NULL AND n.dead_lettered_at IS NULL
                       AND n.attempts < n.max_attempts
                       AND (n.instance_id IS NULL OR n.lease_expiry <= v_now)
                       AND (n.scheduled_for IS NULL OR n.scheduled_for <= v_now) AS leasable
                FROM {table} n
                WHERE n.seq = u.seq
                FOR UPDATE OF n SKIP LOCKED
            ) l
        ),
        -- followers: each head's run, the consecutive leasable rows right after it (the
        -- first row that is not ends the run), in the budget the heads left
        followers AS (
            SELECT r.seq, r.ctid, c.pass, true AS leasable, c.seq AS run_seq,
                   c.run_priority, c.run_stream, c.run_scope, r.due_at
            FROM (
                SELECT u.head_seq, u.seq, u.position, l.ctid, l.due_at,
                       bool_and(coalesce(l.leasable, false))
                           OVER (PARTITION BY u.head_seq ORDER BY u.position) AS in_run
                FROM upcoming u LEFT JOIN locked l ON l.seq = u.seq
            ) r
            JOIN heads c ON c.seq = r.head_seq
            WHERE r.in_run
            ORDER BY r.position, c.pass, c.run_priority DESC, c.seq
            LIMIT (SELECT b.rows_left FROM run_budget b)
        ),
        -- claimed_runs: each follower leased the same way (it has attempts left)
        claimed_runs AS (
            UPDATE {table} t SET
                {lease_set}
            FROM followers c WHERE t.ctid = c.ctid
            RETURNING {leased_columns}, c.run_seq
        ),
        -- pinned: the claimer owns each ordered stream it now works on (sorted: one lock
        -- order for all claimers)
        pinned AS (
            INSERT INTO workpump_active_stream AS s
                (category, scope, stream, partition_number, owner_instance_id, lease_expiry,
                 created_at, last_activity_at)
            SELECT DISTINCT ON (c.run_scope, c.run_stream)
                   '{category}', c.run_scope, c.run_stream, c.partition_number, p_instance_id,
                   v_lease_expiry, v_now, v_now
            FROM heads c
            ORDER BY c.run_scope, c.run_stream
            ON CONFLICT (category, scope, stream) DO UPDATE
                SET owner_instance_id = excluded.owner_instance_id,
                    lease_expiry = excluded.lease_expiry,
                    last_activity_at = excluded.last_activity_at
        )
        -- the heads as leased above, each run right after its head, in stream order
        SELECT o.category, o.work_id, o.topic, o.payload, o.stream, o.attempts, o.max_attempts,
               o.lease_expiry, o.event_id, o.event_type, o.priority, o.claimed_at,
               o.lease_token, o.headers, o.created_at, o.due_at, o.last_error,
               o.checkpoint, o.after_id
        FROM (
            SELECT h.*, h.seq_position AS run_position, 0::bigint AS seq
            FROM unnest(v_heads) WITH ORDINALITY h(category, work_id, topic, payload, stream,
                 attempts, max_attempts, lease_expiry, event_id, event_type, priority,
                 claimed_at, lease_token, headers, created_at, due_at, last_error, checkpoint,
                 after_id, seq_position)
            UNION ALL
            SELECT '{category}'::text, r.work_id, r.topic, {r.payload}, r.stream,
                   r.attempts, r.max_attempts, r.lease_expiry, r.event_id, {r.event_type},
                   r.priority::integer, r.claimed_at, r.lease_token, r.headers, r.created_at,
                   r.due_at, NULL::text, r.checkpoint, NULL::uuid, p.position, p.position, r.seq
            FROM claimed_runs r
{r.event_join}            JOIN unnest(v_head_seqs) WITH ORDINALITY p(seq, position) ON p.seq = r.run_seq
            WHERE NOT r.dead
        ) o
        ORDER BY o.run_position, o.seq;
        GET DIAGNOSTICS v_returned = ROW_COUNT;
    END IF;
{chain_runs}END
$$;
$template$;
BEGIN
    -- flow control (docs/flow-control.md): its pass, built alike, and claim_work's probes
    v_claim := v_claim || v_flow_claim || v_probe;
    -- chains (send(after=...)) are of the outbox alone; their statement's placeholders
    -- are filled with the rest
    v_claim := replace(v_claim, '{chain_runs}',
        CASE WHEN p_category = 'outbox' THEN v_chain_runs ELSE '' END);
    v_claim := replace(v_claim, '{lease_set}', v_lease_set);
    v_claim := replace(v_claim, '{group_picks_due}',
                       replace(v_group_picks, '{heads}', '{flow_due}'));
    v_claim := replace(v_claim, '{group_picks_expired}',
                       replace(v_group_picks, '{heads}', 'v_expired AND {flow_expired}'));
    v_claim := replace(v_claim, '{flow_ready}', v_flow_ready_probe);
    v_claim := replace(v_claim, '{flow_due}', v_flow_due);
    v_claim := replace(v_claim, '{flow_expired}', v_flow_expired);
    v_claim := replace(v_claim, '{leased_columns}', v_leased_columns);
    v_claim := replace(v_claim, '{t.chains}', CASE WHEN p_category = 'outbox'
        THEN '(t.has_dependents AND t.stream IS NULL)' ELSE 'false' END);
    FOREACH v_alias IN ARRAY ARRAY['c', 'r'] LOOP
        v_claim := replace(v_claim, '{' || v_alias || '.payload}',
            CASE WHEN v_from_event THEN 'e.payload' ELSE v_alias || '.payload' END);
        v_claim := replace(v_claim, '{' || v_alias || '.event_type}',
            CASE WHEN v_from_event THEN 'e.event_type' ELSE 'NULL::text' END);
    END LOOP;
    v_claim := replace(v_claim, '{c.event_join}', CASE WHEN v_from_event
        THEN E'\n    JOIN workpump_event e ON e.event_id = c.event_id' ELSE '' END);
    v_claim := replace(v_claim, '{r.event_join}', CASE WHEN v_from_event
        THEN E'            JOIN workpump_event e ON e.event_id = r.event_id\n' ELSE '' END);
    v_claim := replace(v_claim, '{t.payload}',
        CASE WHEN v_from_event THEN 'NULL::jsonb' ELSE 't.payload' END);
    v_claim := replace(v_claim, '{t.event_id}',
        CASE WHEN v_from_event THEN 't.event_id' ELSE 'NULL::uuid' END);
    v_claim := replace(v_claim, '{t.scope}',
        CASE WHEN v_from_event THEN 't.' || quote_ident(v_meta.scope_col) ELSE $$''::text$$ END);
    v_claim := replace(v_claim, '{n.scope_match}', CASE WHEN v_from_event
        THEN 'n.' || quote_ident(v_meta.scope_col) || ' = c.run_scope AND ' ELSE '' END);
    v_claim := replace(v_claim, '{n.scope_order}', CASE WHEN v_from_event
        THEN 'n.' || quote_ident(v_meta.scope_col) || ', ' ELSE '' END);
    v_claim := replace(v_claim, '{table}', quote_ident(v_meta.tbl));
    v_claim := replace(v_claim, '{category}', p_category);
    IF v_claim ~ '\{[a-z_.]+\}' THEN
        RAISE EXCEPTION 'define_claim left a placeholder unfilled: %',
            substring(v_claim from '\{[a-z_.]+\}');
    END IF;
    EXECUTE v_claim;
END
$define$;

SELECT workpump.define_claim(category)
FROM unnest(ARRAY['outbox', 'inbox', 'perspective_event', 'receptor']) category;

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
-- over, else when its retry or deferral fell due, else created_at.
-- Live peers share the ready rows by partition (each claims its own first): a peer
-- counts when its heartbeat is fresh, or when its alive-lock was held at the last probe
-- and its heartbeat is not past the definitive-dead cutoff. A peer that died with its
-- lock counts until the next probe stamps the loss (a few seconds); rows then wait for no
-- one, as any_share takes what the own shares leave.
-- has_more is true on the rows of a category that filled its share of the budget (the
-- caller should poll again at once); a NOTICE 'workpump.has_more=true' says the same.
-- Each category's rows are leased by its own function: claim_outbox, claim_inbox,
-- claim_perspective_event, claim_receptor. With p_stream_run_max > 1 a stream head is
-- leased with a run: up to that many rows in all, the head and the consecutive rows that
-- follow it and could be leased now, each with its own token, returned together in stream
-- order; the runs' rows count against p_max_rows.
-- A row whose attempts are used up (its last attempt ended without an outcome: the lease
-- expired) is parked as dead (failure_reason max_attempts), not leased. With
-- p_return_dead_lettered such rows are returned too, before their category's leased
-- rows, without a lease token and with the last_error they were parked with, so the
-- caller can log them; in the call that parks them they take budget from the categories
-- claimed after theirs (never more than p_max_rows rows are leased). last_error is NULL
-- on every leased row. checkpoint is what the row's last attempt stored
-- (checkpoint_work; NULL when none): the new attempt resumes from it.
-- p_underserved_only: lease only flow-controlled rows of the groups (topic, concurrency key,
-- fairness key) that hold fewer rows now, on every instance, than the group in reach
-- that holds the most, one round of each (its weight): the claim a pump makes with its
-- slots full when new work was stored, so a quiet tenant's row need not wait for a noisy
-- tenant's queue. A row counts as held until its outcome is written.
CREATE FUNCTION workpump.claim_work(
    p_instance_id uuid,
    p_max_rows integer DEFAULT 100,
    p_lease_seconds integer DEFAULT 300,
    p_partition_count integer DEFAULT 10000,
    p_categories text[] DEFAULT NULL,
    p_stale_after_seconds integer DEFAULT 30,
    p_definitively_dead_after_seconds integer DEFAULT 300,
    p_topics jsonb DEFAULT NULL,
    p_topic_prefixes jsonb DEFAULT NULL,
    p_stream_run_max integer DEFAULT 1,
    p_return_dead_lettered boolean DEFAULT false,
    p_underserved_only boolean DEFAULT false,
    p_now timestamptz DEFAULT NULL
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
    last_error text,
    checkpoint jsonb,
    after_id uuid,
    has_more boolean
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
-- its statements' plans are kept: left to choose, the planner kept planning them anew,
-- about 0.15 ms of every claim
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_categories text[] := coalesce(p_categories,
                                    ARRAY['outbox', 'inbox', 'perspective_event', 'receptor']);
    v_category text;
    v_choice workpump.topic_choice;
    v_topics_valid boolean;
    v_prefixes_valid boolean;
    v_evicted boolean;
    v_registered boolean;
    v_chosen workpump.topic_choice[];
    v_with_work workpump.topic_choice[] := '{}';
    v_rounds workpump.topic_choice[];
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
    -- objects are well-formed; the categories with something to claim (each asked for
    -- with a topic chosen, in one fixed order, with the topics and prefixes chosen of
    -- it); whether this instance may claim, and its rank among live instances by
    -- live_instances's rule (pg_locks is read only when an instance's heartbeat is stale
    -- but short of the definitive-dead cutoff).
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
        (SELECT coalesce(array_agg(ROW(c.category, c.topics, c.prefixes, c.paused)
                                   ::workpump.topic_choice ORDER BY c.position), '{}')
         FROM (SELECT u.category, u.position, x.paused,
                      -- the topics chosen of the category (NULL: every topic), less its
                      -- paused ones (flow control: a paused topic leaves the list at once)
                      CASE WHEN p_topics IS NULL THEN NULL
                           WHEN jsonb_typeof(p_topics -> u.category) = 'array' THEN
                               ARRAY(SELECT v #>> '{}'
                                     FROM jsonb_array_elements(p_topics -> u.category) v
                                     WHERE jsonb_typeof(v) = 'string'
                                       AND (x.paused IS NULL
                                            OR v #>> '{}' <> ALL (x.paused)))
                           ELSE '{}' END AS topics,
                      CASE WHEN p_topic_prefixes IS NULL THEN NULL
                           WHEN jsonb_typeof(p_topic_prefixes -> u.category) = 'array' THEN
                               ARRAY(SELECT v #>> '{}'
                                     FROM jsonb_array_elements(p_topic_prefixes -> u.category) v
                                     WHERE jsonb_typeof(v) = 'string')
                           ELSE '{}' END AS prefixes
               FROM unnest(ARRAY['outbox', 'inbox', 'perspective_event', 'receptor'])
                    WITH ORDINALITY u(category, position)
               -- its paused topics; a paused category is not claimed at all
               CROSS JOIN LATERAL (
                   SELECT array_agg(r.name ORDER BY r.name) FILTER (WHERE r.kind = 'topic'),
                          bool_or(r.kind = 'category')
                   FROM workpump_flow_rule r
                   WHERE r.paused AND r.category = u.category
                     AND r.kind IN ('topic', 'category')) x(paused, category_paused)
               WHERE u.category = ANY (v_categories) AND x.category_paused IS NOT TRUE
               OFFSET 0) c  -- each category's lists built once, not once per use below
         -- expressions, not functions: a SQL function with a subquery is not inlined,
         -- and would be planned anew on every claim
         WHERE c.topics IS NULL
            OR cardinality(c.topics) + coalesce(cardinality(c.prefixes), 0) > 0),
        EXISTS (SELECT 1 FROM workpump_eviction e WHERE e.instance_id = p_instance_id),
        live.registered, live.live_count, live.rank
    INTO v_topics_valid, v_prefixes_valid, v_chosen, v_evicted, v_registered, v_live_count,
         v_rank
    FROM (
        SELECT count(*) FILTER (WHERE si.instance_id = p_instance_id) > 0 AS registered,
               count(*)::integer AS live_count,
               (count(*) FILTER (WHERE si.instance_id < p_instance_id))::integer AS rank
        FROM workpump_service_instance si
        WHERE si.instance_id = p_instance_id
           OR si.last_heartbeat_at >= v_now - make_interval(secs => p_stale_after_seconds)
           -- a lock-holding peer beating slowly: the lock as the last probe saw it
           -- (reading pg_locks here cost 0.4 ms a claim; docs/design-decisions.md)
           OR (si.last_heartbeat_at >= v_now - make_interval(secs => p_definitively_dead_after_seconds)
               AND si.alive_lock_pid IS NOT NULL AND si.alive_lock_lost_at IS NULL)
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

    IF cardinality(v_chosen) = 1 THEN
        -- Its claim statement finds what the probes would: they would only add a
        -- statement to every claim that has work.
        v_with_work := v_chosen;
    ELSIF cardinality(v_chosen) > 1 THEN
        -- Per-category guards (claimable_<category>: three index probes, ready rows, due
        -- timers and due flow-controlled heads, of the topics the claimer can run), so
        -- the budget goes to the categories with work.
        FOREACH v_choice IN ARRAY v_chosen LOOP
            IF (CASE v_choice.category
                    WHEN 'outbox' THEN
                        workpump.claimable_outbox(v_choice.topics, v_choice.prefixes, true,
                                                  v_now)
                    WHEN 'inbox' THEN
                        workpump.claimable_inbox(v_choice.topics, v_choice.prefixes, true,
                                                 v_now)
                    WHEN 'perspective_event' THEN
                        workpump.claimable_perspective_event(
                            v_choice.topics, v_choice.prefixes, true, v_now)
                    ELSE
                        workpump.claimable_receptor(v_choice.topics, v_choice.prefixes, true,
                                                    v_now)
                END) THEN
                v_with_work := v_with_work || v_choice;
            END IF;
        END LOOP;
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
        v_choice := v_rounds[v_step];
        IF v_step <= v_first_round THEN
            v_quota := ceil(v_remaining::numeric / (v_first_round - v_step + 1))::integer;
        ELSIF v_remaining <= 0 THEN
            v_any_more := true;
            EXIT;
        ELSE
            v_quota := v_remaining;
        END IF;
        IF v_quota > 0 THEN
            IF v_choice.category = 'outbox' THEN
                RETURN QUERY SELECT w.*, count(w.lease_token) OVER () >= v_quota
                FROM workpump.claim_outbox(p_instance_id, v_quota, p_lease_seconds, v_rank,
                    v_live_count, v_choice.topics, v_choice.prefixes, p_stream_run_max,
                    v_choice.paused, p_underserved_only, v_now) w
                WHERE w.lease_token IS NOT NULL OR p_return_dead_lettered;
            ELSIF v_choice.category = 'inbox' THEN
                RETURN QUERY SELECT w.*, count(w.lease_token) OVER () >= v_quota
                FROM workpump.claim_inbox(p_instance_id, v_quota, p_lease_seconds, v_rank,
                    v_live_count, v_choice.topics, v_choice.prefixes, p_stream_run_max,
                    v_choice.paused, p_underserved_only, v_now) w
                WHERE w.lease_token IS NOT NULL OR p_return_dead_lettered;
            ELSIF v_choice.category = 'perspective_event' THEN
                RETURN QUERY SELECT w.*, count(w.lease_token) OVER () >= v_quota
                FROM workpump.claim_perspective_event(p_instance_id, v_quota, p_lease_seconds,
                    v_rank, v_live_count, v_choice.topics, v_choice.prefixes, p_stream_run_max,
                    v_choice.paused, p_underserved_only, v_now) w
                WHERE w.lease_token IS NOT NULL OR p_return_dead_lettered;
            ELSE
                RETURN QUERY SELECT w.*, count(w.lease_token) OVER () >= v_quota
                FROM workpump.claim_receptor(p_instance_id, v_quota, p_lease_seconds, v_rank,
                    v_live_count, v_choice.topics, v_choice.prefixes, p_stream_run_max,
                    v_choice.paused, p_underserved_only, v_now) w
                WHERE w.lease_token IS NOT NULL OR p_return_dead_lettered;
            END IF;
            GET DIAGNOSTICS v_count = ROW_COUNT;
            v_remaining := v_remaining - v_count;
            IF v_count >= v_quota THEN
                IF v_step <= v_first_round THEN
                    v_rounds := v_rounds || v_choice;  -- it gets a share of the leftovers
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

-- --------------------------------------------------------------------------------------
-- Outcomes
-- --------------------------------------------------------------------------------------
-- What happens to a leased row afterwards: renewal, completion, failure, release. Every
-- write is fenced by the caller's instance id and by the lease token of the attempt it
-- reports on (p_lease_tokens, parallel to p_ids): an outcome of an attempt that no
-- longer holds the row changes nothing and is reported 'lost'.

-- Make the earliest undone row of each given ordered stream its head, under the
-- stream lock that producers take too; NOTIFY the category when a head became ready.
-- Called after the old heads were marked done in the same transaction.
CREATE FUNCTION workpump.promote_stream_heads(
    p_category text, p_scopes text[], p_streams text[]
) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_count integer;
    v_ready integer;
BEGIN
    -- lock in one order for every caller; a separate statement so the promotion below
    -- sees rows that producers committed while this waited
    PERFORM workpump.lock_stream(p_category, s.scope, s.stream)
    FROM (SELECT DISTINCT u.scope, u.stream FROM unnest(p_scopes, p_streams) u(scope, stream)
          WHERE u.stream IS NOT NULL ORDER BY u.scope, u.stream) s;

    EXECUTE format($q$
        WITH promoted AS (
        UPDATE %1$I t SET stream_head = true
        FROM (SELECT DISTINCT u.scope, u.stream
              FROM unnest($1::text[], $2::text[]) u(scope, stream)
              WHERE u.stream IS NOT NULL) s
        CROSS JOIN LATERAL (
            -- the earliest undone row of the stream, through the _stream index
            SELECT n.seq FROM %1$I n
            WHERE %3$s n.stream = s.stream AND n.%2$I IS NULL
            ORDER BY n.seq LIMIT 1
        ) h
        WHERE t.seq = h.seq AND NOT t.stream_head
        RETURNING t.instance_id
        )
        SELECT count(*), count(*) FILTER (WHERE promoted.instance_id IS NULL)
        FROM promoted$q$,
        v_meta.tbl, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''
             ELSE format('n.%I = s.scope AND', v_meta.scope_col) END)
    INTO v_count, v_ready
    USING p_scopes, p_streams;
    -- a head still leased (the next row of its owner's run) wakes no claimer
    IF v_ready > 0 THEN
        PERFORM pg_notify('workpump_' || p_category, p_category);
    END IF;
    RETURN v_count;
END
$$;

-- After p_instance_id ended heads of these streams and the next rows were promoted:
-- each stream it owns stays its own, with the new head's lease, while it holds that
-- head (the next row of its run); otherwise the stream has no owner.
CREATE FUNCTION workpump.hand_over_streams(
    p_category text, p_instance_id uuid, p_scopes text[], p_streams text[]
) RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
BEGIN
    EXECUTE format($q$
        UPDATE workpump_active_stream s
        SET owner_instance_id = CASE WHEN h.instance_id = $3 THEN s.owner_instance_id END,
            lease_expiry = CASE WHEN h.instance_id = $3 THEN h.lease_expiry END
        FROM (SELECT DISTINCT u.scope, u.stream
              FROM unnest($1::text[], $2::text[]) u(scope, stream)
              WHERE u.stream IS NOT NULL) u
        LEFT JOIN LATERAL (
            -- the stream's head now: its earliest undone row, through the _stream index
            SELECT n.instance_id, n.lease_expiry FROM %1$I n
            WHERE %3$s n.stream = u.stream AND n.%2$I IS NULL
            ORDER BY n.seq LIMIT 1
        ) h ON true
        WHERE s.category = $4 AND s.scope = u.scope AND s.stream = u.stream
          AND s.owner_instance_id = $3$q$,
        v_meta.tbl, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''
             ELSE format('n.%I = u.scope AND', v_meta.scope_col) END)
    USING p_scopes, p_streams, p_instance_id, p_category;
END
$$;

-- Seconds until the retry after failed attempt number p_attempts: p_base * 2^(n-1),
-- capped at p_max, plus up to 10% jitter that is stable for a row and attempt (so peers
-- do not retry in lockstep and tests can predict the range).
CREATE FUNCTION workpump.retry_delay_seconds(
    p_key text, p_attempts integer, p_base_seconds integer, p_max_seconds integer
) RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN least(p_base_seconds * 2 ^ greatest(p_attempts - 1, 0), p_max_seconds)
       * (1 + (abs(hashtext(p_key || ':' || p_attempts)) % 1000) / 10000.0);

-- Extend the leases of not-done rows to now + p_lease_seconds and count the renewal, for
-- each p_ids[i] still leased under p_lease_tokens[i]. With p_instance_id only rows that
-- instance holds, and the instance must be registered and not tombstoned (SQLSTATE WP001
-- otherwise). Returns the renewed ids with their new expiry and status 'renewed' (the
-- stream leases of their streams move with them), and the ids whose attempt was
-- cancelled (cancel_work) with status 'cancelled' and no expiry: the holder stops it.
CREATE FUNCTION workpump.renew_leases(
    p_category text,
    p_ids uuid[],
    p_lease_tokens uuid[],
    p_lease_seconds integer DEFAULT 300,
    p_instance_id uuid DEFAULT NULL,
    p_now timestamptz DEFAULT NULL
) RETURNS TABLE (work_id uuid, lease_expiry timestamptz, status text)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_now timestamptz := coalesce(p_now, now());
    v_expiry timestamptz;
BEGIN
    IF p_lease_seconds IS NULL OR p_lease_seconds < 1 THEN
        RAISE EXCEPTION 'renew_leases needs p_lease_seconds >= 1, not %.',
            coalesce(p_lease_seconds::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_ids('renew_leases', p_ids);
    PERFORM workpump.check_lease_tokens('renew_leases', p_ids, p_lease_tokens);
    IF p_instance_id IS NOT NULL THEN
        PERFORM workpump.check_instance('renew_leases', p_instance_id);
    END IF;
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;
    v_expiry := v_now + make_interval(secs => p_lease_seconds);
    RETURN QUERY EXECUTE format($q$
        WITH renewed AS (
            -- only leased, undone rows under the attempt's token; only the caller's when
            -- it says who it is
            UPDATE %1$I t
            SET lease_expiry = $3, lease_renewals = t.lease_renewals + 1
            FROM unnest($1::uuid[], $6::uuid[]) i(id, token)
            WHERE t.%2$I = i.id AND t.lease_token = i.token AND t.%3$I IS NULL
              AND t.instance_id IS NOT NULL AND ($2::uuid IS NULL OR t.instance_id = $2)
            RETURNING t.%2$I AS work_id, t.lease_expiry, t.stream, %4$s AS scope,
                      t.instance_id
        ), streams AS (
            -- the streams' leases follow their rows
            UPDATE workpump_active_stream s SET lease_expiry = $3, last_activity_at = $4
            FROM (SELECT DISTINCT r.scope, r.stream, r.instance_id FROM renewed r
                  WHERE r.stream IS NOT NULL) r
            WHERE s.category = $5 AND s.scope = r.scope AND s.stream = r.stream
              AND s.owner_instance_id = r.instance_id
        )
        SELECT r.work_id, r.lease_expiry, 'renewed'::text FROM renewed r
        UNION ALL
        -- attempts an operator cancelled: the row ended, keeping the attempt's token
        SELECT t.%2$I, NULL::timestamptz, 'cancelled'::text
        FROM %1$I t JOIN unnest($1::uuid[], $6::uuid[]) i(id, token)
             ON t.%2$I = i.id AND t.lease_token = i.token
        WHERE t.end_state = 'cancelled'$q$,
        v_meta.tbl, v_meta.key_col, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END)
    USING p_ids, p_instance_id, v_expiry, v_now, p_category, p_lease_tokens;
END
$$;

-- Mark rows done that p_instance_id still holds under p_lease_tokens[i], storing
-- p_results[i] (jsonb, may be NULL) as the result of p_ids[i] and p_logs[i] as the
-- attempt's log records (check_attempt_logs; NULL: none). Returns every id with
-- 'done' or 'lost' (not held by the caller under that token any more, or already done).
-- Completed heads hand over to the next row of their stream; the caller stays the
-- stream's owner while it holds that row (the next of its run: hand_over_streams).
CREATE FUNCTION workpump.complete_work(
    p_instance_id uuid,
    p_category text,
    p_ids uuid[],
    p_lease_tokens uuid[],
    p_results jsonb[] DEFAULT NULL,
    p_logs jsonb[] DEFAULT NULL,
    p_now timestamptz DEFAULT NULL
) RETURNS TABLE (work_id uuid, status text)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION 'complete_work needs p_instance_id: completion is fenced by the holder.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_ids('complete_work', p_ids);
    PERFORM workpump.check_lease_tokens('complete_work', p_ids, p_lease_tokens);
    IF p_results IS NOT NULL AND cardinality(p_results) <> cardinality(p_ids) THEN
        RAISE EXCEPTION 'complete_work got % ids but % results.', cardinality(p_ids), cardinality(p_results)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_attempt_logs('complete_work', p_ids, p_logs);
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM workpump.end_held_work(
        'done'::text, p_instance_id, p_category, p_ids, p_lease_tokens, p_results, p_logs,
        p_now);
END
$$;

-- The statement of end_held_work for one category, as a function of its own per
-- category (end_held_<category>, made by define_end_held below): end the undone rows
-- p_instance_id holds under p_lease_tokens[i] as p_outcome ('done': p_values[i] is the
-- result; 'discarded': the reason, kept as last_error), release their leases and store
-- their attempt logs; return the ids and tokens ended, their ordering scopes and
-- streams, and whether a row under a concurrency cap (its topic's, or its concurrency
-- key's) was among them: its end may let a capped row start, on any instance.
CREATE FUNCTION workpump.define_end_held(p_category text) RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $define$
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_function text := $template$
CREATE OR REPLACE FUNCTION workpump.end_held_{category}(
    p_outcome text,
    p_instance_id uuid,
    p_ids uuid[],
    p_lease_tokens uuid[],
    p_values jsonb[],
    p_logs jsonb[],
    p_now timestamptz,
    OUT ended_ids uuid[], OUT ended_tokens uuid[], OUT scopes text[], OUT streams text[],
    OUT capped_ended boolean
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
-- a plan kept from a near-empty table (a fresh install, a truncate) would scan the
-- whole table once it grew, on every flush until the next ANALYZE: the statement
-- always ends rows by their key
SET enable_seqscan = off
AS $$
DECLARE
    v_topics text[];  -- of the flow-controlled rows ended (NULL: none)
    v_keys text[];
BEGIN
    WITH ended AS (
        -- fenced: only undone rows the caller holds under the attempt's token
        UPDATE {table} t
        SET done_at = p_now, instance_id = NULL, lease_expiry = NULL, lease_token = NULL,
            result = CASE WHEN p_outcome = 'done' THEN i.value ELSE t.result END,
            end_state = CASE WHEN p_outcome = 'discarded' THEN 'discarded' ELSE t.end_state END,
            failure_reason = CASE WHEN p_outcome = 'discarded' THEN 'discarded'
                                  ELSE t.failure_reason END,
            last_error = CASE WHEN p_outcome = 'discarded' THEN i.value #>> '{}'
                              ELSE t.last_error END,
            scheduled_for = CASE WHEN p_outcome = 'discarded' OR t.scheduled_for = 'infinity'
                                 THEN NULL ELSE t.scheduled_for END
        FROM unnest(p_ids, p_lease_tokens,
                    coalesce(p_values, array_fill(NULL::jsonb, ARRAY[cardinality(p_ids)])),
                    coalesce(p_logs, array_fill(NULL::jsonb, ARRAY[cardinality(p_ids)])))
             AS i(id, token, value, logs)
        -- IS NOT DISTINCT FROM: not indexable, so the kept (generic) plan probes each id
        -- by its key; with "=" it scanned the caller's held rows (estimated at one) and
        -- matched every id against each of them, quadratic in the flush
        WHERE t.work_id = i.id AND t.lease_token = i.token
          AND t.instance_id IS NOT DISTINCT FROM p_instance_id AND t.done_at IS NULL
        RETURNING t.work_id AS id, i.token, t.stream, {t.scope} AS scope, t.attempts, i.logs,
                  t.flow_controlled, t.topic, t.concurrency_key
    ){logged}
    SELECT coalesce(array_agg(e.id), '{}'), coalesce(array_agg(e.token), '{}'),
           coalesce(array_agg(e.scope), '{}'), coalesce(array_agg(e.stream), '{}'),
           array_agg(e.topic) FILTER (WHERE e.flow_controlled),
           array_agg(e.concurrency_key)
               FILTER (WHERE e.flow_controlled AND e.concurrency_key <> '')
    INTO ended_ids, ended_tokens, scopes, streams, v_topics, v_keys
    FROM ended e;
    -- rows of fairness keys or rates alone: no wake (a flood's every flush woke each
    -- claimer's loop for nothing)
    capped_ended := v_topics IS NOT NULL
                    AND workpump.flow_capped('{category}', v_topics, v_keys);
END
$$;
$template$;
BEGIN
    -- the attempt logs' insert is in every call: with p_logs NULL it finds no record
    v_function := replace(v_function, '{logged}', workpump.attempt_logs_cte(p_category, 'ended'));
    v_function := replace(v_function, '{t.scope}', CASE WHEN v_meta.scope_col IS NULL
        THEN $s$''::text$s$ ELSE 't.' || quote_ident(v_meta.scope_col) END);
    v_function := replace(v_function, '{table}', quote_ident(v_meta.tbl));
    v_function := replace(v_function, '{category}', p_category);
    EXECUTE v_function;
END
$define$;

SELECT workpump.define_end_held(category)
FROM unnest(ARRAY['outbox', 'inbox', 'perspective_event', 'receptor']) category;

-- The body of complete_work (p_outcome 'done': each row's value is its result) and of
-- discard_work ('discarded': each value is the reason, a JSON string, kept as its
-- last_error): end the undone rows p_instance_id holds under p_lease_tokens[i], release
-- their leases, store their attempt logs (p_logs), and hand their streams on to the next
-- row. The caller checks the input.
-- Returns every id with p_outcome or 'lost'.
CREATE FUNCTION workpump.end_held_work(
    p_outcome text,
    p_instance_id uuid,
    p_category text,
    p_ids uuid[],
    p_lease_tokens uuid[],
    p_values jsonb[],
    p_logs jsonb[] DEFAULT NULL,
    p_now timestamptz DEFAULT NULL
) RETURNS TABLE (work_id uuid, status text)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_ended_ids uuid[];
    v_ended_tokens uuid[];
    v_scopes text[];
    v_streams text[];
    v_capped_ended boolean;
BEGIN
    PERFORM workpump.check_category(p_category);
    IF p_outcome IS NULL OR p_outcome NOT IN ('done', 'discarded') THEN
        RAISE EXCEPTION 'end_held_work ends rows as done or discarded, not %.',
            coalesce(p_outcome, 'NULL') USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- each category's statement is static SQL of its own (end_held_<category>), so
    -- its plan is kept: built with EXECUTE format it was planned anew on every flush
    CASE p_category
        WHEN 'outbox' THEN
            SELECT * INTO v_ended_ids, v_ended_tokens, v_scopes, v_streams, v_capped_ended
            FROM workpump.end_held_outbox(p_outcome, p_instance_id, p_ids, p_lease_tokens,
                                          p_values, p_logs, v_now);
        WHEN 'inbox' THEN
            SELECT * INTO v_ended_ids, v_ended_tokens, v_scopes, v_streams, v_capped_ended
            FROM workpump.end_held_inbox(p_outcome, p_instance_id, p_ids, p_lease_tokens,
                                         p_values, p_logs, v_now);
        WHEN 'perspective_event' THEN
            SELECT * INTO v_ended_ids, v_ended_tokens, v_scopes, v_streams, v_capped_ended
            FROM workpump.end_held_perspective_event(p_outcome, p_instance_id, p_ids,
                                                     p_lease_tokens, p_values, p_logs, v_now);
        ELSE
            SELECT * INTO v_ended_ids, v_ended_tokens, v_scopes, v_streams, v_capped_ended
            FROM workpump.end_held_receptor(p_outcome, p_instance_id, p_ids, p_lease_tokens,
                                            p_values, p_logs, v_now);
    END CASE;
    PERFORM workpump.notify_ended(v_ended_ids);
    IF v_capped_ended THEN
        -- a row under a concurrency cap ended: a capped row may start now, on any
        -- instance (a claim for free slots: 'ended', not new work)
        PERFORM pg_notify('workpump_' || p_category, 'ended');
    END IF;

    IF EXISTS (SELECT 1 FROM unnest(v_streams) s WHERE s IS NOT NULL) THEN
        PERFORM workpump.promote_stream_heads(p_category, v_scopes, v_streams);
        -- the caller keeps the streams whose new head it holds (its run goes on)
        PERFORM workpump.hand_over_streams(p_category, p_instance_id, v_scopes, v_streams);
    END IF;

    RETURN QUERY
    SELECT i.id,
           CASE WHEN EXISTS (SELECT 1 FROM unnest(v_ended_ids, v_ended_tokens) d(id, token)
                             WHERE d.id = i.id AND d.token = i.token)
                THEN p_outcome ELSE 'lost' END
    FROM unnest(p_ids, p_lease_tokens) i(id, token);
END
$$;

-- Record failed attempts of rows p_instance_id still holds under p_lease_tokens[i]: the
-- error and reason, the lease released, and a retry scheduled after p_retry_delays[i]
-- seconds (the handler's own backoff; 0 retries at once) or, where that is NULL or not
-- given, after retry_delay_seconds; or the row parked as dead when its attempts are used
-- up, with reason 'max_attempts' unless the last attempt's own reason says why it
-- could not succeed ('timeout', 'not_retryable', 'undecodable_payload'). Attempts are
-- not bumped: the claim counted this attempt. p_logs are the attempts' log records, as
-- complete_work's. A row under a concurrency cap that fails wakes the claimers (NOTIFY
-- 'ended'), as one that completes. Returns every id with 'retry', 'dead' or 'lost'.
CREATE FUNCTION workpump.fail_work(
    p_instance_id uuid,
    p_category text,
    p_ids uuid[],
    p_lease_tokens uuid[],
    p_errors text[],
    p_reasons text[] DEFAULT NULL,
    p_retry_base_seconds integer DEFAULT 30,
    p_retry_max_seconds integer DEFAULT 300,
    p_retry_delays double precision[] DEFAULT NULL,
    p_logs jsonb[] DEFAULT NULL,
    p_now timestamptz DEFAULT NULL
) RETURNS TABLE (work_id uuid, status text, scheduled_for timestamptz)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_now timestamptz := coalesce(p_now, now());
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION 'fail_work needs p_instance_id: failure is fenced by the holder.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_ids('fail_work', p_ids);
    PERFORM workpump.check_lease_tokens('fail_work', p_ids, p_lease_tokens);
    IF coalesce(cardinality(p_errors), 0) <> coalesce(cardinality(p_ids), 0)
       OR (p_reasons IS NOT NULL AND cardinality(p_reasons) <> cardinality(p_ids))
       OR (p_retry_delays IS NOT NULL AND cardinality(p_retry_delays) <> cardinality(p_ids)) THEN
        RAISE EXCEPTION 'fail_work needs one error (and one reason and retry delay, when given) per id: got % ids, % errors, % reasons, % delays.',
            coalesce(cardinality(p_ids), 0), coalesce(cardinality(p_errors), 0),
            coalesce(cardinality(p_reasons), 0), coalesce(cardinality(p_retry_delays), 0)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_retry_base_seconds IS NULL OR p_retry_base_seconds < 0
       OR p_retry_max_seconds IS NULL OR p_retry_max_seconds < 0 THEN
        RAISE EXCEPTION 'fail_work needs retry seconds >= 0 (got base %, max %).',
            coalesce(p_retry_base_seconds::text, 'NULL'), coalesce(p_retry_max_seconds::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(p_retry_delays) d
               WHERE d < 0 OR d = 'Infinity'::double precision OR d = 'NaN'::double precision) THEN
        RAISE EXCEPTION 'fail_work needs p_retry_delays of finite seconds >= 0 (or NULL for the default backoff).'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_attempt_logs('fail_work', p_ids, p_logs);
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;
    RETURN QUERY EXECUTE format($q$
        WITH input AS (
            SELECT i.n, i.id, i.token, i.error, coalesce(i.reason, 'handler_error') AS reason,
                   i.delay, i.logs
            FROM unnest($1::uuid[], $9::uuid[], $2::text[],
                        coalesce($3::text[], array_fill(NULL::text, ARRAY[cardinality($1)])),
                        coalesce($10::double precision[],
                                 array_fill(NULL::double precision, ARRAY[cardinality($1)])),
                        coalesce($11::jsonb[], array_fill(NULL::jsonb, ARRAY[cardinality($1)])))
                 WITH ORDINALITY AS i(id, token, error, reason, delay, logs, n)
        ), failed AS (
            -- fenced: only undone rows the caller holds under the attempt's token; dead
            -- when attempts are used up
            UPDATE %1$I t SET
                instance_id = NULL, lease_expiry = NULL, lease_token = NULL,
                lease_renewals = 0, claimed_at = NULL,
                last_error = i.error,
                failure_reason = CASE
                    WHEN t.attempts >= t.max_attempts
                         AND i.reason NOT IN ('timeout', 'not_retryable', 'undecodable_payload')
                    THEN 'max_attempts' ELSE i.reason END,
                dead_lettered_at = CASE WHEN t.attempts >= t.max_attempts THEN $5 END,
                scheduled_for = CASE
                    WHEN t.attempts >= t.max_attempts THEN NULL
                    WHEN i.delay IS NOT NULL THEN  -- the handler's own backoff
                        CASE WHEN i.delay = 0 THEN NULL
                             ELSE $5 + make_interval(secs => i.delay) END
                    WHEN $6 = 0 OR $7 = 0 THEN NULL  -- retry at once: straight to ready
                    ELSE $5 + make_interval(secs => workpump.retry_delay_seconds(
                        t.%2$I::text, t.attempts, $6, $7)) END
            FROM input i
            WHERE t.%2$I = i.id AND t.lease_token = i.token AND t.instance_id = $4
              AND t.%3$I IS NULL
            RETURNING t.%2$I AS id, i.token, t.dead_lettered_at IS NOT NULL AS dead,
                      t.scheduled_for, t.stream, %4$s AS scope, t.attempts, i.logs,
                      t.flow_controlled, t.topic, t.concurrency_key
        )%5$s, streams AS (
            -- the failed rows' streams are no longer worked on by the caller
            UPDATE workpump_active_stream s SET owner_instance_id = NULL, lease_expiry = NULL
            FROM failed f
            WHERE s.category = $8 AND s.scope = f.scope AND s.stream = f.stream
              AND s.owner_instance_id = $4
        ), ready_now AS (
            -- a retry due at once is claimable now: wake the claimers
            SELECT pg_notify('workpump_' || $8, $8)
            WHERE EXISTS (SELECT 1 FROM failed f WHERE NOT f.dead AND f.scheduled_for IS NULL)
        ), ended AS (
            -- rows dead now: wake their waiters (one row, always)
            SELECT workpump.notify_ended(array_agg(f.id)) FROM failed f WHERE f.dead
        ), capped AS (
            -- a row under a concurrency cap left it: a capped row may start now, on any
            -- instance (a claim for free slots: 'ended', not new work)
            SELECT pg_notify('workpump_' || $8, 'ended')
            FROM (SELECT array_agg(f.topic) AS topics,
                         array_agg(f.concurrency_key)
                             FILTER (WHERE f.concurrency_key <> '') AS keys
                  FROM failed f WHERE f.flow_controlled) c
            WHERE c.topics IS NOT NULL AND workpump.flow_capped($8, c.topics, c.keys)
        )
        SELECT i.id,
               CASE WHEN f.id IS NULL THEN 'lost' WHEN f.dead THEN 'dead' ELSE 'retry' END,
               f.scheduled_for
        FROM input i LEFT JOIN failed f ON f.id = i.id AND f.token = i.token
        LEFT JOIN ready_now ON true LEFT JOIN ended ON true LEFT JOIN capped ON true
        ORDER BY i.n$q$,
        v_meta.tbl, v_meta.key_col, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END,
        CASE WHEN p_logs IS NOT NULL THEN workpump.attempt_logs_cte(p_category, 'failed') ELSE '' END)
    USING p_ids, p_errors, p_reasons, p_instance_id, v_now, p_retry_base_seconds,
          p_retry_max_seconds, p_category, p_lease_tokens, p_retry_delays, p_logs;
END
$$;

-- Hand back rows p_instance_id holds under p_lease_tokens[i] but never started
-- (prefetched, or behind a failed row of the same stream): lease released and the
-- attempt given back. Returns every id with 'released' or 'lost'.
CREATE FUNCTION workpump.release_work(
    p_instance_id uuid,
    p_category text,
    p_ids uuid[],
    p_lease_tokens uuid[],
    p_now timestamptz DEFAULT NULL
) RETURNS TABLE (work_id uuid, status text)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_released_ids uuid[];
    v_released_tokens uuid[];
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION 'release_work needs p_instance_id: release is fenced by the holder.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_ids('release_work', p_ids);
    PERFORM workpump.check_lease_tokens('release_work', p_ids, p_lease_tokens);
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;
    EXECUTE format($q$
        WITH released AS (
            -- fenced: only undone rows the caller holds under the attempt's token
            UPDATE %1$I t
            SET instance_id = NULL, lease_expiry = NULL, lease_token = NULL,
                lease_renewals = 0, claimed_at = NULL,
                attempts = greatest(t.attempts - 1, 0)
            FROM unnest($1::uuid[], $4::uuid[]) i(id, token)
            WHERE t.%2$I = i.id AND t.lease_token = i.token AND t.instance_id = $2
              AND t.%3$I IS NULL
            RETURNING t.%2$I AS id, i.token, t.stream, %4$s AS scope
        ), streams AS (
            -- the caller no longer works on these streams
            UPDATE workpump_active_stream s SET owner_instance_id = NULL, lease_expiry = NULL
            FROM released r
            WHERE s.category = $3 AND s.scope = r.scope AND s.stream = r.stream
              AND s.owner_instance_id = $2
        )
        SELECT coalesce(array_agg(r.id), '{}'), coalesce(array_agg(r.token), '{}')
        FROM released r$q$,
        v_meta.tbl, v_meta.key_col, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END)
    INTO v_released_ids, v_released_tokens
    USING p_ids, p_instance_id, p_category, p_lease_tokens;
    IF cardinality(v_released_ids) > 0 THEN
        PERFORM pg_notify('workpump_' || p_category, p_category);
    END IF;
    RETURN QUERY
    SELECT i.id,
           CASE WHEN EXISTS (SELECT 1 FROM unnest(v_released_ids, v_released_tokens) r(id, token)
                             WHERE r.id = i.id AND r.token = i.token)
                THEN 'released' ELSE 'lost' END
    FROM unnest(p_ids, p_lease_tokens) i(id, token);
END
$$;

-- Give rows p_instance_id holds under p_lease_tokens[i] back to run again after
-- p_seconds[i] (0: at once) without spending the attempt: the lease released, attempts
-- given back, snoozes counted. The row stays its stream's head, so the stream waits for
-- it. A row already snoozed p_max_snoozes times is failed instead (reason
-- 'max_snoozes', the attempt counted, retried after p_seconds[i], or dead when its
-- attempts are used up). Returns every id with 'snoozed', 'retry', 'dead' or 'lost'.
CREATE FUNCTION workpump.snooze_work(
    p_instance_id uuid,
    p_category text,
    p_ids uuid[],
    p_lease_tokens uuid[],
    p_seconds double precision[],
    p_max_snoozes integer DEFAULT 25,
    p_now timestamptz DEFAULT NULL
) RETURNS TABLE (work_id uuid, status text, scheduled_for timestamptz)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_now timestamptz := coalesce(p_now, now());
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION 'snooze_work needs p_instance_id: a snooze is fenced by the holder.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_ids('snooze_work', p_ids);
    PERFORM workpump.check_lease_tokens('snooze_work', p_ids, p_lease_tokens);
    IF coalesce(cardinality(p_seconds), 0) <> coalesce(cardinality(p_ids), 0) THEN
        RAISE EXCEPTION 'snooze_work needs one p_seconds per id: got % ids, % seconds.',
            coalesce(cardinality(p_ids), 0), coalesce(cardinality(p_seconds), 0)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(p_seconds) s
               WHERE s IS NULL OR s < 0 OR s = 'Infinity'::double precision
                  OR s = 'NaN'::double precision) THEN
        RAISE EXCEPTION 'snooze_work needs p_seconds of finite seconds >= 0.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_max_snoozes IS NULL OR p_max_snoozes < 0 THEN
        RAISE EXCEPTION 'snooze_work needs p_max_snoozes >= 0, not %.',
            coalesce(p_max_snoozes::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;

    RETURN QUERY EXECUTE format($q$
        WITH input AS (
            SELECT i.n, i.id, i.token, i.seconds
            FROM unnest($1::uuid[], $2::uuid[], $3::double precision[])
                 WITH ORDINALITY AS i(id, token, seconds, n)
        ), old AS (
            -- the row before the update: whether this snooze is over the limit
            SELECT t.seq, t.snoozes >= $4 AS over, t.attempts >= t.max_attempts AS last
            FROM %1$I t JOIN input i ON t.%2$I = i.id AND t.lease_token = i.token
            WHERE t.instance_id = $5 AND t.%3$I IS NULL
            FOR UPDATE OF t
        ), snoozed AS (
            UPDATE %1$I t SET
                instance_id = NULL, lease_expiry = NULL, lease_token = NULL,
                lease_renewals = 0, claimed_at = NULL,
                attempts = CASE WHEN o.over THEN t.attempts ELSE greatest(t.attempts - 1, 0) END,
                snoozes = CASE WHEN o.over THEN t.snoozes ELSE t.snoozes + 1 END,
                last_error = CASE WHEN o.over
                    THEN format('the handler snoozed %%s times, the maximum (MAX_SNOOZES); this snooze counts as a failed attempt', t.snoozes)
                    ELSE t.last_error END,
                failure_reason = CASE WHEN o.over AND o.last THEN 'max_attempts'
                                      WHEN o.over THEN 'max_snoozes'
                                      ELSE t.failure_reason END,
                dead_lettered_at = CASE WHEN o.over AND o.last THEN $6 END,
                scheduled_for = CASE
                    WHEN o.over AND o.last THEN NULL
                    WHEN i.seconds = 0 THEN NULL
                    ELSE $6 + make_interval(secs => i.seconds) END
            FROM old o, input i
            WHERE t.seq = o.seq AND t.%2$I = i.id
            RETURNING t.%2$I AS id, i.token, o.over,
                      t.dead_lettered_at IS NOT NULL AS dead, t.scheduled_for, t.stream,
                      %4$s AS scope
        ), streams AS (
            -- the caller no longer works on these streams (their head waits, unleased)
            UPDATE workpump_active_stream s SET owner_instance_id = NULL, lease_expiry = NULL
            FROM snoozed z
            WHERE s.category = $7 AND s.scope = z.scope AND s.stream = z.stream
              AND s.owner_instance_id = $5
        ), ready_now AS (
            SELECT pg_notify('workpump_' || $7, $7)
            WHERE EXISTS (SELECT 1 FROM snoozed z WHERE NOT z.dead AND z.scheduled_for IS NULL)
        ), ended AS (
            -- rows dead now: wake their waiters (one row, always)
            SELECT workpump.notify_ended(array_agg(z.id)) FROM snoozed z WHERE z.dead
        )
        SELECT i.id,
               CASE WHEN z.id IS NULL THEN 'lost' WHEN z.dead THEN 'dead'
                    WHEN z.over THEN 'retry' ELSE 'snoozed' END,
               z.scheduled_for
        FROM input i LEFT JOIN snoozed z ON z.id = i.id AND z.token = i.token
        LEFT JOIN ready_now ON true LEFT JOIN ended ON true
        ORDER BY i.n$q$,
        v_meta.tbl, v_meta.key_col, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END)
    USING p_ids, p_lease_tokens, p_seconds, p_max_snoozes, p_instance_id, v_now, p_category;
END
$$;

-- Take the stream locks of the rows p_ids names, in promote_stream_heads's order
-- (scope, stream), before any of those rows is updated. Reading a row's stream needs no
-- row lock: a row never changes streams.
CREATE FUNCTION workpump.lock_streams_of(p_category text, p_ids uuid[])
RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
BEGIN
    EXECUTE format($q$
        SELECT workpump.lock_stream($1, s.scope, s.stream)
        FROM (SELECT DISTINCT %3$s AS scope, t.stream FROM %1$I t
              WHERE t.%2$I = ANY ($2) AND t.stream IS NOT NULL
              ORDER BY 1, 2) s$q$,
        v_meta.tbl, v_meta.key_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END)
    USING p_category, p_ids;
END
$$;

-- End rows p_instance_id holds under p_lease_tokens[i] as 'discarded' (the handler
-- raised workpump.Discard): done, with p_reasons[i] kept as the last error and
-- failure_reason 'discarded'. Discarded heads hand over to the next row of their stream
-- as completed ones do (complete_work); the rows' streams are locked before the rows
-- (lock_streams_of); p_logs are the attempts' log records, as complete_work's. Returns
-- every id with 'discarded' or 'lost'.
CREATE FUNCTION workpump.discard_work(
    p_instance_id uuid,
    p_category text,
    p_ids uuid[],
    p_lease_tokens uuid[],
    p_reasons text[],
    p_logs jsonb[] DEFAULT NULL,
    p_now timestamptz DEFAULT NULL
) RETURNS TABLE (work_id uuid, status text)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION 'discard_work needs p_instance_id: a discard is fenced by the holder.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_ids('discard_work', p_ids);
    PERFORM workpump.check_lease_tokens('discard_work', p_ids, p_lease_tokens);
    IF coalesce(cardinality(p_reasons), 0) <> coalesce(cardinality(p_ids), 0) THEN
        RAISE EXCEPTION 'discard_work needs one reason per id: got % ids, % reasons.',
            coalesce(cardinality(p_ids), 0), coalesce(cardinality(p_reasons), 0)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_attempt_logs('discard_work', p_ids, p_logs);
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;

    -- the streams' locks before the rows' (lock_streams_of)
    PERFORM workpump.lock_streams_of(p_category, p_ids);

    RETURN QUERY SELECT * FROM workpump.end_held_work(
        'discarded'::text, p_instance_id, p_category, p_ids, p_lease_tokens,
        ARRAY(SELECT to_jsonb(r.reason) FROM unnest(p_reasons) WITH ORDINALITY r(reason, n)
              ORDER BY r.n),
        p_logs, p_now);
END
$$;

-- --------------------------------------------------------------------------------------
-- Workflows: checkpoints and waiting
-- --------------------------------------------------------------------------------------
-- A handler's checkpoint is a small JSON state stored on its row, fenced like an
-- outcome, which the row's next attempt receives from its claim. A row that ends (done,
-- discarded, cancelled, or dead) is announced on the channel workpump_done, so a
-- waiter (workpump.wait) wakes without polling; it confirms by reading the rows.

-- Store p_state (jsonb, NULL clears it) as the checkpoint of p_id (its checkpoint column), if p_instance_id
-- still holds the row, undone, under p_lease_token: 'saved'; otherwise nothing is written
-- and 'lost' (another attempt has the row now, or it ended). Raises when the state's
-- JSON text is over p_max_bytes bytes. The write joins the caller's transaction: an
-- atomic handler's checkpoint commits (or rolls back) with the handler's own writes.
CREATE FUNCTION workpump.checkpoint_work(
    p_instance_id uuid,
    p_category text,
    p_id uuid,
    p_lease_token uuid,
    p_state jsonb,
    p_max_bytes integer DEFAULT 65536
) RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_bytes integer := octet_length(p_state::text);
    v_count integer;
BEGIN
    IF p_instance_id IS NULL OR p_id IS NULL OR p_lease_token IS NULL THEN
        RAISE EXCEPTION 'checkpoint_work needs p_instance_id, p_id and p_lease_token: a checkpoint is fenced by the attempt.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_max_bytes IS NULL OR p_max_bytes < 1 THEN
        RAISE EXCEPTION 'checkpoint_work needs p_max_bytes >= 1, not %.', coalesce(p_max_bytes::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF v_bytes > p_max_bytes THEN
        RAISE EXCEPTION 'The checkpoint of % % is % bytes of JSON, over the limit of % bytes.',
            p_category, p_id, v_bytes, p_max_bytes
            USING ERRCODE = 'program_limit_exceeded',
                  HINT = 'Checkpoint a small state (a cursor, an offset, the ids done); keep bulk data in your own tables.';
    END IF;
    EXECUTE format($q$
        UPDATE %1$I t SET checkpoint = $1
        WHERE t.%2$I = $2 AND t.lease_token = $3 AND t.instance_id = $4 AND t.%3$I IS NULL$q$,
        v_meta.tbl, v_meta.key_col, v_meta.done_col)
    USING p_state, p_id, p_lease_token, p_instance_id;
    GET DIAGNOSTICS v_count = ROW_COUNT;  -- EXECUTE leaves FOUND as it was
    RETURN CASE WHEN v_count > 0 THEN 'saved' ELSE 'lost' END;
END
$$;

-- NOTIFY workpump_done that the rows p_ids ended: once per call, delivered at commit;
-- the payload is their ids, comma-separated, or '*' for more than 200 (under the
-- 8000-byte limit of a payload). A hint: the listener reads the rows to know.
CREATE FUNCTION workpump.notify_ended(p_ids uuid[]) RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;
    PERFORM pg_notify('workpump_done',
                      CASE WHEN cardinality(p_ids) <= 200 THEN array_to_string(p_ids, ',')
                           ELSE '*' END);
END
$$;

-- The state of each row p_ids names, in any of the categories p_categories names (all
-- when NULL), with its result, last error and failure reason, and when it ended (done,
-- cancelled, discarded or dead; NULL while it has not). Ids of no row are not returned;
-- an id that names rows of two categories comes once per category.
CREATE FUNCTION workpump.work_outcomes(
    p_ids uuid[], p_categories text[] DEFAULT NULL, p_now timestamptz DEFAULT NULL
) RETURNS TABLE (
    work_id uuid, category text, state text, result jsonb, last_error text,
    failure_reason text, ended_at timestamptz
)
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    v_category text;
    v_meta record;
BEGIN
    PERFORM workpump.check_ids('work_outcomes', p_ids);
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;
    FOREACH v_category IN ARRAY coalesce(
            p_categories, ARRAY['outbox', 'inbox', 'perspective_event', 'receptor']) LOOP
        v_meta := workpump.work_table(v_category);
        RETURN QUERY EXECUTE format($q$
            SELECT t.%2$I, $2, workpump.state_of(t.%3$I, t.dead_lettered_at, t.instance_id,
                       t.lease_expiry, t.claimed_at, t.scheduled_for, t.end_state, $3),
                   t.result, t.last_error, t.failure_reason::text,
                   coalesce(t.%3$I, t.dead_lettered_at)
            FROM %1$I t WHERE t.%2$I = ANY ($1)$q$,
            v_meta.tbl, v_meta.key_col, v_meta.done_col)
        USING p_ids, v_category, coalesce(p_now, now());
    END LOOP;
END
$$;

-- --------------------------------------------------------------------------------------
-- Batches and dependencies
-- --------------------------------------------------------------------------------------
-- A batch (workpump_batch) counts its members' endings; a dependency edge
-- (workpump_dependency) keeps an outbox row waiting for another. Both are driven by the
-- transaction that ends a row, whatever ends it (complete, discard, fail_work or the
-- claim parking it dead, dead_letter, cancel_work, requeue_dead): a statement trigger
-- counts a statement's batch members (count_batch_changes; a statement without any pays
-- one scan of what it changed), and an AFTER UPDATE row trigger fires only for rows with
-- dependents whose ending changed, so rows without pay one WHEN test in C.
--
-- Exactly once: an ending locks its batch row (count_batch_members), so endings of
-- members on separate connections are counted one after the other, and only the one
-- that takes pending to 0 of a sealed, unfinished batch finishes it (finish_batch), in
-- its own transaction. A dependent's row is locked before its readiness is decided
-- (resolve_dependents), so the last of its dependencies to end sees the others' edges
-- gone.

-- How a work row stands: NULL while undone and not dead, else 'done', 'dead',
-- 'discarded' or 'cancelled'.
CREATE FUNCTION workpump.outcome_of(
    p_done_at timestamptz, p_dead_lettered_at timestamptz, p_end_state text
) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE WHEN p_done_at IS NOT NULL THEN coalesce(p_end_state, 'done')
            WHEN p_dead_lettered_at IS NOT NULL THEN 'dead' END;

-- A callback spec of a batch: {"topic": ..., "payload": {...}, "stream", "priority",
-- "max_attempts"}, checked as send checks them, so finishing never meets a bad one.
CREATE FUNCTION workpump.check_callback(p_which text, p_spec jsonb) RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_topic text;
BEGIN
    IF p_spec IS NULL THEN
        RETURN;
    END IF;
    IF jsonb_typeof(p_spec) <> 'object'
       OR coalesce(jsonb_typeof(p_spec -> 'topic'), '') <> 'string'
       OR (p_spec ? 'stream' AND jsonb_typeof(p_spec -> 'stream') NOT IN ('string', 'null'))
       OR (p_spec ? 'priority' AND jsonb_typeof(p_spec -> 'priority') <> 'number')
       OR (p_spec ? 'max_attempts' AND jsonb_typeof(p_spec -> 'max_attempts') <> 'number')
       OR EXISTS (SELECT 1 FROM jsonb_object_keys(p_spec) k
                  WHERE k NOT IN ('topic', 'payload', 'stream', 'priority', 'max_attempts')) THEN
        RAISE EXCEPTION 'The batch''s % callback must be {"topic": text, "payload": object, "stream", "priority", "max_attempts"}, not %.',
            p_which, left(p_spec::text, 200)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v_topic := p_spec ->> 'topic';
    PERFORM workpump.check_new_work('batch callback', v_topic,
                                    coalesce(p_spec -> 'payload', '{}'::jsonb),
                                    coalesce((p_spec ->> 'priority')::integer, 0),
                                    coalesce((p_spec ->> 'max_attempts')::integer, 10), 10000);
    PERFORM workpump.check_payload('batch callback', v_topic,
                                   coalesce(p_spec -> 'payload', '{}'::jsonb), 1048576, 100);
END
$$;

-- Open a batch: members are added by send/send_many(p_batch_id => ...) until it
-- finishes; it cannot finish before seal_batch. With p_parent_batch_id the batch is one
-- member of its parent, which counts it as ended when this batch's callback row ends
-- (or, without a callback, when this batch finishes: done if every member ended done,
-- else dead). Returns the batch id.
CREATE FUNCTION workpump.open_batch(
    p_on_complete jsonb DEFAULT NULL,
    p_on_failure jsonb DEFAULT NULL,
    p_parent_batch_id uuid DEFAULT NULL,
    p_batch_id uuid DEFAULT NULL,
    p_now timestamptz DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_id uuid := coalesce(p_batch_id, gen_random_uuid());
BEGIN
    PERFORM workpump.check_callback('on_complete', p_on_complete);
    PERFORM workpump.check_callback('on_failure', p_on_failure);
    IF p_parent_batch_id IS NOT NULL THEN
        PERFORM workpump.add_to_batch(p_parent_batch_id, 1);
    END IF;
    INSERT INTO workpump_batch (id, parent_batch_id, on_complete, on_failure, created_at)
    VALUES (v_id, p_parent_batch_id, p_on_complete, p_on_failure, coalesce(p_now, now()));
    RETURN v_id;
END
$$;

-- Count p_count new members of an unfinished batch (the send functions call it).
CREATE FUNCTION workpump.add_to_batch(p_batch_id uuid, p_count integer) RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    UPDATE workpump_batch SET total = total + p_count, pending = pending + p_count
    WHERE id = p_batch_id AND finished_at IS NULL;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'Batch % %: rows can only join an open batch.', p_batch_id,
            CASE WHEN EXISTS (SELECT 1 FROM workpump_batch WHERE id = p_batch_id)
                 THEN 'has finished' ELSE 'does not exist' END
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Open a new batch (workpump.batch) for more work.';
    END IF;
END
$$;

-- Make undone rows of p_category (outbox or inbox) that belong to no batch members of
-- p_batch_id, for producers that store rows first (a task enqueue); returns how many
-- joined. Call it in the rows' own transaction, before anything could end them.
CREATE FUNCTION workpump.join_batch(p_category text, p_batch_id uuid, p_ids uuid[])
RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_count integer;
BEGIN
    PERFORM workpump.check_ids('join_batch', p_ids);
    IF p_category NOT IN ('outbox', 'inbox') THEN
        RAISE EXCEPTION 'join_batch takes outbox or inbox rows, not %.', quote_literal(p_category)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- the batch first: it must be open before any row is marked
    PERFORM 1 FROM workpump_batch WHERE id = p_batch_id AND finished_at IS NULL FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM workpump.add_to_batch(p_batch_id, 0);  -- raises, naming why
    END IF;
    EXECUTE format($q$
        UPDATE %I t SET batch_id = $1
        WHERE t.work_id = ANY ($2) AND t.batch_id IS NULL
          AND t.done_at IS NULL AND t.dead_lettered_at IS NULL$q$,
        (workpump.work_table(p_category)).tbl)
    USING p_batch_id, p_ids;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    PERFORM workpump.add_to_batch(p_batch_id, v_count);
    RETURN v_count;
END
$$;

-- The producer is done adding: the batch may finish now (at once when nothing is
-- pending, an empty batch included). Sealing twice is harmless.
CREATE FUNCTION workpump.seal_batch(p_batch_id uuid, p_now timestamptz DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_pending integer;
BEGIN
    UPDATE workpump_batch SET sealed = true WHERE id = p_batch_id
    RETURNING pending INTO v_pending;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'Batch % does not exist.', p_batch_id
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF v_pending <= 0 THEN
        PERFORM workpump.finish_batch(p_batch_id, coalesce(p_now, now()));
    END IF;
END
$$;

-- Count members' changes of outcome in their batches: each batch's counts move by the
-- sum of its members' changes in one UPDATE, the batch rows locked in id order (two
-- transactions that end members of the same batches take their rows one after the
-- other, never crosswise); a sealed batch this took to no pending member is finished.
-- A purged batch counts nothing; a finished one keeps counting late changes (a requeued
-- dead member) but never produces a second callback.
CREATE FUNCTION workpump.count_batch_members(p_changes workpump.batch_change[])
RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_batch record;
BEGIN
    PERFORM 1 FROM workpump_batch b
    WHERE b.id IN (SELECT c.batch_id FROM unnest(p_changes) c)
    ORDER BY b.id
    FOR UPDATE OF b;
    FOR v_batch IN
        UPDATE workpump_batch b SET
            pending = b.pending + d.pending,
            done = b.done + d.done,
            dead = b.dead + d.dead,
            discarded = b.discarded + d.discarded,
            cancelled = b.cancelled + d.cancelled
        FROM (
            SELECT c.batch_id,
                   sum((c.new IS NULL)::integer - (c.old IS NULL)::integer) AS pending,
                   sum((c.new IS NOT DISTINCT FROM 'done')::integer
                       - (c.old IS NOT DISTINCT FROM 'done')::integer) AS done,
                   sum((c.new IS NOT DISTINCT FROM 'dead')::integer
                       - (c.old IS NOT DISTINCT FROM 'dead')::integer) AS dead,
                   sum((c.new IS NOT DISTINCT FROM 'discarded')::integer
                       - (c.old IS NOT DISTINCT FROM 'discarded')::integer) AS discarded,
                   sum((c.new IS NOT DISTINCT FROM 'cancelled')::integer
                       - (c.old IS NOT DISTINCT FROM 'cancelled')::integer) AS cancelled,
                   max(c.at) AS at
            FROM unnest(p_changes) c
            WHERE c.old IS DISTINCT FROM c.new
            GROUP BY c.batch_id
        ) d
        WHERE b.id = d.batch_id
        RETURNING b.id, b.sealed, b.pending, b.finished_at, d.at
    LOOP
        IF v_batch.sealed AND v_batch.pending <= 0 AND v_batch.finished_at IS NULL THEN
            PERFORM workpump.finish_batch(v_batch.id, v_batch.at);
        END IF;
    END LOOP;
END
$$;

-- A member of p_batch_id went from outcome p_old to p_new (NULL: pending), at p_now.
CREATE FUNCTION workpump.count_in_batch(
    p_batch_id uuid, p_old text, p_new text, p_now timestamptz
) RETURNS void
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
SELECT workpump.count_batch_members(
    ARRAY[ROW(p_batch_id, p_old, p_new, p_now)::workpump.batch_change]);
$$;

-- Finish a batch once: stamp it and store its callback row (on_failure when a member
-- did not end done and one is given, else on_complete), a member of the parent batch,
-- payload || {"batch": {id, total, done, dead, discarded, cancelled, succeeded}}. A
-- callback that cannot be stored is recorded in callback_error; the member's ending
-- still commits.
CREATE FUNCTION workpump.finish_batch(p_batch_id uuid, p_now timestamptz) RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_batch record;
    v_spec jsonb;
    v_id uuid := gen_random_uuid();
BEGIN
    UPDATE workpump_batch SET finished_at = p_now
    WHERE id = p_batch_id AND finished_at IS NULL
    RETURNING * INTO v_batch;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_spec := CASE WHEN v_batch.done < v_batch.total AND v_batch.on_failure IS NOT NULL
                   THEN v_batch.on_failure ELSE v_batch.on_complete END;
    IF v_spec IS NULL OR jsonb_typeof(v_spec) <> 'object' THEN
        IF v_batch.parent_batch_id IS NOT NULL THEN
            PERFORM workpump.count_in_batch(
                v_batch.parent_batch_id, NULL,
                CASE WHEN v_batch.done = v_batch.total THEN 'done' ELSE 'dead' END, p_now);
        END IF;
        RETURN;
    END IF;
    BEGIN
        INSERT INTO workpump_outbox (work_id, topic, payload, stream, priority,
                                     max_attempts, batch_id)
        VALUES (v_id, v_spec ->> 'topic',
                coalesce(v_spec -> 'payload', '{}'::jsonb) || jsonb_build_object('batch',
                    jsonb_build_object('id', v_batch.id, 'total', v_batch.total,
                                       'done', v_batch.done, 'dead', v_batch.dead,
                                       'discarded', v_batch.discarded,
                                       'cancelled', v_batch.cancelled,
                                       'succeeded', v_batch.done = v_batch.total)),
                v_spec ->> 'stream', coalesce((v_spec ->> 'priority')::integer, 0),
                coalesce((v_spec ->> 'max_attempts')::integer, 10), v_batch.parent_batch_id);
        UPDATE workpump_batch SET callback_id = v_id WHERE id = p_batch_id;
    EXCEPTION WHEN OTHERS THEN
        -- a stored spec another role spoiled: this batch alone goes without its callback
        UPDATE workpump_batch SET callback_error = SQLERRM WHERE id = p_batch_id;
        IF v_batch.parent_batch_id IS NOT NULL THEN
            PERFORM workpump.count_in_batch(v_batch.parent_batch_id, NULL, 'dead', p_now);
        END IF;
    END;
END
$$;

-- Lock the rows p_after names (outbox rows) and mark them as having dependents; return
-- the ones still undone (the dependent waits for them) and the first that ended other
-- than done. Raises when an id names no outbox row: dependencies exist when sent, so a
-- cycle cannot be made.
CREATE FUNCTION workpump.flag_dependencies(
    p_topic text, p_after uuid[], p_policy text,
    OUT waiting uuid[], OUT failed_id uuid, OUT failed_outcome text
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_missing uuid;
BEGIN
    IF p_policy IS NULL OR p_policy NOT IN ('cancel', 'run') THEN
        RAISE EXCEPTION 'after_policy for outbox destination % must be ''cancel'' or ''run'', not %.',
            quote_literal(p_topic), coalesce(quote_literal(p_policy), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM workpump.check_ids('send after', p_after);
    WITH flagged AS (
        UPDATE workpump_outbox t SET has_dependents = true
        WHERE t.work_id = ANY (p_after)
        RETURNING t.work_id, workpump.outcome_of(t.done_at, t.dead_lettered_at, t.end_state) AS o
    )
    SELECT coalesce(array_agg(f.work_id) FILTER (WHERE f.o IS NULL), '{}'),
           (array_agg(f.work_id) FILTER (WHERE f.o <> 'done'))[1],
           (array_agg(f.o) FILTER (WHERE f.o <> 'done'))[1]
    INTO waiting, failed_id, failed_outcome
    FROM flagged f;
    SELECT a.id INTO v_missing FROM unnest(p_after) a(id)
    WHERE NOT EXISTS (SELECT 1 FROM workpump_outbox t WHERE t.work_id = a.id)
    LIMIT 1;
    IF v_missing IS NOT NULL THEN
        RAISE EXCEPTION 'Outbox message to % cannot wait for %: no outbox row has that id.',
            quote_literal(p_topic), v_missing
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'after= names outbox rows sent earlier (in this transaction or before) and not purged.';
    END IF;
END
$$;

-- Cancel the waiting dependent p_id because its dependency p_dependency ended
-- p_outcome: its reason names the dependency; its own dependents resolve in turn.
CREATE FUNCTION workpump.cancel_dependent(
    p_id uuid, p_dependency uuid, p_outcome text, p_now timestamptz
) RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    DELETE FROM workpump_dependency WHERE category = 'outbox' AND dependent_id = p_id;
    UPDATE workpump_outbox
    SET last_error = format('dependency %s ended %s', p_dependency, p_outcome)
    WHERE work_id = p_id AND done_at IS NULL;
    PERFORM workpump.cancel_work('outbox', ARRAY[p_id], p_now);
    UPDATE workpump_outbox SET failure_reason = 'dependency_failed'
    WHERE work_id = p_id AND end_state = 'cancelled';
END
$$;

-- The dependency p_id (an outbox row) ended p_outcome: drop its edges and decide each
-- dependent: cancelled when p_outcome is not 'done' and its policy is 'cancel', else
-- claimable once its last edge is gone (scheduled_for 'infinity' -> NULL, and a NOTIFY).
CREATE FUNCTION workpump.resolve_dependents(p_id uuid, p_outcome text, p_now timestamptz)
RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_edge record;
    v_ready boolean := false;
    v_waiting boolean;  -- the dependent still waits ('infinity')
    v_free boolean;  -- the dependent is undone and leased by nobody
BEGIN
    FOR v_edge IN
        DELETE FROM workpump_dependency
        WHERE category = 'outbox' AND dependency_id = p_id
        RETURNING dependent_id, policy
    LOOP
        -- the dependent's lock first: of two dependencies ending at once, the later
        -- sees the earlier's edge gone
        SELECT t.scheduled_for = 'infinity', t.done_at IS NULL AND t.instance_id IS NULL
        INTO v_waiting, v_free
        FROM workpump_outbox t WHERE t.work_id = v_edge.dependent_id
        FOR UPDATE;
        IF p_outcome <> 'done' AND v_edge.policy = 'cancel' THEN
            PERFORM workpump.cancel_dependent(v_edge.dependent_id, p_id, p_outcome, p_now);
        ELSIF v_waiting AND NOT EXISTS (
                SELECT 1 FROM workpump_dependency d
                WHERE d.category = 'outbox' AND d.dependent_id = v_edge.dependent_id) THEN
            -- its wait is over. A row of a chain's run, leased behind this one, needs no
            -- claimer woken; one that ended with it (one flush) no longer waits at all,
            -- and costs no statement here.
            UPDATE workpump_outbox SET scheduled_for = NULL
            WHERE work_id = v_edge.dependent_id;
            v_ready := v_ready OR v_free;
        END IF;
    END LOOP;
    IF v_ready THEN
        PERFORM pg_notify('workpump_outbox', 'outbox');
    END IF;
END
$$;

-- After a statement on a work table with batches (TG_ARGV[0]: its category) changed how
-- rows stand (ended, parked dead, re-queued): its members' changes are counted together
-- (count_batch_members). One call per statement, not one per member: a flush of a
-- hundred members of one batch updates its row once.
CREATE FUNCTION workpump.count_batch_changes() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM batch_new n WHERE n.batch_id IS NOT NULL) THEN
        RETURN NULL;
    END IF;
    PERFORM workpump.count_batch_members(ARRAY(
        SELECT ROW(n.batch_id,
                   workpump.outcome_of(o.done_at, o.dead_lettered_at, o.end_state),
                   workpump.outcome_of(n.done_at, n.dead_lettered_at, n.end_state),
                   coalesce(n.done_at, n.dead_lettered_at, now()))::workpump.batch_change
        FROM batch_old o JOIN batch_new n ON n.seq = o.seq
        WHERE n.batch_id IS NOT NULL
          AND (o.done_at IS DISTINCT FROM n.done_at
               OR o.dead_lettered_at IS DISTINCT FROM n.dead_lettered_at)));
    RETURN NULL;
END
$$;

CREATE TRIGGER workpump_outbox_batch_count AFTER UPDATE ON workpump_outbox
    REFERENCING OLD TABLE AS batch_old NEW TABLE AS batch_new
    FOR EACH STATEMENT EXECUTE FUNCTION workpump.count_batch_changes('outbox');
CREATE TRIGGER workpump_inbox_batch_count AFTER UPDATE ON workpump_inbox
    REFERENCING OLD TABLE AS batch_old NEW TABLE AS batch_new
    FOR EACH STATEMENT EXECUTE FUNCTION workpump.count_batch_changes('inbox');

-- After an outbox row with dependents ended (done, dead, discarded or cancelled) for the
-- first time: its dependents resolve (a requeue after that changes nothing).
CREATE FUNCTION workpump.after_work_ended() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_old text := workpump.outcome_of(OLD.done_at, OLD.dead_lettered_at, OLD.end_state);
    v_new text := workpump.outcome_of(NEW.done_at, NEW.dead_lettered_at, NEW.end_state);
BEGIN
    IF v_old IS NULL AND v_new IS NOT NULL THEN
        PERFORM workpump.resolve_dependents(
            NEW.work_id, v_new, coalesce(NEW.done_at, NEW.dead_lettered_at, now()));
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER workpump_outbox_ended AFTER UPDATE OF done_at, dead_lettered_at ON workpump_outbox
    FOR EACH ROW
    WHEN (NEW.has_dependents
          AND (OLD.done_at IS DISTINCT FROM NEW.done_at
               OR OLD.dead_lettered_at IS DISTINCT FROM NEW.dead_lettered_at))
    EXECUTE FUNCTION workpump.after_work_ended();

-- --------------------------------------------------------------------------------------
-- Maintenance and retention
-- --------------------------------------------------------------------------------------
-- Housekeeping, one instance at a time under the maintenance lock. Processed rows, dead
-- rows and received message ids are deleted once past their retention; an undone row
-- that is not dead is never deleted.

-- Take the maintenance lock for this session; false when another instance runs it.
CREATE FUNCTION workpump.try_maintenance_lock() RETURNS boolean
LANGUAGE sql
SET search_path FROM CURRENT
AS $$ SELECT pg_try_advisory_lock(workpump.lock_namespace('maintenance'), 0); $$;

-- Release the maintenance lock this session holds.
CREATE FUNCTION workpump.release_maintenance_lock() RETURNS boolean
LANGUAGE sql
SET search_path FROM CURRENT
AS $$ SELECT pg_advisory_unlock(workpump.lock_namespace('maintenance'), 0); $$;

-- Delete up to p_batch rows of a category processed before p_processed_before.
CREATE FUNCTION workpump.purge_processed(
    p_category text,
    p_processed_before timestamptz,
    p_batch integer DEFAULT 1000
) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_count integer;
BEGIN
    IF p_processed_before IS NULL OR p_batch IS NULL OR p_batch < 1 THEN
        RAISE EXCEPTION 'purge_processed needs p_processed_before and p_batch >= 1.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    EXECUTE format($q$
        DELETE FROM %1$I t WHERE t.seq = ANY (ARRAY(
            -- oldest processed rows first, through the _done index
            SELECT d.seq FROM %1$I d
            WHERE d.%2$I IS NOT NULL AND d.%2$I < $1
            ORDER BY d.%2$I LIMIT $2
            FOR UPDATE SKIP LOCKED))$q$,
        v_meta.tbl, v_meta.done_col)
    USING p_processed_before, p_batch;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

-- Delete up to p_batch events created before p_created_before that no work row points at.
CREATE FUNCTION workpump.purge_events(
    p_created_before timestamptz,
    p_batch integer DEFAULT 1000
) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_count integer;
BEGIN
    DELETE FROM workpump_event e WHERE e.seq = ANY (ARRAY(
        SELECT o.seq FROM workpump_event o
        WHERE o.created_at < p_created_before
          AND NOT EXISTS (SELECT 1 FROM workpump_perspective_event p WHERE p.event_id = o.event_id)
          AND NOT EXISTS (SELECT 1 FROM workpump_receptor_processing r WHERE r.event_id = o.event_id)
        ORDER BY o.created_at LIMIT p_batch
        FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

-- Delete up to p_batch batches that finished before p_finished_before, oldest first. A
-- finished batch is history: its callback row was produced (or its failure recorded), and
-- a member re-queued later only moves its counts, so it goes with the processed rows'
-- retention. An open batch is never deleted.
CREATE FUNCTION workpump.purge_batches(
    p_finished_before timestamptz,
    p_batch integer DEFAULT 1000
) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_count integer;
BEGIN
    DELETE FROM workpump_batch b WHERE b.id = ANY (ARRAY(
        SELECT o.id FROM workpump_batch o
        WHERE o.finished_at < p_finished_before
        ORDER BY o.finished_at LIMIT p_batch
        FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

-- Delete tombstones older than p_evicted_before.
CREATE FUNCTION workpump.purge_evictions(p_evicted_before timestamptz) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_count integer;
BEGIN
    DELETE FROM workpump_eviction WHERE evicted_at < p_evicted_before;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

-- Delete stream-ownership rows that nobody owns and whose stream has no undone row.
CREATE FUNCTION workpump.purge_idle_streams(p_batch integer DEFAULT 1000) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_count integer;
BEGIN
    DELETE FROM workpump_active_stream s WHERE s.id = ANY (ARRAY(
        SELECT a.id FROM workpump_active_stream a
        WHERE a.owner_instance_id IS NULL
          AND NOT CASE a.category
              WHEN 'outbox' THEN EXISTS (SELECT 1 FROM workpump_outbox t
                  WHERE t.stream = a.stream AND t.done_at IS NULL)
              WHEN 'inbox' THEN EXISTS (SELECT 1 FROM workpump_inbox t
                  WHERE t.stream = a.stream AND t.done_at IS NULL)
              WHEN 'perspective_event' THEN EXISTS (SELECT 1 FROM workpump_perspective_event t
                  WHERE t.topic = a.scope AND t.stream = a.stream
                    AND t.done_at IS NULL)
              ELSE EXISTS (SELECT 1 FROM workpump_receptor_processing t
                  WHERE t.topic = a.scope AND t.stream = a.stream
                    AND t.done_at IS NULL)
          END
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

-- Delete up to p_batch dead rows (dead-lettered, never done) dead-lettered before
-- p_dead_before, oldest first. A dead row that headed an ordered stream was blocking it;
-- once purged, the stream's next row becomes its head and runs.
CREATE FUNCTION workpump.purge_dead(
    p_category text,
    p_dead_before timestamptz,
    p_batch integer DEFAULT 1000
) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_count integer;
    v_scopes text[];
    v_streams text[];
BEGIN
    IF p_dead_before IS NULL OR p_batch IS NULL OR p_batch < 1 THEN
        RAISE EXCEPTION 'purge_dead needs p_dead_before and p_batch >= 1.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    EXECUTE format($q$
        WITH purged AS (
            -- oldest dead rows first, through the _dead index
            DELETE FROM %1$I t WHERE t.seq = ANY (ARRAY(
                SELECT d.seq FROM %1$I d
                WHERE d.%2$I IS NULL AND d.dead_lettered_at IS NOT NULL
                  AND d.dead_lettered_at < $1
                ORDER BY d.dead_lettered_at LIMIT $2
                FOR UPDATE SKIP LOCKED))
            RETURNING t.stream, t.stream_head, %3$s AS scope
        )
        -- the streams whose blocking head went: their next rows are promoted below
        SELECT count(*)::integer,
               array_agg(p.scope) FILTER (WHERE p.stream_head AND p.stream IS NOT NULL),
               array_agg(p.stream) FILTER (WHERE p.stream_head AND p.stream IS NOT NULL)
        FROM purged p$q$,
        v_meta.tbl, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN 'NULL::text'
             ELSE format('t.%I', v_meta.scope_col) END)
    INTO v_count, v_scopes, v_streams
    USING p_dead_before, p_batch;
    IF v_streams IS NOT NULL THEN
        PERFORM workpump.promote_stream_heads(p_category, v_scopes, v_streams);
    END IF;
    RETURN v_count;
END
$$;

-- Delete up to p_batch received message ids first seen before p_seen_before whose inbox
-- row is gone (purged by retention). A message delivered again after that is accepted
-- as new: the retention is the de-duplication window.
CREATE FUNCTION workpump.purge_inbox_dedup(
    p_seen_before timestamptz,
    p_batch integer DEFAULT 1000
) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_count integer;
BEGIN
    IF p_seen_before IS NULL OR p_batch IS NULL OR p_batch < 1 THEN
        RAISE EXCEPTION 'purge_inbox_dedup needs p_seen_before and p_batch >= 1.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    DELETE FROM workpump_inbox_dedup d WHERE d.message_id = ANY (ARRAY(
        -- oldest first, through wp_inbox_dedup_seen; never the id of a row still stored
        SELECT o.message_id FROM workpump_inbox_dedup o
        WHERE o.first_seen_at < p_seen_before
          AND NOT EXISTS (SELECT 1 FROM workpump_inbox i WHERE i.work_id = o.message_id)
        ORDER BY o.first_seen_at LIMIT p_batch
        FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

-- --------------------------------------------------------------------------------------
-- Operator actions
-- --------------------------------------------------------------------------------------
-- What the admin and an operator at psql do. The row actions act on undone rows only and
-- return the ids they changed; evict_instance has the effects of cleanup_stale_instances
-- for one named instance, whatever its heartbeat.

-- Make scheduled (retry or deferred) rows claimable now.
CREATE FUNCTION workpump.retry_now(
    p_category text, p_ids uuid[], p_now timestamptz DEFAULT NULL
) RETURNS SETOF uuid
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
BEGIN
    PERFORM workpump.check_ids('retry_now', p_ids);
    RETURN QUERY EXECUTE format($q$
        UPDATE %1$I t SET scheduled_for = NULL
        WHERE t.%2$I = ANY ($1) AND t.%3$I IS NULL AND t.dead_lettered_at IS NULL
          AND t.instance_id IS NULL AND t.scheduled_for IS NOT NULL
        RETURNING t.%2$I$q$, v_meta.tbl, v_meta.key_col, v_meta.done_col)
    USING p_ids;
    IF FOUND THEN
        PERFORM pg_notify('workpump_' || p_category, p_category);
    END IF;
END
$$;

-- Release leases. Rows held by a live instance (liveness rule, default thresholds) are
-- skipped unless p_force: taking work from a live holder runs it twice.
CREATE FUNCTION workpump.release_leases(
    p_category text,
    p_ids uuid[],
    p_force boolean DEFAULT false,
    p_stale_after_seconds integer DEFAULT 30,
    p_definitively_dead_after_seconds integer DEFAULT 300,
    p_now timestamptz DEFAULT NULL
) RETURNS SETOF uuid
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_now timestamptz := coalesce(p_now, now());
BEGIN
    PERFORM workpump.check_ids('release_leases', p_ids);
    RETURN QUERY EXECUTE format($q$
        WITH released AS (
            UPDATE %1$I t
            SET instance_id = NULL, lease_expiry = NULL, lease_renewals = 0,
                failure_reason = 'operator_released',
                last_error = format('attempt %%s ended without a reported outcome: lease of instance %%s released by an operator at %%s',
                                    t.attempts, t.instance_id, $3)
            FROM (SELECT o.seq, o.instance_id AS holder FROM %1$I o WHERE o.%2$I = ANY ($1)) old
            WHERE t.seq = old.seq AND t.%3$I IS NULL AND t.instance_id IS NOT NULL
              AND ($2 OR t.instance_id NOT IN (SELECT workpump.live_instances($4, $5)))
            RETURNING t.%2$I AS id, t.stream, %4$s AS scope, old.holder
        ), streams AS (
            -- the old holder no longer works on these streams
            UPDATE workpump_active_stream s SET owner_instance_id = NULL, lease_expiry = NULL
            FROM released r
            WHERE s.category = $6 AND s.scope = r.scope AND s.stream = r.stream
              AND s.owner_instance_id = r.holder
        )
        SELECT r.id FROM released r$q$, v_meta.tbl, v_meta.key_col, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END)
    USING p_ids, coalesce(p_force, false), v_now,
          v_now - make_interval(secs => p_stale_after_seconds),
          v_now - make_interval(secs => p_definitively_dead_after_seconds), p_category;
    IF FOUND THEN
        PERFORM pg_notify('workpump_' || p_category, p_category);
    END IF;
END
$$;

-- Park rows as dead (they keep blocking their stream until re-queued).
CREATE FUNCTION workpump.dead_letter(
    p_category text, p_ids uuid[], p_reason text DEFAULT 'operator', p_now timestamptz DEFAULT NULL
) RETURNS SETOF uuid
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
BEGIN
    PERFORM workpump.check_ids('dead_letter', p_ids);
    RETURN QUERY EXECUTE format($q$
        WITH parked AS (
            UPDATE %1$I t
            SET dead_lettered_at = $2, failure_reason = $3, instance_id = NULL,
                lease_expiry = NULL, lease_renewals = 0, scheduled_for = NULL
            FROM (SELECT o.seq, o.instance_id AS holder FROM %1$I o WHERE o.%2$I = ANY ($1)) old
            WHERE t.seq = old.seq AND t.%3$I IS NULL AND t.dead_lettered_at IS NULL
            RETURNING t.%2$I AS id, t.stream, %4$s AS scope, old.holder
        ), streams AS (
            -- a parked row's holder no longer works on its stream
            UPDATE workpump_active_stream s SET owner_instance_id = NULL, lease_expiry = NULL
            FROM parked p
            WHERE s.category = $4 AND s.scope = p.scope AND s.stream = p.stream
              AND s.owner_instance_id = p.holder
        ), ended AS (
            -- wake the parked rows' waiters (one row, always)
            SELECT workpump.notify_ended(array_agg(p.id)) FROM parked p
        )
        SELECT p.id FROM parked p LEFT JOIN ended ON true$q$, v_meta.tbl, v_meta.key_col, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END)
    USING p_ids, coalesce(p_now, now()), coalesce(p_reason, 'operator'), p_category;
END
$$;

-- Give dead rows a fresh set of attempts; their last error stays for history.
CREATE FUNCTION workpump.requeue_dead(
    p_category text, p_ids uuid[], p_now timestamptz DEFAULT NULL
) RETURNS SETOF uuid
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
BEGIN
    PERFORM workpump.check_ids('requeue_dead', p_ids);
    RETURN QUERY EXECUTE format($q$
        UPDATE %1$I t
        SET dead_lettered_at = NULL, attempts = 0, scheduled_for = NULL, claimed_at = NULL
        WHERE t.%2$I = ANY ($1) AND t.%3$I IS NULL AND t.dead_lettered_at IS NOT NULL
        RETURNING t.%2$I$q$, v_meta.tbl, v_meta.key_col, v_meta.done_col)
    USING p_ids;
    IF FOUND THEN
        PERFORM pg_notify('workpump_' || p_category, p_category);
    END IF;
END
$$;

-- Cancel undone rows (pending, scheduled, leased, orphaned or dead): each ends
-- 'cancelled' at once and never runs (again); its stream moves on. A leased row keeps
-- its attempt's lease token, so that attempt's complete_work and fail_work come back
-- 'lost' and its renewal 'cancelled'; its holder is told at once by a NOTIFY on
-- workpump_cancel, payload {"instance": <holder>, "category": ..., "work": [[id, token],
-- ...]} (at most 50 rows each: under the 8000-byte limit of a NOTIFY payload), delivered
-- when the caller commits. Returns each cancelled id with its holder (NULL when no
-- instance held it); ids of no undone row are not returned.
-- The rows' streams are locked before the rows (lock_streams_of).
CREATE FUNCTION workpump.cancel_work(
    p_category text, p_ids uuid[], p_now timestamptz DEFAULT NULL
) RETURNS TABLE (work_id uuid, holder uuid)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_now timestamptz := coalesce(p_now, now());
    v_ids uuid[];
    v_holders uuid[];
    v_tokens uuid[];
    v_scopes text[];
    v_streams text[];
BEGIN
    PERFORM workpump.check_ids('cancel_work', p_ids);
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN;
    END IF;
    -- the streams' locks before the rows' (lock_streams_of)
    PERFORM workpump.lock_streams_of(p_category, p_ids);
    EXECUTE format($q$
        WITH ended AS (
            UPDATE %1$I t
            SET %3$I = $2, end_state = 'cancelled', failure_reason = 'cancelled',
                instance_id = NULL, lease_expiry = NULL, lease_renewals = 0,
                scheduled_for = NULL
            FROM (SELECT o.seq, o.instance_id AS holder FROM %1$I o WHERE o.%2$I = ANY ($1)) old
            WHERE t.seq = old.seq AND t.%3$I IS NULL
            RETURNING t.%2$I AS id, old.holder, t.lease_token AS token, t.stream,
                      %4$s AS scope
        )
        SELECT coalesce(array_agg(e.id), '{}'), coalesce(array_agg(e.holder), '{}'),
               coalesce(array_agg(e.token), '{}'), coalesce(array_agg(e.scope), '{}'),
               coalesce(array_agg(e.stream), '{}')
        FROM ended e$q$,
        v_meta.tbl, v_meta.key_col, v_meta.done_col,
        CASE WHEN v_meta.scope_col IS NULL THEN ''''''
             ELSE 't.' || quote_ident(v_meta.scope_col) END)
    INTO v_ids, v_holders, v_tokens, v_scopes, v_streams
    USING p_ids, v_now;
    PERFORM workpump.notify_ended(v_ids);

    IF EXISTS (SELECT 1 FROM unnest(v_streams) s WHERE s IS NOT NULL) THEN
        PERFORM workpump.promote_stream_heads(p_category, v_scopes, v_streams);
        -- a cancelled row's holder no longer works on its stream
        UPDATE workpump_active_stream s SET owner_instance_id = NULL, lease_expiry = NULL
        FROM unnest(v_scopes, v_streams, v_holders) u(scope, stream, holder)
        WHERE s.category = p_category AND s.scope = u.scope AND s.stream = u.stream
          AND s.owner_instance_id = u.holder;
    END IF;

    -- tell each holder which of its attempts to stop
    PERFORM pg_notify('workpump_cancel', json_build_object(
                'instance', c.holder, 'category', p_category,
                'work', json_agg(json_build_array(c.id, c.token)))::text)
    FROM (SELECT u.id, u.holder, u.token, (row_number() OVER (PARTITION BY u.holder) - 1) / 50 AS chunk
          FROM unnest(v_ids, v_holders, v_tokens) u(id, holder, token)
          WHERE u.holder IS NOT NULL) c
    GROUP BY c.holder, c.chunk;

    RETURN QUERY SELECT u.id, u.holder FROM unnest(v_ids, v_holders) u(id, holder);
END
$$;

-- Evict p_instance_id: tombstone it (its next heartbeat is refused and it exits),
-- release every lease it holds (the open attempt stamped), release its streams and
-- NOTIFY workpump_orphan. Returns the number of rows released (0 when it was evicted
-- before; an unknown id is tombstoned all the same, so it can never register).
CREATE FUNCTION workpump.evict_instance(
    p_instance_id uuid,
    p_reason text DEFAULT 'evicted by an operator',
    p_now timestamptz DEFAULT NULL
) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_category text;
    v_meta record;
    v_count integer;
    v_total integer := 0;
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION 'evict_instance needs p_instance_id.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    DELETE FROM workpump_service_instance WHERE instance_id = p_instance_id;
    IF NOT FOUND AND EXISTS (SELECT 1 FROM workpump_eviction WHERE instance_id = p_instance_id) THEN
        RETURN 0;  -- evicted before: nothing left to release
    END IF;
    INSERT INTO workpump_eviction (instance_id, evicted_at, reason)
    VALUES (p_instance_id, v_now, coalesce(p_reason, 'evicted by an operator'))
    ON CONFLICT (instance_id) DO NOTHING;

    FOREACH v_category IN ARRAY ARRAY['outbox', 'inbox', 'perspective_event', 'receptor'] LOOP
        v_meta := workpump.work_table(v_category);
        -- claimed_at stays set: the attempt reads as orphaned until re-claimed
        EXECUTE format(
            $q$UPDATE %1$I t
               SET instance_id = NULL, lease_expiry = NULL, lease_renewals = 0,
                   failure_reason = 'instance_evicted',
                   last_error = format('attempt %%s ended without a reported outcome: instance %%s was evicted at %%s (%%s)',
                                       t.attempts, t.instance_id, $2, $3)
               WHERE t.instance_id = $1$q$,
            v_meta.tbl)
        USING p_instance_id, v_now, coalesce(p_reason, 'evicted by an operator');
        GET DIAGNOSTICS v_count = ROW_COUNT;
        v_total := v_total + v_count;
    END LOOP;
    UPDATE workpump_active_stream SET owner_instance_id = NULL, lease_expiry = NULL
    WHERE owner_instance_id = p_instance_id;
    PERFORM pg_notify('workpump_orphan', 'evicted');
    RETURN v_total;
END
$$;

-- --------------------------------------------------------------------------------------
-- Periodic work
-- --------------------------------------------------------------------------------------
-- Each slot of a schedule becomes exactly one outbox row, however many instances race
-- to fire it. The slots themselves (cron in a time zone, or an interval aligned to the
-- epoch) are computed by the pump; these functions keep the one fact every instance
-- must agree on, the last slot handled, and move it forward only with a conditional
-- UPDATE, so that one caller wins each slot.

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

-- --------------------------------------------------------------------------------------
-- The console's time series
-- --------------------------------------------------------------------------------------
-- Per-minute numbers that the admin's console charts (docs/console.md), in the tables of
-- the models ConsoleCount, ConsoleTotal, ConsoleRollup, ConsoleBacklog, ConsoleInstance
-- and ConsoleSample, written and purged only by the functions below.
--
-- Counters (workpump_console_count, per minute, topic, outcome and instance) are written
-- by a statement-level trigger on each work table: one upsert per UPDATE statement (a
-- claim, a flush of outcomes, a renewal, an operator's action), never one per row, in the
-- transaction of the change itself, so a rolled-back flush counts nothing and a restart
-- cannot count twice. Each instance writes counter rows of its own (instance_id is in
-- the key), so peers never wait on each other's. The sampler folds complete 10-minute
-- buckets (console_fold) into the rollup (per topic, 10 minutes a row) and into
-- workpump_console_total (summed over topics, a minute a row, for the whole pump's
-- charts); the readers (console_counts, console_totals) take the counters after the fold.
-- The totals are not a second upsert in the trigger: on a one-row claim that doubled the
-- counting's cost, which the pickup latency pays. Gauges (backlog and oldest pending age per topic, instances with
-- their heartbeat age and in-flight rows) are sampled once a minute by the maintenance
-- worker (console_sample).

-- Upper bounds, in seconds, of the pickup-latency buckets (a last bucket has none).
CREATE FUNCTION workpump.console_latency_bounds() RETURNS double precision[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN '{0.1,0.5,1,2,5,10,30,60,300}'::double precision[];

-- Two latency histograms added bucket by bucket (NULL: none yet): the step of
-- console_latency_total. The counting trigger writes the same sum inline: a SQL function
-- with a subquery is not inlined, and would be planned anew on every claim and flush.
CREATE FUNCTION workpump.console_latency_sum(p_a integer[], p_b integer[]) RETURNS integer[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE
    WHEN p_b IS NULL THEN p_a
    WHEN p_a IS NULL THEN p_b
    ELSE ARRAY(SELECT coalesce(u.a, 0) + coalesce(u.b, 0)
               FROM unnest(p_a, p_b) WITH ORDINALITY u(a, b, i)
               ORDER BY u.i) END;

-- The sum of latency histograms, bucket by bucket (NULL: none had one).
CREATE AGGREGATE workpump.console_latency_total(integer[]) (
    SFUNC = workpump.console_latency_sum,
    STYPE = integer[]
);

-- p_at, or now() where it is NULL or not finite: a stored time anyone with table access
-- may have written ('infinity') counts at the minute of the change.
CREATE FUNCTION workpump.console_finite(p_at timestamptz) RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
RETURN CASE WHEN isfinite(p_at) THEN p_at ELSE now() END;

-- The statement trigger of each work table (TG_ARGV[0]: its category): count what the
-- statement did, from the rows before (console_old) and after (console_new) it. Which
-- outcome a change is follows from the columns the outcome functions set: a failed
-- attempt (fail_work) clears claimed_at, an evicted or operator-released one keeps it
-- open, a released or snoozed one gives its attempt back. Done, dead, cancelled and
-- discarded count at the row's own timestamp; the rest at now().
--
-- A claim is counted when its attempt ends (whatever ended it: an outcome, an eviction,
-- another claim taking an expired lease over), with the instance that held it, at the
-- minute of claimed_at, and with its pickup latency: claimed_at - claim_due_at (the
-- lease set stores when the row became claimable). So a claim statement of rows nobody
-- held counts nothing and leaves at the first check: the pickup path does not pay for
-- the console. An attempt that ends in a later 10-minute bucket than its claim (which
-- the sampler may have folded) counts its claim at that bucket's first minute instead.
-- Static SQL (the four tables name their columns alike): each session plans it once
-- per table.
CREATE FUNCTION workpump.console_count_changes() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    -- nothing ends an attempt here and nothing became done or dead (a claim of free
    -- rows, a change of rows nobody held): nothing to count
    IF NOT EXISTS (SELECT 1 FROM console_old o WHERE o.instance_id IS NOT NULL)
       AND NOT EXISTS (SELECT 1 FROM console_new n
                       WHERE n.done_at IS NOT NULL OR n.dead_lettered_at IS NOT NULL) THEN
        RETURN NULL;
    END IF;
    -- each changed row gives up to two events: what became of the attempt it had (if
    -- anything did), and that attempt's claim when it ended. Two plain scans of the
    -- rows, not a lateral VALUES list per row, which cost several times as much per row.
    WITH changed AS (
        SELECT coalesce(n.topic, '') AS topic,
               coalesce(o.instance_id, '00000000-0000-0000-0000-000000000000') AS instance_id,
               CASE
                   WHEN o.done_at IS NULL AND n.done_at IS NOT NULL THEN coalesce(n.end_state, 'done')
                   WHEN o.dead_lettered_at IS NULL AND n.dead_lettered_at IS NOT NULL THEN 'dead'
                   WHEN o.instance_id IS NOT NULL AND n.instance_id IS NULL THEN
                       CASE WHEN n.attempts < o.attempts THEN 'released'
                            WHEN n.claimed_at IS NULL THEN 'failed'  -- fail_work ends the attempt
                            ELSE 'orphaned' END                      -- the attempt stays open
                   WHEN o.instance_id IS NOT NULL AND n.lease_token IS DISTINCT FROM o.lease_token
                       THEN 'expired'
                   WHEN n.lease_token = o.lease_token AND n.lease_renewals > o.lease_renewals
                       THEN 'renewed'
               END AS ended,  -- NULL: nothing ended
               n.done_at, n.dead_lettered_at, o.instance_id IS NOT NULL AS held,
               o.claimed_at, o.claim_due_at
        FROM console_old o
        JOIN console_new n ON n.seq = o.seq
    ), timed AS (
        -- referenced twice, so computed once; console_finite is inlined only on a column
        SELECT c.*, CASE WHEN c.ended = 'dead' THEN c.dead_lettered_at
                         WHEN c.ended IN ('done', 'cancelled', 'discarded') THEN c.done_at
                    END AS stamped_at
        FROM changed c
    ), events AS (
        SELECT t.topic, t.instance_id, t.ended AS outcome,
               workpump.console_finite(t.stamped_at) AS at, NULL::integer AS b
        FROM timed t WHERE t.ended IS NOT NULL
        UNION ALL
        SELECT t.topic, t.instance_id, 'claimed',
               greatest(workpump.console_finite(t.claimed_at),
                        date_bin('10 minutes', workpump.console_finite(t.stamped_at),
                                 '2000-01-01 00:00:00+00')),
               width_bucket(CASE WHEN isfinite(t.claim_due_at) AND isfinite(t.claimed_at)
                   THEN greatest(extract(epoch FROM t.claimed_at - t.claim_due_at), 0) END,
                   workpump.console_latency_bounds()) + 1
        FROM timed t WHERE t.held AND t.ended <> 'renewed'  -- the held attempt ended
    ), grouped AS (
        -- the statement's counts per minute, topic, outcome and instance; a claim's
        -- bucket b holds [bounds[b - 1], bounds[b]): 1 to 10 for the 9 bounds
        SELECT date_trunc('minute', e.at) AS minute,
               e.topic, e.outcome, e.instance_id,
               count(*) AS n,
               CASE WHEN e.outcome = 'claimed' THEN ARRAY[
                   count(*) FILTER (WHERE e.b = 1), count(*) FILTER (WHERE e.b = 2),
                   count(*) FILTER (WHERE e.b = 3), count(*) FILTER (WHERE e.b = 4),
                   count(*) FILTER (WHERE e.b = 5), count(*) FILTER (WHERE e.b = 6),
                   count(*) FILTER (WHERE e.b = 7), count(*) FILTER (WHERE e.b = 8),
                   count(*) FILTER (WHERE e.b = 9), count(*) FILTER (WHERE e.b = 10)]::integer[]
               END AS latency
        FROM events e
        GROUP BY 1, 2, 3, 4
    )
    -- rows locked in one order by every writer
    INSERT INTO workpump_console_count AS c
        (minute, category, topic, outcome, instance_id, n, latency)
    SELECT g.minute, TG_ARGV[0], g.topic, g.outcome, g.instance_id, g.n, g.latency
    FROM grouped g
    ORDER BY 1, 3, 4, 5
    ON CONFLICT (minute, category, topic, outcome, instance_id) DO UPDATE
    SET n = c.n + excluded.n,
        latency = CASE WHEN excluded.latency IS NULL THEN c.latency
                       WHEN c.latency IS NULL THEN excluded.latency
                       ELSE ARRAY(SELECT coalesce(u.a, 0) + coalesce(u.b, 0)
                                  FROM unnest(c.latency, excluded.latency)
                                       WITH ORDINALITY u(a, b, i)
                                  ORDER BY u.i) END;
    RETURN NULL;
END
$$;

CREATE TRIGGER workpump_outbox_console_count AFTER UPDATE ON workpump_outbox
    REFERENCING OLD TABLE AS console_old NEW TABLE AS console_new
    FOR EACH STATEMENT EXECUTE FUNCTION workpump.console_count_changes('outbox');
CREATE TRIGGER workpump_inbox_console_count AFTER UPDATE ON workpump_inbox
    REFERENCING OLD TABLE AS console_old NEW TABLE AS console_new
    FOR EACH STATEMENT EXECUTE FUNCTION workpump.console_count_changes('inbox');
CREATE TRIGGER workpump_perspective_event_console_count AFTER UPDATE ON workpump_perspective_event
    REFERENCING OLD TABLE AS console_old NEW TABLE AS console_new
    FOR EACH STATEMENT EXECUTE FUNCTION workpump.console_count_changes('perspective_event');
CREATE TRIGGER workpump_receptor_processing_console_count AFTER UPDATE ON workpump_receptor_processing
    REFERENCING OLD TABLE AS console_old NEW TABLE AS console_new
    FOR EACH STATEMENT EXECUTE FUNCTION workpump.console_count_changes('receptor');

-- Switch the console's counting on (p_on true) or off: the four triggers above, enabled
-- or disabled (ALTER TABLE, so only the tables' owner may). Returns p_on.
CREATE FUNCTION workpump.console_counting(p_on boolean) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_category text;
    v_meta record;
BEGIN
    IF p_on IS NULL THEN
        RAISE EXCEPTION 'console_counting needs p_on true (count) or false (stop counting).'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOREACH v_category IN ARRAY ARRAY['outbox', 'inbox', 'perspective_event', 'receptor'] LOOP
        v_meta := workpump.work_table(v_category);
        EXECUTE format('ALTER TABLE %I %s TRIGGER %I', v_meta.tbl,
                       CASE WHEN p_on THEN 'ENABLE' ELSE 'DISABLE' END,
                       v_meta.tbl || '_console_count');
    END LOOP;
    RETURN p_on;
END
$$;

-- Where the last fold stopped (the rollup and the totals hold every bucket before it);
-- '-infinity' before the first.
CREATE FUNCTION workpump.console_folded_until() RETURNS timestamptz
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
SELECT coalesce((SELECT s.folded_until FROM workpump_console_sample s
                 WHERE s.folded_until IS NOT NULL AND isfinite(s.folded_until)
                 ORDER BY s.minute DESC LIMIT 1), '-infinity');
$$;

-- Fold the counters of complete 10-minute buckets into workpump_console_rollup (summed
-- over instances) and into workpump_console_total (summed over topics), from where the last fold stopped up to the bucket that ended 2
-- minutes before p_now (a grace for flushes that commit after their minute), at most 6
-- hours a call so a long gap catches up over several samples. Returns where it stopped:
-- the rollup holds every bucket before it. Refolding a bucket replaces its sums.
CREATE FUNCTION workpump.console_fold(p_now timestamptz) RETURNS timestamptz
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_origin CONSTANT timestamptz := '2000-01-01 00:00:00+00';
    v_from timestamptz;
    v_to timestamptz := date_bin('10 minutes', p_now - interval '2 minutes', v_origin);
BEGIN
    v_from := workpump.console_folded_until();
    IF NOT isfinite(v_from) THEN  -- the first fold: from the oldest counter
        v_from := date_bin('10 minutes', coalesce(
            (SELECT min(c.minute) FROM workpump_console_count c WHERE isfinite(c.minute)),
            v_to), v_origin);
    END IF;
    v_to := least(v_to, v_from + interval '6 hours');
    IF v_to <= v_from THEN
        RETURN v_from;
    END IF;
    INSERT INTO workpump_console_rollup AS r (minute, category, topic, outcome, n, latency)
    SELECT date_bin('10 minutes', c.minute, v_origin), c.category, c.topic, c.outcome, sum(c.n),
           workpump.console_latency_total(c.latency)
    FROM workpump_console_count c
    WHERE c.minute >= v_from AND c.minute < v_to
    GROUP BY 1, 2, 3, 4
    ON CONFLICT (minute, category, topic, outcome) DO UPDATE
    SET n = excluded.n, latency = excluded.latency;
    INSERT INTO workpump_console_total AS t (minute, outcome, instance_id, n, latency)
    SELECT c.minute, c.outcome, c.instance_id, sum(c.n),
           workpump.console_latency_total(c.latency)
    FROM workpump_console_count c
    WHERE c.minute >= v_from AND c.minute < v_to
    GROUP BY 1, 2, 3
    ON CONFLICT (minute, outcome, instance_id) DO UPDATE
    SET n = excluded.n, latency = excluded.latency;
    RETURN v_to;
END
$$;

-- The counters in [p_since, p_until] in bins of p_step minutes (each bin's first minute,
-- from 2000-01-01 UTC: a 10-minute bin is a rollup bucket), a row per bin, topic,
-- outcome and instance (callers sum). A step of a multiple of 10 minutes reads the
-- rollup where it has been folded (a row per topic there), and the counters after. A
-- minute that is not finite (written through SQL) is left out. A standard SQL body
-- (its names bound when it is created) without a SET clause, so the planner inlines it:
-- the caller's filters and grouping reach the tables' scans, where a function scan would
-- first store the window's every row.
CREATE FUNCTION workpump.console_counts(p_since timestamptz, p_until timestamptz, p_step integer)
RETURNS TABLE (minute timestamptz, category text, topic text, outcome text, n bigint,
               latency integer[])
LANGUAGE sql STABLE
BEGIN ATOMIC
    SELECT date_bin(make_interval(mins => p_step), r.minute, '2000-01-01 00:00:00+00'),
           r.category, r.topic, r.outcome, r.n, r.latency
    FROM workpump_console_rollup r
    WHERE r.minute >= p_since AND r.minute <= p_until
      AND r.minute < CASE WHEN p_step % 10 = 0 THEN workpump.console_folded_until()
                          ELSE '-infinity'::timestamptz END
    UNION ALL
    SELECT date_bin(make_interval(mins => p_step), c.minute, '2000-01-01 00:00:00+00'),
           c.category, c.topic, c.outcome, c.n, c.latency
    FROM workpump_console_count c
    WHERE c.minute >= p_since AND c.minute <= p_until AND isfinite(c.minute)
      AND c.minute >= CASE WHEN p_step % 10 = 0 THEN workpump.console_folded_until()
                           ELSE '-infinity'::timestamptz END;
END;

-- The whole pump's counters in [p_since, p_until], a row per minute, outcome and
-- instance (of p_instance_id alone unless NULL): the totals where they have been folded,
-- the counters after (callers sum). A minute that is not finite is left out. Inlined as
-- console_counts is.
CREATE FUNCTION workpump.console_totals(
    p_since timestamptz, p_until timestamptz, p_instance_id uuid DEFAULT NULL
) RETURNS TABLE (minute timestamptz, outcome text, instance_id uuid, n bigint,
                 latency integer[])
LANGUAGE sql STABLE
BEGIN ATOMIC
    SELECT t.minute, t.outcome, t.instance_id, t.n, t.latency
    FROM workpump_console_total t
    WHERE t.minute >= p_since AND t.minute <= p_until
      AND t.minute < workpump.console_folded_until()
      AND (p_instance_id IS NULL OR t.instance_id = p_instance_id)
    UNION ALL
    SELECT c.minute, c.outcome, c.instance_id, c.n, c.latency
    FROM workpump_console_count c
    WHERE c.minute >= p_since AND c.minute <= p_until AND isfinite(c.minute)
      AND c.minute >= workpump.console_folded_until()
      AND (p_instance_id IS NULL OR c.instance_id = p_instance_id);
END;

-- The undone rows (neither done nor dead) of p_category's table, as the text of a query
-- (SELECT u.* ...) in five disjoint parts, each the predicate of a partial index
-- (_stream, _flow, _flowtimer, _ready, _timer). "Undone" alone matches no index, and a
-- table keeps its done rows for RETENTION_SECONDS: read as one predicate, the console's
-- sample read the whole table every minute (0.17 s for 1.1 million rows, 10,000 undone;
-- 0.02 s in parts). A row outside a stream that is not its head is in no part: the
-- producers store none, and no claim takes one.
CREATE FUNCTION workpump.undone_rows_sql(p_category text) RETURNS text
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
    v_undone text := format(
        'SELECT u.* FROM %I u WHERE u.%I IS NULL AND u.dead_lettered_at IS NULL AND ',
        v_meta.tbl, v_meta.done_col);
BEGIN
    RETURN v_undone || 'u.stream IS NOT NULL'
        || ' UNION ALL ' || v_undone
        || 'u.stream IS NULL AND u.stream_head AND u.flow_controlled'
        || ' AND u.instance_id IS NULL'
        || ' UNION ALL ' || v_undone
        || 'u.stream IS NULL AND u.stream_head AND u.flow_controlled'
        || ' AND u.instance_id IS NOT NULL'
        || ' UNION ALL ' || v_undone
        || 'u.stream IS NULL AND u.stream_head AND NOT u.flow_controlled'
        || ' AND u.instance_id IS NULL AND u.scheduled_for IS NULL'
        || ' UNION ALL ' || v_undone
        || 'u.stream IS NULL AND u.stream_head AND NOT u.flow_controlled'
        || ' AND (u.instance_id IS NOT NULL OR u.scheduled_for IS NOT NULL)';
END
$$;

-- Sample the gauges of the minute of p_now, once: per topic the rows waiting (pending,
-- scheduled), leased, and the age of the oldest pending row; per registered instance
-- its heartbeat age, whether it is alive by the liveness rule (live_instances: a fresh
-- heartbeat, or a held alive-lock, with which it beats only every slow interval), and
-- the rows it holds under an unexpired lease; and fold the counters of complete buckets
-- (console_fold). The first call of a minute takes it (its workpump_console_sample row
-- is the high-water mark: a peer's call waits for it to commit, then finds it), so no
-- minute is sampled twice. Returns whether this call sampled. Reads every undone row
-- once (undone_rows_sql): a minute's cost grows with the backlog.
--
-- An idle pump writes nothing: when no row is undone, the last sample had no backlog
-- either, nothing was counted since the last fold, and the instances are those of the
-- last sample, alive or not as it has them (with no row undone, none holds one), the
-- last sample still says it all. The readers carry it forward (console_instances: while
-- each instance's heartbeat row shows it beat), so an idle instance's only write stays
-- its heartbeat.
CREATE FUNCTION workpump.console_sample(
    p_stale_after_seconds integer DEFAULT 30,
    p_definitively_dead_after_seconds integer DEFAULT 300,
    p_now timestamptz DEFAULT NULL
) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_minute timestamptz := date_trunc('minute', coalesce(p_now, now()));
    v_last timestamptz;  -- the last minute sampled before this one
    v_instances workpump_console_instance[];
    v_category text;
    v_meta record;
    v_idle boolean;  -- nothing changed since the last sample (so far as looked)
BEGIN
    IF EXISTS (SELECT 1 FROM workpump_console_sample s WHERE s.minute = v_minute) THEN
        RETURN false;  -- a peer took this minute
    END IF;
    v_instances := ARRAY(
        SELECT ROW(v_minute, i.instance_id, i.service_name, i.host_name, i.process_id,
                   CASE WHEN isfinite(i.last_heartbeat_at)
                        THEN greatest(extract(epoch FROM v_now - i.last_heartbeat_at), 0) END,
                   i.instance_id IN (SELECT workpump.live_instances(
                       v_now - make_interval(secs => p_stale_after_seconds),
                       v_now - make_interval(secs => p_definitively_dead_after_seconds))),
                   (SELECT count(*) FROM (
                        SELECT 1 FROM workpump_outbox t
                        WHERE t.instance_id = i.instance_id AND t.lease_expiry > v_now
                        UNION ALL
                        SELECT 1 FROM workpump_inbox t
                        WHERE t.instance_id = i.instance_id AND t.lease_expiry > v_now
                        UNION ALL
                        SELECT 1 FROM workpump_perspective_event t
                        WHERE t.instance_id = i.instance_id AND t.lease_expiry > v_now
                        UNION ALL
                        SELECT 1 FROM workpump_receptor_processing t
                        WHERE t.instance_id = i.instance_id AND t.lease_expiry > v_now) held)
               )::workpump_console_instance
        FROM workpump_service_instance i);
    SELECT max(s.minute) INTO v_last
    FROM workpump_console_sample s
    WHERE s.minute < v_minute AND isfinite(s.minute);
    v_idle := v_last IS NOT NULL
        AND NOT EXISTS (SELECT 1 FROM workpump_console_backlog b WHERE b.minute = v_last)
        AND NOT EXISTS (SELECT 1 FROM workpump_console_count c
                        WHERE c.minute >= workpump.console_folded_until());
    FOREACH v_category IN ARRAY ARRAY['outbox', 'inbox', 'perspective_event', 'receptor'] LOOP
        EXIT WHEN NOT v_idle;
        EXECUTE 'SELECT NOT EXISTS (' || workpump.undone_rows_sql(v_category) || ')'
        INTO v_idle;
    END LOOP;
    IF v_idle
       AND NOT EXISTS (
           (SELECT n.instance_id, n.service_name, n.host_name, n.process_id, n.alive,
                   n.in_flight
            FROM unnest(v_instances) n
            EXCEPT
            SELECT l.instance_id, l.service_name, l.host_name, l.process_id, l.alive,
                   l.in_flight
            FROM workpump_console_instance l WHERE l.minute = v_last)
           UNION ALL
           (SELECT l.instance_id, l.service_name, l.host_name, l.process_id, l.alive,
                   l.in_flight
            FROM workpump_console_instance l WHERE l.minute = v_last
            EXCEPT
            SELECT n.instance_id, n.service_name, n.host_name, n.process_id, n.alive,
                   n.in_flight
            FROM unnest(v_instances) n)) THEN
        RETURN false;
    END IF;
    INSERT INTO workpump_console_sample (minute, taken_at) VALUES (v_minute, v_now)
    ON CONFLICT (minute) DO NOTHING;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE workpump_console_sample SET folded_until = workpump.console_fold(v_now)
    WHERE minute = v_minute;
    FOREACH v_category IN ARRAY ARRAY['outbox', 'inbox', 'perspective_event', 'receptor'] LOOP
        v_meta := workpump.work_table(v_category);
        EXECUTE format($q$
            INSERT INTO workpump_console_backlog
                (minute, category, topic, pending, scheduled, leased, oldest_pending_seconds)
            SELECT $1, $2, w.topic,
                   count(*) FILTER (WHERE w.state = 'pending'),
                   count(*) FILTER (WHERE w.state = 'scheduled'),
                   count(*) FILTER (WHERE w.state = 'leased'),
                   greatest(extract(epoch FROM $3 - min(w.due)
                       FILTER (WHERE w.state = 'pending' AND isfinite(w.due))), 0)
            FROM (SELECT coalesce(t.%2$I, '') AS topic,
                         CASE WHEN t.instance_id IS NOT NULL AND t.lease_expiry > $3 THEN 'leased'
                              WHEN t.scheduled_for > $3 THEN 'scheduled'
                              ELSE 'pending' END AS state,
                         coalesce(t.lease_expiry, t.scheduled_for, t.created_at) AS due
                  FROM (%1$s) t) w
            GROUP BY w.topic$q$,
            workpump.undone_rows_sql(v_category), v_meta.topic_col)
        USING v_minute, v_category, v_now;
    END LOOP;
    INSERT INTO workpump_console_instance
    SELECT n.* FROM unnest(v_instances) n;
    RETURN true;
END
$$;

-- Delete up to p_batch rows of each console table from minutes before p_before; returns
-- how many rows it deleted in all.
CREATE FUNCTION workpump.purge_console(p_before timestamptz, p_batch integer DEFAULT 1000)
RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_table text;
    v_count integer;
    v_total integer := 0;
BEGIN
    IF p_before IS NULL OR p_batch IS NULL OR p_batch < 1 THEN
        RAISE EXCEPTION 'purge_console needs p_before and p_batch >= 1.'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOREACH v_table IN ARRAY ARRAY['workpump_console_count', 'workpump_console_total',
                                   'workpump_console_rollup', 'workpump_console_backlog',
                                   'workpump_console_instance', 'workpump_console_sample'] LOOP
        EXECUTE format($q$
            DELETE FROM %1$I t WHERE t.ctid = ANY (ARRAY(
                SELECT d.ctid FROM %1$I d WHERE d.minute < $1
                ORDER BY d.minute LIMIT $2 FOR UPDATE SKIP LOCKED))$q$, v_table)
        USING p_before, p_batch;
        GET DIAGNOSTICS v_count = ROW_COUNT;
        v_total := v_total + v_count;
    END LOOP;
    RETURN v_total;
END
$$;

-- Why a topic's rows failed: per failure_reason of its undone and dead rows with an
-- error (at most the p_scan newest of them), how many, and the newest error text.
CREATE FUNCTION workpump.console_failures(
    p_category text, p_topic text, p_scan integer DEFAULT 10000
) RETURNS TABLE (failure_reason text, n bigint, dead bigint, last_error text,
                 last_seen timestamptz)
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    v_meta record := workpump.work_table(p_category);
BEGIN
    RETURN QUERY EXECUTE format($q$
        SELECT coalesce(f.failure_reason, 'unknown')::text, count(*),
               count(*) FILTER (WHERE f.dead_lettered_at IS NOT NULL),
               (array_agg(f.last_error ORDER BY f.seq DESC))[1],
               max(coalesce(f.dead_lettered_at, f.claimed_at, f.created_at))
        FROM (SELECT t.seq, t.failure_reason, t.last_error, t.dead_lettered_at,
                     t.claimed_at, t.created_at
              FROM %1$I t
              WHERE t.%2$I = $1 AND t.%3$I IS NULL AND t.last_error IS NOT NULL
              ORDER BY t.seq DESC LIMIT $2) f
        GROUP BY 1
        ORDER BY 2 DESC$q$, v_meta.tbl, v_meta.topic_col, v_meta.done_col)
    USING p_topic, greatest(coalesce(p_scan, 10000), 1);
END
$$;

-- The rows p_instance_id holds, every category, newest claim first (at most p_limit).
CREATE FUNCTION workpump.console_in_flight(
    p_instance_id uuid, p_limit integer DEFAULT 100, p_now timestamptz DEFAULT NULL
) RETURNS TABLE (category text, seq bigint, work_id uuid, topic text, stream text,
                 attempts integer, max_attempts integer, claimed_at timestamptz,
                 lease_expiry timestamptz, expired boolean)
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    v_category text;
    v_meta record;
BEGIN
    FOREACH v_category IN ARRAY ARRAY['outbox', 'inbox', 'perspective_event', 'receptor'] LOOP
        v_meta := workpump.work_table(v_category);
        RETURN QUERY EXECUTE format($q$
            SELECT $1, t.seq, t.%2$I, t.%3$I::text, t.stream, t.attempts, t.max_attempts,
                   t.claimed_at, t.lease_expiry, t.lease_expiry <= $4
            FROM %1$I t WHERE t.instance_id = $2
            ORDER BY t.claimed_at DESC NULLS LAST LIMIT $3$q$,
            v_meta.tbl, v_meta.key_col, v_meta.topic_col)
        USING v_category, p_instance_id, greatest(coalesce(p_limit, 100), 1),
              coalesce(p_now, now());
    END LOOP;
END
$$;

-- --------------------------------------------------------------------------------------
-- The admin's opt-in payload indexes
-- --------------------------------------------------------------------------------------
-- GIN indexes (jsonb_path_ops: they serve @>) on the payloads the admin's payload search
-- reads: the outbox's, the inbox's and the events' (perspective and receptor rows point
-- at theirs). Not created by the migrations: each insert then writes its index too
-- (docs/admin.md, "Search"). manage.py workpump_payload_index runs these statements one
-- by one, outside a transaction, so the indexes build without blocking writers.

-- The statements that create (p_create true) or drop the payload indexes.
CREATE FUNCTION workpump.payload_index_ddl(p_create boolean) RETURNS SETOF text
LANGUAGE sql IMMUTABLE
SET search_path FROM CURRENT
AS $$
    SELECT CASE WHEN p_create
        THEN format('CREATE INDEX CONCURRENTLY IF NOT EXISTS %I ON %I USING gin (payload jsonb_path_ops)',
                    i.index_name, i.table_name)
        ELSE format('DROP INDEX CONCURRENTLY IF EXISTS %I', i.index_name) END
    FROM (VALUES ('wp_outbox_payload', 'workpump_outbox'),
                 ('wp_inbox_payload', 'workpump_inbox'),
                 ('wp_event_payload', 'workpump_event')) AS i(index_name, table_name)
$$;

-- --------------------------------------------------------------------------------------
-- search_path
-- --------------------------------------------------------------------------------------
-- A function that captured the loading session's search_path ("$user", public by
-- default) could have a table or a built-in shadowed by a temporary table or a schema
-- named after the calling role. pin_search_path sets each one's search_path to
-- pg_catalog, the schema that holds the workpump tables, and pg_temp last.

-- Pin the search_path of every workpump function that sets one: pg_catalog first (no
-- built-in can be shadowed), then the schema of the workpump tables, then pg_temp (a
-- temporary table can shadow nothing). Idempotent; returns how many functions it set.
CREATE FUNCTION workpump.pin_search_path() RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_schema name;
    v_path text;
    v_function record;
    v_count integer := 0;
BEGIN
    SELECT n.nspname INTO v_schema
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE c.relname = 'workpump_outbox' AND c.relkind IN ('r', 'p')
    ORDER BY n.nspname = current_schema() DESC
    LIMIT 1;
    IF v_schema IS NULL THEN
        RAISE EXCEPTION 'pin_search_path found no workpump_outbox table: run the workpump migrations first.'
            USING ERRCODE = 'undefined_table';
    END IF;
    v_path := format('pg_catalog, %I, pg_temp', v_schema);
    FOR v_function IN
        SELECT p.oid::regprocedure AS signature
        FROM pg_proc p
        WHERE p.pronamespace = 'workpump'::regnamespace
          AND p.proname <> 'pin_search_path'
          AND EXISTS (SELECT 1 FROM unnest(p.proconfig) c WHERE c LIKE 'search_path=%')
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %s', v_function.signature, v_path);
        v_count := v_count + 1;
    END LOOP;
    RETURN v_count;
END
$$;

SELECT workpump.pin_search_path();
