-- examples/schema.sql: the tables of the HTTP examples (examples/gin,
-- examples/python), in a schema of their own.  Run once in the example's
-- database, after CREATE EXTENSION idempotency.

CREATE SCHEMA shop;

-- The seed's payments, with the business unique key as the last line of
-- defence: had anything got past the claim, this index would still refuse a
-- second payment for one user's key.
CREATE TABLE shop.payments (
    id               bigserial PRIMARY KEY,
    idempotency_key  text NOT NULL,
    user_id          bigint NOT NULL,
    order_id         text NOT NULL,
    amount           bigint NOT NULL CHECK (amount > 0),
    currency         text NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    UNIQUE (user_id, idempotency_key)
);

-- One row per run of the payment handler, committed with its answer: the
-- tests count runs with it.
CREATE TABLE shop.payment_attempts (
    id               bigserial PRIMARY KEY,
    idempotency_key  text NOT NULL,
    user_id          bigint NOT NULL,
    source           text,
    created_at       timestamptz NOT NULL DEFAULT now()
);

-- The seed's stock deduction.  No CHECK (quantity >= 0) on purpose: the
-- guarded UPDATE alone must keep it from going below zero.
CREATE TABLE shop.stock (
    sku       text PRIMARY KEY,
    quantity  int NOT NULL
);
INSERT INTO shop.stock VALUES ('sku-42', 100);

CREATE TABLE shop.stock_moves (
    id               bigserial PRIMARY KEY,
    idempotency_key  text NOT NULL,
    user_id          bigint NOT NULL,
    sku              text NOT NULL REFERENCES shop.stock,
    quantity         int NOT NULL,
    UNIQUE (user_id, idempotency_key)
);

-- Charges made through an outside provider (lease mode), and the calls
-- that provider received (written outside the request's transaction: they
-- stand for the provider's own records).
CREATE TABLE shop.charges (
    id               bigserial PRIMARY KEY,
    idempotency_key  text NOT NULL,
    user_id          bigint NOT NULL,
    order_id         text NOT NULL,
    amount           bigint NOT NULL,
    provider_ref     text NOT NULL,
    UNIQUE (user_id, idempotency_key)
);
CREATE TABLE shop.provider_calls (
    id               bigserial PRIMARY KEY,
    idempotency_key  text NOT NULL,
    amount           bigint NOT NULL,
    called_at        timestamptz NOT NULL DEFAULT clock_timestamp()
);
