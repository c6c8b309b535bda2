--
-- idem_complete (and idem_extend, idem_release) of the claim this
-- transaction made last reads the record where idem_acquire wrote it,
-- without probing; everything else, and every case where that row is no
-- longer the live claim, is probed for as before.
--
SET idempotency.wait_timeout = 0;
SET stats_fetch_consistency = none;

-- the usual pattern: acquire, complete, in one transaction
BEGIN;
SELECT outcome, attempt FROM idempotency.idem_acquire('cp-1', '{"a": 1}', 'cp');
SELECT idempotency.idem_complete('cp-1', 201, '{"id": 1}', 'cp') AS completed;
-- completed already: the row written by acquire is no longer current
SELECT idempotency.idem_complete('cp-1', 201, '{"id": 1}', 'cp') AS completed_again;
COMMIT;
SELECT outcome, response_status, response_body FROM idempotency.idem_acquire('cp-1', '{"a": 1}', 'cp');

-- a claim rolled back to a savepoint is gone: P0002, never a completion
BEGIN;
SAVEPOINT s;
SELECT outcome FROM idempotency.idem_acquire('cp-2', scope => 'cp');
ROLLBACK TO SAVEPOINT s;
\set VERBOSITY terse
SELECT idempotency.idem_complete('cp-2', 201, scope => 'cp');
\set VERBOSITY default
ROLLBACK;

-- a released claim is gone too
BEGIN;
SELECT outcome FROM idempotency.idem_acquire('cp-3', scope => 'cp');
SELECT idempotency.idem_release('cp-3', 'cp') AS released;
\set VERBOSITY terse
SELECT idempotency.idem_complete('cp-3', 201, scope => 'cp');
\set VERBOSITY default
ROLLBACK;

-- two claims in one transaction: the earlier one is found by its probe,
-- the same key in another scope is not mistaken for the last claim
BEGIN;
SELECT outcome FROM idempotency.idem_acquire('cp-4', scope => 'cp');
SELECT outcome FROM idempotency.idem_acquire('cp-5', scope => 'cp');
\set VERBOSITY terse
SELECT idempotency.idem_complete('cp-5', 201, scope => 'cp-other');
\set VERBOSITY default
ROLLBACK;
BEGIN;
SELECT outcome FROM idempotency.idem_acquire('cp-4', scope => 'cp');
SELECT outcome FROM idempotency.idem_acquire('cp-5', scope => 'cp');
SELECT idempotency.idem_complete('cp-4', 200, scope => 'cp') AS first,
       idempotency.idem_complete('cp-5', 201, scope => 'cp') AS last;
COMMIT;
SELECT key, status, response_status FROM idempotency.records
 WHERE scope = 'cp' AND key IN ('cp-4', 'cp-5') ORDER BY key;

-- idem_extend and idem_release read the last claim in place too; after an
-- extension the row written by acquire is no longer current
BEGIN;
SELECT claim AS cp7_claim FROM idempotency.idem_acquire('cp-7', scope => 'cp', lease => '1 minute') \gset
SELECT idempotency.idem_extend('cp-7', 'cp', :'cp7_claim', '2 hours') > pg_catalog.now() + interval '1 hour' AS extended;
SELECT locked_until > pg_catalog.now() + interval '1 hour' AS lease_was_extended
  FROM idempotency.records WHERE scope = 'cp' AND key = 'cp-7';
SELECT idempotency.idem_complete('cp-7', 201, scope => 'cp', claim => :'cp7_claim') AS completed;
COMMIT;
-- (a completion clears the lease in 1.2's partitions, which every
-- partition of a new install has)
SELECT status, locked_until IS NULL AS lease_cleared
  FROM idempotency.records WHERE scope = 'cp' AND key = 'cp-7';

-- a claim committed in an earlier transaction is probed for
SELECT outcome FROM idempotency.idem_acquire('cp-6', scope => 'cp', lease => '1 hour');
SELECT idempotency.idem_complete('cp-6', 201, scope => 'cp') AS completed_later;

-- and the in-place read is what happens: completing the last claim costs
-- no index scan.  T0 makes the target partition non-empty, so that T1 (a
-- claim rolled back) and T2 (a claim completed) probe the same partitions.
-- Without the known-absent filters, so that acquire probes at all.
SET idempotency.use_filters = off;
BEGIN;
SELECT outcome FROM idempotency.idem_acquire('cp-t0', scope => 'cp');
ROLLBACK;
SELECT pg_stat_force_next_flush();
SELECT pg_catalog.sum(idx_scan) AS s0 FROM pg_stat_user_tables WHERE schemaname = 'idempotency' \gset
BEGIN;
SELECT outcome FROM idempotency.idem_acquire('cp-t1', scope => 'cp');
ROLLBACK;
SELECT pg_stat_force_next_flush();
SELECT pg_catalog.sum(idx_scan) AS s1 FROM pg_stat_user_tables WHERE schemaname = 'idempotency' \gset
BEGIN;
SELECT outcome FROM idempotency.idem_acquire('cp-t2', scope => 'cp');
SELECT idempotency.idem_complete('cp-t2', 201, scope => 'cp') AS completed;
COMMIT;
SELECT pg_stat_force_next_flush();
SELECT pg_catalog.sum(idx_scan) AS s2 FROM pg_stat_user_tables WHERE schemaname = 'idempotency' \gset
SELECT :s1 - :s0 > 0 AS acquire_probed, (:s2 - :s1) - (:s1 - :s0) AS complete_scans;
RESET idempotency.use_filters;
