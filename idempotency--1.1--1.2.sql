/* idempotency--1.1--1.2.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.2'" to load this file. \quit

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
