-- demo/resume_worker.sql: a payment worker (1.2).  It claims the payment
-- (session-bound: the claim lives as long as this session), has the
-- provider charge it, and records the charge as the checkpoint 'charged'
-- in the same transaction; then it dies while it records the payment:
-- scripts/demo.sh terminates its connection, so it never completes.
-- psql variables: key, request.
-- Prints: the provider's charge id.

SELECT claim FROM idempotency.idem_acquire(:'key', :'request'::jsonb, session_bound => true)
\gset
BEGIN;
INSERT INTO provider_charges (payment_key, charge_id)
     VALUES (:'key', 'ch_' || left(md5(:'key'), 8))
  RETURNING charge_id
\gset
SELECT idempotency.idem_checkpoint(:'key', claim => :'claim', phase => 'charged',
                                   state => jsonb_build_object('charge_id', :'charge_id')) IS NOT NULL
    AS checkpointed
\gset
COMMIT;
\echo :charge_id
-- recording the payment, where the worker dies
SELECT pg_sleep(30);
SELECT idempotency.idem_complete(:'key', 201, jsonb_build_object('charge_id', :'charge_id'), claim => :'claim');
