--
-- 06_bad_input: every row of the contract's bad-input table, for every
-- function that takes that parameter, whatever state the record is in
-- (none, processing, completed), with its SQLSTATE; and nothing written.
--
SET idempotency.wait_timeout = '100ms';
SET idempotency.max_response_bytes = '1kB';

-- the states: b-proc is processing (committed, long lease), b-done completed
SELECT outcome FROM idempotency.idem_acquire('b-proc', '{"a": 1}', lease => '1 hour');
SELECT outcome FROM idempotency.idem_acquire('b-done', '{"a": 1}');
SELECT idempotency.idem_complete('b-done', 201, '{"ok": true}');

CREATE TEMP TABLE bad_call (n serial, fn text, input text, call text);
-- $K is replaced by b-none, b-proc and b-done in turn
INSERT INTO bad_call (fn, input, call) VALUES
    ('acquire', 'key NULL',           $$SELECT * FROM idempotency.idem_acquire(NULL, '{"a": 1}')$$),
    ('acquire', 'scope NULL',         $$SELECT * FROM idempotency.idem_acquire('$K', '{"a": 1}', scope => NULL)$$),
    ('acquire', 'key empty',          $$SELECT * FROM idempotency.idem_acquire('', '{"a": 1}')$$),
    ('acquire', 'key 256 bytes',      $$SELECT * FROM idempotency.idem_acquire(repeat('k', 256), '{"a": 1}')$$),
    ('acquire', 'scope 256 bytes',    $$SELECT * FROM idempotency.idem_acquire('$K', '{"a": 1}', scope => repeat('s', 256))$$),
    ('acquire', 'ttl 0',              $$SELECT * FROM idempotency.idem_acquire('$K', '{"a": 1}', ttl => '0')$$),
    ('acquire', 'ttl negative',       $$SELECT * FROM idempotency.idem_acquire('$K', '{"a": 1}', ttl => '-1 hour')$$),
    ('acquire', 'ttl > max_ttl',      $$SELECT * FROM idempotency.idem_acquire('$K', '{"a": 1}', ttl => '7 days 1 second')$$),
    ('acquire', 'ttl 1 month',        $$SELECT * FROM idempotency.idem_acquire('$K', '{"a": 1}', ttl => '1 month')$$),
    ('acquire', 'lease 0',            $$SELECT * FROM idempotency.idem_acquire('$K', '{"a": 1}', lease => '0')$$),
    ('acquire', 'lease negative',     $$SELECT * FROM idempotency.idem_acquire('$K', '{"a": 1}', lease => '-1 second')$$),
    ('acquire', 'lease > ttl',        $$SELECT * FROM idempotency.idem_acquire('$K', '{"a": 1}', ttl => '1 hour', lease => '1 hour 1 second')$$),
    ('acquire', 'lease > default ttl', $$SELECT * FROM idempotency.idem_acquire('$K', '{"a": 1}', lease => '25 hours')$$),
    ('complete', 'key NULL',          $$SELECT idempotency.idem_complete(NULL, 200, '{}')$$),
    ('complete', 'scope NULL',        $$SELECT idempotency.idem_complete('$K', 200, '{}', scope => NULL)$$),
    ('complete', 'status NULL',       $$SELECT idempotency.idem_complete('$K', NULL, '{}')$$),
    ('complete', 'key empty',         $$SELECT idempotency.idem_complete('', 200, '{}')$$),
    ('complete', 'key 256 bytes',     $$SELECT idempotency.idem_complete(repeat('k', 256), 200, '{}')$$),
    ('complete', 'scope 256 bytes',   $$SELECT idempotency.idem_complete('$K', 200, '{}', scope => repeat('s', 256))$$),
    ('complete', 'status 99',         $$SELECT idempotency.idem_complete('$K', 99, '{}')$$),
    ('complete', 'status 600',        $$SELECT idempotency.idem_complete('$K', 600, '{}')$$),
    ('complete', 'status 0',          $$SELECT idempotency.idem_complete('$K', 0, '{}')$$),
    ('complete', 'status -200',       $$SELECT idempotency.idem_complete('$K', -200, '{}')$$),
    ('complete', 'body > 1kB',        $$SELECT idempotency.idem_complete('$K', 200, jsonb_build_object('pad', repeat('x', 2000)))$$),
    ('complete', 'bad status, wrong attempt', $$SELECT idempotency.idem_complete('$K', 600, '{}', attempt => 99)$$),
    ('release', 'key NULL',           $$SELECT idempotency.idem_release(NULL)$$),
    ('release', 'scope NULL',         $$SELECT idempotency.idem_release('$K', NULL)$$),
    ('release', 'key empty',          $$SELECT idempotency.idem_release('')$$),
    ('release', 'key 256 bytes',      $$SELECT idempotency.idem_release(repeat('k', 256))$$),
    ('release', 'scope 256 bytes',    $$SELECT idempotency.idem_release('$K', repeat('s', 256))$$),
    ('lookup', 'key NULL',            $$SELECT * FROM idempotency.idem_lookup(NULL)$$),
    ('lookup', 'scope NULL',          $$SELECT * FROM idempotency.idem_lookup('$K', NULL)$$),
    ('lookup', 'key empty',           $$SELECT * FROM idempotency.idem_lookup('')$$),
    ('lookup', 'key 256 bytes',       $$SELECT * FROM idempotency.idem_lookup(repeat('k', 256))$$),
    ('lookup', 'scope 256 bytes',     $$SELECT * FROM idempotency.idem_lookup('$K', repeat('s', 256))$$);

SELECT public.records_fingerprint() AS before_bad \gset
SELECT fn, input,
       public.sqlstate_of(replace(call, '$K', 'b-none')) AS no_record,
       public.sqlstate_of(replace(call, '$K', 'b-proc')) AS processing,
       public.sqlstate_of(replace(call, '$K', 'b-done')) AS completed
  FROM bad_call
 ORDER BY n;
SELECT public.records_fingerprint() = :'before_bad' AS nothing_written;

-- The same at top level, outside any subtransaction, in one transaction
-- each: the error, then the count of records is unchanged.
SELECT pg_catalog.count(*) AS records_before FROM idempotency.records \gset
\set VERBOSITY sqlstate
SELECT * FROM idempotency.idem_acquire(NULL);
SELECT * FROM idempotency.idem_acquire('b-top', scope => NULL);
SELECT * FROM idempotency.idem_acquire('');
SELECT * FROM idempotency.idem_acquire('b-top', ttl => '8 days');
SELECT * FROM idempotency.idem_acquire('b-top', lease => '0');
SELECT idempotency.idem_complete('b-proc', NULL);
SELECT idempotency.idem_complete('b-proc', 700);
SELECT idempotency.idem_complete('b-proc', 200, jsonb_build_object('pad', repeat('x', 2000)));
SELECT idempotency.idem_complete('b-done', 200, jsonb_build_object('pad', repeat('x', 2000)));
SELECT idempotency.idem_release('b-proc', repeat('s', 300));
SELECT * FROM idempotency.idem_lookup('b-proc', NULL);
\set VERBOSITY default
SELECT pg_catalog.count(*) = :records_before AS count_unchanged FROM idempotency.records;
SELECT public.records_fingerprint() = :'before_bad' AS nothing_written;
-- the records are as they were
SELECT status, attempt, response_status FROM idempotency.idem_lookup('b-proc');
SELECT status, attempt, response_status, response_body FROM idempotency.idem_lookup('b-done');
SELECT pg_catalog.count(*) FROM idempotency.idem_lookup('b-none');
SELECT pg_catalog.count(*) FROM idempotency.idem_lookup('b-top');

-- A bad call inside a transaction that claimed the key: the transaction is
-- aborted, the claim gone.
BEGIN;
SELECT outcome FROM idempotency.idem_acquire('b-tx');
\set VERBOSITY sqlstate
SELECT idempotency.idem_complete('b-tx', 1000);
\set VERBOSITY default
ROLLBACK;
SELECT pg_catalog.count(*) FROM idempotency.idem_lookup('b-tx');

-- The boundaries are accepted.
SELECT outcome, attempt FROM idempotency.idem_acquire(repeat('k', 255), '{"a": 1}');
SELECT status FROM idempotency.idem_lookup(repeat('k', 255));
SELECT idempotency.idem_release(repeat('k', 255));
SELECT outcome, attempt FROM idempotency.idem_acquire('b-edge', '{"a": 1}', scope => repeat('s', 255));
SELECT idempotency.idem_complete('b-edge', 100, scope => repeat('s', 255));
SELECT outcome, attempt FROM idempotency.idem_acquire('b-edge', '{"a": 1}', scope => '');
SELECT idempotency.idem_complete('b-edge', 599, '{"max": true}', scope => '');
SELECT outcome, response_status FROM idempotency.idem_acquire('b-edge', scope => repeat('s', 255));
SELECT outcome, response_status FROM idempotency.idem_acquire('b-edge');
SELECT outcome, attempt,
       expires_at - now() BETWEEN interval '6 days 23 hours 59 minutes'
                              AND interval '7 days 1 minute' AS ttl_is_max
  FROM idempotency.idem_acquire('b-maxttl', ttl => '7 days');
SELECT outcome, attempt FROM idempotency.idem_acquire('b-lease', ttl => '1 hour', lease => '1 hour');
SELECT locked_until = expires_at AS lease_equals_ttl FROM idempotency.idem_lookup('b-lease');
-- response_body of exactly max_response_bytes (pg_column_size) is accepted,
-- one byte more is not
SELECT n AS pad_1kb FROM generate_series(900, 1100) n
 WHERE pg_column_size(jsonb_build_object('pad', repeat('x', n))) = 1024 \gset
SELECT pg_column_size(jsonb_build_object('pad', repeat('x', :pad_1kb))) AS size,
       pg_column_size(jsonb_build_object('pad', repeat('x', :pad_1kb + 1))) AS size_plus_1;
SELECT outcome FROM idempotency.idem_acquire('b-body');
SELECT public.sqlstate_of(format($$SELECT idempotency.idem_complete('b-body', 200, jsonb_build_object('pad', repeat('x', %s)))$$, :pad_1kb + 1)) AS one_byte_more;
SELECT idempotency.idem_complete('b-body', 200, jsonb_build_object('pad', repeat('x', :pad_1kb)));
SELECT pg_column_size(response_body) AS stored_size FROM idempotency.idem_lookup('b-body');
-- and the default limit is 1MB
RESET idempotency.max_response_bytes;
SELECT outcome FROM idempotency.idem_acquire('b-body-2');
SELECT public.sqlstate_of($$SELECT idempotency.idem_complete('b-body-2', 200, jsonb_build_object('pad', repeat('x', 1048576)))$$) AS over_1mb;
SELECT idempotency.idem_complete('b-body-2', 200, jsonb_build_object('pad', repeat('x', 1000000)));
-- max_ttl is a setting
SET idempotency.max_ttl = '1h';
SELECT public.sqlstate_of($$SELECT * FROM idempotency.idem_acquire('b-ttl', ttl => '1 hour 1 second')$$) AS over_max_ttl;
SELECT outcome FROM idempotency.idem_acquire('b-ttl', ttl => '1 hour');
RESET idempotency.max_ttl;
-- lengths are in bytes, not characters (checked where the database is UTF8)
DO $$
DECLARE
    st text;
BEGIN
    IF pg_catalog.current_setting('server_encoding') = 'UTF8' THEN
        -- 128 two-byte characters: 256 bytes
        st := public.sqlstate_of($q$SELECT * FROM idempotency.idem_acquire(repeat(U&'\00e9', 128))$q$);
        IF st <> '22023' THEN
            RAISE EXCEPTION 'key of 128 two-byte characters: got %, want 22023', st;
        END IF;
        st := public.sqlstate_of($q$SELECT * FROM idempotency.idem_acquire('b-mb', scope => repeat(U&'\00e9', 128))$q$);
        IF st <> '22023' THEN
            RAISE EXCEPTION 'scope of 128 two-byte characters: got %, want 22023', st;
        END IF;
        st := public.sqlstate_of($q$SELECT * FROM idempotency.idem_acquire(repeat(U&'\00e9', 127) || 'k')$q$);
        IF st <> 'ok' THEN
            RAISE EXCEPTION 'key of 255 bytes in 128 characters: got %, want ok', st;
        END IF;
    END IF;
END
$$;
