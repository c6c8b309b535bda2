-- bench/setup.sql -- tables of the benchmark (run by bench/run.sh with psql)
--
-- No psql variables.  The replay sets are loaded afterwards, and again for
-- another --spread, by bench/replay_set.sql.
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

-- article: the article's own idempotency_records table
\ir article_table.sql

-- ext_hot_key: one shared counter for all clients; key = counter / N.
CREATE SEQUENCE bench.hot_seq;

\ir plpgsql_idem.sql
