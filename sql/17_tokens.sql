--
-- 17_tokens: one-time tokens.  True exactly once for a live token of its
-- scope; false once consumed, expired, unknown or of another scope; a
-- rolled-back consume leaves the token live; tokens and idempotency keys
-- never see each other; bad input; tokens are long, URL-safe and unique.
--
SET idempotency.wait_timeout = 0;

-- issue, consume, consume again
SELECT idempotency.idem_token_issue('form') AS t1 \gset
SELECT idempotency.idem_token_consume(:'t1', 'form') AS first,
       idempotency.idem_token_consume(:'t1', 'form') AS again;
-- another scope, the default scope, an unknown token
SELECT idempotency.idem_token_issue('form') AS t2 \gset
SELECT idempotency.idem_token_consume(:'t2', 'other') AS other_scope,
       idempotency.idem_token_consume(:'t2') AS default_scope,
       idempotency.idem_token_consume('never-issued', 'form') AS unknown,
       idempotency.idem_token_consume(:'t2', 'form') AS right_scope;
-- the default scope is ''
SELECT idempotency.idem_token_issue() AS t3 \gset
SELECT idempotency.idem_token_consume(:'t3', 'form') AS wrong, idempotency.idem_token_consume(:'t3') AS right;

-- expired: false, as if it never existed
SELECT idempotency.idem_token_issue('form', ttl => '10 milliseconds') AS t4 \gset
SELECT pg_catalog.pg_sleep(0.02);
SELECT idempotency.idem_token_consume(:'t4', 'form') AS expired;

-- a consume rolled back (whole transaction, or to a savepoint) leaves the token live
SELECT idempotency.idem_token_issue('form') AS t5 \gset
BEGIN;
SELECT idempotency.idem_token_consume(:'t5', 'form') AS in_rolled_back_tx;
SELECT idempotency.idem_token_consume(:'t5', 'form') AS again_same_tx;
ROLLBACK;
BEGIN;
SAVEPOINT s;
SELECT idempotency.idem_token_consume(:'t5', 'form') AS in_savepoint;
ROLLBACK TO SAVEPOINT s;
SELECT idempotency.idem_token_consume(:'t5', 'form') AS after_savepoint;
COMMIT;
SELECT idempotency.idem_token_consume(:'t5', 'form') AS after_commit;

-- what a token record looks like: processing until consumed, then completed
SELECT idempotency.idem_token_issue('shape', '1 hour') AS t6 \gset
SELECT status, is_token, request_hash, response_status, locked_until, attempt,
       expires_at - created_at AS ttl, claim, owner_pid
  FROM idempotency.records WHERE key = :'t6';
SELECT idempotency.idem_token_consume(:'t6', 'shape');
SELECT status, completed_at IS NOT NULL AS completed_at_set
  FROM idempotency.records WHERE key = :'t6';

--
-- Tokens and keys never see each other, whatever the strings.
--
-- A live token is not a key: lookup finds nothing, acquire claims the key
-- anew, complete/release/extend find no record.
SELECT idempotency.idem_token_issue('mix') AS t7 \gset
SELECT pg_catalog.count(*) AS lookup_rows FROM idempotency.idem_lookup(:'t7', 'mix');
SELECT public.sqlstate_of(format('SELECT idempotency.idem_complete(%L, 200, scope => %L)', :'t7', 'mix')) AS complete_token;
SELECT idempotency.idem_release(:'t7', 'mix') AS release_token;
SELECT public.sqlstate_of(format('SELECT idempotency.idem_extend(%L, %L)', :'t7', 'mix')) AS extend_token;
SELECT outcome, attempt FROM idempotency.idem_acquire(:'t7', '{"k": 1}', 'mix');
-- and the key, now live under the same strings, leaves the token alone
SELECT idempotency.idem_complete(:'t7', 201, '{"done": true}', 'mix');
SELECT idempotency.idem_token_consume(:'t7', 'mix') AS token_still_live;
SELECT outcome, response_status FROM idempotency.idem_acquire(:'t7', '{"k": 1}', 'mix');
SELECT status FROM idempotency.idem_lookup(:'t7', 'mix');
-- A key is not a token: consume of a key's strings is false and changes nothing.
SELECT outcome FROM idempotency.idem_acquire('plain-key', '{}', 'mix');
SELECT public.records_fingerprint() AS before \gset
SELECT idempotency.idem_token_consume('plain-key', 'mix') AS consume_key;
SELECT public.records_fingerprint() = :'before' AS unchanged;
SELECT idempotency.idem_complete('plain-key', 200, scope => 'mix');
SELECT idempotency.idem_token_consume('plain-key', 'mix') AS consume_completed_key;
SELECT status FROM idempotency.idem_lookup('plain-key', 'mix');

--
-- Bad input: NULL 22004; empty or longer than 255 bytes 22023; ttl out of
-- range 22023.  Nothing is written.
--
SELECT public.records_fingerprint() AS before \gset
SELECT public.sqlstate_of($$SELECT idempotency.idem_token_consume(NULL)$$) AS null_token,
       public.sqlstate_of($$SELECT idempotency.idem_token_consume('x', NULL)$$) AS null_scope,
       public.sqlstate_of($$SELECT idempotency.idem_token_consume('')$$) AS empty_token,
       public.sqlstate_of($$SELECT idempotency.idem_token_consume(repeat('x', 256))$$) AS long_token,
       public.sqlstate_of($$SELECT idempotency.idem_token_consume('x', repeat('s', 256))$$) AS long_scope;
SELECT public.sqlstate_of($$SELECT idempotency.idem_token_issue(NULL)$$) AS issue_null_scope,
       public.sqlstate_of($$SELECT idempotency.idem_token_issue(repeat('s', 256))$$) AS issue_long_scope,
       public.sqlstate_of($$SELECT idempotency.idem_token_issue('', '0 seconds')$$) AS ttl_zero,
       public.sqlstate_of($$SELECT idempotency.idem_token_issue('', '-1 hour')$$) AS ttl_negative,
       public.sqlstate_of($$SELECT idempotency.idem_token_issue('', '8 days')$$) AS ttl_over_max;
SELECT public.records_fingerprint() = :'before' AS nothing_written;
-- 255 bytes are fine
SELECT idempotency.idem_token_consume(repeat('x', 255), repeat('s', 255)) AS longest;
-- a read-only transaction cannot issue, nor consume a live token
SELECT idempotency.idem_token_issue() AS t8 \gset
BEGIN READ ONLY;
SELECT public.sqlstate_of($$SELECT idempotency.idem_token_issue()$$) AS issue_read_only;
SELECT public.sqlstate_of(format('SELECT idempotency.idem_token_consume(%L)', :'t8')) AS consume_read_only;
ROLLBACK;
SELECT idempotency.idem_token_consume(:'t8') AS still_live;

--
-- Unguessable: 100,000 tokens, each 32 characters of the URL-safe base64
-- alphabet (192 random bits), no two equal.
--
CREATE TEMP TABLE many AS
SELECT idempotency.idem_token_issue('many', '1 minute') AS token FROM generate_series(1, 100000);
SELECT pg_catalog.count(*) AS tokens,
       pg_catalog.count(DISTINCT token) AS distinct_tokens,
       pg_catalog.min(pg_catalog.length(token)) AS min_length,
       pg_catalog.max(pg_catalog.octet_length(token)) AS max_bytes,
       pg_catalog.bool_and(token ~ '^[A-Za-z0-9_-]{32}$') AS url_safe
  FROM many;
-- all 64 characters show up, each about as often as the others (3.2
-- million characters: 50,000 each expected, a standard deviation of 220)
SELECT pg_catalog.count(*) AS alphabet,
       pg_catalog.max(n) - pg_catalog.min(n) < 3000 AS uniform
  FROM (SELECT c, pg_catalog.count(*) AS n
          FROM many, LATERAL pg_catalog.regexp_split_to_table(token, '') c
         GROUP BY c) f;
SELECT pg_catalog.count(*) AS stored FROM idempotency.records WHERE scope = 'many' AND is_token;
