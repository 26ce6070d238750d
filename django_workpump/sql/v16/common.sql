-- Schema version 16, part 3: the stream lock, inlined.
--
-- lock_stream was a SQL function with its own search_path: PostgreSQL cannot inline
-- such a function, and switching search_path on every call made it the largest cost of
-- storing a row with a stream (about 60 of 80 microseconds per row of a 5,000-row
-- send_many, in the insert trigger). As a SQL-standard body it is parsed once, at
-- creation (no name is resolved at run time, so no search_path is needed), and inlined
-- into its callers. The lock it takes, and so every caller's lock order, is unchanged.

-- Serialize the writers of one ordered stream until the end of the transaction, so its
-- rows become heads in commit order. A hash collision only serializes two streams more.
CREATE OR REPLACE FUNCTION workpump.lock_stream(p_category text, p_scope text, p_stream text)
RETURNS void
LANGUAGE sql
RETURN pg_advisory_xact_lock(
    workpump.lock_namespace('stream'),
    hashtext(p_category || chr(31) || coalesce(p_scope, '') || chr(31) || p_stream)
);
