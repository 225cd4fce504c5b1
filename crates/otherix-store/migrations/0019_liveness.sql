-- A node's heartbeat written to the store (at most every few seconds) is
-- news for every control plane but the one that answered it: without it
-- the others would take nodes that heartbeat elsewhere for NotReady, and
-- their LB verdicts for stale. Its own kind, so that it costs a catalog
-- the node's liveness and nothing else (no desired state is touched).
-- When the node last vouched for its LB verdicts (a heartbeat that lists
-- only the verdicts that changed: the others stand as of then). A whole
-- set does not vouch for what it leaves out.
ALTER TABLE nodes ADD COLUMN vouched_at INTEGER;

CREATE TRIGGER changes_nodes_alive AFTER UPDATE ON nodes
WHEN OLD.last_heartbeat IS NOT NEW.last_heartbeat
BEGIN INSERT INTO changes (kind, key) VALUES ('liveness', NEW.name); END;
