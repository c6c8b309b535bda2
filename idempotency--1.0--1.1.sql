/* idempotency--1.0--1.1.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.1'" to load this file. \quit

--
-- Version 1.1: fenced claims (claim, retry_after, idem_extend) and
-- session-bound claims (see README.md, "Upgrading", for how to run this).
--
-- idem_acquire, idem_complete, idem_release and idem_lookup change their
-- parameters or result columns, so they are dropped and created again, bound
-- to new C symbols (idem_acquire_1_1, ...): a backend that loaded the 1.0
-- library before it was replaced then fails to find the symbol, rather than
-- fill 1.0's result into 1.1's columns.  The old complete and release must
-- go in any case: a new trailing DEFAULT parameter beside the old function
-- would make every 5-argument call ambiguous.  Every privilege granted on
-- the old functions is granted again on the new ones.
--

-- Refuse, before changing anything, where user objects (views, SQL
-- functions with BEGIN ATOMIC bodies, ...) depend on the functions that are
-- re-created: DROP FUNCTION would fail on them with a less helpful message,
-- and CASCADE would drop the user's objects.
DO $$
DECLARE
    dependents text;
BEGIN
    SELECT pg_catalog.string_agg(DISTINCT pg_catalog.pg_describe_object(d.classid, d.objid, d.objsubid), ', ')
      INTO dependents
      FROM pg_catalog.pg_depend d
     WHERE d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
       AND d.refobjid OPERATOR(pg_catalog.=) ANY (ARRAY[
               'idempotency.idem_acquire(text, jsonb, text, interval, interval)'::pg_catalog.regprocedure,
               'idempotency.idem_complete(text, int, jsonb, text, int)'::pg_catalog.regprocedure,
               'idempotency.idem_release(text, text, int)'::pg_catalog.regprocedure,
               'idempotency.idem_lookup(text, text)'::pg_catalog.regprocedure]::pg_catalog.oid[])
       AND d.deptype OPERATOR(pg_catalog.=) ANY (ARRAY['n', 'a']::pg_catalog."char"[]);
    IF dependents IS NOT NULL THEN
        RAISE EXCEPTION 'cannot update extension "idempotency": other objects depend on functions that version 1.1 re-creates'
            USING ERRCODE = 'dependent_objects_still_exist',
                  DETAIL = 'Dependent objects: ' || dependents || '.',
                  HINT = 'Drop them, run ALTER EXTENSION idempotency UPDATE, and create them again (idem_acquire and idem_lookup return more columns in 1.1).';
    END IF;
END
$$;

--
-- Storage: the claim and, for a session-bound claim, its owner session.
-- Nullable without a default, so adding them rewrites nothing (but takes
-- ACCESS EXCLUSIVE on the table and every partition for a moment; see
-- README.md).  NULL in every record made by 1.0.  Partitions made later by
-- maintenance copy the columns (LIKE idempotency.records).
--
ALTER TABLE idempotency.records
    ADD COLUMN claim uuid,
    ADD COLUMN owner_pid int,
    ADD COLUMN owner_start timestamptz;

--
-- The old functions are renamed, not dropped, until their privileges have
-- been copied to the new ones.
--
ALTER FUNCTION idempotency.idem_acquire(text, jsonb, text, interval, interval)
    RENAME TO idem_acquire_1_0;
ALTER FUNCTION idempotency.idem_complete(text, int, jsonb, text, int)
    RENAME TO idem_complete_1_0;
ALTER FUNCTION idempotency.idem_release(text, text, int)
    RENAME TO idem_release_1_0;
ALTER FUNCTION idempotency.idem_lookup(text, text)
    RENAME TO idem_lookup_1_0;

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
AS 'MODULE_PATHNAME', 'idem_acquire_1_1'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;

CREATE FUNCTION idempotency.idem_complete(
    key             text,
    response_status int,
    response_body   jsonb DEFAULT NULL,
    scope           text  DEFAULT '',
    attempt         int   DEFAULT NULL,
    claim           uuid  DEFAULT NULL)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_complete_1_1'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idempotency.idem_release(
    key         text,
    scope       text DEFAULT '',
    attempt     int  DEFAULT NULL,
    claim       uuid DEFAULT NULL)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_release_1_1'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idempotency.idem_lookup(
    key         text,
    scope       text DEFAULT '')
RETURNS TABLE (status text, request_hash bytea, response_status int,
               response_body jsonb, attempt int, created_at timestamptz,
               locked_until timestamptz, completed_at timestamptz,
               expires_at timestamptz, owner_pid int)
AS 'MODULE_PATHNAME', 'idem_lookup_1_1'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;

CREATE FUNCTION idempotency.idem_extend(
    key         text,
    scope       text     DEFAULT '',
    claim       uuid     DEFAULT NULL,
    lease       interval DEFAULT NULL)
RETURNS timestamptz
AS 'MODULE_PATHNAME', 'idem_extend'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

-- Nothing is granted to PUBLIC, as in 1.0.
REVOKE ALL ON FUNCTION idempotency.idem_acquire(text, jsonb, text, interval, interval, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_complete(text, int, jsonb, text, int, uuid) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_release(text, text, int, uuid) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_lookup(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION idempotency.idem_extend(text, text, uuid, interval) FROM PUBLIC;

--
-- Grant on each new function what was granted on the old one.  idem_extend
-- is granted to whoever may call idem_complete (the holder of a claim).
--
-- Privileges granted inside an extension script are recorded as the
-- extension's initial privileges (pg_init_privs), which pg_dump leaves out.
-- These are the user's own grants, so the initial privileges are set back
-- to what a fresh install of 1.1 records, and pg_dump keeps dumping them.
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
                ('idempotency.idem_acquire_1_0(text, jsonb, text, interval, interval)',
                 'idempotency.idem_acquire(text, jsonb, text, interval, interval, boolean)'),
                ('idempotency.idem_complete_1_0(text, int, jsonb, text, int)',
                 'idempotency.idem_complete(text, int, jsonb, text, int, uuid)'),
                ('idempotency.idem_complete_1_0(text, int, jsonb, text, int)',
                 'idempotency.idem_extend(text, text, uuid, interval)'),
                ('idempotency.idem_release_1_0(text, text, int)',
                 'idempotency.idem_release(text, text, int, uuid)'),
                ('idempotency.idem_lookup_1_0(text, text)',
                 'idempotency.idem_lookup(text, text)')) AS f(old_sig, new_sig)
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

        -- From PostgreSQL 17 on, the roles named in initial privileges are
        -- also recorded as shared dependencies (deptype 'i'); those of the
        -- grants just made go with them, or the roles could not be dropped.
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

DROP FUNCTION idempotency.idem_acquire_1_0(text, jsonb, text, interval, interval);
DROP FUNCTION idempotency.idem_complete_1_0(text, int, jsonb, text, int);
DROP FUNCTION idempotency.idem_release_1_0(text, text, int);
DROP FUNCTION idempotency.idem_lookup_1_0(text, text);
