-- bench/plpgsql_idem.sql -- the idempotency contract in PL/pgSQL, for comparison
--
-- What a competent user would write without C: the same table layout as
-- idempotency.records (range partitions on expires_at, one a day, UTC-aligned,
-- made ahead for max_ttl + 2 days, plus DEFAULT; an index on (scope, key),
-- scope and key COLLATE "C"), and the same protocol as the extension: a
-- transaction-level advisory lock per (scope, key) serializes the writers of
-- a key, a look across the live partitions under that lock decides, a new
-- claim is an INSERT.  Tuned as one would tune it by hand:
--   * uncontended, take the lock at once (pg_try_advisory_xact_lock), so a
--     new key costs one lookup; contended, look first without it, since a
--     completed record answers without waiting (the holder cannot change it);
--   * the request hash is sha256() of the canonical jsonb text, in core;
--   * idem_complete is one UPDATE, guarded by status and attempt (row locks
--     and READ COMMITTED's re-check make it safe without the advisory lock);
--     only when it touches nothing does it look why;
--   * no SET clauses on the functions (they cost a GUC save/restore per call):
--     every name is schema-qualified instead.
--
-- What it leaves out, none of which the benchmark exercises: the wait for an
-- open claiming transaction has no idempotency.wait_timeout of its own (it
-- waits like any lock, bounded by lock_timeout); a duplicate of a committed
-- 'processing' claim (lease mode) answers in_progress at once instead of
-- polling; no serialization_failure check under REPEATABLE READ.
--
-- Loaded with psql into the benchmark database by bench/run.sh; schema plidem.

CREATE SCHEMA plidem;

CREATE TABLE plidem.records (
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

CREATE INDEX records_scope_key_idx ON plidem.records (scope, key);

CREATE TABLE plidem.records_default PARTITION OF plidem.records DEFAULT;

-- Daily partitions, UTC midnight to midnight, from today's to the one that
-- holds now + 7 days (max_ttl) + 2 days, as idempotency's maintenance makes.
DO $$
DECLARE
    day_start timestamptz := date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC';
    horizon   timestamptz := now() + interval '9 days';
BEGIN
    WHILE day_start < horizon LOOP
        EXECUTE format('CREATE TABLE plidem.%I PARTITION OF plidem.records'
                       ' FOR VALUES FROM (%L) TO (%L)',
                       'records_p' || to_char(day_start AT TIME ZONE 'UTC', 'YYYYMMDD'),
                       day_start, day_start + interval '1 day');
        day_start := day_start + interval '1 day';
    END LOOP;
END
$$;

--
-- idem_acquire: outcome acquired / replay / in_progress / mismatch
--
CREATE FUNCTION plidem.idem_acquire(
    key         text,
    request     jsonb    DEFAULT NULL,
    scope       text     DEFAULT '',
    ttl         interval DEFAULT NULL,
    lease       interval DEFAULT NULL)
RETURNS TABLE (outcome text, response_status int, response_body jsonb,
               attempt int, expires_at timestamptz)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_key   text := idem_acquire.key;
    v_scope text := idem_acquire.scope;
    v_ttl   interval := coalesce(idem_acquire.ttl, interval '24 hours');
    v_lease interval;
    v_hash  bytea;
    v_now   timestamptz := clock_timestamp();
    v_lock  bigint;
    rec     record;
BEGIN
    IF v_key IS NULL OR v_scope IS NULL THEN
        RAISE EXCEPTION 'idempotency key and scope must not be null'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF octet_length(v_key) NOT BETWEEN 1 AND 255 OR octet_length(v_scope) > 255 THEN
        RAISE EXCEPTION 'idempotency key must be 1 to 255 bytes, scope at most 255'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF v_ttl <= interval '0' OR v_ttl > interval '7 days' THEN
        RAISE EXCEPTION 'ttl must be greater than zero and at most 7 days'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v_lease := coalesce(idem_acquire.lease, least(interval '60 seconds', v_ttl));
    IF v_lease <= interval '0' OR v_lease > v_ttl THEN
        RAISE EXCEPTION 'lease must be greater than zero and at most the ttl'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF idem_acquire.request IS NOT NULL THEN
        v_hash := pg_catalog.sha256(pg_catalog.convert_to(idem_acquire.request::text, 'UTF8'));
    END IF;

    v_lock := pg_catalog.hashtextextended(v_key, pg_catalog.hashtext(v_scope));

    IF NOT pg_catalog.pg_try_advisory_xact_lock(v_lock) THEN
        -- Contended: a completed (or mismatching) record answers at once.
        SELECT r.status, r.request_hash, r.response_status, r.response_body,
               r.attempt, r.expires_at
          INTO rec
          FROM plidem.records r
         WHERE r.scope = v_scope AND r.key = v_key AND r.expires_at > v_now
         LIMIT 1;
        IF FOUND AND (rec.status = 'completed'
                      OR (rec.request_hash IS NOT NULL AND v_hash IS NOT NULL
                          AND rec.request_hash <> v_hash)) THEN
            IF rec.request_hash IS NOT NULL AND v_hash IS NOT NULL
               AND rec.request_hash <> v_hash THEN
                outcome := 'mismatch';
            ELSE
                outcome := 'replay';
                response_status := rec.response_status;
                response_body := rec.response_body;
            END IF;
            attempt := rec.attempt;
            expires_at := rec.expires_at;
            RETURN NEXT;
            RETURN;
        END IF;
        -- Wait for the holder's transaction to end.
        PERFORM pg_catalog.pg_advisory_xact_lock(v_lock);
        v_now := clock_timestamp();
    END IF;

    -- Under the lock; in READ COMMITTED this statement's snapshot sees what
    -- the holder we may have waited for committed.
    SELECT r.status, r.request_hash, r.response_status, r.response_body,
           r.attempt, r.expires_at, r.locked_until
      INTO rec
      FROM plidem.records r
     WHERE r.scope = v_scope AND r.key = v_key AND r.expires_at > v_now
     LIMIT 1;

    IF NOT FOUND THEN
        INSERT INTO plidem.records AS r
               (scope, key, status, request_hash, attempt, created_at,
                locked_until, expires_at)
        VALUES (v_scope, v_key, 'processing', v_hash, 1, v_now,
                v_now + v_lease, v_now + v_ttl);
        outcome := 'acquired';
        attempt := 1;
        expires_at := v_now + v_ttl;
        RETURN NEXT;
        RETURN;
    END IF;

    attempt := rec.attempt;
    expires_at := rec.expires_at;
    IF rec.request_hash IS NOT NULL AND v_hash IS NOT NULL
       AND rec.request_hash <> v_hash THEN
        outcome := 'mismatch';
    ELSIF rec.status = 'completed' THEN
        outcome := 'replay';
        response_status := rec.response_status;
        response_body := rec.response_body;
    ELSIF rec.locked_until IS NULL OR rec.locked_until <= v_now THEN
        -- the lease ran out: take the claim over
        UPDATE plidem.records r
           SET attempt = rec.attempt + 1,
               locked_until = least(v_now + v_lease, rec.expires_at),
               request_hash = coalesce(r.request_hash, v_hash)
         WHERE r.scope = v_scope AND r.key = v_key
           AND r.expires_at = rec.expires_at;
        outcome := 'acquired';
        attempt := rec.attempt + 1;
    ELSE
        outcome := 'in_progress';
    END IF;
    RETURN NEXT;
END
$$;

--
-- idem_complete: true when it completed the processing record, false when it
-- was completed already; P0002 without a live record, 55000 on a stale attempt.
--
CREATE FUNCTION plidem.idem_complete(
    key             text,
    response_status int,
    response_body   jsonb DEFAULT NULL,
    scope           text  DEFAULT '',
    attempt         int   DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_key     text := idem_complete.key;
    v_scope   text := idem_complete.scope;
    v_status  int := idem_complete.response_status;
    v_attempt int := idem_complete.attempt;
    v_now     timestamptz := clock_timestamp();
    rec       record;
BEGIN
    IF v_key IS NULL OR v_scope IS NULL OR v_status IS NULL THEN
        RAISE EXCEPTION 'key, scope and response_status must not be null'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF octet_length(v_key) NOT BETWEEN 1 AND 255 OR octet_length(v_scope) > 255
       OR v_status NOT BETWEEN 100 AND 599 THEN
        RAISE EXCEPTION 'bad key, scope or response_status'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF pg_catalog.pg_column_size(idem_complete.response_body) > 1048576 THEN
        RAISE EXCEPTION 'response_body is too large'
            USING ERRCODE = 'program_limit_exceeded';
    END IF;

    UPDATE plidem.records r
       SET status = 'completed',
           response_status = v_status,
           response_body = idem_complete.response_body,
           completed_at = v_now
     WHERE r.scope = v_scope AND r.key = v_key AND r.expires_at > v_now
       AND r.status = 'processing'
       AND (v_attempt IS NULL OR r.attempt = v_attempt);
    IF FOUND THEN
        RETURN true;
    END IF;

    -- Nothing updated: say why.
    SELECT r.status, r.attempt INTO rec
      FROM plidem.records r
     WHERE r.scope = v_scope AND r.key = v_key AND r.expires_at > v_now
     LIMIT 1;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no live idempotency record for key "%" in scope "%"', v_key, v_scope
            USING ERRCODE = 'no_data_found';
    END IF;
    IF v_attempt IS NOT NULL AND rec.attempt <> v_attempt THEN
        RAISE EXCEPTION 'attempt % of idempotency key "%" is no longer current', v_attempt, v_key
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    RETURN false;
END
$$;
