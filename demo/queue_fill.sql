-- demo/queue_fill.sql: :events events (event i carries amount 10 * i), each
-- delivered two or three times, in a shuffled order, as an at-least-once
-- queue does.
-- Prints: deliveries|events|sum of the events' amounts

INSERT INTO queue (event_id, amount)
SELECT 'evt-' || i, 10 * i
  FROM generate_series(1, :events) AS i,
       generate_series(1, 2 + i % 2) AS copy
 ORDER BY md5(i || '/' || copy);

SELECT count(*), count(DISTINCT event_id),
       (SELECT sum(10 * i) FROM generate_series(1, :events) AS i)
  FROM queue;
