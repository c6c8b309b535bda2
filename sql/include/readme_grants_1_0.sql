-- sql/include/readme_grants_1_0.sql: the grants README.md gave an
-- application role at release 1.0 (before idem_extend, claims and
-- session-bound claims), to the role named by the psql variable app_role.
-- Included by the upgrade tests (sql/15_upgrade.sql, t/012_upgrade.pl).
GRANT USAGE ON SCHEMA idempotency TO :"app_role";
GRANT EXECUTE ON FUNCTION
    idempotency.idem_acquire(text, jsonb, text, interval, interval),
    idempotency.idem_complete(text, int, jsonb, text, int),
    idempotency.idem_release(text, text, int),
    idempotency.idem_lookup(text, text),
    idempotency.idem_request_hash(jsonb)
    TO :"app_role";
GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency.records TO :"app_role";
