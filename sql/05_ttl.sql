--
-- 05_ttl: expiry on the server clock.  An expired record does not exist for
-- any function, even before cleanup removes it.
--
SET idempotency.wait_timeout = '100ms';
\set VERBOSITY sqlstate

SELECT outcome, attempt FROM idempotency.idem_acquire('t-1', '{"a": 1}', ttl => '1 second');
SELECT idempotency.idem_complete('t-1', 201, '{"t": 1}');
SELECT outcome, attempt FROM idempotency.idem_acquire('t-2', '{"a": 1}', ttl => '1 second');
SELECT outcome, attempt FROM idempotency.idem_acquire('t-3', '{"a": 1}', ttl => '1 second');
SELECT outcome, attempt FROM idempotency.idem_acquire('t-keep', '{"a": 1}', ttl => '1 hour');
-- a NULL lease is the default lease (60s) capped at the ttl
SELECT status,
       locked_until <= expires_at AS lease_capped,
       expires_at - created_at BETWEEN interval '0.9 seconds' AND interval '1.1 seconds' AS ttl_1s
  FROM idempotency.idem_lookup('t-2');
-- live for now: replay and in_progress as usual
SELECT outcome, response_status FROM idempotency.idem_acquire('t-1', '{"a": 1}');
SELECT outcome FROM idempotency.idem_acquire('t-2', '{"a": 1}');

SELECT pg_sleep(1.2);

-- expired: no row from idem_lookup
SELECT * FROM idempotency.idem_lookup('t-1');
SELECT * FROM idempotency.idem_lookup('t-2');
SELECT status FROM idempotency.idem_lookup('t-keep');
-- expired: complete finds no live record, release finds no processing record
SELECT idempotency.idem_complete('t-1', 200);	-- P0002
SELECT idempotency.idem_complete('t-2', 200);	-- P0002
SELECT idempotency.idem_release('t-1');		-- false
SELECT idempotency.idem_release('t-2');		-- false
-- expired: acquire gets a fresh claim (attempt 1), whatever the old request
SELECT outcome, response_status, response_body, attempt,
       expires_at - now() > interval '23 hours' AS new_ttl
  FROM idempotency.idem_acquire('t-1', '{"a": 2}');
SELECT outcome, response_status, response_body, attempt
  FROM idempotency.idem_acquire('t-2', '{"a": 1}');
SELECT outcome, response_status, response_body, attempt
  FROM idempotency.idem_acquire('t-3');
SELECT status, attempt, response_status, response_body, completed_at IS NULL AS not_completed,
       expires_at > now() + interval '23 hours' AS new_expiry
  FROM idempotency.idem_lookup('t-1');
SELECT idempotency.idem_complete('t-1', 200, '{"t": 2}');
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('t-1', '{"a": 2}');
-- only one live record per (scope, key) in the table
SELECT key, pg_catalog.count(*) AS live_rows FROM idempotency.records
 WHERE scope = '' AND key IN ('t-1', 't-2', 't-3') AND expires_at > now()
 GROUP BY key ORDER BY key;
