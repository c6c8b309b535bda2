/* idempotency--1.0--1.1.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.1'" to load this file. \quit

--
-- Version 1.1: fenced claims (claim, retry_after, idem_extend),
-- session-bound claims, statistics (with the library preloaded), daily
-- reconciliation, stale claims, one-time tokens and known-absent filters
-- (see README.md, "Upgrading", for how to run this).
--
-- idem_acquire, idem_complete, idem_release and idem_lookup change their
-- parameters or result columns, so they are dropped and created again, bound
-- to new C symbols (idem_acquire_1_1, ...): a backend that loaded the 1.0
-- library before it was replaced then fails to find the symbol, rather than
-- fill 1.0's result into 1.1's columns.  The old complete and release must
-- go in any case: a new trailing DEFAULT parameter beside the old function
-- would make every 5-argument call ambiguous.  Every privilege granted on
-- the old functions is granted again on the new ones.
--

-- Refuse, before changing anything, where user objects (views, SQL
-- functions with BEGIN ATOMIC bodies, ...) depend on the functions that are
-- re-created: DROP FUNCTION would fail on them with a less helpful message,
-- and CASCADE would drop the user's objects.
DO $$
DECLARE
    dependents text;
BEGIN
    SELECT pg_catalog.string_agg(DISTINCT pg_catalog.pg_describe_object(d.classid, d.objid, d.objsubid), ', ')
      INTO dependents
      FROM pg_catalog.pg_depend d
     WHERE d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
       AND d.refobjid OPERATOR(pg_catalog.=) ANY (ARRAY[
               'idempotency.idem_acquire(text, jsonb, text, interval, interval)'::pg_catalog.regprocedure,
               'idempotency.idem_complete(text, int, jsonb, text, int)'::pg_catalog.regprocedure,
               'idempotency.idem_release(text, text, int)'::pg_catalog.regprocedure,
               'idempotency.idem_lookup(text, text)'::pg_catalog.regprocedure,
               'idempotency.idem_maintain()'::pg_catalog.regprocedure]::pg_catalog.oid[])
       AND d.deptype OPERATOR(pg_catalog.=) ANY (ARRAY['n', 'a']::pg_catalog."char"[]);
    IF dependents IS NOT NULL THEN
        RAISE EXCEPTION 'cannot update extension "idempotency": other objects depend on functions that version 1.1 re-creates'
            USING ERRCODE = 'dependent_objects_still_exist',
                  DETAIL = 'Dependent objects: ' || dependents || '.',
                  HINT = 'Drop them, run ALTER EXTENSION idempotency UPDATE, and create them again (idem_acquire and idem_lookup return more columns in 1.1).';
    END IF;
END
$$;

--
-- Storage: the claim and, for a session-bound claim, its owner session;
-- is_token tells one-time tokens from idempotency keys.  The first three
-- are nullable without a default and is_token has a constant default, so
-- adding them rewrites and scans nothing (but takes ACCESS EXCLUSIVE on the
-- table and every partition for a moment; see README.md).  NULL (false) in
-- every record made by 1.0.  Partitions made later by maintenance copy the
-- columns (LIKE idempotency.records).
--
ALTER TABLE idempotency.records
    ADD COLUMN claim uuid,
    ADD COLUMN owner_pid int,
    ADD COLUMN owner_start timestamptz,
    ADD COLUMN is_token boolean NOT NULL DEFAULT false;

--
-- The old functions are renamed, not dropped, until their privileges have
-- been copied to the new ones.
--
ALTER FUNCTION idempotency.idem_acquire(text, jsonb, text, interval, interval)
    RENAME TO idem_acquire_1_0;
ALTER FUNCTION idempotency.idem_complete(text, int, jsonb, text, int)
    RENAME TO idem_complete_1_0;
ALTER FUNCTION idempotency.idem_release(text, text, int)
    RENAME TO idem_release_1_0;
ALTER FUNCTION idempotency.idem_lookup(text, text)
    RENAME TO idem_lookup_1_0;

-- idem_acquire's row, as a named composite type rather than OUT parameters:
-- the same columns, but the executor takes a named type's descriptor from
-- the type cache, where OUT parameters make every execution build it again
-- from pg_proc (about 7 % of a replay's instructions).
CREATE TYPE idempotency.acquire_result AS (
    outcome         text,
    response_status int,
    response_body   jsonb,
    attempt         int,
    expires_at      timestamptz,
    claim           uuid,
    retry_after     int);

CREATE FUNCTION idempotency.idem_acquire(
    key             text,
    request         jsonb    DEFAULT NULL,
    scope           text     DEFAULT '',
    ttl             interval DEFAULT NULL,
    lease           interval DEFAULT NULL,
    session_bound   boolean  DEFAULT false)
RETURNS SETOF idempotency.acquire_result
AS 'MODULE_PATHNAME', 'idem_acquire_1_1'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;

CREATE FUNCTION idempotency.idem_complete(
    key             text,
    response_status int,
    response_body   jsonb DEFAULT NULL,
    scope           text  DEFAULT '',
    attempt         int   DEFAULT NULL,
    claim           uuid  DEFAULT NULL)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_complete_1_1'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idempotency.idem_release(
    key         text,
    scope       text DEFAULT '',
    attempt     int  DEFAULT NULL,
    claim       uuid DEFAULT NULL)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_release_1_1'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idempotency.idem_lookup(
    key         text,
    scope       text DEFAULT '')
RETURNS TABLE (status text, request_hash bytea, response_status int,
               response_body jsonb, attempt int, created_at timestamptz,
               locked_until timestamptz, completed_at timestamptz,
               expires_at timestamptz, owner_pid int)
AS 'MODULE_PATHNAME', 'idem_lookup_1_1'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;

CREATE FUNCTION idempotency.idem_extend(
    key         text,
    scope       text     DEFAULT '',
    claim       uuid     DEFAULT NULL,
    lease       interval DEFAULT NULL)
RETURNS timestamptz
AS 'MODULE_PATHNAME', 'idem_extend'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

--
-- One-time tokens (the form-submit tokens): records of their own kind.
--
CREATE FUNCTION idempotency.idem_token_issue(
    scope   text     DEFAULT '',
    ttl     interval DEFAULT NULL)
RETURNS text
AS 'MODULE_PATHNAME', 'idem_token_issue'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idempotency.idem_token_consume(
    token   text,
    scope   text DEFAULT '')
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_token_consume'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

--
-- idem_schedule_maintenance, again: a job whose runs fail (pg_cron could not
-- connect, say: it connects to cron.host over TCP, which Debian's default
-- pg_hba.conf refuses without a password) is otherwise silent, and
-- maintenance never runs.  So it now warns when any of the last five runs
-- of this database's job failed.  And since pg_cron keeps the cron.host a
-- job was scheduled with, a job whose host is no longer cron.host is
-- scheduled anew, so that calling it again after fixing cron.host fixes
-- the job too.
--
CREATE OR REPLACE FUNCTION idempotency.idem_schedule_maintenance(schedule text DEFAULT '*/10 * * * *')
RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    job_name    text := 'idempotency-maintenance:' || current_database();
    failed      bigint;
    runs        bigint;
    last_error  text;
BEGIN
    IF schedule IS NULL THEN
        RAISE EXCEPTION 'schedule must not be null'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    PERFORM idempotency.cron_check(schedule);
    IF to_regclass('cron.job_run_details') IS NOT NULL THEN
        SELECT count(*) FILTER (WHERE r.status = 'failed'), count(*),
               (array_agg(r.return_message ORDER BY r.runid DESC)
                    FILTER (WHERE r.status = 'failed'))[1]
          INTO failed, runs, last_error
          FROM (SELECT d.runid, d.status, d.return_message
                  FROM cron.job j
                  JOIN cron.job_run_details d ON d.jobid = j.jobid
                 WHERE j.jobname = job_name AND j.username = current_user
                 ORDER BY d.runid DESC
                 LIMIT 5) r;
        IF failed > 0 THEN
            RAISE WARNING '% of the last % runs of pg_cron job "%" failed: %',
                          failed, runs, job_name, coalesce(last_error, '(no message)')
                USING HINT = 'pg_cron connects to cron.host (default localhost) over TCP, which Debian''s default pg_hba.conf refuses without a password: set cron.host to the socket directory (Debian: ''/var/run/postgresql'') or cron.use_background_workers = on, restart the server, then call idem_schedule_maintenance again.  SELECT * FROM cron.job_run_details shows every run.';
        END IF;
    END IF;
    IF EXISTS (SELECT FROM cron.job j
                WHERE j.jobname = job_name AND j.username = current_user
                  AND j.nodename IS DISTINCT FROM current_setting('cron.host', true)) THEN
        PERFORM cron.unschedule(job_name);
    END IF;
    -- pg_cron replaces the job of the same name and user
    RETURN cron.schedule_in_database(job_name, schedule,
                                     'SELECT idempotency.idem_maintain()',
                                     current_database());
END
$$;

--
-- Statistics, kept in shared memory when the library is preloaded
-- (shared_preload_libraries); otherwise these raise 55000 with a hint.
--
CREATE FUNCTION idempotency.idem_stats(
    OUT datname                 name,
    OUT acquired                bigint,
    OUT taken_over              bigint,
    OUT replayed                bigint,
    OUT mismatched              bigint,
    OUT in_progress             bigint,
    OUT completed               bigint,
    OUT released                bigint,
    OUT waits                   bigint,
    OUT wait_time               double precision,
    OUT tokens_issued           bigint,
    OUT tokens_consumed         bigint,
    OUT acquire_duration_sum    double precision,
    OUT acquire_duration_count  bigint,
    OUT stats_reset             timestamptz)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_stats'
LANGUAGE C VOLATILE STRICT PARALLEL SAFE;

CREATE FUNCTION idempotency.idem_acquire_histogram(
    OUT datname name,
    OUT le      double precision,
    OUT count   bigint)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_acquire_histogram'
LANGUAGE C VOLATILE STRICT PARALLEL SAFE;

CREATE FUNCTION idempotency.idem_stats_reset()
RETURNS timestamptz
AS 'MODULE_PATHNAME', 'idem_stats_reset'
LANGUAGE C VOLATILE STRICT PARALLEL UNSAFE;

CREATE FUNCTION idempotency.idem_stats_enabled()
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_stats_enabled'
LANGUAGE C STABLE STRICT PARALLEL SAFE;

-- The seed's counters, one row per database (wait_time in milliseconds)
CREATE VIEW idempotency.stats AS
SELECT s.datname, s.acquired, s.taken_over, s.replayed, s.mismatched,
       s.in_progress, s.completed, s.released, s.waits, s.wait_time,
       s.tokens_issued, s.tokens_consumed, s.stats_reset
  FROM idempotency.idem_stats() s;

COMMENT ON VIEW idempotency.stats IS
    'what idem_* calls answered, per database, since stats_reset';

-- The cumulative histogram of idem_acquire's duration (le in seconds)
CREATE VIEW idempotency.acquire_duration AS
SELECT h.datname, h.le, h.count
  FROM idempotency.idem_acquire_histogram() h;

COMMENT ON VIEW idempotency.acquire_duration IS
    'cumulative histogram of idem_acquire duration per database, Prometheus style';

--
-- idempotency.stale_claims: live processing claims whose lease has run out
-- or whose session-bound owner is gone, for an operator to review (the
-- next idem_acquire of the key takes them over).  It reads every live
-- partition: no index serves it, so that completions stay HOT updates.  A
-- security barrier: a reader's own conditions never see the rows it leaves
-- out (completed records, tokens).
--
CREATE FUNCTION idempotency.owner_alive(owner_pid int, owner_start timestamptz)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_owner_alive_sql'
LANGUAGE C VOLATILE STRICT PARALLEL RESTRICTED;

CREATE VIEW idempotency.stale_claims WITH (security_barrier) AS
SELECT r.scope, r.key, r.attempt, r.created_at, r.locked_until, r.expires_at,
       r.owner_pid,
       CASE WHEN r.owner_pid IS NULL THEN 'lease expired'
            ELSE 'owner gone' END AS reason
  FROM idempotency.records r
 WHERE r.status OPERATOR(pg_catalog.=) 'processing'
   AND NOT r.is_token
   AND r.expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()
   AND CASE WHEN r.owner_pid IS NULL
            THEN r.locked_until OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp()
            ELSE NOT idempotency.owner_alive(r.owner_pid, r.owner_start) END;

COMMENT ON VIEW idempotency.stale_claims IS
    'live processing claims whose lease ran out or whose owner session is gone';

--
-- Daily reconciliation: idem_maintain() adds each UTC day's increase of
-- this database's counters to idempotency.daily, kept for
-- idempotency.stats_retention.  daily_base holds the counters as last
-- seen; a counter that went down (a server crash, idem_stats_reset) starts
-- a new base, so no negative increase is ever written.
--
CREATE TABLE idempotency.daily (
    day             date NOT NULL,
    datname         name NOT NULL,
    acquired        bigint NOT NULL DEFAULT 0,
    taken_over      bigint NOT NULL DEFAULT 0,
    replayed        bigint NOT NULL DEFAULT 0,
    mismatched      bigint NOT NULL DEFAULT 0,
    in_progress     bigint NOT NULL DEFAULT 0,
    completed       bigint NOT NULL DEFAULT 0,
    released        bigint NOT NULL DEFAULT 0,
    waits           bigint NOT NULL DEFAULT 0,
    wait_time       double precision NOT NULL DEFAULT 0,
    tokens_issued   bigint NOT NULL DEFAULT 0,
    tokens_consumed bigint NOT NULL DEFAULT 0,
    acquire_count   bigint NOT NULL DEFAULT 0,
    acquire_time    double precision NOT NULL DEFAULT 0,
    PRIMARY KEY (day, datname)
);

COMMENT ON TABLE idempotency.daily IS
    'increase of the statistics per UTC day and database, written by idem_maintain()';

SELECT pg_catalog.pg_extension_config_dump('idempotency.daily', '');

CREATE TABLE idempotency.daily_base (
    datname         name PRIMARY KEY,
    stats_reset     timestamptz NOT NULL,
    sampled_at      timestamptz NOT NULL,
    acquired        bigint NOT NULL,
    taken_over      bigint NOT NULL,
    replayed        bigint NOT NULL,
    mismatched      bigint NOT NULL,
    in_progress     bigint NOT NULL,
    completed       bigint NOT NULL,
    released        bigint NOT NULL,
    waits           bigint NOT NULL,
    wait_time       double precision NOT NULL,
    tokens_issued   bigint NOT NULL,
    tokens_consumed bigint NOT NULL,
    acquire_count   bigint NOT NULL,
    acquire_time    double precision NOT NULL
);

COMMENT ON TABLE idempotency.daily_base IS
    'the statistics as idem_maintain() last saw them (the base of the next increase)';

--
-- record_daily(): the reconciliation step of idem_maintain().  Nothing to
-- record without statistics (old days still go).  Concurrent runs take
-- turns on daily_base, so no increase is counted twice; a run that cannot
-- have it within idempotency.maintenance_lock_timeout leaves the increase
-- to the next run.
--
CREATE FUNCTION idempotency.record_daily()
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '100ms'
AS $$
DECLARE
    cur         record;
    last        idempotency.daily_base;
    fresh       boolean;
    -- first: calling it loads the library, which defines the settings
    settings    record := idempotency.maintenance_settings();
    today       date := (clock_timestamp() AT TIME ZONE 'UTC')::date;
    retention   interval := current_setting('idempotency.stats_retention')::interval;
BEGIN
    DELETE FROM idempotency.daily d WHERE d.day <= today - retention;
    IF NOT idempotency.idem_stats_enabled() THEN
        RETURN;
    END IF;

    PERFORM set_config('lock_timeout', settings.lock_timeout_ms || 'ms', true);
    BEGIN
        LOCK TABLE idempotency.daily_base IN SHARE ROW EXCLUSIVE MODE;
    EXCEPTION WHEN lock_not_available THEN
        RAISE LOG 'idempotency maintenance could not lock table "idempotency.daily_base", leaving the daily statistics to its next run';
        RETURN;
    END;
    SELECT * INTO cur FROM idempotency.idem_stats() s
     WHERE s.datname = current_database();
    IF FOUND THEN
        SELECT * INTO last FROM idempotency.daily_base b
         WHERE b.datname = current_database();
        -- a new base after a reset or a restart that lost the counters
        fresh := last.datname IS NULL
              OR last.stats_reset IS DISTINCT FROM cur.stats_reset
              OR cur.acquired < last.acquired OR cur.taken_over < last.taken_over
              OR cur.replayed < last.replayed OR cur.mismatched < last.mismatched
              OR cur.in_progress < last.in_progress OR cur.completed < last.completed
              OR cur.released < last.released OR cur.waits < last.waits
              OR cur.wait_time < last.wait_time
              OR cur.tokens_issued < last.tokens_issued
              OR cur.tokens_consumed < last.tokens_consumed
              OR cur.acquire_duration_count < last.acquire_count
              OR cur.acquire_duration_sum < last.acquire_time;
        IF fresh THEN
            last := ROW(current_database(), cur.stats_reset, clock_timestamp(),
                        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
        END IF;

        INSERT INTO idempotency.daily AS d
               (day, datname, acquired, taken_over, replayed, mismatched,
                in_progress, completed, released, waits, wait_time,
                tokens_issued, tokens_consumed, acquire_count, acquire_time)
        VALUES (today, current_database(),
                cur.acquired - last.acquired, cur.taken_over - last.taken_over,
                cur.replayed - last.replayed, cur.mismatched - last.mismatched,
                cur.in_progress - last.in_progress, cur.completed - last.completed,
                cur.released - last.released, cur.waits - last.waits,
                cur.wait_time - last.wait_time,
                cur.tokens_issued - last.tokens_issued,
                cur.tokens_consumed - last.tokens_consumed,
                cur.acquire_duration_count - last.acquire_count,
                cur.acquire_duration_sum - last.acquire_time)
        ON CONFLICT (day, datname) DO UPDATE SET
            acquired = d.acquired + excluded.acquired,
            taken_over = d.taken_over + excluded.taken_over,
            replayed = d.replayed + excluded.replayed,
            mismatched = d.mismatched + excluded.mismatched,
            in_progress = d.in_progress + excluded.in_progress,
            completed = d.completed + excluded.completed,
            released = d.released + excluded.released,
            waits = d.waits + excluded.waits,
            wait_time = d.wait_time + excluded.wait_time,
            tokens_issued = d.tokens_issued + excluded.tokens_issued,
            tokens_consumed = d.tokens_consumed + excluded.tokens_consumed,
            acquire_count = d.acquire_count + excluded.acquire_count,
            acquire_time = d.acquire_time + excluded.acquire_time;

        INSERT INTO idempotency.daily_base AS b
        VALUES (current_database(), cur.stats_reset, clock_timestamp(),
                cur.acquired, cur.taken_over, cur.replayed, cur.mismatched,
                cur.in_progress, cur.completed, cur.released, cur.waits,
                cur.wait_time, cur.tokens_issued, cur.tokens_consumed,
                cur.acquire_duration_count, cur.acquire_duration_sum)
        ON CONFLICT (datname) DO UPDATE SET
            stats_reset = excluded.stats_reset,
            sampled_at = excluded.sampled_at,
            acquired = excluded.acquired, taken_over = excluded.taken_over,
            replayed = excluded.replayed, mismatched = excluded.mismatched,
            in_progress = excluded.in_progress, completed = excluded.completed,
            released = excluded.released, waits = excluded.waits,
            wait_time = excluded.wait_time,
            tokens_issued = excluded.tokens_issued,
            tokens_consumed = excluded.tokens_consumed,
            acquire_count = excluded.acquire_count,
            acquire_time = excluded.acquire_time;
    END IF;
END
$$;

--
-- Known-absent filters (with the library preloaded and idempotency.filters
-- above zero; see filter.c): a filter per live partition in shared memory
-- lets idem_acquire rule a new key out of a partition without descending
-- its index.  Every insert must add its key to the filter first: the C
-- path does so itself, every other path (SQL INSERT, COPY, UPDATE, logical
-- replication apply) through this trigger.  It is named to fire last among
-- the BEFORE ROW triggers (a later one could change the key; the trigger
-- checks and invalidates the filter if one does) and is ENABLE ALWAYS, so
-- that it also fires where session_replication_role is replica.  Cloned to
-- every partition, those maintenance attaches later included.
--
CREATE FUNCTION idempotency.records_note_key()
RETURNS trigger
AS 'MODULE_PATHNAME', 'idem_records_note_key'
LANGUAGE C;

CREATE TRIGGER zz_records_filter
    BEFORE INSERT OR UPDATE ON idempotency.records
    FOR EACH ROW EXECUTE FUNCTION idempotency.records_note_key();

ALTER TABLE idempotency.records ENABLE ALWAYS TRIGGER zz_records_filter;

CREATE FUNCTION idempotency.build_filters(max_wait interval DEFAULT NULL)
RETURNS int
AS 'MODULE_PATHNAME', 'idem_build_filters'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idempotency.idem_filters(
    OUT partition       regclass,
    OUT state           text,
    OUT size_bytes      bigint,
    OUT bits_set        bigint,
    OUT estimated_keys  bigint)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_filters_sql'
LANGUAGE C VOLATILE STRICT PARALLEL SAFE;

--
-- idem_maintain() gains the daily reconciliation and the filters' builds.
-- 1.0's function keeps its body as idempotency.maintain_partitions(); the
-- new one runs record_daily() and build_filters() first, so that the ACCESS
-- EXCLUSIVE lock partition work takes is held for no longer than before
-- (a build scans whole partitions; it takes only SHARE UPDATE EXCLUSIVE on
-- each, which acquires do not wait for).  Each runs in a subtransaction,
-- so that its failure (a role without rights to the statistics, say) never
-- keeps the partitions from being made and dropped: it is a WARNING.  The
-- partitions made here get their filters at the next run.  The pg_cron job
-- calls idem_maintain() by name.
--
-- Then, before the partition work, the filter trigger is put back to
-- ENABLE ALWAYS where something left it plain ENABLE (the state ALTER TABLE ... ENABLE TRIGGER ALL gives
-- it, which pg_restore --disable-triggers runs): builds refuse such a
-- partition, since the trigger would not fire for logical replication's
-- apply.  Only where the trigger is otherwise the extension's own (its
-- function, BEFORE INSERT OR UPDATE FOR EACH ROW, no WHEN, no columns), one
-- table at a time with ONLY (the parent's state is what new partitions
-- copy), the parent last, each within maintenance_lock_timeout (its SHARE
-- ROW EXCLUSIVE lock, held to the end of the run, keeps claims out of that
-- table meanwhile); the next run builds the filters.  Before the partition
-- work, so that no lock is waited for while ACCESS EXCLUSIVE is held.
-- A trigger disabled, ENABLE REPLICA, changed or missing is left alone and
-- named in a WARNING, which the server log keeps.
--
ALTER FUNCTION idempotency.idem_maintain() RENAME TO maintain_partitions;

CREATE FUNCTION idempotency.idem_maintain()
RETURNS TABLE (partitions_created int, partitions_dropped int)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    rel         pg_catalog.regclass;
    trig_state  "char";
    intact      boolean;
    lock_wait   text;
BEGIN
    BEGIN
        PERFORM idempotency.record_daily();
    EXCEPTION WHEN OTHERS THEN
        RAISE WARNING 'idempotency maintenance could not record the daily statistics: %', SQLERRM
            USING ERRCODE = SQLSTATE;
    END;
    IF pg_catalog.current_setting('idempotency.filters', true)
       OPERATOR(pg_catalog.<>) '0' THEN
        BEGIN
            PERFORM idempotency.build_filters(pg_catalog.make_interval(
                secs => (idempotency.maintenance_settings()).lock_timeout_ms
                        OPERATOR(pg_catalog./) 1000.0));
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'idempotency maintenance could not build the filters: %', SQLERRM
                USING ERRCODE = SQLSTATE;
        END;
        lock_wait := pg_catalog.current_setting('lock_timeout');
        BEGIN
            PERFORM pg_catalog.set_config('lock_timeout',
                (idempotency.maintenance_settings()).lock_timeout_ms OPERATOR(pg_catalog.||) 'ms',
                true);
            FOR rel, trig_state, intact IN
                SELECT c.oid::pg_catalog.regclass, t.tgenabled,
                       t.tgfoid OPERATOR(pg_catalog.=)
                           'idempotency.records_note_key()'::pg_catalog.regprocedure
                       AND t.tgtype OPERATOR(pg_catalog.=) 23
                       AND t.tgqual IS NULL
                       AND t.tgnargs OPERATOR(pg_catalog.=) 0
                       AND pg_catalog.cardinality(t.tgattr::pg_catalog.int2[]) OPERATOR(pg_catalog.=) 0
                  FROM pg_catalog.pg_class c
                  LEFT JOIN pg_catalog.pg_trigger t
                    ON t.tgrelid OPERATOR(pg_catalog.=) c.oid
                   AND t.tgname OPERATOR(pg_catalog.=) 'zz_records_filter'
                 WHERE (c.oid OPERATOR(pg_catalog.=) 'idempotency.records'::pg_catalog.regclass
                        OR c.oid IN (SELECT p.partition FROM idempotency.partitions p))
                   AND t.tgenabled IS DISTINCT FROM 'A'
                 ORDER BY c.oid OPERATOR(pg_catalog.=) 'idempotency.records'::pg_catalog.regclass, c.oid
            LOOP
                IF intact AND trig_state OPERATOR(pg_catalog.=) 'O' THEN
                    BEGIN
                        EXECUTE pg_catalog.format(
                            'ALTER TABLE ONLY %s ENABLE ALWAYS TRIGGER zz_records_filter', rel);
                        RAISE LOG 'idempotency maintenance set trigger "zz_records_filter" of table "%" back to ENABLE ALWAYS',
                            rel;
                    EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
                        RAISE LOG 'idempotency maintenance could not lock table "%" to set its trigger "zz_records_filter" back to ENABLE ALWAYS, leaving it to its next run',
                            rel;
                    END;
                ELSIF intact THEN
                    RAISE WARNING 'table "%" has no known-absent filter: its trigger "zz_records_filter" is %',
                        rel, CASE trig_state WHEN 'D' THEN 'disabled' ELSE 'ENABLE REPLICA' END
                      USING HINT = pg_catalog.format(
                          'Once nothing needs it so, run ALTER TABLE ONLY %s ENABLE ALWAYS TRIGGER zz_records_filter;', rel);
                ELSE
                    RAISE WARNING 'table "%" has no known-absent filter: its trigger "zz_records_filter" is %',
                        rel, CASE WHEN trig_state IS NULL THEN 'missing'
                                  ELSE 'not the one the extension made' END;
                END IF;
            END LOOP;
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'idempotency maintenance could not check the filter triggers: %', SQLERRM
                USING ERRCODE = SQLSTATE;
        END;
        PERFORM pg_catalog.set_config('lock_timeout', lock_wait, true);
    END IF;
    RETURN QUERY SELECT m.partitions_created, m.partitions_dropped
                   FROM idempotency.maintain_partitions() m;
END
$$;

-- Nothing is granted to PUBLIC, as in 1.0.
REVOKE ALL ON FUNCTION idempotency.idem_acquire(text, jsonb, text, interval, interval, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_complete(text, int, jsonb, text, int, uuid) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_release(text, text, int, uuid) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_lookup(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_extend(text, text, uuid, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_token_issue(text, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_token_consume(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_stats() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_acquire_histogram() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_stats_reset() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_stats_enabled() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.owner_alive(int, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.record_daily() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_maintain() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.records_note_key() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.build_filters(interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_filters() FROM PUBLIC;

--
-- Grant on each new function what was granted on the old one.  idem_extend
-- is granted to whoever may call idem_complete (the holder of a claim).
--
-- Privileges granted inside an extension script are recorded as the
-- extension's initial privileges (pg_init_privs), which pg_dump leaves out.
-- These are the user's own grants, so the initial privileges are set back
-- to what a fresh install of 1.1 records, and pg_dump keeps dumping them.
--
DO $$
DECLARE
    pair        record;
    grant_row   record;
    initial     pg_catalog.aclitem[];
BEGIN
    FOR pair IN
        SELECT o.oid AS old_oid, n.oid AS new_oid, n.proowner
          FROM (VALUES
                ('idempotency.idem_acquire_1_0(text, jsonb, text, interval, interval)',
                 'idempotency.idem_acquire(text, jsonb, text, interval, interval, boolean)'),
                ('idempotency.idem_complete_1_0(text, int, jsonb, text, int)',
                 'idempotency.idem_complete(text, int, jsonb, text, int, uuid)'),
                ('idempotency.idem_complete_1_0(text, int, jsonb, text, int)',
                 'idempotency.idem_extend(text, text, uuid, interval)'),
                ('idempotency.idem_release_1_0(text, text, int)',
                 'idempotency.idem_release(text, text, int, uuid)'),
                ('idempotency.idem_lookup_1_0(text, text)',
                 'idempotency.idem_lookup(text, text)'),
                ('idempotency.maintain_partitions()',
                 'idempotency.idem_maintain()'),
                ('idempotency.maintain_partitions()',
                 'idempotency.record_daily()')) AS f(old_sig, new_sig)
          JOIN pg_catalog.pg_proc o
            ON o.oid OPERATOR(pg_catalog.=) f.old_sig::pg_catalog.regprocedure
          JOIN pg_catalog.pg_proc n
            ON n.oid OPERATOR(pg_catalog.=) f.new_sig::pg_catalog.regprocedure
    LOOP
        SELECT p.proacl INTO initial
          FROM pg_catalog.pg_proc p
         WHERE p.oid OPERATOR(pg_catalog.=) pair.new_oid;

        FOR grant_row IN
            SELECT a.grantee, a.is_grantable
              FROM pg_catalog.pg_proc p,
                   LATERAL pg_catalog.aclexplode(p.proacl) a
             WHERE p.oid OPERATOR(pg_catalog.=) pair.old_oid
               AND a.privilege_type OPERATOR(pg_catalog.=) 'EXECUTE'
               AND a.grantee OPERATOR(pg_catalog.<>) pair.proowner
        LOOP
            EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO %s%s',
                pair.new_oid::pg_catalog.regprocedure,
                CASE WHEN grant_row.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                     ELSE grant_row.grantee::pg_catalog.regrole::pg_catalog.text END,
                CASE WHEN grant_row.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
        END LOOP;

        UPDATE pg_catalog.pg_init_privs
           SET initprivs = initial
         WHERE objoid OPERATOR(pg_catalog.=) pair.new_oid
           AND classoid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
           AND objsubid OPERATOR(pg_catalog.=) 0;

        -- From PostgreSQL 17 on, the roles named in initial privileges are
        -- also recorded as shared dependencies (deptype 'i'); those of the
        -- grants just made go with them, or the roles could not be dropped.
        IF pg_catalog.current_setting('server_version_num')::pg_catalog.int4
           OPERATOR(pg_catalog.>=) 170000 THEN
            DELETE FROM pg_catalog.pg_shdepend d
             WHERE d.deptype OPERATOR(pg_catalog.=) 'i'
               AND d.dbid OPERATOR(pg_catalog.=)
                   (SELECT db.oid FROM pg_catalog.pg_database db
                     WHERE db.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
               AND d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
               AND d.objid OPERATOR(pg_catalog.=) pair.new_oid
               AND d.objsubid OPERATOR(pg_catalog.=) 0
               AND NOT EXISTS (SELECT FROM pg_catalog.aclexplode(initial) a
                                WHERE a.grantee OPERATOR(pg_catalog.=) d.refobjid
                                   OR a.grantor OPERATOR(pg_catalog.=) d.refobjid);
        END IF;
    END LOOP;
END
$$;

DROP FUNCTION idempotency.idem_acquire_1_0(text, jsonb, text, interval, interval);
DROP FUNCTION idempotency.idem_complete_1_0(text, int, jsonb, text, int);
DROP FUNCTION idempotency.idem_release_1_0(text, text, int);
DROP FUNCTION idempotency.idem_lookup_1_0(text, text);
