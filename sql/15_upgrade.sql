--
-- 15_upgrade: a database created at 1.0, served by the current library
-- before and after ALTER EXTENSION idempotency UPDATE TO '1.1', against a
-- fresh 1.1 install (1.1 -> 1.2: sql/33_upgrade_1_2.sql).
-- (Live records in open transactions, a session opened before the update,
-- and the lock the update takes: t/012_upgrade.pl.)
--
SET client_min_messages = warning;
DROP DATABASE IF EXISTS regress_idem_v10;
DROP DATABASE IF EXISTS regress_idem_v11;
DROP ROLE IF EXISTS regress_idem_upgrade_app;
RESET client_min_messages;
CREATE DATABASE regress_idem_v10;
CREATE DATABASE regress_idem_v11;
CREATE ROLE regress_idem_upgrade_app;

\c regress_idem_v10
CREATE EXTENSION idempotency VERSION '1.0';
\i sql/include/sqlstate_of.sql
-- the README's 1.0 grants
\set app_role regress_idem_upgrade_app
\i sql/include/readme_grants_1_0.sql

-- At 1.0 the 1.1 library answers exactly as 1.0 did: five columns, nine
-- from idem_lookup, and the table has no 1.1 columns to write.
SET idempotency.wait_timeout = 0;
SELECT outcome, attempt FROM idempotency.idem_acquire('u-done', '{"a": 1}');
SELECT idempotency.idem_complete('u-done', 201, '{"id": 1}', attempt => 1);
SELECT outcome, response_status, response_body, attempt FROM idempotency.idem_acquire('u-done', '{"a": 1}');
SELECT outcome, attempt FROM idempotency.idem_acquire('u-lease', lease => '1 hour');
SELECT outcome, attempt FROM idempotency.idem_acquire('u-short', lease => '1 second');
SELECT * FROM idempotency.idem_acquire('u-lease') WHERE false;
SELECT * FROM idempotency.idem_lookup('u-lease') WHERE false;
SELECT outcome, attempt FROM idempotency.idem_acquire('u-gone', lease => '1 hour');
SELECT idempotency.idem_release('u-gone', attempt => 1);
SELECT pg_catalog.count(*) AS v11_columns FROM pg_attribute
 WHERE attrelid = 'idempotency.records'::regclass AND attname IN ('claim', 'owner_pid', 'owner_start');

-- A 1.1 entry point where the table lacks the 1.1 columns: a clean 55000
-- that names the update; a 1.0 entry point declared with 1.1's result
-- shape: a clean error, never five values in seven columns.
CREATE FUNCTION public.wrong_acquire_1_1(key text, request jsonb DEFAULT NULL, scope text DEFAULT '',
    ttl interval DEFAULT NULL, lease interval DEFAULT NULL, session_bound boolean DEFAULT false)
RETURNS TABLE (outcome text, response_status int, response_body jsonb, attempt int,
               expires_at timestamptz, claim uuid, retry_after int)
AS '$libdir/idempotency', 'idem_acquire_1_1' LANGUAGE C;
CREATE FUNCTION public.wrong_acquire_1_0(key text, request jsonb DEFAULT NULL, scope text DEFAULT '',
    ttl interval DEFAULT NULL, lease interval DEFAULT NULL)
RETURNS TABLE (outcome text, response_status int, response_body jsonb, attempt int,
               expires_at timestamptz, claim uuid, retry_after int)
AS '$libdir/idempotency', 'idem_acquire' LANGUAGE C;
\set VERBOSITY default
SELECT * FROM public.wrong_acquire_1_1('u-wrong');
SELECT * FROM public.wrong_acquire_1_0('u-wrong');
\set VERBOSITY default
DROP FUNCTION public.wrong_acquire_1_1, public.wrong_acquire_1_0;
SELECT pg_catalog.count(*) FROM idempotency.idem_lookup('u-wrong');

-- A user view over a function the update re-creates blocks it, with an
-- error that names the view, before anything is changed.
CREATE VIEW public.my_lookup AS SELECT * FROM idempotency.idem_lookup('u-done');
-- (no context: PostgreSQL 18 adds the script's statement to it)
\set SHOW_CONTEXT never
ALTER EXTENSION idempotency UPDATE TO '1.1';
\set SHOW_CONTEXT errors
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
DROP VIEW public.my_lookup;

-- The update
SELECT pg_sleep(1.1);	-- u-short's lease runs out
ALTER EXTENSION idempotency UPDATE TO '1.1';
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';

-- Every 1.0 record: completed replays; processing with a running lease is
-- in_progress and completes with its attempt (not with a claim: it has
-- none); one whose lease ran out is taken over with a claim; a released one
-- is claimed afresh.
SELECT outcome, response_status, response_body, attempt, claim, retry_after FROM idempotency.idem_acquire('u-done', '{"a": 1}');
SELECT outcome, attempt, claim, retry_after > 3500 AS retry_after_is_lease_left FROM idempotency.idem_acquire('u-lease');
SELECT claim IS NULL AS v10_record_has_no_claim, owner_pid FROM idempotency.records WHERE key = 'u-lease';
SELECT public.sqlstate_of($$SELECT idempotency.idem_complete('u-lease', 200, claim => gen_random_uuid())$$) AS complete_with_claim;
SELECT public.sqlstate_of($$SELECT idempotency.idem_extend('u-lease', claim => gen_random_uuid())$$) AS extend_with_claim;
SELECT idempotency.idem_complete('u-lease', 200, attempt => 1);
SELECT outcome, attempt, claim IS NOT NULL AS has_claim FROM idempotency.idem_acquire('u-short');
SELECT outcome, attempt, claim IS NOT NULL AS has_claim FROM idempotency.idem_acquire('u-gone');

-- 1.1's additions on the updated database: every 1.0 record is a key;
-- tokens, the daily reconciliation and stale_claims work.
SELECT pg_catalog.bool_and(NOT is_token) AS v10_records_are_keys, pg_catalog.count(*) AS records
  FROM idempotency.records;
SELECT idempotency.idem_token_issue('u') AS ut \gset
SELECT idempotency.idem_token_consume(:'ut', 'u') AS first, idempotency.idem_token_consume(:'ut', 'u') AS again;
SELECT pg_catalog.count(*) FROM idempotency.idem_maintain();
SELECT datname = pg_catalog.current_database() AS this_db, tokens_issued, tokens_consumed
  FROM idempotency.daily;
SELECT pg_catalog.count(*) AS stale FROM idempotency.stale_claims;

-- The application role keeps its privileges and gets idem_extend too.
SET ROLE regress_idem_upgrade_app;
SELECT outcome, claim IS NOT NULL AS has_claim FROM idempotency.idem_acquire('u-app', lease => '1 minute');
SELECT idempotency.idem_extend('u-app') IS NOT NULL AS extended;
SELECT idempotency.idem_complete('u-app', 200);
SELECT status, owner_pid FROM idempotency.idem_lookup('u-app');
SELECT outcome FROM idempotency.idem_acquire('u-app-s', session_bound => true);
RESET ROLE;
-- Its grants are its own, not the extension's initial privileges: nothing
-- of them is recorded as such (PostgreSQL 17 and later also record the
-- roles of initial privileges in pg_shdepend, which would keep the role
-- from being dropped).
SELECT pg_catalog.count(*) AS init_priv_dependencies FROM pg_catalog.pg_shdepend
 WHERE deptype = 'i' AND refobjid = 'regress_idem_upgrade_app'::regrole;
SELECT pg_catalog.count(*) AS init_privs_naming_app
  FROM pg_catalog.pg_init_privs i, LATERAL pg_catalog.aclexplode(i.initprivs) a
 WHERE a.grantee = 'regress_idem_upgrade_app'::regrole;

-- The objects now equal those of a fresh 1.1 install.
CREATE TEMP VIEW ext_objects AS
SELECT 'function' AS kind,
       p.proname || '(' || pg_get_function_arguments(p.oid) || ') ' || pg_get_function_result(p.oid)
       || ' ' || CASE WHEN p.prosrc ~ E'\n' THEN 'md5:' || md5(p.prosrc) ELSE p.prosrc END || ' ' || p.provolatile::text || p.proparallel::text || p.prorows::text || ' '
       || COALESCE((SELECT pg_catalog.string_agg(a.privilege_type || ' to ' ||
                           CASE WHEN a.grantee = 0 THEN 'PUBLIC' WHEN a.grantee = p.proowner THEN 'owner'
                                ELSE a.grantee::regrole::text END || CASE WHEN a.is_grantable THEN '*' ELSE '' END,
                           ', ' ORDER BY 1)
                      FROM aclexplode(p.proacl) a), '') AS object,
       COALESCE((SELECT i.initprivs::text FROM pg_init_privs i
                  WHERE i.objoid = p.oid AND i.classoid = 'pg_proc'::regclass), '') AS initprivs
  FROM pg_proc p WHERE p.pronamespace = 'idempotency'::regnamespace
UNION ALL
SELECT 'column', c.relname || '.' || a.attnum || ' ' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
       || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END, ''
  FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
 WHERE c.oid IN ('idempotency.records'::regclass, 'idempotency.records_default'::regclass)
   AND a.attnum > 0 AND NOT a.attisdropped
UNION ALL
SELECT 'partition columns', pg_catalog.string_agg(DISTINCT
           (SELECT pg_catalog.string_agg(a.attname, ',' ORDER BY a.attnum) FROM pg_attribute a
             WHERE a.attrelid = i.inhrelid AND a.attnum > 0 AND NOT a.attisdropped), ' | '), ''
  FROM pg_inherits i WHERE i.inhparent = 'idempotency.records'::regclass
UNION ALL
SELECT 'member', pg_describe_object(d.classid, d.objid, 0), ''
  FROM pg_depend d
 WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e'
   AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency');
SELECT pg_catalog.string_agg(kind || ': ' || object || ' ' || initprivs, E'\n' ORDER BY kind, object) AS upgraded,
       pg_get_viewdef('ext_objects') AS viewdef
  FROM ext_objects \gset
\c regress_idem_v11
CREATE EXTENSION idempotency VERSION '1.1';
-- the README's 1.1 grants
\i sql/include/readme_grants_1_1.sql
CREATE TEMP VIEW ext_objects AS :viewdef
SELECT pg_catalog.string_agg(kind || ': ' || object || ' ' || initprivs, E'\n' ORDER BY kind, object) AS fresh
  FROM ext_objects \gset
SELECT :'upgraded' = :'fresh' AS same_objects;
-- what differs, if anything
SELECT 'only after the update' AS side, x FROM unnest(string_to_array(:'upgraded', E'\n')) x
EXCEPT SELECT 'only after the update', x FROM unnest(string_to_array(:'fresh', E'\n')) x
UNION ALL
(SELECT 'only in a fresh install', x FROM unnest(string_to_array(:'fresh', E'\n')) x
 EXCEPT SELECT 'only in a fresh install', x FROM unnest(string_to_array(:'upgraded', E'\n')) x)
ORDER BY 1, 2;
-- the functions and columns, once, for the record
SELECT x AS object FROM unnest(string_to_array(:'fresh', E'\n')) x WHERE x !~ '^member' ORDER BY 1;

\c contrib_regression
DROP DATABASE regress_idem_v10;
DROP DATABASE regress_idem_v11;
DROP ROLE regress_idem_upgrade_app;
