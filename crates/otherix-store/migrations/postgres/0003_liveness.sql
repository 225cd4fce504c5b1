-- As SQLite's 0019: a node's heartbeat written to the store is logged as
-- its liveness, for the other control planes.
ALTER TABLE nodes ADD COLUMN vouched_at BIGINT;

CREATE TRIGGER changes_nodes_alive AFTER UPDATE ON nodes
    FOR EACH ROW WHEN (OLD.last_heartbeat IS DISTINCT FROM NEW.last_heartbeat)
    EXECUTE FUNCTION log_change('liveness', 'name');
