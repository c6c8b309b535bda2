/* idempotency--1.2--1.3.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.3'" to load this file. \quit

-- A shard's layout check in C (issue 39)
--
-- A call routed to a shard by idempotency_proxy (or made to the owning
-- shard by an application itself, as the Go package's Shards does) went
-- through three PL/pgSQL functions: shard_acquire, shard_refusal and
-- shard_key_hash, each with its search_path switch.  That was most of what
-- a routed replay cost the shard beyond a direct idem_acquire.  From 1.3
-- on the three are bound to the library (shard.c, through idempotency.c):
-- the same arguments, answers, messages and SQLSTATEs, the same lock on
-- idempotency.shard_layout held to the caller's commit, and the same
-- privileges (SELECT on idempotency.shard_layout; EXECUTE on the function
-- called).  CREATE OR REPLACE keeps each function's OID and grants, so a
-- router's prepared calls and a shard's grants survive the update.
--
-- shard_check, shard_lookup, shard_token_issue and shard_owns stay in
-- PL/pgSQL and now call the C shard_refusal and shard_key_hash.
--

-- shard_key_hash(scope, key): idempotency_proxy's key hash (NULL hashes as
-- ''), computed by the shard itself.
CREATE OR REPLACE FUNCTION idempotency.shard_key_hash(scope text, key text)
RETURNS int
LANGUAGE C IMMUTABLE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'idem_shard_key_hash_sql';

-- shard_refusal(layout, hash, fresh): why this shard may not answer a call
-- for partition hash from a router at layout version layout, or NULLs when
-- it may (shard.c, idem_shard_refusal, has the rules).
CREATE OR REPLACE FUNCTION idempotency.shard_refusal(layout bigint, hash int,
    fresh boolean, OUT message text, OUT detail text)
LANGUAGE C VOLATILE
AS 'MODULE_PATHNAME', 'idem_shard_refusal_sql';

-- shard_acquire(layout, ..., trace): idem_acquire, or one row with
-- outcome 'refused' when this shard may not answer the key under the
-- caller's layout (idempotency.c, idem_shard_acquire).
CREATE OR REPLACE FUNCTION idempotency.shard_acquire(layout bigint, key text,
    request jsonb, scope text, ttl interval, lease interval,
    trace text DEFAULT NULL)
RETURNS TABLE (outcome text, response_status int, response_body jsonb,
               attempt int, expires_at timestamptz, claim uuid,
               retry_after int, phase text, state jsonb,
               response_headers jsonb, origin_trace text)
LANGUAGE C VOLATILE ROWS 1
AS 'MODULE_PATHNAME', 'idem_shard_acquire';
