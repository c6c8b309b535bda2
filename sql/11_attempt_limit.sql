--
-- 11_attempt_limit: a processing claim at attempt 2147483647, the largest
-- value of type integer, whose lease ran out cannot be taken over: there is
-- no next attempt.  idem_acquire raises 22003 (numeric_value_out_of_range)
-- and leaves the record as it is; no attempt is ever below 1.  Everything
-- else about such a record works as for any other.
--
SET idempotency.wait_timeout = 0;

-- A role with the grants of the README can write the table; here the
-- superuser does.
SELECT outcome, attempt FROM idempotency.idem_acquire('max-attempt', '{"a": 1}', lease => '1 hour');
UPDATE idempotency.records
   SET attempt = 2147483647, locked_until = clock_timestamp() - interval '1 second'
 WHERE scope = '' AND key = 'max-attempt';
SELECT public.records_fingerprint() AS before_fingerprint \gset
-- the lease has run out, but there is no next attempt: 22003, with why
SELECT * FROM idempotency.idem_acquire('max-attempt', '{"a": 1}');
SELECT public.sqlstate_of($$SELECT * FROM idempotency.idem_acquire('max-attempt', '{"a": 1}')$$) AS takeover,
       public.sqlstate_of($$SELECT * FROM idempotency.idem_acquire('max-attempt', '{"a": 1}', lease => '1 second')$$) AS takeover_short_lease;
-- the record stays as it was, and no attempt is ever below 1
SELECT public.records_fingerprint() = :'before_fingerprint' AS unchanged;
SELECT status, attempt FROM idempotency.idem_lookup('max-attempt');
SELECT count(*) AS below_one FROM idempotency.records WHERE attempt < 1;
-- a different request is still a mismatch, and the holder can release it
SELECT outcome, attempt FROM idempotency.idem_acquire('max-attempt', '{"a": 2}');
SELECT idempotency.idem_release('max-attempt', attempt => 2147483647);
-- released: the next claim starts again at attempt 1
SELECT outcome, attempt FROM idempotency.idem_acquire('max-attempt', '{"a": 1}');
-- with its lease still running it is in_progress, as any claim
UPDATE idempotency.records
   SET attempt = 2147483647, locked_until = clock_timestamp() + interval '1 hour'
 WHERE scope = '' AND key = 'max-attempt';
SELECT outcome, attempt FROM idempotency.idem_acquire('max-attempt', '{"a": 1}');
SELECT idempotency.idem_complete('max-attempt', 201, '{"done": true}', attempt => 2147483647);
SELECT outcome, response_status, response_body, attempt
  FROM idempotency.idem_acquire('max-attempt', '{"a": 1}');
