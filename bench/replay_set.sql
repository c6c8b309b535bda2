-- bench/replay_set.sql -- the replay sets of bench/run.sh (run with psql
-- after bench/setup.sql, and again for each other --spread)
--
-- psql variables: req (the request JSON), resp (the response JSON), nrep
-- (how many completed records every replay case draws from), spread (the
-- window over which they expire).
--
-- Empties the four tables the cases write to (bench.floor,
-- bench.idempotency_records, plidem.records, idempotency.records: earlier
-- cases' new keys too, so that every spread starts from the same tables),
-- then puts the same nrep completed records in each, key md5('r' || i),
-- expires_at from now + 1 hour evenly over the next :spread in 1,000 steps.
-- idempotency.records and plidem.records are partitioned by day on
-- expires_at, made ahead for max_ttl (7 days) + 2 days: '1 day' lands in two
-- partitions, '6 days' in seven; a spread past max_ttl would land in DEFAULT
-- (bench/run.sh reports how many partitions hold rows).

TRUNCATE bench.floor, bench.idempotency_records, plidem.records, idempotency.records;

-- The replay set: :nrep completed records in each of the four tables, with
-- expires_at spread evenly over the next :spread (bench/run.sh --spread).
CREATE TEMP TABLE replay_set AS
SELECT md5('r' || i) AS key,
       now() - interval '1 minute' AS created_at,
       now() + interval '1 hour' + (i % 1000) * (:'spread'::interval / 1000) AS expires_at
  FROM generate_series(1, :nrep) i;

INSERT INTO bench.floor (scope, key, status, request_hash, response_status,
                         response_body, created_at, completed_at, expires_at)
SELECT '', s.key, 'completed', sha256(convert_to((:'req'::jsonb)::text, 'UTF8')), 201,
       :'resp'::jsonb, s.created_at, s.created_at, s.expires_at
  FROM replay_set s;

INSERT INTO bench.idempotency_records (idempotency_key, request_hash, status,
                                       response_status, response_body, expires_at)
SELECT s.key, encode(sha256(convert_to((:'req'::jsonb)::text, 'UTF8')), 'hex'),
       'COMPLETED', 201, :'resp'::jsonb, s.expires_at
  FROM replay_set s;

INSERT INTO plidem.records (scope, key, status, request_hash, response_status,
                            response_body, created_at, completed_at, expires_at)
SELECT '', s.key, 'completed', sha256(convert_to((:'req'::jsonb)::text, 'UTF8')), 201,
       :'resp'::jsonb, s.created_at, s.created_at, s.expires_at
  FROM replay_set s;

INSERT INTO idempotency.records (scope, key, status, request_hash, response_status,
                                 response_body, created_at, completed_at, expires_at)
SELECT '', s.key, 'completed', idempotency.idem_request_hash(:'req'::jsonb), 201,
       :'resp'::jsonb, s.created_at, s.created_at, s.expires_at
  FROM replay_set s;

VACUUM ANALYZE bench.floor, bench.idempotency_records, plidem.records, idempotency.records;
