--
-- 10_maintenance: partitions for the coming period, idem_maintain, and the
-- pg_cron scheduling functions as seen from a database that is not pg_cron's.
-- (A real pg_cron run, load, catch-up and the no-pg_cron case are in
-- t/001_maintenance.pl.)
--

-- After CREATE EXTENSION: dated partitions from the current one up to at
-- least now + max_ttl, contiguous, plus the DEFAULT partition.
SELECT count(*) FILTER (WHERE is_default) AS default_partitions,
       min(range_start) <= now() AS covers_now,
       max(range_end) >= now() + (idempotency.maintenance_settings()).max_ttl AS covers_max_ttl
  FROM idempotency.partitions;
SELECT count(*) AS gaps
  FROM (SELECT range_start, lag(range_end) OVER (ORDER BY range_start) AS prev_end
          FROM idempotency.partitions WHERE NOT is_default) p
 WHERE prev_end IS NOT NULL AND prev_end <> range_start;
-- the dated partitions are not extension members (maintenance drops them)
SELECT count(*) AS member_partitions
  FROM idempotency.partitions p
  JOIN pg_depend d ON d.classid = 'pg_class'::regclass AND d.objid = p.partition
                  AND d.deptype = 'e'
 WHERE NOT p.is_default;

-- Nothing to do: nothing created, nothing dropped, twice.
SELECT * FROM idempotency.idem_maintain();
SELECT * FROM idempotency.idem_maintain();

-- Scheduling from a database that is not pg_cron's: 55000, and the hint
-- names the exact call to make there.
\set SHOW_CONTEXT never
SELECT idempotency.idem_schedule_maintenance();
SELECT idempotency.idem_schedule_maintenance('*/5 * * * *');
SELECT idempotency.idem_unschedule_maintenance();
\set SHOW_CONTEXT errors
SELECT public.sqlstate_of($$SELECT idempotency.idem_schedule_maintenance()$$) AS schedule,
       public.sqlstate_of($$SELECT idempotency.idem_unschedule_maintenance()$$) AS unschedule,
       public.sqlstate_of($$SELECT idempotency.idem_schedule_maintenance(NULL)$$) AS null_schedule;

-- Short partitions: re-create the extension with partitions of 2 seconds.
-- A partition is dropped only once its whole range has ended: one holding
-- a live record never is.
DROP EXTENSION idempotency;
SET idempotency.partition_interval = '2s';
SET idempotency.max_ttl = '10s';
SET idempotency.default_ttl = '10s';
CREATE EXTENSION idempotency;
SELECT count(*) > 5 AS short_partitions FROM idempotency.partitions WHERE NOT is_default;

SELECT outcome FROM idempotency.idem_acquire('short', ttl => '1s');
SELECT outcome FROM idempotency.idem_acquire('long', ttl => '10s');
SELECT idempotency.idem_complete('long', 201, '{"kept": true}');
SELECT tableoid::regclass AS long_partition FROM idempotency.records WHERE key = 'long' \gset
SELECT tableoid::regclass AS short_partition FROM idempotency.records WHERE key = 'short' \gset
SELECT pg_sleep(3.5);   -- the short record's partition has ended

SELECT clock_timestamp() AS before_run \gset
SELECT partitions_created > 0 AS created, partitions_dropped > 0 AS dropped
  FROM idempotency.idem_maintain();
SELECT to_regclass(:'short_partition') IS NULL AS short_partition_dropped,
       to_regclass(:'long_partition') IS NOT NULL AS long_partition_kept;
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('long', ttl => '10s');
SELECT count(*) AS ended_partitions_left
  FROM idempotency.partitions WHERE NOT is_default AND range_end <= :'before_run';
SELECT max(range_end) >= clock_timestamp() + interval '10s' AS still_covers_max_ttl
  FROM idempotency.partitions;

-- Back to the defaults for whatever runs next.
DROP EXTENSION idempotency;
RESET idempotency.partition_interval;
RESET idempotency.max_ttl;
RESET idempotency.default_ttl;
CREATE EXTENSION idempotency;
SELECT count(*) > 7 AS daily_partitions FROM idempotency.partitions WHERE NOT is_default;
