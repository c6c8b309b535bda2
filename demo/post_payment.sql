-- demo/post_payment.sql: one POST /payments carrying an Idempotency-Key, as
-- an API server runs it: claim, payment and stored response in ONE
-- transaction.
--
-- psql variables: key, user_id, amount (cents).
-- Prints one line: outcome|HTTP status|response body

\set scope 'user:' :user_id '/payments'
\set request '{"amount_cents": ' :amount ', "currency": "EUR"}'

BEGIN;

SELECT a.outcome,
       a.outcome = 'acquired' AS acquired,
       coalesce(a.response_status,
                CASE a.outcome WHEN 'in_progress' THEN 409
                               WHEN 'mismatch' THEN 422 END) AS http_status,
       coalesce(a.response_body::text,
                CASE a.outcome
                  WHEN 'in_progress' THEN '{"error": "a request with this key is in progress"}'
                  WHEN 'mismatch' THEN '{"error": "this key was used for another request"}'
                  ELSE 'null' END) AS body
  FROM idempotency.idem_acquire(:'key', :'request'::jsonb, scope => :'scope') AS a
\gset

\if :acquired
    -- The operation itself, in the claim's transaction.
    INSERT INTO payments (idempotency_key, user_id, amount_cents, currency)
    VALUES (:'key', :user_id, :amount, 'EUR')
    RETURNING 201 AS http_status,
              jsonb_build_object('payment_id', id, 'amount_cents', amount_cents,
                                 'currency', currency, 'status', 'succeeded')::text AS body
    \gset
    SELECT idempotency.idem_complete(:'key', :http_status, :'body'::jsonb,
                                     scope => :'scope') AS completed
    \gset
\endif

COMMIT;

SELECT :'outcome', :http_status, :'body';
