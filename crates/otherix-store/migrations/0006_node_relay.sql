-- Where a node accepts relay connections from the CP.
ALTER TABLE nodes ADD COLUMN relay TEXT;
