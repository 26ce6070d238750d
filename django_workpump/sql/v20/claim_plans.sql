-- Schema version 20: each claim statement is planned once per session.
--
-- The four claim_<category> functions run one static statement each, and PostgreSQL
-- planned it afresh on every call: its cost estimate for a generic plan (one that
-- leaves the parameters open) was far above each custom plan's, so plan_cache_mode
-- "auto" never kept one. Planning that statement, which reads the work table five times
-- past ten partial indexes, was about half of a one-row claim: 2.0 ms against 1.0 ms
-- with the generic plan, at 1M pending and 5M processed rows (and 1.8 against 0.9 ms at
-- 400k and 2M). The generic plan is the same plan: index scans of the ready, timer,
-- stream and primary key indexes, driven by the parameters at run time.
--
-- The generic plan's row estimates are loose (a LIMIT of unknown size is taken as a
-- tenth of the table), and its total cost crosses jit_above_cost on a big table. A JIT
-- compile of this statement took 1.2 s, once per call, so these functions turn JIT off.

ALTER FUNCTION workpump.claim_outbox(uuid, integer, integer, integer, integer, text[], timestamptz, text[], integer)
    SET plan_cache_mode = force_generic_plan SET jit = off;
ALTER FUNCTION workpump.claim_inbox(uuid, integer, integer, integer, integer, text[], timestamptz, text[], integer)
    SET plan_cache_mode = force_generic_plan SET jit = off;
ALTER FUNCTION workpump.claim_perspective_event(uuid, integer, integer, integer, integer, text[], timestamptz, text[], integer)
    SET plan_cache_mode = force_generic_plan SET jit = off;
ALTER FUNCTION workpump.claim_receptor(uuid, integer, integer, integer, integer, text[], timestamptz, text[], integer)
    SET plan_cache_mode = force_generic_plan SET jit = off;
