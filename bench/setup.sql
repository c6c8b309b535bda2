-- bench/setup.sql -- tables of the benchmark (run by bench/run.sh with psql)
--
-- psql variables: req (the request JSON), resp (the response JSON),
-- nrep (how many completed records every replay case draws from).
--
-- Every replay key is md5('r' || i), i = 1..nrep; the new-key cases make
-- md5(<case>-<client>-<n>) keys.  md5 hex keys are the length of a UUID
-- without dashes and land all over the index, as real keys do.

CREATE EXTENSION idempotency;

CREATE SCHEMA bench;

-- floor_new / floor_replay: the thinnest hand-written SQL.  No partitions,
-- PRIMARY KEY (scope, key), the same columns as idempotency.records.
CREATE TABLE bench.floor (
    scope           text COLLATE "C" NOT NULL,
    key             text COLLATE "C" NOT NULL,
    status          text NOT NULL,
    request_hash    bytea,
    response_status int,
    response_body   jsonb,
    attempt         int NOT NULL DEFAULT 1,
    created_at      timestamptz NOT NULL,
    locked_until    timestamptz,
    completed_at    timestamptz,
    expires_at      timestamptz NOT NULL,
    PRIMARY KEY (scope, key)
);

-- article: the article's own idempotency_records table, a surrogate key
-- and a UNIQUE idempotency key.
CREATE TABLE bench.idempotency_records (
    id              bigserial PRIMARY KEY,
    idempotency_key varchar(255) NOT NULL UNIQUE,
    request_hash    varchar(64),
    status          varchar(16) NOT NULL DEFAULT 'PROCESSING',
    response_status int,
    response_body   jsonb,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL
);

-- ext_hot_key: one shared counter for all clients; key = counter / N.
CREATE SEQUENCE bench.hot_seq;

\ir plpgsql_idem.sql

-- The replay set: nrep completed records in each of the four tables, with
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
