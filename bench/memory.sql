-- bench/memory.sql -- a backend's memory after 1,000 and after :calls
-- idem_acquire + idem_complete calls (each pair its own transaction), in one
-- session.  Measured between statements: the sum of total_bytes of
-- pg_backend_memory_contexts, and the backend's RssAnon (private memory) and
-- VmRSS (which also counts the shared buffers it has touched) from
-- /proc/self/status.  Prints tab-separated: label, calls, context bytes,
-- RssAnon kB, VmRSS kB.
\set ON_ERROR_STOP 1
\pset format unaligned
\pset fieldsep '\t'
\pset tuples_only on

CREATE TEMP VIEW mem AS
SELECT (SELECT sum(total_bytes) FROM pg_backend_memory_contexts) AS ctx_bytes,
       (regexp_match(pg_read_file('/proc/self/status'), 'RssAnon:\s+(\d+)'))[1]::bigint AS rss_anon_kb,
       (regexp_match(pg_read_file('/proc/self/status'), 'VmRSS:\s+(\d+)'))[1]::bigint AS vm_rss_kb;

SELECT * FROM mem \g /dev/null

-- calls 1 .. 1000
DO $$
BEGIN
    FOR i IN 1..1000 LOOP
        PERFORM * FROM idempotency.idem_acquire(md5('mem-' || i), '{"amount": 2000}'::jsonb);
        PERFORM idempotency.idem_complete(md5('mem-' || i), 201, '{"payment_id": 7}'::jsonb);
        COMMIT;
    END LOOP;
END
$$;
SELECT 'after', 1000, * FROM mem;

-- calls 1001 .. :calls
SELECT set_config('bench.calls', :'calls', false) \g /dev/null
DO $$
DECLARE
    n bigint := current_setting('bench.calls')::bigint;
BEGIN
    FOR i IN 1001..n LOOP
        PERFORM * FROM idempotency.idem_acquire(md5('mem-' || i), '{"amount": 2000}'::jsonb);
        PERFORM idempotency.idem_complete(md5('mem-' || i), 201, '{"payment_id": 7}'::jsonb);
        COMMIT;
    END LOOP;
END
$$;
SELECT 'after', current_setting('bench.calls'), * FROM mem;
