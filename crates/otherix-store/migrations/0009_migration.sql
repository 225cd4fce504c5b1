-- Live migration: the node a VM is moving to (while it is `migrating`), and
-- each node's own network namespace name (the netns runtime hands a guest's
-- veth over to it).
ALTER TABLE vms ADD COLUMN migrate_to TEXT;
ALTER TABLE nodes ADD COLUMN netns TEXT;
-- Overlays the node reports as realized (JSON array of network names): a
-- migration hands a guest over only once the target has its overlay.
ALTER TABLE nodes ADD COLUMN ready_overlays TEXT NOT NULL DEFAULT '[]';
