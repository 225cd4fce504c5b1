-- Session records in the audit trail: bytes each way, duration, end reason.
ALTER TABLE audit_events ADD COLUMN bytes_up INTEGER;
ALTER TABLE audit_events ADD COLUMN bytes_down INTEGER;
ALTER TABLE audit_events ADD COLUMN duration_ms INTEGER;
