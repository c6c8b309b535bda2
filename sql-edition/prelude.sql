--
-- sql-edition/prelude.sql: the SQL edition's stand-ins for what the C
-- library gives the SQL that both editions share (generate.py puts this
-- before that SQL): the settings, maintenance_settings(), the statistics
-- (none in this edition: they raise 55000, as the C extension's do without
-- shared_preload_libraries), owner_alive().
--
-- Two schemas.  idempotency holds what the C extension has, with the same
-- names, signatures and privileges (nothing granted to PUBLIC).
-- idempotency_sql holds the edition's helpers, which the API functions call
-- with their caller's privileges: so they are EXECUTE for PUBLIC, and each
-- of them is a pure computation or reads only what every role may read (its
-- settings, pg_locks, its own session): none touches a table of the
-- extension.
--
CREATE SCHEMA idempotency_sql;
COMMENT ON SCHEMA idempotency_sql IS
    'helpers of the SQL edition of idempotency (no table; callable by everyone)';
GRANT USAGE ON SCHEMA idempotency_sql TO PUBLIC;

--
-- setting(name, default, unit): the integer value of setting name, read
-- with current_setting(name, true) (so it may be set per database, role,
-- session or transaction, and in postgresql.conf), in unit ('s', 'ms' or
-- 'B'), as PostgreSQL reads a GUC of that unit: a bare number is in unit,
-- or a number with one of PostgreSQL's units ('30s', '24h', '1MB').
-- Unset or empty: default.  Not a number, or below lo: 22023.
--
CREATE FUNCTION idempotency_sql.setting(name text, dflt bigint, unit text, lo bigint DEFAULT 1)
RETURNS bigint
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    raw     text := pg_catalog.current_setting(name, true);
    m       text[];
    num     numeric;
    factor  numeric;
    v       numeric;
BEGIN
    IF raw IS NULL OR pg_catalog.btrim(raw) OPERATOR(pg_catalog.=) '' THEN
        RETURN dflt;
    END IF;
    m := pg_catalog.regexp_match(raw, '^\s*([-+]?[0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$');
    IF m IS NOT NULL THEN
        num := m[1]::pg_catalog.numeric;
        -- PostgreSQL's units (guc.c), in microseconds or bytes
        factor := CASE m[2]
            WHEN '' THEN CASE unit WHEN 's' THEN 1000000 WHEN 'ms' THEN 1000 ELSE 1 END
            WHEN 'us' THEN 1 WHEN 'ms' THEN 1000 WHEN 's' THEN 1000000
            WHEN 'min' THEN 60000000 WHEN 'h' THEN 3600000000 WHEN 'd' THEN 86400000000
            WHEN 'B' THEN 1 WHEN 'kB' THEN 1024 WHEN 'MB' THEN 1048576
            WHEN 'GB' THEN 1073741824 WHEN 'TB' THEN 1099511627776
            END;
        IF factor IS NOT NULL
           AND (m[2] OPERATOR(pg_catalog.=) ''
                OR (unit OPERATOR(pg_catalog.=) 'B') OPERATOR(pg_catalog.=)
                   (m[2] OPERATOR(pg_catalog.=) ANY (ARRAY['B', 'kB', 'MB', 'GB', 'TB']))) THEN
            v := pg_catalog.round(num OPERATOR(pg_catalog.*) factor OPERATOR(pg_catalog./)
                     CASE unit WHEN 's' THEN 1000000 WHEN 'ms' THEN 1000 ELSE 1 END);
            IF v OPERATOR(pg_catalog.>=) lo AND v OPERATOR(pg_catalog.<=) 9223372036854 THEN
                RETURN v::pg_catalog.int8;
            END IF;
        END IF;
    END IF;
    RAISE EXCEPTION 'invalid value for parameter "%": "%"', name, raw
        USING ERRCODE = 'invalid_parameter_value',
              HINT = CASE unit WHEN 'B' THEN 'Valid units are "B", "kB", "MB", "GB" and "TB".'
                     ELSE 'Valid units are "us", "ms", "s", "min", "h" and "d".' END;
END
$$;

--
-- check_ident(value, what, nonempty): the checks every function makes of
-- a key, a scope or a token, with the C extension's SQLSTATEs and messages:
-- NULL 22004; empty (where nonempty) or longer than 255 bytes 22023.
--
CREATE FUNCTION idempotency_sql.check_ident(value text, what text, nonempty boolean)
RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF value IS NULL THEN
        IF nonempty THEN
            RAISE EXCEPTION 'idempotency % must not be null', what
                USING ERRCODE = 'null_value_not_allowed';
        END IF;
        RAISE EXCEPTION 'idempotency % must not be null', what
            USING ERRCODE = 'null_value_not_allowed', HINT = 'Use '''' for the default scope.';
    END IF;
    IF nonempty AND value OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION 'idempotency % must not be empty', what
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF pg_catalog.octet_length(value) OPERATOR(pg_catalog.>) 255 THEN
        RAISE EXCEPTION 'idempotency % is too long', what
            USING ERRCODE = 'invalid_parameter_value',
                  DETAIL = pg_catalog.format('It has %s bytes; the limit is 255.', pg_catalog.octet_length(value)),
                  HINT = CASE what
                         WHEN 'key' THEN 'Pass a hash of a longer natural key, such as the hex of its SHA-256 (64 bytes).'
                         WHEN 'scope' THEN 'Pass a hash of a longer scope, such as the hex of its SHA-256 (64 bytes).'
                         ELSE 'Pass a token as idem_token_issue returned it.' END;
    END IF;
END
$$;

--
-- check_optional(value, what, nonempty): an optional text argument (trace,
-- checkpoint phase): NULL, or at most 255 bytes and, where nonempty, not
-- empty; 22023 otherwise.
--
CREATE FUNCTION idempotency_sql.check_optional(value text, what text, nonempty boolean)
RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF nonempty AND value OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION '% must not be empty', what
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF pg_catalog.octet_length(value) OPERATOR(pg_catalog.>) 255 THEN
        RAISE EXCEPTION '% is too long', what
            USING ERRCODE = 'invalid_parameter_value',
                  DETAIL = pg_catalog.format('It has %s bytes; the limit is 255.', pg_catalog.octet_length(value));
    END IF;
END
$$;

--
-- usecs(span): an interval in microseconds, a month counted as 30 days and
-- a day as 24 hours (as the C extension and interval comparison count
-- them); NULL where it does not fit.
--
CREATE FUNCTION idempotency_sql.usecs(span interval)
RETURNS bigint
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    y       int := EXTRACT(year FROM span);
    mo      int := EXTRACT(month FROM span);
    d       int := EXTRACT(day FROM span);
    total   numeric;
BEGIN
    -- (OPERATOR() operators all bind alike, left to right: parenthesized)
    total := ((((y OPERATOR(pg_catalog.*) 12) OPERATOR(pg_catalog.+) mo)::pg_catalog.numeric
                  OPERATOR(pg_catalog.*) 30) OPERATOR(pg_catalog.+) d)
             OPERATOR(pg_catalog.*) 86400000000
             OPERATOR(pg_catalog.+)
             (EXTRACT(epoch FROM span OPERATOR(pg_catalog.-)
                      pg_catalog.make_interval(years => y, months => mo, days => d))
              OPERATOR(pg_catalog.*) 1000000);
    IF pg_catalog.abs(total) OPERATOR(pg_catalog.>) 9223372036854775807 THEN
        RETURN NULL;
    END IF;
    RETURN total::pg_catalog.int8;
END
$$;

-- plus_us(ts, usecs): ts plus usecs microseconds (not a calendar interval)
CREATE FUNCTION idempotency_sql.plus_us(ts timestamptz, usecs bigint)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN ts OPERATOR(pg_catalog.+) (usecs OPERATOR(pg_catalog.*) interval '1 microsecond');

--
-- key_lock(scope, key, token): the bigint of the transaction-level
-- advisory lock of a record's strings (an idempotency key's, or a one-time
-- token's, which never meet).  A collision only makes two keys take turns.
--
CREATE FUNCTION idempotency_sql.key_lock(scope text, key text, token boolean)
RETURNS bigint
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN pg_catalog.hashtextextended(
           (CASE WHEN token THEN 't' ELSE 'k' END)
           OPERATOR(pg_catalog.||) scope OPERATOR(pg_catalog.||) pg_catalog.chr(1)
           OPERATOR(pg_catalog.||) key COLLATE pg_catalog."C", 26948);

--
-- Session-bound claims.  The owner session holds a session-level advisory
-- lock (pid, hash of owner_start) for as long as it lives; a claim is over
-- once nobody holds that lock (pg_locks, which every role may read).
-- owner_start is the session's backend_start, as the C extension records
-- it, so that a new backend reusing the pid is not taken for the owner.
--
CREATE FUNCTION idempotency_sql.owner_key(owner_start timestamptz)
RETURNS int
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN pg_catalog.hashint8((EXTRACT(epoch FROM owner_start) OPERATOR(pg_catalog.*) 1000000)::pg_catalog.int8);

CREATE FUNCTION idempotency_sql.owner_alive(owner_pid int, owner_start timestamptz)
RETURNS boolean
LANGUAGE sql VOLATILE STRICT PARALLEL RESTRICTED
SET search_path = pg_catalog, pg_temp
AS $$
SELECT EXISTS (
    SELECT FROM pg_catalog.pg_locks l
     WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory'
       AND l.granted
       AND l.objsubid OPERATOR(pg_catalog.=) 2
       AND l.database OPERATOR(pg_catalog.=)
           (SELECT d.oid FROM pg_catalog.pg_database d
             WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
       AND l.classid::pg_catalog.text::pg_catalog.int8 OPERATOR(pg_catalog.=)
           (owner_pid::pg_catalog.int8 OPERATOR(pg_catalog.&) 4294967295)
       AND l.objid::pg_catalog.text::pg_catalog.int8 OPERATOR(pg_catalog.=)
           (idempotency_sql.owner_key(owner_start)::pg_catalog.int8 OPERATOR(pg_catalog.&) 4294967295)
       AND l.pid OPERATOR(pg_catalog.=) owner_pid)
$$;

-- owner_hold(): make this session an owner, if it is not one, and return
-- the start of its ownership: the backend's start for its first, or the
-- time it began for one after an ownership that ended (pg_advisory_unlock_all,
-- DISCARD ALL, which a session pooler runs between clients), so that the
-- claims of an ownership that ended are never revived.  The start is kept
-- in the session setting idempotency_sql.owner_since (microseconds since
-- the epoch), which DISCARD ALL resets along with the lock.
CREATE FUNCTION idempotency_sql.owner_hold()
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    me      int := pg_catalog.pg_backend_pid();
    kept    text := pg_catalog.current_setting('idempotency_sql.owner_since', true);
    since   timestamptz;
    started timestamptz;
BEGIN
    IF kept IS NOT NULL AND kept OPERATOR(pg_catalog.<>) '' THEN
        since := pg_catalog.to_timestamp(kept::pg_catalog.numeric OPERATOR(pg_catalog./) 1000000);
        IF idempotency_sql.owner_alive(me, since) THEN
            RETURN since;
        END IF;
    END IF;
    SELECT a.backend_start INTO started FROM pg_catalog.pg_stat_get_activity(me) a;
    IF kept IS NULL OR kept OPERATOR(pg_catalog.=) '' THEN
        IF idempotency_sql.owner_alive(me, started) THEN
            since := started;
        ELSIF NOT EXISTS (SELECT FROM idempotency.records r
                           WHERE r.owner_pid OPERATOR(pg_catalog.=) me
                             AND r.owner_start OPERATOR(pg_catalog.=) started) THEN
            since := started;       -- this backend's first ownership
        ELSE
            since := pg_catalog.clock_timestamp();
        END IF;
    ELSE
        since := pg_catalog.clock_timestamp();
    END IF;
    IF NOT idempotency_sql.owner_alive(me, since) THEN
        PERFORM pg_catalog.pg_advisory_lock(me, idempotency_sql.owner_key(since));
    END IF;
    PERFORM pg_catalog.set_config('idempotency_sql.owner_since',
        (EXTRACT(epoch FROM since) OPERATOR(pg_catalog.*) 1000000)::pg_catalog.int8::pg_catalog.text, false);
    RETURN since;
END
$$;

--
-- own_xact(xmin): whether a row version that this transaction sees was
-- written by a transaction still in progress: one of this transaction's
-- own (sub)transactions, since no other's is visible.
--
CREATE FUNCTION idempotency_sql.own_xact(row_xmin xid)
RETURNS boolean
LANGUAGE sql VOLATILE STRICT PARALLEL RESTRICTED
SET search_path = pg_catalog, pg_temp
AS $$
SELECT pg_catalog.pg_xact_status(
           (CASE WHEN f.full OPERATOR(pg_catalog.>) f.xmax
                 THEN f.full OPERATOR(pg_catalog.-) 4294967296 ELSE f.full END)
           ::pg_catalog.text::pg_catalog.xid8) OPERATOR(pg_catalog.=) 'in progress'
  FROM (SELECT s.xmax, ((s.xmax OPERATOR(pg_catalog.>>) 32) OPERATOR(pg_catalog.<<) 32)
                       OPERATOR(pg_catalog.|) row_xmin::pg_catalog.text::pg_catalog.int8 AS full
          FROM (SELECT pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot())
                           ::pg_catalog.text::pg_catalog.int8 AS xmax) s) f
$$;

GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA idempotency_sql TO PUBLIC;

--
-- The settings maintenance reads (the C library's idem_maintenance_settings):
-- idempotency.partition_interval (default 1 day, at most 31 days),
-- idempotency.max_ttl, idempotency.maintenance_lock_timeout (ms).
--
CREATE FUNCTION idempotency.maintenance_settings(
    OUT partition_interval interval,
    OUT max_ttl interval,
    OUT lock_timeout_ms int)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    partition_interval := pg_catalog.make_interval(secs =>
        LEAST(idempotency_sql.setting('idempotency.partition_interval', 86400, 's'),
                         31 OPERATOR(pg_catalog.*) 86400));
    max_ttl := pg_catalog.make_interval(secs =>
        idempotency_sql.setting('idempotency.max_ttl', 604800, 's'));
    lock_timeout_ms := LEAST(
        idempotency_sql.setting('idempotency.maintenance_lock_timeout', 100, 'ms'), 2147483647);
END
$$;

--
-- Statistics: the C extension keeps them in shared memory, which SQL
-- cannot have (a row written per call would make every replay a write).
-- The same objects exist, so that the views and grants are the same; they
-- raise 55000, as the C extension's do without shared_preload_libraries.
--
CREATE FUNCTION idempotency_sql.no_stats()
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'idempotency statistics are not available in the SQL edition'
        USING ERRCODE = 'object_not_in_prerequisite_state',
              HINT = 'The SQL edition keeps no counters (they would make every replay write); count the outcomes idem_acquire returns in the application, or use the C extension with shared_preload_libraries.';
END
$$;
GRANT EXECUTE ON FUNCTION idempotency_sql.no_stats() TO PUBLIC;

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
LANGUAGE plpgsql VOLATILE STRICT
SET search_path = pg_catalog, pg_temp
AS $$ BEGIN PERFORM idempotency_sql.no_stats(); END $$;

CREATE FUNCTION idempotency.idem_acquire_histogram(
    OUT datname name,
    OUT le      double precision,
    OUT count   bigint)
RETURNS SETOF record
LANGUAGE plpgsql VOLATILE STRICT
SET search_path = pg_catalog, pg_temp
AS $$ BEGIN PERFORM idempotency_sql.no_stats(); END $$;

CREATE FUNCTION idempotency.idem_stats_reset()
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE STRICT
SET search_path = pg_catalog, pg_temp
AS $$ BEGIN PERFORM idempotency_sql.no_stats(); RETURN NULL; END $$;

CREATE FUNCTION idempotency.idem_stats_enabled()
RETURNS boolean
LANGUAGE sql STABLE STRICT PARALLEL SAFE
RETURN false;

-- owner_alive, as the C extension has it (idempotency.stale_claims)
CREATE FUNCTION idempotency.owner_alive(owner_pid int, owner_start timestamptz)
RETURNS boolean
LANGUAGE sql VOLATILE STRICT PARALLEL RESTRICTED
SET search_path = pg_catalog, pg_temp
AS $$ SELECT idempotency_sql.owner_alive(owner_pid, owner_start) $$;

REVOKE ALL ON FUNCTION idempotency.maintenance_settings() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_stats() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_acquire_histogram() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_stats_reset() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_stats_enabled() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.owner_alive(int, timestamptz) FROM PUBLIC;

