/* idempotency--1.0.sql */

-- complain if script is sourced in psql, rather than via CREATE EXTENSION
\echo Use "CREATE EXTENSION idempotency" to load this file. \quit

--
-- Storage
--
-- One row per claimed (scope, key).  The table is range-partitioned on
-- expires_at, which never changes once a record is claimed: a partition whose
-- upper bound has passed holds only expired records and can be dropped whole.
-- There is no unique index on (scope, key) (a partitioned table cannot have
-- one without the partition key); the C functions serialize writers of one
-- (scope, key) on a transaction-level lock and look across the live
-- partitions before inserting.  See idempotency.c.
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

CREATE INDEX records_scope_key_idx ON idempotency.records (scope, key);

-- Rows land here only when no dated partition covers their expires_at
-- (maintenance has not run for too long); no claim ever fails for want of a
-- partition.
CREATE TABLE idempotency.records_default
    PARTITION OF idempotency.records DEFAULT;

COMMENT ON TABLE idempotency.records IS
    'idempotency records, one per claimed (scope, key); range-partitioned on expires_at';

SELECT pg_catalog.pg_extension_config_dump('idempotency.records', '');

--
-- ensure_partitions(horizon)
--
-- Creates the daily partitions (UTC days) that are missing between today and
-- horizon, and returns how many it created.  Internal: called at CREATE
-- EXTENSION and by maintenance.  Concurrent callers are serialized on a lock
-- of the parent table, and a partition that already exists is skipped.
--
CREATE FUNCTION idempotency.ensure_partitions(horizon timestamptz)
RETURNS int
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    day_start   timestamptz;
    created     int := 0;
    part_name   text;
BEGIN
    -- SHARE ROW EXCLUSIVE conflicts with itself: one creator at a time, while
    -- reads and writes of records go on.
    LOCK TABLE idempotency.records IN SHARE ROW EXCLUSIVE MODE;

    day_start := date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC';
    WHILE day_start < horizon LOOP
        part_name := 'records_p' || to_char(day_start AT TIME ZONE 'UTC', 'YYYYMMDD');
        IF to_regclass(format('idempotency.%I', part_name)) IS NULL THEN
            EXECUTE format(
                'CREATE TABLE idempotency.%I PARTITION OF idempotency.records '
                'FOR VALUES FROM (%L) TO (%L)',
                part_name, day_start, day_start + interval '1 day');
            created := created + 1;
        END IF;
        day_start := day_start + interval '1 day';
    END LOOP;
    RETURN created;
END
$$;

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
REVOKE ALL ON FUNCTION idempotency.ensure_partitions(timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_acquire(text, jsonb, text, interval, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_complete(text, int, jsonb, text, int) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_release(text, text, int) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_lookup(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_request_hash(jsonb) FROM PUBLIC;

-- Partitions for today and the next max_ttl plus two days.  The C functions
-- above are created first, so the library is loaded and max_ttl is known.
SELECT idempotency.ensure_partitions(
    now() + pg_catalog.current_setting('idempotency.max_ttl')::interval
          + interval '2 days');
