/* idempotency--1.1--1.2.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.2'" to load this file. \quit

--
-- Version 1.2 (see docs/reference.md and the shared contract).  Each block
-- below is one feature, self-contained.
--

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
-- partitions (0-based) this shard holds under each.
CREATE TABLE idempotency.shard_layout (
    one             boolean PRIMARY KEY DEFAULT true CHECK (one),
    version         bigint NOT NULL CHECK (version > 0),
    active          boolean NOT NULL,   -- false: installed, not yet in force
    map             text[] NOT NULL,
    owned           int[] NOT NULL,
    previous_map    text[],
    previous_owned  int[],
    switched_at     timestamptz,
    consult_until   timestamptz
);

COMMENT ON TABLE idempotency.shard_layout IS
    'the routers'' layout as this shard knows it: which hash partitions it owns (written by idempotency_proxy)';

SELECT pg_catalog.pg_extension_config_dump('idempotency.shard_layout', '');

-- shard_key_hash(scope, key): idempotency_proxy's key_hash, computed here
-- (the shard does not take the router's word for which partition a key
-- is in).
CREATE FUNCTION idempotency.shard_key_hash(scope text, key text)
RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
SELECT ('x' OPERATOR(pg_catalog.||) pg_catalog.encode(pg_catalog.substr(pg_catalog.sha256(
            pg_catalog.convert_to(COALESCE($1, ''), 'UTF8')
            OPERATOR(pg_catalog.||) '\x00'::pg_catalog.bytea
            OPERATOR(pg_catalog.||) pg_catalog.convert_to(COALESCE($2, ''), 'UTF8')), 1, 4), 'hex')
       )::pg_catalog.bit(32)::pg_catalog.int4
$$;

-- shard_check(layout, hash, fresh): raise 55R01 unless this shard may
-- answer a call for partition hash from a router at layout version layout.
-- fresh: the call makes a new record (a new claim, a token), which needs
-- the partition owned under the layout in force; otherwise (an existing
-- record answered: replay, in_progress, mismatch, a takeover, a lookup)
-- owning it under the previous layout is enough.  Caller: the claim is
-- already written in this transaction, and is rolled back by the error.
-- SECURITY DEFINER: the layout holds connection strings, which callers do
-- not read.
CREATE FUNCTION idempotency.shard_check(layout bigint, hash int, fresh boolean)
RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    l       idempotency.shard_layout;
    now_own boolean;
    was_own boolean;
BEGIN
    SELECT s.* INTO l FROM idempotency.shard_layout s;
    IF NOT FOUND THEN
        IF layout IS NULL THEN
            RETURN;
        END IF;
        RAISE EXCEPTION 'this shard has no layout, the router sent layout %', layout
            USING ERRCODE = '55R01',
                  HINT = 'Declare the shards on the router again with idempotency.cluster_create(), which writes the layout to each.';
    END IF;
    IF layout IS DISTINCT FROM l.version THEN
        RAISE EXCEPTION 'the router''s layout % is not this shard''s layout %', coalesce(layout::text, 'none'), l.version
            USING ERRCODE = '55R01',
                  DETAIL = CASE WHEN layout IS NULL OR layout < l.version
                                THEN 'The router has not heard of the newest growth.'
                                ELSE 'This shard has not been told of the router''s growth.' END,
                  HINT = 'The router reloads its layout from the shards and retries.';
    END IF;
    now_own := (hash & (cardinality(l.map) - 1)) = ANY (l.owned);
    was_own := l.previous_map IS NOT NULL
               AND (hash & (cardinality(l.previous_map) - 1)) = ANY (l.previous_owned);
    IF now_own AND (l.active OR was_own) THEN
        RETURN;
    END IF;
    IF (was_own OR now_own) AND NOT fresh THEN
        RETURN;
    END IF;
    RAISE EXCEPTION 'partition % of layout % is not owned by this shard', hash & (cardinality(l.map) - 1), l.version
        USING ERRCODE = '55R01',
              DETAIL = CASE WHEN was_own THEN 'It moved to another shard: only its existing records are answered here.'
                            WHEN now_own THEN 'It moves here once the growth is in force.'
                            ELSE 'Another shard owns it.' END,
              HINT = 'The router reloads its layout from the shards and retries.';
END
$$;

-- shard_acquire(layout, ...): idem_acquire (1.1's columns), refused with
-- 55R01 when this shard does not own the key under the router's layout.
-- Bad input raises what idem_acquire raises, before the check.
CREATE FUNCTION idempotency.shard_acquire(layout bigint, key text,
    request jsonb, scope text, ttl interval, lease interval)
RETURNS TABLE (outcome text, response_status int, response_body jsonb,
               attempt int, expires_at timestamptz, claim uuid,
               retry_after int)
LANGUAGE plpgsql VOLATILE ROWS 1
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    a   record;
BEGIN
    SELECT x.outcome, x.response_status, x.response_body, x.attempt,
           x.expires_at, x.claim, x.retry_after
      INTO a
      FROM idempotency.idem_acquire($2, $3, $4, $5, $6) x;
    PERFORM idempotency.shard_check($1, idempotency.shard_key_hash($4, $2),
                                    a.outcome = 'acquired' AND a.attempt = 1);
    outcome := a.outcome;
    response_status := a.response_status;
    response_body := a.response_body;
    attempt := a.attempt;
    expires_at := a.expires_at;
    claim := a.claim;
    retry_after := a.retry_after;
    RETURN NEXT;
END
$$;

-- shard_lookup(layout, key, scope): idem_lookup (1.1's columns), refused
-- with 55R01 when the router's layout is not this shard's or the key is
-- neither owned here nor was before the growth.  The router's look at a
-- moved key's previous shard: answered only once that shard refuses new
-- claims of the key.
CREATE FUNCTION idempotency.shard_lookup(layout bigint, key text, scope text)
RETURNS TABLE (status text, request_hash bytea, response_status int,
               response_body jsonb, attempt int, created_at timestamptz,
               locked_until timestamptz, completed_at timestamptz,
               expires_at timestamptz, owner_pid int)
LANGUAGE plpgsql VOLATILE ROWS 1
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM idempotency.shard_check($1, idempotency.shard_key_hash($3, $2), false);
    RETURN QUERY
        SELECT l.status, l.request_hash, l.response_status, l.response_body,
               l.attempt, l.created_at, l.locked_until, l.completed_at,
               l.expires_at, l.owner_pid
          FROM idempotency.idem_lookup($2, $3) l;
END
$$;

-- shard_token_issue(layout, hash, scope, ttl): idem_token_issue for the
-- router's partition hash, refused with 55R01 unless this shard owns it.
CREATE FUNCTION idempotency.shard_token_issue(layout bigint, hash int,
    scope text, ttl interval)
RETURNS text
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    t   text := idempotency.idem_token_issue($3, $4);
BEGIN
    PERFORM idempotency.shard_check($1, $2, true);
    RETURN t;
END
$$;

-- shard_owns(scope, key): for an application's own endpoint on the shards
-- (proxy/README.md, the in-transaction mode), called after its
-- idem_acquire answered acquired with attempt 1: raise 55R01 (and so roll
-- the claim back) unless this shard owns the key under its newest layout,
-- in force.  Nothing is checked on a shard without a layout.
CREATE FUNCTION idempotency.shard_owns(scope text, key text)
RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM idempotency.shard_check((SELECT s.version FROM idempotency.shard_layout s),
                                    idempotency.shard_key_hash(scope, key), true);
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
                shard_layout_install.switched_at, shard_layout_install.consult_until);
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

-- The routed wrappers do only what the functions they call do, under the
-- caller's own privileges (EXECUTE on idem_acquire, idem_lookup,
-- idem_token_issue): they may be called by anyone.  The layout is the
-- owner's (the router's superuser connects to read and write it).
REVOKE ALL ON TABLE idempotency.shard_layout FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.shard_layout_get() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.shard_layout_install(bigint, boolean, text[], int[], text[], int[], timestamptz, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.shard_layout_activate(bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.shard_layout_close(bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency.shard_check(bigint, int, boolean) TO PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency.shard_acquire(bigint, text, jsonb, text, interval, interval) TO PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency.shard_lookup(bigint, text, text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency.shard_token_issue(bigint, int, text, interval) TO PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency.shard_owns(text, text) TO PUBLIC;

-- End of shard ownership (issue 28)
