--
-- 13_claims: fenced claims (1.1).  claim is new with every acquired and
-- NULL otherwise; complete, release and extend with a claim that is not the
-- record's get 55000 and change nothing; retry_after counts the lease down;
-- idem_extend pushes the lease out.
--
SET idempotency.wait_timeout = 0;

-- claim: a version 4 UUID with acquired, NULL with every other outcome
SELECT outcome, claim IS NOT NULL AS has_claim,
       substr(claim::text, 15, 1) AS version,
       substr(claim::text, 20, 1) IN ('8', '9', 'a', 'b') AS variant,
       retry_after
  FROM idempotency.idem_acquire('c-1', '{"a": 1}', lease => '10 seconds');
SELECT outcome, claim, retry_after BETWEEN 9 AND 10 AS retry_after_is_lease_left
  FROM idempotency.idem_acquire('c-1', '{"a": 1}');		-- in_progress (own claim, lease running)
SELECT outcome, claim, retry_after FROM idempotency.idem_acquire('c-1', '{"a": 2}');	-- mismatch
SELECT idempotency.idem_complete('c-1', 201, '{"id": 1}');
SELECT outcome, claim, retry_after FROM idempotency.idem_acquire('c-1', '{"a": 1}');	-- replay

-- every acquired has a claim of its own
CREATE TEMP TABLE claims (name text PRIMARY KEY, claim uuid);
INSERT INTO claims SELECT 'k' || i, a.claim
  FROM generate_series(1, 50) i, idempotency.idem_acquire('c-many-' || i) a;
SELECT pg_catalog.count(DISTINCT claim) AS distinct_claims FROM claims;

-- The 1.0 hole, closed: claim, release, claim again (attempt 1 again); the
-- stale worker's complete with its old claim gets 55000 and changes nothing.
INSERT INTO claims SELECT 'old', claim FROM idempotency.idem_acquire('c-2', lease => '1 minute');
SELECT idempotency.idem_release('c-2', claim => (SELECT claim FROM claims WHERE name = 'old'));
INSERT INTO claims SELECT 'new', claim FROM idempotency.idem_acquire('c-2', lease => '1 minute');
SELECT attempt FROM idempotency.idem_lookup('c-2');
SELECT public.records_fingerprint() AS before \gset
SELECT public.sqlstate_of($$SELECT idempotency.idem_complete('c-2', 200, '{"by": "stale"}',
    claim => (SELECT claim FROM claims WHERE name = 'old'))$$) AS stale_complete;
SELECT public.sqlstate_of($$SELECT idempotency.idem_complete('c-2', 200, '{"by": "stale"}',
    attempt => 1, claim => (SELECT claim FROM claims WHERE name = 'old'))$$) AS stale_complete_with_attempt;
SELECT public.sqlstate_of($$SELECT idempotency.idem_release('c-2',
    claim => (SELECT claim FROM claims WHERE name = 'old'))$$) AS stale_release;
SELECT public.sqlstate_of($$SELECT idempotency.idem_extend('c-2',
    claim => (SELECT claim FROM claims WHERE name = 'old'))$$) AS stale_extend;
SELECT public.records_fingerprint() = :'before' AS nothing_changed;
-- the error says why
\set VERBOSITY default
SELECT idempotency.idem_complete('c-2', 200, claim => (SELECT claim FROM claims WHERE name = 'old'));
\set VERBOSITY default
-- with only attempt => 1, as in 1.0, the stale worker still succeeds: the
-- reason to pass claim (README)
BEGIN;
SELECT idempotency.idem_complete('c-2', 200, '{"by": "stale"}', attempt => 1);
ROLLBACK;
-- the current claim completes it; afterwards the stale claim still gets
-- 55000, checked before the completed case
SELECT idempotency.idem_complete('c-2', 201, '{"by": "new"}',
    claim => (SELECT claim FROM claims WHERE name = 'new'));
SELECT idempotency.idem_complete('c-2', 201, '{"by": "new"}',
    claim => (SELECT claim FROM claims WHERE name = 'new'));
SELECT public.sqlstate_of($$SELECT idempotency.idem_complete('c-2', 200,
    claim => (SELECT claim FROM claims WHERE name = 'old'))$$) AS stale_after_completed;
SELECT public.sqlstate_of($$SELECT idempotency.idem_release('c-2',
    claim => (SELECT claim FROM claims WHERE name = 'old'))$$) AS stale_release_after_completed;
SELECT idempotency.idem_release('c-2', claim => (SELECT claim FROM claims WHERE name = 'new'));

-- release with the right claim
INSERT INTO claims SELECT 'r', claim FROM idempotency.idem_acquire('c-3', lease => '1 minute');
SELECT idempotency.idem_release('c-3', claim => (SELECT claim FROM claims WHERE name = 'r'));
SELECT pg_catalog.count(*) FROM idempotency.idem_lookup('c-3');

-- a takeover makes a new claim; the old one is refused
INSERT INTO claims SELECT 't1', claim FROM idempotency.idem_acquire('c-4', lease => '1 second');
SELECT pg_sleep(1.1);
INSERT INTO claims SELECT 't2', claim FROM idempotency.idem_acquire('c-4');
SELECT (SELECT claim FROM claims WHERE name = 't1') <> (SELECT claim FROM claims WHERE name = 't2') AS new_claim,
       attempt FROM idempotency.idem_lookup('c-4');
SELECT public.sqlstate_of($$SELECT idempotency.idem_complete('c-4', 200,
    claim => (SELECT claim FROM claims WHERE name = 't1'))$$) AS taken_over_complete;
SELECT idempotency.idem_complete('c-4', 200, attempt => 2,
    claim => (SELECT claim FROM claims WHERE name = 't2'));

-- retry_after: the rounded-up seconds left of the lease
-- (with most of a second to spare on a slow machine before either changes)
SELECT outcome FROM idempotency.idem_acquire('c-5', lease => '60.9 seconds');
SELECT outcome, retry_after FROM idempotency.idem_acquire('c-5');	-- 60.9 s left: 61
UPDATE idempotency.records SET locked_until = clock_timestamp() + interval '5.9 seconds'
 WHERE key = 'c-5';
SELECT outcome, retry_after FROM idempotency.idem_acquire('c-5');	-- 5.9 s left: 6

-- idem_extend: pushes locked_until out, capped at expires_at
INSERT INTO claims SELECT 'e', claim FROM idempotency.idem_acquire('c-6', ttl => '1 minute', lease => '1 second');
SELECT idempotency.idem_extend('c-6', claim => (SELECT claim FROM claims WHERE name = 'e'), lease => '20 seconds')
       = (SELECT locked_until FROM idempotency.idem_lookup('c-6')) AS returns_locked_until,
       (SELECT locked_until - created_at BETWEEN '20 seconds' AND '21 seconds' FROM idempotency.idem_lookup('c-6')) AS lease_pushed;
SELECT pg_sleep(1.1);
SELECT outcome, attempt, retry_after BETWEEN 18 AND 20 AS retry_after_is_lease_left
  FROM idempotency.idem_acquire('c-6');	-- after the old lease end: still in_progress
SELECT idempotency.idem_extend('c-6', claim => (SELECT claim FROM claims WHERE name = 'e'), lease => '1 hour')
       = expires_at AS capped_at_expires_at
  FROM idempotency.idem_lookup('c-6');
-- default lease: idempotency.default_lease; no claim given: any claim
SET idempotency.default_lease = '30s';
SELECT idempotency.idem_extend('c-6') - clock_timestamp() BETWEEN '29 seconds' AND '30 seconds' AS default_lease;
RESET idempotency.default_lease;
-- errors: stale claim 55000; completed P0002; no record P0002; bad input
SELECT public.sqlstate_of($$SELECT idempotency.idem_extend('c-6', claim => gen_random_uuid())$$) AS wrong_claim;
SELECT idempotency.idem_complete('c-6', 200, claim => (SELECT claim FROM claims WHERE name = 'e'));
SELECT public.sqlstate_of($$SELECT idempotency.idem_extend('c-6', claim => (SELECT claim FROM claims WHERE name = 'e'))$$) AS completed;
SELECT public.sqlstate_of($$SELECT idempotency.idem_extend('c-6', claim => gen_random_uuid())$$) AS completed_wrong_claim;
SELECT public.sqlstate_of($$SELECT idempotency.idem_extend('c-none')$$) AS no_record;
SELECT public.records_fingerprint() AS before \gset
SELECT public.sqlstate_of($$SELECT idempotency.idem_extend(NULL)$$) AS null_key,
       public.sqlstate_of($$SELECT idempotency.idem_extend('c-6', NULL)$$) AS null_scope,
       public.sqlstate_of($$SELECT idempotency.idem_extend('')$$) AS empty_key,
       public.sqlstate_of($$SELECT idempotency.idem_extend('c-6', lease => '0')$$) AS zero_lease,
       public.sqlstate_of($$SELECT idempotency.idem_extend('c-6', lease => '-1 second')$$) AS negative_lease,
       public.sqlstate_of($$SELECT idempotency.idem_extend('c-6', lease => '8 days')$$) AS lease_over_max_ttl;
SELECT public.records_fingerprint() = :'before' AS nothing_changed;
-- claim of another scope or key never fits
INSERT INTO claims SELECT 's', claim FROM idempotency.idem_acquire('c-7', scope => 'a', lease => '1 minute');
SELECT public.sqlstate_of($$SELECT idempotency.idem_complete('c-7', 200, scope => 'b')$$) AS other_scope_no_record,
       public.sqlstate_of($$SELECT idempotency.idem_complete('c-7', 200, scope => 'a',
           claim => (SELECT claim FROM claims WHERE name = 'r'))$$) AS claim_of_another_key;
SELECT idempotency.idem_complete('c-7', 200, scope => 'a', claim => (SELECT claim FROM claims WHERE name = 's'));

DELETE FROM idempotency.records;
RESET idempotency.wait_timeout;
