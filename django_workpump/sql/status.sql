-- Named queries of status.py (manage.py workpump_status and the admin summary): read-only
-- reports, with Django's %(name)s placeholders. Every state comes from workpump.state_of
-- and every age from the database clock; %(now)s is NULL in production (tests pin it).

-- name: state_counts
-- One row per category x state, zeros included, with the age of the oldest row in each
-- (category, state) but done, and the clock the report was taken with. Neither reads
-- every row of a table: each state is counted as the rows of a few partial indexes (the
-- arms below), each arm no further than one past %(exact_limit)s rows. A state whose
-- every arm stays within the limit is counted exactly; past it (estimated is true) the
-- count is the rows counted, which status.py raises to the planner's estimate. Done
-- rows, most of a large table, are counted up to the limit in the _done index and past
-- it estimated from pg_class.reltuples. The oldest age of an estimated state is that
-- of the rows counted.
WITH RECURSIVE clock AS (
    -- the one "now" of this report
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
-- each category, joined by ,
holders_{category} AS (
    -- the holders of rows (loose index scan of _held)
    (SELECT t.instance_id FROM {table} t
     WHERE t.instance_id IS NOT NULL ORDER BY t.instance_id LIMIT 1)
    UNION ALL
    SELECT (SELECT t.instance_id FROM {table} t
            WHERE t.instance_id > h.instance_id ORDER BY t.instance_id LIMIT 1)
    FROM holders_{category} h WHERE h.instance_id IS NOT NULL
)
-- end each
, arms AS (
    -- the rows of each undone state, as disjoint arms that each read one partial index:
    -- pending = claimable heads (_ready) + unleased rows whose time has come (_waiting)
    -- + unscheduled rows behind a head (_stream); scheduled = _waiting not yet due;
    -- leased = held (_held) with an unexpired lease; orphaned = held with an expired
    -- lease (_held, each holder's rows) + rows of an evicted holder not re-claimed
    -- (_orphan); dead = _dead
    -- each category, joined by UNION ALL
    SELECT '{category}' AS category, a.state, a.capped, a.oldest_created_at
    FROM clock c CROSS JOIN LATERAL (
        SELECT 'pending' AS state, count(*) AS capped, min(x.created_at) AS oldest_created_at
        FROM (SELECT t.created_at FROM {table} t
              WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL
                AND t.stream_head AND NOT t.flow_controlled
                AND t.instance_id IS NULL AND t.scheduled_for IS NULL AND t.claimed_at IS NULL
              ORDER BY t.priority DESC, t.seq
              LIMIT %(exact_limit)s + 1) x
        UNION ALL
        -- flow-controlled heads (_flow; docs/flow-control.md)
        SELECT 'pending' AS state, count(*) AS capped, min(x.created_at) AS oldest_created_at
        FROM (SELECT t.created_at FROM {table} t
              WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL
                AND t.stream_head AND t.flow_controlled
                AND t.instance_id IS NULL AND t.scheduled_for IS NULL AND t.claimed_at IS NULL
              LIMIT %(exact_limit)s + 1) x
        UNION ALL
        SELECT 'pending' AS state, count(*) AS capped, min(x.created_at) AS oldest_created_at
        FROM (SELECT t.created_at FROM {table} t
              WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL
                AND t.instance_id IS NULL
                AND t.scheduled_for <= c.now AND t.claimed_at IS NULL
              ORDER BY t.scheduled_for
              LIMIT %(exact_limit)s + 1) x
        UNION ALL
        SELECT 'pending' AS state, count(*) AS capped, min(x.created_at) AS oldest_created_at
        FROM (SELECT t.created_at FROM {table} t
              WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL
                AND NOT t.stream_head AND t.stream IS NOT NULL
                AND t.instance_id IS NULL AND t.scheduled_for IS NULL AND t.claimed_at IS NULL
              LIMIT %(exact_limit)s + 1) x
        UNION ALL
        SELECT 'scheduled' AS state, count(*) AS capped, min(x.created_at) AS oldest_created_at
        FROM (SELECT t.created_at FROM {table} t
              WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL
                AND t.instance_id IS NULL
                AND t.scheduled_for > c.now AND t.claimed_at IS NULL
              LIMIT %(exact_limit)s + 1) x
        UNION ALL
        SELECT 'leased' AS state, count(*) AS capped, min(x.created_at) AS oldest_created_at
        FROM (SELECT t.created_at FROM {table} t
              WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL
                AND t.instance_id IS NOT NULL
                AND t.lease_expiry > c.now
              LIMIT %(exact_limit)s + 1) x
        UNION ALL
        SELECT 'orphaned' AS state, count(*) AS capped, min(x.created_at) AS oldest_created_at
        FROM (SELECT e.created_at FROM holders_{category} h CROSS JOIN LATERAL (
                  SELECT t.created_at FROM {table} t
                  WHERE t.instance_id = h.instance_id
                    AND t.done_at IS NULL AND t.dead_lettered_at IS NULL
                    AND t.lease_expiry <= c.now
                  LIMIT %(exact_limit)s + 1) e
              WHERE h.instance_id IS NOT NULL
              LIMIT %(exact_limit)s + 1) x
        UNION ALL
        SELECT 'orphaned' AS state, count(*) AS capped, min(x.created_at) AS oldest_created_at
        FROM (SELECT t.created_at FROM {table} t
              WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL
                AND t.instance_id IS NULL
                AND t.claimed_at IS NOT NULL
              ORDER BY t.seq
              LIMIT %(exact_limit)s + 1) x
        UNION ALL
        SELECT 'dead' AS state, count(*) AS capped, min(x.created_at) AS oldest_created_at
        FROM (SELECT t.created_at FROM {table} t
              WHERE t.done_at IS NULL AND t.dead_lettered_at IS NOT NULL
              LIMIT %(exact_limit)s + 1) x
    ) a
    -- end each
), counted AS (
    SELECT a.category, a.state, sum(a.capped)::bigint AS count,
           min(a.oldest_created_at) AS oldest_created_at,
           bool_or(a.capped > %(exact_limit)s) AS estimated
    FROM arms a
    GROUP BY a.category, a.state
), done_capped AS (
    -- done rows per table, counted no further than one past the exact limit, in the
    -- order of the _done index (a bounded read of it, whatever the table holds), and
    -- that index's row count at the last VACUUM or ANALYZE (pg_class.reltuples)
    -- each category, joined by UNION ALL
    SELECT '{category}' AS category, '{index_prefix}_done'::regclass AS index,
           (SELECT count(*) FROM (SELECT FROM {table} t WHERE t.done_at IS NOT NULL
                                  ORDER BY t.done_at LIMIT %(exact_limit)s + 1) d) AS capped
    -- end each
), ended AS (
    -- rows that ended cancelled or discarded, counted exactly through the _ended indexes
    -- each category, joined by UNION ALL
    SELECT '{category}' AS category, t.end_state AS state, count(*) AS count,
           NULL::timestamptz AS oldest_created_at, false AS estimated
    FROM {table} t WHERE t.done_at IS NOT NULL AND t.end_state IS NOT NULL
    GROUP BY t.end_state
    -- end each
), done AS (
    -- completed rows: exact up to the limit; past it the _done index's estimated rows;
    -- the ended ones (cancelled, discarded) are counted apart
    SELECT d.category, 'done' AS state,
           CASE WHEN d.capped <= %(exact_limit)s THEN d.capped - e.total
                ELSE greatest(d.capped - e.total, p.reltuples::bigint - e.total)
           END AS count,
           NULL::timestamptz AS oldest_created_at,
           d.capped > %(exact_limit)s AS estimated
    FROM done_capped d JOIN pg_class p ON p.oid = d.index
    CROSS JOIN LATERAL (SELECT coalesce(sum(x.count), 0)::bigint AS total FROM ended x
                        WHERE x.category = d.category) e
), every AS (
    SELECT * FROM counted
    UNION ALL
    SELECT * FROM ended
    UNION ALL
    SELECT * FROM done
)
SELECT k.category, s.state, coalesce(n.count, 0) AS count,
       (extract(epoch FROM c.now) - extract(epoch FROM n.oldest_created_at))::double precision AS oldest_age_seconds,
       coalesce(n.estimated, false) AS estimated, c.now
FROM clock c
CROSS JOIN unnest(%(categories)s::text[]) WITH ORDINALITY AS k(category, k_order)
CROSS JOIN unnest(%(states)s::text[]) WITH ORDINALITY AS s(state, s_order)
LEFT JOIN every n ON n.category = k.category AND n.state = s.state
ORDER BY k.k_order, s.s_order

-- name: state_estimates
-- The rows of each undone state of each category, for EXPLAIN only (never run): the
-- planner's estimate of each arm (the children of its Append, in this order) is the count
-- of a state that state_counts found past its exact limit.
-- each category, joined by UNION ALL
SELECT '{category}' AS category, 'pending' AS state FROM {table} t
WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL
  AND t.instance_id IS NULL AND t.claimed_at IS NULL
  AND (t.scheduled_for IS NULL OR t.scheduled_for <= coalesce(%(now)s::timestamptz, now()))
UNION ALL
SELECT '{category}' AS category, 'scheduled' AS state FROM {table} t
WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL
  AND t.instance_id IS NULL AND t.claimed_at IS NULL
  AND t.scheduled_for > coalesce(%(now)s::timestamptz, now())
UNION ALL
SELECT '{category}' AS category, 'leased' AS state FROM {table} t
WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL
  AND t.instance_id IS NOT NULL AND t.lease_expiry > coalesce(%(now)s::timestamptz, now())
UNION ALL
SELECT '{category}' AS category, 'orphaned' AS state FROM {table} t
WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL
  AND ((t.instance_id IS NOT NULL AND t.lease_expiry <= coalesce(%(now)s::timestamptz, now()))
       OR (t.instance_id IS NULL AND t.claimed_at IS NOT NULL))
UNION ALL
SELECT '{category}' AS category, 'dead' AS state FROM {table} t
WHERE t.done_at IS NULL AND t.dead_lettered_at IS NOT NULL
-- end each

-- name: blocked_streams
-- Ordered streams whose head is dead or waiting for a retry (scheduled after a failed
-- attempt): the rows behind it wait. Most waiting rows first; total counts past the limit.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
), heads AS (
    -- undone heads of ordered streams that are parked or not due yet
    -- each category, joined by UNION ALL
    SELECT '{category}' AS category,
           CASE WHEN {topic_scopes_streams} THEN h.topic ELSE '' END AS scope, h.stream,
           h.work_id AS head_id, h.attempts,
           h.max_attempts, h.scheduled_for, h.dead_lettered_at, h.failure_reason, h.last_error,
           workpump.state_of(h.done_at, h.dead_lettered_at, h.instance_id, h.lease_expiry,
                             h.claimed_at, h.scheduled_for, h.end_state, c.now) AS head_state,
           (SELECT count(*) FROM {table} n
            WHERE (NOT {topic_scopes_streams} OR n.topic = h.topic) AND n.stream = h.stream
              AND n.done_at IS NULL AND n.seq > h.seq) AS waiting
    FROM {table} h CROSS JOIN clock c
    WHERE h.stream_head AND h.stream IS NOT NULL AND h.done_at IS NULL
      AND (h.dead_lettered_at IS NOT NULL
           OR (h.dead_lettered_at IS NULL AND h.scheduled_for > c.now))
    -- end each
), blocked AS (
    -- dead, or scheduled after an attempt (a retry wait); a deferred first attempt is the
    -- producer's choice, not a blockage
    SELECT * FROM heads
    WHERE head_state = 'dead' OR (head_state = 'scheduled' AND attempts > 0)
)
SELECT b.category, b.scope, b.stream, b.head_id, b.head_state, b.attempts, b.max_attempts,
       b.scheduled_for AS retry_at, b.dead_lettered_at, b.failure_reason,
       split_part(b.last_error, E'\n', 1) AS last_error, b.waiting,
       count(*) OVER () AS total
FROM blocked b
ORDER BY b.waiting DESC, b.category, b.scope, b.stream
LIMIT %(limit)s

-- name: dead_rows
-- The most recently parked rows of all four tables, newest first.
SELECT d.* FROM (
    -- each category, joined by UNION ALL
    (SELECT '{category}' AS category, work_id, topic, stream,
            attempts, max_attempts, failure_reason, dead_lettered_at,
            split_part(last_error, E'\n', 1) AS last_error
     FROM {table}
     WHERE done_at IS NULL AND dead_lettered_at IS NOT NULL
     ORDER BY dead_lettered_at DESC LIMIT %(limit)s)
    -- end each
) d
ORDER BY d.dead_lettered_at DESC, d.category, d.work_id
LIMIT %(limit)s

-- name: instances
-- Every registered instance with its heartbeat age, alive-lock, liveness (the one rule of
-- workpump.live_instances), LISTEN session, stalled flushers and the rows it holds per
-- category, counted no further than one past %(exact_limit)s (an instance holds as many
-- rows as it runs at once; past the limit the count says "at least").
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
), held_keys AS (
    -- alive-locks some session holds now (pg_locks, read once)
    SELECT k.key FROM workpump.held_alive_lock_keys() AS k(key)
), live AS (
    -- the liveness rule with the configured cutoffs
    SELECT l.instance_id
    FROM clock c,
         workpump.live_instances(c.now - make_interval(secs => %(stale_after_seconds)s),
                                 c.now - make_interval(secs => %(definitively_dead_after_seconds)s))
             AS l(instance_id)
), listeners AS (
    -- LISTEN sessions of this database, named workpump-<instance id> by the NOTIFY gate
    SELECT DISTINCT a.application_name FROM pg_stat_activity a
    WHERE a.datname = current_database() AND a.application_name LIKE 'workpump-%%'
)
SELECT si.instance_id, si.service_name, si.host_name, si.process_id, si.started_at,
       si.last_heartbeat_at,
       (extract(epoch FROM c.now) - extract(epoch FROM si.last_heartbeat_at))::double precision
           AS heartbeat_age_seconds,
       si.alive_lock_key IN (SELECT key FROM held_keys) AS alive_lock_held,
       si.instance_id IN (SELECT instance_id FROM live) AS live,
       ('workpump-' || si.instance_id::text) IN (SELECT application_name FROM listeners)
           AS listening,
       -- outcome flushers of the instance that cannot write, as of its last heartbeat
       coalesce(si.metadata -> 'stalled_flushers', '{}'::jsonb) AS stalled_flushers,
       -- how long its NOTIFY listener had been down at its last heartbeat (NULL: up, or
       -- an instance that does not listen)
       CASE jsonb_typeof(si.metadata -> 'listener_down_seconds') WHEN 'number'
            THEN (si.metadata ->> 'listener_down_seconds')::double precision END
           AS listener_down_seconds,
       (SELECT count(*) FROM (SELECT FROM workpump_outbox t WHERE t.instance_id = si.instance_id
                              LIMIT %(exact_limit)s + 1) x)
           AS held_outbox,
       (SELECT count(*) FROM (SELECT FROM workpump_inbox t WHERE t.instance_id = si.instance_id
                              LIMIT %(exact_limit)s + 1) x)
           AS held_inbox,
       (SELECT count(*) FROM (SELECT FROM workpump_perspective_event t WHERE t.instance_id = si.instance_id
                              LIMIT %(exact_limit)s + 1) x)
           AS held_perspective_event,
       (SELECT count(*) FROM (SELECT FROM workpump_receptor_processing t WHERE t.instance_id = si.instance_id
                              LIMIT %(exact_limit)s + 1) x)
           AS held_receptor
FROM workpump_service_instance si CROSS JOIN clock c
ORDER BY si.started_at, si.instance_id

-- name: tombstones
-- The newest tombstones of evicted instances.
SELECT e.instance_id, e.evicted_at, e.reason,
       (extract(epoch FROM coalesce(%(now)s::timestamptz, now()))
        - extract(epoch FROM e.evicted_at))::double precision
           AS age_seconds
FROM workpump_eviction e
ORDER BY e.evicted_at DESC, e.instance_id
LIMIT %(limit)s

-- name: unhandled_topics
-- Topics with rows waiting for a claimer that no live instance runs: a claimer leases
-- only the topics it has handlers for, so these rows wait (no attempt is spent) until an
-- instance that runs them starts. Instances advertise their topics in their heartbeat
-- metadata ({"topics": {category: [topic, ...]}}, and {"topic_prefixes": {category:
-- [prefix, ...]}} for the topics it claims by prefix); one that advertises no topics (an
-- older version) is taken to run every topic of its categories. Past %(exact_limit)s
-- rows of an index the counts are of the rows read, and estimated is true.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
), live AS (
    -- the metadata of live instances (the liveness rule with the configured cutoffs)
    SELECT si.metadata
    FROM workpump_service_instance si, clock c
    WHERE si.instance_id IN (
        SELECT workpump.live_instances(
            c.now - make_interval(secs => %(stale_after_seconds)s),
            c.now - make_interval(secs => %(definitively_dead_after_seconds)s)))
), handled AS (
    -- (category, topic, prefix) some live instance runs: the topic, or every topic
    -- starting with the prefix; both NULL: every topic
    SELECT t.category, x.topic, NULL::text AS prefix
    FROM live l
    CROSS JOIN LATERAL jsonb_each(CASE jsonb_typeof(l.metadata -> 'topics')
                                  WHEN 'object' THEN l.metadata -> 'topics'
                                  ELSE '{}' END) t(category, topics)
    CROSS JOIN LATERAL jsonb_array_elements_text(CASE jsonb_typeof(t.topics)
                                                 WHEN 'array' THEN t.topics
                                                 ELSE '[]' END) x(topic)
    UNION ALL
    SELECT t.category, NULL, x.prefix
    FROM live l
    CROSS JOIN LATERAL jsonb_each(CASE jsonb_typeof(l.metadata -> 'topic_prefixes')
                                  WHEN 'object' THEN l.metadata -> 'topic_prefixes'
                                  ELSE '{}' END) t(category, prefixes)
    CROSS JOIN LATERAL jsonb_array_elements_text(CASE jsonb_typeof(t.prefixes)
                                                 WHEN 'array' THEN t.prefixes
                                                 ELSE '[]' END) x(prefix)
    UNION ALL
    SELECT c.category, NULL, NULL
    FROM live l
    CROSS JOIN LATERAL jsonb_array_elements_text(
        CASE jsonb_typeof(l.metadata -> 'categories') WHEN 'array' THEN l.metadata -> 'categories'
             ELSE '["outbox", "inbox", "perspective_event", "receptor"]' END) c(category)
    WHERE jsonb_typeof(l.metadata -> 'topics') IS DISTINCT FROM 'object'
), everything AS (
    -- categories of which some live instance runs every topic: none of their rows waits
    -- for a handler, and none is read
    SELECT DISTINCT h.category FROM handled h WHERE h.topic IS NULL AND h.prefix IS NULL
), waiting AS (
    -- undone rows, not dead, that no unexpired lease holds: the first %(exact_limit)s + 1
    -- of each partial index (_ready, _flow and _flowtimer, _timer, _stream), in claim
    -- order. Rows no instance runs are never claimed, so they stay first; past the limit
    -- the counts are of the rows read (estimated)
    -- each category, joined by UNION ALL
    (SELECT '{category}' AS category, 'ready' AS arm, t.topic, t.created_at
     FROM {table} t, clock c
     WHERE '{category}' NOT IN (SELECT e.category FROM everything e)
       AND t.done_at IS NULL AND t.dead_lettered_at IS NULL
       AND t.stream_head AND t.instance_id IS NULL AND t.scheduled_for IS NULL
       AND NOT t.flow_controlled
       ORDER BY t.priority DESC, t.seq
     LIMIT %(exact_limit)s + 1)
    UNION ALL
    (SELECT '{category}' AS category, 'flow' AS arm, f.topic, f.created_at
     FROM clock c CROSS JOIN LATERAL (
         -- unleased heads (_flow), then leased ones whose lease expired (_flowtimer)
         (SELECT t.topic, t.created_at FROM {table} t
          WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
            AND t.flow_controlled AND t.instance_id IS NULL LIMIT %(exact_limit)s + 1)
         UNION ALL
         (SELECT t.topic, t.created_at FROM {table} t
          WHERE t.done_at IS NULL AND t.dead_lettered_at IS NULL AND t.stream_head
            AND t.flow_controlled AND t.instance_id IS NOT NULL AND t.lease_expiry <= c.now
          ORDER BY t.lease_expiry LIMIT %(exact_limit)s + 1)) f
     WHERE '{category}' NOT IN (SELECT e.category FROM everything e)
     LIMIT %(exact_limit)s + 1)
    UNION ALL
    (SELECT '{category}' AS category, 'timer' AS arm, t.topic, t.created_at
     FROM {table} t, clock c
     WHERE '{category}' NOT IN (SELECT e.category FROM everything e)
       AND t.done_at IS NULL AND t.dead_lettered_at IS NULL
       AND t.stream_head AND NOT t.flow_controlled
       AND ((t.instance_id IS NULL AND t.scheduled_for IS NOT NULL)
            OR (t.instance_id IS NOT NULL AND t.lease_expiry <= c.now))
       ORDER BY coalesce(t.lease_expiry, t.scheduled_for)
     LIMIT %(exact_limit)s + 1)
    UNION ALL
    (SELECT '{category}' AS category, 'behind' AS arm, t.topic, t.created_at
     FROM {table} t, clock c
     WHERE '{category}' NOT IN (SELECT e.category FROM everything e)
       AND t.done_at IS NULL AND t.dead_lettered_at IS NULL
       AND NOT t.stream_head AND t.stream IS NOT NULL AND t.instance_id IS NULL
     LIMIT %(exact_limit)s + 1)
    -- end each
), capped AS (
    SELECT w.category, w.arm, count(*) > %(exact_limit)s AS capped
    FROM waiting w GROUP BY w.category, w.arm
)
SELECT w.category, w.topic, count(*) AS rows,
       max(extract(epoch FROM c.now) - extract(epoch FROM w.created_at))::double precision AS oldest_age_seconds,
       EXISTS (SELECT 1 FROM capped p WHERE p.category = w.category AND p.capped) AS estimated
FROM waiting w CROSS JOIN clock c
WHERE NOT EXISTS (SELECT 1 FROM handled h
                  WHERE h.category = w.category
                    AND (h.topic = w.topic OR w.topic ^@ h.prefix
                         OR (h.topic IS NULL AND h.prefix IS NULL)))
GROUP BY w.category, w.topic
ORDER BY count(*) DESC, w.category, w.topic

-- name: periodic_schedules
-- Every periodic schedule, also those no longer in the code, with when it fires next
-- and the slot it handled last.
SELECT s.name, s.cron, s.every_seconds, s.timezone, s.catch_up, s.paused, s.last_slot,
       s.next_fire_at, s.last_fired_at, s.last_message_id, s.registered_at
FROM workpump_periodic_schedule s
ORDER BY s.name

-- name: vacuum_health
-- Each work table's row versions as the statistics system last counted them: live, and
-- dead (left by updates and deletes, and kept, with their index entries, until VACUUM
-- removes them: a claim steps over the entries of done rows); when VACUUM last finished
-- on it, by hand or by autovacuum; and whether autovacuum may run on it (the server's
-- setting and the table's own). With each, the session of this database holding the
-- oldest snapshot or transaction id, for which VACUUM keeps every row version it may see
-- (none: NULLs; a session of another role shows only to a role that may read its
-- activity). Autovacuum's own workers are left out: their snapshots hold no VACUUM back.
WITH clock AS (SELECT coalesce(%(now)s::timestamptz, now()) AS now),
oldest AS (
    SELECT a.pid, a.usename::text AS role_name, a.application_name, a.state,
           (extract(epoch FROM c.now) - extract(epoch FROM a.xact_start))::double precision
               AS open_seconds
    FROM pg_stat_activity a CROSS JOIN clock c
    WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
      AND a.backend_type <> 'autovacuum worker'
      AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
    ORDER BY greatest(age(a.backend_xmin), age(a.backend_xid)) DESC, a.pid
    LIMIT 1
)
SELECT k.category, w.tbl AS table_name,
       coalesce(s.n_live_tup, 0) AS live_versions,
       coalesce(s.n_dead_tup, 0) AS dead_versions,
       (extract(epoch FROM c.now)
        - extract(epoch FROM greatest(s.last_vacuum, s.last_autovacuum)))::double precision
           AS vacuum_age_seconds,
       current_setting('autovacuum')::boolean
           AND coalesce((SELECT o.option_value::boolean
                         FROM pg_options_to_table(r.reloptions) o
                         WHERE o.option_name = 'autovacuum_enabled'), true) AS autovacuum,
       -- the oldest snapshot's session, the same on every row
       o.pid, o.role_name, o.application_name, o.state, o.open_seconds
FROM unnest(%(categories)s::text[]) WITH ORDINALITY AS k(category, n)
CROSS JOIN LATERAL workpump.work_table(k.category) w
CROSS JOIN clock c
JOIN pg_class r ON r.oid = to_regclass(w.tbl)
LEFT JOIN pg_stat_user_tables s ON s.relid = r.oid
LEFT JOIN oldest o ON true
ORDER BY k.n
