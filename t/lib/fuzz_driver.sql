--
-- The driver of t/006_fuzz.pl: runs every case of fuzz_cases (the corpus of
-- t/lib/IdemFuzz.pm) and writes each departure from the contract into
-- fuzz_fail (case id, step, what the call gave, what the contract says).
--
-- Every case runs in a subtransaction that is rolled back at its end (by
-- raising XF999), so each starts from the same empty state and the key
-- locks it took are let go.  Each call catches its own SQLSTATE.
--

-- ('ok' or the SQLSTATE of a statement: public.sqlstate_of, of
-- sql/include/sqlstate_of.sql, which t/006_fuzz.pl runs first)

-- a fingerprint of every stored record, every column included
CREATE FUNCTION public.fz_fp() RETURNS text LANGUAGE sql AS $$
    SELECT count(*) || '/' || coalesce(md5(string_agg(r::text, '|' ORDER BY r::text)), '')
      FROM idempotency.records r
$$;

-- append a failure unless got is want (fz_chk) or one of want's |-list (fz_chk_in)
CREATE FUNCTION public.fz_chk(fails jsonb, step text, got text, want text) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN got IS NOT DISTINCT FROM want THEN fails
                ELSE fails || jsonb_build_array(jsonb_build_object('step', step, 'got', got, 'want', want)) END
$$;
CREATE FUNCTION public.fz_chk_in(fails jsonb, step text, got text, want text) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN got = ANY (string_to_array(want, '|')) THEN fails
                ELSE fails || jsonb_build_array(jsonb_build_object('step', step, 'got', got, 'want', want)) END
$$;

-- microseconds between two timestamps, within 1 ms of the expected value
CREATE FUNCTION public.fz_us_near(t1 timestamptz, t0 timestamptz, us bigint) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT abs(extract(epoch FROM t1 - t0) * 1000000 - us) <= 1000
$$;

CREATE PROCEDURE fuzz_run(max_bytes int) LANGUAGE plpgsql AS $$
DECLARE
    c fuzz_cases;
    req jsonb;
    ttl interval;
    lease interval;
    body jsonb;
    alt jsonb;
    reply jsonb;
    exp_hash bytea;
    st text;
    want text;
    got text;
    setup_state text;
    fp text;
    a record;
    l record;
    n int;
    fails jsonb;
    n_cases int := 0;
    n_calls bigint := 0;
    n_input int := 0;
    n_chains int := 0;
BEGIN
    FOR c IN SELECT * FROM fuzz_cases ORDER BY id LOOP
        n_cases := n_cases + 1;
        fails := '[]';

        -- input side: make the values into the arguments' types
        BEGIN
            req := c.request::jsonb;
            ttl := c.ttl::interval;
            lease := c.lease::interval;
            body := c.body::jsonb;
            st := 'ok';
        EXCEPTION WHEN OTHERS THEN
            st := 'input:' || SQLSTATE;
        END;

        IF st <> 'ok' OR c.expected LIKE 'input:%' THEN
            n_input := n_input + 1;
            fails := fz_chk(fails, 'input side', st, c.expected);
        ELSE
            want := c.expected;
            IF want LIKE 'SIZE:%' THEN
                want := CASE WHEN pg_column_size(body) > max_bytes THEN '54000' ELSE substr(want, 6) END;
            END IF;

            BEGIN   -- the case, rolled back at its end
                setup_state := NULL;
                IF c.setup THEN
                    BEGIN
                        SELECT * INTO a FROM idempotency.idem_acquire(c.key, NULL, c.scope);
                        setup_state := 'ok';
                        fails := fz_chk(fails, 'setup acquire', a.outcome || '|' || a.attempt, 'acquired|1');
                    EXCEPTION WHEN OTHERS THEN
                        setup_state := SQLSTATE;
                    END;
                    n_calls := n_calls + 1;
                END IF;
                fp := fz_fp();

                IF c.fn = 'acquire' THEN
                    BEGIN
                        SELECT * INTO a FROM idempotency.idem_acquire(c.key, req, c.scope, ttl, lease);
                        got := 'ok';
                    EXCEPTION WHEN OTHERS THEN
                        got := SQLSTATE;
                    END;
                    n_calls := n_calls + 1;
                    fails := fz_chk_in(fails, 'acquire', got, want);
                    IF got <> 'ok' THEN
                        fails := fz_chk(fails, 'failed acquire leaves no trace', fz_fp(), fp);
                    ELSIF want = 'ok' THEN
                        n_chains := n_chains + 1;
                        fails := fz_chk(fails, 'acquire answer',
                                        concat_ws('|', a.outcome, a.attempt, a.response_status, a.response_body),
                                        'acquired|1');
                        exp_hash := sha256(convert_to(req::text, 'UTF8'));   -- NULL for a NULL request
                        alt := CASE WHEN req IS NULL THEN '{"other": true}' ELSE jsonb_build_array(req) END;
                        IF c.ttl_us >= 5000000 THEN
                            -- the record as claimed
                            SELECT * INTO l FROM idempotency.idem_lookup(c.key, c.scope);
                            n_calls := n_calls + 1;
                            fails := fz_chk(fails, 'lookup after acquire',
                                concat_ws('|', l.status, l.attempt, l.request_hash IS NOT DISTINCT FROM exp_hash,
                                          l.response_status, l.response_body, l.completed_at,
                                          l.expires_at = a.expires_at,
                                          fz_us_near(l.expires_at, l.created_at, c.ttl_us),
                                          fz_us_near(l.locked_until, l.created_at, c.lease_us)),
                                'processing|1|t|t|t|t');
                            IF c.lease_us >= 5000000 THEN
                                -- a duplicate: in_progress (wait_timeout 0), canonical JSON
                                SELECT * INTO a FROM idempotency.idem_acquire(c.key, req::text::jsonb, c.scope);
                                fails := fz_chk(fails, 'duplicate acquire',
                                    concat_ws('|', a.outcome, a.response_status, a.response_body), 'in_progress');
                                SELECT * INTO a FROM idempotency.idem_acquire(c.key, alt, c.scope);
                                fails := fz_chk(fails, 'acquire with another request',
                                    a.outcome, CASE WHEN req IS NULL THEN 'in_progress' ELSE 'mismatch' END);
                                SELECT * INTO a FROM idempotency.idem_acquire(c.key, NULL, c.scope);
                                fails := fz_chk(fails, 'acquire with no request', a.outcome, 'in_progress');
                                n_calls := n_calls + 3;
                            END IF;
                            -- complete, with the request as the body where it fits
                            reply := CASE WHEN pg_column_size(req) <= max_bytes THEN req END;
                            BEGIN
                                got := idempotency.idem_complete(c.key, 201, reply, c.scope)::text;
                            EXCEPTION WHEN OTHERS THEN
                                got := SQLSTATE;
                            END;
                            fails := fz_chk(fails, 'complete after acquire', got, 'true');
                            SELECT * INTO a FROM idempotency.idem_acquire(c.key, req, c.scope);
                            fails := fz_chk(fails, 'replay',
                                concat_ws('|', a.outcome, a.attempt, a.response_status,
                                          a.response_body IS NOT DISTINCT FROM reply), 'replay|1|201|t');
                            SELECT * INTO a FROM idempotency.idem_acquire(c.key, alt, c.scope);
                            fails := fz_chk(fails, 'completed, another request',
                                a.outcome, CASE WHEN req IS NULL THEN 'replay' ELSE 'mismatch' END);
                            SELECT * INTO a FROM idempotency.idem_acquire(c.key, NULL, c.scope);
                            fails := fz_chk(fails, 'completed, no request', a.outcome, 'replay');
                            fails := fz_chk(fails, 'release of a completed record',
                                idempotency.idem_release(c.key, c.scope)::text, 'false');
                            fails := fz_chk(fails, 'second complete',
                                idempotency.idem_complete(c.key, 500, NULL, c.scope)::text, 'false');
                            SELECT * INTO l FROM idempotency.idem_lookup(c.key, c.scope);
                            fails := fz_chk(fails, 'lookup after complete',
                                concat_ws('|', l.status, l.response_status, l.response_body IS NOT DISTINCT FROM reply,
                                          l.completed_at IS NOT NULL, l.request_hash IS NOT DISTINCT FROM exp_hash),
                                'completed|201|t|t|t');
                            n_calls := n_calls + 7;
                        ELSIF c.ttl_us <= 1000 THEN
                            -- expired once the ttl has passed: it does not exist, and
                            -- a new claim is attempt 1
                            PERFORM pg_sleep(c.ttl_us / 1000000.0 + 0.001);
                            SELECT count(*) INTO n FROM idempotency.idem_lookup(c.key, c.scope);
                            fails := fz_chk(fails, 'lookup of an expired claim', n::text, '0');
                            SELECT * INTO a FROM idempotency.idem_acquire(c.key, req, c.scope, ttl, lease);
                            fails := fz_chk(fails, 'acquire over an expired claim',
                                a.outcome || '|' || a.attempt, 'acquired|1');
                            n_calls := n_calls + 2;
                        END IF;
                    END IF;

                ELSIF c.fn = 'complete' THEN
                    BEGIN
                        got := idempotency.idem_complete(c.key, c.status, body, c.scope, c.attempt)::text;
                    EXCEPTION WHEN OTHERS THEN
                        got := SQLSTATE;
                    END;
                    n_calls := n_calls + 1;
                    fails := fz_chk_in(fails, 'complete', got, want);
                    IF got <> 'true' THEN
                        fails := fz_chk(fails, 'failed complete leaves the records as they were', fz_fp(), fp);
                    ELSE
                        n_chains := n_chains + 1;
                        SELECT * INTO l FROM idempotency.idem_lookup(c.key, c.scope);
                        fails := fz_chk(fails, 'lookup after complete',
                            concat_ws('|', l.status, l.attempt, l.response_status = c.status,
                                      l.response_body IS NOT DISTINCT FROM body, l.completed_at IS NOT NULL),
                            'completed|1|t|t|t');
                        SELECT * INTO a FROM idempotency.idem_acquire(c.key, NULL, c.scope);
                        fails := fz_chk(fails, 'replay after complete',
                            concat_ws('|', a.outcome, a.response_status = c.status,
                                      a.response_body IS NOT DISTINCT FROM body),
                            'replay|t|t');
                        fails := fz_chk(fails, 'the same complete again',
                            idempotency.idem_complete(c.key, c.status, body, c.scope, c.attempt)::text, 'false');
                        n_calls := n_calls + 3;
                    END IF;

                ELSIF c.fn = 'release' THEN
                    BEGIN
                        got := idempotency.idem_release(c.key, c.scope, c.attempt)::text;
                    EXCEPTION WHEN OTHERS THEN
                        got := SQLSTATE;
                    END;
                    n_calls := n_calls + 1;
                    fails := fz_chk_in(fails, 'release', got, want);
                    IF got <> 'true' THEN
                        fails := fz_chk(fails, 'release that removed nothing leaves the records as they were', fz_fp(), fp);
                    ELSE
                        n_chains := n_chains + 1;
                        SELECT count(*) INTO n FROM idempotency.idem_lookup(c.key, c.scope);
                        fails := fz_chk(fails, 'lookup after release', n::text, '0');
                        SELECT * INTO a FROM idempotency.idem_acquire(c.key, NULL, c.scope);
                        fails := fz_chk(fails, 'acquire after release', a.outcome || '|' || a.attempt, 'acquired|1');
                        n_calls := n_calls + 2;
                    END IF;

                ELSIF c.fn = 'lookup' THEN
                    BEGIN
                        SELECT count(*), max(status) INTO n, st FROM idempotency.idem_lookup(c.key, c.scope);
                        got := 'ok';
                    EXCEPTION WHEN OTHERS THEN
                        got := SQLSTATE;
                    END;
                    n_calls := n_calls + 1;
                    fails := fz_chk_in(fails, 'lookup', got, want);
                    IF got = 'ok' THEN
                        n_chains := n_chains + 1;
                        fails := fz_chk(fails, 'lookup rows',
                            n || '|' || coalesce(st, ''),
                            CASE WHEN setup_state = 'ok' THEN '1|processing' ELSE '0|' END);
                    END IF;
                    fails := fz_chk(fails, 'lookup writes nothing', fz_fp(), fp);

                ELSIF c.fn = 'hash' THEN
                    BEGIN
                        got := encode(idempotency.idem_request_hash(req), 'hex');
                        got := CASE WHEN got IS NOT DISTINCT FROM encode(sha256(convert_to(req::text, 'UTF8')), 'hex')
                                    THEN 'ok' ELSE 'wrong hash ' || coalesce(got, 'NULL') END;
                    EXCEPTION WHEN OTHERS THEN
                        got := SQLSTATE;
                    END;
                    n_calls := n_calls + 1;
                    fails := fz_chk_in(fails, 'hash', got, want);
                END IF;

                RAISE SQLSTATE 'XF999';
            EXCEPTION
                WHEN SQLSTATE 'XF999' THEN
                    NULL;
                WHEN OTHERS THEN
                    fails := fz_chk(fails, 'unexpected error in the case''s checks', SQLSTATE || ': ' || SQLERRM, NULL);
            END;
        END IF;

        INSERT INTO fuzz_fail
        SELECT c.id, f->>'step', f->>'got', f->>'want' FROM jsonb_array_elements(fails) f;
        IF n_cases % 100 = 0 THEN
            COMMIT;
        END IF;
    END LOOP;
    INSERT INTO fuzz_stats VALUES (n_cases, n_calls, n_input, n_chains);
    COMMIT;
END
$$;

--
-- fuzz_memory(batches, per_batch): batches * per_batch calls, ten per round
-- over every function, outcome and error path, committing after each batch
-- and then noting the backend's memory.
--
CREATE TABLE fuzz_mem (calls bigint, contexts_bytes bigint, rss_anon_kb bigint, vm_rss_kb bigint);

CREATE PROCEDURE fuzz_memory(batches int, per_batch int) LANGUAGE plpgsql AS $$
DECLARE
    n bigint := 0;
    i int := 0;
    k text;
    s text;
    req jsonb;
    status text;
BEGIN
    FOR b IN 1 .. batches LOOP
        WHILE n < b::bigint * per_batch LOOP
            i := i + 1;
            k := 'mem-' || i || '-' || repeat('é', i % 40);
            s := 'scope-' || (i % 7);
            req := jsonb_build_object('n', i, 'pad', repeat('x', i % 300), 'list', jsonb_build_array(i, 'a', NULL));
            PERFORM idempotency.idem_acquire(k, req, s, '1 hour', '5 minutes');            -- acquired
            PERFORM idempotency.idem_lookup(k, s);
            PERFORM idempotency.idem_complete(k, 200 + i % 300, req || '{"id": 1}', s, 1);  -- true
            PERFORM idempotency.idem_acquire(k, req, s);                                     -- replay
            PERFORM idempotency.idem_acquire(k, '{"other": 1}', s);                          -- mismatch
            PERFORM idempotency.idem_request_hash(req);
            PERFORM idempotency.idem_acquire(k || '-r', NULL, s, '1 hour', '1 minute');      -- acquired
            PERFORM idempotency.idem_release(k || '-r', s);                                  -- true
            BEGIN
                PERFORM idempotency.idem_acquire('', req);                                   -- 22023
            EXCEPTION WHEN invalid_parameter_value THEN
                NULL;
            END;
            BEGIN
                IF i % 2 = 0 THEN
                    PERFORM idempotency.idem_complete(k || '-none', 200);                     -- P0002
                ELSE
                    PERFORM idempotency.idem_complete(k, 200, NULL, s, 2);                    -- 55000
                END IF;
            EXCEPTION WHEN no_data_found OR object_not_in_prerequisite_state THEN
                NULL;
            END;
            n := n + 10;
        END LOOP;
        COMMIT;
        status := pg_read_file('/proc/self/status');
        INSERT INTO fuzz_mem
        SELECT n, (SELECT sum(total_bytes) FROM pg_backend_memory_contexts),
               (regexp_match(status, 'RssAnon:\s+(\d+)'))[1]::bigint,
               (regexp_match(status, 'VmRSS:\s+(\d+)'))[1]::bigint;
        COMMIT;
    END LOOP;
END
$$;
