--
-- 91_review: the single-session points of a review of the SQL edition
-- (the concurrent ones are sql-edition/specs/sqled_*.spec).
--
DELETE FROM idempotency.records;
SET idempotency.wait_timeout = 0;

-- 1. nobody but the owner has a privilege on the latch table: a role
-- could otherwise move its rows (and so turn the REPEATABLE READ check
-- off) or lock them all (and so hold up every new claim)
SELECT pg_catalog.count(*) AS public_privileges
  FROM pg_class c, aclexplode(c.relacl) a
 WHERE c.oid = 'idempotency_sql.key_latches'::regclass AND a.grantee = 0;
SET ROLE regress_idem_sql_ops;
SELECT public.sqlstate_of($$UPDATE idempotency_sql.key_latches SET h = h + 1000000$$) AS tamper,
       public.sqlstate_of($$SELECT FROM idempotency_sql.key_latches FOR UPDATE$$) AS lock_all,
       public.sqlstate_of($$SELECT idempotency_sql.latch_prune()$$) AS prune;
-- the latch function writes only under the key lock, which it takes
BEGIN;
SELECT idempotency_sql.latch(4242);
SELECT pg_catalog.count(*) AS key_lock_held FROM pg_locks
 WHERE pid = pg_backend_pid() AND locktype = 'advisory' AND objsubid = 1
   AND classid = 0 AND objid = 4242;
ROLLBACK;
RESET ROLE;
-- a new claim writes its key's row, a replay does not
SELECT outcome FROM idempotency.idem_acquire('rv-1');
SELECT pg_catalog.count(*) AS latch_rows FROM idempotency_sql.key_latches
 WHERE h = idempotency_sql.key_lock('', 'rv-1', false);
SELECT idempotency.idem_complete('rv-1', 200);
SELECT xmin AS latch_xmin FROM idempotency_sql.key_latches
 WHERE h = idempotency_sql.key_lock('', 'rv-1', false) \gset
SELECT outcome FROM idempotency.idem_acquire('rv-1');
SELECT xmin = :'latch_xmin' AS latch_unchanged FROM idempotency_sql.key_latches
 WHERE h = idempotency_sql.key_lock('', 'rv-1', false);

-- 4. the latch is one row per key hash; idem_maintain prunes the rows no
-- snapshot can need: written before every live record was created, by a
-- transaction that ended before its snapshot (so rv-2's row, written
-- after rv-1's record was created, stays, though rv-2 was forgotten)
SELECT outcome FROM idempotency.idem_acquire('rv-2');
SELECT idempotency.idem_forget('rv-2');
INSERT INTO idempotency_sql.key_latches VALUES (12345, clock_timestamp() - interval '10 days');
SELECT count(*) FROM idempotency.idem_maintain();
SELECT idempotency_sql.key_lock('', 'rv-1', false) IN (SELECT h FROM idempotency_sql.key_latches) AS live_key_kept,
       idempotency_sql.key_lock('', 'rv-2', false) IN (SELECT h FROM idempotency_sql.key_latches) AS forgotten_key_kept,
       12345 IN (SELECT h FROM idempotency_sql.key_latches) AS old_row_kept;

-- 6. READ UNCOMMITTED is READ COMMITTED: a replay takes no row lock, so
-- no transaction id
BEGIN ISOLATION LEVEL READ UNCOMMITTED;
SELECT outcome FROM idempotency.idem_acquire('rv-1');
SELECT pg_current_xact_id_if_assigned() IS NULL AS no_xid;
COMMIT;

-- 7. idempotency.wait_timeout above the C extension's bound (INT_MAX ms)
-- is a 22023 at the call, as the other bad settings
SET idempotency.wait_timeout = '30d';
SELECT outcome FROM idempotency.idem_acquire('rv-3');
SELECT idempotency.idem_forget('rv-3');
SELECT idempotency.idem_token_consume('nope');
SET idempotency.wait_timeout = '2147483647ms';
SELECT outcome FROM idempotency.idem_acquire('rv-3');

RESET idempotency.wait_timeout;
DELETE FROM idempotency.records;
