-- As SQLite's 0020: when each session signing key signs from (NULL on
-- keys made before: computed from when they were made).
ALTER TABLE session_keys ADD COLUMN signs_from BIGINT;
