--
-- 00_setup: create the extension and the test helpers used by later files.
--
CREATE EXTENSION idempotency;
CREATE EXTENSION pgcrypto;		-- for the hash comparison in 04_lookup_hash

-- Test helper: run a statement, return 'ok' or the SQLSTATE it raised.
\i sql/include/sqlstate_of.sql

-- Test helper: a fingerprint of every stored record, every column included.
CREATE FUNCTION public.records_fingerprint() RETURNS text
LANGUAGE sql AS $$
    SELECT pg_catalog.count(*) || '/' ||
           COALESCE(pg_catalog.md5(pg_catalog.string_agg(r::pg_catalog.text, '|' ORDER BY r::pg_catalog.text)), '')
      FROM idempotency.records r
$$;

-- The extension lives in its fixed schema and is not relocatable.
SELECT e.extname, n.nspname, e.extrelocatable, e.extversion
  FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace
 WHERE e.extname = 'idempotency';

-- The API: exact names, parameters, defaults and results.
SELECT p.proname,
       pg_get_function_arguments(p.oid) AS arguments,
       pg_get_function_result(p.oid) AS result
  FROM pg_proc p
 WHERE p.pronamespace = 'idempotency'::regnamespace
   AND p.proname IN ('idem_acquire', 'idem_complete', 'idem_release',
                     'idem_lookup', 'idem_request_hash', 'idem_extend')
 ORDER BY p.proname;

-- idem_acquire's row type: the contract's result columns, in order
SELECT a.attnum, a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod) AS type
  FROM pg_type t JOIN pg_attribute a ON a.attrelid = t.typrelid
 WHERE t.oid = 'idempotency.acquire_result'::regtype AND a.attnum > 0 AND NOT a.attisdropped
 ORDER BY a.attnum;

SELECT proname, provolatile, proisstrict
  FROM pg_proc
 WHERE oid = 'idempotency.idem_request_hash(jsonb)'::regprocedure;

-- Storage: a logged table, range-partitioned, with a DEFAULT partition and
-- dated partitions (every partition logged too).
SELECT c.relkind, c.relpersistence, pt.partstrat
  FROM pg_class c JOIN pg_partitioned_table pt ON pt.partrelid = c.oid
 WHERE c.oid = 'idempotency.records'::regclass;

SELECT pg_catalog.count(*) > 1 AS has_dated_partitions,
       pg_catalog.bool_or(pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT') AS has_default_partition,
       pg_catalog.bool_and(c.relpersistence = 'p') AS all_logged
  FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
 WHERE i.inhparent = 'idempotency.records'::regclass;

-- Nothing is granted to PUBLIC.
SELECT has_schema_privilege('public', 'idempotency', 'USAGE') AS schema_usage,
       has_table_privilege('public', 'idempotency.records', 'SELECT') AS table_select;
SELECT pg_catalog.count(*) > 0 AS has_functions,
       pg_catalog.bool_or(has_function_privilege('public', p.oid, 'EXECUTE')) AS any_public_execute
  FROM pg_proc p
 WHERE p.pronamespace = 'idempotency'::regnamespace;
