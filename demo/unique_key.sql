-- demo/unique_key.sql: the payments table's own UNIQUE (idempotency_key)
-- refuses a second row for one key even from code that skipped the claim.
-- Rolled back: it leaves nothing behind.
-- Prints: ok: ... or SQLSTATE xxxxx: message

BEGIN;
INSERT INTO payments (idempotency_key, user_id, amount_cents, currency)
VALUES ('raw-insert-key', 1, 100, 'EUR');
SELECT try_sql($$
    INSERT INTO payments (idempotency_key, user_id, amount_cents, currency)
    VALUES ('raw-insert-key', 1, 100, 'EUR') RETURNING id $$);
ROLLBACK;
-- The sequence is not transactional: give the demo's first payment id 1 again.
SELECT setval('payments_id_seq', 1, false) \g /dev/null
