-- demo/stock_resend.sql: every order of the stock scenario sent once more,
-- with its key and request.  Each must replay its stored answer (201 or 409)
-- without touching the stock.  Rolled back for safety: a replay writes nothing.
-- Prints: replays|replayed 201|replayed 409|other outcomes|stock left

BEGIN;
SELECT count(*) FILTER (WHERE a.outcome = 'replay'),
       count(*) FILTER (WHERE a.outcome = 'replay' AND a.response_status = 201),
       count(*) FILTER (WHERE a.outcome = 'replay' AND a.response_status = 409),
       count(*) FILTER (WHERE a.outcome <> 'replay'),
       (SELECT quantity FROM stock WHERE sku = 'sku-42')
  FROM outcomes o
 CROSS JOIN LATERAL idempotency.idem_acquire(
        o.key, jsonb_build_object('sku', 'sku-42', 'quantity', :qty),
        scope => 'shop/orders') AS a
 WHERE o.scenario = 'stock';
ROLLBACK;
