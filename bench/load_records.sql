-- bench/load_records.sql -- live completed records straight into idempotency.records
--
-- psql variables: from, to (the range of i), req, resp, spread.  Keys
-- md5('m' || i), expires_at spread evenly over the next :spread, status
-- completed with the request hash of req, so that idem_acquire(key, req)
-- replays them.  Far faster than claiming them through idem_acquire.
-- Inserted in key order, so that each partition's index grows from left to
-- right instead of at random pages (a third faster).  bench/run.sh runs it
-- in two sessions at once, each with half of the range.
SET work_mem = '1GB';
INSERT INTO idempotency.records (scope, key, status, request_hash, response_status,
                                 response_body, created_at, completed_at, expires_at)
SELECT '', k.key, 'completed', h.hash, 201, :'resp'::jsonb,
       now() - interval '1 minute', now() - interval '1 minute',
       now() + interval '1 hour' + (k.i % 1000) * (:'spread'::interval / 1000)
  FROM (SELECT idempotency.idem_request_hash(:'req'::jsonb) AS hash) h,
       (SELECT i, md5('m' || i) COLLATE "C" AS key
          FROM generate_series(:from::bigint, :to::bigint) i) k
 ORDER BY k.key;
