-- As SQLite's 0019: when the node last vouched for its LB verdicts, which
-- the other replicas read with its last heartbeat (see
-- `Store::liveness_since`).
ALTER TABLE nodes ADD COLUMN vouched_at BIGINT;
