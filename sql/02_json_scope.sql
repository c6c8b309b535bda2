--
-- 02_json_scope: the request check (JSON key order and white space do not
-- matter, NULL never mismatches) and scope isolation.
--
SET idempotency.wait_timeout = '100ms';

-- Key order and white space: jsonb's canonical text is hashed.
SELECT outcome, attempt FROM idempotency.idem_acquire('j-1', '{"b": 2, "a": 1}');
SELECT idempotency.idem_complete('j-1', 201, '{"n": 1}');
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('j-1', '{"a":1,"b":2}');
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('j-1', E'{\n\t"a" :  1 ,\n   "b":2\n}');
-- duplicate keys: jsonb keeps the last one, so this is the same request
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('j-1', '{"a": 0, "b": 2, "a": 1}');

-- nested objects too
SELECT outcome, attempt
  FROM idempotency.idem_acquire('j-2', '{"x": {"d": [1, 2], "c": null}, "y": "z"}');
SELECT idempotency.idem_complete('j-2', 200, '{"n": 2}');
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('j-2', '{ "y":"z",  "x":{ "c":null,"d":[ 1,2 ] } }');
-- but array order, values and types do matter
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('j-2', '{"x": {"d": [2, 1], "c": null}, "y": "z"}');
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('j-2', '{"x": {"d": [1, 2], "c": null}, "y": "Z"}');
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('j-2', '{"x": {"d": ["1", 2], "c": null}, "y": "z"}');

-- NULL request never mismatches, whichever side is NULL.
SELECT outcome, attempt FROM idempotency.idem_acquire('j-3');	-- claimed without a request
SELECT request_hash IS NULL AS no_hash FROM idempotency.idem_lookup('j-3');
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('j-3', '{"any": "thing"}');	-- in_progress, not mismatch
SELECT idempotency.idem_complete('j-3', 204);
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('j-3', '{"any": "thing"}');	-- replay
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('j-3');				-- replay
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('j-1');				-- replay (stored side has a hash)
-- but JSON null is a request like any other
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('j-1', 'null');			-- mismatch

-- Scope isolation: equal keys in different scopes never meet.
SELECT outcome, attempt
  FROM idempotency.idem_acquire('s-1', '{"amount": 1}', scope => 'user:1/payments');
SELECT outcome, attempt
  FROM idempotency.idem_acquire('s-1', '{"amount": 2}', scope => 'user:2/payments');
SELECT outcome, attempt
  FROM idempotency.idem_acquire('s-1', '{"amount": 3}');		-- default scope ''
SELECT outcome, attempt
  FROM idempotency.idem_acquire('s-1', '{"amount": 4}', scope => 'User:1/payments');	-- bytes, not case-folded
SELECT outcome, attempt
  FROM idempotency.idem_acquire('S-1', '{"amount": 5}', scope => 'user:1/payments');	-- key too
SELECT idempotency.idem_complete('s-1', 201, '{"user": 1}', scope => 'user:1/payments');
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('s-1', '{"amount": 1}', scope => 'user:1/payments');	-- replay
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('s-1', '{"amount": 2}', scope => 'user:2/payments');	-- in_progress
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('s-1', '{"amount": 3}', scope => '');			-- in_progress
SELECT 'user:1/payments' AS scope, status, response_status FROM idempotency.idem_lookup('s-1', 'user:1/payments')
UNION ALL
SELECT 'user:2/payments', status, response_status FROM idempotency.idem_lookup('s-1', 'user:2/payments')
UNION ALL
SELECT '', status, response_status FROM idempotency.idem_lookup('s-1')
UNION ALL
SELECT 'user:3/payments', status, response_status FROM idempotency.idem_lookup('s-1', 'user:3/payments');
-- complete and release act on their own scope only
\set VERBOSITY sqlstate
SELECT idempotency.idem_complete('s-1', 200, scope => 'user:3/payments');	-- P0002
\set VERBOSITY default
SELECT idempotency.idem_release('s-1', scope => 'user:3/payments');		-- false
SELECT idempotency.idem_release('s-1', scope => 'user:2/payments');		-- true
SELECT idempotency.idem_complete('s-1', 202, '{"user": 0}');			-- default scope
SELECT 'user:1/payments' AS scope, status, response_status, response_body FROM idempotency.idem_lookup('s-1', 'user:1/payments')
UNION ALL
SELECT 'user:2/payments', status, response_status, response_body FROM idempotency.idem_lookup('s-1', 'user:2/payments')
UNION ALL
SELECT '', status, response_status, response_body FROM idempotency.idem_lookup('s-1', '');
