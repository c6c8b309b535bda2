-- demo/lease_retry.sql: the client retries the same request (same key, same
-- request), waiting at most 200 ms on a claim that is still running.
-- psql variables: key, request.
-- Prints: outcome|attempt|HTTP status|milliseconds spent in idem_acquire

SET idempotency.wait_timeout = '200ms';
SELECT clock_timestamp() AS t0
\gset
SELECT a.outcome, a.attempt,
       coalesce(a.response_status,
                CASE a.outcome WHEN 'in_progress' THEN 409
                               WHEN 'mismatch' THEN 422 END),
       round(1000 * extract(epoch FROM clock_timestamp() - :'t0'::timestamptz))
  FROM idempotency.idem_acquire(:'key', :'request'::jsonb, lease => '2 seconds') AS a;
