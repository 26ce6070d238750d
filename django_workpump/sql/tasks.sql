-- Named queries of the django.tasks backend (tasks/runner.py), run through
-- db.fetch_named("tasks.sql", name, params). Write queries end with RETURNING.

-- name: spend_attempts
-- A task the runner refuses (not a task it may run, a return value that is not JSON)
-- must not be retried: lowering max_attempts to the attempts used makes the failure
-- the runner reports next dead-letter the row. Fenced like every post-claim write:
-- only the instance holding the undone row, under the lease token of this attempt.
UPDATE workpump_inbox
SET max_attempts = attempts
WHERE message_id = %(message_id)s
  AND instance_id = %(instance_id)s
  AND lease_token = %(lease_token)s
  AND processed_at IS NULL
RETURNING message_id, max_attempts
