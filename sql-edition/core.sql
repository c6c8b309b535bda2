
-- ======== the SQL edition's API (sql-edition/core.sql) ========
--
-- The contract's functions in PL/pgSQL, with the C extension's names,
-- parameters, defaults, result columns and SQLSTATEs.  Each runs with its
-- caller's privileges (SECURITY INVOKER; idem_forget and the latch's
-- idempotency_sql.latch and latch_prune excepted, see there)
-- and with search_path fixed to pg_catalog, pg_temp, and names every object
-- with its schema: a caller's search_path changes nothing.
--
-- Why no live (scope, key) is ever acquired twice.  A partitioned table
-- cannot have a unique index on (scope, key) (it would have to hold the
-- partition key, expires_at), so the edition does what the C extension
-- does, with the tools SQL has:
--   1. Every INSERT of a new record of (scope, key) is made by idem_acquire
--      while it holds the key lock: a transaction-level advisory lock on a
--      64-bit hash of (scope, key) (idempotency_sql.key_lock), held until
--      its transaction ends, and after a read of the live record, made by a
--      statement that began after the lock was granted, found none.
--   2. Under READ COMMITTED each statement takes a new snapshot.  A second
--      inserter of the same key gets the lock only once the first one's
--      transaction has ended (commit records the transaction as committed
--      before its locks are released), so its read after the lock sees the
--      first one's committed record and does not insert; if the first one
--      rolled back there is nothing to see, and inserting is right.
--   3. Under REPEATABLE READ and SERIALIZABLE the read uses the
--      transaction's snapshot, which may be older than a record committed
--      meanwhile.  So every new claim, once its read under the key lock
--      found nothing, also writes its key's row of idempotency_sql.key_latches
--      (one row per 64-bit key hash, INSERT ... ON CONFLICT DO UPDATE, through
--      idempotency_sql.latch(), SECURITY DEFINER: no role but the owner has any
--      privilege on the table).  A transaction whose snapshot predates
--      another's committed write of that row gets serialization_failure
--      (40001) from its own upsert (PostgreSQL's rule for ON CONFLICT DO
--      UPDATE on a row version the snapshot cannot see).  Only holders of
--      the same key lock write a row, so nobody waits on it; a write that
--      does not change exactly one row is an error.  idem_forget under
--      REPEATABLE READ writes it too.  idem_maintain deletes only rows
--      whose writer ended before its snapshot and that are older than
--      every live record (see latch_prune).
--   4. Every other change of a record (complete, release, takeover, extend,
--      checkpoint, token consume, forget) is an UPDATE or DELETE of the one
--      row version it read, conditioned on what it read (status, claim,
--      attempt): PostgreSQL's row lock makes concurrent changers take turns,
--      and READ COMMITTED re-checks the condition on the newest version
--      (a takeover that lost the race updates nothing and reads again),
--      REPEATABLE READ raises 40001.
-- A replay reads one row with a plain SELECT: no write, and no lock when
-- the record lies where a call with its ttl looks first (a retry with the
-- ttl of its first call).  A record claimed with a longer ttl than the
-- retry's is found by the read of every live partition, which takes the
-- key lock first if it is free and holds it to the end of the transaction
-- (as the C extension does without its filters): an idem_forget or a new
-- claim of that key from another session waits for that transaction.
--

CREATE TABLE idempotency_sql.key_latches (
    h           bigint PRIMARY KEY,
    touched_at  timestamptz NOT NULL
);
COMMENT ON TABLE idempotency_sql.key_latches IS
    'one row per key hash (idempotency_sql.key_lock) of a new claim: REPEATABLE READ safety; written only through idempotency_sql.latch()';
REVOKE ALL ON idempotency_sql.key_latches FROM PUBLIC;

--
-- latch(key_hash): write the latch row of that key hash (point 3 above).  SECURITY
-- DEFINER, so that no other role needs (or has) any privilege on the table,
-- which would let it move or lock rows and so disable the check or hold up
-- every claim.  Safe to run with the owner's rights: search_path fixed,
-- names qualified, it takes only a bigint and writes only that row, with
-- the server's clock, and only under the key lock of that hash (taken
-- if free).  EXECUTE for PUBLIC: it can do nothing pg_advisory_xact_lock(h)
-- cannot (hold up claims of one key, up to their wait_timeout), and the
-- application's grants stay those of docs/reference.md.
--
CREATE FUNCTION idempotency_sql.latch(key_hash bigint)
RETURNS void
LANGUAGE plpgsql VOLATILE STRICT SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n   bigint;
BEGIN
    -- under the key lock only (its callers hold it already): whoever
    -- holds a latch row's lock holds the key lock too, so a claim of the
    -- key waits on the key lock (up to wait_timeout), never on the row
    IF NOT pg_catalog.pg_try_advisory_xact_lock(latch.key_hash) THEN
        RAISE EXCEPTION 'idempotency latch of key hash % is written only under its key lock', latch.key_hash
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  DETAIL = 'Another transaction holds the key lock.';
    END IF;
    INSERT INTO idempotency_sql.key_latches AS l (h, touched_at)
    VALUES (latch.key_hash, pg_catalog.clock_timestamp())
    ON CONFLICT (h) DO UPDATE SET touched_at = EXCLUDED.touched_at;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n IS DISTINCT FROM 1 THEN
        RAISE EXCEPTION 'idempotency latch of key hash % was not written', latch.key_hash
            USING ERRCODE = 'internal_error',
                  DETAIL = pg_catalog.format('%s rows were written, not 1.', n);
    END IF;
END
$$;
REVOKE ALL ON FUNCTION idempotency_sql.latch(bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency_sql.latch(bigint) TO PUBLIC;

--
-- latch_prune(): delete the latch rows no snapshot can need any more.  A
-- row of hash h guards a live record R of that key claimed by transaction
-- B against a transaction T whose snapshot predates B's commit.  A row is
-- deleted only if (a) its last writer ended before this function's
-- snapshot was taken (xmin older than the snapshot's xmin), so a committed
-- B's record is visible to that snapshot, and (b) it was written before
-- the creation of every live record that snapshot sees: R was created
-- before its latch write, so R is no longer live (expired or forgotten),
-- and T inserting a new record is right.  A writer still open, or one
-- that commits meanwhile, fails (a) on the version DELETE re-checks.
-- No setting is read (a session could SET them).  SECURITY DEFINER
-- (the table is the owner's); EXECUTE to nobody: idem_maintain calls it
-- where its caller may.
--
CREATE FUNCTION idempotency_sql.latch_prune()
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    snap_xmin   xid;
    cutoff      timestamptz;
    n           bigint;
BEGIN
    -- one statement, one snapshot: its xmin and the live records it sees
    SELECT (pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot())::pg_catalog.text::pg_catalog.numeric
            OPERATOR(pg_catalog.%) 4294967296)::pg_catalog.text::pg_catalog.xid,
           coalesce((SELECT pg_catalog.min(r.created_at) FROM idempotency.records r
                      WHERE r.expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()
                        AND NOT r.is_token),
                    pg_catalog.clock_timestamp())
      INTO snap_xmin, cutoff;
    DELETE FROM idempotency_sql.key_latches l
     WHERE l.touched_at OPERATOR(pg_catalog.<) cutoff
       AND pg_catalog.age(l.xmin) OPERATOR(pg_catalog.>) pg_catalog.age(snap_xmin);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;
REVOKE ALL ON FUNCTION idempotency_sql.latch_prune() FROM PUBLIC;

--
-- wait_timeout_ms(): idempotency.wait_timeout in ms, within the C
-- extension's bounds (0 .. INT_MAX ms): 22023 otherwise, at the call
--
CREATE FUNCTION idempotency_sql.wait_timeout_ms()
RETURNS bigint
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v   bigint := idempotency_sql.setting('idempotency.wait_timeout', 3000, 'ms', 0);
BEGIN
    IF v OPERATOR(pg_catalog.>) 2147483647 THEN
        RAISE EXCEPTION '% ms is outside the valid range for parameter "idempotency.wait_timeout" (0 .. 2147483647)', v
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN v;
END
$$;
GRANT EXECUTE ON FUNCTION idempotency_sql.wait_timeout_ms() TO PUBLIC;

--
-- wait_key_lock(lock, deadline): take the key lock, waiting until deadline
-- at most; false if it could not be had in time.  A caller's own
-- lock_timeout that is shorter stays in charge (its 55P03 reaches the
-- caller), as for any lock.  The subtransaction is entered only when the
-- lock is taken.
--
CREATE FUNCTION idempotency_sql.wait_key_lock(lock bigint, deadline timestamptz)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    remaining   bigint;
    own         bigint;
BEGIN
    IF pg_catalog.pg_try_advisory_xact_lock(lock) THEN
        RETURN true;
    END IF;
    remaining := pg_catalog.ceil(EXTRACT(epoch FROM deadline OPERATOR(pg_catalog.-)
                                          pg_catalog.clock_timestamp()) OPERATOR(pg_catalog.*) 1000);
    IF remaining OPERATOR(pg_catalog.<=) 0 THEN
        RETURN false;
    END IF;
    own := idempotency_sql.setting('lock_timeout', 0, 'ms', 0);
    IF own OPERATOR(pg_catalog.>) 0 AND own OPERATOR(pg_catalog.<=) remaining THEN
        PERFORM pg_catalog.pg_advisory_xact_lock(lock);
        RETURN true;
    END IF;
    BEGIN
        -- undone with the subtransaction if the lock times out; else below
        PERFORM pg_catalog.set_config('lock_timeout', remaining::pg_catalog.text, true);
        PERFORM pg_catalog.pg_advisory_xact_lock(lock);
    EXCEPTION WHEN lock_not_available THEN
        RETURN false;
    END;
    PERFORM pg_catalog.set_config('lock_timeout', own::pg_catalog.text, true);
    RETURN true;
END
$$;
GRANT EXECUTE ON FUNCTION idempotency_sql.wait_key_lock(bigint, timestamptz) TO PUBLIC;

-- key_lock_busy(lock): whether another session holds the key lock
CREATE FUNCTION idempotency_sql.key_lock_busy(lock bigint)
RETURNS boolean
LANGUAGE sql VOLATILE STRICT
SET search_path = pg_catalog, pg_temp
AS $$
SELECT EXISTS (
    SELECT FROM pg_catalog.pg_locks l
     WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory'
       AND l.objsubid OPERATOR(pg_catalog.=) 1
       AND l.granted
       AND l.pid OPERATOR(pg_catalog.<>) pg_catalog.pg_backend_pid()
       AND l.database OPERATOR(pg_catalog.=)
           (SELECT d.oid FROM pg_catalog.pg_database d
             WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
       AND l.classid::pg_catalog.text::pg_catalog.int8 OPERATOR(pg_catalog.=)
           ((lock OPERATOR(pg_catalog.>>) 32) OPERATOR(pg_catalog.&) 4294967295)
       AND l.objid::pg_catalog.text::pg_catalog.int8 OPERATOR(pg_catalog.=)
           (lock OPERATOR(pg_catalog.&) 4294967295))
$$;
GRANT EXECUTE ON FUNCTION idempotency_sql.key_lock_busy(bigint) TO PUBLIC;

--
-- rr_check(scope, key, expires_at, what): under REPEATABLE READ or
-- SERIALIZABLE, share-lock the version of the record that the snapshot
-- sees (what = 'record'; the lock is let go at once) or write the key's
-- latch row (what = 'latch'), so that a change committed after the
-- snapshot raises 40001, with the C extension's message; a change in
-- progress is waited for.  Called only under those isolation levels.
--
CREATE FUNCTION idempotency_sql.rr_check(scope text, key text, expires timestamptz, what text)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    k   text COLLATE "C" := rr_check.key;
    s   text COLLATE "C" := rr_check.scope;
BEGIN
    IF what OPERATOR(pg_catalog.=) 'latch' THEN
        PERFORM idempotency_sql.latch(idempotency_sql.key_lock(s, k, false));
    ELSE
        -- the share lock is only a probe: taken in a subtransaction rolled
        -- back at once, so that it is not held to our transaction's end
        -- (the holder's idem_complete would wait for it)
        BEGIN
            PERFORM FROM idempotency.records r
             WHERE r.scope OPERATOR(pg_catalog.=) s AND r.key OPERATOR(pg_catalog.=) k
               AND r.expires_at OPERATOR(pg_catalog.=) expires AND NOT r.is_token
               FOR SHARE;
            RAISE EXCEPTION USING ERRCODE = 'IDMRR';
        EXCEPTION WHEN SQLSTATE 'IDMRR' THEN
            NULL;
        END;
    END IF;
EXCEPTION WHEN serialization_failure THEN
    RAISE EXCEPTION 'could not serialize access due to concurrent change of idempotency key "%"', k
        USING ERRCODE = 'serialization_failure',
              DETAIL = 'The key''s record was changed by a transaction that committed after this transaction''s snapshot was taken.',
              HINT = 'Retry the transaction.';
END
$$;
GRANT EXECUTE ON FUNCTION idempotency_sql.rr_check(text, text, timestamptz, text) TO PUBLIC;

CREATE FUNCTION idempotency.idem_request_hash(request jsonb)
RETURNS bytea
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN pg_catalog.sha256(pg_catalog.convert_to(request::pg_catalog.text, 'UTF8'));

--
-- idem_acquire: see the head of this section and docs/reference.md.
--
CREATE FUNCTION idempotency.idem_acquire(
    key             text,
    request         jsonb    DEFAULT NULL,
    scope           text     DEFAULT '',
    ttl             interval DEFAULT NULL,
    lease           interval DEFAULT NULL,
    session_bound   boolean  DEFAULT false,
    trace           text     DEFAULT NULL)
RETURNS SETOF idempotency.acquire_result
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 1
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    k           text COLLATE "C" := idem_acquire.key;
    s           text COLLATE "C" := idem_acquire.scope;
    max_ttl     bigint;
    ttl_us      bigint;
    lease_us    bigint;
    hash        bytea;
    bound       boolean := coalesce(idem_acquire.session_bound, false);
    my_start    timestamptz;
    now_ts      timestamptz;
    deadline    timestamptz;
    rr          boolean;
    rec         record;
    res         idempotency.acquire_result;
    have_record boolean := false;
    xact_open   boolean := false;
    locked      boolean := false;
    poll_ms     int := 2;
    newclaim    uuid;
    new_until   timestamptz;
    n           int;
    raw         text;
    lock        bigint;
    looked      boolean := false;
BEGIN
    -- The argument checks and the settings, in the order of the helpers
    -- (check_ident, setting, ...), which are called only where they have
    -- something to say: an argument to refuse, a setting that is set.  The
    -- common call (a valid key, settings unset) costs no helper call.
    IF k IS NULL OR k OPERATOR(pg_catalog.=) '' OR pg_catalog.octet_length(k) OPERATOR(pg_catalog.>) 255 THEN
        PERFORM idempotency_sql.check_ident(idem_acquire.key, 'key', true);
    END IF;
    IF s IS NULL OR pg_catalog.octet_length(s) OPERATOR(pg_catalog.>) 255 THEN
        PERFORM idempotency_sql.check_ident(idem_acquire.scope, 'scope', false);
    END IF;
    raw := pg_catalog.current_setting('idempotency.max_ttl', true);
    max_ttl := CASE WHEN raw IS NULL OR raw OPERATOR(pg_catalog.=) '' THEN 604800
                    ELSE idempotency_sql.setting('idempotency.max_ttl', 604800, 's') END
               OPERATOR(pg_catalog.*) 1000000;
    IF idem_acquire.ttl IS NULL THEN
        raw := pg_catalog.current_setting('idempotency.default_ttl', true);
        ttl_us := CASE WHEN raw IS NULL OR raw OPERATOR(pg_catalog.=) '' THEN 86400
                       ELSE idempotency_sql.setting('idempotency.default_ttl', 86400, 's') END
                  OPERATOR(pg_catalog.*) 1000000;
        IF ttl_us OPERATOR(pg_catalog.>) max_ttl THEN
            RAISE EXCEPTION 'idempotency.default_ttl is larger than idempotency.max_ttl'
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Pass a ttl, or lower idempotency.default_ttl.';
        END IF;
    ELSE
        ttl_us := idempotency_sql.usecs(idem_acquire.ttl);
        IF ttl_us IS NULL OR ttl_us OPERATOR(pg_catalog.<=) 0
           OR ttl_us OPERATOR(pg_catalog.>) max_ttl THEN
            RAISE EXCEPTION 'ttl must be greater than zero and at most idempotency.max_ttl'
                USING ERRCODE = 'invalid_parameter_value',
                      DETAIL = pg_catalog.format('idempotency.max_ttl is %s seconds.',
                                                 max_ttl OPERATOR(pg_catalog./) 1000000);
        END IF;
    END IF;
    IF idem_acquire.lease IS NULL THEN
        raw := pg_catalog.current_setting('idempotency.default_lease', true);
        lease_us := LEAST(CASE WHEN raw IS NULL OR raw OPERATOR(pg_catalog.=) '' THEN 60
                               ELSE idempotency_sql.setting('idempotency.default_lease', 60, 's') END
                          OPERATOR(pg_catalog.*) 1000000, ttl_us);
    ELSE
        lease_us := idempotency_sql.usecs(idem_acquire.lease);
        IF lease_us IS NULL OR lease_us OPERATOR(pg_catalog.<=) 0
           OR lease_us OPERATOR(pg_catalog.>) ttl_us THEN
            RAISE EXCEPTION 'lease must be greater than zero and at most the ttl'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END IF;
    hash := pg_catalog.sha256(pg_catalog.convert_to(idem_acquire.request::pg_catalog.text, 'UTF8'));
    IF pg_catalog.octet_length(idem_acquire.trace) OPERATOR(pg_catalog.>) 255 THEN
        PERFORM idempotency_sql.check_optional(idem_acquire.trace, 'trace', false);
    END IF;

    IF bound THEN
        -- taken before the key lock, so that nothing waits on us for it
        my_start := idempotency_sql.owner_hold();
    END IF;
    rr := pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.=)
          ANY (ARRAY['repeatable read', 'serializable']);
    raw := pg_catalog.current_setting('idempotency.wait_timeout', true);
    deadline := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+)
                pg_catalog.make_interval(secs => CASE WHEN raw IS NULL OR raw OPERATOR(pg_catalog.=) '' THEN 3000
                                                      ELSE idempotency_sql.wait_timeout_ms() END
                                                 OPERATOR(pg_catalog./) 1000.0);
    -- idempotency_sql.key_lock(s, k, false), inline
    lock := pg_catalog.hashtextextended('k' OPERATOR(pg_catalog.||) s OPERATOR(pg_catalog.||) pg_catalog.chr(1)
                                        OPERATOR(pg_catalog.||) k, 26948);

    LOOP
        now_ts := pg_catalog.clock_timestamp();
        -- The live record (at most one), as this statement's snapshot sees
        -- it.  The first look reads only the partitions that can hold a
        -- record claimed with this call's ttl since (expires_at up to
        -- now_ts + ttl: a retry's record, in one or two partitions; the plan
        -- is generic, so the others are pruned at executor start, neither
        -- opened nor their index descended).  Where it finds none (a new
        -- key, as a rule) the key lock is taken if it is free, and every live
        -- partition read under it, so that a new key reads them once; if
        -- another transaction holds it, they are read without it, as before.
        -- So a replay of a record claimed with a longer ttl than this call's
        -- may hold the key lock to the end of its transaction, as one found
        -- after a wait does; the common replay takes no lock.
        IF NOT looked THEN
            looked := true;
            SELECT r.xmin AS row_xmin, r.status, r.request_hash, r.response_status,
                   r.response_body, r.attempt, r.locked_until, r.expires_at, r.claim,
                   r.owner_pid, r.owner_start, r.phase, r.state, r.response_headers, r.trace
              INTO rec
              FROM idempotency.records r
             WHERE r.scope OPERATOR(pg_catalog.=) s AND r.key OPERATOR(pg_catalog.=) k
               AND r.expires_at OPERATOR(pg_catalog.>) now_ts
               AND r.expires_at OPERATOR(pg_catalog.<=)
                   (now_ts OPERATOR(pg_catalog.+)
                    (LEAST(ttl_us, 3155760000000000)    -- a hint: 100 years at most, no overflow
                     OPERATOR(pg_catalog.*) interval '1 microsecond'))
               AND NOT r.is_token;
            IF NOT FOUND THEN
                locked := pg_catalog.pg_try_advisory_xact_lock(lock);
                now_ts := pg_catalog.clock_timestamp();
                SELECT r.xmin AS row_xmin, r.status, r.request_hash, r.response_status,
                       r.response_body, r.attempt, r.locked_until, r.expires_at, r.claim,
                       r.owner_pid, r.owner_start, r.phase, r.state, r.response_headers, r.trace
                  INTO rec
                  FROM idempotency.records r
                 WHERE r.scope OPERATOR(pg_catalog.=) s AND r.key OPERATOR(pg_catalog.=) k
                   AND r.expires_at OPERATOR(pg_catalog.>) now_ts AND NOT r.is_token;
            END IF;
        ELSE
            SELECT r.xmin AS row_xmin, r.status, r.request_hash, r.response_status,
                   r.response_body, r.attempt, r.locked_until, r.expires_at, r.claim,
                   r.owner_pid, r.owner_start, r.phase, r.state, r.response_headers, r.trace
              INTO rec
              FROM idempotency.records r
             WHERE r.scope OPERATOR(pg_catalog.=) s AND r.key OPERATOR(pg_catalog.=) k
               AND r.expires_at OPERATOR(pg_catalog.>) now_ts AND NOT r.is_token;
        END IF;
        IF NOT FOUND THEN
            IF NOT locked THEN
                -- wait for a claim in a transaction still open: its
                -- transaction holds the key lock
                IF NOT idempotency_sql.wait_key_lock(lock, deadline) THEN
                    xact_open := true;
                    res.outcome := 'in_progress';
                    EXIT;
                END IF;
                locked := true;
                CONTINUE;   -- read again, with a snapshot taken under the lock
            END IF;
            -- no live record, under the key lock: a new claim.  REPEATABLE
            -- READ safety first (see the head of this section): only here,
            -- so that a replay writes nothing
            IF rr THEN
                PERFORM idempotency_sql.rr_check(s, k, NULL, 'latch');
            ELSE
                PERFORM idempotency_sql.latch(lock);
            END IF;
            newclaim := pg_catalog.gen_random_uuid();
            res.expires_at := (now_ts OPERATOR(pg_catalog.+) (ttl_us OPERATOR(pg_catalog.*) interval '1 microsecond'));
            INSERT INTO idempotency.records AS r
                   (scope, key, status, request_hash, attempt, created_at, locked_until,
                    expires_at, claim, owner_pid, owner_start, is_token, trace)
            VALUES (s, k, 'processing', hash, 1, now_ts,
                    CASE WHEN bound THEN res.expires_at
                         ELSE (now_ts OPERATOR(pg_catalog.+) (lease_us OPERATOR(pg_catalog.*) interval '1 microsecond')) END,
                    res.expires_at, newclaim,
                    CASE WHEN bound THEN pg_catalog.pg_backend_pid() END,
                    CASE WHEN bound THEN my_start END,
                    false, idem_acquire.trace);
            res.outcome := 'acquired';
            res.attempt := 1;
            res.claim := newclaim;
            PERFORM pg_catalog.set_config('idempotency_sql.claimed',
                (EXTRACT(epoch FROM res.expires_at) OPERATOR(pg_catalog.*) 1000000)::pg_catalog.int8::pg_catalog.text
                OPERATOR(pg_catalog.||) ' ' OPERATOR(pg_catalog.||) s OPERATOR(pg_catalog.||) pg_catalog.chr(1)
                OPERATOR(pg_catalog.||) k, true);
            RETURN NEXT res;
            RETURN;
        END IF;

        -- Under REPEATABLE READ and SERIALIZABLE the snapshot may be older
        -- than a change of the record (completed, released, taken over,
        -- forgotten): a share lock on the version it sees raises 40001 if
        -- so, and waits for a transaction changing it now.  (Not in a
        -- read-only transaction, which may not lock rows; the C extension
        -- checks the same under its key lock.)
        IF rr AND NOT have_record
           AND pg_catalog.current_setting('transaction_read_only') OPERATOR(pg_catalog.=) 'off' THEN
            PERFORM idempotency_sql.rr_check(s, k, rec.expires_at, 'record');
        END IF;
        have_record := true;
        IF hash IS NOT NULL AND rec.request_hash IS NOT NULL
           AND hash OPERATOR(pg_catalog.<>) rec.request_hash THEN
            res.outcome := 'mismatch';
            EXIT;
        END IF;
        IF rec.status OPERATOR(pg_catalog.=) 'completed' THEN
            res.outcome := 'replay';
            res.response_status := rec.response_status;
            res.response_body := rec.response_body;
            res.response_headers := rec.response_headers;
            EXIT;
        END IF;

        -- processing: is its claim over (lease run out, or owner gone)?
        IF (CASE WHEN rec.owner_pid IS NULL
                 THEN rec.locked_until IS NULL OR rec.locked_until OPERATOR(pg_catalog.<=) now_ts
                 ELSE NOT coalesce(idempotency_sql.owner_alive(rec.owner_pid, rec.owner_start), false) END) THEN
            IF rec.attempt OPERATOR(pg_catalog.>=) 2147483647 THEN
                RAISE EXCEPTION 'attempt of idempotency key "%" is out of range', k
                    USING ERRCODE = 'numeric_value_out_of_range',
                          DETAIL = pg_catalog.format('The claim''s lease ran out at attempt %s, the largest value of type integer, so it cannot be taken over again.', rec.attempt),
                          HINT = 'Release the claim with idem_release to start again at attempt 1, or wait until the record expires.';
            END IF;
            newclaim := pg_catalog.gen_random_uuid();
            new_until := CASE WHEN bound THEN rec.expires_at
                              ELSE LEAST((now_ts OPERATOR(pg_catalog.+) (lease_us OPERATOR(pg_catalog.*) interval '1 microsecond')),
                                                    rec.expires_at) END;
            -- the version read, if it is still the current one (a
            -- concurrent takeover or completion makes this update nothing)
            UPDATE idempotency.records r
               SET attempt = r.attempt OPERATOR(pg_catalog.+) 1,
                   locked_until = new_until,
                   request_hash = coalesce(r.request_hash, hash),
                   claim = newclaim,
                   owner_pid = CASE WHEN bound THEN pg_catalog.pg_backend_pid() END,
                   owner_start = CASE WHEN bound THEN my_start END,
                   trace = idem_acquire.trace
             WHERE r.scope OPERATOR(pg_catalog.=) s AND r.key OPERATOR(pg_catalog.=) k
               AND r.expires_at OPERATOR(pg_catalog.=) rec.expires_at AND NOT r.is_token
               -- re-checked on the newest version after a wait for its row
               -- lock: a record that expired meanwhile is not taken over
               AND r.expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()
               AND r.status OPERATOR(pg_catalog.=) 'processing'
               AND r.attempt OPERATOR(pg_catalog.=) rec.attempt
               AND r.claim IS NOT DISTINCT FROM rec.claim;
            GET DIAGNOSTICS n = ROW_COUNT;
            IF n OPERATOR(pg_catalog.=) 1 THEN
                res.outcome := 'acquired';
                res.attempt := rec.attempt OPERATOR(pg_catalog.+) 1;
                res.expires_at := rec.expires_at;
                res.claim := newclaim;
                res.phase := rec.phase;
                PERFORM pg_catalog.set_config('idempotency_sql.claimed',
                    (EXTRACT(epoch FROM rec.expires_at) OPERATOR(pg_catalog.*) 1000000)::pg_catalog.int8::pg_catalog.text
                OPERATOR(pg_catalog.||) ' ' OPERATOR(pg_catalog.||) s OPERATOR(pg_catalog.||) pg_catalog.chr(1)
                OPERATOR(pg_catalog.||) k, true);
                res.state := rec.state;
                RETURN NEXT res;
                RETURN;
            END IF;
            CONTINUE;       -- someone else changed it first: read again
        END IF;

        -- our own claim, from earlier in this transaction or (session-bound)
        -- of this session: nothing to wait for
        IF idempotency_sql.own_xact(rec.row_xmin)
           OR rec.owner_pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid() THEN
            xact_open := true;
            res.outcome := 'in_progress';
            EXIT;
        END IF;
        -- Under REPEATABLE READ the snapshot never sees the claim end: a
        -- share lock on the version it sees raises 40001 once another
        -- transaction changed it (completed, released, took it over).
        IF rr AND pg_catalog.current_setting('transaction_read_only') OPERATOR(pg_catalog.=) 'off' THEN
            PERFORM idempotency_sql.rr_check(s, k, rec.expires_at, 'record');
        END IF;
        -- a committed claim still running: poll until it ends or deadline
        IF pg_catalog.clock_timestamp() OPERATOR(pg_catalog.>=) deadline THEN
            res.outcome := 'in_progress';
            EXIT;
        END IF;
        PERFORM pg_catalog.pg_sleep(LEAST(poll_ms OPERATOR(pg_catalog./) 1000.0,
            EXTRACT(epoch FROM deadline OPERATOR(pg_catalog.-) pg_catalog.clock_timestamp())));
        poll_ms := LEAST(poll_ms OPERATOR(pg_catalog.*) 2, 50);
    END LOOP;

    IF have_record THEN
        res.attempt := rec.attempt;
        res.expires_at := rec.expires_at;
        res.origin_trace := rec.trace;
    END IF;
    IF res.outcome OPERATOR(pg_catalog.=) 'in_progress' THEN
        res.retry_after := CASE
            WHEN xact_open OR NOT have_record OR rec.owner_pid IS NOT NULL
                 OR rec.locked_until IS NULL
                 OR rec.locked_until OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp() THEN 1
            ELSE LEAST(pg_catalog.ceil(EXTRACT(epoch FROM rec.locked_until
                                     OPERATOR(pg_catalog.-) pg_catalog.clock_timestamp())), 2147483647)::int
            END;
    END IF;
    RETURN NEXT res;
END
$$;

--
-- lock_claimed(scope, key, token): the live record of (scope, key), row
-- locked (FOR UPDATE), for the functions that change a record a claim
-- already exists for.  Where none is visible, the key lock is waited for
-- (as long as it takes: lock_timeout applies), so that a claim whose
-- transaction is still open is seen once it commits, and read again.
-- Returns no row where there is no live record.  SECURITY INVOKER: the
-- caller needs UPDATE on the table, as for the C extension.
--
CREATE FUNCTION idempotency_sql.lock_claimed(scope text, key text)
RETURNS SETOF idempotency.records
LANGUAGE plpgsql VOLATILE ROWS 1
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    k   text COLLATE "C" := lock_claimed.key;
    s   text COLLATE "C" := lock_claimed.scope;
    r   idempotency.records;
BEGIN
    FOR pass IN 1..2 LOOP
        -- a completed record never changes (until forgotten or expired):
        -- answered without a row lock, so that nobody waits for us
        SELECT x.* INTO r FROM idempotency.records x
         WHERE x.scope OPERATOR(pg_catalog.=) s AND x.key OPERATOR(pg_catalog.=) k
           AND x.expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp() AND NOT x.is_token;
        IF FOUND AND r.status OPERATOR(pg_catalog.=) 'completed' THEN
            RETURN NEXT r;
            RETURN;
        END IF;
        SELECT x.* INTO r FROM idempotency.records x
         WHERE x.scope OPERATOR(pg_catalog.=) s AND x.key OPERATOR(pg_catalog.=) k
           AND x.expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp() AND NOT x.is_token
           FOR UPDATE;
        IF FOUND THEN
            RETURN NEXT r;
            RETURN;
        END IF;
        -- wait only where another transaction holds the key lock (it is
        -- writing a new record), so as to hold nothing otherwise
        EXIT WHEN pass OPERATOR(pg_catalog.=) 2
              OR NOT idempotency_sql.key_lock_busy(idempotency_sql.key_lock(s, k, false));
        PERFORM pg_catalog.pg_advisory_xact_lock(idempotency_sql.key_lock(s, k, false));
    END LOOP;
END
$$;
GRANT EXECUTE ON FUNCTION idempotency_sql.lock_claimed(text, text) TO PUBLIC;

-- the 55000 of a claim or attempt that is not the record's
CREATE FUNCTION idempotency_sql.check_claim(key text, rec idempotency.records,
                                            attempt int, claim uuid)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF attempt IS NOT NULL AND attempt OPERATOR(pg_catalog.<>) rec.attempt THEN
        RAISE EXCEPTION 'attempt % of idempotency key "%" is no longer current', attempt, key
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  DETAIL = pg_catalog.format('The record is at attempt %s: its lease ran out and the claim was taken over.', rec.attempt),
                  HINT = 'Do not report this attempt''s result; the current attempt will.';
    END IF;
    IF claim IS NOT NULL AND claim IS DISTINCT FROM rec.claim THEN
        RAISE EXCEPTION 'claim of idempotency key "%" is not the current claim', key
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  DETAIL = CASE WHEN rec.claim IS NULL
                                THEN 'The record was claimed by version 1.0 and has no claim.'
                                ELSE pg_catalog.format('The record is at attempt %s: the claim was taken over, or released and claimed again.', rec.attempt) END,
                  HINT = 'Do not report this claim''s result; the current claim will.';
    END IF;
END
$$;
GRANT EXECUTE ON FUNCTION idempotency_sql.check_claim(text, idempotency.records, int, uuid) TO PUBLIC;

CREATE FUNCTION idempotency_sql.no_record(scope text, key text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'no live idempotency record for key "%" in scope "%"', key, scope
        USING ERRCODE = 'no_data_found',
              HINT = 'Claim the key with idem_acquire first; a record that has expired or was released cannot be completed.';
END
$$;
GRANT EXECUTE ON FUNCTION idempotency_sql.no_record(text, text) TO PUBLIC;

-- check_attempt(attempt): NULL or positive, else 22023
CREATE FUNCTION idempotency_sql.check_attempt(attempt int)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF attempt OPERATOR(pg_catalog.<) 1 THEN
        RAISE EXCEPTION 'attempt must be a positive number'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;
GRANT EXECUTE ON FUNCTION idempotency_sql.check_attempt(int) TO PUBLIC;

--
-- check_headers(headers): idem_complete's response_headers as stored: a
-- JSON object of at most 64 names, each an RFC 9110 field name (token),
-- lower-cased, none twice, each value a string without CR, LF or NUL
-- (jsonb holds no NUL), with the C extension's messages, checked in its
-- order (jsonb's order of keys).
--
CREATE FUNCTION idempotency_sql.check_headers(headers jsonb)
RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE STRICT
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    result  jsonb := '{}';
    given   jsonb := '{}';      -- lower-case name -> the name as given
    name    text;
    value   jsonb;
    low     text;
    n       int;
BEGIN
    IF pg_catalog.jsonb_typeof(headers) OPERATOR(pg_catalog.<>) 'object' THEN
        RAISE EXCEPTION 'response_headers must be a JSON object'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass an object of header name and string value, such as ''{"Location": "/orders/1"}''.';
    END IF;
    SELECT pg_catalog.count(*) INTO n FROM pg_catalog.jsonb_object_keys(headers);
    IF n OPERATOR(pg_catalog.>) 64 THEN
        RAISE EXCEPTION 'too many response headers'
            USING ERRCODE = 'invalid_parameter_value',
                  DETAIL = pg_catalog.format('response_headers has %s headers; the limit is 64.', n),
                  HINT = 'Store only the headers a replay needs, such as Location and ETag.';
    END IF;
    FOR name, value IN SELECT e.key, e.value FROM pg_catalog.jsonb_each(headers) e LOOP
        IF name OPERATOR(pg_catalog.!~) '^[-!#$%&''*+.^_`|~0-9A-Za-z]+$' THEN
            RAISE EXCEPTION 'invalid response header name'
                USING ERRCODE = 'invalid_parameter_value',
                      DETAIL = pg_catalog.format('Header name %s is not an HTTP field name.', pg_catalog.to_json(name)),
                      HINT = 'A header name is one or more letters, digits or characters of !#$%&''*+-.^_`|~ (an RFC 9110 token).';
        END IF;
        low := pg_catalog.lower(name COLLATE pg_catalog."C");
        IF given OPERATOR(pg_catalog.?) low THEN
            RAISE EXCEPTION 'duplicate response header name'
                USING ERRCODE = 'invalid_parameter_value',
                      DETAIL = pg_catalog.format('Header names %s and %s are the same name in lower case.',
                                                 pg_catalog.to_json(given OPERATOR(pg_catalog.->>) low), pg_catalog.to_json(name)),
                      HINT = 'Store each header once.';
        END IF;
        given := given OPERATOR(pg_catalog.||) pg_catalog.jsonb_build_object(low, name);
        IF pg_catalog.jsonb_typeof(value) OPERATOR(pg_catalog.<>) 'string' THEN
            RAISE EXCEPTION 'value of response header "%" is not a string', low
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Store every header value as a JSON string.';
        END IF;
        IF (value OPERATOR(pg_catalog.#>>) '{}') OPERATOR(pg_catalog.~) '[\r\n]' THEN
            RAISE EXCEPTION 'invalid response header value'
                USING ERRCODE = 'invalid_parameter_value',
                      DETAIL = pg_catalog.format('The value of header %s holds a %s.', pg_catalog.to_json(name),
                                                 CASE WHEN pg_catalog.strpos(value OPERATOR(pg_catalog.#>>) '{}', pg_catalog.chr(13))
                                                           OPERATOR(pg_catalog.>) 0
                                                       AND (pg_catalog.strpos(value OPERATOR(pg_catalog.#>>) '{}', pg_catalog.chr(10))
                                                            OPERATOR(pg_catalog.=) 0
                                                            OR pg_catalog.strpos(value OPERATOR(pg_catalog.#>>) '{}', pg_catalog.chr(13))
                                                               OPERATOR(pg_catalog.<)
                                                               pg_catalog.strpos(value OPERATOR(pg_catalog.#>>) '{}', pg_catalog.chr(10)))
                                                      THEN 'carriage return (CR)' ELSE 'line feed (LF)' END),
                      HINT = 'A header value is one line of text: remove its CR, LF and NUL characters.';
        END IF;
        result := result OPERATOR(pg_catalog.||) pg_catalog.jsonb_build_object(low, value);
    END LOOP;
    RETURN result;
END
$$;
GRANT EXECUTE ON FUNCTION idempotency_sql.check_headers(jsonb) TO PUBLIC;

CREATE FUNCTION idempotency.idem_complete(
    key              text,
    response_status  int,
    response_body    jsonb DEFAULT NULL,
    scope            text  DEFAULT '',
    attempt          int   DEFAULT NULL,
    claim            uuid  DEFAULT NULL,
    response_headers jsonb DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    k           text COLLATE "C" := idem_complete.key;
    s           text COLLATE "C" := idem_complete.scope;
    max_bytes   bigint;
    size        bigint := 0;
    headers     jsonb;
    rec         idempotency.records;
    raw         text;
    sp          int;
BEGIN
    -- the helpers are called only where they have something to say, as in
    -- idem_acquire
    IF k IS NULL OR k OPERATOR(pg_catalog.=) '' OR pg_catalog.octet_length(k) OPERATOR(pg_catalog.>) 255 THEN
        PERFORM idempotency_sql.check_ident(idem_complete.key, 'key', true);
    END IF;
    IF s IS NULL OR pg_catalog.octet_length(s) OPERATOR(pg_catalog.>) 255 THEN
        PERFORM idempotency_sql.check_ident(idem_complete.scope, 'scope', false);
    END IF;
    IF idem_complete.response_status IS NULL THEN
        RAISE EXCEPTION 'response_status must not be null'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF idem_complete.response_status OPERATOR(pg_catalog.<) 100
       OR idem_complete.response_status OPERATOR(pg_catalog.>) 599 THEN
        RAISE EXCEPTION 'response_status % is not an HTTP status code', idem_complete.response_status
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Use a status from 100 to 599.';
    END IF;
    raw := pg_catalog.current_setting('idempotency.max_response_bytes', true);
    max_bytes := CASE WHEN raw IS NULL OR raw OPERATOR(pg_catalog.=) '' THEN 1048576
                      ELSE idempotency_sql.setting('idempotency.max_response_bytes', 1048576, 'B') END;
    IF idem_complete.response_body IS NOT NULL THEN
        size := pg_catalog.pg_column_size(idem_complete.response_body);
        IF size OPERATOR(pg_catalog.>) max_bytes THEN
            RAISE EXCEPTION 'response_body is too large'
                USING ERRCODE = 'program_limit_exceeded',
                      DETAIL = pg_catalog.format('It takes %s bytes; idempotency.max_response_bytes is %s.', size, max_bytes);
        END IF;
    END IF;
    IF idem_complete.attempt OPERATOR(pg_catalog.<) 1 THEN
        PERFORM idempotency_sql.check_attempt(idem_complete.attempt);
    END IF;
    IF idem_complete.response_headers IS NOT NULL THEN
        headers := idempotency_sql.check_headers(idem_complete.response_headers);
        size := size OPERATOR(pg_catalog.+) pg_catalog.pg_column_size(headers);
        IF size OPERATOR(pg_catalog.>) max_bytes THEN
            RAISE EXCEPTION 'response_body and response_headers are too large'
                USING ERRCODE = 'program_limit_exceeded',
                      DETAIL = pg_catalog.format('They take %s bytes together; idempotency.max_response_bytes is %s.', size, max_bytes);
        END IF;
    END IF;

    -- The claim this transaction made last (idem_acquire's hint, see
    -- there): its record is completed in its one partition, in one
    -- statement, if it is still live and processing and its attempt and
    -- claim are those given (the row lock taken by the UPDATE, and under
    -- READ COMMITTED the conditions checked again on the newest version, as
    -- lock_claimed's FOR UPDATE would).  The hint only says where to look:
    -- the row is the live record of (scope, key) whatever wrote the hint.
    -- Otherwise (no hint, a record no longer processing, a claim or attempt
    -- to refuse) the general way below, which also gives the errors.
    raw := pg_catalog.current_setting('idempotency_sql.claimed', true);
    IF raw IS NOT NULL THEN
        sp := pg_catalog.strpos(raw, ' ');
        IF sp OPERATOR(pg_catalog.>) 1
           AND pg_catalog.substr(raw, sp OPERATOR(pg_catalog.+) 1) OPERATOR(pg_catalog.=)
               (s OPERATOR(pg_catalog.||) pg_catalog.chr(1) OPERATOR(pg_catalog.||) k)
           AND pg_catalog.left(raw, sp OPERATOR(pg_catalog.-) 1) OPERATOR(pg_catalog.~) '^[0-9]{1,18}$' THEN
            UPDATE idempotency.records x
               SET status = 'completed',
                   response_status = idem_complete.response_status,
                   response_body = idem_complete.response_body,
                   response_headers = headers,
                   completed_at = pg_catalog.clock_timestamp(),
                   locked_until = NULL
             WHERE x.scope OPERATOR(pg_catalog.=) s AND x.key OPERATOR(pg_catalog.=) k
               AND x.expires_at OPERATOR(pg_catalog.=)
                   ('1970-01-01 00:00:00+00'::pg_catalog.timestamptz OPERATOR(pg_catalog.+)
                    (pg_catalog.left(raw, sp OPERATOR(pg_catalog.-) 1)::pg_catalog.int8
                     OPERATOR(pg_catalog.*) interval '1 microsecond'))
               AND x.expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp() AND NOT x.is_token
               AND x.status OPERATOR(pg_catalog.=) 'processing'
               AND (idem_complete.attempt IS NULL OR x.attempt OPERATOR(pg_catalog.=) idem_complete.attempt)
               AND (idem_complete.claim IS NULL OR x.claim OPERATOR(pg_catalog.=) idem_complete.claim);
            GET DIAGNOSTICS sp = ROW_COUNT;
            IF sp OPERATOR(pg_catalog.=) 1 THEN
                RETURN true;
            END IF;
        END IF;
    END IF;
    SELECT * INTO rec FROM idempotency_sql.lock_claimed(idem_complete.scope, idem_complete.key);
    IF rec.key IS NULL THEN
        PERFORM idempotency_sql.no_record(idem_complete.scope, idem_complete.key);
    END IF;
    IF (idem_complete.attempt IS NOT NULL AND idem_complete.attempt OPERATOR(pg_catalog.<>) rec.attempt)
       OR (idem_complete.claim IS NOT NULL AND idem_complete.claim IS DISTINCT FROM rec.claim) THEN
        PERFORM idempotency_sql.check_claim(idem_complete.key, rec, idem_complete.attempt, idem_complete.claim);
    END IF;
    IF rec.status OPERATOR(pg_catalog.=) 'completed' THEN
        RETURN false;
    END IF;
    UPDATE idempotency.records r
       SET status = 'completed',
           response_status = idem_complete.response_status,
           response_body = idem_complete.response_body,
           response_headers = headers,
           completed_at = pg_catalog.clock_timestamp(),
           locked_until = NULL
     WHERE r.scope OPERATOR(pg_catalog.=) rec.scope AND r.key OPERATOR(pg_catalog.=) rec.key
       AND r.expires_at OPERATOR(pg_catalog.=) rec.expires_at;
    RETURN true;
END
$$;

CREATE FUNCTION idempotency.idem_release(
    key         text,
    scope       text DEFAULT '',
    attempt     int  DEFAULT NULL,
    claim       uuid DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    rec     idempotency.records;
BEGIN
    PERFORM idempotency_sql.check_ident(idem_release.key, 'key', true);
    PERFORM idempotency_sql.check_ident(idem_release.scope, 'scope', false);
    PERFORM idempotency_sql.check_attempt(idem_release.attempt);
    SELECT * INTO rec FROM idempotency_sql.lock_claimed(idem_release.scope, idem_release.key);
    IF rec.key IS NULL THEN
        RETURN false;
    END IF;
    PERFORM idempotency_sql.check_claim(idem_release.key, rec, idem_release.attempt, idem_release.claim);
    IF rec.status OPERATOR(pg_catalog.=) 'completed' THEN
        RETURN false;
    END IF;
    DELETE FROM idempotency.records r
     WHERE r.scope OPERATOR(pg_catalog.=) rec.scope AND r.key OPERATOR(pg_catalog.=) rec.key
       AND r.expires_at OPERATOR(pg_catalog.=) rec.expires_at;
    RETURN true;
END
$$;

CREATE FUNCTION idempotency.idem_lookup(
    key         text,
    scope       text DEFAULT '')
RETURNS TABLE (status text, request_hash bytea, response_status int,
               response_body jsonb, attempt int, created_at timestamptz,
               locked_until timestamptz, completed_at timestamptz,
               expires_at timestamptz, owner_pid int, phase text,
               state jsonb, response_headers jsonb, origin_trace text)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 1
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    k   text COLLATE "C" := idem_lookup.key;
    s   text COLLATE "C" := idem_lookup.scope;
BEGIN
    PERFORM idempotency_sql.check_ident(idem_lookup.key, 'key', true);
    PERFORM idempotency_sql.check_ident(idem_lookup.scope, 'scope', false);
    RETURN QUERY
        SELECT r.status, r.request_hash, r.response_status, r.response_body, r.attempt,
               r.created_at, r.locked_until, r.completed_at, r.expires_at,
               CASE WHEN r.status OPERATOR(pg_catalog.=) 'completed' THEN NULL ELSE r.owner_pid END,
               r.phase, r.state, r.response_headers, r.trace
          FROM idempotency.records r
         WHERE r.scope OPERATOR(pg_catalog.=) s AND r.key OPERATOR(pg_catalog.=) k
           AND r.expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp() AND NOT r.is_token;
END
$$;

--
-- lock_processing: the live processing record of the holder's functions
-- (idem_extend, idem_checkpoint), row locked, or their errors: no live
-- record P0002, a claim not the record's 55000, completed P0002.
--
CREATE FUNCTION idempotency_sql.lock_processing(scope text, key text, claim uuid, completed_detail text)
RETURNS idempotency.records
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    rec     idempotency.records;
BEGIN
    SELECT * INTO rec FROM idempotency_sql.lock_claimed(scope, key);
    IF rec.key IS NULL THEN
        PERFORM idempotency_sql.no_record(scope, key);
    END IF;
    PERFORM idempotency_sql.check_claim(key, rec, NULL, claim);
    IF rec.status OPERATOR(pg_catalog.=) 'completed' THEN
        RAISE EXCEPTION 'idempotency key "%" in scope "%" is completed', key, scope
            USING ERRCODE = 'no_data_found', DETAIL = completed_detail;
    END IF;
    RETURN rec;
END
$$;
GRANT EXECUTE ON FUNCTION idempotency_sql.lock_processing(text, text, uuid, text) TO PUBLIC;

CREATE FUNCTION idempotency.idem_extend(
    key         text,
    scope       text     DEFAULT '',
    claim       uuid     DEFAULT NULL,
    lease       interval DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    max_ttl     bigint;
    lease_us    bigint;
    rec         idempotency.records;
    until       timestamptz;
    now_ts      timestamptz;
BEGIN
    PERFORM idempotency_sql.check_ident(idem_extend.key, 'key', true);
    PERFORM idempotency_sql.check_ident(idem_extend.scope, 'scope', false);
    max_ttl := idempotency_sql.setting('idempotency.max_ttl', 604800, 's') OPERATOR(pg_catalog.*) 1000000;
    IF idem_extend.lease IS NULL THEN
        lease_us := idempotency_sql.setting('idempotency.default_lease', 60, 's') OPERATOR(pg_catalog.*) 1000000;
    ELSE
        lease_us := idempotency_sql.usecs(idem_extend.lease);
        IF lease_us IS NULL OR lease_us OPERATOR(pg_catalog.<=) 0
           OR lease_us OPERATOR(pg_catalog.>) max_ttl THEN
            RAISE EXCEPTION 'lease must be greater than zero and at most idempotency.max_ttl'
                USING ERRCODE = 'invalid_parameter_value',
                      DETAIL = pg_catalog.format('idempotency.max_ttl is %s seconds.', max_ttl OPERATOR(pg_catalog./) 1000000);
        END IF;
    END IF;
    rec := idempotency_sql.lock_processing(idem_extend.scope, idem_extend.key, idem_extend.claim,
                                           'Only a processing claim has a lease to extend.');
    IF rec.owner_pid IS NOT NULL THEN
        RETURN coalesce(rec.locked_until, rec.expires_at);
    END IF;
    now_ts := pg_catalog.clock_timestamp();
    until := LEAST(idempotency_sql.plus_us(now_ts, lease_us),
                              rec.expires_at);
    UPDATE idempotency.records r SET locked_until = until
     WHERE r.scope OPERATOR(pg_catalog.=) rec.scope AND r.key OPERATOR(pg_catalog.=) rec.key
       AND r.expires_at OPERATOR(pg_catalog.=) rec.expires_at;
    RETURN until;
END
$$;

CREATE FUNCTION idempotency.idem_checkpoint(
    key         text,
    scope       text  DEFAULT '',
    claim       uuid  DEFAULT NULL,
    phase       text  DEFAULT NULL,
    state       jsonb DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    rec         idempotency.records;
    max_bytes   bigint;
BEGIN
    PERFORM idempotency_sql.check_ident(idem_checkpoint.key, 'key', true);
    PERFORM idempotency_sql.check_ident(idem_checkpoint.scope, 'scope', false);
    IF idem_checkpoint.claim IS NULL THEN
        RAISE EXCEPTION 'checkpoint claim must not be null'
            USING ERRCODE = 'null_value_not_allowed',
                  DETAIL = 'Only the holder of the processing claim records its checkpoint.',
                  HINT = 'Pass the claim that idem_acquire returned.';
    END IF;
    IF idem_checkpoint.phase IS NULL THEN
        RAISE EXCEPTION 'checkpoint phase must not be null'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Name the step the claim has got to, such as ''charged''.';
    END IF;
    PERFORM idempotency_sql.check_optional(idem_checkpoint.phase, 'checkpoint phase', true);
    IF idem_checkpoint.state IS NOT NULL THEN
        max_bytes := idempotency_sql.setting('idempotency.max_response_bytes', 1048576, 'B');
        IF pg_catalog.pg_column_size(idem_checkpoint.state) OPERATOR(pg_catalog.>) max_bytes THEN
            RAISE EXCEPTION 'checkpoint state is too large'
                USING ERRCODE = 'program_limit_exceeded',
                      DETAIL = pg_catalog.format('It takes %s bytes; idempotency.max_response_bytes is %s.',
                                                 pg_catalog.pg_column_size(idem_checkpoint.state), max_bytes);
        END IF;
    END IF;
    rec := idempotency_sql.lock_processing(idem_checkpoint.scope, idem_checkpoint.key, idem_checkpoint.claim,
                                           'Only a processing claim records checkpoints.');
    UPDATE idempotency.records r
       SET phase = idem_checkpoint.phase, state = idem_checkpoint.state
     WHERE r.scope OPERATOR(pg_catalog.=) rec.scope AND r.key OPERATOR(pg_catalog.=) rec.key
       AND r.expires_at OPERATOR(pg_catalog.=) rec.expires_at;
    RETURN coalesce(rec.locked_until, rec.expires_at);
END
$$;

--
-- idem_forget.  SECURITY DEFINER, the one function that is: the contract
-- lets a role granted EXECUTE on it forget keys without any privilege on
-- the table (an operator role), which only the table owner's rights can
-- give in SQL.  It is safe to run with them: search_path is fixed, every
-- name is qualified, it takes only (scope, key) and deletes only the live
-- record of that key (never a token), and EXECUTE is granted to nobody.
--
CREATE FUNCTION idempotency.idem_forget(
    key         text,
    scope       text DEFAULT '')
RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    k           text COLLATE "C" := idem_forget.key;
    s           text COLLATE "C" := idem_forget.scope;
    wait_ms     bigint;
    own         bigint;
    deadline    timestamptz;
    n           int;
BEGIN
    PERFORM idempotency_sql.check_ident(idem_forget.key, 'key', true);
    PERFORM idempotency_sql.check_ident(idem_forget.scope, 'scope', false);
    wait_ms := idempotency_sql.wait_timeout_ms();
    deadline := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+)
                pg_catalog.make_interval(secs => wait_ms OPERATOR(pg_catalog./) 1000.0);
    -- a claim in a transaction still open holds the key lock
    IF NOT idempotency_sql.wait_key_lock(idempotency_sql.key_lock(s, k, false), deadline) THEN
        RAISE EXCEPTION 'could not forget idempotency key "%" in scope "%": another transaction is still writing its record', k, s
            USING ERRCODE = 'lock_not_available',
                  DETAIL = pg_catalog.format('It waited idempotency.wait_timeout (%s ms) for that transaction to end.', wait_ms),
                  HINT = 'Retry once that transaction has ended, or raise idempotency.wait_timeout.';
    END IF;
    -- Under REPEATABLE READ and SERIALIZABLE the snapshot may predate a
    -- claim committed since (invisible to the DELETE below): its latch
    -- write raises 40001 then, as in idem_acquire
    IF pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.=)
       ANY (ARRAY['repeatable read', 'serializable']) THEN
        PERFORM idempotency_sql.rr_check(s, k, NULL, 'latch');
    END IF;
    -- a change in progress of the record (a completion, a takeover) holds
    -- its row lock: wait for it until the deadline too
    own := idempotency_sql.setting('lock_timeout', 0, 'ms', 0);
    BEGIN
        PERFORM pg_catalog.set_config('lock_timeout',
            GREATEST(1, pg_catalog.ceil(EXTRACT(epoch FROM deadline OPERATOR(pg_catalog.-)
                                                   pg_catalog.clock_timestamp()) OPERATOR(pg_catalog.*) 1000))::pg_catalog.text,
            true);
        DELETE FROM idempotency.records r
         WHERE r.scope OPERATOR(pg_catalog.=) s AND r.key OPERATOR(pg_catalog.=) k
           AND r.expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp() AND NOT r.is_token;
        GET DIAGNOSTICS n = ROW_COUNT;
        PERFORM pg_catalog.set_config('lock_timeout', own::pg_catalog.text, true);
    EXCEPTION WHEN lock_not_available THEN
        RAISE EXCEPTION 'could not forget idempotency key "%" in scope "%": another transaction is still writing its record', k, s
            USING ERRCODE = 'lock_not_available',
                  DETAIL = pg_catalog.format('It waited idempotency.wait_timeout (%s ms) for that transaction to end.', wait_ms),
                  HINT = 'Retry once that transaction has ended, or raise idempotency.wait_timeout.';
    END;
    RETURN n OPERATOR(pg_catalog.>) 0;
END
$$;

--
-- One-time tokens: records of their own kind (is_token), the token as
-- their key; issued 'processing', consumed 'completed'.
--
CREATE FUNCTION idempotency.idem_token_issue(
    scope   text     DEFAULT '',
    ttl     interval DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    max_ttl     bigint;
    ttl_us      bigint;
    token       text;
    now_ts      timestamptz;
BEGIN
    PERFORM idempotency_sql.check_ident(idem_token_issue.scope, 'scope', false);
    max_ttl := idempotency_sql.setting('idempotency.max_ttl', 604800, 's') OPERATOR(pg_catalog.*) 1000000;
    IF idem_token_issue.ttl IS NULL THEN
        ttl_us := idempotency_sql.setting('idempotency.default_ttl', 86400, 's') OPERATOR(pg_catalog.*) 1000000;
        IF ttl_us OPERATOR(pg_catalog.>) max_ttl THEN
            RAISE EXCEPTION 'idempotency.default_ttl is larger than idempotency.max_ttl'
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Pass a ttl, or lower idempotency.default_ttl.';
        END IF;
    ELSE
        ttl_us := idempotency_sql.usecs(idem_token_issue.ttl);
        IF ttl_us IS NULL OR ttl_us OPERATOR(pg_catalog.<=) 0 OR ttl_us OPERATOR(pg_catalog.>) max_ttl THEN
            RAISE EXCEPTION 'ttl must be greater than zero and at most idempotency.max_ttl'
                USING ERRCODE = 'invalid_parameter_value',
                      DETAIL = pg_catalog.format('idempotency.max_ttl is %s seconds.', max_ttl OPERATOR(pg_catalog./) 1000000);
        END IF;
    END IF;
    -- 192 bits, as 32 URL-safe characters: two random UUIDs (244 bits
    -- from the server's strong random source) through SHA-256
    token := pg_catalog.translate(pg_catalog.encode(pg_catalog.substr(pg_catalog.sha256(
                 pg_catalog.uuid_send(pg_catalog.gen_random_uuid()) OPERATOR(pg_catalog.||)
                 pg_catalog.uuid_send(pg_catalog.gen_random_uuid())), 1, 24), 'base64'), '+/', '-_');
    now_ts := pg_catalog.clock_timestamp();
    INSERT INTO idempotency.records (scope, key, status, attempt, created_at, expires_at, is_token)
    VALUES (idem_token_issue.scope, token, 'processing', 1, now_ts,
            idempotency_sql.plus_us(now_ts, ttl_us), true);
    RETURN token;
END
$$;

CREATE FUNCTION idempotency.idem_token_consume(
    token   text,
    scope   text DEFAULT '')
RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    t           text COLLATE "C" := idem_token_consume.token;
    s           text COLLATE "C" := idem_token_consume.scope;
    wait_ms     bigint;
    own         bigint;
    found_at    timestamptz;
BEGIN
    PERFORM idempotency_sql.check_ident(idem_token_consume.token, 'token', true);
    PERFORM idempotency_sql.check_ident(idem_token_consume.scope, 'scope', false);
    wait_ms := idempotency_sql.wait_timeout_ms();
    own := idempotency_sql.setting('lock_timeout', 0, 'ms', 0);
    BEGIN
        IF own OPERATOR(pg_catalog.=) 0 OR own OPERATOR(pg_catalog.>) wait_ms THEN
            PERFORM pg_catalog.set_config('lock_timeout', GREATEST(wait_ms, 1)::pg_catalog.text, true);
        END IF;
        -- the row lock: concurrent consumers take turns; under READ
        -- COMMITTED the condition is checked again on the version a
        -- consumer that went first left
        SELECT r.expires_at INTO found_at FROM idempotency.records r
         WHERE r.scope OPERATOR(pg_catalog.=) s AND r.key OPERATOR(pg_catalog.=) t AND r.is_token
           AND r.status OPERATOR(pg_catalog.=) 'processing'
           AND r.expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()
           FOR UPDATE;
        PERFORM pg_catalog.set_config('lock_timeout', own::pg_catalog.text, true);
    EXCEPTION
    WHEN serialization_failure THEN
        RAISE EXCEPTION 'could not serialize access due to concurrent change of a one-time token'
            USING ERRCODE = 'serialization_failure',
                  DETAIL = 'The token was consumed or issued by a transaction that committed after this transaction''s snapshot was taken.',
                  HINT = 'Retry the transaction.';
    WHEN lock_not_available THEN
        RAISE EXCEPTION 'could not consume one-time token: another transaction is still writing it'
            USING ERRCODE = 'lock_not_available',
                  DETAIL = pg_catalog.format('It waited idempotency.wait_timeout (%s ms) for that transaction, which is consuming or issuing the token, to end.', wait_ms),
                  HINT = 'Retry: the token is spent if that transaction commits, and still live if it rolls back.';
    END;
    IF found_at IS NULL THEN
        RETURN false;
    END IF;
    UPDATE idempotency.records r
       SET status = 'completed', completed_at = pg_catalog.clock_timestamp()
     WHERE r.scope OPERATOR(pg_catalog.=) s AND r.key OPERATOR(pg_catalog.=) t AND r.is_token
       AND r.expires_at OPERATOR(pg_catalog.=) found_at;
    RETURN true;
END
$$;

--
-- No known-absent filters in this edition (they live in shared memory):
-- the two functions exist, so that the same calls work; build_filters
-- builds nothing, idem_filters lists none.
--
CREATE FUNCTION idempotency.build_filters(max_wait interval DEFAULT NULL)
RETURNS int
LANGUAGE sql VOLATILE PARALLEL UNSAFE
RETURN 0;

CREATE FUNCTION idempotency.idem_filters(
    OUT partition       regclass,
    OUT state           text,
    OUT size_bytes      bigint,
    OUT bits_set        bigint,
    OUT estimated_keys  bigint)
RETURNS SETOF record
LANGUAGE sql VOLATILE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT NULL::pg_catalog.regclass, NULL::pg_catalog.text, NULL::pg_catalog.int8,
             NULL::pg_catalog.int8, NULL::pg_catalog.int8 WHERE false $$;

--
-- idem_maintain(), the edition's: the shared one also builds the filters
-- and checks their triggers, which this edition has not.  No daily
-- statistics either (there are no counters): it only lets old days of
-- idempotency.daily go (rows moved from the C extension), then does the
-- partition work.
--
CREATE OR REPLACE FUNCTION idempotency.idem_maintain()
RETURNS TABLE (partitions_created int, partitions_dropped int)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    DELETE FROM idempotency.daily d
     WHERE d.day OPERATOR(pg_catalog.<=)
           ((pg_catalog.clock_timestamp() AT TIME ZONE 'UTC')::pg_catalog.date
            OPERATOR(pg_catalog.-) coalesce(pg_catalog.current_setting('idempotency.stats_retention', true),
                                            '90 days')::pg_catalog.interval);
    RETURN QUERY SELECT m.partitions_created, m.partitions_dropped
                   FROM idempotency.maintain_partitions() m;
    -- the latch rows no snapshot can need (where this role may: the
    -- owner); last, so that their row locks are held only briefly (a new
    -- claim of such a key waits for them)
    IF pg_catalog.has_function_privilege('idempotency_sql.latch_prune()', 'EXECUTE') THEN
        PERFORM idempotency_sql.latch_prune();
    END IF;
END
$$;

REVOKE ALL ON FUNCTION idempotency.idem_acquire(text, jsonb, text, interval, interval, boolean, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_complete(text, int, jsonb, text, int, uuid, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_release(text, text, int, uuid) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_lookup(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_extend(text, text, uuid, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_checkpoint(text, text, uuid, text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_forget(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_token_issue(text, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_token_consume(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_request_hash(jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.build_filters(interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_filters() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_maintain() FROM PUBLIC;

--
-- cron_check(schedule), the edition's: the shared one reads
-- cron.database_name, which pg_cron lets only superusers and members of
-- pg_read_all_settings read (42501 otherwise), and the edition's users are
-- neither, as a rule.  Where it cannot be read, pg_cron's database is this
-- one if pg_cron is installed here; otherwise the error says where to make
-- the call instead.  The rest is the shared function's.
--
CREATE OR REPLACE FUNCTION idempotency.cron_check(schedule text)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cron_db     text;
    job_name    text := pg_catalog.concat('idempotency-maintenance:', pg_catalog.current_database());
    call        text;
BEGIN
    BEGIN
        cron_db := pg_catalog.current_setting('cron.database_name', true);
    EXCEPTION WHEN insufficient_privilege THEN
        cron_db := CASE WHEN EXISTS (SELECT FROM pg_catalog.pg_extension e
                                      WHERE e.extname OPERATOR(pg_catalog.=) 'pg_cron')
                        THEN pg_catalog.current_database() ELSE '' END;
    END;
    IF cron_db IS NULL THEN
        RAISE EXCEPTION 'pg_cron is not loaded'
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Install pg_cron (Debian: apt-get install postgresql-15-cron), add pg_cron to shared_preload_libraries, set cron.database_name, restart the server and run CREATE EXTENSION pg_cron in that database.  On a managed service, turn pg_cron on in its settings.';
    END IF;
    call := CASE WHEN schedule IS NULL
                 THEN pg_catalog.format('SELECT cron.unschedule(%L);', job_name)
                 ELSE pg_catalog.format('SELECT cron.schedule_in_database(%L, %L, %L, %L);',
                                        job_name, schedule, 'SELECT idempotency.idem_maintain()',
                                        pg_catalog.current_database()) END;
    IF cron_db OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION 'pg_cron is not installed in database "%"', pg_catalog.current_database()
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = pg_catalog.format('Connect to the database where pg_cron is installed (cron.database_name, often postgres) and run: %s', call);
    END IF;
    IF cron_db IS DISTINCT FROM pg_catalog.current_database() THEN
        RAISE EXCEPTION 'pg_cron lives in database "%", not in "%"', cron_db, pg_catalog.current_database()
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = pg_catalog.format('Connect to database %s and run: %s', pg_catalog.quote_ident(cron_db), call);
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_extension e WHERE e.extname OPERATOR(pg_catalog.=) 'pg_cron') THEN
        RAISE EXCEPTION 'extension "pg_cron" is not installed in database "%"', pg_catalog.current_database()
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Run CREATE EXTENSION pg_cron in this database.';
    END IF;
END
$$;
REVOKE ALL ON FUNCTION idempotency.cron_check(text) FROM PUBLIC;
