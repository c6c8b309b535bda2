-- article: the article's own idempotency_records table, a surrogate key
-- and a UNIQUE idempotency key.
CREATE TABLE bench.idempotency_records (
    id              bigserial PRIMARY KEY,
    idempotency_key varchar(255) NOT NULL UNIQUE,
    request_hash    varchar(64),
    status          varchar(16) NOT NULL DEFAULT 'PROCESSING',
    response_status int,
    response_body   jsonb,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL
);
