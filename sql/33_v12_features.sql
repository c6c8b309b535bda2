--
-- 33_v12_features: the 1.2 contract.  idem_checkpoint (fenced, in the
-- caller's transaction, answered by a takeover and shown by idem_lookup);
-- response_headers (stored in lower case, replayed, counted against
-- max_response_bytes); idem_forget (any state, never a token, for the
-- owner and an EXECUTE grantee without table privileges, counted);
-- trace / origin_trace.  Every error with its SQLSTATE, nothing written.
-- (Concurrent forgets: specs/33_forget.spec; takeover after a crash:
-- t/022_resume.pl.)
--
SET idempotency.wait_timeout = 0;

-- Checkpoints: a new key has none; the holder records one with its claim;
-- it is not a heartbeat (locked_until unchanged); lookup shows it.
SELECT outcome, attempt, phase, state, response_headers, origin_trace
  FROM idempotency.idem_acquire('v-pay', '{"amount": 10}', lease => '1 hour', trace => 'tp-first');
SELECT claim AS vpay_claim FROM idempotency.records WHERE key = 'v-pay' \gset
SELECT locked_until AS lease_end FROM idempotency.idem_lookup('v-pay') \gset
SELECT idempotency.idem_checkpoint('v-pay', claim => :'vpay_claim', phase => 'charged', state => '{"charge": "ch_1"}') = :'lease_end'::timestamptz AS lease_unchanged;
SELECT status, phase, state, origin_trace FROM idempotency.idem_lookup('v-pay');

-- In the caller's transaction: rolled back with it, kept when it commits.
BEGIN;
SELECT idempotency.idem_checkpoint('v-pay', claim => :'vpay_claim', phase => 'refunded', state => '{"refund": "re_1"}') IS NOT NULL AS checkpointed;
SELECT phase FROM idempotency.idem_lookup('v-pay');
ROLLBACK;
SELECT phase, state FROM idempotency.idem_lookup('v-pay');

-- Only the holder's claim: a claim that is not the record's gets 55000.
SELECT claim AS pay_claim FROM idempotency.idem_acquire('v-own', lease => '1 hour') \gset
SELECT idempotency.idem_checkpoint('v-own', '', :'pay_claim', 'step-1') IS NOT NULL AS with_claim;
SELECT public.records_fingerprint() AS before \gset
SELECT public.sqlstate_of($$SELECT idempotency.idem_checkpoint('v-own', '', gen_random_uuid(), 'step-2')$$) AS other_claim;

-- The claim is required (issue 36): without one (NULL, the default) 22004,
-- and the holder's checkpoint stays as it was, so that the next takeover
-- is not told a step that was not the holder's.
SELECT public.sqlstate_of($$SELECT idempotency.idem_checkpoint('v-own', '', NULL, 'started')$$) AS null_claim,
       public.sqlstate_of($$SELECT idempotency.idem_checkpoint('v-own', phase => 'started', state => '{}')$$) AS no_claim;
SELECT idempotency.idem_checkpoint('v-own', phase => 'started');
SELECT public.records_fingerprint() = :'before' AS nothing_written;
SELECT status, phase, state FROM idempotency.idem_lookup('v-own');

-- Duplicates see no checkpoint: in_progress, mismatch (and a replay below).
SELECT outcome, phase, state, origin_trace FROM idempotency.idem_acquire('v-pay', '{"amount": 10}', trace => 'tp-dup');
SELECT outcome, phase, state, origin_trace FROM idempotency.idem_acquire('v-pay', '{"amount": 99}', trace => 'tp-other');

-- A takeover answers the last checkpoint, stores its own trace, and keeps
-- the checkpoint for the takeover after it (which answers it again).
SELECT outcome FROM idempotency.idem_acquire('v-resume', '{"amount": 5}', lease => '1 millisecond', trace => 'tp-a');
SELECT claim AS resume_claim FROM idempotency.records WHERE key = 'v-resume' \gset
SELECT idempotency.idem_checkpoint('v-resume', claim => :'resume_claim', phase => 'charged', state => '{"charge": "ch_9"}') IS NOT NULL AS checkpointed;
SELECT pg_sleep(0.01);
SELECT * FROM idempotency.stale_claims WHERE key = 'v-resume' AND false;
SELECT key, attempt, reason, origin_trace FROM idempotency.stale_claims WHERE key = 'v-resume';
SELECT outcome, attempt, phase, state, origin_trace
  FROM idempotency.idem_acquire('v-resume', '{"amount": 5}', lease => '1 millisecond', trace => 'tp-b');
SELECT origin_trace FROM idempotency.idem_lookup('v-resume');
SELECT pg_sleep(0.01);
SELECT outcome, attempt, phase, state FROM idempotency.idem_acquire('v-resume', '{"amount": 5}', lease => '1 hour');
SELECT origin_trace IS NULL AS takeover_without_trace FROM idempotency.idem_lookup('v-resume');
-- A takeover of a claim that made no checkpoint answers NULL.
SELECT outcome FROM idempotency.idem_acquire('v-plain', lease => '1 millisecond');
SELECT pg_sleep(0.01);
SELECT outcome, attempt, phase, state FROM idempotency.idem_acquire('v-plain');

-- Completing keeps the checkpoint (lookup shows it); a completed record
-- takes no checkpoint (P0002), nor does a key without a record.
SELECT idempotency.idem_complete('v-resume', 201, '{"id": 9}');
SELECT status, phase, state FROM idempotency.idem_lookup('v-resume');
SELECT public.records_fingerprint() AS before \gset
SELECT public.sqlstate_of($$SELECT idempotency.idem_checkpoint('v-resume',
    claim => (SELECT claim FROM idempotency.records WHERE key = 'v-resume'), phase => 'again')$$) AS completed;
SELECT public.sqlstate_of($$SELECT idempotency.idem_checkpoint('v-none', claim => gen_random_uuid(), phase => 'x')$$) AS no_record;

-- Bad input: NULL key or scope 22004; phase NULL, empty or over 255 bytes
-- 22023; state over max_response_bytes 54000.  Nothing written.
SELECT public.sqlstate_of($$SELECT idempotency.idem_checkpoint(NULL, claim => gen_random_uuid(), phase => 'x')$$) AS null_key,
       public.sqlstate_of($$SELECT idempotency.idem_checkpoint('v-own', NULL, gen_random_uuid(), phase => 'x')$$) AS null_scope,
       public.sqlstate_of($$SELECT idempotency.idem_checkpoint('v-own', claim => gen_random_uuid())$$) AS null_phase,
       public.sqlstate_of($$SELECT idempotency.idem_checkpoint('v-own', claim => gen_random_uuid(), phase => '')$$) AS empty_phase,
       public.sqlstate_of($$SELECT idempotency.idem_checkpoint('v-own', claim => gen_random_uuid(), phase => repeat('p', 256))$$) AS long_phase;
SET idempotency.max_response_bytes = 100;
SELECT public.sqlstate_of($$SELECT idempotency.idem_checkpoint('v-own', claim => gen_random_uuid(), phase => 'x',
    state => pg_catalog.jsonb_build_object('s', repeat('x', 200)))$$) AS large_state;
RESET idempotency.max_response_bytes;
SELECT public.records_fingerprint() = :'before' AS nothing_written;
SELECT idempotency.idem_checkpoint('v-own', claim => :'pay_claim', phase => repeat('p', 255)) IS NOT NULL AS phase_255;
SELECT phase = repeat('p', 255) AS phase_255_stored, state FROM idempotency.idem_lookup('v-own');

-- Replayed headers: stored with names in lower case, replayed with replay
-- only, shown by lookup.
SELECT outcome FROM idempotency.idem_acquire('v-created', '{"item": 1}', trace => 'tp-create');
SELECT idempotency.idem_complete('v-created', 201, '{"id": 7}',
    response_headers => '{"Location": "/orders/7", "ETag": "\"v1\"", "Content-Type": "application/json"}');
SELECT outcome, response_status, response_headers, phase, origin_trace
  FROM idempotency.idem_acquire('v-created', '{"item": 1}', trace => 'tp-retry');
SELECT outcome, response_headers, origin_trace FROM idempotency.idem_acquire('v-created', '{"item": 2}');
SELECT response_headers FROM idempotency.idem_lookup('v-created');
-- without headers: NULL, as before
SELECT outcome FROM idempotency.idem_acquire('v-plain-done');
SELECT idempotency.idem_complete('v-plain-done', 204);
SELECT outcome, response_headers, origin_trace FROM idempotency.idem_acquire('v-plain-done');
-- Accepted (issue 36): every character of an RFC 9110 token, names in
-- mixed case stored in lower case, a value with a tab or empty, and 64
-- headers.
SELECT outcome FROM idempotency.idem_acquire('v-case');
SELECT idempotency.idem_complete('v-case', 200, response_headers =>
    '{"X-Az09!#$%&''*+-.^_`|~": "v", "Content-TYPE": "text/plain;\tcharset=utf-8", "x-EMPTY": ""}');
SELECT response_headers FROM idempotency.idem_lookup('v-case');
SELECT outcome FROM idempotency.idem_acquire('v-64-headers');
SELECT idempotency.idem_complete('v-64-headers', 200, response_headers =>
    (SELECT pg_catalog.jsonb_object_agg('X-Header-' || i, 'value ' || i) FROM pg_catalog.generate_series(1, 64) i));
SELECT pg_catalog.count(*) AS stored, pg_catalog.bool_and(name = pg_catalog.lower(name)) AS lower_case
  FROM idempotency.idem_lookup('v-64-headers'), pg_catalog.jsonb_object_keys(response_headers) name;
SELECT outcome, pg_catalog.jsonb_typeof(response_headers) AS replayed FROM idempotency.idem_acquire('v-64-headers');

-- Bad headers: not an object, a value that is not a string 22023; with the
-- body over max_response_bytes 54000.  Nothing written.
SELECT outcome FROM idempotency.idem_acquire('v-bad-headers');
SELECT public.records_fingerprint() AS before \gset
SELECT public.sqlstate_of($$SELECT idempotency.idem_complete('v-bad-headers', 200, response_headers => '["Location"]')$$) AS array_headers,
       public.sqlstate_of($$SELECT idempotency.idem_complete('v-bad-headers', 200, response_headers => '"Location"')$$) AS scalar_headers,
       public.sqlstate_of($$SELECT idempotency.idem_complete('v-bad-headers', 200, response_headers => '{"Retry-After": 5}')$$) AS number_value,
       public.sqlstate_of($$SELECT idempotency.idem_complete('v-bad-headers', 200, response_headers => '{"X": {"a": "b"}}')$$) AS object_value,
       public.sqlstate_of($$SELECT idempotency.idem_complete('v-bad-headers', 200, response_headers => '{"X": null}')$$) AS null_value;
SET idempotency.max_response_bytes = 100;
SELECT public.sqlstate_of($$SELECT idempotency.idem_complete('v-bad-headers', 200, '{"body": "0123456789012345678901234567890123456789"}',
    response_headers => '{"location": "/0123456789012345678901234567890123456789"}')$$) AS body_and_headers_too_large;
SELECT public.sqlstate_of($$SELECT idempotency.idem_complete('v-bad-headers', 200, '{"body": "0123456789012345678901234567890123456789"}')$$) AS body_alone_fits;
RESET idempotency.max_response_bytes;
SELECT status FROM idempotency.idem_lookup('v-bad-headers');

-- Header injection (issue 36): a name that is not an HTTP field name (an
-- RFC 9110 token: empty, with a space, a colon, a CR or LF, a slash, a
-- non-ASCII letter), two names equal after lower-casing, a value with a
-- CR or LF, more than 64 headers: 22023, nothing stored, the claim still
-- processing.  (A NUL never gets this far: jsonb refuses \u0000, 22P05.)
SELECT outcome FROM idempotency.idem_acquire('v-inject');
SELECT public.records_fingerprint() AS before \gset
SELECT public.sqlstate_of($$SELECT idempotency.idem_complete('v-inject', 200, response_headers => '{"": "x"}')$$) AS empty_name,
       public.sqlstate_of($$SELECT idempotency.idem_complete('v-inject', 200, response_headers => '{"X Header": "x"}')$$) AS space_in_name,
       public.sqlstate_of($$SELECT idempotency.idem_complete('v-inject', 200, response_headers => '{"Location:": "/a"}')$$) AS colon_in_name,
       public.sqlstate_of($$SELECT idempotency.idem_complete('v-inject', 200, response_headers => '{"X-A\r\nSet-Cookie": "s=1"}')$$) AS crlf_in_name,
       public.sqlstate_of($$SELECT idempotency.idem_complete('v-inject', 200, response_headers => '{"X/Y": "x"}')$$) AS slash_in_name,
       public.sqlstate_of($$SELECT idempotency.idem_complete('v-inject', 200, response_headers => '{"Ünicode": "x"}')$$) AS non_ascii_name;
SELECT public.sqlstate_of($$SELECT idempotency.idem_complete('v-inject', 200, response_headers => '{"Location": "/a\rSet-Cookie: s=1"}')$$) AS cr_in_value,
       public.sqlstate_of($$SELECT idempotency.idem_complete('v-inject', 200, response_headers => '{"Location": "/a\nSet-Cookie: s=1"}')$$) AS lf_in_value,
       public.sqlstate_of($$SELECT idempotency.idem_complete('v-inject', 200, response_headers => '{"Location": "/a\r\n"}')$$) AS crlf_at_end,
       public.sqlstate_of($$SELECT idempotency.idem_complete('v-inject', 200, response_headers => '{"X": "a\u0000b"}')$$) AS nul_in_value;
SELECT public.sqlstate_of($$SELECT idempotency.idem_complete('v-inject', 200, response_headers => '{"ETag": "\"a\"", "etag": "\"b\""}')$$) AS etag_twice,
       public.sqlstate_of($$SELECT idempotency.idem_complete('v-inject', 200, response_headers => '{"A": "1", "B": "2", "Z": "3", "b": "4"}')$$) AS b_twice,
       public.sqlstate_of($$SELECT idempotency.idem_complete('v-inject', 200, response_headers =>
           (SELECT pg_catalog.jsonb_object_agg('X-Header-' || i, 'value ' || i) FROM pg_catalog.generate_series(1, 65) i))$$) AS headers_65;
-- what each says
SELECT idempotency.idem_complete('v-inject', 200, response_headers => '{"Location": "/a", "X Header": "x"}');
SELECT idempotency.idem_complete('v-inject', 200, response_headers => '{"Location": "/a\r\nSet-Cookie: s=1"}');
SELECT idempotency.idem_complete('v-inject', 200, response_headers => '{"ETag": "\"a\"", "etag": "\"b\""}');
SELECT idempotency.idem_complete('v-inject', 200, response_headers =>
    (SELECT pg_catalog.jsonb_object_agg('X-Header-' || i, 'value ' || i) FROM pg_catalog.generate_series(1, 65) i));
SELECT public.records_fingerprint() = :'before' AS nothing_written;
SELECT status, response_status, response_headers FROM idempotency.idem_lookup('v-inject');

-- A key or scope over 255 bytes: 22023, with a hint that says what to do.
SELECT outcome FROM idempotency.idem_acquire(repeat('k', 256));
SELECT outcome FROM idempotency.idem_acquire('v-long-scope', scope => repeat('s', 256));

-- Traces: over 255 bytes 22023, nothing written; exactly 255 stored.
SELECT public.records_fingerprint() AS before \gset
SELECT public.sqlstate_of($$SELECT idempotency.idem_acquire('v-trace', trace => repeat('t', 256))$$) AS long_trace;
SELECT public.records_fingerprint() = :'before' AS nothing_written;
SELECT outcome FROM idempotency.idem_acquire('v-trace', trace => repeat('t', 255));
SELECT length(origin_trace) FROM idempotency.idem_acquire('v-trace');

-- idem_forget: a completed record, a processing one, none; the next
-- acquire is attempt 1 with no trace of the old record.  The daily
-- reconciliation counts them too (record_daily() first sets its base).
SELECT pg_catalog.count(*) AS base_recorded FROM idempotency.record_daily();
SELECT pg_catalog.sum(forgotten) AS daily_before FROM idempotency.daily
 WHERE datname OPERATOR(pg_catalog.=) pg_catalog.current_database() \gset
SELECT forgotten AS forgotten_before FROM idempotency.stats WHERE datname = pg_catalog.current_database() \gset
SELECT idempotency.idem_forget('v-created') AS completed_forgotten;
SELECT pg_catalog.count(*) AS left_of_it FROM idempotency.idem_lookup('v-created');
SELECT outcome, attempt, response_status, response_headers, origin_trace
  FROM idempotency.idem_acquire('v-created', '{"item": 2}');
SELECT idempotency.idem_forget('v-own') AS processing_forgotten;
SELECT idempotency.idem_forget('v-own') AS again;
SELECT idempotency.idem_forget('v-never') AS never_there;
SELECT forgotten - :forgotten_before AS counted FROM idempotency.stats WHERE datname = pg_catalog.current_database();
SELECT pg_catalog.count(*) AS recorded FROM idempotency.record_daily();
SELECT pg_catalog.sum(forgotten) - :daily_before AS counted_daily FROM idempotency.daily
 WHERE datname OPERATOR(pg_catalog.=) pg_catalog.current_database();
-- rolled back: the record is back
BEGIN;
SELECT idempotency.idem_forget('v-resume') AS forgotten_in_xact;
SELECT outcome FROM idempotency.idem_acquire('v-resume', '{"amount": 5}');
ROLLBACK;
SELECT outcome, response_status FROM idempotency.idem_acquire('v-resume', '{"amount": 5}');
-- a one-time token is never forgotten, whatever its scope and key
SELECT idempotency.idem_token_issue('v-tokens') AS tok \gset
SELECT idempotency.idem_forget(:'tok', 'v-tokens') AS token_forgotten;
SELECT idempotency.idem_token_consume(:'tok', 'v-tokens') AS token_still_live;
-- bad input
SELECT public.sqlstate_of($$SELECT idempotency.idem_forget(NULL)$$) AS null_key,
       public.sqlstate_of($$SELECT idempotency.idem_forget('v-x', NULL)$$) AS null_scope,
       public.sqlstate_of($$SELECT idempotency.idem_forget('')$$) AS empty_key;

-- Who may forget: an operator role with EXECUTE on idem_forget alone (no
-- privilege on the table); an application role with the README's grants
-- and the table, but not idem_forget, may not.
SET client_min_messages = warning;
DROP ROLE IF EXISTS regress_idem_operator;
DROP ROLE IF EXISTS regress_idem_v12_app;
RESET client_min_messages;
CREATE ROLE regress_idem_operator;
CREATE ROLE regress_idem_v12_app;
\set app_role regress_idem_v12_app
\i sql/include/readme_grants.sql
GRANT USAGE ON SCHEMA idempotency TO regress_idem_operator;
GRANT EXECUTE ON FUNCTION idempotency.idem_forget(text, text) TO regress_idem_operator;
SELECT outcome FROM idempotency.idem_acquire('v-op', '{"a": 1}');
SELECT idempotency.idem_complete('v-op', 200);
SET ROLE regress_idem_v12_app;
SELECT public.sqlstate_of($$SELECT idempotency.idem_forget('v-op')$$) AS app_forget;
SELECT claim AS app_claim FROM idempotency.idem_acquire('v-app', lease => '1 hour', trace => 'tp-app') \gset
SELECT idempotency.idem_checkpoint('v-app', claim => :'app_claim', phase => 'step') IS NOT NULL AS app_checkpoint;
SELECT idempotency.idem_complete('v-app', 201, response_headers => '{"Location": "/a"}');
SELECT outcome, response_headers, origin_trace FROM idempotency.idem_acquire('v-app');
SET ROLE regress_idem_operator;
SELECT public.sqlstate_of($$SELECT pg_catalog.count(*) FROM idempotency.records$$) AS operator_select;
SELECT public.sqlstate_of($$SELECT * FROM idempotency.idem_lookup('v-op')$$) AS operator_lookup;
SELECT idempotency.idem_forget('v-op') AS operator_forget;
RESET ROLE;
SELECT outcome, attempt FROM idempotency.idem_acquire('v-op', '{"a": 2}');
REVOKE ALL ON FUNCTION idempotency.idem_forget(text, text) FROM regress_idem_operator;
REVOKE ALL ON SCHEMA idempotency FROM regress_idem_operator;
DROP ROLE regress_idem_operator;
DROP OWNED BY regress_idem_v12_app;
DROP ROLE regress_idem_v12_app;
