-- demo/lease_wait.sql: sleep until the claim's lease has run out (on the
-- server's clock), plus 50 ms.
-- psql variables: key.  Prints the seconds slept.

SELECT round(s::numeric, 2)
  FROM (SELECT greatest(0, extract(epoch FROM locked_until - clock_timestamp()))
               + 0.05 AS s
          FROM idempotency.idem_lookup(:'key')) AS l,
       LATERAL pg_sleep(s);
