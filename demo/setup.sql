-- demo/setup.sql: the application's side of the demo (run once, in its own
-- database, by scripts/demo.sh).

CREATE EXTENSION idempotency;

-- A payments table with its own unique business key: if anything ever got
-- past the idempotency claim, this index would still refuse a second payment
-- for the same Idempotency-Key (the last line of defence).
CREATE TABLE payments (
    id               bigserial PRIMARY KEY,
    idempotency_key  text NOT NULL UNIQUE,
    user_id          int NOT NULL,
    amount_cents     bigint NOT NULL CHECK (amount_cents > 0),
    currency         text NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now()
);

-- The payment provider's side of the resumed payment (1.2): one row per
-- charge it made.  The demo checks that a payment whose worker died after
-- the charge is charged once.
CREATE TABLE provider_charges (
    payment_key      text NOT NULL,
    charge_id        text NOT NULL,
    charged_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- One product whose stock concurrent orders deduct.  There is deliberately no
-- CHECK (quantity >= 0): the guarded UPDATE alone must keep it from going
-- below zero.
CREATE TABLE stock (
    sku       text PRIMARY KEY,
    quantity  int NOT NULL
);
CREATE TABLE stock_moves (
    order_key  text PRIMARY KEY,
    sku        text NOT NULL,
    quantity   int NOT NULL
);
CREATE SEQUENCE order_no;

-- A message queue that redelivers, and the consumer's effects.
CREATE TABLE queue (
    delivery_id  bigserial PRIMARY KEY,
    event_id     text NOT NULL,
    amount       int NOT NULL
);
CREATE TABLE ledger (
    event_id     text PRIMARY KEY,        -- last line of defence again
    amount       int NOT NULL
);
CREATE TABLE account (
    id       int PRIMARY KEY,
    balance  bigint NOT NULL
);
INSERT INTO account VALUES (1, 0);

-- What each concurrent client saw, written in the same transaction as its
-- claim (so a rolled back attempt leaves no line either).
CREATE TABLE outcomes (
    id           bigserial PRIMARY KEY,
    scenario     text NOT NULL,
    client_id    int,
    key          text NOT NULL,
    outcome      text NOT NULL,
    attempt      int,
    http_status  int,
    body         jsonb,
    started_at   timestamptz NOT NULL DEFAULT now(),             -- transaction start
    answered_at  timestamptz NOT NULL DEFAULT clock_timestamp()  -- after idem_acquire
);

-- try_sql(statement): run it and say what happened, as an application that
-- catches the error would: 'ok: <first column>' or 'SQLSTATE xxxxx: message'.
CREATE FUNCTION try_sql(stmt text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    result text;
BEGIN
    EXECUTE stmt INTO result;
    RETURN 'ok: ' || coalesce(result, 'NULL');
EXCEPTION WHEN OTHERS THEN
    RETURN 'SQLSTATE ' || SQLSTATE || ': ' || SQLERRM;
END
$$;
