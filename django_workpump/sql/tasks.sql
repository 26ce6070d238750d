-- Named queries of the django.tasks backend (tasks/runner.py), run through
-- db.fetch_named("tasks.sql", name, params). Write queries end with RETURNING.

-- name: spend_attempts
-- A task the runner refuses (not a task it may run, a return value that is not JSON)
-- must not be retried: lowering max_attempts to the attempts used makes the failure
-- the runner reports next dead-letter the row. Fenced like every post-claim write:
-- only the instance holding the undone row, under the lease token of this attempt.
UPDATE workpump_inbox
SET max_attempts = attempts
WHERE work_id = %(work_id)s
  AND instance_id = %(instance_id)s
  AND lease_token = %(lease_token)s
  AND done_at IS NULL
RETURNING work_id, max_attempts

-- name: task_result
-- A task's row and its recorded attempts in one statement (tasks/results.py): the
-- attempts come as parallel arrays in attempt order (NULL when there is none). Only a
-- row of the backend's topics (topics starting with %(topic_prefix)s) is found.
SELECT i.topic, i.payload, i.priority, i.created_at, i.attempts, i.instance_id,
       i.lease_expiry, i.done_at, i.end_state, i.dead_lettered_at, i.last_error,
       i.result,
       a.numbers AS attempt_numbers, a.instance_ids AS attempt_instance_ids,
       a.started AS attempt_started_at, a.finished AS attempt_finished_at,
       a.error_classes AS attempt_error_classes, a.tracebacks AS attempt_tracebacks
FROM workpump_inbox i
CROSS JOIN LATERAL (
    SELECT array_agg(t.attempt ORDER BY t.attempt) AS numbers,
           array_agg(t.instance_id ORDER BY t.attempt) AS instance_ids,
           array_agg(t.started_at ORDER BY t.attempt) AS started,
           array_agg(t.finished_at ORDER BY t.attempt) AS finished,
           array_agg(t.error_class ORDER BY t.attempt) AS error_classes,
           array_agg(t.traceback ORDER BY t.attempt) AS tracebacks
    FROM workpump_task_attempt t
    WHERE t.work_id = i.work_id
) a
WHERE i.work_id = %(work_id)s
  AND starts_with(i.topic, %(topic_prefix)s)
