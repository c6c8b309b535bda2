--
-- 14_session_bound: session-bound claims (1.1) as one session sees them.
-- Owners that die are in t/013_session_bound.pl; duplicates from another
-- session in specs/27_fencing.spec.
--
SET idempotency.wait_timeout = 0;

-- locked_until = expires_at whatever the lease; owner_pid = this backend
SELECT outcome, attempt, claim IS NOT NULL AS has_claim
  FROM idempotency.idem_acquire('s-1', ttl => '1 hour', lease => '1 second', session_bound => true);
SELECT status, locked_until = expires_at AS locked_for_ttl, owner_pid = pg_backend_pid() AS owner_is_me
  FROM idempotency.idem_lookup('s-1');
SELECT owner_start = pg_catalog.pg_postmaster_start_time() AS is_postmaster_start,
       owner_start = (SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()) AS is_backend_start
  FROM idempotency.records WHERE key = 's-1';
-- the lease is checked as input all the same
SELECT public.sqlstate_of($$SELECT * FROM idempotency.idem_acquire('s-x', ttl => '1 hour', lease => '2 hours', session_bound => true)$$) AS lease_over_ttl;
-- a lease claim has no owner
SELECT outcome FROM idempotency.idem_acquire('s-lease', lease => '1 minute');
SELECT owner_pid FROM idempotency.idem_lookup('s-lease');
-- session_bound => NULL is a lease claim
SELECT outcome FROM idempotency.idem_acquire('s-null', lease => '1 minute', session_bound => NULL);
SELECT owner_pid FROM idempotency.idem_lookup('s-null');

-- while the owner lives (here: it is us), duplicates are in_progress with
-- retry_after 1, long after the lease given would have run out
SELECT pg_sleep(1.1);
SELECT outcome, attempt, claim, retry_after FROM idempotency.idem_acquire('s-1');

-- idem_extend on a session-bound claim: allowed, writes nothing, returns
-- locked_until as it is (expires_at)
SELECT public.records_fingerprint() AS before \gset
SELECT idempotency.idem_extend('s-1', lease => '1 second') = expires_at AS extend_returns_expires_at
  FROM idempotency.idem_lookup('s-1');
SELECT public.records_fingerprint() = :'before' AS nothing_written;

-- The owner is identified by pid AND backend start: a record naming our pid
-- with another start time belongs to a dead backend that had our pid, and
-- is taken over at once.
UPDATE idempotency.records SET owner_start = owner_start - interval '1 second' WHERE key = 's-1';
SELECT outcome, attempt FROM idempotency.idem_acquire('s-1', session_bound => true);
SELECT owner_pid = pg_backend_pid() AS owner_is_me, attempt FROM idempotency.idem_lookup('s-1');
-- the same with the pid of another live backend (the autovacuum launcher,
-- which never made a claim): not the owner, taken over at once
UPDATE idempotency.records
   SET owner_pid = (SELECT pid FROM pg_stat_activity WHERE backend_type = 'autovacuum launcher'),
       owner_start = (SELECT backend_start FROM pg_stat_activity WHERE backend_type = 'autovacuum launcher')
 WHERE key = 's-1';
SELECT outcome, attempt FROM idempotency.idem_acquire('s-1');
SELECT owner_pid, locked_until < expires_at AS has_lease FROM idempotency.idem_lookup('s-1');

-- completed: owner_pid NULL, replay as usual
SELECT outcome FROM idempotency.idem_acquire('s-2', session_bound => true);
SELECT idempotency.idem_complete('s-2', 200, '{"ok": true}');
SELECT status, owner_pid FROM idempotency.idem_lookup('s-2');
SELECT outcome, response_status FROM idempotency.idem_acquire('s-2', session_bound => true);

-- pg_advisory_unlock_all() lets go of the owner lock (documented): our
-- claim then looks dead to others until our next session-bound claim
SELECT outcome FROM idempotency.idem_acquire('s-3', session_bound => true);
SELECT pg_catalog.count(*) AS owner_locks FROM pg_locks
 WHERE locktype = 'advisory' AND objsubid = 18757 AND pid = pg_backend_pid() AND mode = 'ExclusiveLock';
SELECT pg_advisory_unlock_all();
SELECT pg_catalog.count(*) AS owner_locks FROM pg_locks
 WHERE locktype = 'advisory' AND objsubid = 18757 AND pid = pg_backend_pid();
SELECT outcome FROM idempotency.idem_acquire('s-4', session_bound => true);
SELECT pg_catalog.count(*) AS owner_locks FROM pg_locks
 WHERE locktype = 'advisory' AND objsubid = 18757 AND pid = pg_backend_pid();
-- an error (transaction abort) does not end ownership
BEGIN;
SELECT 1 / 0;
ROLLBACK;
SELECT pg_catalog.count(*) AS owner_locks FROM pg_locks
 WHERE locktype = 'advisory' AND objsubid = 18757 AND pid = pg_backend_pid();


-- Our own committed session-bound claim: in_progress at once, not after
-- waiting out wait_timeout for a claim only we can finish
SET idempotency.wait_timeout = '5s';
SET statement_timeout = '2s';
SELECT outcome, retry_after FROM idempotency.idem_acquire('s-5', session_bound => true);
SELECT outcome, retry_after FROM idempotency.idem_acquire('s-5');
SELECT outcome, retry_after FROM idempotency.idem_acquire('s-5', session_bound => true);
RESET statement_timeout;
SET idempotency.wait_timeout = 0;

-- DISCARD ALL (what a session pooler runs before it hands the connection to
-- the next client) ends the ownership: the departed client's claims are
-- taken over, by this backend as by any other, and are not revived by the
-- next client's session-bound claim, which begins a new ownership.
SELECT outcome FROM idempotency.idem_acquire('s-6', session_bound => true);
SELECT outcome FROM idempotency.idem_acquire('s-7', session_bound => true);
DISCARD ALL;
SET idempotency.wait_timeout = 0;
SELECT outcome, attempt FROM idempotency.idem_acquire('s-6');
SELECT outcome, attempt FROM idempotency.idem_acquire('s-8', session_bound => true);
SELECT outcome, attempt FROM idempotency.idem_acquire('s-7');
SELECT owner_start > (SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid())
       AS new_ownership
  FROM idempotency.records WHERE key = 's-8';
-- and the new ownership's claims are ours
SELECT outcome, retry_after FROM idempotency.idem_acquire('s-8');

DELETE FROM idempotency.records;
RESET idempotency.wait_timeout;
