-- sql/include/readme_grants.sql: the grants docs/reference.md (Privileges) gives an
-- application role, here to the role named by the psql variable app_role.
-- Included by the tests that check them (sql/08_privileges.sql,
-- sql/33_v12_features.sql, t/007_privileges.pl, t/019_fresh_vs_updated.pl,
-- t/020_proxy.pl, t/024_upgrade_1_2.pl); keep it the same as
-- docs/reference.md's block.
GRANT USAGE ON SCHEMA idempotency TO :"app_role";
GRANT EXECUTE ON FUNCTION
    idempotency.idem_acquire(text, jsonb, text, interval, interval, boolean, text),
    idempotency.idem_complete(text, int, jsonb, text, int, uuid, jsonb),
    idempotency.idem_release(text, text, int, uuid),
    idempotency.idem_extend(text, text, uuid, interval),
    idempotency.idem_checkpoint(text, text, uuid, text, jsonb),
    idempotency.idem_lookup(text, text),
    idempotency.idem_request_hash(jsonb)
    TO :"app_role";
GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency.records TO :"app_role";
