-- demo/lease_caller.sql: caller 1 in lease mode.  It claims the key with a
-- 2 second lease and commits (autocommit), then calls a slow outside service,
-- and dies there: scripts/demo.sh terminates its connection, so it never
-- completes.
-- psql variables: key, request.

SELECT outcome, attempt
  FROM idempotency.idem_acquire(:'key', :'request'::jsonb, lease => '2 seconds')
\gset
\echo :outcome|:attempt
-- the slow outside service
SELECT pg_sleep(30);
SELECT idempotency.idem_complete(:'key', 201, '{"transfer": "done"}', attempt => :attempt);
