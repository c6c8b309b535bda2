-- demo/lease_complete.sql: idem_complete for one attempt of the claim, with
-- the error caught as the application would catch it.
-- psql variables: key, attempt.
-- Prints: ok: true|false or SQLSTATE xxxxx: message

SELECT try_sql(format(
    'SELECT idempotency.idem_complete(%L, 201, %L::jsonb, attempt => %s)',
    :'key', '{"transfer": "done", "by_attempt": ' || :attempt || '}', :attempt));
