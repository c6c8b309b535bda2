-- sql/include/readme_token_grants.sql: the grants docs/reference.md (Privileges)
-- adds for one-time tokens, to the role named by the psql variable app_role
-- (which has those of readme_grants.sql).  Included by t/020_proxy.pl.
GRANT EXECUTE ON FUNCTION
    idempotency.idem_token_issue(text, interval),
    idempotency.idem_token_consume(text, text)
    TO :"app_role";
