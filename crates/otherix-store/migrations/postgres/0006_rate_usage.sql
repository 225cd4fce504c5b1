-- What each control-plane replica's rate limits charged, per principal, so
-- that the others charge it too: a limit holds across replicas, not per
-- replica. Insert-only; rows older than a few seconds are pruned.
CREATE TABLE rate_usage (
    id BIGSERIAL PRIMARY KEY,
    replica TEXT NOT NULL,
    kind TEXT NOT NULL,
    principal TEXT NOT NULL,
    n BIGINT NOT NULL,
    at BIGINT NOT NULL
);
CREATE INDEX rate_usage_at ON rate_usage (at);
