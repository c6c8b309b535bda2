--
-- 03_complete_release: idem_complete (true, then false; P0002; the attempt
-- check and its 55000) and idem_release.
--
SET idempotency.wait_timeout = '100ms';
\set VERBOSITY sqlstate

-- Claims whose lease runs out during the sleep below.
SELECT outcome, attempt FROM idempotency.idem_acquire('c-4', '{"a": 1}', lease => '1 second');
SELECT outcome, attempt FROM idempotency.idem_acquire('r-3', '{"a": 1}', lease => '1 second');
SELECT outcome, attempt FROM idempotency.idem_acquire('r-4', '{"a": 1}', lease => '1 second');
SELECT pg_sleep(1.1);

-- complete twice: true, then false, and the first response stays.
SELECT outcome, attempt FROM idempotency.idem_acquire('c-1', '{"a": 1}');
SELECT idempotency.idem_complete('c-1', 201, '{"id": 1}');
SELECT idempotency.idem_complete('c-1', 500, '{"error": "other"}');
SELECT status, response_status, response_body, attempt, completed_at IS NOT NULL AS has_completed_at
  FROM idempotency.idem_lookup('c-1');
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('c-1', '{"a": 1}');

-- no live record: P0002
SELECT idempotency.idem_complete('c-none', 200, '{}');

-- a NULL body is stored as NULL
SELECT outcome FROM idempotency.idem_acquire('c-2');
SELECT idempotency.idem_complete('c-2', 204);
SELECT outcome, response_status, response_body FROM idempotency.idem_acquire('c-2');

-- a failed operation is completed with its error, and replayed as such
SELECT outcome FROM idempotency.idem_acquire('c-3', '{"card": "4000"}');
SELECT idempotency.idem_complete('c-3', 402, '{"error": "card declined"}');
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('c-3', '{"card": "4000"}');

-- attempt: the lease of c-4 ran out and the claim was taken over.
SELECT outcome, attempt FROM idempotency.idem_acquire('c-4', '{"a": 1}');	-- acquired, 2
SELECT idempotency.idem_complete('c-4', 200, '{"by": 1}', attempt => 1);	-- 55000
SELECT idempotency.idem_complete('c-4', 200, '{"by": 3}', attempt => 3);	-- 55000
SELECT status, attempt, response_status FROM idempotency.idem_lookup('c-4');	-- unchanged
SELECT idempotency.idem_complete('c-4', 201, '{"by": 2}', attempt => 2);	-- true
SELECT idempotency.idem_complete('c-4', 200, '{"by": 1}', attempt => 1);	-- 55000: checked before the completed case
SELECT idempotency.idem_complete('c-4', 200, '{"by": 2}', attempt => 2);	-- false
SELECT idempotency.idem_complete('c-4', 200, '{"by": 0}');			-- false
SELECT status, attempt, response_status, response_body FROM idempotency.idem_lookup('c-4');

-- attempt given without a takeover
SELECT outcome, attempt FROM idempotency.idem_acquire('c-5');
SELECT idempotency.idem_complete('c-5', 200, attempt => 2);	-- 55000
SELECT idempotency.idem_complete('c-5', 200, attempt => 1);	-- true

-- release: true, then false; the next acquire gets attempt 1 and no mismatch.
SELECT outcome, attempt FROM idempotency.idem_acquire('r-1', '{"a": 1}');
SELECT idempotency.idem_release('r-1');
SELECT idempotency.idem_release('r-1');
SELECT pg_catalog.count(*) AS live_records FROM idempotency.idem_lookup('r-1');
SELECT outcome, response_status, response_body, attempt
  FROM idempotency.idem_acquire('r-1', '{"a": 2}');
-- a completed record is never released
SELECT idempotency.idem_complete('r-1', 201, '{"r": 1}');
SELECT idempotency.idem_release('r-1');
SELECT status, response_status, response_body FROM idempotency.idem_lookup('r-1');
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('r-1', '{"a": 2}');
-- no record at all
SELECT idempotency.idem_release('r-none');
SELECT idempotency.idem_release('r-none', attempt => 1);

-- release inside the claiming transaction
BEGIN;
SELECT outcome, attempt FROM idempotency.idem_acquire('r-2', '{"a": 1}');
SELECT idempotency.idem_release('r-2');
SELECT outcome, attempt FROM idempotency.idem_acquire('r-2', '{"a": 2}');
COMMIT;
SELECT status, attempt FROM idempotency.idem_lookup('r-2');

-- release with attempt: r-3 was taken over (attempt 2); the old attempt
-- cannot release it, the current one can, and the next claim is attempt 1.
SELECT outcome, attempt FROM idempotency.idem_acquire('r-3', '{"a": 1}');	-- acquired, 2
SELECT idempotency.idem_release('r-3', attempt => 1);	-- 55000
SELECT status, attempt FROM idempotency.idem_lookup('r-3');
SELECT idempotency.idem_release('r-3', attempt => 2);	-- true
SELECT outcome, attempt FROM idempotency.idem_acquire('r-3', '{"a": 1}');	-- acquired, 1

-- a completed record with a stale attempt: 55000, as in idem_complete
SELECT outcome, attempt FROM idempotency.idem_acquire('r-4', '{"a": 1}');	-- acquired, 2
SELECT idempotency.idem_complete('r-4', 200, attempt => 2);
SELECT idempotency.idem_release('r-4', attempt => 1);	-- 55000
SELECT idempotency.idem_release('r-4', attempt => 2);	-- false
SELECT status, attempt, response_status FROM idempotency.idem_lookup('r-4');
