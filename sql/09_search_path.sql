--
-- 09_search_path: a hostile schema first on search_path, ahead of
-- pg_catalog, with functions, operators and types named like the built-ins.
-- Every one of them raises an error naming itself if it is ever called, so
-- the API must behave exactly as with a clean search_path.
--
-- This session has not called the extension yet: everything it prepares,
-- it prepares under the hostile search_path.
--
CREATE SCHEMA regress_hostile;

CREATE FUNCTION regress_hostile.trap(what pg_catalog.text) RETURNS pg_catalog.bool
LANGUAGE plpgsql SET search_path = pg_catalog AS $$
BEGIN
    RAISE EXCEPTION 'hostile % called', what;
END
$$;

-- functions
CREATE FUNCTION regress_hostile.now() RETURNS pg_catalog.timestamptz
    LANGUAGE sql AS $$ SELECT NULL::pg_catalog.timestamptz WHERE regress_hostile.trap('now()') $$;
CREATE FUNCTION regress_hostile.clock_timestamp() RETURNS pg_catalog.timestamptz
    LANGUAGE sql AS $$ SELECT NULL::pg_catalog.timestamptz WHERE regress_hostile.trap('clock_timestamp()') $$;
CREATE FUNCTION regress_hostile.statement_timestamp() RETURNS pg_catalog.timestamptz
    LANGUAGE sql AS $$ SELECT NULL::pg_catalog.timestamptz WHERE regress_hostile.trap('statement_timestamp()') $$;
CREATE FUNCTION regress_hostile.transaction_timestamp() RETURNS pg_catalog.timestamptz
    LANGUAGE sql AS $$ SELECT NULL::pg_catalog.timestamptz WHERE regress_hostile.trap('transaction_timestamp()') $$;
CREATE FUNCTION regress_hostile.current_setting(pg_catalog.text) RETURNS pg_catalog.text
    LANGUAGE sql AS $$ SELECT NULL::pg_catalog.text WHERE regress_hostile.trap('current_setting(text)') $$;
CREATE FUNCTION regress_hostile.current_setting(pg_catalog.text, pg_catalog.bool) RETURNS pg_catalog.text
    LANGUAGE sql AS $$ SELECT NULL::pg_catalog.text WHERE regress_hostile.trap('current_setting(text, bool)') $$;
CREATE FUNCTION regress_hostile.sha256(pg_catalog.bytea) RETURNS pg_catalog.bytea
    LANGUAGE sql AS $$ SELECT NULL::pg_catalog.bytea WHERE regress_hostile.trap('sha256(bytea)') $$;
CREATE FUNCTION regress_hostile.convert_to(pg_catalog.text, pg_catalog.name) RETURNS pg_catalog.bytea
    LANGUAGE sql AS $$ SELECT NULL::pg_catalog.bytea WHERE regress_hostile.trap('convert_to(text, name)') $$;
CREATE FUNCTION regress_hostile.octet_length(pg_catalog.text) RETURNS pg_catalog.int4
    LANGUAGE sql AS $$ SELECT NULL::pg_catalog.int4 WHERE regress_hostile.trap('octet_length(text)') $$;
CREATE FUNCTION regress_hostile.length(pg_catalog.text) RETURNS pg_catalog.int4
    LANGUAGE sql AS $$ SELECT NULL::pg_catalog.int4 WHERE regress_hostile.trap('length(text)') $$;
CREATE FUNCTION regress_hostile.pg_column_size(pg_catalog.jsonb) RETURNS pg_catalog.int4
    LANGUAGE sql AS $$ SELECT NULL::pg_catalog.int4 WHERE regress_hostile.trap('pg_column_size(jsonb)') $$;
CREATE FUNCTION regress_hostile.hashtext(pg_catalog.text) RETURNS pg_catalog.int4
    LANGUAGE sql AS $$ SELECT NULL::pg_catalog.int4 WHERE regress_hostile.trap('hashtext(text)') $$;
CREATE FUNCTION regress_hostile.pg_advisory_xact_lock(pg_catalog.int8) RETURNS void
    LANGUAGE plpgsql AS $$ BEGIN PERFORM regress_hostile.trap('pg_advisory_xact_lock(int8)'); END $$;
CREATE FUNCTION regress_hostile.pg_advisory_xact_lock(pg_catalog.int4, pg_catalog.int4) RETURNS void
    LANGUAGE plpgsql AS $$ BEGIN PERFORM regress_hostile.trap('pg_advisory_xact_lock(int4, int4)'); END $$;
CREATE FUNCTION regress_hostile.pg_try_advisory_xact_lock(pg_catalog.int8) RETURNS pg_catalog.bool
    LANGUAGE sql AS $$ SELECT regress_hostile.trap('pg_try_advisory_xact_lock(int8)') $$;
CREATE FUNCTION regress_hostile.ensure_partitions(pg_catalog.timestamptz) RETURNS pg_catalog.int4
    LANGUAGE sql AS $$ SELECT NULL::pg_catalog.int4 WHERE regress_hostile.trap('ensure_partitions(timestamptz)') $$;
CREATE FUNCTION regress_hostile.idem_request_hash(pg_catalog.jsonb) RETURNS pg_catalog.bytea
    LANGUAGE sql AS $$ SELECT NULL::pg_catalog.bytea WHERE regress_hostile.trap('idem_request_hash(jsonb)') $$;

-- operators: the comparisons the extension needs, for every type it compares
CREATE FUNCTION regress_hostile.text_op(pg_catalog.text, pg_catalog.text) RETURNS pg_catalog.bool
    LANGUAGE sql AS $$ SELECT regress_hostile.trap('operator on text') $$;
CREATE FUNCTION regress_hostile.bytea_op(pg_catalog.bytea, pg_catalog.bytea) RETURNS pg_catalog.bool
    LANGUAGE sql AS $$ SELECT regress_hostile.trap('operator on bytea') $$;
CREATE FUNCTION regress_hostile.int4_op(pg_catalog.int4, pg_catalog.int4) RETURNS pg_catalog.bool
    LANGUAGE sql AS $$ SELECT regress_hostile.trap('operator on int4') $$;
CREATE FUNCTION regress_hostile.tstz_op(pg_catalog.timestamptz, pg_catalog.timestamptz) RETURNS pg_catalog.bool
    LANGUAGE sql AS $$ SELECT regress_hostile.trap('operator on timestamptz') $$;
CREATE FUNCTION regress_hostile.tstz_plus(pg_catalog.timestamptz, pg_catalog.interval) RETURNS pg_catalog.timestamptz
    LANGUAGE sql AS $$ SELECT NULL::pg_catalog.timestamptz WHERE regress_hostile.trap('timestamptz + interval') $$;
CREATE FUNCTION regress_hostile.interval_op(pg_catalog.interval, pg_catalog.interval) RETURNS pg_catalog.bool
    LANGUAGE sql AS $$ SELECT regress_hostile.trap('operator on interval') $$;
CREATE FUNCTION regress_hostile.text_concat(pg_catalog.text, pg_catalog.text) RETURNS pg_catalog.text
    LANGUAGE sql AS $$ SELECT NULL::pg_catalog.text WHERE regress_hostile.trap('text || text') $$;

CREATE OPERATOR regress_hostile.=  (LEFTARG = pg_catalog.text, RIGHTARG = pg_catalog.text, FUNCTION = regress_hostile.text_op);
CREATE OPERATOR regress_hostile.<> (LEFTARG = pg_catalog.text, RIGHTARG = pg_catalog.text, FUNCTION = regress_hostile.text_op);
CREATE OPERATOR regress_hostile.|| (LEFTARG = pg_catalog.text, RIGHTARG = pg_catalog.text, FUNCTION = regress_hostile.text_concat);
CREATE OPERATOR regress_hostile.=  (LEFTARG = pg_catalog.bytea, RIGHTARG = pg_catalog.bytea, FUNCTION = regress_hostile.bytea_op);
CREATE OPERATOR regress_hostile.<> (LEFTARG = pg_catalog.bytea, RIGHTARG = pg_catalog.bytea, FUNCTION = regress_hostile.bytea_op);
CREATE OPERATOR regress_hostile.=  (LEFTARG = pg_catalog.int4, RIGHTARG = pg_catalog.int4, FUNCTION = regress_hostile.int4_op);
CREATE OPERATOR regress_hostile.<> (LEFTARG = pg_catalog.int4, RIGHTARG = pg_catalog.int4, FUNCTION = regress_hostile.int4_op);
CREATE OPERATOR regress_hostile.=  (LEFTARG = pg_catalog.timestamptz, RIGHTARG = pg_catalog.timestamptz, FUNCTION = regress_hostile.tstz_op);
CREATE OPERATOR regress_hostile.<  (LEFTARG = pg_catalog.timestamptz, RIGHTARG = pg_catalog.timestamptz, FUNCTION = regress_hostile.tstz_op);
CREATE OPERATOR regress_hostile.<= (LEFTARG = pg_catalog.timestamptz, RIGHTARG = pg_catalog.timestamptz, FUNCTION = regress_hostile.tstz_op);
CREATE OPERATOR regress_hostile.>  (LEFTARG = pg_catalog.timestamptz, RIGHTARG = pg_catalog.timestamptz, FUNCTION = regress_hostile.tstz_op);
CREATE OPERATOR regress_hostile.>= (LEFTARG = pg_catalog.timestamptz, RIGHTARG = pg_catalog.timestamptz, FUNCTION = regress_hostile.tstz_op);
CREATE OPERATOR regress_hostile.+  (LEFTARG = pg_catalog.timestamptz, RIGHTARG = pg_catalog.interval, FUNCTION = regress_hostile.tstz_plus);
CREATE OPERATOR regress_hostile.>  (LEFTARG = pg_catalog.interval, RIGHTARG = pg_catalog.interval, FUNCTION = regress_hostile.interval_op);
CREATE OPERATOR regress_hostile.<= (LEFTARG = pg_catalog.interval, RIGHTARG = pg_catalog.interval, FUNCTION = regress_hostile.interval_op);

-- types: a domain named like each built-in type the extension uses
CREATE DOMAIN regress_hostile.text AS pg_catalog.text CHECK (regress_hostile.trap('type text'));
CREATE DOMAIN regress_hostile.jsonb AS pg_catalog.jsonb CHECK (regress_hostile.trap('type jsonb'));
CREATE DOMAIN regress_hostile.bytea AS pg_catalog.bytea CHECK (regress_hostile.trap('type bytea'));
CREATE DOMAIN regress_hostile.timestamptz AS pg_catalog.timestamptz CHECK (regress_hostile.trap('type timestamptz'));
CREATE DOMAIN regress_hostile.int4 AS pg_catalog.int4 CHECK (regress_hostile.trap('type int4'));
CREATE DOMAIN regress_hostile.int8 AS pg_catalog.int8 CHECK (regress_hostile.trap('type int8'));
CREATE DOMAIN regress_hostile.bool AS pg_catalog.bool CHECK (regress_hostile.trap('type bool'));
CREATE DOMAIN regress_hostile.name AS pg_catalog.name CHECK (regress_hostile.trap('type name'));
CREATE DOMAIN regress_hostile.regclass AS pg_catalog.regclass CHECK (regress_hostile.trap('type regclass'));

-- a table named like the extension's
CREATE TABLE regress_hostile.records (LIKE idempotency.records);

-- From here on, the hostile schema comes first, even before pg_catalog.
-- Everything below is written to work under it (pg_catalog-qualified).
SET search_path = regress_hostile, pg_catalog, public;
SET idempotency.wait_timeout = '100ms';

SELECT outcome, response_status, response_body, attempt,
       expires_at OPERATOR(pg_catalog.>) pg_catalog.now() AS expires_later
  FROM idempotency.idem_acquire('h-1', '{"amount": 100}');
SELECT outcome, attempt
  FROM idempotency.idem_acquire('h-1', '{"amount": 999}', scope => 'other');	-- other scope
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('h-1', '{"amount": 100}');	-- in_progress
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('h-1', '{"amount": 200}');	-- mismatch
SELECT idempotency.idem_complete('h-1', 201, '{"id": 1}');
SELECT idempotency.idem_complete('h-1', 201, '{"id": 1}');
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('h-1', '{ "amount" : 100 }');	-- replay
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('h-1', '{"amount": 200}');	-- mismatch
SELECT outcome, response_status, response_body
  FROM idempotency.idem_acquire('h-1');				-- replay
SELECT status, response_status, response_body, attempt,
       request_hash OPERATOR(pg_catalog.=) public.digest('{"amount": 100}', 'sha256') AS hash_ok,
       completed_at IS NOT NULL AS has_completed_at
  FROM idempotency.idem_lookup('h-1');
SELECT status, attempt FROM idempotency.idem_lookup('h-1', 'other');
SELECT * FROM idempotency.idem_lookup('h-none');
\set VERBOSITY sqlstate
SELECT idempotency.idem_complete('h-none', 200);		-- P0002
SELECT * FROM idempotency.idem_acquire('h-2', ttl => '0');	-- 22023
SELECT * FROM idempotency.idem_acquire('', '{}');		-- 22023
SELECT idempotency.idem_complete('h-1', 99);			-- 22023
\set VERBOSITY default
-- lease, takeover and the attempt check
SELECT outcome, attempt FROM idempotency.idem_acquire('h-3', lease => '1 second');
SELECT outcome, attempt FROM idempotency.idem_acquire('h-4', ttl => '1 second');
SELECT pg_catalog.pg_sleep(1.1);
SELECT outcome, attempt FROM idempotency.idem_acquire('h-3');	-- acquired, 2
\set VERBOSITY sqlstate
SELECT idempotency.idem_complete('h-3', 200, attempt => 1);	-- 55000
\set VERBOSITY default
SELECT idempotency.idem_release('h-3', attempt => 2);
SELECT idempotency.idem_release('h-3');
SELECT outcome, attempt FROM idempotency.idem_acquire('h-3');	-- acquired, 1
-- ttl expiry
SELECT * FROM idempotency.idem_lookup('h-4');
SELECT outcome, attempt FROM idempotency.idem_acquire('h-4', '{"x": 1}');
-- hash and the response size check
SELECT pg_catalog.encode(idempotency.idem_request_hash('{}'), 'hex') AS sha256_of_braces;
SET idempotency.max_response_bytes = 100;
SELECT public.sqlstate_of($$SELECT idempotency.idem_complete('h-4', 200, pg_catalog.jsonb_build_object('pad', pg_catalog.repeat('x', 200)))$$) AS over_100b;
SELECT idempotency.idem_complete('h-4', 200, '{"small": true}');
-- inside a transaction
BEGIN;
SELECT outcome, attempt FROM idempotency.idem_acquire('h-5', '{"a": 1}');
SELECT outcome FROM idempotency.idem_acquire('h-5', '{"a": 1}');
SELECT idempotency.idem_complete('h-5', 200);
ROLLBACK;
SELECT * FROM idempotency.idem_lookup('h-5');

-- The hostile objects were never called, and the extension's own table got
-- the records, not the look-alike.
RESET search_path;
SELECT count(*) AS hostile_records FROM regress_hostile.records;
SELECT key, scope, status, attempt, response_status
  FROM idempotency.records
 WHERE key LIKE 'h-%' AND expires_at > now()
 ORDER BY key, scope;
SET client_min_messages = warning;
DROP SCHEMA regress_hostile CASCADE;
RESET client_min_messages;
