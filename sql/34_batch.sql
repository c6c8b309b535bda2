--
-- Queue consumers claim a batch of messages in one statement (README.md,
-- "Queue consumers"): idem_acquire over the batch's distinct ids in sorted
-- order, then the business writes and idem_complete of the acquired ones,
-- in the same statement.  Each message takes effect once: a message twice
-- in a batch is one claim, a redelivered batch replays, a batch that fails
-- leaves nothing, and a message claimed elsewhere is in_progress and
-- left for a later delivery while the rest of the batch goes on.
--
SET idempotency.wait_timeout = 0;
CREATE TABLE batch_shipments (event_id text PRIMARY KEY, sku text NOT NULL);

-- consume(batch): the README's statement, the batch as a parameter
PREPARE consume(jsonb) AS
WITH claimed AS (
    SELECT m.event_id, m.sku, a.outcome
      FROM (SELECT DISTINCT ON (event_id) event_id, sku
              FROM jsonb_to_recordset($1) AS b(event_id text, sku text)
             ORDER BY event_id) m
     CROSS JOIN LATERAL idempotency.idem_acquire(m.event_id, NULL, 'queue:shipments') a),
shipped AS (
    INSERT INTO batch_shipments
    SELECT event_id, sku FROM claimed WHERE outcome = 'acquired'
    RETURNING event_id)
SELECT c.event_id, c.outcome,
       CASE WHEN s.event_id IS NOT NULL
            THEN idempotency.idem_complete(s.event_id, 200, scope => 'queue:shipments')
       END AS completed
  FROM claimed c LEFT JOIN shipped s USING (event_id)
 ORDER BY c.event_id;

-- the first delivery: e2 twice, e1 once: both shipped, e2 once
EXECUTE consume('[{"event_id": "e2", "sku": "b"}, {"event_id": "e1", "sku": "a"},
                  {"event_id": "e2", "sku": "b"}]');
SELECT * FROM batch_shipments ORDER BY event_id;
SELECT key, status, response_status FROM idempotency.records
 WHERE scope = 'queue:shipments' ORDER BY key;

-- redelivered with a new message e3: e1 and e2 replay, e3 is shipped
EXECUTE consume('[{"event_id": "e1", "sku": "a"}, {"event_id": "e2", "sku": "b"},
                  {"event_id": "e3", "sku": "c"}]');
SELECT * FROM batch_shipments ORDER BY event_id;

-- what each message of a batch answers: replay for the done ones
SELECT m.id, a.outcome, a.response_status
  FROM (SELECT DISTINCT id FROM unnest(ARRAY['e3', 'e1', 'e9']) id ORDER BY id) m
 CROSS JOIN LATERAL idempotency.idem_acquire(m.id, NULL, 'queue:shipments') a;
-- e9 above was claimed by that statement and committed unfinished; let it go
SELECT idempotency.idem_release('e9', 'queue:shipments') AS released;

-- without DISTINCT, a message twice in one batch: the second meets this
-- statement's own claim, in_progress at once (never a second acquired)
BEGIN;
SELECT m.id, a.outcome
  FROM unnest(ARRAY['d1', 'd1']) WITH ORDINALITY m(id, n)
 CROSS JOIN LATERAL idempotency.idem_acquire(m.id, NULL, 'queue:dup') a
 ORDER BY m.n;
ROLLBACK;

-- a batch that fails (here: e5's row breaks a constraint) leaves nothing:
-- its claims roll back with it, and the next delivery ships them all
\set VERBOSITY terse
EXECUTE consume('[{"event_id": "e4", "sku": "d"}, {"event_id": "e5", "sku": null}]');
\set VERBOSITY default
SELECT count(*) AS records_of_failed_batch FROM idempotency.records
 WHERE scope = 'queue:shipments' AND key IN ('e4', 'e5');
EXECUTE consume('[{"event_id": "e4", "sku": "d"}, {"event_id": "e5", "sku": "e"}]');

-- a message claimed elsewhere (a committed lease claim, as a worker that
-- calls out holds it) is in_progress: the rest of the batch ships, and
-- that message ships at a later delivery once the claim is given up
SELECT outcome FROM idempotency.idem_acquire('e7', NULL, 'queue:shipments', lease => '1 hour');
EXECUTE consume('[{"event_id": "e6", "sku": "f"}, {"event_id": "e7", "sku": "g"},
                  {"event_id": "e8", "sku": "h"}]');
SELECT idempotency.idem_release('e7', 'queue:shipments') AS released;
EXECUTE consume('[{"event_id": "e6", "sku": "f"}, {"event_id": "e7", "sku": "g"},
                  {"event_id": "e8", "sku": "h"}]');
SELECT * FROM batch_shipments ORDER BY event_id;

DEALLOCATE consume;
DROP TABLE batch_shipments;
DELETE FROM idempotency.records WHERE scope IN ('queue:shipments', 'queue:dup');
