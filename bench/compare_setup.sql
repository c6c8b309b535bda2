-- bench/compare_setup.sql -- one database of bench/compare.sh (run with psql)
--
-- The extension as the revision under test installed it, and the
-- application's own table that ext_new_biz writes in the same transaction
-- as the claim.  idempotency.partition_interval, when the database sets one
-- (ALTER DATABASE ... SET), is in force here: CREATE EXTENSION makes the
-- partitions for the coming max_ttl with it.

CREATE EXTENSION idempotency;

CREATE SCHEMA bench;

-- ext_new_biz: an orders table like a real one, a surrogate key and two
-- more indexes, so that the INSERT takes five relation locks (table,
-- sequence, three indexes).
CREATE TABLE bench.orders (
    id         bigserial PRIMARY KEY,
    key        text NOT NULL,
    amount     int NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX orders_key_idx ON bench.orders (key);
CREATE INDEX orders_created_at_idx ON bench.orders (created_at);
