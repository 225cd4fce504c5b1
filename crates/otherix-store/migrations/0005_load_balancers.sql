-- Load balancers (the pool is computed from the selector, never stored) and
-- the health verdicts agents report for their backends.

CREATE TABLE load_balancers (
    name        TEXT PRIMARY KEY,
    port        INTEGER NOT NULL,
    selector    TEXT NOT NULL,
    health_kind TEXT NOT NULL CHECK (health_kind IN ('tcp', 'http')),
    health_path TEXT,
    health_port INTEGER,
    interval_ms INTEGER NOT NULL,
    timeout_ms  INTEGER NOT NULL,
    rise        INTEGER NOT NULL,
    fall        INTEGER NOT NULL,
    created_at  INTEGER NOT NULL
);

CREATE TABLE health_verdicts (
    lb         TEXT NOT NULL REFERENCES load_balancers(name) ON DELETE CASCADE,
    vm_id      TEXT NOT NULL,
    -- The node that probed: verdicts of a former owner are ignored.
    node       TEXT NOT NULL,
    health     TEXT NOT NULL,
    probed_at  INTEGER NOT NULL,
    changed_at INTEGER,
    reason     TEXT,
    successes  INTEGER NOT NULL DEFAULT 0,
    failures   INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (lb, vm_id)
);
