-- API tokens expire: when (NULL: never, as every token made before this
-- and the first admin's bootstrap token).
ALTER TABLE api_tokens ADD COLUMN expires_at BIGINT;
