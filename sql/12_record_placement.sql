--
-- 12_record_placement: records wherever they are stored.
--   - records that fill their pages, so that completions are not HOT
--     updates and need index entries of their own, still replay;
--   - a record with a ttl longer than idempotency.default_ttl (the probes
--     start at the partition of the default ttl) is found by every function;
--   - maintenance keeps the partition whose range has started and not ended.
--
SET idempotency.wait_timeout = 0;

-- ------------------------------------------------------------------
-- 300 claims in one statement, all completed: the records fill several
-- pages, so completions that find no room on their page are not HOT and
-- must add index entries for the new version.
-- ------------------------------------------------------------------
BEGIN;
-- (the heap counts HOT updates; within a transaction block the counts are
-- not flushed, so the difference below is this transaction's)
SELECT sum(n_tup_upd) AS upd_before, sum(n_tup_hot_upd) AS hot_before
  FROM pg_stat_xact_user_tables WHERE schemaname = 'idempotency' \gset
SELECT count(*) FILTER (WHERE a.outcome = 'acquired' AND a.attempt = 1) AS acquired
  FROM generate_series(1, 300) g,
       idempotency.idem_acquire('bulk-' || g, jsonb_build_object('n', g)) a;
SELECT count(*) FILTER (WHERE c) AS completed
  FROM generate_series(1, 300) g,
       idempotency.idem_complete('bulk-' || g, 201, jsonb_build_object('id', g)) c;
-- some of the 300 updates were not HOT
SELECT sum(n_tup_upd) - coalesce(:'upd_before'::bigint, 0) AS updates,
       sum(n_tup_hot_upd) - coalesce(:'hot_before'::bigint, 0) < 300 AS some_not_hot
  FROM pg_stat_xact_user_tables WHERE schemaname = 'idempotency';
COMMIT;
SELECT count(*) FILTER (WHERE a.outcome = 'replay' AND a.response_status = 201
                          AND a.response_body = jsonb_build_object('id', g)) AS replayed
  FROM generate_series(1, 300) g,
       idempotency.idem_acquire('bulk-' || g, jsonb_build_object('n', g)) a;
SELECT count(*) FILTER (WHERE l.status = 'completed') AS looked_up
  FROM generate_series(1, 300) g, idempotency.idem_lookup('bulk-' || g) l;
SELECT count(*) AS rows, count(DISTINCT key) AS keys
  FROM idempotency.records WHERE key LIKE 'bulk-%';

-- ------------------------------------------------------------------
-- A 7-day record (longer than the 24 h default_ttl), read back by lookup,
-- completed, and replayed to an acquire with the default ttl.
-- ------------------------------------------------------------------
SELECT outcome, attempt, expires_at > now() + interval '6 days 23 hours' AS seven_days
  FROM idempotency.idem_acquire('week', '{"w": 1}', ttl => '7 days');
SELECT p.range_start > now() + interval '2 days' AS in_a_later_partition
  FROM idempotency.records r JOIN idempotency.partitions p ON p.partition = r.tableoid
 WHERE r.key = 'week';
SELECT status, attempt, expires_at > now() + interval '6 days 23 hours' AS seven_days
  FROM idempotency.idem_lookup('week');
SELECT outcome, attempt FROM idempotency.idem_acquire('week', '{"w": 2}');
SELECT outcome, attempt FROM idempotency.idem_acquire('week', '{"w": 1}');
SELECT idempotency.idem_complete('week', 201, '{"w": "done"}');
SELECT outcome, response_status, response_body,
       expires_at > now() + interval '6 days 23 hours' AS seven_days
  FROM idempotency.idem_acquire('week', '{"w": 1}');
SELECT idempotency.idem_release('week');
SELECT count(*) AS rows FROM idempotency.records WHERE key = 'week';

-- ------------------------------------------------------------------
-- Maintenance and the current partition.  A record in the partition whose
-- range has started but not ended is live: a run of idem_maintain that has
-- work to do (a partition ahead is missing) must keep it.
-- ------------------------------------------------------------------
-- not within 2 s of the end of the current partition
DO $$
BEGIN
    PERFORM pg_catalog.pg_sleep(extract(epoch FROM p.range_end - clock_timestamp()) + 0.1)
       FROM idempotency.partitions p
      WHERE NOT p.is_default AND p.range_start <= clock_timestamp()
        AND p.range_end > clock_timestamp()
        AND p.range_end < clock_timestamp() + interval '2 seconds';
END
$$;
-- the current partition, made here should an earlier run of maintenance
-- (the one of CREATE EXTENSION) have dropped it
DO $$
DECLARE
    step    interval := (idempotency.maintenance_settings()).partition_interval;
    secs    double precision := extract(epoch FROM step);
    slot    timestamptz := to_timestamp(floor(extract(epoch FROM clock_timestamp()) / secs) * secs);
BEGIN
    IF NOT EXISTS (SELECT FROM idempotency.partitions p
                    WHERE NOT p.is_default AND p.range_start <= clock_timestamp()
                      AND p.range_end > clock_timestamp()) THEN
        RAISE NOTICE 'no current partition: making one';
        EXECUTE format('CREATE TABLE idempotency.records_placement_current'
                       ' PARTITION OF idempotency.records FOR VALUES FROM (%L) TO (%L)',
                       slot, slot + step);
    END IF;
END
$$;
-- a ttl that ends inside the current partition: at most a minute, at least 1 s
SELECT least(interval '1 minute', (p.range_end - clock_timestamp()) / 2) AS current_ttl
  FROM idempotency.partitions p
 WHERE NOT p.is_default AND p.range_start <= clock_timestamp()
   AND p.range_end > clock_timestamp() \gset
SELECT outcome FROM idempotency.idem_acquire('current', '{"c": 1}', ttl => :'current_ttl');
SELECT idempotency.idem_complete('current', 201, '{"c": "done"}');
SELECT r.tableoid::regclass AS current_partition,
       p.range_start <= clock_timestamp() AND p.range_end > clock_timestamp() AS range_started_not_ended
  FROM idempotency.records r JOIN idempotency.partitions p ON p.partition = r.tableoid
 WHERE r.key = 'current' \gset
SELECT :'range_started_not_ended' AS range_started_not_ended;
SELECT partition AS last_partition FROM idempotency.partitions
 WHERE NOT is_default ORDER BY range_end DESC LIMIT 1 \gset
DROP TABLE :last_partition;
SELECT partitions_created > 0 AS created FROM idempotency.idem_maintain();
SELECT to_regclass(:'current_partition') IS NOT NULL AS current_partition_kept;
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('current', '{"c": 1}');
