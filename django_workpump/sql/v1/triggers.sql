-- Insert triggers of the four work tables.
--
-- Before each row: fill partition_number and decide stream_head. A row is its stream's
-- head iff no undone row of its ordering scope exists; the stream lock makes that check
-- and complete_work's promotion of the next head mutually exclusive, so exactly one
-- undone row per stream is a head, and rows become heads in commit order.
--
-- After each statement: one NOTIFY per category, delivered at commit.

CREATE FUNCTION workpump.before_insert_work() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_category text := TG_ARGV[0];
BEGIN
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
            WHERE stream = NEW.stream AND processed_at IS NULL);
    ELSIF v_category = 'inbox' THEN
        PERFORM workpump.lock_stream(v_category, '', NEW.stream);
        NEW.stream_head := NOT EXISTS (
            SELECT 1 FROM workpump_inbox
            WHERE stream = NEW.stream AND processed_at IS NULL);
    ELSIF v_category = 'perspective_event' THEN
        PERFORM workpump.lock_stream(v_category, NEW.perspective_name, NEW.stream);
        NEW.stream_head := NOT EXISTS (
            SELECT 1 FROM workpump_perspective_event
            WHERE perspective_name = NEW.perspective_name AND stream = NEW.stream
              AND processed_at IS NULL);
    ELSE
        PERFORM workpump.lock_stream(v_category, NEW.receptor_name, NEW.stream);
        NEW.stream_head := NOT EXISTS (
            SELECT 1 FROM workpump_receptor_processing
            WHERE receptor_name = NEW.receptor_name AND stream = NEW.stream
              AND completed_at IS NULL);
    END IF;
    RETURN NEW;
END
$$;

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
    FOR EACH ROW EXECUTE FUNCTION workpump.before_insert_work('outbox');
CREATE TRIGGER workpump_inbox_before_insert BEFORE INSERT ON workpump_inbox
    FOR EACH ROW EXECUTE FUNCTION workpump.before_insert_work('inbox');
CREATE TRIGGER workpump_perspective_event_before_insert BEFORE INSERT ON workpump_perspective_event
    FOR EACH ROW EXECUTE FUNCTION workpump.before_insert_work('perspective_event');
CREATE TRIGGER workpump_receptor_processing_before_insert BEFORE INSERT ON workpump_receptor_processing
    FOR EACH ROW EXECUTE FUNCTION workpump.before_insert_work('receptor');

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
