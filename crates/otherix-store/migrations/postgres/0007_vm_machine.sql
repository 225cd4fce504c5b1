-- QEMU guests: a VM's machine (JSON: memory, CPUs, image, SSH keys; NULL
-- for the netns runtime) and the accelerator its node reports for it.
ALTER TABLE vms ADD COLUMN machine TEXT;
ALTER TABLE vms ADD COLUMN accelerator TEXT;
-- A QEMU guest's migration: its id (a new one per `vm migrate`, from which
-- the CP derives the stream's key) and the port the target's incoming QEMU
-- reported it listens on.
ALTER TABLE vms ADD COLUMN migration_id TEXT;
ALTER TABLE vms ADD COLUMN migration_port INTEGER;
