-- When each session signing key signs from. A key made by the rotation
-- schedule signs a publish lead after it was made; one made by
-- `otherix keys rotate` sooner. NULL on keys made before this column:
-- their start is computed as it was (the first key at once, the others a
-- lead after they were made).
ALTER TABLE session_keys ADD COLUMN signs_from INTEGER;
