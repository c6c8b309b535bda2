--
-- 16_stats: the statistics (the library is preloaded by the test cluster).
-- Every counter after a known sequence of calls, the histogram's shape,
-- idem_stats_reset and who may call it, and the daily reconciliation of
-- idem_maintain: each day's increase, never a negative one.
--
SET idempotency.wait_timeout = 0;
SELECT idempotency.idem_stats_enabled();

-- Everything this file counts starts from zero.
SELECT idempotency.idem_stats_reset() <= pg_catalog.clock_timestamp() AS reset_now;
SELECT acquired, taken_over, replayed, mismatched, in_progress, completed,
       released, waits, wait_time, tokens_issued, tokens_consumed
  FROM idempotency.stats WHERE datname = pg_catalog.current_database();

-- Four new claims (one in a transaction rolled back below) and a takeover,
-- a replay, two mismatches, one in_progress (a claim still processing), a
-- completion, a release.
SELECT outcome FROM idempotency.idem_acquire('st-1', '{"a": 1}');
SELECT outcome FROM idempotency.idem_acquire('st-1', '{"a": 1}');	-- in_progress
SELECT idempotency.idem_complete('st-1', 201, '{"id": 1}');
SELECT idempotency.idem_complete('st-1', 201, '{"id": 1}');		-- false: not counted
SELECT outcome FROM idempotency.idem_acquire('st-1', '{"a": 1}');	-- replay
SELECT outcome FROM idempotency.idem_acquire('st-1', '{"a": 2}');	-- mismatch
SELECT outcome FROM idempotency.idem_acquire('st-1', '{"a": 3}');	-- mismatch
SELECT outcome FROM idempotency.idem_acquire('st-2');
SELECT idempotency.idem_release('st-2');
SELECT idempotency.idem_release('st-2');					-- false: not counted
SELECT outcome FROM idempotency.idem_acquire('st-3', lease => '1 millisecond');
SELECT pg_catalog.pg_sleep(0.01);
SELECT outcome, attempt FROM idempotency.idem_acquire('st-3');		-- taken over
-- Errors count nothing.
SELECT public.sqlstate_of($$SELECT idempotency.idem_acquire(NULL)$$);
SELECT public.sqlstate_of($$SELECT idempotency.idem_complete('st-none', 200)$$);
-- Tokens: two issued, one consumed (the second consume is false).
SELECT idempotency.idem_token_issue('st') AS tok \gset
SELECT idempotency.idem_token_issue('st') IS NOT NULL AS issued;
SELECT idempotency.idem_token_consume(:'tok', 'st'), idempotency.idem_token_consume(:'tok', 'st');

-- Counted per call, whatever the transaction does afterwards.
BEGIN;
SELECT outcome FROM idempotency.idem_acquire('st-rolled-back');
ROLLBACK;

SELECT acquired, taken_over, replayed, mismatched, in_progress, completed,
       released, waits, wait_time, tokens_issued, tokens_consumed
  FROM idempotency.stats WHERE datname = pg_catalog.current_database();

-- The histogram: 17 cumulative buckets from 50 us to 5 s and Infinity, the
-- last one counting every acquire (9 so far), never decreasing.
SELECT pg_catalog.count(*) AS buckets,
       pg_catalog.min(le) AS first_le,
       pg_catalog.max(le) FILTER (WHERE le < 'Infinity') AS last_finite_le,
       pg_catalog.max(count) FILTER (WHERE le = 'Infinity') AS total,
       pg_catalog.bool_and(count >= 0) AS non_negative
  FROM idempotency.acquire_duration WHERE datname = pg_catalog.current_database();
SELECT pg_catalog.bool_and(count >= prev) AS cumulative
  FROM (SELECT count, pg_catalog.lag(count, 1, 0::bigint) OVER (ORDER BY le) AS prev
          FROM idempotency.acquire_duration
         WHERE datname = pg_catalog.current_database()) h;
SELECT acquire_duration_count,
       acquire_duration_sum > 0 AND acquire_duration_sum < 10 AS sum_in_seconds
  FROM idempotency.idem_stats() WHERE datname = pg_catalog.current_database();

-- A wait is counted with its time: another session's claim held in an open
-- transaction cannot be made from here, so wait on a lease instead.
-- wait_time counts the sleeps between the reads of the record, not the
-- reads, and the wait ends at wait_timeout after the call began: on a busy
-- machine it is less than wait_timeout, never more than the call took.
-- wait_timeout is 30 ms, or 20 times what a call that does not wait took
-- just before on a machine slow enough to need it, so that the call still
-- sleeps at least once.
SELECT outcome FROM idempotency.idem_acquire('st-wait', lease => '1 minute');
SELECT pg_catalog.clock_timestamp() AS t0 \gset
SELECT outcome FROM idempotency.idem_acquire('st-wait');		-- in_progress, no wait
SELECT GREATEST(30, pg_catalog.ceil(20 * 1000 * pg_catalog.date_part('epoch',
         pg_catalog.clock_timestamp() - :'t0'::timestamptz)))::integer
       AS wait_ms \gset
SET idempotency.wait_timeout = :wait_ms;
SELECT pg_catalog.clock_timestamp() AS t1 \gset
SELECT outcome FROM idempotency.idem_acquire('st-wait');		-- in_progress after a wait
SELECT 1000 * pg_catalog.date_part('epoch',
         pg_catalog.clock_timestamp() - :'t1'::timestamptz) AS call_ms \gset
SET idempotency.wait_timeout = 0;
SELECT :call_ms >= :wait_ms AS answered_after_wait_timeout,
       waits, wait_time > 0 AND wait_time <= :call_ms AS wait_time_within_the_call
  FROM idempotency.stats WHERE datname = pg_catalog.current_database();

-- Only the owner of idempotency.records may reset.
CREATE ROLE idem_stats_reader;
GRANT USAGE ON SCHEMA idempotency TO idem_stats_reader;
GRANT EXECUTE ON FUNCTION idempotency.idem_stats_reset(), idempotency.idem_stats() TO idem_stats_reader;
GRANT SELECT ON idempotency.stats TO idem_stats_reader;
SET ROLE idem_stats_reader;
SELECT acquired FROM idempotency.stats WHERE datname = pg_catalog.current_database();
SELECT public.sqlstate_of($$SELECT idempotency.idem_stats_reset()$$) AS reset_by_reader;
SELECT public.sqlstate_of($$SELECT * FROM idempotency.acquire_duration$$) AS histogram_without_grant;
RESET ROLE;
REVOKE ALL ON SCHEMA idempotency FROM idem_stats_reader;
REVOKE ALL ON FUNCTION idempotency.idem_stats_reset(), idempotency.idem_stats() FROM idem_stats_reader;
REVOKE ALL ON idempotency.stats FROM idem_stats_reader;
DROP ROLE idem_stats_reader;

--
-- Daily reconciliation.  The first run takes everything since the reset as
-- today's increase; a run with nothing new adds nothing; a reset starts a
-- new base: the next increase is what was counted since, never negative.
--
DELETE FROM idempotency.daily;
DELETE FROM idempotency.daily_base;
SELECT idempotency.idem_stats_reset() IS NOT NULL AS reset;
SELECT outcome FROM idempotency.idem_acquire('st-d1');
SELECT outcome FROM idempotency.idem_acquire('st-d2');
SELECT idempotency.idem_complete('st-d1', 200);
SELECT outcome FROM idempotency.idem_acquire('st-d1');			-- replay
SELECT pg_catalog.count(*) FROM idempotency.idem_maintain();
SELECT day = (pg_catalog.clock_timestamp() AT TIME ZONE 'UTC')::date AS today,
       datname = pg_catalog.current_database() AS this_db,
       acquired, replayed, completed, acquire_count
  FROM idempotency.daily;
SELECT pg_catalog.count(*) FROM idempotency.idem_maintain();
SELECT acquired, replayed, completed, acquire_count FROM idempotency.daily;
SELECT outcome FROM idempotency.idem_acquire('st-d1');			-- replay
SELECT pg_catalog.count(*) FROM idempotency.idem_maintain();
SELECT acquired, replayed, completed, acquire_count FROM idempotency.daily;
-- a reset: counters go down; then one more replay
SELECT idempotency.idem_stats_reset() IS NOT NULL AS reset;
SELECT outcome FROM idempotency.idem_acquire('st-d1');			-- replay
SELECT pg_catalog.count(*) FROM idempotency.idem_maintain();
SELECT acquired, replayed, completed, acquire_count FROM idempotency.daily;
SELECT pg_catalog.bool_and(acquired >= 0 AND replayed >= 0 AND acquire_count >= 0 AND wait_time >= 0)
       AS never_negative FROM idempotency.daily;
-- The seed's question: duplicates blocked per day for the last week.
SELECT day = (pg_catalog.clock_timestamp() AT TIME ZONE 'UTC')::date AS today,
       replayed + in_progress + mismatched AS duplicates_blocked
  FROM idempotency.daily
 WHERE datname = pg_catalog.current_database()
   AND day > (pg_catalog.clock_timestamp() AT TIME ZONE 'UTC')::date - 7
 ORDER BY day;
-- Days older than idempotency.stats_retention go.
INSERT INTO idempotency.daily (day, datname, replayed)
VALUES ((pg_catalog.clock_timestamp() AT TIME ZONE 'UTC')::date - 91, pg_catalog.current_database(), 5),
       ((pg_catalog.clock_timestamp() AT TIME ZONE 'UTC')::date - 89, pg_catalog.current_database(), 7);
SELECT pg_catalog.count(*) FROM idempotency.idem_maintain();
SELECT (pg_catalog.clock_timestamp() AT TIME ZONE 'UTC')::date - day AS days_ago, replayed
  FROM idempotency.daily ORDER BY day;
SET idempotency.stats_retention = '30d';
SELECT pg_catalog.count(*) FROM idempotency.idem_maintain();
SELECT (pg_catalog.clock_timestamp() AT TIME ZONE 'UTC')::date - day AS days_ago
  FROM idempotency.daily ORDER BY day;
RESET idempotency.stats_retention;
SELECT public.sqlstate_of($$SET idempotency.stats_retention = '1h'$$) AS retention_below_a_day;

--
-- stale_claims: a claim whose lease ran out is listed, and a session-bound
-- one whose ownership ended (pg_advisory_unlock_all ends it, as a
-- disconnect would); one with a lease running is not, nor one whose owner
-- lives, nor a completed record, nor a token.
--
SELECT outcome FROM idempotency.idem_acquire('st-owner-gone', session_bound => true);
SELECT pg_catalog.pg_advisory_unlock_all();
SELECT outcome FROM idempotency.idem_acquire('st-owner-alive', session_bound => true);
SELECT outcome FROM idempotency.idem_acquire('st-stale', lease => '1 millisecond');
SELECT outcome FROM idempotency.idem_acquire('st-fresh', lease => '1 hour');
SELECT idempotency.idem_token_issue('st-stale') IS NOT NULL AS token;
SELECT pg_catalog.pg_sleep(0.01);
SELECT key, attempt, owner_pid = pg_catalog.pg_backend_pid() AS owner_was_us, reason
  FROM idempotency.stale_claims
 WHERE key LIKE 'st-%' ORDER BY key;
-- A reader of the view with a leaky function of its own learns nothing of
-- the rows the view leaves out (security barrier): it sees two keys.
CREATE ROLE idem_monitor;
GRANT USAGE ON SCHEMA idempotency TO idem_monitor;
GRANT EXECUTE ON FUNCTION idempotency.owner_alive(int, timestamptz) TO idem_monitor;
GRANT SELECT ON idempotency.stale_claims TO idem_monitor;
SET ROLE idem_monitor;
CREATE FUNCTION pg_temp.peek(k text) RETURNS boolean LANGUAGE plpgsql COST 0.0000001 AS $$
BEGIN
    IF k LIKE 'st-%' THEN
        RAISE NOTICE 'saw %', k;
    END IF;
    RETURN true;
END
$$;
SELECT pg_catalog.count(*) FROM idempotency.stale_claims WHERE pg_temp.peek(key) AND key LIKE 'st-%';
DROP FUNCTION pg_temp.peek(text);
RESET ROLE;
REVOKE ALL ON idempotency.stale_claims FROM idem_monitor;
REVOKE ALL ON FUNCTION idempotency.owner_alive(int, timestamptz) FROM idem_monitor;
REVOKE ALL ON SCHEMA idempotency FROM idem_monitor;
DROP ROLE idem_monitor;
