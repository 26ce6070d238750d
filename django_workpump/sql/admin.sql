-- Named queries of the Django admin (django_workpump/admin/): the operator actions, each
-- through the SQL function that keeps leases fenced, with Django's %(name)s placeholders.
-- Each returns rows (the ids it changed, or a count), run with db.fetch_named("admin.sql", ...);
-- the subquery fragments at the end are read by admin/expressions.py into its querysets.

-- name: retry_now
-- Scheduled rows (retry wait or deferral) become claimable now; the ids that changed.
SELECT r.id
FROM workpump.retry_now(%(category)s, %(ids)s::uuid[]) AS r(id)

-- name: release_leases
-- Leases of the given rows released; rows held by a live instance (the liveness rule with
-- the configured cutoffs) are skipped unless forced. The ids that were released.
SELECT r.id
FROM workpump.release_leases(
    %(category)s, %(ids)s::uuid[], %(force)s,
    %(stale_after_seconds)s, %(definitively_dead_after_seconds)s
) AS r(id)

-- name: dead_letter
-- Undone rows parked as dead with the operator's reason; the ids that changed.
SELECT r.id
FROM workpump.dead_letter(%(category)s, %(ids)s::uuid[], %(reason)s) AS r(id)

-- name: requeue_dead
-- Dead rows given a fresh set of attempts (their last error stays); the ids that changed.
SELECT r.id
FROM workpump.requeue_dead(%(category)s, %(ids)s::uuid[]) AS r(id)

-- name: evict_instance
-- One instance tombstoned and every lease it held released; the number of rows released.
SELECT workpump.evict_instance(%(instance_id)s, %(reason)s) AS released

-- Subquery fragments of the admin's ORM querysets (RawSQL, positional parameters):
-- each yields one column of ids or keys for an IN test, so liveness and the alive-lock
-- come from the same SQL functions every other reader uses.

-- name: live_instance_ids
-- The live instances by workpump.live_instances: stale and definitive-dead cutoffs in
-- seconds before now().
SELECT workpump.live_instances(
    now() - make_interval(secs => %s), now() - make_interval(secs => %s)
)

-- name: held_alive_lock_keys
-- alive_lock_key values whose alive-lock some session holds now (pg_locks).
SELECT workpump.held_alive_lock_keys()

-- name: listening_instance_ids
-- Instances whose NOTIFY gate is connected: sessions of this database named
-- workpump-<instance id> (anything else named workpump-... yields NULL, not an error).
SELECT CASE WHEN a.application_name ~ '^workpump-[0-9a-f-]{36}$'
            THEN substr(a.application_name, 10)::uuid END
FROM pg_stat_activity a
WHERE a.datname = current_database()
