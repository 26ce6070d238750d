-- Named queries of the admin's console (django_workpump/db/console.py): the per-minute
-- series that the console tables hold (sql/schema.sql, "The console's time series"), and
-- the sampler's and the purge's calls. %(now)s is NULL in production (tests pin it).
-- Every filter parameter may be NULL: that filter is off.

-- name: console_sample
SELECT workpump.console_sample(
    p_stale_after_seconds => %(stale_after_seconds)s,
    p_definitively_dead_after_seconds => %(definitively_dead_after_seconds)s,
    p_now => %(now)s) AS sampled

-- name: purge_console
SELECT workpump.purge_console(
    now() - make_interval(secs => %(retention_seconds)s), %(batch)s) AS purged

-- name: console_counting
SELECT workpump.console_counting(%(on)s) AS counting

-- name: console_clock
-- The minute the console's window ends at, and the latency bucket bounds.
SELECT date_trunc('minute', coalesce(%(now)s::timestamptz, now())) AS minute,
       workpump.console_latency_bounds() AS bounds

-- name: counts_by_minute
-- A part, {counts} in the queries below with a step of one minute: the counters of
-- [since, until], a row per minute, topic, outcome and instance.
(SELECT c.minute, c.category, c.topic, c.outcome, c.n, c.latency
 FROM workpump_console_count c
 WHERE c.minute >= %(since)s AND c.minute <= %(until)s AND isfinite(c.minute))

-- name: counts_binned
-- A part, {counts} in the queries below with a step of several minutes: the counters
-- in bins of %(step)s minutes (the rollup where it is folded).
workpump.console_counts(%(since)s, %(until)s, %(step)s)

-- name: console_outcomes
-- Counts per bin and outcome in [since, until], of one topic.
SELECT c.minute, c.outcome, sum(c.n)::bigint AS n
FROM {counts} c
WHERE c.category = %(category)s AND c.topic = %(topic)s
GROUP BY 1, 2
ORDER BY 1, 2

-- name: console_total_outcomes
-- Counts per bin of %(step)s minutes and outcome in [since, until], of every topic (the
-- totals).
SELECT date_bin(make_interval(mins => %(step)s), c.minute, '2000-01-01 00:00:00+00') AS minute,
       c.outcome, sum(c.n)::bigint AS n
FROM workpump.console_totals(%(since)s, %(until)s, %(instance_id)s::uuid) c
GROUP BY 1, 2
ORDER BY 1, 2

-- name: console_topic_outcomes
-- Counts per bin, topic and outcome in [since, until], for the topics asked for: one
-- probe of each topic's key (the rollup's wp_console_rollup_topic index; OFFSET 0 keeps
-- the probes apart, which the planner would otherwise merge into one scan of the window
-- for every topic).
SELECT c.minute, c.category, c.topic, c.outcome, sum(c.n)::bigint AS n
FROM unnest(%(categories)s::text[], %(topics)s::text[]) t(category, topic)
CROSS JOIN LATERAL (
    SELECT c.minute, c.category, c.topic, c.outcome, c.n
    FROM {counts} c
    WHERE c.category = t.category AND c.topic = t.topic
      AND c.outcome IN ('done', 'failed', 'dead')
    OFFSET 0) c
GROUP BY 1, 2, 3, 4
ORDER BY 1

-- name: console_topics
-- Topics with counts in [since, until], busiest first: totals per outcome.
SELECT c.category, c.topic,
       coalesce(sum(c.n) FILTER (WHERE c.outcome = 'done'), 0)::bigint AS done,
       coalesce(sum(c.n) FILTER (WHERE c.outcome = 'failed'), 0)::bigint AS failed,
       coalesce(sum(c.n) FILTER (WHERE c.outcome = 'dead'), 0)::bigint AS dead,
       coalesce(sum(c.n) FILTER (WHERE c.outcome = 'claimed'), 0)::bigint AS claimed
FROM {counts} c
WHERE c.outcome IN ('done', 'failed', 'dead', 'claimed')
GROUP BY 1, 2
ORDER BY sum(c.n) FILTER (WHERE c.outcome IN ('done', 'failed', 'dead')) DESC NULLS LAST,
         1, 2
LIMIT %(limit)s

-- name: console_latency
-- Claims per bin and pickup-latency bucket (1-based) in [since, until], of one topic.
SELECT c.minute, u.bucket::integer AS bucket, sum(u.rows)::bigint AS n
FROM {counts} c
CROSS JOIN LATERAL unnest(c.latency) WITH ORDINALITY AS u(rows, bucket)
WHERE c.outcome = 'claimed' AND c.category = %(category)s AND c.topic = %(topic)s
GROUP BY 1, 2
ORDER BY 1, 2

-- name: console_total_latency
-- Claims per bin of %(step)s minutes and pickup-latency bucket (1-based) in [since,
-- until], of every topic.
SELECT date_bin(make_interval(mins => %(step)s), c.minute, '2000-01-01 00:00:00+00') AS minute,
       u.bucket::integer AS bucket, sum(u.rows)::bigint AS n
FROM workpump.console_totals(%(since)s, %(until)s, %(instance_id)s::uuid) c
CROSS JOIN LATERAL unnest(c.latency) WITH ORDINALITY AS u(rows, bucket)
WHERE c.outcome = 'claimed'
GROUP BY 1, 2
ORDER BY 1, 2

-- name: console_backlog
-- Sampled backlog in [since, until], for each bin of %(step)s minutes its last sampled
-- minute (what the chart draws for the bin): rows waiting, and the oldest pending age. A
-- backward probe of the key per bin finds that minute, so a day in 10-minute bins reads
-- a tenth of the day's samples.
SELECT m.minute, sum(b.pending)::bigint AS pending, sum(b.scheduled)::bigint AS scheduled,
       sum(b.leased)::bigint AS leased, max(b.oldest_pending_seconds) AS oldest_pending_seconds
FROM generate_series(date_bin(make_interval(mins => %(step)s), %(since)s::timestamptz,
                              '2000-01-01 00:00:00+00'),
                     %(until)s::timestamptz, make_interval(mins => %(step)s)) bin(start)
CROSS JOIN LATERAL (
    SELECT l.minute FROM workpump_console_backlog l
    WHERE l.minute >= greatest(bin.start, %(since)s::timestamptz)
      AND l.minute < bin.start + make_interval(mins => %(step)s)
      AND l.minute <= %(until)s AND isfinite(l.minute)
      AND (%(category)s::text IS NULL OR l.category = %(category)s)
      AND (%(topic)s::text IS NULL OR l.topic = %(topic)s)
    ORDER BY l.minute DESC LIMIT 1) m
JOIN workpump_console_backlog b ON b.minute = m.minute
WHERE (%(category)s::text IS NULL OR b.category = %(category)s)
  AND (%(topic)s::text IS NULL OR b.topic = %(topic)s)
GROUP BY 1
ORDER BY 1

-- name: console_instances
-- Sampled instances in [since, until]: heartbeat age, alive, rows in flight, each instance's
-- last sample in each bin of %(step)s minutes (every sample with a step of 1). A chart
-- draws a bin from its last sample, so the rest stay here: a day of minutes for a few
-- instances was thousands of rows to load and sort in Python. An idle pump samples
-- nothing (console_sample), so the window starts at the last sampled minute before it,
-- and each row says until when its instance's heartbeat row shows it beat (beat_until,
-- NULL once it is gone): a chart carries a sample forward until then.
SELECT s.minute, s.instance_id, s.service_name, s.host_name, s.process_id,
       s.heartbeat_age_seconds, s.alive, s.in_flight,
       CASE WHEN isfinite(si.last_heartbeat_at) THEN si.last_heartbeat_at END AS beat_until
FROM (
    SELECT i.*, row_number() OVER (
               PARTITION BY date_bin(make_interval(mins => %(step)s), i.minute,
                                     '2000-01-01 00:00:00+00'), i.instance_id
               ORDER BY i.minute DESC) AS nth
    FROM workpump_console_instance i
    WHERE i.minute >= coalesce((SELECT max(p.minute) FROM workpump_console_sample p
                                WHERE p.minute <= %(since)s AND isfinite(p.minute)),
                               %(since)s)
      AND i.minute <= %(until)s AND isfinite(i.minute)
      AND (%(instance_id)s::uuid IS NULL OR i.instance_id = %(instance_id)s)) s
LEFT JOIN workpump_service_instance si ON si.instance_id = s.instance_id
WHERE s.nth = 1
ORDER BY 1, 2

-- name: console_failures
SELECT f.failure_reason, f.n, f.dead, f.last_error, f.last_seen
FROM workpump.console_failures(%(category)s, %(topic)s, %(scan)s) f

-- name: console_in_flight
SELECT r.category, r.seq, r.work_id, r.topic, r.stream, r.attempts, r.max_attempts, r.claimed_at,
       r.lease_expiry, r.expired
FROM workpump.console_in_flight(%(instance_id)s, %(limit)s, %(now)s) r
