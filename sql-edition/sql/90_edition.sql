--
-- 90_edition: the SQL edition as an application and an operator use it,
-- each a role that is neither superuser nor owner (made by the database's
-- administrator, as on a managed service: sql-edition/test.sh), with the
-- grants docs/reference.md gives.  Also the 1.2 points that sql/33_v12_features
-- tests without a claim (excluded, see sql-edition/excluded.txt).
--
SET idempotency.wait_timeout = 0;

-- the helpers' schema: callable by everyone, holding no record
SELECT n.nspname, has_schema_privilege('public', n.oid, 'USAGE') AS public_usage
  FROM pg_namespace n WHERE n.nspname = 'idempotency_sql';
SELECT pg_catalog.count(*) AS helper_tables_with_records
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = 'idempotency_sql' AND c.relkind = 'r' AND c.relname <> 'key_latches';
-- no C, no untrusted language, no SECURITY DEFINER but idem_forget and
-- the latch's two (core.sql: they take a bigint or nothing)
SELECT l.lanname, pg_catalog.count(*) > 0 AS used
  FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
 WHERE p.pronamespace IN ('idempotency'::regnamespace, 'idempotency_sql'::regnamespace)
 GROUP BY l.lanname ORDER BY l.lanname;
SELECT p.oid::regprocedure AS security_definer
  FROM pg_proc p
 WHERE p.pronamespace IN ('idempotency'::regnamespace, 'idempotency_sql'::regnamespace)
   AND p.prosecdef
 ORDER BY p.oid::regprocedure::text COLLATE "C";
-- every function fixes its search_path (SQL-standard bodies are bound at creation)
SELECT p.oid::regprocedure AS without_search_path
  FROM pg_proc p
 WHERE p.pronamespace IN ('idempotency'::regnamespace, 'idempotency_sql'::regnamespace)
   AND p.prosqlbody IS NULL
   AND NOT coalesce(p.proconfig @> ARRAY['search_path=pg_catalog, pg_temp'], false)
 ORDER BY 1::text;

-- The application role, with README's grants
\set app_role regress_idem_sql_app
\i sql/include/readme_grants.sql
\i sql/include/readme_token_grants.sql
SET ROLE regress_idem_sql_app;
SELECT outcome, attempt, claim IS NOT NULL AS has_claim
  FROM idempotency.idem_acquire('e-1', '{"amount": 5}', trace => 'tp-e1') \gset a_
SELECT :'a_outcome' AS outcome, :a_attempt AS attempt, :'a_has_claim' AS has_claim;
SELECT claim AS e1_claim FROM idempotency.idem_acquire('e-1b', '{"amount": 5}') \gset
-- the checkpoint needs the claim
SELECT public.sqlstate_of($$SELECT idempotency.idem_checkpoint('e-1b', phase => 'charged')$$) AS no_claim;
SELECT idempotency.idem_checkpoint('e-1b', claim => :'e1_claim', phase => 'charged',
                                   state => '{"charge": "ch_1"}') IS NOT NULL AS checkpointed;
SELECT phase, state FROM idempotency.idem_lookup('e-1b');
SELECT public.sqlstate_of(format($$SELECT idempotency.idem_checkpoint('e-1b', claim => %L, phase => '')$$, :'e1_claim')) AS empty_phase,
       public.sqlstate_of(format($$SELECT idempotency.idem_checkpoint('e-1b', claim => %L, phase => NULL)$$, :'e1_claim')) AS null_phase,
       public.sqlstate_of($$SELECT idempotency.idem_checkpoint('e-1b', claim => gen_random_uuid(), phase => 'x')$$) AS other_claim,
       public.sqlstate_of($$SELECT idempotency.idem_checkpoint('e-none', claim => gen_random_uuid(), phase => 'x')$$) AS no_record;
-- a takeover answers the last checkpoint
UPDATE idempotency.records SET locked_until = clock_timestamp() WHERE key = 'e-1b';
SELECT outcome, attempt, phase, state FROM idempotency.idem_acquire('e-1b', '{"amount": 5}');

-- replayed headers: lower-cased, stored, replayed
SELECT idempotency.idem_complete('e-1', 201, '{"id": 1}',
           response_headers => '{"Location": "/orders/1", "X-Request-Id": "r-1"}');
SELECT outcome, response_status, response_body, response_headers, origin_trace
  FROM idempotency.idem_acquire('e-1', '{"amount": 5}');
SELECT outcome, origin_trace FROM idempotency.idem_acquire('e-1', '{"amount": 6}');
-- the header rules: 22023 each, nothing written
SELECT claim AS e2_claim FROM idempotency.idem_acquire('e-2') \gset
SELECT public.sqlstate_of($$SELECT idempotency.idem_complete('e-2', 200, response_headers => '["a"]')$$) AS not_object,
       public.sqlstate_of($$SELECT idempotency.idem_complete('e-2', 200, response_headers => '{"a": 1}')$$) AS not_string,
       public.sqlstate_of($$SELECT idempotency.idem_complete('e-2', 200, response_headers => '{"Bad Name": "x"}')$$) AS bad_name,
       public.sqlstate_of($$SELECT idempotency.idem_complete('e-2', 200, response_headers => '{"": "x"}')$$) AS empty_name,
       public.sqlstate_of($$SELECT idempotency.idem_complete('e-2', 200, response_headers => '{"A": "x", "a": "y"}')$$) AS twice,
       public.sqlstate_of($$SELECT idempotency.idem_complete('e-2', 200, response_headers => '{"a": "x\r\nSet-Cookie: y"}')$$) AS crlf,
       public.sqlstate_of(format($$SELECT idempotency.idem_complete('e-2', 200, response_headers => %L)$$,
                                 (SELECT pg_catalog.jsonb_object_agg('h' || g, 'v') FROM generate_series(1, 65) g))) AS too_many;
SELECT status FROM idempotency.idem_lookup('e-2');
SELECT idempotency.idem_complete('e-2', 200, response_headers =>
           (SELECT pg_catalog.jsonb_object_agg('h' || g, 'v') FROM generate_series(1, 64) g)) AS sixty_four_ok;
SELECT public.sqlstate_of($$SELECT * FROM idempotency.idem_acquire('e-3', trace => repeat('t', 256))$$) AS long_trace;

-- the request hash: the contract's, whatever the key order and spacing
SELECT idempotency.idem_request_hash('{"b": [1, 2.50], "a": "é\u00e9", "c": null}')
       = sha256(convert_to(('{"b": [1, 2.50], "a": "é\u00e9", "c": null}'::jsonb)::text, 'UTF8')) AS contract_hash,
       idempotency.idem_request_hash('{"a":"éé","c":null,"b":[1,2.50]}')
       = idempotency.idem_request_hash(' {"c": null, "b": [1, 2.50], "a": "éé"}') AS canonical;

-- a replay writes nothing and takes no lock of its own (no transaction id,
-- no row, advisory or tuple lock)
BEGIN;
SELECT outcome FROM idempotency.idem_acquire('e-1', '{"amount": 5}');
SELECT pg_current_xact_id_if_assigned() IS NULL AS no_xid,
       (SELECT pg_catalog.count(*) FROM pg_locks
         WHERE pid = pg_backend_pid() AND locktype IN ('advisory', 'tuple', 'transactionid')) AS locks;
COMMIT;

-- the application may not forget keys, nor see the statistics
SELECT public.sqlstate_of($$SELECT idempotency.idem_forget('e-1')$$) AS app_forget;
RESET ROLE;
SELECT public.sqlstate_of($$SELECT * FROM idempotency.stats$$) AS stats;

-- an operator role with EXECUTE on idem_forget alone
GRANT USAGE ON SCHEMA idempotency TO regress_idem_sql_ops;
GRANT EXECUTE ON FUNCTION idempotency.idem_forget(text, text) TO regress_idem_sql_ops;
SET ROLE regress_idem_sql_ops;
SELECT public.sqlstate_of($$SELECT pg_catalog.count(*) FROM idempotency.records$$) AS ops_select;
SELECT idempotency.idem_forget('e-1') AS forgotten, idempotency.idem_forget('e-1') AS again;
RESET ROLE;
SET ROLE regress_idem_sql_app;
SELECT outcome, attempt FROM idempotency.idem_acquire('e-1', '{"amount": 7}');
-- tokens: once, and never a key
SELECT idempotency.idem_token_issue('e-tok') AS tok \gset
SELECT pg_catalog.length(:'tok') AS token_length, :'tok' ~ '^[A-Za-z0-9_-]+$' AS url_safe;
SELECT pg_catalog.count(*) AS token_seen_as_key FROM idempotency.idem_lookup(:'tok', 'e-tok');
SELECT idempotency.idem_token_consume(:'tok', 'e-tok') AS first,
       idempotency.idem_token_consume(:'tok', 'e-tok') AS second,
       idempotency.idem_token_consume(:'tok', 'other') AS other_scope;
RESET ROLE;

REVOKE ALL ON SCHEMA idempotency FROM regress_idem_sql_app, regress_idem_sql_ops;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM regress_idem_sql_app, regress_idem_sql_ops;
REVOKE ALL ON idempotency.records FROM regress_idem_sql_app;
DELETE FROM idempotency.records;
RESET idempotency.wait_timeout;
