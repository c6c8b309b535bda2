--
-- 18_filter: the known-absent filters (the library is preloaded by the test
-- cluster, idempotency.filters at its default).  A READY filter keeps
-- idem_acquire from descending a partition's index for a new key; a key
-- written by any path other than idem_acquire (SQL INSERT into a partition
-- or through the parent, an UPDATE that moves or renames a row, COPY) is
-- still found; disabling the trigger or adding a BEFORE trigger after it
-- takes the filter away, and a build refuses such a partition.
--
SET idempotency.wait_timeout = 0;
-- a build's NOTICEs name dated partitions; one with a fixed name shows one
SET client_min_messages = warning;

-- Records in several partitions, so that without filters a new key would
-- descend several indexes.
SELECT pg_catalog.count(*) AS acquired
  FROM pg_catalog.generate_series(1, 4) i,
       LATERAL idempotency.idem_acquire('flt-seed-' || i, ttl => i * interval '1 day') a
 WHERE a.outcome = 'acquired';
SELECT idempotency.build_filters() >= 0 AS built;
SELECT pg_catalog.count(*) FILTER (WHERE f.state = 'ready') = pg_catalog.count(*) AS all_ready,
       pg_catalog.count(*) >= 5 AS enough
  FROM idempotency.idem_filters() f;
-- each seed key is in its filter
SELECT pg_catalog.sum(f.estimated_keys) >= 4 AS keys_noted
  FROM idempotency.idem_filters() f;

-- Index scans of the partitions, as the statistics count them; a backend
-- sends its counts when idle, so each read follows a statement that forces
-- that.
CREATE FUNCTION pg_temp.idx_scans() RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_catalog.pg_stat_clear_snapshot();
    RETURN (SELECT pg_catalog.sum(s.idx_scan)
              FROM pg_catalog.pg_stat_user_tables s
             WHERE s.schemaname = 'idempotency'
               AND s.relname LIKE 'records%');
END
$$;
-- A backend trusts a partition's filter once it has read the partition's
-- index definition itself (its collations must compare by bytes, as the
-- filter's hash does): its first call descends each non-empty partition.
SELECT outcome FROM idempotency.idem_acquire('flt-warm-up');
SELECT pg_catalog.pg_stat_force_next_flush();
SELECT pg_temp.idx_scans() AS before \gset
SELECT outcome FROM idempotency.idem_acquire('flt-new-1');
SELECT outcome FROM idempotency.idem_acquire('flt-new-2', ttl => '3 days');
SELECT outcome FROM idempotency.idem_acquire('flt-new-3', scope => 'other');
-- no partition's index was descended for a new key
SELECT pg_catalog.pg_stat_force_next_flush();
SELECT pg_temp.idx_scans() - :before AS idx_scan_delta;
-- a replay still finds its record (the filter says maybe)
SELECT outcome FROM idempotency.idem_acquire('flt-new-1');
SELECT pg_catalog.pg_stat_force_next_flush();
SELECT pg_temp.idx_scans() - :before > 0 AS replay_descended;

-- A filter that no key was added to (its partition, made ahead, was empty
-- when it was built) rules keys out without reading its bits; the first
-- key written into the partition is then found like any other.
CREATE FUNCTION pg_temp.bits_at(ahead interval) RETURNS bigint
LANGUAGE sql AS $$
    SELECT f.bits_set FROM idempotency.idem_filters() f, idempotency.partitions p
     WHERE f.partition = p.partition
       AND p.range_start <= pg_catalog.now() + ahead
       AND p.range_end > pg_catalog.now() + ahead $$;
SELECT pg_temp.bits_at('6 days') AS bits_before;
SELECT outcome FROM idempotency.idem_acquire('flt-late', ttl => '6 days');
SELECT pg_temp.bits_at('6 days') > 0 AS bits_after;
SELECT outcome FROM idempotency.idem_acquire('flt-late', ttl => '6 days');

-- A completed record is looked for before the key lock is taken (specs/31
-- shows that its replay does not wait for the lock): one index descent
-- each, and the same answers as under the lock (filters off): replay,
-- mismatch, replay without a request.
SELECT outcome FROM idempotency.idem_acquire('flt-done', '{"n": 1}', ttl => '2 days');
SELECT idempotency.idem_complete('flt-done', 201, '{"id": 1}');
SELECT pg_catalog.pg_stat_force_next_flush();
SELECT pg_temp.idx_scans() AS before \gset
CREATE TEMP TABLE flt_answers AS
SELECT r.n, a.*
  FROM (VALUES (1, '{"n": 1}'::jsonb), (2, '{"n": 2}'), (3, NULL)) r(n, req),
       LATERAL idempotency.idem_acquire('flt-done', r.req, ttl => '2 days') a;
SELECT pg_catalog.pg_stat_force_next_flush();
SELECT pg_temp.idx_scans() - :before AS idx_scan_delta;
SELECT n, outcome, response_status, response_body, attempt FROM flt_answers ORDER BY n;
SET idempotency.use_filters = off;
SELECT pg_catalog.count(*) AS differing
  FROM ((SELECT r.n, a.*
           FROM (VALUES (1, '{"n": 1}'::jsonb), (2, '{"n": 2}'), (3, NULL)) r(n, req),
                LATERAL idempotency.idem_acquire('flt-done', r.req, ttl => '2 days') a
         EXCEPT SELECT * FROM flt_answers)
        UNION ALL
        (SELECT * FROM flt_answers
         EXCEPT SELECT r.n, a.*
           FROM (VALUES (1, '{"n": 1}'::jsonb), (2, '{"n": 2}'), (3, NULL)) r(n, req),
                LATERAL idempotency.idem_acquire('flt-done', r.req, ttl => '2 days') a)) d;
RESET idempotency.use_filters;
-- a completed record that has expired answers nothing: the key is claimed anew
SELECT outcome FROM idempotency.idem_acquire('flt-brief', ttl => '3 seconds');
SELECT idempotency.idem_complete('flt-brief', 201);
SELECT outcome FROM idempotency.idem_acquire('flt-brief');
SELECT pg_catalog.pg_sleep(3.1);
SELECT outcome, attempt FROM idempotency.idem_acquire('flt-brief');

-- Keys written by SQL, not idem_acquire: each is then found.
CREATE FUNCTION pg_temp.outcome(k text) RETURNS text
LANGUAGE sql AS $$ SELECT a.outcome FROM idempotency.idem_acquire(k) a $$;
-- plain INSERT into a partition (the one of a 1-day ttl)
DO $$
DECLARE
    part regclass := (SELECT p.partition FROM idempotency.partitions p
                       WHERE p.range_start <= pg_catalog.now() + interval '1 day'
                         AND p.range_end > pg_catalog.now() + interval '1 day');
BEGIN
    EXECUTE pg_catalog.format(
        'INSERT INTO %s (scope, key, status, attempt, created_at, locked_until, expires_at)'
        ' VALUES ('''', ''flt-sql-part'', ''processing'', 1, now(), now() + interval ''1 hour'', now() + interval ''1 day'')',
        part);
END
$$;
SELECT pg_temp.outcome('flt-sql-part');
-- INSERT through the parent, routed to a partition
INSERT INTO idempotency.records (scope, key, status, attempt, created_at, locked_until, expires_at)
VALUES ('', 'flt-sql-parent', 'processing', 1, now(), now() + interval '1 hour', now() + interval '2 days');
SELECT pg_temp.outcome('flt-sql-parent');
-- an UPDATE that moves a row to another partition
INSERT INTO idempotency.records (scope, key, status, attempt, created_at, locked_until, expires_at)
VALUES ('', 'flt-move', 'processing', 1, now(), now() + interval '1 hour', now() + interval '1 day');
UPDATE idempotency.records SET key = 'flt-moved', expires_at = now() + interval '3 days'
 WHERE key = 'flt-move';
SELECT pg_temp.outcome('flt-moved');
-- an UPDATE that renames a key in place
UPDATE idempotency.records SET key = 'flt-renamed' WHERE key = 'flt-sql-parent';
SELECT pg_temp.outcome('flt-renamed');
-- COPY
COPY idempotency.records (scope, key, status, attempt, created_at, locked_until, expires_at) FROM stdin;
	flt-copy	processing	1	2000-01-01 00:00:00+00	2998-01-01 00:00:00+00	2999-01-01 00:00:00+00
\.
SELECT outcome, expires_at > now() + interval '100 years' AS in_default
  FROM idempotency.idem_acquire('flt-copy');
-- all filters still ready
SELECT pg_catalog.count(*) FILTER (WHERE f.state <> 'ready') AS not_ready
  FROM idempotency.idem_filters() f;

-- DISABLE TRIGGER takes the partition's filter away, and a build skips it.
SELECT p.partition AS part2 FROM idempotency.partitions p
 WHERE p.range_start <= now() + interval '2 days' AND p.range_end > now() + interval '2 days' \gset
SELECT pg_catalog.count(*) AS has_filter FROM idempotency.idem_filters() f
 WHERE f.partition = :'part2'::regclass;
ALTER TABLE :part2 DISABLE TRIGGER zz_records_filter;
SELECT pg_catalog.count(*) AS has_filter FROM idempotency.idem_filters() f
 WHERE f.partition = :'part2'::regclass;
INSERT INTO idempotency.records (scope, key, status, attempt, created_at, locked_until, expires_at)
VALUES ('', 'flt-untriggered', 'processing', 1, now(), now() + interval '1 hour', now() + interval '2 days');
SELECT idempotency.build_filters() >= 0 AS built;
SELECT pg_catalog.count(*) AS has_filter FROM idempotency.idem_filters() f
 WHERE f.partition = :'part2'::regclass;
SELECT pg_temp.outcome('flt-untriggered');
ALTER TABLE :part2 ENABLE ALWAYS TRIGGER zz_records_filter;
SELECT idempotency.build_filters() >= 1 AS built;
SELECT f.state FROM idempotency.idem_filters() f
 WHERE f.partition = :'part2'::regclass;
-- the build scanned the heap: the untriggered row's key is in the filter
SELECT pg_temp.outcome('flt-untriggered');

-- A user BEFORE trigger named after ours could change the key: the first
-- row through ours takes the filter away, and a build skips the partition.
CREATE FUNCTION pg_temp.upper_key() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.key := pg_catalog.upper(NEW.key);
    RETURN NEW;
END
$$;
CREATE TRIGGER zzz_upper_key BEFORE INSERT ON :part2
    FOR EACH ROW EXECUTE FUNCTION pg_temp.upper_key();
INSERT INTO idempotency.records (scope, key, status, attempt, created_at, locked_until, expires_at)
VALUES ('', 'flt-lower', 'processing', 1, now(), now() + interval '1 hour', now() + interval '2 days');
SELECT pg_catalog.count(*) AS has_filter FROM idempotency.idem_filters() f
 WHERE f.partition = :'part2'::regclass;
SELECT pg_temp.outcome('FLT-LOWER');
SELECT idempotency.build_filters() >= 0 AS built;
SELECT pg_catalog.count(*) AS has_filter FROM idempotency.idem_filters() f
 WHERE f.partition = :'part2'::regclass;
DROP TRIGGER zzz_upper_key ON :part2;
SELECT idempotency.build_filters() >= 1 AS built;
SELECT f.state FROM idempotency.idem_filters() f
 WHERE f.partition = :'part2'::regclass;

-- A filter built by a transaction that rolls back goes with it: the
-- trigger state it trusted (ENABLE ALWAYS, made in that transaction) is
-- undone, and no hook says so.  The same for a savepoint.
ALTER TABLE :part2 DISABLE TRIGGER zz_records_filter;
BEGIN;
ALTER TABLE :part2 ENABLE ALWAYS TRIGGER zz_records_filter;
SELECT idempotency.build_filters() >= 1 AS built;
SELECT f.state FROM idempotency.idem_filters() f
 WHERE f.partition = :'part2'::regclass;
ROLLBACK;
SELECT pg_catalog.count(*) AS has_filter FROM idempotency.idem_filters() f
 WHERE f.partition = :'part2'::regclass;
BEGIN;
SAVEPOINT s;
ALTER TABLE :part2 ENABLE ALWAYS TRIGGER zz_records_filter;
SELECT idempotency.build_filters() >= 1 AS built;
ROLLBACK TO SAVEPOINT s;
SELECT pg_catalog.count(*) AS has_filter FROM idempotency.idem_filters() f
 WHERE f.partition = :'part2'::regclass;
COMMIT;
-- also when the filter is made again and again in the transaction (more
-- times than there are slots)
SELECT pg_catalog.set_config('flt.part2', :'part2', false) IS NOT NULL AS set;
BEGIN;
DO $$
BEGIN
    FOR i IN 1..70 LOOP
        EXECUTE pg_catalog.format('ALTER TABLE %s ENABLE TRIGGER zz_records_filter',
                                  pg_catalog.current_setting('flt.part2'));
        EXECUTE pg_catalog.format('ALTER TABLE %s ENABLE ALWAYS TRIGGER zz_records_filter',
                                  pg_catalog.current_setting('flt.part2'));
        PERFORM idempotency.build_filters();
    END LOOP;
END
$$;
SELECT f.state FROM idempotency.idem_filters() f
 WHERE f.partition = :'part2'::regclass;
ROLLBACK;
SELECT pg_catalog.count(*) AS has_filter FROM idempotency.idem_filters() f
 WHERE f.partition = :'part2'::regclass;
-- so the key of a row written meanwhile, noted by no trigger, is found
INSERT INTO idempotency.records (scope, key, status, attempt, created_at, locked_until, expires_at)
VALUES ('', 'flt-rolled-back', 'processing', 1, now(), now() + interval '1 hour', now() + interval '2 days');
SELECT pg_temp.outcome('flt-rolled-back');
ALTER TABLE :part2 ENABLE ALWAYS TRIGGER zz_records_filter;
SELECT idempotency.build_filters() >= 1 AS built;

-- CREATE OR REPLACE TRIGGER drops the filters (it makes the trigger ENABLE
-- ORIGIN again, which replica-role sessions skip), and so does replacing
-- the trigger function; a WHEN condition or a column list on ours, or
-- another function, keeps a build from trusting it.
SELECT pg_catalog.count(*) > 0 AS some_ready FROM idempotency.idem_filters() f
 WHERE f.state = 'ready';
CREATE OR REPLACE TRIGGER zz_records_filter
    BEFORE INSERT OR UPDATE ON idempotency.records
    FOR EACH ROW WHEN (NEW.key NOT LIKE 'flt-when-%')
    EXECUTE FUNCTION idempotency.records_note_key();
SELECT pg_catalog.count(*) AS filters_left FROM idempotency.idem_filters() f;
ALTER TABLE idempotency.records ENABLE ALWAYS TRIGGER zz_records_filter;
SELECT idempotency.build_filters() AS built_with_when;
INSERT INTO idempotency.records (scope, key, status, attempt, created_at, locked_until, expires_at)
VALUES ('', 'flt-when-1', 'processing', 1, now(), now() + interval '1 hour', now() + interval '2 days');
SELECT pg_temp.outcome('flt-when-1');
CREATE OR REPLACE TRIGGER zz_records_filter
    BEFORE INSERT OR UPDATE OF status ON idempotency.records
    FOR EACH ROW EXECUTE FUNCTION idempotency.records_note_key();
ALTER TABLE idempotency.records ENABLE ALWAYS TRIGGER zz_records_filter;
SELECT idempotency.build_filters() AS built_with_columns;
CREATE OR REPLACE TRIGGER zz_records_filter
    BEFORE INSERT OR UPDATE ON idempotency.records
    FOR EACH ROW EXECUTE FUNCTION idempotency.records_note_key();
ALTER TABLE idempotency.records ENABLE ALWAYS TRIGGER zz_records_filter;
SELECT idempotency.build_filters() >= 1 AS built;
CREATE OR REPLACE FUNCTION idempotency.records_note_key() RETURNS trigger
LANGUAGE plpgsql AS $$ BEGIN RETURN NEW; END $$;
SELECT pg_catalog.count(*) AS filters_left FROM idempotency.idem_filters() f;
SELECT idempotency.build_filters() AS built_with_plpgsql;
-- the transaction that puts the C function back does not build: other
-- sessions call the plpgsql one until it commits
BEGIN;
CREATE OR REPLACE FUNCTION idempotency.records_note_key() RETURNS trigger
AS '$libdir/idempotency', 'idem_records_note_key' LANGUAGE C;
SELECT idempotency.build_filters() AS built_while_replacing;
COMMIT;
SELECT idempotency.build_filters() >= 1 AS built;

-- A partition made later (CREATE TABLE + ATTACH) gets the trigger ENABLE ALWAYS.
CREATE TABLE idempotency.records_flt_test
    (LIKE idempotency.records INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
ALTER TABLE idempotency.records ATTACH PARTITION idempotency.records_flt_test
    FOR VALUES FROM ('2900-01-01') TO ('2900-01-02');
SELECT t.tgenabled FROM pg_catalog.pg_trigger t
 WHERE t.tgrelid = 'idempotency.records_flt_test'::regclass
   AND t.tgname = 'zz_records_filter';
-- it gets a filter; dropping it frees the filter
SELECT idempotency.build_filters() >= 1 AS built;
-- a partition a build cannot trust is named in a NOTICE (every other one
-- is ready already, so this is the only one)
ALTER TABLE idempotency.records_flt_test DISABLE TRIGGER zz_records_filter;
SET client_min_messages = notice;
SELECT idempotency.build_filters() AS built;
SET client_min_messages = warning;
ALTER TABLE idempotency.records_flt_test ENABLE ALWAYS TRIGGER zz_records_filter;
SELECT idempotency.build_filters() AS built;
SELECT f.state FROM idempotency.idem_filters() f
 WHERE f.partition = 'idempotency.records_flt_test'::regclass;
DROP TABLE idempotency.records_flt_test;
SELECT pg_catalog.count(*) AS filters_of_dropped FROM idempotency.idem_filters() f
 WHERE f.partition::oid NOT IN (SELECT c.oid FROM pg_catalog.pg_class c);

-- A partition whose probe index compares keys under a nondeterministic
-- collation finds keys of other bytes, which a filter of the bytes cannot
-- know: a backend does not use that partition's filter.  Here an index made
-- before ATTACH comes first, so probes use it.
CREATE COLLATION pg_temp.flt_ci (provider = icu, locale = 'und-u-ks-level2',
                                 deterministic = false);
CREATE TABLE idempotency.records_flt_ci
    (LIKE idempotency.records INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
CREATE INDEX records_flt_ci_ci ON idempotency.records_flt_ci
    (scope COLLATE pg_temp.flt_ci, key COLLATE pg_temp.flt_ci);
ALTER TABLE idempotency.records ATTACH PARTITION idempotency.records_flt_ci
    FOR VALUES FROM ('2900-02-01') TO ('2900-02-02');
INSERT INTO idempotency.records (scope, key, status, attempt, created_at, locked_until, expires_at)
VALUES ('', 'FLT-CI', 'processing', 1, now(), '2900-01-01', '2900-02-01 12:00');
SELECT idempotency.build_filters() >= 1 AS built;
SELECT f.state FROM idempotency.idem_filters() f
 WHERE f.partition = 'idempotency.records_flt_ci'::regclass;
-- the filter holds only 'FLT-CI'; the index finds it for either spelling
SELECT pg_temp.outcome('flt-ci') AS first, pg_temp.outcome('Flt-Ci') AS second;
DROP TABLE idempotency.records_flt_ci;

-- A partition without a heap of its own (partitioned further) gets no
-- filter, and the build goes on.
CREATE TABLE idempotency.records_flt_sub
    (LIKE idempotency.records INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY RANGE (expires_at);
CREATE TABLE idempotency.records_flt_sub_1 PARTITION OF idempotency.records_flt_sub
    FOR VALUES FROM ('2900-03-01') TO ('2900-03-02');
ALTER TABLE idempotency.records ATTACH PARTITION idempotency.records_flt_sub
    FOR VALUES FROM ('2900-03-01') TO ('2900-03-02');
SELECT idempotency.build_filters() AS built;
SELECT pg_catalog.count(*) AS sub_filters FROM idempotency.idem_filters() f
 WHERE f.partition = 'idempotency.records_flt_sub'::regclass;
DROP TABLE idempotency.records_flt_sub;

-- A negative max_wait is refused.
SELECT public.sqlstate_of($$SELECT idempotency.build_filters('-1 second')$$);

-- Only the owner of idempotency.records may build.
CREATE ROLE flt_nobody;
GRANT USAGE ON SCHEMA idempotency TO flt_nobody;
GRANT SELECT ON idempotency.records TO flt_nobody;
GRANT EXECUTE ON FUNCTION idempotency.build_filters(interval) TO flt_nobody;
SET ROLE flt_nobody;
SELECT public.sqlstate_of('SELECT idempotency.build_filters()');
RESET ROLE;
REVOKE ALL ON FUNCTION idempotency.build_filters(interval) FROM flt_nobody;
REVOKE ALL ON idempotency.records FROM flt_nobody;
REVOKE ALL ON SCHEMA idempotency FROM flt_nobody;
DROP ROLE flt_nobody;

-- Clean up the keys of this file.
DELETE FROM idempotency.records WHERE key LIKE 'flt-%' OR key LIKE 'FLT-%';
