/* idempotency--1.0.sql */

-- complain if script is sourced in psql, rather than via CREATE EXTENSION
\echo Use "CREATE EXTENSION idempotency" to load this file. \quit

--
-- Storage
--
-- One row per claimed (scope, key).  The table is range-partitioned on
-- expires_at, which never changes once a record is claimed: a partition whose
-- upper bound has passed holds only expired records and can be dropped whole.
-- A unique index cannot say "one live record per (scope, key)" (a
-- partitioned table's unique index must hold the partition key, and expired
-- records stay until their partition is dropped); the C functions serialize
-- writers of one (scope, key) on a transaction-level lock and look across
-- the live partitions before inserting.  See idempotency.c.
--
-- The index is unique on (scope, key, expires_at) all the same, so that it
-- can serve as the replica identity: logical replication then works on every
-- partition, updates and deletes log only those three columns, and a
-- subscriber finds the row by index on every major.  Two records of one key
-- never share an expires_at (a new claim expires after now, an old one that
-- is still there expired before it), so the uniqueness costs nothing but
-- the check.  Every partition has the index as its replica identity;
-- maintenance keeps that true for the partitions it makes.
--
-- key and scope are COLLATE "C": identity is by bytes, and comparisons in
-- the index are plain memcmp.
--
CREATE TABLE idempotency.records (
    scope           text COLLATE "C" NOT NULL,
    key             text COLLATE "C" NOT NULL,
    status          text NOT NULL
                    CHECK (status IN ('processing', 'completed')),
    request_hash    bytea,
    response_status int
                    CHECK (response_status BETWEEN 100 AND 599),
    response_body   jsonb,
    attempt         int NOT NULL DEFAULT 1 CHECK (attempt >= 1),
    created_at      timestamptz NOT NULL,
    locked_until    timestamptz,
    completed_at    timestamptz,
    expires_at      timestamptz NOT NULL,
    CHECK ((status = 'completed') = (completed_at IS NOT NULL))
) PARTITION BY RANGE (expires_at);

CREATE UNIQUE INDEX records_scope_key_idx
    ON idempotency.records (scope, key, expires_at);
ALTER TABLE idempotency.records
    REPLICA IDENTITY USING INDEX records_scope_key_idx;

-- Rows land here only when no dated partition covers their expires_at
-- (maintenance has not run for too long); no claim ever fails for want of a
-- partition.  Made standalone and attached, as maintenance makes the dated
-- ones, so that its index has a known name for the replica identity.
CREATE TABLE idempotency.records_default
    (LIKE idempotency.records INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
CREATE UNIQUE INDEX records_default_key
    ON idempotency.records_default (scope, key, expires_at);
ALTER TABLE idempotency.records_default
    REPLICA IDENTITY USING INDEX records_default_key;
ALTER TABLE idempotency.records
    ATTACH PARTITION idempotency.records_default DEFAULT;

COMMENT ON TABLE idempotency.records IS
    'idempotency records, one per claimed (scope, key); range-partitioned on expires_at';

-- Rows that wait in DEFAULT are dumped by pg_dump too.
SELECT pg_catalog.pg_extension_config_dump('idempotency.records_default', '');

--
-- The API (see README.md).  All are SECURITY INVOKER: the caller needs the
-- privileges that README.md lists.
--
CREATE FUNCTION idempotency.idem_acquire(
    key         text,
    request     jsonb    DEFAULT NULL,
    scope       text     DEFAULT '',
    ttl         interval DEFAULT NULL,
    lease       interval DEFAULT NULL)
RETURNS TABLE (outcome text, response_status int, response_body jsonb,
               attempt int, expires_at timestamptz)
AS 'MODULE_PATHNAME', 'idem_acquire'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;

CREATE FUNCTION idempotency.idem_complete(
    key             text,
    response_status int,
    response_body   jsonb DEFAULT NULL,
    scope           text  DEFAULT '',
    attempt         int   DEFAULT NULL)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_complete'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idempotency.idem_release(
    key         text,
    scope       text DEFAULT '',
    attempt     int  DEFAULT NULL)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_release'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idempotency.idem_lookup(
    key         text,
    scope       text DEFAULT '')
RETURNS TABLE (status text, request_hash bytea, response_status int,
               response_body jsonb, attempt int, created_at timestamptz,
               locked_until timestamptz, completed_at timestamptz,
               expires_at timestamptz)
AS 'MODULE_PATHNAME', 'idem_lookup'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;

CREATE FUNCTION idempotency.idem_request_hash(request jsonb)
RETURNS bytea
AS 'MODULE_PATHNAME', 'idem_request_hash'
LANGUAGE C IMMUTABLE STRICT PARALLEL SAFE;

-- Nothing is granted to PUBLIC: README.md says what to grant to whom.
REVOKE ALL ON FUNCTION idempotency.idem_acquire(text, jsonb, text, interval, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_complete(text, int, jsonb, text, int) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_release(text, text, int) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_lookup(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_request_hash(jsonb) FROM PUBLIC;

--
-- Partition lifecycle
--

--
-- idempotency.partitions: the partitions of records and their ranges.
-- range_start and range_end are NULL for the DEFAULT partition.
--
CREATE VIEW idempotency.partitions AS
SELECT c.oid::pg_catalog.regclass AS partition,
       (pg_catalog.regexp_match(pg_catalog.pg_get_expr(c.relpartbound, c.oid),
                                'FROM \(''([^'']*)''\)'))[1]::timestamptz AS range_start,
       (pg_catalog.regexp_match(pg_catalog.pg_get_expr(c.relpartbound, c.oid),
                                'TO \(''([^'']*)''\)'))[1]::timestamptz AS range_end,
       pg_catalog.pg_get_expr(c.relpartbound, c.oid) OPERATOR(pg_catalog.=) 'DEFAULT' AS is_default
  FROM pg_catalog.pg_inherits i
  JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) i.inhrelid
 WHERE i.inhparent OPERATOR(pg_catalog.=) 'idempotency.records'::pg_catalog.regclass;

COMMENT ON VIEW idempotency.partitions IS
    'partitions of idempotency.records with their expires_at ranges';

--
-- maintenance_settings(): the settings idem_maintain needs, as the library
-- has them (calling it loads the library; see idempotency.c).
--
CREATE FUNCTION idempotency.maintenance_settings(
    OUT partition_interval interval,
    OUT max_ttl interval,
    OUT lock_timeout_ms int)
AS 'MODULE_PATHNAME', 'idem_maintenance_settings'
LANGUAGE C STABLE STRICT PARALLEL SAFE;

--
-- idem_maintain()
--
-- Creates the partitions that the coming period needs (up to now + max_ttl +
-- two partition widths), moves the live records found in DEFAULT into them,
-- deletes the expired ones found there, and drops every partition whose
-- range has ended: all of its records have expired.
--
-- Logical replication.  Every change to a live record goes through tables a
-- publication of idempotency.records publishes: records moved out of DEFAULT
-- are deleted there, kept in a temporary table while their new partition is
-- attached (ATTACH refuses while DEFAULT still holds rows of its range), and
-- inserted again through idempotency.records, so a subscriber sees a delete
-- and an insert in one transaction.  Each new partition gets a unique index
-- on (scope, key, expires_at) as its replica identity before it is attached.
-- Dropping a partition whose range has ended removes only expired records
-- and is not replicated; a subscriber's own maintenance drops its copy.
--
-- Locking.  When there is nothing to do it takes no lock at all.  Otherwise
-- it takes one ACCESS EXCLUSIVE lock on records (DROP of a partition and
-- ATTACH need that or close to it anyway), waiting at most
-- idempotency.maintenance_lock_timeout, then plans again under the lock and
-- does all the work.  Taking the one lock up front, rather than one per
-- step, means maintenance never waits while holding a lock that application
-- sessions wait for: a lock cycle with idem_acquire cannot form, and traffic
-- waits at most maintenance_lock_timeout plus the run's own few
-- milliseconds.  If the lock cannot be had in time, it logs that and leaves
-- the work to its next run.  Concurrent runs serialize on the same lock.
--
CREATE FUNCTION idempotency.idem_maintain()
RETURNS TABLE (partitions_created int, partitions_dropped int)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '100ms'
AS $$
DECLARE
    settings    record := idempotency.maintenance_settings();
    step        interval := settings.partition_interval;
    step_secs   double precision := extract(epoch FROM settings.partition_interval);
    lock_wait   text := settings.lock_timeout_ms || 'ms';
    now_ts      timestamptz;
    horizon     timestamptz;
    last_end    timestamptz;
    slot_start  timestamptz;
    part        regclass;
    part_name   text;
    moving      boolean := false;
    created     int := 0;
    dropped     int := 0;
    worked      boolean := false;
BEGIN
    -- the function's SET clause confines this to the function
    PERFORM set_config('lock_timeout', lock_wait, true);

    FOR attempt IN 1..2 LOOP
        -- attempt 1 plans without a lock; attempt 2 again under the lock
        -- No claim can expire after now + max_ttl.  A row beyond the
        -- horizon (written by hand, or from before max_ttl was lowered)
        -- stays in DEFAULT, where lookups still find it: following it with
        -- partitions could mean thousands of them under an exclusive lock.
        now_ts := clock_timestamp();
        horizon := now_ts + settings.max_ttl + 2 * step;
        SELECT max(p.range_end) INTO last_end
          FROM idempotency.partitions p WHERE NOT p.is_default;

        EXIT WHEN attempt = 1
              AND last_end >= horizon
              AND NOT EXISTS (SELECT FROM idempotency.partitions p
                               WHERE NOT p.is_default AND p.range_end <= now_ts)
              AND NOT EXISTS (SELECT FROM idempotency.records_default d
                               WHERE d.expires_at < horizon);

        IF attempt = 1 THEN
            BEGIN
                LOCK TABLE idempotency.records IN ACCESS EXCLUSIVE MODE;
            EXCEPTION WHEN lock_not_available THEN
                RAISE LOG 'idempotency maintenance could not lock table "idempotency.records" within %, leaving the work to its next run',
                    lock_wait;
                EXIT;
            END;
            CONTINUE;
        END IF;

        -- Under the lock.  Expired records in DEFAULT go now; live ones are
        -- moved below into the partitions made for them.
        worked := true;
        DELETE FROM idempotency.records_default d WHERE d.expires_at <= now_ts;

        -- New slots continue from the last partition, or start at the
        -- current slot, aligned to the epoch, if that has passed.
        slot_start := to_timestamp(floor(extract(epoch FROM now_ts) / step_secs) * step_secs);
        IF last_end IS NOT NULL AND last_end > slot_start THEN
            slot_start := last_end;
        END IF;

        -- Live records in DEFAULT that the new partitions will cover wait in
        -- a temporary table while those are attached (see above).
        IF slot_start < horizon
           AND EXISTS (SELECT FROM idempotency.records_default d
                        WHERE d.expires_at < horizon) THEN
            moving := true;
            CREATE TEMPORARY TABLE idem_maintain_moving
                (LIKE idempotency.records) ON COMMIT DROP;
        END IF;

        WHILE slot_start < horizon LOOP
            part_name := 'records_p'
                || to_char(slot_start AT TIME ZONE 'UTC', 'YYYYMMDD"_"HH24MISS');
            EXECUTE format('CREATE TABLE idempotency.%I'
                           ' (LIKE idempotency.records INCLUDING DEFAULTS INCLUDING CONSTRAINTS,'
                           '  CHECK (expires_at >= %L AND expires_at < %L))',
                           part_name, slot_start, slot_start + step);
            part := format('idempotency.%I', part_name)::regclass;
            EXECUTE format('CREATE UNIQUE INDEX %I ON %s (scope, key, expires_at)',
                           part_name || '_key', part);
            EXECUTE format('ALTER TABLE %s REPLICA IDENTITY USING INDEX %I',
                           part, part_name || '_key');
            IF moving THEN
                EXECUTE format('WITH moved AS (DELETE FROM idempotency.records_default d'
                               ' WHERE d.expires_at >= %L'
                               ' AND d.expires_at < %L RETURNING d.*)'
                               ' INSERT INTO pg_temp.idem_maintain_moving SELECT * FROM moved',
                               slot_start, slot_start + step);
            END IF;
            EXECUTE format('ALTER TABLE idempotency.records ATTACH PARTITION %s'
                           ' FOR VALUES FROM (%L) TO (%L)',
                           part, slot_start, slot_start + step);
            created := created + 1;
            slot_start := slot_start + step;
        END LOOP;

        IF moving THEN
            INSERT INTO idempotency.records SELECT * FROM pg_temp.idem_maintain_moving;
            DROP TABLE pg_temp.idem_maintain_moving;
        END IF;

        FOR part IN SELECT p.partition FROM idempotency.partitions p
                     WHERE NOT p.is_default AND p.range_end <= now_ts
                     ORDER BY p.range_end
        LOOP
            EXECUTE format('DROP TABLE %s', part);
            dropped := dropped + 1;
        END LOOP;
    END LOOP;

    IF worked AND EXISTS (SELECT FROM idempotency.records_default d
                           WHERE d.expires_at >= horizon) THEN
        RAISE WARNING 'idempotency.records_default holds records that expire after now + idempotency.max_ttl'
            USING HINT = 'They stay in the DEFAULT partition, where they are still found; no claim made through idem_acquire expires that late.';
    END IF;
    IF created > 0 OR dropped > 0 THEN
        RAISE LOG 'idempotency maintenance created % and dropped % partitions of "idempotency.records"',
            created, dropped;
    END IF;
    partitions_created := created;
    partitions_dropped := dropped;
    RETURN NEXT;
END
$$;

--
-- idem_schedule_maintenance(schedule) / idem_unschedule_maintenance()
--
-- One pg_cron job per database, named 'idempotency-maintenance:<database>',
-- running idem_maintain() in this database.  pg_cron is optional: it is
-- looked for at run time, and only in the database it lives in
-- (cron.database_name) can jobs be scheduled.
--
-- cron_check(schedule): raise 55000 with the right hint unless pg_cron can
-- be used from here; schedule NULL means the caller wants to unschedule.
CREATE FUNCTION idempotency.cron_check(schedule text)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cron_db     text := current_setting('cron.database_name', true);
BEGIN
    IF cron_db IS NULL THEN
        RAISE EXCEPTION 'pg_cron is not loaded'
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Install pg_cron (Debian: apt-get install postgresql-15-cron), add pg_cron to shared_preload_libraries, set cron.database_name, restart the server and run CREATE EXTENSION pg_cron in that database.';
    END IF;
    IF cron_db IS DISTINCT FROM current_database() THEN
        RAISE EXCEPTION 'pg_cron lives in database "%", not in "%"', cron_db, current_database()
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = CASE WHEN schedule IS NULL THEN
                             format('Connect to database %s and run: SELECT cron.unschedule(%L);',
                                    quote_ident(cron_db),
                                    'idempotency-maintenance:' || current_database())
                         ELSE
                             format('Connect to database %s and run: SELECT cron.schedule_in_database(%L, %L, %L, %L);',
                                    quote_ident(cron_db),
                                    'idempotency-maintenance:' || current_database(),
                                    schedule,
                                    'SELECT idempotency.idem_maintain()',
                                    current_database())
                         END;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_extension WHERE extname = 'pg_cron') THEN
        RAISE EXCEPTION 'extension "pg_cron" is not installed in database "%"', current_database()
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Run CREATE EXTENSION pg_cron in this database.';
    END IF;
END
$$;

CREATE FUNCTION idempotency.idem_schedule_maintenance(schedule text DEFAULT '*/10 * * * *')
RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF schedule IS NULL THEN
        RAISE EXCEPTION 'schedule must not be null'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    PERFORM idempotency.cron_check(schedule);
    -- pg_cron replaces the job of the same name and user
    RETURN cron.schedule_in_database('idempotency-maintenance:' || current_database(),
                                     schedule,
                                     'SELECT idempotency.idem_maintain()',
                                     current_database());
END
$$;

CREATE FUNCTION idempotency.idem_unschedule_maintenance()
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM idempotency.cron_check(NULL);
    IF NOT EXISTS (SELECT FROM cron.job j
                    WHERE j.jobname = 'idempotency-maintenance:' || current_database()
                      AND j.username = current_user) THEN
        RETURN false;
    END IF;
    RETURN cron.unschedule('idempotency-maintenance:' || current_database());
END
$$;

REVOKE ALL ON FUNCTION idempotency.maintenance_settings() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_maintain() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.cron_check(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_schedule_maintenance(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_unschedule_maintenance() FROM PUBLIC;

-- The partitions for the coming period.  The C functions above are created
-- first, so the library is loaded and the settings are known.  The dated
-- partitions are then released from the extension, as those that
-- maintenance makes later are: maintenance must be able to drop them, and
-- pg_dump must dump their rows.
SELECT idempotency.idem_maintain();

DO $$
DECLARE
    part regclass;
BEGIN
    FOR part IN SELECT p.partition FROM idempotency.partitions p WHERE NOT p.is_default LOOP
        EXECUTE format('ALTER EXTENSION idempotency DROP TABLE %s', part);
    END LOOP;
END
$$;
