-- sql/include/sqlstate_of.sql: the test helper public.sqlstate_of(stmt),
-- which runs a statement and returns 'ok' or the SQLSTATE it raised.  (The
-- statement runs in a subtransaction; anything it wrote before failing is
-- rolled back, so callers also compare the records before and after.)
-- Included by sql/00_setup.sql and sql/15_upgrade.sql; t/005_pgbouncer.pl,
-- t/006_fuzz.pl and t/007_privileges.pl run it too (IdemTest::sql_fixture).
CREATE FUNCTION public.sqlstate_of(stmt text) RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE stmt;
    RETURN 'ok';
EXCEPTION WHEN OTHERS THEN
    RETURN SQLSTATE;
END
$$;
