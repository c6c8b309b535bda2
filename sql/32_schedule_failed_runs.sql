--
-- 32_schedule_failed_runs: idem_schedule_maintenance warns when the last runs
-- of its pg_cron job failed, and schedules anew a job made for another
-- cron.host.  Run in pg_cron's database, 'postgres' in the cluster of
-- scripts/test.sh (cron.database_name); the job is yearly, so it never runs
-- during the test, and the failed runs are written by hand as pg_cron logs
-- them when it cannot connect.
--
\c postgres
SELECT current_setting('cron.database_name') AS cron_database;
SELECT NOT EXISTS (SELECT FROM pg_extension WHERE extname = 'pg_cron') AS made_cron \gset
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS pg_cron;
RESET client_min_messages;
CREATE EXTENSION idempotency;
\set SHOW_CONTEXT never

-- No runs yet: no warning.
SELECT idempotency.idem_schedule_maintenance('0 0 1 1 *') AS jobid \gset
SELECT jobname, schedule, command FROM cron.job WHERE jobid = :jobid;

-- Two runs that could not connect, then one that worked.
INSERT INTO cron.job_run_details (jobid, runid, database, username, command, status, return_message, start_time, end_time)
SELECT :jobid, nextval('cron.runid_seq'), 'postgres', current_user, 'SELECT idempotency.idem_maintain()',
       'failed', 'connection failed', now(), now()
  FROM generate_series(1, 2);
SELECT idempotency.idem_schedule_maintenance('0 0 1 1 *') = :jobid AS same_job;
INSERT INTO cron.job_run_details (jobid, runid, database, username, command, status, return_message, start_time, end_time)
VALUES (:jobid, nextval('cron.runid_seq'), 'postgres', current_user, 'SELECT idempotency.idem_maintain()',
        'succeeded', '1 row', now(), now());
SELECT idempotency.idem_schedule_maintenance('0 0 1 1 *') = :jobid AS same_job;

-- Five runs that worked since: the failures are out of sight, no warning.
INSERT INTO cron.job_run_details (jobid, runid, database, username, command, status, return_message, start_time, end_time)
SELECT :jobid, nextval('cron.runid_seq'), 'postgres', current_user, 'SELECT idempotency.idem_maintain()',
       'succeeded', '1 row', now(), now()
  FROM generate_series(1, 5);
SELECT idempotency.idem_schedule_maintenance('0 0 1 1 *') = :jobid AS same_job;

-- A job made while cron.host was something else is scheduled anew, with
-- today's cron.host.
UPDATE cron.job SET nodename = 'elsewhere' WHERE jobid = :jobid;
SELECT idempotency.idem_schedule_maintenance('0 0 1 1 *') <> :jobid AS new_job;
SELECT count(*) AS jobs, bool_and(nodename = current_setting('cron.host')) AS current_host
  FROM cron.job WHERE jobname = 'idempotency-maintenance:postgres';

SELECT idempotency.idem_unschedule_maintenance();
DELETE FROM cron.job_run_details WHERE command = 'SELECT idempotency.idem_maintain()';
DROP EXTENSION idempotency;
DROP SCHEMA idempotency;
\if :made_cron
DROP EXTENSION pg_cron;
\endif
