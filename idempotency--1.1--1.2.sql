/* idempotency--1.1--1.2.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.2'" to load this file. \quit

-- Storage (issue 30)
--
-- Partitions that maintenance makes from 1.2 on are laid out for the one
-- update most records get, their completion, so that it is a HOT update
-- that logs little more than what it writes.  The update makes the dated
-- partitions that are still empty again in that layout (below, after the
-- new columns): in a new install, whose first partitions
-- idempotency--1.1.sql makes, and in an updated database; as many as half
-- the lock table allows, which is all of them with daily partitions.  A
-- partition that holds records keeps its layout (a partition may order
-- its columns differently from its parent; every reader and writer finds
-- columns by name) until maintenance drops it.
--
-- Column order (partition_columns).  log_heap_update leaves out of the WAL
-- the bytes a new row version shares with the old one at its start and at
-- its end, when both are on one page.  So the columns a completion leaves
-- alone come first, the fixed-width ones (8-byte aligned first, so that no
-- padding moves) then the variable-width ones written at claim time; then
-- what a completion writes: locked_until (a completion sets it NULL, here
-- only: records.c), status, response_status, completed_at,
-- response_headers (1.2) and response_body last (the widest); then what
-- checkpoints write while the claim is processing and a completion leaves
-- as it was, phase and state (1.2), whose bytes are then the common end.
-- trace (1.2) is set at claim time, with the claim's other columns.  A
-- column this list does not know (a later version's) goes at the end.
--
-- Fillfactor (partition_fillfactor).  A HOT update needs room for the new
-- version on the old one's page: the reserve (6 %, 491 bytes) holds a
-- completed record with a response of about 300 bytes.  Without it, a claim
-- inserted into a nearly full page (one that VACUUM put in the free-space
-- map, say) leaves no room for its completion.  The library prunes a page
-- before it inserts into it or updates in it (records.c), but
-- heap_page_prune_opt prunes only a page with less than a tenth free: the
-- reserve plus a claim must stay below that, or inserts would leave pages
-- before their dead claims are pruned (at 90, a record took 30 % more room
-- than at 94; bench/wal_storage.sh, BENCHMARKS.md).
--

--
-- partition_columns(): the column definitions of a new partition, in the
-- order above, as CREATE TABLE takes them (types, collations, NOT NULL and
-- defaults as the parent has them).
--
CREATE FUNCTION idempotency.partition_columns()
RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT pg_catalog.string_agg(
           pg_catalog.format('%I %s%s%s%s', a.attname,
                             pg_catalog.format_type(a.atttypid, a.atttypmod),
                             CASE WHEN co.oid IS NULL THEN ''
                                  ELSE pg_catalog.format(' COLLATE %I.%I', cn.nspname, co.collname) END,
                             CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END,
                             CASE WHEN d.adbin IS NULL THEN ''
                                  ELSE pg_catalog.concat(' DEFAULT ', pg_catalog.pg_get_expr(d.adbin, d.adrelid)) END),
           ', '
           ORDER BY pg_catalog.array_position(
                        ARRAY['created_at', 'expires_at', 'owner_start',
                              'claim', 'attempt', 'owner_pid', 'is_token',
                              'scope', 'key', 'request_hash', 'trace',
                              'locked_until', 'status', 'response_status', 'completed_at',
                              'response_headers', 'response_body',
                              'phase', 'state']::pg_catalog.text[],
                        a.attname::pg_catalog.text) NULLS LAST,
                    a.attnum)
  FROM pg_catalog.pg_attribute a
  LEFT JOIN pg_catalog.pg_attrdef d
         ON d.adrelid OPERATOR(pg_catalog.=) a.attrelid AND d.adnum OPERATOR(pg_catalog.=) a.attnum
  LEFT JOIN pg_catalog.pg_collation co ON co.oid OPERATOR(pg_catalog.=) a.attcollation
  LEFT JOIN pg_catalog.pg_namespace cn ON cn.oid OPERATOR(pg_catalog.=) co.collnamespace
 WHERE a.attrelid OPERATOR(pg_catalog.=) 'idempotency.records'::pg_catalog.regclass
   AND a.attnum OPERATOR(pg_catalog.>) 0
   AND NOT a.attisdropped
$$;

--
-- partition_fillfactor(): the fillfactor of a new partition.
--
CREATE FUNCTION idempotency.partition_fillfactor()
RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT 94 $$;

--
-- make_partition(part_name, range_start, range_end): a new dated partition
-- in the layout above, not attached yet: its CHECK of the range (so that
-- ATTACH scans nothing), the parent's CHECK constraints by name (as ATTACH
-- wants them), and its unique (scope, key, expires_at) index as its
-- replica identity.
--
CREATE FUNCTION idempotency.make_partition(part_name text, range_start timestamptz,
                                           range_end timestamptz)
RETURNS regclass
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    part    regclass;
    con     record;
BEGIN
    EXECUTE pg_catalog.format('CREATE TABLE idempotency.%I (%s,'
                              '  CHECK (expires_at OPERATOR(pg_catalog.>=) %L'
                              ' AND expires_at OPERATOR(pg_catalog.<) %L))'
                              ' WITH (fillfactor = %s)',
                              part_name, idempotency.partition_columns(), range_start,
                              range_end, idempotency.partition_fillfactor());
    part := pg_catalog.format('idempotency.%I', part_name)::pg_catalog.regclass;
    FOR con IN SELECT c.conname, pg_catalog.pg_get_constraintdef(c.oid) AS def
                 FROM pg_catalog.pg_constraint c
                WHERE c.conrelid OPERATOR(pg_catalog.=) 'idempotency.records'::pg_catalog.regclass
                  AND c.contype OPERATOR(pg_catalog.=) 'c'
                ORDER BY c.conname
    LOOP
        EXECUTE pg_catalog.format('ALTER TABLE %s ADD CONSTRAINT %I %s',
                                  part, con.conname, con.def);
    END LOOP;
    EXECUTE pg_catalog.format('CREATE UNIQUE INDEX %I ON %s (scope, key, expires_at)',
                              pg_catalog.concat(part_name, '_key'), part);
    EXECUTE pg_catalog.format('ALTER TABLE %s REPLICA IDENTITY USING INDEX %I',
                              part, pg_catalog.concat(part_name, '_key'));
    RETURN part;
END
$$;

REVOKE ALL ON FUNCTION idempotency.partition_columns() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.partition_fillfactor() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.make_partition(text, timestamptz, timestamptz) FROM PUBLIC;

--
-- maintain_partitions(): 1.0's partition work (see idem_maintain in
-- idempotency--1.0.sql), the same but for the layout of the partitions it
-- makes.  idem_maintain() calls it.
--
CREATE OR REPLACE FUNCTION idempotency.maintain_partitions()
RETURNS TABLE (partitions_created int, partitions_dropped int)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '100ms'
AS $$
DECLARE
    settings    record := idempotency.maintenance_settings();
    step        interval := settings.partition_interval;
    step_secs   double precision := extract(epoch FROM settings.partition_interval);
    lock_wait   text := pg_catalog.concat(settings.lock_timeout_ms, 'ms');
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
        horizon := (now_ts OPERATOR(pg_catalog.+) settings.max_ttl)
                   OPERATOR(pg_catalog.+) (2 OPERATOR(pg_catalog.*) step);
        SELECT max(p.range_end) INTO last_end
          FROM idempotency.partitions p WHERE NOT p.is_default;

        EXIT WHEN attempt OPERATOR(pg_catalog.=) 1
              AND last_end OPERATOR(pg_catalog.>=) horizon
              AND NOT EXISTS (SELECT FROM idempotency.partitions p
                               WHERE NOT p.is_default AND p.range_end OPERATOR(pg_catalog.<=) now_ts)
              AND NOT EXISTS (SELECT FROM idempotency.records_default d
                               WHERE d.expires_at OPERATOR(pg_catalog.<) horizon);

        IF attempt OPERATOR(pg_catalog.=) 1 THEN
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
        DELETE FROM idempotency.records_default d WHERE d.expires_at OPERATOR(pg_catalog.<=) now_ts;

        -- New slots continue from the last partition, or start at the
        -- current slot, aligned to the epoch, if that has passed.
        slot_start := pg_catalog.to_timestamp(pg_catalog.floor(EXTRACT(epoch FROM now_ts)
                          OPERATOR(pg_catalog./) step_secs) OPERATOR(pg_catalog.*) step_secs);
        IF last_end IS NOT NULL AND last_end OPERATOR(pg_catalog.>) slot_start THEN
            slot_start := last_end;
        END IF;

        -- Live records in DEFAULT that the new partitions will cover wait in
        -- a temporary table while those are attached (see above).
        IF slot_start OPERATOR(pg_catalog.<) horizon
           AND EXISTS (SELECT FROM idempotency.records_default d
                        WHERE d.expires_at OPERATOR(pg_catalog.<) horizon) THEN
            moving := true;
            CREATE TEMPORARY TABLE idem_maintain_moving
                (LIKE idempotency.records) ON COMMIT DROP;
        END IF;

        WHILE slot_start OPERATOR(pg_catalog.<) horizon LOOP
            part_name := pg_catalog.concat('records_p',
                pg_catalog.to_char(slot_start AT TIME ZONE 'UTC', 'YYYYMMDD"_"HH24MISS'));
            part := idempotency.make_partition(part_name, slot_start,
                                               slot_start OPERATOR(pg_catalog.+) step);
            IF moving THEN
                EXECUTE pg_catalog.format('WITH moved AS (DELETE FROM idempotency.records_default d'
                                          ' WHERE d.expires_at OPERATOR(pg_catalog.>=) %L'
                                          ' AND d.expires_at OPERATOR(pg_catalog.<) %L RETURNING d.*)'
                                          ' INSERT INTO pg_temp.idem_maintain_moving SELECT * FROM moved',
                                          slot_start, slot_start OPERATOR(pg_catalog.+) step);
            END IF;
            EXECUTE pg_catalog.format('ALTER TABLE idempotency.records ATTACH PARTITION %s'
                                      ' FOR VALUES FROM (%L) TO (%L)',
                                      part, slot_start, slot_start OPERATOR(pg_catalog.+) step);
            created := created OPERATOR(pg_catalog.+) 1;
            slot_start := slot_start OPERATOR(pg_catalog.+) step;
        END LOOP;

        IF moving THEN
            INSERT INTO idempotency.records SELECT * FROM pg_temp.idem_maintain_moving;
            DROP TABLE pg_temp.idem_maintain_moving;
        END IF;

        FOR part IN SELECT p.partition FROM idempotency.partitions p
                     WHERE NOT p.is_default AND p.range_end OPERATOR(pg_catalog.<=) now_ts
                     ORDER BY p.range_end
        LOOP
            EXECUTE pg_catalog.format('DROP TABLE %s', part);
            dropped := dropped OPERATOR(pg_catalog.+) 1;
        END LOOP;
    END LOOP;

    IF worked AND EXISTS (SELECT FROM idempotency.records_default d
                           WHERE d.expires_at OPERATOR(pg_catalog.>=) horizon) THEN
        RAISE WARNING 'idempotency.records_default holds records that expire after now + idempotency.max_ttl'
            USING HINT = 'They stay in the DEFAULT partition, where they are still found; no claim made through idem_acquire expires that late.';
    END IF;
    IF created OPERATOR(pg_catalog.>) 0 OR dropped OPERATOR(pg_catalog.>) 0 THEN
        RAISE LOG 'idempotency maintenance created % and dropped % partitions of "idempotency.records"',
            created, dropped;
    END IF;
    partitions_created := created;
    partitions_dropped := dropped;
    RETURN NEXT;
END
$$;

--
-- Version 1.2: resumable operations (idem_checkpoint; a takeover answers
-- the last phase and state), replayed headers, idem_forget, traceable
-- duplicates (trace, origin_trace).  See docs/reference.md.
--
-- idem_acquire, idem_complete, idem_lookup and idem_stats change their
-- parameters or result columns, so they are created again, bound to new C
-- symbols (idem_acquire_1_2, ...), as 1.1 did for 1.0: a backend still on
-- the 1.1 library fails to find them rather than answer in 1.1's shape.
-- idem_extend keeps its signature but is bound to idem_extend_1_2, since
-- the 1.1 library would write the record without its 1.2 columns.  Every
-- privilege granted on an old function is granted again on the new one.
--

-- Refuse, before changing anything, where user objects depend on the
-- functions that are re-created (as the 1.0 -> 1.1 update does); the
-- extension's own views are re-created below.
DO $$
DECLARE
    dependents text;
BEGIN
    SELECT pg_catalog.string_agg(DISTINCT pg_catalog.pg_describe_object(d.classid, d.objid, d.objsubid), ', ')
      INTO dependents
      FROM pg_catalog.pg_depend d
     WHERE d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
       AND d.refobjid OPERATOR(pg_catalog.=) ANY (ARRAY[
               'idempotency.idem_acquire(text, jsonb, text, interval, interval, boolean)'::pg_catalog.regprocedure,
               'idempotency.idem_complete(text, int, jsonb, text, int, uuid)'::pg_catalog.regprocedure,
               'idempotency.idem_lookup(text, text)'::pg_catalog.regprocedure,
               'idempotency.idem_stats()'::pg_catalog.regprocedure]::pg_catalog.oid[])
       AND d.deptype OPERATOR(pg_catalog.=) ANY (ARRAY['n', 'a']::pg_catalog."char"[])
       AND NOT EXISTS (
               SELECT FROM pg_catalog.pg_rewrite rw
                 JOIN pg_catalog.pg_depend e
                   ON e.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass
                  AND e.objid OPERATOR(pg_catalog.=) rw.ev_class
                  AND e.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_extension'::pg_catalog.regclass
                  AND e.deptype OPERATOR(pg_catalog.=) 'e'
                WHERE d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_rewrite'::pg_catalog.regclass
                  AND rw.oid OPERATOR(pg_catalog.=) d.objid);
    IF dependents IS NOT NULL THEN
        RAISE EXCEPTION 'cannot update extension "idempotency": other objects depend on functions that version 1.2 re-creates'
            USING ERRCODE = 'dependent_objects_still_exist',
                  DETAIL = 'Dependent objects: ' || dependents || '.',
                  HINT = 'Drop them, run ALTER EXTENSION idempotency UPDATE, and create them again (idem_acquire, idem_lookup and idem_stats return more columns in 1.2).';
    END IF;
END
$$;

--
-- Storage: a claim's last checkpoint (phase, state), a completed record's
-- replayed headers, and the trace of the request whose claim made the
-- record.  Nullable without a default: adding them rewrites and scans
-- nothing (ACCESS EXCLUSIVE on the table and its partitions for a moment,
-- as in 1.1).  NULL in every record made before.
--
ALTER TABLE idempotency.records
    ADD COLUMN phase text,
    ADD COLUMN state jsonb,
    ADD COLUMN response_headers jsonb,
    ADD COLUMN trace text;

--
-- The dated partitions that hold no record are made again in 1.2's layout
-- (see the head of this file), with their names and ranges: in a new
-- install (CREATE EXTENSION runs idempotency--1.1.sql, then this script)
-- and an updated database's empty ones.  The ALTER TABLE above holds
-- ACCESS EXCLUSIVE on every partition to the end of the update, so none
-- gains a record once it was found empty; a claim in a transaction still
-- open made the update wait for it.  A partition that objects of the
-- user's depend on (DROP TABLE refuses, 2BP01) keeps its layout, as one
-- that holds records does.  Like those that maintenance makes, the new
-- partitions are not members of the extension.
--
-- Every lock the update takes is held to its end, and making a partition
-- again takes about 26 (the old one's objects, the new one's), on top of
-- the 10 or so that idempotency--1.1.sql took to make it: with 15-minute
-- partitions and a week's max_ttl (676 of them) that is more than the
-- shared lock table holds by default.  So the partitions are made again
-- nearest first, while what this transaction holds stays under half the
-- shared lock table (max_locks_per_transaction for each backend the server
-- may run and each prepared transaction).  With the default settings that
-- is every daily partition, and the first four days of hourly ones.  The
-- others keep their layout; maintenance makes those after them in 1.2's.
--
DO $$
DECLARE
    p       record;
    part    regclass;
    holds   boolean;
    budget  bigint;
BEGIN
    -- half the shared lock table: max_locks_per_transaction slots for each
    -- backend the server may run (MaxBackends) and each prepared transaction
    SELECT (pg_catalog.sum(pg_catalog.current_setting(g)::pg_catalog.int8) OPERATOR(pg_catalog.+) 1)
           OPERATOR(pg_catalog.*) pg_catalog.current_setting('max_locks_per_transaction')::pg_catalog.int8
           OPERATOR(pg_catalog./) 2
      INTO budget
      FROM pg_catalog.unnest(ARRAY['max_connections', 'autovacuum_max_workers', 'max_worker_processes',
                                   'max_wal_senders', 'max_prepared_transactions']::pg_catalog.text[]) g;
    FOR p IN SELECT pp.partition, c.relname, pp.range_start, pp.range_end
               FROM idempotency.partitions pp
               JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) pp.partition
              WHERE NOT pp.is_default
              ORDER BY pp.range_start
    LOOP
        EXIT WHEN (SELECT pg_catalog.count(*) FROM pg_catalog.pg_locks l
                    WHERE l.pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid())
                  OPERATOR(pg_catalog.+) 40 OPERATOR(pg_catalog.>) budget;
        EXECUTE pg_catalog.format('SELECT EXISTS (SELECT FROM %s)', p.partition) INTO holds;
        CONTINUE WHEN holds;
        BEGIN
            EXECUTE pg_catalog.format('DROP TABLE %s', p.partition);
        EXCEPTION WHEN dependent_objects_still_exist THEN
            CONTINUE;
        END;
        part := idempotency.make_partition(p.relname, p.range_start, p.range_end);
        EXECUTE pg_catalog.format('ALTER TABLE idempotency.records ATTACH PARTITION %s'
                                  ' FOR VALUES FROM (%L) TO (%L)',
                                  part, p.range_start, p.range_end);
        EXECUTE pg_catalog.format('ALTER EXTENSION idempotency DROP TABLE %s', part);
    END LOOP;
END
$$;

--
-- The old functions are renamed, not dropped, until their privileges have
-- been copied to the new ones.
--
ALTER FUNCTION idempotency.idem_acquire(text, jsonb, text, interval, interval, boolean)
    RENAME TO idem_acquire_1_1;
ALTER FUNCTION idempotency.idem_complete(text, int, jsonb, text, int, uuid)
    RENAME TO idem_complete_1_1;
ALTER FUNCTION idempotency.idem_lookup(text, text)
    RENAME TO idem_lookup_1_1;
ALTER FUNCTION idempotency.idem_stats()
    RENAME TO idem_stats_1_1;

-- idem_acquire's row gains four columns at the end
ALTER TYPE idempotency.acquire_result
    ADD ATTRIBUTE phase            text,
    ADD ATTRIBUTE state            jsonb,
    ADD ATTRIBUTE response_headers jsonb,
    ADD ATTRIBUTE origin_trace     text;

CREATE FUNCTION idempotency.idem_acquire(
    key             text,
    request         jsonb    DEFAULT NULL,
    scope           text     DEFAULT '',
    ttl             interval DEFAULT NULL,
    lease           interval DEFAULT NULL,
    session_bound   boolean  DEFAULT false,
    trace           text     DEFAULT NULL)
RETURNS SETOF idempotency.acquire_result
AS 'MODULE_PATHNAME', 'idem_acquire_1_2'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;

CREATE FUNCTION idempotency.idem_complete(
    key              text,
    response_status  int,
    response_body    jsonb DEFAULT NULL,
    scope            text  DEFAULT '',
    attempt          int   DEFAULT NULL,
    claim            uuid  DEFAULT NULL,
    response_headers jsonb DEFAULT NULL)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_complete_1_2'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idempotency.idem_lookup(
    key         text,
    scope       text DEFAULT '')
RETURNS TABLE (status text, request_hash bytea, response_status int,
               response_body jsonb, attempt int, created_at timestamptz,
               locked_until timestamptz, completed_at timestamptz,
               expires_at timestamptz, owner_pid int, phase text,
               state jsonb, response_headers jsonb, origin_trace text)
AS 'MODULE_PATHNAME', 'idem_lookup_1_2'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;

CREATE OR REPLACE FUNCTION idempotency.idem_extend(
    key         text,
    scope       text     DEFAULT '',
    claim       uuid     DEFAULT NULL,
    lease       interval DEFAULT NULL)
RETURNS timestamptz
AS 'MODULE_PATHNAME', 'idem_extend_1_2'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

--
-- Resumable operations: the holder of a processing claim records how far
-- it got, in its own transaction.
--
CREATE FUNCTION idempotency.idem_checkpoint(
    key         text,
    scope       text  DEFAULT '',
    claim       uuid  DEFAULT NULL,
    phase       text  DEFAULT NULL,
    state       jsonb DEFAULT NULL)
RETURNS timestamptz
AS 'MODULE_PATHNAME', 'idem_checkpoint'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

--
-- Forgetting a key: for the table's owner and the roles it grants EXECUTE
-- to (an operator role needs no privilege on the table).
--
CREATE FUNCTION idempotency.idem_forget(
    key         text,
    scope       text DEFAULT '')
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_forget'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

-- The statistics gain forgotten at the end
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
    OUT stats_reset             timestamptz,
    OUT forgotten               bigint)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_stats_1_2'
LANGUAGE C VOLATILE STRICT PARALLEL SAFE;

CREATE OR REPLACE VIEW idempotency.stats AS
SELECT s.datname, s.acquired, s.taken_over, s.replayed, s.mismatched,
       s.in_progress, s.completed, s.released, s.waits, s.wait_time,
       s.tokens_issued, s.tokens_consumed, s.stats_reset, s.forgotten
  FROM idempotency.idem_stats() s;

-- stale_claims shows the trace of the claim at the end
CREATE OR REPLACE VIEW idempotency.stale_claims WITH (security_barrier) AS
SELECT r.scope, r.key, r.attempt, r.created_at, r.locked_until, r.expires_at,
       r.owner_pid,
       CASE WHEN r.owner_pid IS NULL THEN 'lease expired'
            ELSE 'owner gone' END AS reason,
       r.trace AS origin_trace
  FROM idempotency.records r
 WHERE r.status OPERATOR(pg_catalog.=) 'processing'
   AND NOT r.is_token
   AND r.expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()
   AND CASE WHEN r.owner_pid IS NULL
            THEN r.locked_until OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp()
            ELSE NOT idempotency.owner_alive(r.owner_pid, r.owner_start) END;

--
-- The daily reconciliation counts forgotten keys too, as it counts the
-- other counters: a column at the end of daily and daily_base, 0 for what
-- was recorded before (no key of this database could be forgotten before
-- 1.2, so the base of its counter is 0), and record_daily() with it.
--
ALTER TABLE idempotency.daily ADD COLUMN forgotten bigint NOT NULL DEFAULT 0;
ALTER TABLE idempotency.daily_base ADD COLUMN forgotten bigint NOT NULL DEFAULT 0;

CREATE OR REPLACE FUNCTION idempotency.record_daily()
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
              OR cur.acquire_duration_sum < last.acquire_time
              OR cur.forgotten < last.forgotten;
        IF fresh THEN
            last := ROW(current_database(), cur.stats_reset, clock_timestamp(),
                        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
        END IF;

        INSERT INTO idempotency.daily AS d
               (day, datname, acquired, taken_over, replayed, mismatched,
                in_progress, completed, released, waits, wait_time,
                tokens_issued, tokens_consumed, acquire_count, acquire_time,
                forgotten)
        VALUES (today, current_database(),
                cur.acquired - last.acquired, cur.taken_over - last.taken_over,
                cur.replayed - last.replayed, cur.mismatched - last.mismatched,
                cur.in_progress - last.in_progress, cur.completed - last.completed,
                cur.released - last.released, cur.waits - last.waits,
                cur.wait_time - last.wait_time,
                cur.tokens_issued - last.tokens_issued,
                cur.tokens_consumed - last.tokens_consumed,
                cur.acquire_duration_count - last.acquire_count,
                cur.acquire_duration_sum - last.acquire_time,
                cur.forgotten - last.forgotten)
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
            acquire_time = d.acquire_time + excluded.acquire_time,
            forgotten = d.forgotten + excluded.forgotten;

        INSERT INTO idempotency.daily_base AS b
        VALUES (current_database(), cur.stats_reset, clock_timestamp(),
                cur.acquired, cur.taken_over, cur.replayed, cur.mismatched,
                cur.in_progress, cur.completed, cur.released, cur.waits,
                cur.wait_time, cur.tokens_issued, cur.tokens_consumed,
                cur.acquire_duration_count, cur.acquire_duration_sum,
                cur.forgotten)
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
            acquire_time = excluded.acquire_time,
            forgotten = excluded.forgotten;
    END IF;
END
$$;

-- Nothing is granted to PUBLIC, as before.
REVOKE ALL ON FUNCTION idempotency.idem_acquire(text, jsonb, text, interval, interval, boolean, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_complete(text, int, jsonb, text, int, uuid, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_lookup(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_checkpoint(text, text, uuid, text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_forget(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_stats() FROM PUBLIC;

--
-- Grant on each new function what was granted on the old one.
-- idem_checkpoint is granted to whoever may call idem_complete (the holder
-- of a claim); idem_forget to nobody (an operator's grant).  The initial
-- privileges are set back to what a fresh install records, as in the
-- 1.0 -> 1.1 update, so that pg_dump keeps dumping the user's grants.
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
                ('idempotency.idem_acquire_1_1(text, jsonb, text, interval, interval, boolean)',
                 'idempotency.idem_acquire(text, jsonb, text, interval, interval, boolean, text)'),
                ('idempotency.idem_complete_1_1(text, int, jsonb, text, int, uuid)',
                 'idempotency.idem_complete(text, int, jsonb, text, int, uuid, jsonb)'),
                ('idempotency.idem_complete_1_1(text, int, jsonb, text, int, uuid)',
                 'idempotency.idem_checkpoint(text, text, uuid, text, jsonb)'),
                ('idempotency.idem_lookup_1_1(text, text)',
                 'idempotency.idem_lookup(text, text)'),
                ('idempotency.idem_stats_1_1()',
                 'idempotency.idem_stats()')) AS f(old_sig, new_sig)
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

        -- From PostgreSQL 17 on, roles named in initial privileges are also
        -- shared dependencies (deptype 'i'); those of the grants just made
        -- go with them, or the roles could not be dropped.
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

DROP FUNCTION idempotency.idem_acquire_1_1(text, jsonb, text, interval, interval, boolean);
DROP FUNCTION idempotency.idem_complete_1_1(text, int, jsonb, text, int, uuid);
DROP FUNCTION idempotency.idem_lookup_1_1(text, text);
DROP FUNCTION idempotency.idem_stats_1_1();

-- Shard ownership (issue 28)
--
-- A shard behind idempotency_proxy routers (proxy/README.md) knows which
-- hash partitions it owns, at which layout version, and refuses a claim
-- (acquire, token issue) for a key it does not own, or from a router whose
-- layout is not its own, with SQLSTATE 55R01 (class 55, object not in
-- prerequisite state: the router's layout is the prerequisite).  The
-- router then reloads its layout from the shards and retries once.  So no
-- router, however stale, can make a key run on two shards; the argument
-- is in proxy/README.md, "Why a key never runs on two shards".
--
-- Locking: every routed claim reads idempotency.shard_layout after its
-- claim is written and before it commits (ACCESS SHARE, a fast-path lock);
-- a new layout is written under ACCESS EXCLUSIVE, so it waits for the
-- claims in flight (and they for it).  The lock is tried in short steps,
-- so that new claims are never held behind it for long.
--
-- A shard without a layout row accepts routed calls that carry none (a
-- router not yet given one), as 1.1 did: nothing is checked then.
--

-- The layout this shard knows (one row; none until a 1.2 router declares
-- or grows the cluster).  map and previous_map are the partitions'
-- connection strings as the router wrote them, so that a router rebuilt
-- from nothing can read the layout back; owned and previous_owned are the
-- partitions (0-based) this shard holds under each.  installed_at: from
-- then on this shard refused new claims and tokens of the partitions it
-- gave away (the router's cluster_growth_pending() counts the tokens made
-- here before it).
CREATE TABLE idempotency.shard_layout (
    one             boolean PRIMARY KEY DEFAULT true CHECK (one),
    version         bigint NOT NULL CHECK (version > 0),
    active          boolean NOT NULL,   -- false: installed, not yet in force
    map             text[] NOT NULL,
    owned           int[] NOT NULL,
    previous_map    text[],
    previous_owned  int[],
    switched_at     timestamptz,
    consult_until   timestamptz,
    installed_at    timestamptz     -- when this shard wrote it (its clock)
);

COMMENT ON TABLE idempotency.shard_layout IS
    'the routers'' layout as this shard knows it: which hash partitions it owns (written by idempotency_proxy)';

SELECT pg_catalog.pg_extension_config_dump('idempotency.shard_layout', '');

-- shard_key_hash(scope, key): idempotency_proxy's key_hash, computed here
-- (the shard does not take the router's word for which partition a key
-- is in).  PL/pgSQL, not SQL: a SQL function with SET is never inlined,
-- and its body was parsed and planned again on every routed call.
CREATE FUNCTION idempotency.shard_key_hash(scope text, key text)
RETURNS int
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN ('x' OPERATOR(pg_catalog.||) pg_catalog.encode(pg_catalog.substr(pg_catalog.sha256(
                pg_catalog.convert_to(COALESCE(scope, ''), 'UTF8')
                OPERATOR(pg_catalog.||) '\x00'::pg_catalog.bytea
                OPERATOR(pg_catalog.||) pg_catalog.convert_to(COALESCE(key, ''), 'UTF8')), 1, 4), 'hex')
           )::pg_catalog.bit(32)::pg_catalog.int4;
END
$$;

-- shard_refusal(layout, hash, fresh): why this shard may not answer a call
-- for partition hash from a router at layout version layout (message and
-- detail of the 55R01), or NULLs when it may.  fresh: the call makes a new
-- record (a new claim, a token), which needs the partition owned under the
-- layout in force; otherwise (an existing record answered: replay,
-- in_progress, mismatch, a takeover) owning it under the previous layout
-- is enough.  The router's version matters only where the argument of
-- proxy/README.md needs it: a new claim of a key that moved here in the
-- newest growth is taken only from a router at this shard's version (that
-- router looked at the key's previous shard first); a key this shard owned
-- before the growth and owns now is taken from a router at any version,
-- so a growth refuses no call of a key that does not move.  Reads
-- idempotency.shard_layout: the ACCESS SHARE lock it takes is held to the
-- caller's commit.
CREATE FUNCTION idempotency.shard_refusal(layout bigint, hash int, fresh boolean,
    OUT message text, OUT detail text)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    l       idempotency.shard_layout;
    now_own boolean;
    was_own boolean;
BEGIN
    SELECT s.* INTO l FROM idempotency.shard_layout s;
    IF NOT FOUND THEN
        IF layout IS NOT NULL THEN
            message := format('this shard has no layout, the router sent layout %s', layout);
            detail := 'Declare the shards on the router again with idempotency.cluster_create(), which writes the layout to each.';
        END IF;
        RETURN;
    END IF;
    now_own := (hash & (cardinality(l.map) - 1)) = ANY (l.owned);
    was_own := l.previous_map IS NOT NULL
               AND (hash & (cardinality(l.previous_map) - 1)) = ANY (l.previous_owned);
    IF layout IS NULL
       OR (layout <> l.version AND NOT (now_own AND (was_own OR l.previous_map IS NULL))) THEN
        message := format('the router''s layout %s is not this shard''s layout %s',
                          coalesce(layout::text, 'none'), l.version);
        detail := CASE WHEN layout IS NULL OR layout < l.version
                       THEN 'The router has not heard of the newest growth.'
                       ELSE 'This shard has not been told of the router''s growth.' END;
        RETURN;
    END IF;
    IF now_own AND (l.active OR was_own) THEN
        RETURN;
    END IF;
    IF (was_own OR now_own) AND NOT fresh THEN
        RETURN;
    END IF;
    message := format('partition %s of layout %s is not owned by this shard',
                      hash & (cardinality(l.map) - 1), l.version);
    detail := CASE WHEN was_own THEN 'It moved to another shard: only its existing records are answered here.'
                   WHEN now_own THEN 'It moves here once the growth is in force.'
                   ELSE 'Another shard owns it.' END;
END
$$;

-- shard_check(layout, hash, fresh): raise 55R01 when shard_refusal() says
-- this shard may not answer.  Caller: a claim is already written in this
-- transaction, and is rolled back by the error.  It runs with the
-- caller's privileges, like every function of the extension: the role a
-- router connects as needs SELECT on idempotency.shard_layout
-- (proxy/README.md lists the shards' grants).
CREATE FUNCTION idempotency.shard_check(layout bigint, hash int, fresh boolean)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    r   record;
BEGIN
    SELECT * INTO r FROM idempotency.shard_refusal(layout, hash, fresh);
    IF r.message IS NOT NULL THEN
        RAISE EXCEPTION '%', r.message
            USING ERRCODE = '55R01', DETAIL = r.detail,
                  HINT = 'The router reloads its layout from the shards and retries.';
    END IF;
END
$$;

-- shard_acquire(layout, ..., trace): idem_acquire (1.2's columns, and
-- its trace), unless this
-- shard may not answer the key under the router's layout: then one row
-- with outcome 'refused' and the reason in response_body (message,
-- detail), and nothing is left of the call (a new claim it made is
-- released at once, in this transaction, so no other session ever sees
-- it).  A refusal is a row, not an error, so that PL/Proxy keeps its
-- connection (it drops one after every remote error); the router reloads
-- its layout and retries.  A refused takeover (a record of a key this
-- shard neither owns nor owned, which a forced end of a growth window can
-- leave) raises 55R01, which rolls it back.  Bad input raises what
-- idem_acquire raises, before the check.
CREATE FUNCTION idempotency.shard_acquire(layout bigint, key text,
    request jsonb, scope text, ttl interval, lease interval,
    trace text DEFAULT NULL)
RETURNS TABLE (outcome text, response_status int, response_body jsonb,
               attempt int, expires_at timestamptz, claim uuid,
               retry_after int, phase text, state jsonb,
               response_headers jsonb, origin_trace text)
LANGUAGE plpgsql VOLATILE ROWS 1
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    a   record;
    r   record;
BEGIN
    SELECT x.outcome, x.response_status, x.response_body, x.attempt,
           x.expires_at, x.claim, x.retry_after, x.phase, x.state,
           x.response_headers, x.origin_trace
      INTO a
      FROM idempotency.idem_acquire($2, $3, $4, $5, $6, false, $7) x;
    SELECT * INTO r
      FROM idempotency.shard_refusal($1, idempotency.shard_key_hash($4, $2),
                                     a.outcome = 'acquired' AND a.attempt = 1);
    IF r.message IS NULL THEN
        outcome := a.outcome;
        response_status := a.response_status;
        response_body := a.response_body;
        attempt := a.attempt;
        expires_at := a.expires_at;
        claim := a.claim;
        retry_after := a.retry_after;
        phase := a.phase;
        state := a.state;
        response_headers := a.response_headers;
        origin_trace := a.origin_trace;
    ELSIF a.outcome = 'acquired' AND a.attempt = 1 THEN
        PERFORM idempotency.idem_release($2, $4, 1, a.claim);
        outcome := 'refused';
        response_body := jsonb_build_object('message', r.message, 'detail', r.detail);
    ELSIF a.outcome = 'acquired' THEN
        RAISE EXCEPTION '%', r.message
            USING ERRCODE = '55R01', DETAIL = r.detail,
                  HINT = 'The router reloads its layout from the shards and retries.';
    ELSE
        outcome := 'refused';
        response_body := jsonb_build_object('message', r.message, 'detail', r.detail);
    END IF;
    RETURN NEXT;
END
$$;

-- shard_lookup(layout, key, scope): idem_lookup (1.1's columns), unless
-- the router's layout is not this shard's, whatever the key, or the key
-- is neither owned here nor was before the growth: then one row with
-- status 'refused' and the reason in response_body (message, detail), as
-- shard_acquire's (a row keeps PL/Proxy's connection).  The router's look
-- at a moved key's previous shard: answered only once that shard refuses
-- new claims of the key (step 4 of proxy/README.md's argument), so the
-- version must be equal here.
CREATE FUNCTION idempotency.shard_lookup(layout bigint, key text, scope text)
RETURNS TABLE (status text, request_hash bytea, response_status int,
               response_body jsonb, attempt int, created_at timestamptz,
               locked_until timestamptz, completed_at timestamptz,
               expires_at timestamptz, owner_pid int)
LANGUAGE plpgsql VOLATILE ROWS 1
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v   bigint := (SELECT s.version FROM idempotency.shard_layout s);
    r   record;
BEGIN
    IF $1 IS DISTINCT FROM v THEN
        status := 'refused';
        response_body := jsonb_build_object('message',
            format('the router''s layout %s is not this shard''s layout %s',
                   coalesce($1::text, 'none'), coalesce(v::text, 'none')));
        RETURN NEXT;
        RETURN;
    END IF;
    SELECT * INTO r
      FROM idempotency.shard_refusal($1, idempotency.shard_key_hash($3, $2), false);
    IF r.message IS NOT NULL THEN
        status := 'refused';
        response_body := jsonb_build_object('message', r.message, 'detail', r.detail);
        RETURN NEXT;
        RETURN;
    END IF;
    RETURN QUERY
        SELECT l.status, l.request_hash, l.response_status, l.response_body,
               l.attempt, l.created_at, l.locked_until, l.completed_at,
               l.expires_at, l.owner_pid
          FROM idempotency.idem_lookup($2, $3) l;
END
$$;

-- shard_token_issue(layout, hash, scope, ttl): idem_token_issue for the
-- router's partition hash; NULL (the token made is consumed at once, in
-- this transaction) unless this shard owns it, so that the refusal keeps
-- PL/Proxy's connection, as shard_acquire's.
CREATE FUNCTION idempotency.shard_token_issue(layout bigint, hash int,
    scope text, ttl interval)
RETURNS text
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    t   text := idempotency.idem_token_issue($3, $4);
BEGIN
    IF (SELECT r.message FROM idempotency.shard_refusal($1, $2, true) r) IS NOT NULL THEN
        PERFORM idempotency.idem_token_consume(t, $3);
        RETURN NULL;
    END IF;
    RETURN t;
END
$$;

-- shard_owns(scope, key, layout): for an application's own endpoint on
-- the shards (proxy/README.md, the in-transaction mode), called after its
-- idem_acquire answered acquired with attempt 1, with the layout version
-- of the router that routed the call (the endpoint's router function
-- passes idempotency.layout_version()): raise 55R01 (and so roll the claim
-- back) unless this shard may make that claim for a router at that
-- layout, as shard_acquire checks it.  The router's version matters: a
-- router that missed a growth sends a key that moved here without looking
-- at its previous shard.  Nothing is checked on a shard without a layout
-- when layout is NULL.
CREATE FUNCTION idempotency.shard_owns(scope text, key text, layout bigint)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM idempotency.shard_check(layout, idempotency.shard_key_hash(scope, key), true);
END
$$;

-- shard_layout_get(): the layout this shard knows (no row: none), for a
-- router that reloads or is rebuilt.
CREATE FUNCTION idempotency.shard_layout_get(
    OUT version bigint, OUT active boolean, OUT map text[],
    OUT previous_map text[], OUT switched_at timestamptz,
    OUT consult_until timestamptz)
RETURNS SETOF record
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT s.version, s.active, s.map, s.previous_map, s.switched_at, s.consult_until
  FROM idempotency.shard_layout s
$$;

-- shard_layout_install(...): write a layout (not yet in force unless
-- active), after every claim in flight here has ended.  The same version
-- again rewrites it (a growth run again); an older one is refused (55R01).
-- The ACCESS EXCLUSIVE lock is tried in steps of 20 ms, so that claims
-- arriving meanwhile wait at most that long, then waited for.  Returns the
-- version.
CREATE FUNCTION idempotency.shard_layout_install(version bigint, active boolean,
    map text[], owned int[], previous_map text[], previous_owned int[],
    switched_at timestamptz, consult_until timestamptz)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    deadline    timestamptz := clock_timestamp() + interval '2 seconds';
    cur         bigint;
    got         boolean := false;
BEGIN
    IF version IS NULL OR version < 1 OR map IS NULL OR owned IS NULL
       OR cardinality(map) & (cardinality(map) - 1) <> 0 THEN
        RAISE EXCEPTION 'invalid layout'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    WHILE NOT got AND clock_timestamp() < deadline LOOP
        BEGIN
            PERFORM set_config('lock_timeout', '20ms', true);
            LOCK TABLE idempotency.shard_layout IN ACCESS EXCLUSIVE MODE;
            got := true;
        EXCEPTION WHEN lock_not_available THEN
            PERFORM pg_sleep(0.005);
        END;
    END LOOP;
    PERFORM set_config('lock_timeout', '0', true);
    IF NOT got THEN
        LOCK TABLE idempotency.shard_layout IN ACCESS EXCLUSIVE MODE;
    END IF;
    SELECT s.version INTO cur FROM idempotency.shard_layout s;
    IF cur > shard_layout_install.version THEN
        RAISE EXCEPTION 'this shard has layout %, newer than %', cur, shard_layout_install.version
            USING ERRCODE = '55R01',
                  HINT = 'Reload the router''s layout (idempotency.cluster_reload()) and grow again.';
    END IF;
    DELETE FROM idempotency.shard_layout;
    INSERT INTO idempotency.shard_layout
        VALUES (true, shard_layout_install.version, shard_layout_install.active,
                shard_layout_install.map, shard_layout_install.owned,
                shard_layout_install.previous_map, shard_layout_install.previous_owned,
                shard_layout_install.switched_at, shard_layout_install.consult_until,
                clock_timestamp());
    RETURN shard_layout_install.version;
END
$$;

-- shard_layout_activate(version): put an installed layout in force; true
-- when it was installed (and is now active), false otherwise.
CREATE FUNCTION idempotency.shard_layout_activate(version bigint)
RETURNS boolean
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
WITH u AS (
    UPDATE idempotency.shard_layout s SET active = true
     WHERE s.version OPERATOR(pg_catalog.=) $1
    RETURNING 1)
SELECT EXISTS (SELECT FROM u)
$$;

-- shard_layout_close(version): the growth window of that layout is over
-- (the router's cluster_growth_finish()): forget the previous placement.
CREATE FUNCTION idempotency.shard_layout_close(version bigint)
RETURNS boolean
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
WITH u AS (
    UPDATE idempotency.shard_layout s
       SET previous_map = NULL, previous_owned = NULL, consult_until = NULL
     WHERE s.version OPERATOR(pg_catalog.=) $1
    RETURNING 1)
SELECT EXISTS (SELECT FROM u)
$$;

-- Nothing is granted to PUBLIC, as everywhere in the extension.  The role
-- a router connects as gets EXECUTE on the wrappers and on shard_check and
-- shard_key_hash, and SELECT on shard_layout (proxy/README.md, "Grants on
-- the shards"); the wrappers run with its own privileges, so it needs
-- EXECUTE on idem_acquire, idem_lookup and idem_token_issue too.  The
-- router's superuser reads and writes the layout itself.
REVOKE ALL ON TABLE idempotency.shard_layout FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.shard_layout_get() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.shard_layout_install(bigint, boolean, text[], int[], text[], int[], timestamptz, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.shard_layout_activate(bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.shard_layout_close(bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.shard_key_hash(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.shard_refusal(bigint, int, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.shard_check(bigint, int, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.shard_acquire(bigint, text, jsonb, text, interval, interval, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.shard_lookup(bigint, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.shard_token_issue(bigint, int, text, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.shard_owns(text, text, bigint) FROM PUBLIC;

-- End of shard ownership (issue 28)
