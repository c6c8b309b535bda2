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
-- What differs from 1.2, all outside what a router sends or writes:
--   - under REPEATABLE READ or SERIALIZABLE, a layout changed since the
--     transaction's snapshot fails the check with 40001 (1.2 checked a
--     claim against the layout its snapshot saw, which proxy/README.md's
--     argument does not allow);
--   - a NULL element of owned or previous_owned, or a NULL previous_owned
--     beside a previous_map, owns nothing (1.2's NULL logic let some calls
--     through);
--   - shard_refusal with a NULL hash or fresh raises 22004;
--   - shard_acquire needs EXECUTE on itself only, not on idem_acquire and
--     idem_release too (it runs their code, not the SQL functions).
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
