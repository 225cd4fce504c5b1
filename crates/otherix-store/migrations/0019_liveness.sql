-- When the node last vouched for its LB verdicts (a heartbeat that lists
-- only the verdicts that changed: the others stand as of then). A whole
-- set does not vouch for what it leaves out. Control-plane replicas on
-- PostgreSQL read it with each node's last heartbeat (SQLite keeps the
-- column so that both schemas are one).
ALTER TABLE nodes ADD COLUMN vouched_at INTEGER;
