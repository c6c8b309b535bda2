-- demo/resume_takeover.sql: the retry of the payment (1.2).  It takes the
-- dead worker's claim over, and the takeover says how far the worker got:
-- at 'charged' it completes with the charge id it is given, without
-- calling the provider again; otherwise it charges first.
-- psql variables: key, request.
-- Prints: outcome|attempt|phase|charge id|completed|the provider's charges

SELECT outcome, attempt, coalesce(phase, '-') AS phase,
       coalesce(state->>'charge_id', '-') AS charge_id, claim
  FROM idempotency.idem_acquire(:'key', :'request'::jsonb)
\gset
SELECT :'phase' <> 'charged' AS must_charge
\gset
\if :must_charge
INSERT INTO provider_charges (payment_key, charge_id) VALUES (:'key', 'ch_retry')
  RETURNING charge_id
\gset
\endif
SELECT idempotency.idem_complete(:'key', 201, jsonb_build_object('charge_id', :'charge_id'),
                                 claim => :'claim') AS done
\gset
SELECT :'outcome', :'attempt', :'phase', :'charge_id', :'done',
       (SELECT count(*) FROM provider_charges WHERE payment_key = :'key');
