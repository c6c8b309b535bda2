--
-- 07_gucs: the settings, their defaults, units, who may set them, bad
-- values, and their effect.
--
-- load the library in this session first (nothing is preloaded)
SELECT idempotency.idem_request_hash('{}') IS NOT NULL AS loaded;

-- name, default, unit (a bare number means seconds for ttl and lease,
-- milliseconds for wait_timeout, bytes for max_response_bytes), context
SELECT name, boot_val, unit, context
  FROM pg_settings
 WHERE name IN ('idempotency.default_ttl', 'idempotency.max_ttl',
                'idempotency.default_lease', 'idempotency.wait_timeout',
                'idempotency.max_response_bytes')
 ORDER BY name;
SHOW idempotency.default_ttl;
SHOW idempotency.max_ttl;
SHOW idempotency.default_lease;
SHOW idempotency.wait_timeout;
SHOW idempotency.max_response_bytes;

-- units
SET idempotency.wait_timeout = '1s';
SHOW idempotency.wait_timeout;
SET idempotency.wait_timeout = 250;
SHOW idempotency.wait_timeout;
SET idempotency.wait_timeout = '1.5s';
SHOW idempotency.wait_timeout;
SET idempotency.wait_timeout = 0;
SHOW idempotency.wait_timeout;
SET idempotency.default_ttl = '2h';
SHOW idempotency.default_ttl;
SET idempotency.default_ttl = 90;
SHOW idempotency.default_ttl;
SET idempotency.default_ttl = '1d';
SHOW idempotency.default_ttl;
SET idempotency.default_lease = '30s';
SHOW idempotency.default_lease;
SET idempotency.default_lease = 120;
SHOW idempotency.default_lease;
SET idempotency.max_ttl = '1h';
SHOW idempotency.max_ttl;
SET idempotency.max_ttl = 7200;
SHOW idempotency.max_ttl;
SET idempotency.max_response_bytes = '1kB';
SHOW idempotency.max_response_bytes;
SET idempotency.max_response_bytes = 2048;
SHOW idempotency.max_response_bytes;
SET idempotency.max_response_bytes = 100;
SHOW idempotency.max_response_bytes;
RESET ALL;

-- bad values are refused and leave the setting as it was
\set VERBOSITY sqlstate
SET idempotency.wait_timeout = 'soon';
SET idempotency.wait_timeout = '1kB';
SET idempotency.default_ttl = 'forever';
SET idempotency.default_ttl = '-1h';
SET idempotency.default_ttl = '1MB';
SET idempotency.default_lease = 'x';
SET idempotency.default_lease = -5;
SET idempotency.max_ttl = 'a week';
SET idempotency.max_ttl = '-7d';
SET idempotency.max_response_bytes = 'big';
SET idempotency.max_response_bytes = '1s';
SET idempotency.max_response_bytes = -1;
\set VERBOSITY default
SHOW idempotency.wait_timeout;
SHOW idempotency.default_ttl;
SHOW idempotency.default_lease;
SHOW idempotency.max_ttl;
SHOW idempotency.max_response_bytes;

-- max_ttl and max_response_bytes are superuser-only; the others any user
SET client_min_messages = warning;
DROP ROLE IF EXISTS regress_idem_guc;
RESET client_min_messages;
CREATE ROLE regress_idem_guc;
SET ROLE regress_idem_guc;
\set VERBOSITY sqlstate
SET idempotency.max_ttl = '1h';
SET idempotency.max_response_bytes = '1kB';
SELECT set_config('idempotency.max_ttl', '1h', false);
SELECT set_config('idempotency.max_response_bytes', '1kB', true);
\set VERBOSITY default
SET idempotency.default_ttl = '1h';
SET idempotency.default_lease = '10s';
SET idempotency.wait_timeout = '10ms';
SHOW idempotency.default_ttl;
SHOW idempotency.default_lease;
SHOW idempotency.wait_timeout;
SHOW idempotency.max_ttl;
SHOW idempotency.max_response_bytes;
RESET ROLE;
RESET ALL;
-- and per role, as ALTER ROLE ... SET
ALTER ROLE regress_idem_guc SET idempotency.default_ttl = '2h';
SELECT unnest(setconfig) AS role_setting
  FROM pg_db_role_setting
 WHERE setrole = 'regress_idem_guc'::regrole;
DROP ROLE regress_idem_guc;

-- effects
SET idempotency.default_ttl = '2h';
SELECT outcome,
       expires_at - now() BETWEEN interval '1 hour 59 minutes' AND interval '2 hours 1 minute' AS ttl_2h
  FROM idempotency.idem_acquire('g-1');
SET idempotency.default_lease = '30s';
SELECT outcome FROM idempotency.idem_acquire('g-2');
SELECT locked_until - created_at BETWEEN interval '29 seconds' AND interval '31 seconds' AS lease_30s,
       expires_at - created_at BETWEEN interval '1 hour 59 minutes' AND interval '2 hours 1 minute' AS ttl_2h
  FROM idempotency.idem_lookup('g-2');
-- a NULL lease is default_lease capped at the ttl
SET idempotency.default_lease = '1h';
SELECT outcome FROM idempotency.idem_acquire('g-3', ttl => '10 minutes');
SELECT locked_until <= expires_at AS capped,
       locked_until - created_at BETWEEN interval '9 minutes 59 seconds' AND interval '10 minutes 1 second' AS lease_10min
  FROM idempotency.idem_lookup('g-3');
-- an explicit lease is used as given
SELECT outcome FROM idempotency.idem_acquire('g-4', ttl => '10 minutes', lease => '5 seconds');
SELECT locked_until - created_at BETWEEN interval '4 seconds' AND interval '6 seconds' AS lease_5s
  FROM idempotency.idem_lookup('g-4');
RESET ALL;
-- max_response_bytes
SET idempotency.max_response_bytes = 100;
SELECT outcome FROM idempotency.idem_acquire('g-5');
SELECT public.sqlstate_of($$SELECT idempotency.idem_complete('g-5', 200, jsonb_build_object('pad', repeat('x', 200)))$$) AS over_100b;
SELECT idempotency.idem_complete('g-5', 200, '{"small": 1}');
RESET ALL;
