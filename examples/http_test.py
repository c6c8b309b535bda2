#!/usr/bin/env python3
"""examples/http_test.py -- drive an HTTP example with real requests.

    http_test.py --name NAME --url http://127.0.0.1:PORT \
                 [--seed-url http://127.0.0.1:PORT2] [--log SERVER_LOG] DSN

The server at --url runs the example's endpoints (see examples/gin/main.go)
over the database DSN, with the default mapping; the one at --seed-url (if
given) over the same database with the seed's rule (replay 200).  The one
at --url runs with fault injection (X-Fault), and writes its log to --log.
Checks what the answers say (status, headers, the bytes of the body), what
the database holds (rows counted) and what the server logged.  Prints TAP-style lines, then
"NAME: N of M tests passed." and exits 1 if any failed.
"""

import argparse
import http.client
import json
import sys
import threading
import time
import urllib.parse
import uuid

import psycopg

USER = "42"
# The scope both examples give POST /api/payments of USER: the user and the
# route.
PAYMENTS_SCOPE = "user:%s POST /api/payments" % USER
CHARGES_SCOPE = "user:%s POST /api/charges" % USER


class Answer:
    def __init__(self, status, headers, body):
        self.status = status
        self.headers = headers  # lower-cased names
        self.body = body  # bytes

    def header(self, name):
        return self.headers.get(name.lower())

    def json(self):
        return json.loads(self.body)

    def __repr__(self):
        return "%d %r %r" % (self.status, self.headers, self.body[:300])


def request(url, method, path, body=None, key=None, user=USER, timeout=60, extra=None):
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    headers = dict(extra or {})
    if body is not None:
        if not isinstance(body, (bytes, str)):
            body = json.dumps(body)
        headers["Content-Type"] = "application/json"
    if key is not None:
        headers["Idempotency-Key"] = key
    if user is not None:
        headers["X-User-ID"] = user
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return Answer(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    finally:
        conn.close()


def post(url, path, body, key=None, user=USER, extra=None):
    return request(url, "POST", path, body, key, user, extra=extra)


def traceparent():
    """A new W3C traceparent (version 00, sampled)."""
    return "00-%s-%s-01" % (uuid.uuid4().hex, uuid.uuid4().hex[:16])


def concurrently(n, fn):
    """Run fn(i) for i in 0..n-1 in n threads released together."""
    barrier = threading.Barrier(n)
    results = [None] * n

    def run(i):
        barrier.wait()
        try:
            results[i] = fn(i)
        except Exception as e:  # noqa: BLE001 -- reported as a failed answer
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


class Tap:
    def __init__(self, name):
        self.name = name
        self.n = 0
        self.failed = 0

    def ok(self, cond, what, detail=None):
        self.n += 1
        if cond:
            print("ok %d - %s" % (self.n, what), flush=True)
        else:
            self.failed += 1
            print("not ok %d - %s" % (self.n, what), flush=True)
            if detail is not None:
                for line in str(detail).splitlines():
                    print("#   " + line, flush=True)
        return cond

    def finish(self):
        print("1..%d" % self.n)
        print("%s: %d of %d tests passed." % (self.name, self.n - self.failed, self.n))
        return 1 if self.failed else 0


def new_key():
    return str(uuid.uuid4())


def is_problem(a, status):
    if a.status != status or not (a.header("content-type") or "").startswith("application/problem+json"):
        return False
    try:
        return a.json().get("status") == status
    except ValueError:
        return False


def is_own_problem(a, status):
    """A problem that the idempotency layer itself answers (400, 409 in
    progress, 422), in the bytes every example and integration sends:
    compact JSON, keys sorted, the four members.  So that one answer is the
    same from any of them, byte for byte."""
    if not is_problem(a, status):
        return False
    p = a.json()
    return (isinstance(p, dict) and sorted(p) == ["detail", "status", "title", "type"]
            and a.body == json.dumps(p, separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--seed-url")
    ap.add_argument("--log", help="the --url server's log (stdout and stderr)")
    ap.add_argument("dsn")
    args = ap.parse_args()
    url = args.url
    t = Tap(args.name)
    db = psycopg.connect(args.dsn, autocommit=True)

    def count(sql, *params):
        return db.execute(sql, params).fetchone()[0]

    def lookup(key, scope, *cols):
        return db.execute("SELECT %s FROM idempotency.idem_lookup(%%s, %%s)" % ", ".join(cols),
                          (key, scope)).fetchone()

    def logged(*words):
        """Whether a line of the server's log holds every one of words
        (polled a little: the line may still be on its way)."""
        if not args.log:
            return False
        for _ in range(50):
            with open(args.log, errors="replace") as f:
                if any(all(w in line for w in words) for line in f):
                    return True
            time.sleep(0.1)
        return False

    def stored_body(key):
        """The body stored for a payment key of USER, as jsonb's text."""
        row = db.execute("SELECT response_body::text FROM idempotency.idem_lookup(%s, %s)",
                         (key, PAYMENTS_SCOPE)).fetchone()
        return row[0].encode() if row and row[0] is not None else None

    # Skipped by the middleware: no key needed.
    a = request(url, "GET", "/health", user=None)
    t.ok(a.status == 200, "GET /health answers 200 without a key", a)

    # First POST, its retry, the same JSON written otherwise.
    k1 = new_key()
    pay = {"order_id": "ORD-001", "amount": 9900, "currency": "EUR", "source": "tok_visa"}
    tp1, tp2, tp3 = traceparent(), traceparent(), traceparent()
    first = post(url, "/api/payments", pay, k1, extra={"traceparent": tp1})
    t.ok(first.status == 201 and first.header("idempotent-replayed") is None
         and (first.header("content-type") or "").startswith("application/json")
         and first.json().get("status") == "succeeded"
         and first.header("idempotent-origin-trace") is None,
         "first POST /api/payments: 201 with the payment, not marked replayed", first)
    pid = first.json().get("payment_id") if first.status == 201 else None
    t.ok(first.header("location") == "/api/payments/%s" % pid
         and first.header("etag") == '"payment-%s-1"' % pid,
         "first POST /api/payments: Location and ETag of the payment", first)
    retry = post(url, "/api/payments", pay, k1, extra={"traceparent": tp2})
    t.ok(retry.status == first.status and retry.body == first.body
         and retry.header("idempotent-replayed") == "true"
         and retry.header("content-type") == first.header("content-type"),
         "retry: the same status and body bytes, Idempotent-Replayed: true", retry)
    t.ok(first.header("location") is not None
         and all(retry.header(h) == first.header(h) for h in ("location", "etag", "content-type")),
         "retry: the first answer's Location, ETag and Content-Type replayed", retry)
    row = lookup(k1, PAYMENTS_SCOPE, "response_headers", "origin_trace")
    t.ok(row is not None and row[0] == {h: first.header(h) for h in ("location", "etag", "content-type")},
         "the stored response_headers: the allowlisted headers the first answer had, no other", row)
    t.ok(row is not None and row[1] == tp1 and retry.header("idempotent-origin-trace") == tp1,
         "the first request's traceparent is the record's trace, sent back with the replay", row)
    t.ok(logged("replay", tp2, tp1), "the replay logged a line with its traceparent and the first request's")
    shuffled = '{ "source":"tok_visa","currency" : "EUR","amount":9900, "order_id":"ORD-001"}'
    again = post(url, "/api/payments", shuffled, k1)
    t.ok(again.status == 201 and again.body == first.body and again.header("idempotent-replayed") == "true",
         "the same JSON in another key order and spacing is a replay", again)
    t.ok(count("SELECT count(*) FROM shop.payments WHERE idempotency_key = %s", k1) == 1
         and count("SELECT count(*) FROM shop.payment_attempts WHERE idempotency_key = %s", k1) == 1,
         "one payment row and one handler run for the key")

    a = request(url, "GET", "/api/payments/%d" % first.json()["payment_id"])
    t.ok(a.status == 200 and a.json().get("amount") == 9900 and a.header("idempotent-replayed") is None,
         "GET /api/payments/:id is passed through without a key", a)

    # Same key, other body: 422, nothing written.
    other = dict(pay, amount=100)
    a = post(url, "/api/payments", other, k1, extra={"traceparent": tp3})
    t.ok(is_own_problem(a, 422), "same key with another body: 422 problem+json", a)
    t.ok(a.header("idempotent-origin-trace") == tp1 and logged("mismatch", tp3, tp1),
         "the 422 carries the first request's traceparent, and is logged with both", a)
    t.ok(count("SELECT count(*) FROM shop.payments WHERE idempotency_key = %s", k1) == 1,
         "the mismatch wrote nothing")

    # No key: 400, handler not run.
    before = count("SELECT count(*) FROM shop.payment_attempts")
    a = post(url, "/api/payments", dict(pay, order_id="ORD-nokey"), None)
    t.ok(is_own_problem(a, 400), "POST without Idempotency-Key: 400 problem+json", a)
    a = post(url, "/api/payments", dict(pay, order_id="ORD-longkey"), "k" * 256)
    t.ok(is_own_problem(a, 400), "POST with a key over 255 bytes: 400 problem+json", a)
    t.ok(count("SELECT count(*) FROM shop.payment_attempts") == before,
         "the handler did not run for either")

    # The scope holds the user: another user's equal key is another request.
    a = post(url, "/api/payments", pay, k1, user="43")
    t.ok(a.status == 201 and a.header("idempotent-replayed") is None and a.body != first.body,
         "the same key from another user is a new payment", a)

    # 10 concurrent identical POSTs: one payment; every answer the 201 or
    # its replay (or 409 with Retry-After where the wait ran out).
    k2 = new_key()
    body2 = {"order_id": "ORD-002", "amount": 100, "source": "tok_visa"}
    answers = concurrently(10, lambda i: post(url, "/api/payments", body2, k2))
    t.ok(count("SELECT count(*) FROM shop.payments WHERE idempotency_key = %s", k2) == 1
         and count("SELECT count(*) FROM shop.payment_attempts WHERE idempotency_key = %s", k2) == 1,
         "10 concurrent identical POSTs: exactly one payment row, one handler run")
    firsts = [x for x in answers if isinstance(x, Answer) and x.status == 201
              and x.header("idempotent-replayed") is None]
    good = len(firsts) == 1
    bad = []
    for x in answers:
        if not isinstance(x, Answer):
            bad.append(x)
        elif x.status == 201:
            if not good or x.body != firsts[0].body:
                bad.append(x)
        elif x.status == 409:
            ra = x.header("retry-after") or ""
            if not (ra.isdigit() and int(ra) >= 1 and is_own_problem(x, 409)):
                bad.append(x)
        else:
            bad.append(x)
    t.ok(good and not bad,
         "every answer is the one first 201 or its replay (%d replayed, %d in progress)" % (
             sum(1 for x in answers if isinstance(x, Answer) and x.header("idempotent-replayed") == "true"),
             sum(1 for x in answers if isinstance(x, Answer) and x.status == 409)),
         "\n".join(map(repr, bad or answers)))

    # Stock: 20 concurrent orders of distinct keys, 3 units each, 50 in stock.
    db.execute("INSERT INTO shop.stock VALUES ('sku-http', 50) "
               "ON CONFLICT (sku) DO UPDATE SET quantity = 50")
    db.execute("DELETE FROM shop.stock_moves WHERE sku = 'sku-http'")
    keys = [new_key() for _ in range(20)]
    answers = concurrently(20, lambda i: post(url, "/api/orders", {"sku": "sku-http", "quantity": 3}, keys[i]))
    left = count("SELECT quantity FROM shop.stock WHERE sku = 'sku-http'")
    moved = count("SELECT coalesce(-sum(quantity), 0) FROM shop.stock_moves WHERE sku = 'sku-http'")
    made = [x for x in answers if isinstance(x, Answer) and x.status == 201]
    refused = [i for i, x in enumerate(answers) if isinstance(x, Answer) and is_problem(x, 409)]
    t.ok(left >= 0 and left == 50 - moved and moved == 3 * len(made),
         "stock never below zero: %d left, %d deducted by %d orders answered 201" % (left, moved, len(made)))
    t.ok(len(made) == 16 and len(refused) == 4 and left == 2,
         "16 orders made, 4 refused as out of stock (409)", "\n".join(map(repr, answers)))
    if refused:
        i = refused[0]
        a = post(url, "/api/orders", {"sku": "sku-http", "quantity": 3}, keys[i])
        t.ok(a.status == 409 and a.body == answers[i].body and a.header("idempotent-replayed") == "true",
             "a refused order's retry replays the refusal", a)
    else:
        t.ok(False, "a refused order's retry replays the refusal (no order was refused)")

    # A handler that fails with 500: the failure is stored and replayed.
    k3 = new_key()
    fail = {"order_id": "ORD-003", "amount": 500, "source": "tok_fail"}
    a = post(url, "/api/payments", fail, k3)
    b = post(url, "/api/payments", fail, k3)
    t.ok(a.status == 500 and a.header("idempotent-replayed") is None
         and b.status == 500 and b.body == a.body and b.header("idempotent-replayed") == "true",
         "a handler's 500 is stored: the retry replays it", "%r\n%r" % (a, b))
    t.ok(count("SELECT count(*) FROM shop.payment_attempts WHERE idempotency_key = %s", k3) == 1
         and count("SELECT count(*) FROM shop.payments WHERE idempotency_key = %s", k3) == 0,
         "the failing handler ran once, made no payment")

    # A handler that releases the claim: the retry runs it again.
    k4 = new_key()
    unavailable = {"order_id": "ORD-004", "amount": 500, "source": "tok_retry"}
    a = post(url, "/api/payments", unavailable, k4)
    b = post(url, "/api/payments", unavailable, k4)
    t.ok(a.status == 503 and a.header("retry-after") == "1" and a.header("idempotent-replayed") is None
         and b.status == 503 and b.header("idempotent-replayed") is None,
         "a handler that calls idem_release answers 503, its retry is not a replay", "%r\n%r" % (a, b))
    t.ok(count("SELECT count(*) FROM shop.payment_attempts WHERE idempotency_key = %s", k4) == 2
         and count("SELECT count(*) FROM idempotency.idem_lookup(%s, %s)", k4, PAYMENTS_SCOPE) == 0,
         "the released handler ran twice and left no record")

    # Lease mode: a slow outside call, kept alive with idem_extend past its
    # 2 s lease; a duplicate meanwhile gets 409 with Retry-After.
    k5 = new_key()
    charge = {"order_id": "ORD-005", "amount": 700, "delay_ms": 4500}
    holder = {}
    tp5, tp6 = traceparent(), traceparent()
    th = threading.Thread(target=lambda: holder.update(
        a=post(url, "/api/charges", charge, k5, extra={"traceparent": tp5})))
    th.start()
    time.sleep(0.5)
    dup = post(url, "/api/charges", charge, k5, extra={"traceparent": tp6})
    th.join()
    first = holder.get("a")
    ra = dup.header("retry-after") or ""
    t.ok(is_own_problem(dup, 409) and ra.isdigit() and int(ra) >= 1,
         "lease mode: a duplicate during the call gets 409 with Retry-After (%s)" % ra, dup)
    t.ok(dup.header("idempotent-origin-trace") == tp5 and logged("in_progress", tp6, tp5),
         "lease mode: the 409 carries the first request's traceparent, and is logged with both", dup)
    t.ok(first is not None and first.status == 201 and first.json().get("provider_ref", "").startswith("ch_"),
         "lease mode: the call, kept alive past its lease, answers 201", first)
    a = post(url, "/api/charges", charge, k5)
    t.ok(first is not None and a.status == 201 and a.body == first.body and a.header("idempotent-replayed") == "true",
         "lease mode: the retry replays it", a)
    t.ok(count("SELECT count(*) FROM shop.provider_calls WHERE idempotency_key = %s", k5) == 1
         and count("SELECT count(*) FROM shop.charges WHERE idempotency_key = %s", k5) == 1,
         "lease mode: one call to the provider, one charge row")

    # Resumed after a takeover: the worker dies once the provider has
    # charged and the checkpoint "charged" (the charge id) is committed; the
    # retry after its lease takes the claim over, resumes at "charged" and
    # completes with that charge id: the provider is called once.
    k7 = new_key()
    charge7 = {"order_id": "ORD-007", "amount": 800, "delay_ms": 0}
    tp7, tp9 = traceparent(), traceparent()
    try:
        died = post(url, "/api/charges", charge7, k7, extra={"X-Fault": "die-after-charge", "traceparent": tp7})
    except (http.client.HTTPException, OSError) as e:  # the connection dropped
        died = e
    row = lookup(k7, CHARGES_SCOPE, "status", "phase", "state", "attempt")
    t.ok(not (isinstance(died, Answer) and died.status < 500)
         and row is not None and row[0] == "processing" and row[1] == "charged"
         and (row[2] or {}).get("charge_id", "").startswith("ch_"),
         "a worker that dies after the provider charged leaves its claim at the checkpoint charged",
         "%r\n%r" % (died, row))
    charged = (row[2] or {}).get("charge_id") if row else None
    # Past the lease (polled: a slow machine may take longer than 2 s)
    for _ in range(600):
        if count("SELECT count(*) FROM idempotency.idem_lookup(%s, %s)"
                 " WHERE locked_until <= clock_timestamp()", k7, CHARGES_SCOPE) == 1:
            break
        time.sleep(0.1)
    resumed = post(url, "/api/charges", charge7, k7, extra={"traceparent": tp9})
    t.ok(resumed.status == 201 and resumed.header("idempotent-replayed") is None
         and charged is not None and resumed.json().get("provider_ref") == charged,
         "the retry after the lease takes the claim over and completes with the checkpoint's charge id", resumed)
    t.ok(count("SELECT count(*) FROM shop.provider_calls WHERE idempotency_key = %s", k7) == 1
         and count("SELECT count(*) FROM shop.charges WHERE idempotency_key = %s", k7) == 1
         and lookup(k7, CHARGES_SCOPE, "attempt", "status") == (2, "completed"),
         "resumed: one call to the provider, one charge row, completed at attempt 2",
         "provider calls %d" % count("SELECT count(*) FROM shop.provider_calls WHERE idempotency_key = %s", k7))
    a = post(url, "/api/charges", charge7, k7)
    t.ok(a.status == 201 and a.body == resumed.body and a.header("idempotent-replayed") == "true"
         and a.header("idempotent-origin-trace") == tp9,
         "resumed: its retry replays it, linked to the takeover's traceparent", a)

    # The seed's rule, on a server started with it: first 201, replay 200.
    if args.seed_url:
        k6 = new_key()
        body6 = {"order_id": "ORD-006", "amount": 1200, "source": "tok_visa"}
        a = post(args.seed_url, "/api/payments", body6, k6)
        b = post(args.seed_url, "/api/payments", body6, k6)
        t.ok(a.status == 201 and b.status == 200 and b.body == a.body
             and b.header("idempotent-replayed") == "true",
             "seed's rule on: first 201, replay 200 with the same body", "%r\n%r" % (a, b))
        c = post(args.seed_url, "/api/payments", fail, k3)
        t.ok(c.status == 500 and c.body == stored_body(k3) and c.header("idempotent-replayed") == "true",
             "seed's rule on: a stored 500 still replays as 500", c)

    db.close()
    return t.finish()


if __name__ == "__main__":
    sys.exit(main())
