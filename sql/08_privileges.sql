--
-- 08_privileges: nothing is granted to PUBLIC; a role without the grants
-- that README.md lists gets 42501 from every function and from the table;
-- with exactly those grants it can use the API.
--
SET idempotency.wait_timeout = '100ms';
SELECT outcome FROM idempotency.idem_acquire('p-owned', '{"a": 1}');	-- a record made by the owner

SET client_min_messages = warning;
DROP ROLE IF EXISTS regress_idem_app;
RESET client_min_messages;
CREATE ROLE regress_idem_app;
\set app_role regress_idem_app

CREATE TEMP VIEW api_calls (n, what, call) AS VALUES
    (1, 'idem_acquire', $$SELECT * FROM idempotency.idem_acquire('p-1', '{"a": 1}')$$),
    (2, 'idem_complete', $$SELECT idempotency.idem_complete('p-1', 201, '{"id": 1}')$$),
    (3, 'idem_release', $$SELECT idempotency.idem_release('p-1')$$),
    (4, 'idem_lookup', $$SELECT * FROM idempotency.idem_lookup('p-1')$$),
    (5, 'idem_request_hash', $$SELECT idempotency.idem_request_hash('{"a": 1}')$$),
    (6, 'idem_maintain', $$SELECT * FROM idempotency.idem_maintain()$$),
    (7, 'idem_schedule_maintenance', $$SELECT idempotency.idem_schedule_maintenance()$$),
    (8, 'idem_unschedule_maintenance', $$SELECT idempotency.idem_unschedule_maintenance()$$),
    (9, 'SELECT records', $$SELECT pg_catalog.count(*) FROM idempotency.records$$),
    (10, 'INSERT records', $$INSERT INTO idempotency.records (scope, key, status, created_at, expires_at) VALUES ('', 'p-x', 'processing', now(), now())$$),
    (11, 'UPDATE records', $$UPDATE idempotency.records SET attempt = attempt WHERE key = 'p-owned'$$),
    (12, 'DELETE records', $$DELETE FROM idempotency.records WHERE key = 'p-x'$$),
    (13, 'idem_extend', $$SELECT idempotency.idem_extend('p-1')$$);
GRANT SELECT ON api_calls TO regress_idem_app;

-- 1. no grants at all
SET ROLE regress_idem_app;
SELECT what, public.sqlstate_of(call) FROM api_calls ORDER BY n;
RESET ROLE;

-- 2. only USAGE on the schema: the README's grants less the functions and
-- the table
\i sql/include/readme_grants.sql
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA idempotency FROM regress_idem_app;
REVOKE ALL ON idempotency.records FROM regress_idem_app;
SET ROLE regress_idem_app;
SELECT what, public.sqlstate_of(call) FROM api_calls ORDER BY n;
RESET ROLE;

-- 3. USAGE and EXECUTE, but no table privileges: idem_request_hash works,
-- everything that touches the records does not (and the maintenance
-- functions are not among the grants)
\i sql/include/readme_grants.sql
REVOKE ALL ON idempotency.records FROM regress_idem_app;
SET ROLE regress_idem_app;
SELECT what, public.sqlstate_of(call) FROM api_calls ORDER BY n;
RESET ROLE;
SELECT pg_catalog.count(*) FROM idempotency.idem_lookup('p-1');	-- nothing was written

-- 4. exactly the grants of README.md: the API works
\i sql/include/readme_grants.sql
SET ROLE regress_idem_app;
SELECT outcome, attempt FROM idempotency.idem_acquire('p-1', '{"a": 1}');
SELECT outcome FROM idempotency.idem_acquire('p-1', '{"a": 1}');	-- in_progress
SELECT outcome FROM idempotency.idem_acquire('p-1', '{"a": 2}');	-- mismatch
SELECT status, attempt FROM idempotency.idem_lookup('p-1');
SELECT idempotency.idem_complete('p-1', 201, '{"id": 1}');
SELECT idempotency.idem_complete('p-1', 201, '{"id": 1}');
SELECT outcome, response_status, response_body FROM idempotency.idem_acquire('p-1', '{"a": 1}');
SELECT idempotency.idem_release('p-1');
SELECT outcome, attempt FROM idempotency.idem_acquire('p-2', lease => '1 minute');
SELECT idempotency.idem_release('p-2');
SELECT encode(idempotency.idem_request_hash('{}'), 'hex');
SELECT status FROM idempotency.idem_lookup('p-owned');	-- the owner's records too
SELECT pg_catalog.count(*) > 0 AS can_select FROM idempotency.records;
-- maintenance is not among the application's grants
SELECT what, public.sqlstate_of(call) FROM api_calls WHERE n BETWEEN 6 AND 8 ORDER BY n;
-- inside a transaction, with a rollback
BEGIN;
SELECT outcome FROM idempotency.idem_acquire('p-3');
ROLLBACK;
SELECT pg_catalog.count(*) FROM idempotency.idem_lookup('p-3');
RESET ROLE;

-- 5. taking the table grants back: 42501 again
REVOKE SELECT, INSERT, UPDATE, DELETE ON idempotency.records FROM regress_idem_app;
SET ROLE regress_idem_app;
SELECT what, public.sqlstate_of(call) FROM api_calls ORDER BY n;
RESET ROLE;

DROP VIEW api_calls;
DROP OWNED BY regress_idem_app;
DROP ROLE regress_idem_app;
