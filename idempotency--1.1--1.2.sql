/* idempotency--1.1--1.2.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.2'" to load this file. \quit

-- Storage (issue 30)
--
-- Partitions that maintenance makes from 1.2 on are laid out for the one
-- update most records get, their completion, so that it is a HOT update
-- that logs little more than what it writes.  Partitions made before keep
-- their layout (a partition may order its columns differently from its
-- parent; every reader and writer finds columns by name), so the change
-- takes effect as maintenance makes new partitions: after max_ttl plus two
-- partition intervals, also on a new install, whose first partitions the
-- 1.0 script makes.  (Making the empty ones again during the update held
-- locks on every one of them to its end, and slowed CREATE EXTENSION.)
--
-- Column order (partition_columns).  log_heap_update leaves out of the WAL
-- the bytes a new row version shares with the old one at its start and at
-- its end, when both are on one page.  So the columns a completion leaves
-- alone come first, the fixed-width ones (8-byte aligned first, so that no
-- padding moves) then the variable-width ones written at claim time; then
-- what a completion writes: status, response_status, completed_at,
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
                        ARRAY['created_at', 'expires_at', 'locked_until', 'owner_start',
                              'claim', 'attempt', 'owner_pid', 'is_token',
                              'scope', 'key', 'request_hash', 'trace',
                              'status', 'response_status', 'completed_at',
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
