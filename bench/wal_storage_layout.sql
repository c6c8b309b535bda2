-- bench/wal_storage_layout.sql -- make the dated partitions of
-- idempotency.records again, still empty, with another layout: an
-- experiment for bench/wal_storage.sh --ext-sql (issue 30), not what
-- maintenance makes
--
-- Environment (psql \getenv):
--   WS_FILLFACTOR  the partitions' fillfactor (default 100)
--   WS_ORDER       maintenance: drop them and let idem_maintain() make them
--                  as the installed version's maintenance does (from 1.2
--                  on, the layout of issue 30; CREATE EXTENSION's come from
--                  the 1.0 script); the two settings below are ignored;
--                  keep: the partitions as they are, only the two settings
--                  below changed (ALTER TABLE ... SET);
--                  parent: the parent's column order (as LIKE makes them);
--                  hot: the columns a completion leaves alone first, fixed
--                  width and 8-byte aligned first, then what a completion
--                  writes (status, response_status, completed_at,
--                  response_body), so that a HOT update logs only those
--                  (log_heap_update leaves out the common prefix)
--   WS_AUTOVACUUM  the partitions' autovacuum_enabled (default on)
-- Each partition gets the index, replica identity and bounds maintenance
-- gives it; the trigger comes from the parent when it is attached.
-- DEFAULT is left as it is.
\getenv ff WS_FILLFACTOR
\getenv ord WS_ORDER
\getenv av WS_AUTOVACUUM
\if :{?ff}
\else
\set ff 100
\endif
\if :{?ord}
\else
\set ord parent
\endif
\if :{?av}
\else
\set av on
\endif
SELECT set_config('ws.ff', :'ff', false), set_config('ws.ord', :'ord', false),
       set_config('ws.av', :'av', false);

DO $$
DECLARE
    part regclass;
BEGIN
    IF current_setting('ws.ord') = 'maintenance' THEN
        FOR part IN SELECT p.partition FROM idempotency.partitions p WHERE NOT p.is_default LOOP
            EXECUTE format('DROP TABLE %s', part);
        END LOOP;
        PERFORM idempotency.idem_maintain();
    END IF;
END
$$;

DO $$
DECLARE
    hot_order text[] := ARRAY['created_at', 'locked_until', 'expires_at', 'owner_start',
                              'claim', 'attempt', 'owner_pid', 'is_token',
                              'scope', 'key', 'request_hash',
                              'status', 'response_status', 'completed_at', 'response_body'];
    ord text := current_setting('ws.ord');
    p record;
    con record;
    cols text;
BEGIN
    SELECT string_agg(format('%I %s%s%s%s', a.attname, format_type(a.atttypid, a.atttypmod),
                             CASE WHEN a.attcollation <> 0
                                  THEN ' COLLATE ' || quote_ident(co.collname) ELSE '' END,
                             CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END,
                             coalesce(' DEFAULT ' || pg_get_expr(d.adbin, d.adrelid), '')),
                      ', ' ORDER BY CASE WHEN ord = 'hot'
                                         THEN coalesce(array_position(hot_order, a.attname::text), 100 + a.attnum)
                                         ELSE a.attnum END)
      INTO cols
      FROM pg_attribute a
      LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
      LEFT JOIN pg_collation co ON co.oid = a.attcollation
     WHERE a.attrelid = 'idempotency.records'::regclass AND a.attnum > 0 AND NOT a.attisdropped;

    IF ord = 'maintenance' THEN
        RETURN;
    END IF;
    FOR p IN SELECT c.oid::regclass AS rel, c.relname, pg_get_expr(c.relpartbound, c.oid) AS bound
               FROM pg_inherits h JOIN pg_class c ON c.oid = h.inhrelid
              WHERE h.inhparent = 'idempotency.records'::regclass
                AND pg_get_expr(c.relpartbound, c.oid) <> 'DEFAULT'
    LOOP
        IF ord = 'keep' THEN
            EXECUTE format('ALTER TABLE %s SET (fillfactor = %s, autovacuum_enabled = %s)',
                           p.rel, current_setting('ws.ff'), current_setting('ws.av'));
            CONTINUE;
        END IF;
        EXECUTE format('ALTER TABLE idempotency.records DETACH PARTITION %s', p.rel);
        IF EXISTS (SELECT FROM pg_depend WHERE classid = 'pg_class'::regclass AND objid = p.rel
                      AND deptype = 'e') THEN
            EXECUTE format('ALTER EXTENSION idempotency DROP TABLE %s', p.rel);
        END IF;
        EXECUTE format('DROP TABLE %s', p.rel);
        EXECUTE format('CREATE TABLE idempotency.%I (%s) WITH (fillfactor = %s, autovacuum_enabled = %s)',
                       p.relname, cols, current_setting('ws.ff'), current_setting('ws.av'));
        FOR con IN SELECT conname, pg_get_constraintdef(oid) AS def FROM pg_constraint
                    WHERE conrelid = 'idempotency.records'::regclass AND contype = 'c'
        LOOP
            EXECUTE format('ALTER TABLE idempotency.%I ADD CONSTRAINT %I %s', p.relname, con.conname, con.def);
        END LOOP;
        EXECUTE format('CREATE UNIQUE INDEX %I ON idempotency.%I (scope, key, expires_at)',
                       p.relname || '_key', p.relname);
        EXECUTE format('ALTER TABLE idempotency.%I REPLICA IDENTITY USING INDEX %I',
                       p.relname, p.relname || '_key');
        EXECUTE format('ALTER TABLE idempotency.records ATTACH PARTITION idempotency.%I %s',
                       p.relname, p.bound);
    END LOOP;
END
$$;
