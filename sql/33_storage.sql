--
-- 33_storage: the partitions maintenance makes are laid out for the
-- completion (issue 30).  What a completion writes comes after the columns
-- it leaves alone, so that a HOT update logs little more than that; the
-- partition keeps room for completions (fillfactor); the page an insert
-- goes to is pruned first, so the dead claims' room is used again.  So
-- every completion is a HOT update, and a record takes the room of one
-- completed row, not of a completed row and its dead claim.
--
SET idempotency.wait_timeout = 0;
SET stats_fetch_consistency = none;
-- every dated partition: the completion's columns last, the fillfactor
CREATE TEMP VIEW layout_now AS
SELECT count(*) > 0 AS some_partitions,
       bool_and((SELECT max(a.attnum) FROM pg_attribute a
                  WHERE a.attrelid = p.partition
                    AND a.attname IN ('scope', 'key', 'request_hash', 'created_at', 'expires_at',
                                      'locked_until', 'attempt', 'claim', 'owner_pid',
                                      'owner_start', 'is_token'))
                < (SELECT min(a.attnum) FROM pg_attribute a
                    WHERE a.attrelid = p.partition
                      AND a.attname IN ('status', 'response_status', 'completed_at', 'response_body')))
           AS completion_columns_last,
       array_agg(DISTINCT c.reloptions::text) AS reloptions
  FROM idempotency.partitions p
  JOIN pg_class c ON c.oid = p.partition
 WHERE NOT p.is_default;
-- The partitions CREATE EXTENSION made (idempotency--1.1.sql, then the
-- update, which makes the empty ones again) have it from the start.
SELECT * FROM layout_now;
-- Drop them all (this is the last test), so that the figures below start
-- from empty partitions, and let maintenance make new ones: the same.
DO $$
DECLARE
    part regclass;
BEGIN
    FOR part IN SELECT p.partition FROM idempotency.partitions p WHERE NOT p.is_default LOOP
        EXECUTE format('DROP TABLE %s', part);
    END LOOP;
END
$$;
SELECT partitions_created > 0 AS made FROM idempotency.idem_maintain();
SELECT * FROM layout_now;

-- 300 keys of a scope of their own, each claimed and completed in a
-- transaction of its own, with a 300-byte response.  Counted over every partition: the records of a ttl
-- may straddle two.
CREATE TEMP VIEW storage_now AS
SELECT sum(s.n_tup_upd) AS upd, sum(s.n_tup_hot_upd) AS hot,
       sum(pg_relation_size(p.partition) / current_setting('block_size')::int) AS pages
  FROM idempotency.partitions p
  JOIN pg_stat_user_tables s ON s.relid = p.partition;
SELECT pg_stat_force_next_flush();
SELECT upd AS upd0, hot AS hot0, pages AS pages0 FROM storage_now \gset
\set ECHO none
\o /dev/null
SELECT format('SELECT idempotency.idem_acquire(%L, ''{"order": 1}'', ''storage'', ttl => interval ''3 days''); '
              'SELECT idempotency.idem_complete(%L, 201, %L, ''storage'')',
              'k-' || i, 'k-' || i, jsonb_build_object('receipt', repeat('x', 280)))
  FROM generate_series(1, 300) i \gexec
\o
\set ECHO all
SELECT pg_stat_force_next_flush();
-- every completion HOT; the 300 records in 21 pages or fewer (about 15 a
-- page; about 25 pages when the dead claims stay)
SELECT upd - :upd0 AS completions, hot - :hot0 AS hot, pages - :pages0 <= 21 AS compact
  FROM storage_now;
SELECT count(*) AS completed FROM idempotency.records
 WHERE scope = 'storage' AND status = 'completed';

-- A completion clears the lease in these partitions (records.c,
-- IdemPartition.clear_lease): a completed record has none, and its 8
-- bytes are what puts 16 rows of this size on a page instead of 15.  The
-- claim stays: the right claim completes nothing more, a wrong one is
-- still refused.
SELECT count(*) FILTER (WHERE locked_until IS NULL) AS without_lease, count(*) AS completed
  FROM idempotency.records WHERE scope = 'storage';
SELECT claim AS lease_claim FROM idempotency.idem_acquire('lease', '{"order": 1}', 'storage') \gset
SELECT status, locked_until > now() AS leased FROM idempotency.idem_lookup('lease', 'storage');
SELECT idempotency.idem_complete('lease', 201, '{"id": 1}', 'storage', claim => :'lease_claim') AS completed;
SELECT status, locked_until IS NULL AS no_lease FROM idempotency.idem_lookup('lease', 'storage');
SELECT idempotency.idem_complete('lease', 201, '{"id": 1}', 'storage', claim => :'lease_claim') AS completed_again;
\set VERBOSITY terse
SELECT idempotency.idem_complete('lease', 201, '{"id": 1}', 'storage', claim => gen_random_uuid());
\set VERBOSITY default
-- a heartbeat of the completed record is refused, as before
\set VERBOSITY terse
SELECT idempotency.idem_extend('lease', 'storage', :'lease_claim');
\set VERBOSITY default
