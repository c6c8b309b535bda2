-- sql/include/readme_grants_1_1.sql: the grants docs/reference.md gave an
-- application role at 1.1, here to the role named by the psql variable
-- app_role, for the tests of databases at 1.1 (sql/15_upgrade.sql,
-- t/012_upgrade.pl, t/019_fresh_vs_updated.pl, t/024_upgrade_1_2.pl).
GRANT USAGE ON SCHEMA idempotency TO :"app_role";
GRANT EXECUTE ON FUNCTION
    idempotency.idem_acquire(text, jsonb, text, interval, interval, boolean),
    idempotency.idem_complete(text, int, jsonb, text, int, uuid),
    idempotency.idem_release(text, text, int, uuid),
    idempotency.idem_extend(text, text, uuid, interval),
    idempotency.idem_lookup(text, text),
    idempotency.idem_request_hash(jsonb)
    TO :"app_role";
GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency.records TO :"app_role";
