--
-- 04_lookup_hash: idem_lookup (no row, processing, completed; never
-- writes) and idem_request_hash (equal to pgcrypto's digest and to sha256).
--

-- no live record: no row
SELECT * FROM idempotency.idem_lookup('l-none');
SELECT * FROM idempotency.idem_lookup('l-none', 'some scope');

-- processing
SELECT outcome, attempt
  FROM idempotency.idem_acquire('l-1', '{"a": 1}', scope => 'lookups',
                                ttl => '1 hour', lease => '10 minutes');
SELECT created_at AS l1_created_at, expires_at AS l1_expires_at
  FROM idempotency.idem_lookup('l-1', 'lookups') \gset
SELECT status,
       request_hash = idempotency.idem_request_hash('{"a": 1}') AS hash_ok,
       response_status, response_body, attempt,
       created_at BETWEEN now() - interval '1 minute' AND now() AS created_ok,
       locked_until - created_at BETWEEN interval '9 minutes 59 seconds'
                                     AND interval '10 minutes 1 second' AS lease_10min,
       completed_at,
       expires_at - created_at BETWEEN interval '59 minutes 59 seconds'
                                   AND interval '1 hour 1 second' AS ttl_1h
  FROM idempotency.idem_lookup('l-1', 'lookups');
-- other scope, other key: no row
SELECT pg_catalog.count(*) FROM idempotency.idem_lookup('l-1');
SELECT pg_catalog.count(*) FROM idempotency.idem_lookup('l-2', 'lookups');

-- completed
SELECT idempotency.idem_complete('l-1', 201, '{"id": 42, "tags": ["a", "b"]}', scope => 'lookups');
SELECT status,
       request_hash = idempotency.idem_request_hash('{"a": 1}') AS hash_ok,
       response_status, response_body, attempt,
       created_at = :'l1_created_at'::timestamptz AS same_created_at,
       completed_at BETWEEN created_at AND now() AS completed_ok,
       expires_at = :'l1_expires_at'::timestamptz AS same_expires_at
  FROM idempotency.idem_lookup('l-1', 'lookups');

-- inside the claiming transaction the claim is visible; after a rollback not
BEGIN;
SELECT outcome FROM idempotency.idem_acquire('l-3');
SELECT status, attempt, request_hash IS NULL AS no_hash FROM idempotency.idem_lookup('l-3');
ROLLBACK;
SELECT pg_catalog.count(*) FROM idempotency.idem_lookup('l-3');

-- lookup never writes: it works in a read-only transaction and changes nothing
SELECT public.records_fingerprint() AS before_lookups \gset
BEGIN READ ONLY;
SELECT status FROM idempotency.idem_lookup('l-1', 'lookups');
SELECT pg_catalog.count(*) FROM idempotency.idem_lookup('l-none');
COMMIT;
SELECT public.records_fingerprint() = :'before_lookups' AS nothing_written;

-- idem_request_hash: SHA-256 of the UTF-8 text of request::text
SELECT encode(idempotency.idem_request_hash('{}'), 'hex') AS sha256_of_braces;
SELECT encode(idempotency.idem_request_hash('{"b": 1, "a": [true, null]}'), 'hex') AS hex;
SELECT pg_catalog.left(r::text, 50) AS request, pg_catalog.octet_length(r::text) AS text_bytes,
       pg_catalog.length(idempotency.idem_request_hash(r)) AS bytes,
       idempotency.idem_request_hash(r) = digest(r::text, 'sha256') AS eq_pgcrypto,
       idempotency.idem_request_hash(r) = sha256(convert_to(r::text, 'UTF8')) AS eq_sha256
  FROM (VALUES ('{"amount": 100, "currency": "EUR"}'::jsonb),
               ('{"b": 2, "a": 1}'),
               ('[1, 2, 3]'),
               ('"just a string"'),
               ('123.4500'),
               ('true'),
               ('null'),
               ('{}'),
               ('{"nested": {"z": [1, {"y": null}], "a": "quote\" backslash\\ tab\t"}}'),
               (jsonb_build_object('long', repeat('x', 100000)))) AS t(r);
-- idem_request_hash against the server's sha256(), for canonical
-- texts of every length from 2 to 300 bytes (one, two and more blocks, and
-- each side of the 55/56-byte padding boundary), with varied bytes
SELECT pg_catalog.count(*) AS texts,
       pg_catalog.min(pg_catalog.octet_length(r::text)) AS shortest,
       pg_catalog.max(pg_catalog.octet_length(r::text)) AS longest,
       pg_catalog.count(*) FILTER (WHERE idempotency.idem_request_hash(r)
                                   <> sha256(convert_to(r::text, 'UTF8'))) AS differ
  FROM (SELECT pg_catalog.to_jsonb(pg_catalog.string_agg(pg_catalog.chr(33 + (n * 7 + i * 13) % 90), ''
                                                         ORDER BY i)) AS r
          FROM pg_catalog.generate_series(0, 298) n,
               LATERAL pg_catalog.generate_series(1, n) i
         GROUP BY n
        UNION ALL SELECT '""'::jsonb) t;
-- key order and white space give the same hash
SELECT idempotency.idem_request_hash('{"b":2,"a":1}') = idempotency.idem_request_hash(E'{ "a" : 1,\n "b" : 2 }') AS same;
-- STRICT: NULL in, NULL out
SELECT idempotency.idem_request_hash(NULL) IS NULL AS null_hash;
-- non-ASCII text is hashed as UTF-8 (checked where the database is UTF8)
DO $$
DECLARE
    ok boolean;
BEGIN
    IF pg_catalog.current_setting('server_encoding') = 'UTF8' THEN
        EXECUTE $q$SELECT idempotency.idem_request_hash(r) = public.digest(r::text, 'sha256')
                      AND idempotency.idem_request_hash(r) = pg_catalog.sha256(pg_catalog.convert_to(r::text, 'UTF8'))
                     FROM (SELECT '{"name": "Zo\u00eb", "city": "\u6771\u4eac", "emoji": "\ud83d\ude00"}'::jsonb AS r) s$q$
           INTO ok;
        IF NOT ok THEN
            RAISE EXCEPTION 'idem_request_hash differs from SHA-256 of the UTF-8 text for non-ASCII input';
        END IF;
    END IF;
END
$$;
-- the stored request_hash is idem_request_hash(request)
SELECT request_hash = digest('{"a": 1}', 'sha256') AS stored_hash_ok
  FROM idempotency.idem_lookup('l-1', 'lookups');
