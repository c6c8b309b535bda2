--
-- 01_outcomes: every outcome of idem_acquire (acquired, replay, in_progress,
-- mismatch), from a single session.
--
SET idempotency.wait_timeout = '100ms';

-- acquired: no live record.  Response columns NULL, attempt 1,
-- expires_at = server clock + default ttl (24h).
SELECT outcome, response_status, response_body, attempt,
       expires_at - now() BETWEEN interval '23 hours 59 minutes'
                              AND interval '24 hours 1 minute' AS expires_in_24h
  FROM idempotency.idem_acquire('o-1', '{"amount": 100}');

SELECT idempotency.idem_complete('o-1', 201, '{"id": 1, "status": "paid"}');

-- replay: the stored status and body, as stored.
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('o-1', '{"amount": 100}');
-- a NULL request is no payload check: still a replay
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('o-1');

-- mismatch: same key, other request.  Response columns NULL.
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('o-1', '{"amount": 200}');
-- nothing changed
SELECT status, response_status, response_body, attempt
  FROM idempotency.idem_lookup('o-1');

-- Inside one transaction: the claim is visible to its own transaction.
BEGIN;
SELECT outcome, response_status, response_body, attempt
  FROM idempotency.idem_acquire('o-2', '{"a": 1}');
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('o-2', '{"a": 1}');	-- in_progress
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('o-2', '{"a": 2}');	-- mismatch
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('o-2');			-- in_progress
SELECT idempotency.idem_complete('o-2', 200, '{"ok": true}');
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('o-2', '{"a": 1}');	-- replay
COMMIT;
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('o-2', '{"a": 1}');	-- replay after commit

-- A rollback leaves no claim.
BEGIN;
SELECT outcome, attempt FROM idempotency.idem_acquire('o-3', '{"a": 1}');
ROLLBACK;
SELECT pg_catalog.count(*) AS live_records FROM idempotency.idem_lookup('o-3');
SELECT outcome, attempt FROM idempotency.idem_acquire('o-3', '{"a": 2}');

-- Across transactions: the committed claim is processing, protected by its
-- lease; a duplicate waits up to wait_timeout, then gets in_progress.
SELECT outcome, attempt
  FROM idempotency.idem_acquire('o-4', '{"a": 1}', lease => '1 hour');
SELECT status, attempt, locked_until > now() AS locked, completed_at IS NULL AS not_completed
  FROM idempotency.idem_lookup('o-4');
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('o-4', '{"a": 1}');	-- in_progress
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('o-4', '{"a": 2}');	-- mismatch, at once
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('o-4');			-- in_progress (NULL request)

-- wait_timeout is honoured: it waits about that long, or not at all with 0.
SET idempotency.wait_timeout = '300ms';
SELECT clock_timestamp() AS t0 \gset
SELECT outcome FROM idempotency.idem_acquire('o-4', '{"a": 1}');
SELECT clock_timestamp() - :'t0'::timestamptz BETWEEN interval '250 ms' AND interval '3 s' AS waited_300ms;
SET idempotency.wait_timeout = 0;
SELECT clock_timestamp() AS t0 \gset
SELECT outcome FROM idempotency.idem_acquire('o-4', '{"a": 1}');
SELECT clock_timestamp() - :'t0'::timestamptz < interval '250 ms' AS did_not_wait;
SET idempotency.wait_timeout = '100ms';
-- still attempt 1, still processing: none of the duplicates changed it
SELECT status, attempt FROM idempotency.idem_lookup('o-4');

-- Lease run out: the next acquire takes the claim over with attempt + 1,
-- keeping the record's expires_at (set when it was first claimed).
SELECT outcome, attempt
  FROM idempotency.idem_acquire('o-5', '{"a": 1}', lease => '1 second');
SELECT expires_at AS o5_expires_at FROM idempotency.idem_lookup('o-5') \gset
SELECT pg_sleep(1.1);
SELECT outcome, response_status, response_body, attempt,
       expires_at = :'o5_expires_at'::timestamptz AS same_expires_at
  FROM idempotency.idem_acquire('o-5', '{"a": 1}');
SELECT status, attempt, expires_at = :'o5_expires_at'::timestamptz AS same_expires_at
  FROM idempotency.idem_lookup('o-5');
-- the new claim has a fresh lease (default 60s): a duplicate is in_progress
SELECT outcome FROM idempotency.idem_acquire('o-5', '{"a": 1}');
SELECT idempotency.idem_complete('o-5', 201, '{"attempt": 2}', attempt => 2);
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('o-5', '{"a": 1}');	-- replay
