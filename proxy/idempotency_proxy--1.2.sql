/* proxy/idempotency_proxy--1.2.sql */

-- complain if script is sourced in psql, rather than via CREATE EXTENSION
\echo Use "CREATE EXTENSION idempotency_proxy" to load this file. \quit

--
-- idempotency_proxy 1.2, for a fresh install: the 1.1 script followed by
-- the 1.1--1.2 update, statement for statement, so that a router created
-- at 1.2 and one updated from 1.1 are the same (their head comments say
-- what each part does).
--

--
-- idempotency_proxy: the router side of the idempotency extension, keys
-- sharded over several PostgreSQL servers with PL/Proxy.
--
-- The router database holds this extension instead of idempotency; every
-- shard holds idempotency (1.1, preloaded for the statistics).  The
-- functions have the names, parameters and results of the 1.1 contract
-- (shared/spec/API.md); each is a small PL/pgSQL wrapper that fills in the
-- router's defaults and calls an internal PL/Proxy function (px_*), which
-- runs the shard's own function on the partition chosen by
-- idempotency.key_hash(scope, key).  idem_request_hash runs here.
--
-- Transactions: every routed call is a transaction of its own on its
-- shard, committed when the call returns, whatever the router's
-- transaction does afterwards.  So the router offers the across-
-- transactions mode (lease, claim); session-bound claims raise 0A000.
--
-- Errors: what a shard raises comes back with its SQLSTATE; a shard that
-- cannot be reached (PL/Proxy's XX000) is reported as 08006.
--
-- Placement: idempotency.cluster_state (one row) holds the partitions'
-- connection strings as the helpers wrote them into the SQL/MED server
-- idempotency_cluster, and, while a growth is under way, the previous
-- ones (server idempotency_cluster_previous) and until when they are
-- consulted.  Every call reads that row first, and the growth helper
-- locks it ACCESS EXCLUSIVE: no call runs on the old placement once the
-- new one is committed.
--

-- The router must not hold the idempotency extension: both own the schema
-- idempotency and the idem_* names.
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_extension e
                WHERE e.extname OPERATOR(pg_catalog.=) 'idempotency') THEN
        RAISE EXCEPTION 'extension "idempotency_proxy" cannot be created in a database that has extension "idempotency"'
            USING ERRCODE = 'duplicate_object',
                  DETAIL = 'Both define the schema idempotency and its idem_* functions.',
                  HINT = 'Create idempotency_proxy in a database of its own (the router); the shards hold idempotency.';
    END IF;
END
$$;

--
-- Placement
--
CREATE TABLE idempotency.cluster_state (
    one             boolean PRIMARY KEY DEFAULT true CHECK (one),
    connstrs        text[],         -- partition i is connstrs[i + 1]
    previous        text[],         -- the placement before the last growth
    switched_at     timestamptz,    -- when the last growth was committed
    consult_until   timestamptz     -- until when lookups consult previous
);
INSERT INTO idempotency.cluster_state DEFAULT VALUES;

COMMENT ON TABLE idempotency.cluster_state IS
    'the placement written by cluster_create()/cluster_grow(); read by every routed call';

SELECT pg_catalog.pg_extension_config_dump('idempotency.cluster_state', '');

--
-- key_hash(scope, key): the routing hash of a key, the first 32 bits of
-- SHA-256 over scope, a zero byte and key (text never holds a zero byte, so
-- no two pairs meet).  Stable across PostgreSQL majors and machines, unlike
-- hashtext(); PL/Proxy takes partition (hash & (partitions - 1)).  A NULL
-- is hashed as '' so that the shard raises the contract's 22004.
--
CREATE FUNCTION idempotency.key_hash(scope text, key text)
RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
SELECT ('x' OPERATOR(pg_catalog.||) pg_catalog.encode(pg_catalog.substr(pg_catalog.sha256(
            pg_catalog.convert_to(COALESCE($1, ''), 'UTF8')
            OPERATOR(pg_catalog.||) '\x00'::pg_catalog.bytea
            OPERATOR(pg_catalog.||) pg_catalog.convert_to(COALESCE($2, ''), 'UTF8')), 1, 4), 'hex')
       )::pg_catalog.bit(32)::pg_catalog.int4
$$;

-- The SQL/MED server (PL/Proxy cluster) of the placement now in use, or of
-- the previous one.
CREATE FUNCTION idempotency.cluster_name(previous boolean)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
SELECT CASE WHEN $1 THEN 'idempotency_cluster_previous' ELSE 'idempotency_cluster' END
$$;

-- The routing state of one call: raises where no shards are configured.
-- VOLATILE, so that its SELECT takes its snapshot after its lock: a call
-- that waited for cluster_grow() then sees the new placement, never the
-- old one with PL/Proxy's new partitions.
CREATE FUNCTION idempotency.placement()
RETURNS idempotency.cluster_state
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    st  idempotency.cluster_state;
BEGIN
    SELECT s.* INTO st FROM idempotency.cluster_state s;
    IF st.connstrs IS NULL THEN
        RAISE EXCEPTION 'no shards are configured for idempotency_proxy'
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Declare them with SELECT idempotency.cluster_create(ARRAY[''host=... dbname=...'', ...]).';
    END IF;
    RETURN st;
END
$$;

-- moved(st, hash): true while the previous placement is consulted and puts
-- the hash on another server than the current one.
CREATE FUNCTION idempotency.moved(st idempotency.cluster_state, hash int)
RETURNS boolean
LANGUAGE sql STABLE
AS $$
SELECT $1.previous IS NOT NULL
   AND $1.consult_until OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()
   AND $1.previous[($2 OPERATOR(pg_catalog.&) (pg_catalog.cardinality($1.previous) OPERATOR(pg_catalog.-) 1)) OPERATOR(pg_catalog.+) 1]
       IS DISTINCT FROM
       $1.connstrs[($2 OPERATOR(pg_catalog.&) (pg_catalog.cardinality($1.connstrs) OPERATOR(pg_catalog.-) 1)) OPERATOR(pg_catalog.+) 1]
$$;

-- The router's own defaults, passed explicitly (PL/Proxy does not carry
-- session settings to the shards).  A bare number is seconds, as on the
-- shards.
CREATE FUNCTION idempotency.router_default(name text, fallback interval)
RETURNS interval
LANGUAGE sql STABLE
AS $$
SELECT COALESCE(NULLIF(pg_catalog.current_setting('idempotency.' OPERATOR(pg_catalog.||) $1, true), '')::interval, $2)
$$;

--
-- The PL/Proxy functions: one shard call each.  `previous` picks the
-- cluster, `hash` the partition; neither is sent to the shard.
--
CREATE FUNCTION idempotency.px_acquire(previous boolean, hash int,
    key text, request jsonb, scope text, ttl interval, lease interval,
    session_bound boolean)
RETURNS TABLE (outcome text, response_status int, response_body jsonb,
               attempt int, expires_at timestamptz, claim uuid,
               retry_after int)
LANGUAGE plproxy
AS $$
    CLUSTER idempotency.cluster_name(previous);
    RUN ON hash;
    SELECT * FROM idempotency.idem_acquire(key, request, scope, ttl, lease, session_bound);
$$;

CREATE FUNCTION idempotency.px_complete(previous boolean, hash int,
    key text, response_status int, response_body jsonb, scope text,
    attempt int, claim uuid)
RETURNS boolean
LANGUAGE plproxy
AS $$
    CLUSTER idempotency.cluster_name(previous);
    RUN ON hash;
    SELECT idempotency.idem_complete(key, response_status, response_body, scope, attempt, claim) AS px_complete;
$$;

CREATE FUNCTION idempotency.px_release(previous boolean, hash int,
    key text, scope text, attempt int, claim uuid)
RETURNS boolean
LANGUAGE plproxy
AS $$
    CLUSTER idempotency.cluster_name(previous);
    RUN ON hash;
    SELECT idempotency.idem_release(key, scope, attempt, claim) AS px_release;
$$;

CREATE FUNCTION idempotency.px_extend(previous boolean, hash int,
    key text, scope text, claim uuid, lease interval)
RETURNS timestamptz
LANGUAGE plproxy
AS $$
    CLUSTER idempotency.cluster_name(previous);
    RUN ON hash;
    SELECT idempotency.idem_extend(key, scope, claim, lease) AS px_extend;
$$;

CREATE FUNCTION idempotency.px_lookup(previous boolean, hash int,
    key text, scope text)
RETURNS TABLE (status text, request_hash bytea, response_status int,
               response_body jsonb, attempt int, created_at timestamptz,
               locked_until timestamptz, completed_at timestamptz,
               expires_at timestamptz, owner_pid int)
LANGUAGE plproxy
AS $$
    CLUSTER idempotency.cluster_name(previous);
    RUN ON hash;
    SELECT * FROM idempotency.idem_lookup(key, scope);
$$;

CREATE FUNCTION idempotency.px_token_issue(hash int, scope text, ttl interval)
RETURNS text
LANGUAGE plproxy
AS $$
    CLUSTER 'idempotency_cluster';
    RUN ON hash;
    SELECT idempotency.idem_token_issue(scope, ttl) AS px_token_issue;
$$;

CREATE FUNCTION idempotency.px_token_consume(previous boolean, hash int,
    token text, scope text)
RETURNS boolean
LANGUAGE plproxy
AS $$
    CLUSTER idempotency.cluster_name(previous);
    RUN ON hash;
    SELECT idempotency.idem_token_consume(token, scope) AS px_token_consume;
$$;

-- RUN ON ALL runs once per server, however many partitions name it.
CREATE FUNCTION idempotency.px_maintain()
RETURNS TABLE (partitions_created int, partitions_dropped int)
LANGUAGE plproxy
AS $$
    CLUSTER 'idempotency_cluster';
    RUN ON ALL;
    SELECT * FROM idempotency.idem_maintain();
$$;

CREATE FUNCTION idempotency.px_stats(
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
LANGUAGE plproxy
AS $$
    CLUSTER 'idempotency_cluster';
    RUN ON ALL;
    SELECT * FROM idempotency.idem_stats() s
     WHERE s.datname OPERATOR(pg_catalog.=) pg_catalog.current_database();
$$;

CREATE FUNCTION idempotency.px_acquire_histogram(
    OUT datname name,
    OUT le      double precision,
    OUT count   bigint)
RETURNS SETOF record
LANGUAGE plproxy
AS $$
    CLUSTER 'idempotency_cluster';
    RUN ON ALL;
    SELECT * FROM idempotency.idem_acquire_histogram() h
     WHERE h.datname OPERATOR(pg_catalog.=) pg_catalog.current_database();
$$;

CREATE FUNCTION idempotency.px_stats_reset()
RETURNS SETOF timestamptz
LANGUAGE plproxy
AS $$
    CLUSTER 'idempotency_cluster';
    RUN ON ALL;
    SELECT idempotency.idem_stats_reset() AS px_stats_reset;
$$;

CREATE FUNCTION idempotency.px_stats_enabled()
RETURNS SETOF boolean
LANGUAGE plproxy
AS $$
    CLUSTER 'idempotency_cluster';
    RUN ON ALL;
    SELECT idempotency.idem_stats_enabled() AS px_stats_enabled;
$$;

CREATE FUNCTION idempotency.px_stale_claims()
RETURNS TABLE (scope text, key text, attempt int, created_at timestamptz,
               locked_until timestamptz, expires_at timestamptz,
               owner_pid int, reason text)
LANGUAGE plproxy
AS $$
    CLUSTER 'idempotency_cluster';
    RUN ON ALL;
    SELECT * FROM idempotency.stale_claims;
$$;

-- The largest max_ttl of the shards: how long a growth consults the
-- previous placement unless told otherwise.
CREATE FUNCTION idempotency.px_max_ttl()
RETURNS SETOF interval
LANGUAGE plproxy
AS $$
    CLUSTER 'idempotency_cluster';
    RUN ON ALL;
    SELECT pg_catalog.current_setting('idempotency.max_ttl')::interval AS px_max_ttl;
$$;

-- Live records on the previous placement that the current one puts
-- elsewhere: keys whose hash moved, and tokens issued before the switch
-- (a token's routing value is in the token, not on the shard).
CREATE FUNCTION idempotency.px_growth_pending(old_map text[], new_map text[],
    switched timestamptz, OUT pending bigint, OUT until timestamptz)
RETURNS SETOF record
LANGUAGE plproxy
AS $$
    CLUSTER 'idempotency_cluster_previous';
    RUN ON ALL;
    SELECT pg_catalog.count(*) AS pending, pg_catalog.max(r.expires_at) AS until
      FROM (SELECT x.expires_at, x.is_token, x.created_at,
                   ('x' OPERATOR(pg_catalog.||) pg_catalog.encode(pg_catalog.substr(pg_catalog.sha256(
                        pg_catalog.convert_to(x.scope, 'UTF8')
                        OPERATOR(pg_catalog.||) pg_catalog.decode('00', 'hex')
                        OPERATOR(pg_catalog.||) pg_catalog.convert_to(x.key, 'UTF8')), 1, 4), 'hex')
                   )::pg_catalog.bit(32)::pg_catalog.int4 AS h
              FROM idempotency.records x
             WHERE x.expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()) r
     WHERE CASE WHEN r.is_token THEN r.created_at OPERATOR(pg_catalog.<) switched
                ELSE (old_map)[(r.h OPERATOR(pg_catalog.&) (pg_catalog.cardinality(old_map) OPERATOR(pg_catalog.-) 1)) OPERATOR(pg_catalog.+) 1]
                     IS DISTINCT FROM
                     (new_map)[(r.h OPERATOR(pg_catalog.&) (pg_catalog.cardinality(new_map) OPERATOR(pg_catalog.-) 1)) OPERATOR(pg_catalog.+) 1]
           END;
$$;

--
-- The contract's functions (1.1), routed.
--

CREATE FUNCTION idempotency.idem_acquire(
    key             text,
    request         jsonb    DEFAULT NULL,
    scope           text     DEFAULT '',
    ttl             interval DEFAULT NULL,
    lease           interval DEFAULT NULL,
    session_bound   boolean  DEFAULT false)
RETURNS TABLE (outcome text, response_status int, response_body jsonb,
               attempt int, expires_at timestamptz, claim uuid,
               retry_after int)
LANGUAGE plpgsql VOLATILE ROWS 1
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    st      idempotency.cluster_state;
    h       int;
    r       record;
BEGIN
    IF session_bound THEN
        RAISE EXCEPTION 'session-bound claims are not available through the idempotency router'
            USING ERRCODE = 'feature_not_supported',
                  DETAIL = 'The owner of a session-bound claim would be the router''s connection to the shard, which outlives the client.',
                  HINT = 'Use a lease (lease =>, and idem_extend as a heartbeat), or call the shard directly.';
    END IF;
    ttl := COALESCE(ttl, idempotency.router_default('default_ttl', '24h'));
    lease := COALESCE(lease, LEAST(idempotency.router_default('default_lease', '60s'), ttl));
    h := idempotency.key_hash(scope, key);
    st := idempotency.placement();

    -- Growing: a key whose live record is on its previous server is
    -- answered there; a claim made there afresh meanwhile (its record
    -- expired or was released after the look) is given back at once, and
    -- the key is claimed on its current server.
    IF idempotency.moved(st, h)
       AND EXISTS (SELECT FROM idempotency.px_lookup(true, h, key, scope)) THEN
        SELECT * INTO r FROM idempotency.px_acquire(true, h, key, request, scope, ttl, lease, session_bound);
        IF r.outcome IS DISTINCT FROM 'acquired' OR r.attempt > 1 THEN
            RETURN QUERY SELECT r.outcome, r.response_status, r.response_body,
                                r.attempt, r.expires_at, r.claim, r.retry_after;
            RETURN;
        END IF;
        PERFORM idempotency.px_release(true, h, key, scope, NULL, r.claim);
    END IF;

    RETURN QUERY SELECT * FROM idempotency.px_acquire(false, h, key, request, scope, ttl, lease, session_bound);
EXCEPTION WHEN internal_error THEN
    -- PL/Proxy reports a shard it cannot reach as XX000: say what it is
    IF SQLERRM ~ '(PQconnectPoll|PQconnectStart|PQconsumeInput|PQflush|PQsendQuery|connect timeout|query timeout)' THEN
        RAISE EXCEPTION 'idempotency shard unavailable'
            USING ERRCODE = 'connection_failure',
                  DETAIL = SQLERRM,
                  HINT = 'Keys of the other shards keep working; retry this one when its shard is back.';
    END IF;
    RAISE;
END
$$;

-- where(st, hash, key, scope): the cluster (previous or not) that holds the
-- live record of a key; the current one when neither does.
CREATE FUNCTION idempotency.record_is_previous(st idempotency.cluster_state,
    hash int, key text, scope text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN idempotency.moved(st, hash)
       AND NOT EXISTS (SELECT FROM idempotency.px_lookup(false, hash, key, scope))
       AND EXISTS (SELECT FROM idempotency.px_lookup(true, hash, key, scope));
END
$$;

CREATE FUNCTION idempotency.idem_complete(
    key             text,
    response_status int,
    response_body   jsonb DEFAULT NULL,
    scope           text  DEFAULT '',
    attempt         int   DEFAULT NULL,
    claim           uuid  DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    h   int := idempotency.key_hash(scope, key);
BEGIN
    RETURN idempotency.px_complete(idempotency.record_is_previous(idempotency.placement(), h, key, scope),
                                   h, key, response_status, response_body, scope, attempt, claim);
EXCEPTION WHEN internal_error THEN
    -- PL/Proxy reports a shard it cannot reach as XX000: say what it is
    IF SQLERRM ~ '(PQconnectPoll|PQconnectStart|PQconsumeInput|PQflush|PQsendQuery|connect timeout|query timeout)' THEN
        RAISE EXCEPTION 'idempotency shard unavailable'
            USING ERRCODE = 'connection_failure',
                  DETAIL = SQLERRM,
                  HINT = 'Keys of the other shards keep working; retry this one when its shard is back.';
    END IF;
    RAISE;
END
$$;

CREATE FUNCTION idempotency.idem_release(
    key         text,
    scope       text DEFAULT '',
    attempt     int  DEFAULT NULL,
    claim       uuid DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    h   int := idempotency.key_hash(scope, key);
BEGIN
    RETURN idempotency.px_release(idempotency.record_is_previous(idempotency.placement(), h, key, scope),
                                  h, key, scope, attempt, claim);
EXCEPTION WHEN internal_error THEN
    -- PL/Proxy reports a shard it cannot reach as XX000: say what it is
    IF SQLERRM ~ '(PQconnectPoll|PQconnectStart|PQconsumeInput|PQflush|PQsendQuery|connect timeout|query timeout)' THEN
        RAISE EXCEPTION 'idempotency shard unavailable'
            USING ERRCODE = 'connection_failure',
                  DETAIL = SQLERRM,
                  HINT = 'Keys of the other shards keep working; retry this one when its shard is back.';
    END IF;
    RAISE;
END
$$;

CREATE FUNCTION idempotency.idem_extend(
    key         text,
    scope       text     DEFAULT '',
    claim       uuid     DEFAULT NULL,
    lease       interval DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    h   int := idempotency.key_hash(scope, key);
BEGIN
    lease := COALESCE(lease, idempotency.router_default('default_lease', '60s'));
    RETURN idempotency.px_extend(idempotency.record_is_previous(idempotency.placement(), h, key, scope),
                                 h, key, scope, claim, lease);
EXCEPTION WHEN internal_error THEN
    -- PL/Proxy reports a shard it cannot reach as XX000: say what it is
    IF SQLERRM ~ '(PQconnectPoll|PQconnectStart|PQconsumeInput|PQflush|PQsendQuery|connect timeout|query timeout)' THEN
        RAISE EXCEPTION 'idempotency shard unavailable'
            USING ERRCODE = 'connection_failure',
                  DETAIL = SQLERRM,
                  HINT = 'Keys of the other shards keep working; retry this one when its shard is back.';
    END IF;
    RAISE;
END
$$;

CREATE FUNCTION idempotency.idem_lookup(
    key         text,
    scope       text DEFAULT '')
RETURNS TABLE (status text, request_hash bytea, response_status int,
               response_body jsonb, attempt int, created_at timestamptz,
               locked_until timestamptz, completed_at timestamptz,
               expires_at timestamptz, owner_pid int)
LANGUAGE plpgsql VOLATILE ROWS 1
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    st  idempotency.cluster_state := idempotency.placement();
    h   int := idempotency.key_hash(scope, key);
BEGIN
    RETURN QUERY SELECT * FROM idempotency.px_lookup(false, h, key, scope);
    IF NOT FOUND AND idempotency.moved(st, h) THEN
        RETURN QUERY SELECT * FROM idempotency.px_lookup(true, h, key, scope);
    END IF;
EXCEPTION WHEN internal_error THEN
    -- PL/Proxy reports a shard it cannot reach as XX000: say what it is
    IF SQLERRM ~ '(PQconnectPoll|PQconnectStart|PQconsumeInput|PQflush|PQsendQuery|connect timeout|query timeout)' THEN
        RAISE EXCEPTION 'idempotency shard unavailable'
            USING ERRCODE = 'connection_failure',
                  DETAIL = SQLERRM,
                  HINT = 'Keys of the other shards keep working; retry this one when its shard is back.';
    END IF;
    RAISE;
END
$$;

-- key_cluster(scope, key, margin): the cluster on which to run an
-- application's own routed endpoint for this key (CLUSTER
-- idempotency.key_cluster(...); RUN ON idempotency.key_hash(...)).  The
-- previous placement while it holds the key's live record, else the
-- current one.  A record with less than margin left to live counts as
-- gone: the endpoint then runs on the key's new server, while one sent to
-- the previous server just before still finds the record there (so margin
-- must exceed the endpoint's run time); the record's last margin of life
-- is lost, instead of two concurrent runs at its expiry.
CREATE FUNCTION idempotency.key_cluster(scope text, key text,
    margin interval DEFAULT '1 minute')
RETURNS text
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    st  idempotency.cluster_state := idempotency.placement();
    h   int := idempotency.key_hash(scope, key);
BEGIN
    IF idempotency.moved(st, h)
       AND EXISTS (SELECT FROM idempotency.px_lookup(true, h, key, scope) l
                    WHERE l.expires_at > clock_timestamp() + margin) THEN
        RETURN 'idempotency_cluster_previous';
    END IF;
    RETURN 'idempotency_cluster';
END
$$;

-- As on the shards: SHA-256 of jsonb's canonical text.
CREATE FUNCTION idempotency.idem_request_hash(request jsonb)
RETURNS bytea
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$
SELECT pg_catalog.sha256(pg_catalog.convert_to($1::pg_catalog.text, 'UTF8'))
$$;

--
-- One-time tokens.  The shard makes the token (32 characters); the router
-- picks the partition first, from a random 32-bit routing value, and
-- appends that value to the token in 6 URL-safe base64 characters.  A
-- consume reads the value back and runs on the partition it names, under
-- the current placement and, while growing, the previous one.
--
CREATE FUNCTION idempotency.token_tag(hash int)
RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$
SELECT pg_catalog.translate(pg_catalog.rtrim(pg_catalog.encode(pg_catalog.int4send($1), 'base64'), '='), '+/', '-_')
$$;

CREATE FUNCTION idempotency.token_hash(token text)
RETURNS int
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$
SELECT CASE WHEN $1 OPERATOR(pg_catalog.~) '^[A-Za-z0-9_-]{37}[AQgw]$'
            THEN ('x' OPERATOR(pg_catalog.||) pg_catalog.encode(pg_catalog.decode(
                     pg_catalog.translate(pg_catalog.substr($1, 33), '-_', '+/') OPERATOR(pg_catalog.||) '==',
                     'base64'), 'hex'))::pg_catalog.bit(32)::pg_catalog.int4
       END
$$;

CREATE FUNCTION idempotency.idem_token_issue(
    scope   text     DEFAULT '',
    ttl     interval DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    h   int := floor(random() * 4294967296 - 2147483648)::int;
BEGIN
    PERFORM idempotency.placement();
    ttl := COALESCE(ttl, idempotency.router_default('default_ttl', '24h'));
    RETURN idempotency.px_token_issue(h, scope, ttl) || idempotency.token_tag(h);
EXCEPTION WHEN internal_error THEN
    -- PL/Proxy reports a shard it cannot reach as XX000: say what it is
    IF SQLERRM ~ '(PQconnectPoll|PQconnectStart|PQconsumeInput|PQflush|PQsendQuery|connect timeout|query timeout)' THEN
        RAISE EXCEPTION 'idempotency shard unavailable'
            USING ERRCODE = 'connection_failure',
                  DETAIL = SQLERRM,
                  HINT = 'Keys of the other shards keep working; retry this one when its shard is back.';
    END IF;
    RAISE;
END
$$;

CREATE FUNCTION idempotency.idem_token_consume(
    token   text,
    scope   text DEFAULT '')
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    st      idempotency.cluster_state := idempotency.placement();
    h       int := idempotency.token_hash(token);
    shard_token   text := substr(token, 1, 32);
    ok      boolean;
BEGIN
    IF h IS NULL THEN
        -- not a router token: the shard answers (22004, 22023 or false)
        h := idempotency.key_hash(scope, token);
        shard_token := token;
    END IF;
    ok := idempotency.px_token_consume(false, h, shard_token, scope);
    IF NOT ok AND idempotency.moved(st, h) THEN
        ok := idempotency.px_token_consume(true, h, shard_token, scope);
    END IF;
    RETURN ok;
EXCEPTION WHEN internal_error THEN
    -- PL/Proxy reports a shard it cannot reach as XX000: say what it is
    IF SQLERRM ~ '(PQconnectPoll|PQconnectStart|PQconsumeInput|PQflush|PQsendQuery|connect timeout|query timeout)' THEN
        RAISE EXCEPTION 'idempotency shard unavailable'
            USING ERRCODE = 'connection_failure',
                  DETAIL = SQLERRM,
                  HINT = 'Keys of the other shards keep working; retry this one when its shard is back.';
    END IF;
    RAISE;
END
$$;

--
-- Maintenance and statistics across the cluster (every server of the
-- current placement): sums.
--
CREATE FUNCTION idempotency.idem_maintain()
RETURNS TABLE (partitions_created int, partitions_dropped int)
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT COALESCE(sum(m.partitions_created), 0)::int, COALESCE(sum(m.partitions_dropped), 0)::int
  FROM idempotency.px_maintain() m
$$;

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
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT current_database(),
       sum(s.acquired)::bigint, sum(s.taken_over)::bigint, sum(s.replayed)::bigint,
       sum(s.mismatched)::bigint, sum(s.in_progress)::bigint, sum(s.completed)::bigint,
       sum(s.released)::bigint, sum(s.waits)::bigint, sum(s.wait_time),
       sum(s.tokens_issued)::bigint, sum(s.tokens_consumed)::bigint,
       sum(s.acquire_duration_sum), sum(s.acquire_duration_count)::bigint,
       max(s.stats_reset)
  FROM idempotency.px_stats() s
HAVING count(*) > 0
$$;

CREATE FUNCTION idempotency.idem_acquire_histogram(
    OUT datname name,
    OUT le      double precision,
    OUT count   bigint)
RETURNS SETOF record
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT current_database(), h.le, sum(h.count)::bigint
  FROM idempotency.px_acquire_histogram() h
 GROUP BY h.le
 ORDER BY h.le
$$;

CREATE FUNCTION idempotency.idem_stats_reset()
RETURNS timestamptz
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT max(r) FROM idempotency.px_stats_reset() r
$$;

CREATE FUNCTION idempotency.idem_stats_enabled()
RETURNS boolean
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT bool_and(e) FROM idempotency.px_stats_enabled() e
$$;

-- As on the shards, summed over them (wait_time in milliseconds).
CREATE VIEW idempotency.stats AS
SELECT s.datname, s.acquired, s.taken_over, s.replayed, s.mismatched,
       s.in_progress, s.completed, s.released, s.waits, s.wait_time,
       s.tokens_issued, s.tokens_consumed, s.stats_reset
  FROM idempotency.idem_stats() s;

COMMENT ON VIEW idempotency.stats IS
    'what idem_* calls answered on every shard of the cluster, summed';

CREATE VIEW idempotency.acquire_duration AS
SELECT h.datname, h.le, h.count
  FROM idempotency.idem_acquire_histogram() h;

COMMENT ON VIEW idempotency.acquire_duration IS
    'cumulative histogram of idem_acquire duration on the shards, summed';

CREATE VIEW idempotency.stale_claims AS
SELECT c.scope, c.key, c.attempt, c.created_at, c.locked_until,
       c.expires_at, c.owner_pid, c.reason
  FROM idempotency.px_stale_claims() c;

COMMENT ON VIEW idempotency.stale_claims IS
    'stale processing claims of every shard';

--
-- Declaring the cluster (SQL/MED: a SERVER of the plproxy foreign data
-- wrapper whose options p0, p1, ... are the partitions' connection
-- strings, and a user mapping for PUBLIC).
--
-- partition_map(servers, partitions): partition i -> servers[i mod n].
-- PL/Proxy wants a power of two partitions: n servers take n partitions
-- where n is one, else (3 servers, 5, ...) the power of two at or above
-- 16 n, so that no server gets more than 1/16 of its share too much
-- (3 servers: 64 partitions, 22/21/21).
--
CREATE FUNCTION idempotency.partition_map(servers text[], partitions int DEFAULT NULL)
RETURNS text[]
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n   int := cardinality(servers);
    p   int := partitions;
BEGIN
    IF n IS NULL OR n = 0 OR array_position(servers, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'servers must be a non-empty array of connection strings'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p IS NULL THEN
        p := 1;
        WHILE p < n LOOP
            p := p * 2;
        END LOOP;
        IF p <> n THEN
            WHILE p < 16 * n LOOP
                p := p * 2;
            END LOOP;
        END IF;
    END IF;
    IF p < n OR p > 4096 OR p & (p - 1) <> 0 THEN
        RAISE EXCEPTION 'partitions must be a power of two between the number of servers (%) and 4096', n
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN ARRAY(SELECT servers[g.i % n + 1] FROM generate_series(0, p - 1) g(i));
END
$$;

-- set_server(server, connstrs): create the server, or set its partitions.
CREATE FUNCTION idempotency.set_server(server name, connstrs text[])
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    opts    text[];
    cmds    text[] := '{}';
    i       int;
    o       text;
BEGIN
    SELECT s.srvoptions INTO opts FROM pg_foreign_server s
     WHERE s.srvname = server;
    IF NOT FOUND THEN
        EXECUTE format('CREATE SERVER %I FOREIGN DATA WRAPPER plproxy OPTIONS (%s)', server,
                       (SELECT string_agg(format('p%s %L', g.n - 1, connstrs[g.n]), ', ' ORDER BY g.n)
                          FROM generate_subscripts(connstrs, 1) g(n)));
        EXECUTE format('CREATE USER MAPPING FOR PUBLIC SERVER %I', server);
        RETURN;
    END IF;
    FOREACH o IN ARRAY COALESCE(opts, '{}') LOOP
        IF o ~ '^p[0-9]+=' AND split_part(substr(o, 2), '=', 1)::int >= cardinality(connstrs) THEN
            cmds := cmds || format('DROP %s', split_part(o, '=', 1));
        END IF;
    END LOOP;
    FOR i IN 1 .. cardinality(connstrs) LOOP
        cmds := cmds || format('%s p%s %L',
            CASE WHEN EXISTS (SELECT FROM unnest(opts) x WHERE x LIKE format('p%s=%%', i - 1))
                 THEN 'SET' ELSE 'ADD' END, i - 1, connstrs[i]);
    END LOOP;
    EXECUTE format('ALTER SERVER %I OPTIONS (%s)', server, array_to_string(cmds, ', '));
END
$$;

-- cluster_create(servers, partitions): declare the shards (or redeclare
-- them while no growth is under way, with the same placement of keys: to
-- change a server's address).  Returns the partitions.
CREATE FUNCTION idempotency.cluster_create(servers text[], partitions int DEFAULT NULL)
RETURNS TABLE (partition int, connstr text)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    map     text[] := idempotency.partition_map(servers, partitions);
    st      idempotency.cluster_state;
BEGIN
    LOCK TABLE idempotency.cluster_state IN ACCESS EXCLUSIVE MODE;
    SELECT s.* INTO st FROM idempotency.cluster_state s;
    IF st.connstrs IS NOT NULL AND cardinality(st.connstrs) <> cardinality(map) THEN
        RAISE EXCEPTION 'the cluster has % partitions, not %', cardinality(st.connstrs), cardinality(map)
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Change the number of servers with idempotency.cluster_grow(), which keeps every live key.';
    END IF;
    PERFORM idempotency.set_server('idempotency_cluster', map);
    UPDATE idempotency.cluster_state SET connstrs = map;
    RETURN QUERY SELECT (g.n - 1)::int, map[g.n] FROM generate_subscripts(map, 1) g(n);
END
$$;

-- cluster_grow(servers, partitions, consult_previous): switch to a new
-- placement in one transaction.  Until now() + consult_previous (default:
-- the shards' largest idempotency.max_ttl, the longest a record can live)
-- the keys that moved are looked for on their previous server first;
-- cluster_growth_finish() ends that window early once no live record
-- needs it.  Returns the partitions and where each was before.
CREATE FUNCTION idempotency.cluster_grow(servers text[], partitions int DEFAULT NULL,
    consult_previous interval DEFAULT NULL)
RETURNS TABLE (partition int, connstr text, previous_connstr text)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    map     text[] := idempotency.partition_map(servers, partitions);
    st      idempotency.cluster_state;
    um      record;
BEGIN
    -- waits for every routed call in flight, and holds new ones until
    -- this transaction ends
    LOCK TABLE idempotency.cluster_state IN ACCESS EXCLUSIVE MODE;
    SELECT s.* INTO st FROM idempotency.cluster_state s;
    IF st.connstrs IS NULL THEN
        RAISE EXCEPTION 'no shards are configured for idempotency_proxy'
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Use idempotency.cluster_create() first.';
    END IF;
    IF st.previous IS NOT NULL AND st.consult_until > clock_timestamp() THEN
        RAISE EXCEPTION 'a growth is under way until %', st.consult_until
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Wait, or end it with idempotency.cluster_growth_finish() once no record needs the previous placement.';
    END IF;
    IF cardinality(map) < cardinality(st.connstrs) THEN
        RAISE EXCEPTION 'a cluster of % partitions cannot shrink to %', cardinality(st.connstrs), cardinality(map)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF consult_previous IS NULL THEN
        SELECT max(t) INTO consult_previous FROM idempotency.px_max_ttl() t;
    END IF;

    PERFORM idempotency.set_server('idempotency_cluster_previous', st.connstrs);
    FOR um IN
        SELECT m.umuser, m.umoptions
          FROM pg_user_mapping m JOIN pg_foreign_server s ON s.oid = m.umserver
         WHERE s.srvname = 'idempotency_cluster' AND m.umuser <> 0
    LOOP
        EXECUTE format('DROP USER MAPPING IF EXISTS FOR %I SERVER idempotency_cluster_previous',
                       um.umuser::regrole);
        EXECUTE format('CREATE USER MAPPING FOR %I SERVER idempotency_cluster_previous%s',
                       um.umuser::regrole,
                       CASE WHEN um.umoptions IS NULL THEN ''
                            ELSE format(' OPTIONS (%s)',
                                        (SELECT string_agg(format('%I %L', split_part(x, '=', 1),
                                                                  substr(x, strpos(x, '=') + 1)), ', ')
                                           FROM unnest(um.umoptions) x)) END);
    END LOOP;
    EXECUTE format('GRANT USAGE ON FOREIGN SERVER idempotency_cluster_previous TO %s',
                   COALESCE((SELECT string_agg(CASE WHEN a.grantee = 0 THEN 'PUBLIC'
                                                    ELSE quote_ident(a.grantee::regrole::text) END, ', ')
                               FROM pg_foreign_server s, aclexplode(s.srvacl) a
                              WHERE s.srvname = 'idempotency_cluster'
                                AND a.grantee <> s.srvowner), 'CURRENT_USER'));
    PERFORM idempotency.set_server('idempotency_cluster', map);
    UPDATE idempotency.cluster_state
       SET previous = connstrs, connstrs = map, switched_at = clock_timestamp(),
           consult_until = clock_timestamp() + consult_previous;
    RETURN QUERY SELECT (g.n - 1)::int, map[g.n],
                        st.connstrs[((g.n - 1) & (cardinality(st.connstrs) - 1)) + 1]
                   FROM generate_subscripts(map, 1) g(n);
END
$$;

-- cluster_growth_pending(): live records on the previous placement that
-- the current one puts elsewhere (0 when no growth is under way), and when
-- the last of them expires.
CREATE FUNCTION idempotency.cluster_growth_pending(OUT pending bigint, OUT until timestamptz)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    st  idempotency.cluster_state;
BEGIN
    SELECT s.* INTO st FROM idempotency.cluster_state s;
    pending := 0;
    IF st.previous IS NULL OR st.consult_until <= clock_timestamp() THEN
        RETURN;
    END IF;
    SELECT COALESCE(sum(g.pending), 0)::bigint, max(g.until) INTO pending, until
      FROM idempotency.px_growth_pending(st.previous, st.connstrs, st.switched_at) g;
END
$$;

-- cluster_growth_finish(force): stop consulting the previous placement;
-- refused while it still holds live records that moved, unless forced.
CREATE FUNCTION idempotency.cluster_growth_finish(force boolean DEFAULT false)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    p   record;
BEGIN
    LOCK TABLE idempotency.cluster_state IN ACCESS EXCLUSIVE MODE;
    IF NOT EXISTS (SELECT FROM idempotency.cluster_state s WHERE s.previous IS NOT NULL) THEN
        RETURN false;
    END IF;
    SELECT * INTO p FROM idempotency.cluster_growth_pending();
    IF p.pending > 0 AND NOT force THEN
        RAISE EXCEPTION 'the previous placement still holds % live records of keys that moved', p.pending
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  DETAIL = format('The last of them expires at %s.', p.until),
                  HINT = 'Wait until then; force => true loses their replays.';
    END IF;
    UPDATE idempotency.cluster_state
       SET previous = NULL, switched_at = NULL, consult_until = NULL;
    RETURN true;
END
$$;

-- Nothing is granted to PUBLIC, as in idempotency.
DO $$
DECLARE
    f   regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
              WHERE p.pronamespace OPERATOR(pg_catalog.=) 'idempotency'::pg_catalog.regnamespace
    LOOP
        EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$$;

--
-- The other way round: refuse CREATE EXTENSION idempotency in this
-- database with a clear message (its script would otherwise stop on a
-- name that exists already).
--
CREATE FUNCTION idempotency.refuse_idempotency()
RETURNS event_trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF current_query() ~* 'create\s+extension\s+(if\s+not\s+exists\s+)?"?idempotency"?(\s|;|$)' THEN
        RAISE EXCEPTION 'extension "idempotency" cannot be created in a database that has extension "idempotency_proxy"'
            USING ERRCODE = 'duplicate_object',
                  DETAIL = 'Both define the schema idempotency and its idem_* functions.',
                  HINT = 'The router database holds idempotency_proxy; create idempotency in the shard databases.';
    END IF;
END
$$;

CREATE EVENT TRIGGER idempotency_proxy_refuse_idempotency
    ON ddl_command_start WHEN TAG IN ('CREATE EXTENSION')
    EXECUTE FUNCTION idempotency.refuse_idempotency();

--
-- The 1.1--1.2 update
--

--
-- idempotency_proxy 1.2: more than one router (issue 28).
--
-- The shards (idempotency 1.2) now check ownership: each knows the layout
-- (version, partitions, which it owns) and refuses a claim of a key it
-- does not own, or from a router whose layout is not its own, with
-- SQLSTATE 55R01.  A routed call that gets 55R01 reloads the router's
-- layout from the shard (cluster_reload()) and runs once more (and, while
-- a growth is being switched, a few times more, for up to 0.6 s).  A growth
-- writes the new layout to every shard in two steps (installed, then in
-- force) and never locks the router's placement against calls: calls in
-- flight on the old layout are refused by the shards and retried.  The
-- argument why no router, however stale, makes a key run on two shards is
-- in proxy/README.md, "Why a key never runs on two shards".
--
-- Also: a router token carries 4 more characters, a check of the other
-- 38, so a token with a changed tail answers false; a shard connection
-- ended by the shard (57P01, 57P02, 57P03, class 08) is reported as 08006,
-- as one that cannot be reached.
--
-- The shards must be at idempotency 1.2 before the router is updated;
-- afterwards, run cluster_create() once with the same servers to write
-- the layout (version 1) to them.  Until then calls carry no layout and
-- the shards check nothing, as in 1.1.
--

ALTER TABLE idempotency.cluster_state ADD COLUMN layout_version bigint;

COMMENT ON COLUMN idempotency.cluster_state.layout_version IS
    'the layout version the shards know this placement by (NULL: not yet written to them)';

--
-- PL/Proxy functions of 1.2: the shards' checked calls, and the layout.
--
CREATE FUNCTION idempotency.px_owned_acquire(previous boolean, hash int,
    layout bigint, key text, request jsonb, scope text, ttl interval,
    lease interval, trace text)
RETURNS TABLE (outcome text, response_status int, response_body jsonb,
               attempt int, expires_at timestamptz, claim uuid,
               retry_after int, phase text, state jsonb,
               response_headers jsonb, origin_trace text)
LANGUAGE plproxy
AS $$
    CLUSTER idempotency.cluster_name(previous);
    RUN ON hash;
    SELECT * FROM idempotency.shard_acquire(layout, key, request, scope, ttl, lease, trace);
$$;

CREATE FUNCTION idempotency.px_owned_lookup(previous boolean, hash int,
    layout bigint, key text, scope text)
RETURNS TABLE (status text, request_hash bytea, response_status int,
               response_body jsonb, attempt int, created_at timestamptz,
               locked_until timestamptz, completed_at timestamptz,
               expires_at timestamptz, owner_pid int)
LANGUAGE plproxy
AS $$
    CLUSTER idempotency.cluster_name(previous);
    RUN ON hash;
    SELECT * FROM idempotency.shard_lookup(layout, key, scope);
$$;

CREATE FUNCTION idempotency.px_owned_token_issue(hash int, layout bigint,
    scope text, ttl interval)
RETURNS text
LANGUAGE plproxy
AS $$
    CLUSTER 'idempotency_cluster';
    RUN ON hash;
    SELECT idempotency.shard_token_issue(layout, hash, scope, ttl) AS px_owned_token_issue;
$$;

-- The layout of the shard of partition hash (current placement).
CREATE FUNCTION idempotency.px_layout_get(hash int,
    OUT version bigint, OUT active boolean, OUT map text[],
    OUT previous_map text[], OUT switched_at timestamptz,
    OUT consult_until timestamptz)
RETURNS SETOF record
LANGUAGE plproxy
AS $$
    CLUSTER 'idempotency_cluster';
    RUN ON hash;
    SELECT * FROM idempotency.shard_layout_get();
$$;

-- The same, and writing it, on one server by its connection string
-- (PL/Proxy's CONNECT: a growth reaches servers no cluster names yet).
CREATE FUNCTION idempotency.px_layout_get_at(connstr text,
    OUT version bigint, OUT active boolean, OUT map text[],
    OUT previous_map text[], OUT switched_at timestamptz,
    OUT consult_until timestamptz)
RETURNS SETOF record
LANGUAGE plproxy
AS $$
    CONNECT connstr;
    SELECT * FROM idempotency.shard_layout_get();
$$;

CREATE FUNCTION idempotency.px_layout_install_at(connstr text, version bigint,
    active boolean, map text[], owned int[], previous_map text[],
    previous_owned int[], switched_at timestamptz, consult_until timestamptz)
RETURNS bigint
LANGUAGE plproxy
AS $$
    CONNECT connstr;
    SELECT idempotency.shard_layout_install(version, active, map, owned, previous_map,
        previous_owned, switched_at, consult_until) AS px_layout_install_at;
$$;

CREATE FUNCTION idempotency.px_layout_activate_at(connstr text, version bigint)
RETURNS boolean
LANGUAGE plproxy
AS $$
    CONNECT connstr;
    SELECT idempotency.shard_layout_activate(version) AS px_layout_activate_at;
$$;

CREATE FUNCTION idempotency.px_layout_close_at(connstr text, version bigint)
RETURNS boolean
LANGUAGE plproxy
AS $$
    CONNECT connstr;
    SELECT idempotency.shard_layout_close(version) AS px_layout_close_at;
$$;

-- The same two steps of a growth on all its servers at once: PL/Proxy
-- sends a call to all the partitions it runs on before it waits for any,
-- so the servers take the new layout in parallel, and the keys that move
-- are refused for the time of one step, not of one step per server.  The
-- cluster idempotency_cluster_grow (made by cluster_grow for the purpose,
-- in its own transaction) has one partition per server of the growth
-- (padded to a power of two with the first server again); partition
-- part[i] gets owned[i] and previous_owned[i] (int[] as text).
CREATE FUNCTION idempotency.px_layout_install_all(part int[], owned text[],
    previous_owned text[], version bigint, active boolean, map text[],
    previous_map text[], switched_at timestamptz, consult_until timestamptz)
RETURNS SETOF bigint
LANGUAGE plproxy
AS $$
    CLUSTER 'idempotency_cluster_grow';
    SPLIT part, owned, previous_owned;
    RUN ON part;
    SELECT idempotency.shard_layout_install(version, active, map, (owned)[1]::int[], previous_map,
        (previous_owned)[1]::int[], switched_at, consult_until) AS px_layout_install_all;
$$;

CREATE FUNCTION idempotency.px_layout_activate_all(version bigint)
RETURNS SETOF boolean
LANGUAGE plproxy
AS $$
    CLUSTER 'idempotency_cluster_grow';
    RUN ON ALL;
    SELECT idempotency.shard_layout_activate(version) AS px_layout_activate_all;
$$;

-- owned_partitions(map, server): the partitions (0-based) map puts on
-- server (servers are told apart by their connection strings, spelled as
-- in the map).
CREATE FUNCTION idempotency.owned_partitions(map text[], server text)
RETURNS int[]
LANGUAGE sql IMMUTABLE
AS $$
SELECT COALESCE(pg_catalog.array_agg((g.n OPERATOR(pg_catalog.-) 1)::int ORDER BY g.n), '{}')
  FROM pg_catalog.generate_subscripts($1, 1) g(n)
 WHERE ($1)[g.n] OPERATOR(pg_catalog.=) $2
$$;

-- copy_access(): give idempotency_cluster_previous the user mappings and
-- USAGE grants of idempotency_cluster (a growth keeps who may call).
CREATE FUNCTION idempotency.copy_access()
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    um  record;
BEGIN
    FOR um IN
        SELECT m.umuser, m.umoptions
          FROM pg_user_mapping m JOIN pg_foreign_server s ON s.oid = m.umserver
         WHERE s.srvname = 'idempotency_cluster' AND m.umuser <> 0
    LOOP
        EXECUTE format('DROP USER MAPPING IF EXISTS FOR %I SERVER idempotency_cluster_previous',
                       um.umuser::regrole);
        EXECUTE format('CREATE USER MAPPING FOR %I SERVER idempotency_cluster_previous%s',
                       um.umuser::regrole,
                       CASE WHEN um.umoptions IS NULL THEN ''
                            ELSE format(' OPTIONS (%s)',
                                        (SELECT string_agg(format('%I %L', split_part(x, '=', 1),
                                                                  substr(x, strpos(x, '=') + 1)), ', ')
                                           FROM unnest(um.umoptions) x)) END);
    END LOOP;
    EXECUTE format('GRANT USAGE ON FOREIGN SERVER idempotency_cluster_previous TO %s',
                   COALESCE((SELECT string_agg(CASE WHEN a.grantee = 0 THEN 'PUBLIC'
                                                    ELSE quote_ident(a.grantee::regrole::text) END, ', ')
                               FROM pg_foreign_server s, aclexplode(s.srvacl) a
                              WHERE s.srvname = 'idempotency_cluster'
                                AND a.grantee <> s.srvowner), 'CURRENT_USER'));
END
$$;

-- cluster_apply(version, map, previous, switched_at, consult_until): make
-- this router's placement that layout, unless it has that version or a
-- newer one already; the same version is taken when its growth window is
-- closed there and still open here (cluster_growth_finish() on another
-- router: a shard is closed only once no record needs the window, so a
-- router in it would only see refusals of its looks).  True when it
-- changed.  Takes the placement's row
-- lock where it changes it, without waiting: concurrent reloads apply a
-- layout once, those that come after it take no lock, and one that finds
-- the row locked by another session's reload does nothing (the routed
-- call tries again, up to 0.6 s).  Caller: the owner of the
-- SQL/MED servers (cluster_reload, cluster_create, cluster_grow).
CREATE FUNCTION idempotency.cluster_apply(version bigint, map text[],
    previous text[], switched_at timestamptz, consult_until timestamptz)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cur     bigint;
    open    boolean;
BEGIN
    -- most reloads find it done already: no lock then
    SELECT s.layout_version, s.previous IS NOT NULL INTO cur, open
      FROM idempotency.cluster_state s;
    IF cur > cluster_apply.version
       OR (cur = cluster_apply.version AND NOT (open AND cluster_apply.previous IS NULL)) THEN
        RETURN false;
    END IF;
    -- another session applying one (its transaction may be a long call):
    -- do not wait for it, the caller tries again
    SELECT s.layout_version, s.previous IS NOT NULL INTO cur, open
      FROM idempotency.cluster_state s
       FOR UPDATE SKIP LOCKED;
    IF NOT FOUND OR cur > cluster_apply.version
       OR (cur = cluster_apply.version AND NOT (open AND cluster_apply.previous IS NULL)) THEN
        RETURN false;
    END IF;
    PERFORM idempotency.set_server('idempotency_cluster', map);
    IF previous IS NOT NULL THEN
        PERFORM idempotency.set_server('idempotency_cluster_previous', previous);
        PERFORM idempotency.copy_access();
    END IF;
    UPDATE idempotency.cluster_state s
       SET connstrs = map, previous = cluster_apply.previous,
           switched_at = cluster_apply.switched_at,
           consult_until = cluster_apply.consult_until,
           layout_version = cluster_apply.version;
    RETURN true;
END
$$;

-- cluster_reload(hash): read the layout from the shard of partition hash
-- (the shard that refused a call) and make it this router's, if it is
-- newer (or its window closed, cluster_apply) and in force there (a layout only installed would not let the
-- call through, and applying it would hold this router's placement
-- locked for the rest of a call that is bound to wait).  True when the placement changed.  SECURITY DEFINER: any
-- caller of a routed function may make the router adopt what its shards
-- say, and nothing else (the layout is never taken from the caller).
CREATE FUNCTION idempotency.cluster_reload(hash int DEFAULT 0)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    l   record;
BEGIN
    SELECT g.* INTO l FROM idempotency.px_layout_get(hash) g;
    IF l.version IS NULL OR NOT l.active THEN
        RETURN false;
    END IF;
    RETURN idempotency.cluster_apply(l.version, l.map, l.previous_map,
                                     l.switched_at, l.consult_until);
END
$$;

-- reloaded(hash): for a routed call that found no record (P0002, false)
-- where this router looked: true when this router has a layout and
-- cluster_reload(hash) changed it (a growth it was not told of), so that
-- the call is run once more.  A router without a layout (its shards have
-- none) reads nothing.
CREATE FUNCTION idempotency.reloaded(hash int)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN (SELECT s.layout_version FROM idempotency.cluster_state s) IS NOT NULL
       AND idempotency.cluster_reload(hash);
END
$$;

-- shard_failure(): true when the error just caught (its SQLSTATE and
-- message) means the shard could not be reached or ended the connection:
-- PL/Proxy's XX000 for a connection it could not make or lost, or the
-- shard's own 57P01/57P02/57P03 or class 08 on a cached connection.
CREATE FUNCTION idempotency.shard_failure(state text, message text)
RETURNS boolean
LANGUAGE sql IMMUTABLE
AS $$
SELECT ($1 OPERATOR(pg_catalog.=) 'XX000'
        AND $2 OPERATOR(pg_catalog.~) '(PQconnectPoll|PQconnectStart|PQconsumeInput|PQflush|PQsendQuery|connect timeout|query timeout|server closed the connection|terminating connection)')
    OR $1 OPERATOR(pg_catalog.=) ANY ('{57P01,57P02,57P03}'::text[])
    OR pg_catalog.left($1, 2) OPERATOR(pg_catalog.=) '08'
$$;

--
-- The routed functions of 1.2: claims go through the shards' checks.
--

-- idem_acquire, idem_complete and idem_lookup change their parameters or
-- results (issue 29, the main extension's 1.2): the 1.1 functions are
-- renamed, not dropped, until their grants are copied to the new ones
-- (at the end of this script).
ALTER FUNCTION idempotency.idem_acquire(text, jsonb, text, interval, interval, boolean)
    RENAME TO idem_acquire_1_1;
ALTER FUNCTION idempotency.idem_complete(text, int, jsonb, text, int, uuid)
    RENAME TO idem_complete_1_1;
ALTER FUNCTION idempotency.idem_lookup(text, text)
    RENAME TO idem_lookup_1_1;

-- route_acquire(...): one routing of idem_acquire under the placement now
-- in force; a shard's refusal (a row with outcome 'refused' from
-- shard_acquire or status 'refused' from shard_lookup, or 55R01) comes out (idem_acquire reloads, retries).  A moved key (growth window)
-- whose live record is on its previous server is answered there; when
-- that record vanished between the look and the claim, the previous
-- server refuses the new claim and the key is claimed on its current
-- server.  The result has idem_acquire's 1.2 columns.
CREATE FUNCTION idempotency.route_acquire(h int, key text, request jsonb,
    scope text, ttl interval, lease interval, trace text)
RETURNS TABLE (outcome text, response_status int, response_body jsonb,
               attempt int, expires_at timestamptz, claim uuid,
               retry_after int, phase text, state jsonb,
               response_headers jsonb, origin_trace text)
LANGUAGE plpgsql VOLATILE ROWS 1
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    st      idempotency.cluster_state := idempotency.placement();
    r       record;
    l       record;
    there   boolean := false;
BEGIN
    IF idempotency.moved(st, h) THEN
        -- the look at the previous server; refused (a row): come out
        SELECT x.status, x.response_body INTO l
          FROM idempotency.px_owned_lookup(true, h, st.layout_version, key, scope) x;
        IF l.status = 'refused' THEN
            RETURN QUERY SELECT 'refused'::text, NULL::int, l.response_body, NULL::int,
                                NULL::timestamptz, NULL::uuid, NULL::int, NULL::text,
                                NULL::jsonb, NULL::jsonb, NULL::text;
            RETURN;
        END IF;
        there := l.status IS NOT NULL;
    END IF;
    IF there THEN
        BEGIN
            SELECT * INTO r FROM idempotency.px_owned_acquire(true, h, st.layout_version,
                                                               key, request, scope, ttl, lease, trace);
            IF r.outcome <> 'refused' THEN
                RETURN QUERY SELECT r.outcome, r.response_status, r.response_body,
                                    r.attempt, r.expires_at, r.claim, r.retry_after,
                                    r.phase, r.state, r.response_headers, r.origin_trace;
                RETURN;
            END IF;
        EXCEPTION WHEN SQLSTATE '55R01' THEN
            NULL;   -- no longer there: claimed on the current server below
        END;
    END IF;
    RETURN QUERY SELECT * FROM idempotency.px_owned_acquire(false, h, st.layout_version,
                                                             key, request, scope, ttl, lease, trace);
END
$$;

-- idem_acquire(..., trace): as in the main extension's 1.2 (trace stored
-- with the claim; phase, state, response_headers and origin_trace at the
-- end), routed by route_acquire.  Needs every shard at idempotency 1.2.
CREATE FUNCTION idempotency.idem_acquire(
    key             text,
    request         jsonb    DEFAULT NULL,
    scope           text     DEFAULT '',
    ttl             interval DEFAULT NULL,
    lease           interval DEFAULT NULL,
    session_bound   boolean  DEFAULT false,
    trace           text     DEFAULT NULL)
RETURNS TABLE (outcome text, response_status int, response_body jsonb,
               attempt int, expires_at timestamptz, claim uuid,
               retry_after int, phase text, state jsonb,
               response_headers jsonb, origin_trace text)
LANGUAGE plpgsql VOLATILE ROWS 1
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    h       int := idempotency.key_hash(scope, key);
    r       record;
    st      text;
    msg     text;
    why     jsonb;
BEGIN
    IF session_bound THEN
        RAISE EXCEPTION 'session-bound claims are not available through the idempotency router'
            USING ERRCODE = 'feature_not_supported',
                  DETAIL = 'The owner of a session-bound claim would be the router''s connection to the shard, which outlives the client.',
                  HINT = 'Use a lease (lease =>, and idem_extend as a heartbeat), or call the shard directly.';
    END IF;
    ttl := COALESCE(ttl, idempotency.router_default('default_ttl', '24h'));
    lease := COALESCE(lease, LEAST(idempotency.router_default('default_lease', '60s'), ttl));
    FOR i IN 1 .. 8 LOOP
        -- a shard's refusal is a row (outcome 'refused', its reason in
        -- response_body), so that PL/Proxy keeps the connection; a 55R01
        -- raised by a shard is taken the same way
        BEGIN
            SELECT * INTO r FROM idempotency.route_acquire(h, key, request, scope, ttl, lease, trace);
            IF r.outcome <> 'refused' THEN
                RETURN QUERY SELECT r.outcome, r.response_status, r.response_body,
                                    r.attempt, r.expires_at, r.claim, r.retry_after,
                                    r.phase, r.state, r.response_headers, r.origin_trace;
                RETURN;
            END IF;
            why := r.response_body;
        EXCEPTION WHEN OTHERS THEN
            GET STACKED DIAGNOSTICS st = RETURNED_SQLSTATE, msg = MESSAGE_TEXT;
            IF idempotency.shard_failure(st, msg) THEN
                RAISE EXCEPTION 'idempotency shard unavailable'
                    USING ERRCODE = 'connection_failure',
                          DETAIL = msg,
                          HINT = 'Keys of the other shards keep working; retry this one when its shard is back.';
            END IF;
            IF st <> '55R01' OR i = 8 THEN
                RAISE;
            END IF;
            why := NULL;
        END;
        IF i = 8 THEN
            RAISE EXCEPTION '%', why->>'message'
                USING ERRCODE = '55R01', DETAIL = why->>'detail',
                      HINT = 'A growth of the cluster is being switched: retry the call.';
        END IF;
        -- reload and run again at once; refused again, a growth is being
        -- switched (its layout installed on some shards, not yet in force
        -- on all): wait for it, 10 to 320 ms a time, 0.6 s in all
        IF i > 1 THEN
            PERFORM pg_sleep(0.005 * (2 ^ (i - 1)));
        END IF;
        PERFORM idempotency.cluster_reload(h);
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION idempotency.idem_token_issue(
    scope   text     DEFAULT '',
    ttl     interval DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    h       int := floor(random() * 4294967296 - 2147483648)::int;
    t       text;
    st      text;
    msg     text;
BEGIN
    ttl := COALESCE(ttl, idempotency.router_default('default_ttl', '24h'));
    FOR i IN 1 .. 8 LOOP
        BEGIN
            -- NULL: refused (a row, not an error: the connection is kept)
            t := idempotency.px_owned_token_issue(h, (idempotency.placement()).layout_version, scope, ttl)
                 || idempotency.token_tag(h);
            IF t IS NOT NULL THEN
                RETURN t || idempotency.token_check(t);
            END IF;
        EXCEPTION WHEN OTHERS THEN
            GET STACKED DIAGNOSTICS st = RETURNED_SQLSTATE, msg = MESSAGE_TEXT;
            IF idempotency.shard_failure(st, msg) THEN
                RAISE EXCEPTION 'idempotency shard unavailable'
                    USING ERRCODE = 'connection_failure',
                          DETAIL = msg,
                          HINT = 'Keys of the other shards keep working; retry this one when its shard is back.';
            END IF;
            IF st <> '55R01' OR i = 8 THEN
                RAISE;
            END IF;
        END;
        IF i = 8 THEN
            RAISE EXCEPTION 'partition % is not owned by its shard under this router''s layout', h
                USING ERRCODE = '55R01',
                      HINT = 'A growth of the cluster is being switched: retry the call.';
        END IF;
        -- reload and run again at once; refused again, a growth is being
        -- switched (its layout installed on some shards, not yet in force
        -- on all): wait for it, 10 to 320 ms a time, 0.6 s in all
        IF i > 1 THEN
            PERFORM pg_sleep(0.005 * (2 ^ (i - 1)));
        END IF;
        PERFORM idempotency.cluster_reload(h);
    END LOOP;
END
$$;

-- token_check(t): the 4 characters that end a 1.2 router token: the first
-- 24 bits of SHA-256 over its other 38 (the shard's 32 and the routing
-- value's 6), URL-safe base64.
CREATE FUNCTION idempotency.token_check(t text)
RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$
SELECT pg_catalog.translate(pg_catalog.encode(pg_catalog.substr(pg_catalog.sha256(
           pg_catalog.convert_to($1, 'UTF8')), 1, 3), 'base64'), '+/', '-_')
$$;

-- router_setting(name, fallback): the router's own setting
-- idempotency.<name> (a plain custom setting: no library on the router).
CREATE FUNCTION idempotency.router_setting(name text, fallback text)
RETURNS text
LANGUAGE sql STABLE
AS $$
SELECT COALESCE(NULLIF(pg_catalog.current_setting('idempotency.' OPERATOR(pg_catalog.||) $1, true), ''), $2)
$$;

-- token_hash(token): the routing value of a router token, NULL for any
-- other string.  A 1.2 token (42 characters) counts only with its check
-- right; a 1.1 token (38, issued before the update) as in 1.1.
CREATE OR REPLACE FUNCTION idempotency.token_hash(token text)
RETURNS int
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$
SELECT CASE WHEN ($1 OPERATOR(pg_catalog.~) '^[A-Za-z0-9_-]{37}[AQgw]$')
              OR ($1 OPERATOR(pg_catalog.~) '^[A-Za-z0-9_-]{37}[AQgw][A-Za-z0-9_-]{4}$'
                  AND pg_catalog.substr($1, 39) OPERATOR(pg_catalog.=)
                      idempotency.token_check(pg_catalog.substr($1, 1, 38)))
            THEN ('x' OPERATOR(pg_catalog.||) pg_catalog.encode(pg_catalog.decode(
                     pg_catalog.translate(pg_catalog.substr($1, 33, 6), '-_', '+/') OPERATOR(pg_catalog.||) '==',
                     'base64'), 'hex'))::pg_catalog.bit(32)::pg_catalog.int4
       END
$$;

-- The routed functions that were 1.1's: a shard that ended the connection
-- (57P01 after it was stopped, ...) is reported as 08006 too.
-- idem_complete(..., response_headers): stored for replays (1.2).
CREATE FUNCTION idempotency.idem_complete(
    key              text,
    response_status  int,
    response_body    jsonb DEFAULT NULL,
    scope            text  DEFAULT '',
    attempt          int   DEFAULT NULL,
    claim            uuid  DEFAULT NULL,
    response_headers jsonb DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    h   int := idempotency.key_hash(scope, key);
    p   boolean := idempotency.record_is_previous(idempotency.placement(), h, key, scope);
    st  text;
    msg text;
BEGIN
    -- without headers, 1.1's call (a shard still at 1.1 answers it)
    IF response_headers IS NULL THEN
        RETURN idempotency.px_complete(p, h, key, response_status, response_body, scope, attempt, claim);
    END IF;
    RETURN idempotency.px_complete_1_2(p, h, key, response_status, response_body, scope,
                                       attempt, claim, response_headers);
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS st = RETURNED_SQLSTATE, msg = MESSAGE_TEXT;
    IF idempotency.shard_failure(st, msg) THEN
        RAISE EXCEPTION 'idempotency shard unavailable'
            USING ERRCODE = 'connection_failure',
                  DETAIL = msg,
                  HINT = 'Keys of the other shards keep working; retry this one when its shard is back.';
    END IF;
    -- no record where this router looked: its layout may be behind a
    -- growth it was not told of; reloaded, run once more
    IF st = 'P0002' AND idempotency.reloaded(h) THEN
        RETURN idempotency.idem_complete(key, response_status, response_body, scope,
                                         attempt, claim, response_headers);
    END IF;
    IF st IN ('42883', '42703') THEN
        RAISE EXCEPTION '% needs its shard at idempotency 1.2', 'idem_complete with response_headers'
            USING ERRCODE = 'feature_not_supported',
                  DETAIL = msg,
                  HINT = 'Update the extension idempotency on every shard to 1.2 first.';
    END IF;
    RAISE;
END
$$;

CREATE OR REPLACE FUNCTION idempotency.idem_release(
    key         text,
    scope       text DEFAULT '',
    attempt     int  DEFAULT NULL,
    claim       uuid DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    h   int := idempotency.key_hash(scope, key);
    ok  boolean;
    st  text;
    msg text;
BEGIN
    FOR i IN 1 .. 2 LOOP
        ok := idempotency.px_release(idempotency.record_is_previous(idempotency.placement(), h, key, scope),
                                     h, key, scope, attempt, claim);
        -- false: no claim where this router looked; its layout may be
        -- behind a growth it was not told of; reloaded, run once more
        EXIT WHEN ok OR i = 2 OR NOT idempotency.reloaded(h);
    END LOOP;
    RETURN ok;
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS st = RETURNED_SQLSTATE, msg = MESSAGE_TEXT;
    IF idempotency.shard_failure(st, msg) THEN
        RAISE EXCEPTION 'idempotency shard unavailable'
            USING ERRCODE = 'connection_failure',
                  DETAIL = msg,
                  HINT = 'Keys of the other shards keep working; retry this one when its shard is back.';
    END IF;
    RAISE;
END
$$;

CREATE OR REPLACE FUNCTION idempotency.idem_extend(
    key         text,
    scope       text     DEFAULT '',
    claim       uuid     DEFAULT NULL,
    lease       interval DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    h   int := idempotency.key_hash(scope, key);
    st  text;
    msg text;
BEGIN
    lease := COALESCE(lease, idempotency.router_default('default_lease', '60s'));
    RETURN idempotency.px_extend(idempotency.record_is_previous(idempotency.placement(), h, key, scope),
                                 h, key, scope, claim, lease);
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS st = RETURNED_SQLSTATE, msg = MESSAGE_TEXT;
    IF idempotency.shard_failure(st, msg) THEN
        RAISE EXCEPTION 'idempotency shard unavailable'
            USING ERRCODE = 'connection_failure',
                  DETAIL = msg,
                  HINT = 'Keys of the other shards keep working; retry this one when its shard is back.';
    END IF;
    -- no record where this router looked: its layout may be behind a
    -- growth it was not told of; reloaded, run once more
    IF st = 'P0002' AND idempotency.reloaded(h) THEN
        RETURN idempotency.idem_extend(key, scope, claim, lease);
    END IF;
    RAISE;
END
$$;

-- idem_lookup: 1.2's columns (NULL from a shard still at 1.1).
CREATE FUNCTION idempotency.idem_lookup(
    key         text,
    scope       text DEFAULT '')
RETURNS TABLE (status text, request_hash bytea, response_status int,
               response_body jsonb, attempt int, created_at timestamptz,
               locked_until timestamptz, completed_at timestamptz,
               expires_at timestamptz, owner_pid int, phase text,
               state jsonb, response_headers jsonb, origin_trace text)
LANGUAGE plpgsql VOLATILE ROWS 1
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    st  idempotency.cluster_state := idempotency.placement();
    h   int := idempotency.key_hash(scope, key);
    s   text;
    msg text;
BEGIN
    BEGIN
        RETURN QUERY SELECT * FROM idempotency.px_lookup_1_2(false, h, key, scope);
        IF NOT FOUND AND idempotency.moved(st, h) THEN
            RETURN QUERY SELECT * FROM idempotency.px_lookup_1_2(true, h, key, scope);
        END IF;
    EXCEPTION WHEN undefined_column THEN
        -- a shard still at 1.1 (no 1.2 columns): its 1.1 row, the rest NULL
        RETURN QUERY SELECT l.*, NULL::text, NULL::jsonb, NULL::jsonb, NULL::text
                       FROM idempotency.px_lookup(false, h, key, scope) l;
        IF NOT FOUND AND idempotency.moved(st, h) THEN
            RETURN QUERY SELECT l.*, NULL::text, NULL::jsonb, NULL::jsonb, NULL::text
                           FROM idempotency.px_lookup(true, h, key, scope) l;
        END IF;
    END;
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS s = RETURNED_SQLSTATE, msg = MESSAGE_TEXT;
    IF idempotency.shard_failure(s, msg) THEN
        RAISE EXCEPTION 'idempotency shard unavailable'
            USING ERRCODE = 'connection_failure',
                  DETAIL = msg,
                  HINT = 'Keys of the other shards keep working; retry this one when its shard is back.';
    END IF;
    RAISE;
END
$$;

CREATE OR REPLACE FUNCTION idempotency.idem_token_consume(
    token   text,
    scope   text DEFAULT '')
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    st      idempotency.cluster_state := idempotency.placement();
    h       int := idempotency.token_hash(token);
    shard_token   text := substr(token, 1, 32);
    ok      boolean;
    s       text;
    msg     text;
BEGIN
    -- a 1.1 token (38 characters, no check), once they are no longer taken
    IF length(token) = 38
       AND idempotency.router_setting('legacy_tokens', 'on') = 'off' THEN
        h := NULL;
    END IF;
    IF h IS NULL THEN
        -- not a router token: the shard answers (22004, 22023 or false)
        h := idempotency.key_hash(scope, token);
        shard_token := token;
    END IF;
    FOR i IN 1 .. 2 LOOP
        ok := idempotency.px_token_consume(false, h, shard_token, scope);
        IF NOT ok AND idempotency.moved(st, h) THEN
            ok := idempotency.px_token_consume(true, h, shard_token, scope);
        END IF;
        -- false: as idem_release
        EXIT WHEN ok OR i = 2 OR NOT idempotency.reloaded(h);
        st := idempotency.placement();
    END LOOP;
    RETURN ok;
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS s = RETURNED_SQLSTATE, msg = MESSAGE_TEXT;
    IF idempotency.shard_failure(s, msg) THEN
        RAISE EXCEPTION 'idempotency shard unavailable'
            USING ERRCODE = 'connection_failure',
                  DETAIL = msg,
                  HINT = 'Keys of the other shards keep working; retry this one when its shard is back.';
    END IF;
    RAISE;
END
$$;

-- key_cluster(scope, key, margin): as in 1.1, but the look at the previous
-- server is the shards' checked one (answered only once that server
-- refuses new claims of the key); refused (this router's layout is
-- behind), it reloads the layout and looks once more, then raises 55R01.
CREATE OR REPLACE FUNCTION idempotency.key_cluster(scope text, key text,
    margin interval DEFAULT '1 minute')
RETURNS text
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    h   int := idempotency.key_hash(scope, key);
    st  idempotency.cluster_state;
    r   record;
BEGIN
    FOR i IN 1 .. 2 LOOP
        st := idempotency.placement();
        IF NOT idempotency.moved(st, h) THEN
            RETURN 'idempotency_cluster';
        END IF;
        SELECT l.status, l.response_body, l.expires_at INTO r
          FROM idempotency.px_owned_lookup(true, h, st.layout_version, key, scope) l;
        IF r.status IS DISTINCT FROM 'refused' THEN
            IF r.expires_at > clock_timestamp() + margin THEN
                RETURN 'idempotency_cluster_previous';
            END IF;
            RETURN 'idempotency_cluster';
        END IF;
        -- refused: this router's layout is behind; reload it, look again
        EXIT WHEN i = 2 OR NOT idempotency.cluster_reload(h);
    END LOOP;
    RAISE EXCEPTION '%', r.response_body->>'message'
        USING ERRCODE = '55R01', DETAIL = r.response_body->>'detail',
              HINT = 'A growth of the cluster is being switched: retry the call.';
END
$$;

-- layout_version(): the version of this router's layout, for an
-- endpoint's router function to pass to the shard's shard_owns() (as a
-- parameter's DEFAULT: proxy/README.md, the in-transaction mode).
CREATE FUNCTION idempotency.layout_version()
RETURNS bigint
LANGUAGE sql STABLE
AS $$
SELECT s.layout_version FROM idempotency.cluster_state s
$$;

--
-- Declaring and growing, with the layout written to the shards.
--

-- cluster_layouts(servers): the layout each of these servers knows (a
-- row per server; version NULL where it has none).
CREATE FUNCTION idempotency.cluster_layouts(servers text[])
RETURNS TABLE (connstr text, version bigint, active boolean, map text[],
               previous_map text[], switched_at timestamptz,
               consult_until timestamptz)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    c   text;
    l   record;
BEGIN
    FOR c IN SELECT DISTINCT x FROM unnest(servers) x LOOP
        SELECT g.* INTO l FROM idempotency.px_layout_get_at(c) g;
        RETURN QUERY SELECT c, l.version, l.active, l.map, l.previous_map, l.switched_at, l.consult_until;
    END LOOP;
END
$$;

-- cluster_create(servers, partitions): declare the shards.  Where none of
-- them knows a layout, write layout 1 (partition i on servers[i mod n]) to
-- each; where they do (a router rebuilt from nothing, a second router),
-- take the newest they know, whatever servers and partitions say (they
-- only say where to read it).  Returns the partitions.
CREATE OR REPLACE FUNCTION idempotency.cluster_create(servers text[], partitions int DEFAULT NULL)
RETURNS TABLE (partition int, connstr text)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    map     text[] := idempotency.partition_map(servers, partitions);
    st      idempotency.cluster_state;
    best    record;
    v       bigint;
    c       text;
BEGIN
    -- one declaration or growth at a time on this router
    PERFORM pg_advisory_xact_lock(pg_catalog.hashtext('idempotency_proxy.cluster'));
    SELECT s.* INTO st FROM idempotency.cluster_state s;
    SELECT l.* INTO best FROM idempotency.cluster_layouts(servers) l
     WHERE l.version IS NOT NULL
     ORDER BY l.version DESC LIMIT 1;
    IF best.version IS NOT NULL THEN
        -- set up the servers as they are, even at the same version
        UPDATE idempotency.cluster_state SET layout_version = NULL;
        PERFORM idempotency.cluster_apply(best.version, best.map, best.previous_map,
                                          best.switched_at, best.consult_until);
        map := best.map;
    ELSE
        IF st.connstrs IS NOT NULL AND cardinality(st.connstrs) <> cardinality(map) THEN
            RAISE EXCEPTION 'the cluster has % partitions, not %', cardinality(st.connstrs), cardinality(map)
                USING ERRCODE = 'object_not_in_prerequisite_state',
                      HINT = 'Change the number of servers with idempotency.cluster_grow(), which keeps every live key.';
        END IF;
        v := COALESCE(st.layout_version, 0) + 1;
        FOR c IN SELECT DISTINCT x FROM unnest(map) x LOOP
            PERFORM idempotency.px_layout_install_at(c, v, true, map,
                idempotency.owned_partitions(map, c), NULL, NULL, NULL, NULL);
        END LOOP;
        PERFORM idempotency.cluster_apply(v, map, NULL, NULL, NULL);
    END IF;
    RETURN QUERY SELECT (g.n - 1)::int, map[g.n] FROM generate_subscripts(map, 1) g(n);
END
$$;

-- cluster_switch(version, map, previous, switched_at, consult_until): put
-- a layout in force on every server it names (map and previous): first
-- install it, not in force, on every one of them at once, then put it in
-- force on every one at once; never in force anywhere before every server
-- has it (proxy/README.md, "Why a key never runs on two shards", step 3).
-- Installing again where a server has it already is harmless (the shard
-- rewrites it), so a growth that stopped half way is finished the same way.
CREATE FUNCTION idempotency.cluster_switch(version bigint, map text[],
    previous text[], switched_at timestamptz, consult_until timestamptz)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    all_servers text[] := ARRAY(SELECT DISTINCT x FROM unnest(map || COALESCE(previous, '{}')) x ORDER BY 1);
    n           int := cardinality(all_servers);
    done        boolean;
BEGIN
    PERFORM idempotency.set_server('idempotency_cluster_grow',
        all_servers || array_fill(all_servers[1], ARRAY[(1 << ceil(log(2, n))::int) - n]));
    PERFORM count(*) FROM idempotency.px_layout_install_all(
        ARRAY(SELECT g - 1 FROM generate_series(1, n) g),
        ARRAY(SELECT idempotency.owned_partitions(map, all_servers[g])::text FROM generate_series(1, n) g),
        ARRAY(SELECT CASE WHEN previous IS NOT NULL THEN idempotency.owned_partitions(previous, all_servers[g])::text END
              FROM generate_series(1, n) g),
        version, false, map, previous, switched_at, consult_until);
    SELECT bool_and(a) INTO done FROM idempotency.px_layout_activate_all(version) a;
    DROP USER MAPPING FOR PUBLIC SERVER idempotency_cluster_grow;
    DROP SERVER idempotency_cluster_grow;
    IF NOT done THEN
        RAISE EXCEPTION 'layout % could not be put in force on every server', version
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  DETAIL = 'A server no longer had it when it was put in force: another router may be growing the cluster.',
                  HINT = 'Grow from one router at a time; run idempotency.cluster_grow() again with the same servers.';
    END IF;
END
$$;

-- cluster_grow(servers, partitions, consult_previous): switch to a new
-- placement.  Writes layout version + 1 to every server of the old and
-- the new placement, not in force (the keys that change owner are then
-- refused everywhere: their old owners only answer their records, the
-- new ones nothing), then puts it in force on each (the new owners take
-- claims), then makes it this router's.  No lock of the router's
-- placement: calls go on, and those that meet a shard of the new layout
-- reload and retry.  Each shard's step waits for the claims in flight
-- there (in steps of 20 ms).  Run again with the same servers if it
-- failed half way.  Refused while the window of the growth before is
-- open (cluster_growth_finish() closes it), whenever that growth was: a
-- shard knows only the newest layout and the one before.  Returns the
-- partitions and where each was before.
CREATE OR REPLACE FUNCTION idempotency.cluster_grow(servers text[], partitions int DEFAULT NULL,
    consult_previous interval DEFAULT NULL)
RETURNS TABLE (partition int, connstr text, previous_connstr text)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    map         text[] := idempotency.partition_map(servers, partitions);
    st          idempotency.cluster_state;
    best        record;
    v           bigint;
    switched    timestamptz;
    until       timestamptz;
BEGIN
    PERFORM pg_advisory_xact_lock(pg_catalog.hashtext('idempotency_proxy.cluster'));
    SELECT s.* INTO st FROM idempotency.cluster_state s;
    IF st.connstrs IS NULL THEN
        RAISE EXCEPTION 'no shards are configured for idempotency_proxy'
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Use idempotency.cluster_create() first.';
    END IF;
    -- the newest layout any server has
    SELECT l.* INTO best FROM idempotency.cluster_layouts(st.connstrs || map) l
     WHERE l.version IS NOT NULL
     ORDER BY l.version DESC LIMIT 1;
    -- not in force on every server it names: a growth that stopped half
    -- way (here or on another router); finish it, installing it again
    -- everywhere before it is put in force anywhere
    IF best.version IS NOT NULL AND EXISTS (
           SELECT FROM idempotency.cluster_layouts(best.map || COALESCE(best.previous_map, '{}')) l
            WHERE l.version IS DISTINCT FROM best.version OR NOT l.active) THEN
        PERFORM idempotency.cluster_switch(best.version, best.map, best.previous_map,
                                           best.switched_at, best.consult_until);
        PERFORM FROM idempotency.cluster_state FOR UPDATE;
        PERFORM idempotency.cluster_apply(best.version, best.map, best.previous_map,
                                          best.switched_at, best.consult_until);
        RETURN QUERY SELECT (g.n - 1)::int, best.map[g.n],
                            best.previous_map[((g.n - 1) & (cardinality(best.previous_map) - 1)) + 1]
                       FROM generate_subscripts(best.map, 1) g(n);
        RETURN;
    END IF;
    -- in force everywhere: this router may be behind another, take it
    IF best.version > COALESCE(st.layout_version, 0) THEN
        PERFORM idempotency.cluster_apply(best.version, best.map, best.previous_map,
                                          best.switched_at, best.consult_until);
        SELECT s.* INTO st FROM idempotency.cluster_state s;
    END IF;
    IF st.previous IS NOT NULL THEN
        RAISE EXCEPTION 'the window of the last growth is still open'
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  DETAIL = format('Its records on the previous placement expire by %s.', st.consult_until),
                  HINT = 'Close it with idempotency.cluster_growth_finish() once idempotency.cluster_growth_pending() counts none.';
    END IF;
    IF cardinality(map) < cardinality(st.connstrs) THEN
        RAISE EXCEPTION 'a cluster of % partitions cannot shrink to %', cardinality(st.connstrs), cardinality(map)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF consult_previous IS NULL THEN
        SELECT max(t) INTO consult_previous FROM idempotency.px_max_ttl() t;
    END IF;
    v := GREATEST(COALESCE(best.version, 0), COALESCE(st.layout_version, 0)) + 1;
    switched := clock_timestamp();
    until := switched + consult_previous;
    PERFORM idempotency.cluster_switch(v, map, st.connstrs, switched, until);
    -- a call that reloaded the layout may be applying it (cluster_apply
    -- skips a locked placement): wait for it, so that this router has the
    -- layout when the growth commits, whether that call commits or not
    PERFORM FROM idempotency.cluster_state FOR UPDATE;
    PERFORM idempotency.cluster_apply(v, map, st.connstrs, switched, until);
    RETURN QUERY SELECT (g.n - 1)::int, map[g.n],
                        st.connstrs[((g.n - 1) & (cardinality(st.connstrs) - 1)) + 1]
                   FROM generate_subscripts(map, 1) g(n);
END
$$;

-- px_growth_pending(old_map, new_map, switched): as in 1.1, but a token
-- counts when it was made on its shard before that shard installed the
-- growth (its installed_at, by its own clock), not before the router's
-- switched: until the install a shard still issues tokens of partitions
-- it gives away, and their consume needs the window.  A shard without a
-- layout (still at 1.1 while a 1.1 growth's window was open) counts them
-- as 1.1 did.  A consumed token counts no more: its new shard answers
-- false for it as well.
CREATE OR REPLACE FUNCTION idempotency.px_growth_pending(old_map text[], new_map text[],
    switched timestamptz, OUT pending bigint, OUT until timestamptz)
RETURNS SETOF record
LANGUAGE plproxy
AS $$
    CLUSTER 'idempotency_cluster_previous';
    RUN ON ALL;
    SELECT pg_catalog.count(*) AS pending, pg_catalog.max(r.expires_at) AS until
      FROM (SELECT x.expires_at, x.is_token, x.created_at, x.status,
                   ('x' OPERATOR(pg_catalog.||) pg_catalog.encode(pg_catalog.substr(pg_catalog.sha256(
                        pg_catalog.convert_to(x.scope, 'UTF8')
                        OPERATOR(pg_catalog.||) pg_catalog.decode('00', 'hex')
                        OPERATOR(pg_catalog.||) pg_catalog.convert_to(x.key, 'UTF8')), 1, 4), 'hex')
                   )::pg_catalog.bit(32)::pg_catalog.int4 AS h
              FROM idempotency.records x
             WHERE x.expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()) r
     WHERE CASE WHEN r.is_token
                THEN r.status OPERATOR(pg_catalog.=) 'processing'
                     AND r.created_at OPERATOR(pg_catalog.<)
                     COALESCE((SELECT l.installed_at FROM idempotency.shard_layout l), switched)
                ELSE (old_map)[(r.h OPERATOR(pg_catalog.&) (pg_catalog.cardinality(old_map) OPERATOR(pg_catalog.-) 1)) OPERATOR(pg_catalog.+) 1]
                     IS DISTINCT FROM
                     (new_map)[(r.h OPERATOR(pg_catalog.&) (pg_catalog.cardinality(new_map) OPERATOR(pg_catalog.-) 1)) OPERATOR(pg_catalog.+) 1]
           END;
$$;

-- cluster_growth_pending(): as in 1.1, but counted for as long as the
-- window is open, also after consult_until (a record can outlive it: see
-- moved()).
CREATE OR REPLACE FUNCTION idempotency.cluster_growth_pending(OUT pending bigint, OUT until timestamptz)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    st  idempotency.cluster_state;
BEGIN
    SELECT s.* INTO st FROM idempotency.cluster_state s;
    pending := 0;
    IF st.previous IS NULL THEN
        RETURN;
    END IF;
    SELECT COALESCE(sum(g.pending), 0)::bigint, max(g.until) INTO pending, until
      FROM idempotency.px_growth_pending(st.previous, st.connstrs, st.switched_at) g;
END
$$;

-- cluster_growth_finish(force): as in 1.1, and the shards forget the
-- previous placement too.
CREATE OR REPLACE FUNCTION idempotency.cluster_growth_finish(force boolean DEFAULT false)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    p   record;
    st  idempotency.cluster_state;
    c   text;
BEGIN
    PERFORM pg_advisory_xact_lock(pg_catalog.hashtext('idempotency_proxy.cluster'));
    SELECT s.* INTO st FROM idempotency.cluster_state s FOR UPDATE;
    IF st.previous IS NULL THEN
        RETURN false;
    END IF;
    SELECT * INTO p FROM idempotency.cluster_growth_pending();
    IF p.pending > 0 AND NOT force THEN
        RAISE EXCEPTION 'the previous placement still holds % live records of keys that moved', p.pending
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  DETAIL = format('The last of them expires at %s.', p.until),
                  HINT = 'Wait until then; force => true loses their replays.';
    END IF;
    IF st.layout_version IS NOT NULL THEN
        FOR c IN SELECT DISTINCT x FROM unnest(st.connstrs || st.previous) x LOOP
            PERFORM idempotency.px_layout_close_at(c, st.layout_version);
        END LOOP;
    END IF;
    UPDATE idempotency.cluster_state
       SET previous = NULL, switched_at = NULL, consult_until = NULL;
    RETURN true;
END
$$;

-- Nothing new is granted to PUBLIC.
REVOKE ALL ON FUNCTION idempotency.px_owned_acquire(boolean, int, bigint, text, jsonb, text, interval, interval, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.px_owned_lookup(boolean, int, bigint, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.px_owned_token_issue(int, bigint, text, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.px_layout_get(int) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.px_layout_get_at(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.px_layout_install_at(text, bigint, boolean, text[], int[], text[], int[], timestamptz, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.px_layout_activate_at(text, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.px_layout_close_at(text, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.px_layout_install_all(int[], text[], text[], bigint, boolean, text[], text[], timestamptz, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.px_layout_activate_all(bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.cluster_switch(bigint, text[], text[], timestamptz, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.owned_partitions(text[], text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.copy_access() FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.cluster_apply(bigint, text[], text[], timestamptz, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.cluster_reload(int) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.reloaded(int) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.shard_failure(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.route_acquire(int, text, jsonb, text, interval, interval, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.token_check(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.router_setting(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.cluster_layouts(text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.layout_version() FROM PUBLIC;

--
-- Shards at idempotency 1.2 return more columns from idem_acquire,
-- idem_lookup, idem_stats and stale_claims (new ones at the end).  The
-- routed functions below name the columns they return, so that a router
-- works over shards at 1.1 and at 1.2 alike (PL/Proxy refuses a row with
-- more fields than the function declares).
--
CREATE OR REPLACE FUNCTION idempotency.px_acquire(previous boolean, hash int,
    key text, request jsonb, scope text, ttl interval, lease interval,
    session_bound boolean)
RETURNS TABLE (outcome text, response_status int, response_body jsonb,
               attempt int, expires_at timestamptz, claim uuid,
               retry_after int)
LANGUAGE plproxy
AS $$
    CLUSTER idempotency.cluster_name(previous);
    RUN ON hash;
    SELECT a.outcome, a.response_status, a.response_body, a.attempt,
           a.expires_at, a.claim, a.retry_after
      FROM idempotency.idem_acquire(key, request, scope, ttl, lease, session_bound) a;
$$;

CREATE OR REPLACE FUNCTION idempotency.px_lookup(previous boolean, hash int,
    key text, scope text)
RETURNS TABLE (status text, request_hash bytea, response_status int,
               response_body jsonb, attempt int, created_at timestamptz,
               locked_until timestamptz, completed_at timestamptz,
               expires_at timestamptz, owner_pid int)
LANGUAGE plproxy
AS $$
    CLUSTER idempotency.cluster_name(previous);
    RUN ON hash;
    SELECT l.status, l.request_hash, l.response_status, l.response_body,
           l.attempt, l.created_at, l.locked_until, l.completed_at,
           l.expires_at, l.owner_pid
      FROM idempotency.idem_lookup(key, scope) l;
$$;

CREATE OR REPLACE FUNCTION idempotency.px_stats(
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
LANGUAGE plproxy
AS $$
    CLUSTER 'idempotency_cluster';
    RUN ON ALL;
    SELECT s.datname, s.acquired, s.taken_over, s.replayed, s.mismatched,
           s.in_progress, s.completed, s.released, s.waits, s.wait_time,
           s.tokens_issued, s.tokens_consumed, s.acquire_duration_sum,
           s.acquire_duration_count, s.stats_reset
      FROM idempotency.idem_stats() s
     WHERE s.datname OPERATOR(pg_catalog.=) pg_catalog.current_database();
$$;

CREATE OR REPLACE FUNCTION idempotency.px_stale_claims()
RETURNS TABLE (scope text, key text, attempt int, created_at timestamptz,
               locked_until timestamptz, expires_at timestamptz,
               owner_pid int, reason text)
LANGUAGE plproxy
AS $$
    CLUSTER 'idempotency_cluster';
    RUN ON ALL;
    SELECT c.scope, c.key, c.attempt, c.created_at, c.locked_until,
           c.expires_at, c.owner_pid, c.reason
      FROM idempotency.stale_claims c;
$$;

--
-- The router's cost (issue 28): key_hash and moved run on every call.  As
-- SQL functions they are not inlined (key_hash's body is only STABLE,
-- convert_to; moved's VOLATILE, clock_timestamp), so each call parsed and
-- planned their bodies again (a fifth of the router backend's CPU, in
-- perf).  As PL/pgSQL their expressions are planned once a session, with
-- the same volatility.
--
CREATE OR REPLACE FUNCTION idempotency.key_hash(scope text, key text)
RETURNS int
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    RETURN ('x' OPERATOR(pg_catalog.||) pg_catalog.encode(pg_catalog.substr(pg_catalog.sha256(
                pg_catalog.convert_to(COALESCE(scope, ''), 'UTF8')
                OPERATOR(pg_catalog.||) '\x00'::pg_catalog.bytea
                OPERATOR(pg_catalog.||) pg_catalog.convert_to(COALESCE(key, ''), 'UTF8')), 1, 4), 'hex')
           )::pg_catalog.bit(32)::pg_catalog.int4;
END
$$;

-- moved(st, hash): as in 1.1, but until the window is closed
-- (cluster_growth_finish()), not until consult_until: a record on the
-- previous placement can outlive consult_until (made while the growth
-- waited for the claims in flight there, a consult_previous shorter than
-- its ttl, the router's clock ahead of the shard's), and the key's new
-- shard would claim it again.  The window closes only when the previous
-- shards, by their own clocks, hold no live record of a moved key.
CREATE OR REPLACE FUNCTION idempotency.moved(st idempotency.cluster_state, hash int)
RETURNS boolean
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN st.previous IS NOT NULL
       AND st.previous[(hash OPERATOR(pg_catalog.&) (pg_catalog.cardinality(st.previous) OPERATOR(pg_catalog.-) 1)) OPERATOR(pg_catalog.+) 1]
           IS DISTINCT FROM
           st.connstrs[(hash OPERATOR(pg_catalog.&) (pg_catalog.cardinality(st.connstrs) OPERATOR(pg_catalog.-) 1)) OPERATOR(pg_catalog.+) 1];
END
$$;

--
-- The main extension's 1.2 functions through the router (issue 29):
-- idem_acquire's trace and its 1.2 columns, idem_complete's
-- response_headers and idem_lookup's 1.2 columns (above), idem_checkpoint
-- and idem_forget (here), each run on its key's shard.  Over a shard still
-- at idempotency 1.1, a call that needs 1.2 (complete with headers, a
-- checkpoint, a forget) raises 0A000; lookup answers 1.1's columns and
-- NULL for the others; every claim already needs 1.2 (shard_acquire).
--

CREATE FUNCTION idempotency.px_complete_1_2(previous boolean, hash int,
    key text, response_status int, response_body jsonb, scope text,
    attempt int, claim uuid, response_headers jsonb)
RETURNS boolean
LANGUAGE plproxy
AS $$
    CLUSTER idempotency.cluster_name(previous);
    RUN ON hash;
    SELECT idempotency.idem_complete(key, response_status, response_body, scope, attempt,
                                     claim, response_headers) AS px_complete_1_2;
$$;

CREATE FUNCTION idempotency.px_lookup_1_2(previous boolean, hash int,
    key text, scope text)
RETURNS TABLE (status text, request_hash bytea, response_status int,
               response_body jsonb, attempt int, created_at timestamptz,
               locked_until timestamptz, completed_at timestamptz,
               expires_at timestamptz, owner_pid int, phase text,
               state jsonb, response_headers jsonb, origin_trace text)
LANGUAGE plproxy
AS $$
    CLUSTER idempotency.cluster_name(previous);
    RUN ON hash;
    SELECT l.status, l.request_hash, l.response_status, l.response_body,
           l.attempt, l.created_at, l.locked_until, l.completed_at,
           l.expires_at, l.owner_pid, l.phase, l.state, l.response_headers,
           l.origin_trace
      FROM idempotency.idem_lookup(key, scope) l;
$$;

CREATE FUNCTION idempotency.px_checkpoint(previous boolean, hash int,
    key text, scope text, claim uuid, phase text, state jsonb)
RETURNS timestamptz
LANGUAGE plproxy
AS $$
    CLUSTER idempotency.cluster_name(previous);
    RUN ON hash;
    SELECT idempotency.idem_checkpoint(key, scope, claim, phase, state) AS px_checkpoint;
$$;

CREATE FUNCTION idempotency.px_forget(previous boolean, hash int,
    key text, scope text)
RETURNS boolean
LANGUAGE plproxy
AS $$
    CLUSTER idempotency.cluster_name(previous);
    RUN ON hash;
    SELECT idempotency.idem_forget(key, scope) AS px_forget;
$$;

-- idem_checkpoint(key, scope, claim, phase, state): on the shard that
-- holds the key's live record.  Committed on the shard when the call
-- returns (a routed call is a transaction of its own there), not with the
-- caller's transaction on the router.
CREATE FUNCTION idempotency.idem_checkpoint(
    key         text,
    scope       text  DEFAULT '',
    claim       uuid  DEFAULT NULL,
    phase       text  DEFAULT NULL,
    state       jsonb DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    h   int := idempotency.key_hash(scope, key);
    st  text;
    msg text;
BEGIN
    RETURN idempotency.px_checkpoint(idempotency.record_is_previous(idempotency.placement(), h, key, scope),
                                     h, key, scope, claim, phase, state);
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS st = RETURNED_SQLSTATE, msg = MESSAGE_TEXT;
    IF idempotency.shard_failure(st, msg) THEN
        RAISE EXCEPTION 'idempotency shard unavailable'
            USING ERRCODE = 'connection_failure',
                  DETAIL = msg,
                  HINT = 'Keys of the other shards keep working; retry this one when its shard is back.';
    END IF;
    -- no record where this router looked: its layout may be behind a
    -- growth it was not told of; reloaded, run once more
    IF st = 'P0002' AND idempotency.reloaded(h) THEN
        RETURN idempotency.idem_checkpoint(key, scope, claim, phase, state);
    END IF;
    IF st IN ('42883', '42703') THEN
        RAISE EXCEPTION '% needs its shard at idempotency 1.2', 'idem_checkpoint'
            USING ERRCODE = 'feature_not_supported',
                  DETAIL = msg,
                  HINT = 'Update the extension idempotency on every shard to 1.2 first.';
    END IF;
    RAISE;
END
$$;

-- idem_forget(key, scope): on the key's shard, and during a growth window
-- on its previous shard too when the key moved (its record may be on
-- either).  True when a record was removed.  The role needs EXECUTE on
-- idem_forget on the shards too (PL/Proxy connects as the caller).
CREATE FUNCTION idempotency.idem_forget(
    key         text,
    scope       text DEFAULT '')
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    sp  idempotency.cluster_state;
    h   int := idempotency.key_hash(scope, key);
    got boolean;
    st  text;
    msg text;
BEGIN
    FOR i IN 1 .. 2 LOOP
        sp := idempotency.placement();
        got := idempotency.px_forget(false, h, key, scope);
        IF idempotency.moved(sp, h) THEN
            got := idempotency.px_forget(true, h, key, scope) OR got;
        END IF;
        -- nothing removed: as idem_release
        EXIT WHEN got OR i = 2 OR NOT idempotency.reloaded(h);
    END LOOP;
    RETURN got;
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS st = RETURNED_SQLSTATE, msg = MESSAGE_TEXT;
    IF idempotency.shard_failure(st, msg) THEN
        RAISE EXCEPTION 'idempotency shard unavailable'
            USING ERRCODE = 'connection_failure',
                  DETAIL = msg,
                  HINT = 'Keys of the other shards keep working; retry this one when its shard is back.';
    END IF;
    IF st IN ('42883', '42703') THEN
        RAISE EXCEPTION '% needs its shard at idempotency 1.2', 'idem_forget'
            USING ERRCODE = 'feature_not_supported',
                  DETAIL = msg,
                  HINT = 'Update the extension idempotency on every shard to 1.2 first.';
    END IF;
    RAISE;
END
$$;

REVOKE ALL ON FUNCTION idempotency.px_complete_1_2(boolean, int, text, int, jsonb, text, int, uuid, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.px_lookup_1_2(boolean, int, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.px_checkpoint(boolean, int, text, text, uuid, text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.px_forget(boolean, int, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_acquire(text, jsonb, text, interval, interval, boolean, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_complete(text, int, jsonb, text, int, uuid, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_lookup(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_checkpoint(text, text, uuid, text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_forget(text, text) FROM PUBLIC;

--
-- Grant on each new function what was granted on the old one, as the main
-- extension's 1.1 -> 1.2 update does: idem_checkpoint to whoever may call
-- idem_complete, idem_forget to nobody (an operator's grant).  The
-- initial privileges are set back to what a fresh install records, so
-- that pg_dump keeps dumping the user's grants.  (In a fresh install no
-- 1.1 function exists and nothing is copied.)
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
                ('idem_acquire_1_1', 'idempotency.idem_acquire(text, jsonb, text, interval, interval, boolean, text)'),
                ('idem_complete_1_1', 'idempotency.idem_complete(text, int, jsonb, text, int, uuid, jsonb)'),
                ('idem_complete_1_1', 'idempotency.idem_checkpoint(text, text, uuid, text, jsonb)'),
                ('idem_lookup_1_1', 'idempotency.idem_lookup(text, text)')) AS f(old_name, new_sig)
          JOIN pg_catalog.pg_proc o
            ON o.proname OPERATOR(pg_catalog.=) f.old_name
           AND o.pronamespace OPERATOR(pg_catalog.=) 'idempotency'::pg_catalog.regnamespace
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
