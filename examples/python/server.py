#!/usr/bin/env python3
"""examples/python/server.py -- exactly-once HTTP endpoints over the
idempotency PostgreSQL extension, with the standard library's HTTP server,
psycopg 3 and psycopg_pool (Debian: python3-psycopg, python3-psycopg-pool).

    python3 server.py --listen 127.0.0.1:8080 --dsn 'dbname=shop'

The same endpoints and the same mapping as examples/gin (tables:
examples/schema.sql).  The mapping is pg_idempotency's (the package of
integrations/python, imported from this tree): Idempotency.handle, for a
POST, reads the Idempotency-Key header and the JSON body, and

  - opens one transaction and calls idempotency.idem_acquire(key, body,
    scope) in it, the scope being the authenticated user and the route;
  - acquired: runs the handler, whose writes go in the same transaction
    (claim.tx), stores its status and body with idempotency.idem_complete and
    commits; the answer goes out once the commit has succeeded;
  - replay: the stored status, body and headers (those of
    REPLAYED_HEADERS that the first answer had), with Idempotent-Replayed:
    true;
  - in_progress: 409 with Retry-After (retry_after); mismatch: 422;
  - no key: 400 (problem+json, RFC 9457).

The request's W3C traceparent header goes with the claim (idem_acquire's
trace).  A replay, a 409 or a 422 logs a line with its own traceparent and
the first request's (origin_trace), and sends the first request's back in
Idempotent-Origin-Trace: the client (the same user: the scope holds it) can
then find the attempt that did the work in its traces.

Routes registered with a lease claim across transactions instead (for a
handler that calls an outside service): the claim commits at once, the
handler calls out (claim.keep_alive() runs idem_extend meanwhile), then its
writes and the answer commit in a second transaction, fenced by the claim.
claim.checkpoint() records a step done; when the worker dies, the retry
that takes the claim over finds it in claim.resumed and carries on from
there instead of repeating the step.

A handler returns a Response, which is stored whatever its status, unless it
called claim.release() (the retry runs again); an exception rolls everything
back and stores nothing (the retry runs again too).

Every duplicate answer is logged (log_duplicates="all"; the package's
default, "sampled", writes at most a line a second).  --replay-cache (or
IDEM_REPLAY_CACHE=1 in the environment): completed answers are kept in the
process (pg_idempotency.ReplayCache) and their replays answered from there.
"""

import argparse
import hashlib
import json
import logging
import os
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from psycopg_pool import ConnectionPool

# pg_idempotency from this tree (integrations/python/src), not installed:
# the example runs on every PostgreSQL major of the tests as it is.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                                "integrations", "python", "src"))
from pg_idempotency import Idempotency, Response, problem  # noqa: E402

SKIP_PATHS = {"/health", "/metrics"}


class WorkerDied(BaseException):
    """Raised by a handler (--fault-injection) to play a worker that dies:
    nothing is answered, stored or released; the claim is left to its lease."""


class Request:
    def __init__(self, method, path, headers, body, user):
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body
        self.user = user
        self.params = {}

    def json(self):
        return json.loads(self.body or b"null")


# ---- the example's endpoints (the seed's payment and stock deduction) ----

class Shop:
    def __init__(self, pool, faults=False):
        self.pool = pool
        self.faults = faults  # --fault-injection: honour X-Fault

    def create_payment(self, req, claim):
        """One transaction: the payment, the claim and the answer commit
        together.  tok_fail fails for good (500, stored), tok_retry finds
        the processor unavailable (503, claim released)."""
        p = req.json()
        if not isinstance(p, dict) or not p.get("order_id") or not isinstance(p.get("amount"), int) \
                or p["amount"] < 1:
            return problem(400, "invalid-payment", "order_id and a positive amount are required")
        currency = p.get("currency") or "EUR"
        tx = claim.tx
        tx.execute("INSERT INTO shop.payment_attempts (idempotency_key, user_id, source) VALUES (%s, %s, %s)",
                   (claim.key, req.user, p.get("source")))
        if p.get("source") == "tok_fail":
            return problem(500, "processor-error", "the payment processor failed")
        if p.get("source") == "tok_retry":
            claim.release()
            return problem(503, "processor-unavailable", "the payment processor is unavailable, try again",
                           headers={"Retry-After": "1"})
        (pid,) = tx.execute("INSERT INTO shop.payments (idempotency_key, user_id, order_id, amount, currency)"
                            " VALUES (%s, %s, %s, %s, %s) RETURNING id",
                            (claim.key, req.user, p["order_id"], p["amount"], currency)).fetchone()
        # stored with the answer and sent again with its replays (REPLAYED_HEADERS)
        return Response(201, {"payment_id": pid, "order_id": p["order_id"], "amount": p["amount"],
                              "currency": currency, "status": "succeeded"},
                        {"Location": "/api/payments/%d" % pid, "ETag": '"payment-%d-1"' % pid})

    def get_payment(self, req):
        with self.pool.connection() as conn:
            row = conn.execute("SELECT order_id, amount, currency FROM shop.payments"
                               " WHERE id = %s AND user_id = %s", (int(req.params["id"]), req.user)).fetchone()
            conn.rollback()
        if row is None:
            return problem(404, "not-found", "no such payment")
        return Response(200, {"order_id": row[0], "amount": row[1], "currency": row[2]})

    def create_order(self, req, claim):
        """Stock deduction: the guarded UPDATE keeps the stock from going
        below zero, the claim keeps a retried order from deducting twice."""
        o = req.json()
        if not isinstance(o, dict) or not o.get("sku") or not isinstance(o.get("quantity"), int) \
                or o["quantity"] < 1:
            return problem(400, "invalid-order", "sku and a positive quantity are required")
        tx = claim.tx
        row = tx.execute("UPDATE shop.stock SET quantity = quantity - %s"
                         " WHERE sku = %s AND quantity >= %s RETURNING quantity",
                         (o["quantity"], o["sku"], o["quantity"])).fetchone()
        if row is None:
            return problem(409, "out-of-stock", "not enough stock of " + o["sku"])
        (oid,) = tx.execute("INSERT INTO shop.stock_moves (idempotency_key, user_id, sku, quantity)"
                            " VALUES (%s, %s, %s, %s) RETURNING id",
                            (claim.key, req.user, o["sku"], -o["quantity"])).fetchone()
        return Response(201, {"order_id": oid, "sku": o["sku"], "quantity": o["quantity"], "stock_left": row[0]})

    def create_charge(self, req, claim):
        """Lease mode: the claim is committed before the slow outside call,
        kept alive during it; the charge and the answer commit after it.
        Once the provider has charged, the charge id is recorded as the
        checkpoint "charged": if this worker dies before it completes, the
        retry that takes the claim over (after the lease) resumes at
        "charged" with that id, and the provider is not called again."""
        c = req.json()
        if not isinstance(c, dict) or not c.get("order_id") or not isinstance(c.get("amount"), int) \
                or c["amount"] < 1:
            return problem(400, "invalid-charge", "order_id and a positive amount are required")
        if claim.resumed is not None and claim.resumed[0] == "charged":
            ref = claim.resumed[1]["charge_id"]
        else:
            with claim.keep_alive():
                ref = self.call_provider(claim.key, c["amount"], c.get("delay_ms", 0) / 1000)
            claim.checkpoint("charged", {"charge_id": ref})
            if self.faults and req.headers.get("X-Fault") == "die-after-charge":
                raise WorkerDied()
        (cid,) = claim.tx.execute("INSERT INTO shop.charges (idempotency_key, user_id, order_id, amount,"
                                  " provider_ref) VALUES (%s, %s, %s, %s, %s) RETURNING id",
                                  (claim.key, req.user, c["order_id"], c["amount"], ref)).fetchone()
        return Response(201, {"charge_id": cid, "order_id": c["order_id"], "amount": c["amount"],
                              "provider_ref": ref})

    def call_provider(self, key, amount, delay):
        """Stands in for the outside service: logs the call (in a table that
        stands for the provider's records), takes its time, and answers a
        reference derived from the key, as a provider that deduplicates on
        the merchant's request id would."""
        with self.pool.connection() as conn:
            conn.execute("INSERT INTO shop.provider_calls (idempotency_key, amount) VALUES (%s, %s)",
                         (key, amount))
            conn.commit()
        threading.Event().wait(delay)
        return "ch_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def make_handler(shop, idem, charge_lease):
    # (method, path pattern) -> (function, idempotent, lease)
    routes = [
        ("GET", r"/health", lambda req: Response(200, {"status": "ok"}), False, None),
        ("GET", r"/metrics", lambda req: Response(200, b"# no metrics in this example\n",
                                                  {"Content-Type": "text/plain"}), False, None),
        ("GET", r"/api/payments/(?P<id>[0-9]+)", shop.get_payment, False, None),
        ("POST", r"/api/payments", shop.create_payment, True, None),
        ("POST", r"/api/orders", shop.create_order, True, None),
        ("POST", r"/api/charges", shop.create_charge, True, charge_lease),
    ]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.dispatch()

        def do_POST(self):
            self.dispatch()

        def dispatch(self):
            path = self.path.split("?", 1)[0]
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            for method, pattern, fn, idempotent, lease in routes:
                m = re.fullmatch(pattern, path)
                if m and method == self.command:
                    break
            else:
                return self.send(problem(404, "not-found", "no such route"))
            user = self.headers.get("X-User-ID")
            if path not in SKIP_PATHS and not (user or "").isdigit():
                return self.send(problem(401, "unauthenticated", "X-User-ID header missing or not a number"))
            req = Request(self.command, path, self.headers, body, user)
            req.params = m.groupdict()
            try:
                if idempotent and path not in SKIP_PATHS:
                    resp = idem.handle(self.command, path, self.headers.get("Idempotency-Key"), body, user,
                                       lambda claim: fn(req, claim), lease=lease,
                                       trace=self.headers.get("traceparent"))
                else:
                    resp = fn(req)
            except WorkerDied:
                # no answer: the connection is dropped, as when a worker dies
                sys.stderr.write("worker died (X-Fault) on %s %s\n" % (self.command, path))
                self.close_connection = True
                return
            self.send(resp)

        def send(self, resp):
            body, headers = resp.encoded()
            self.send_response(resp.status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            if body:
                self.wfile.write(body)

        def log_message(self, fmt, *args):
            sys.stderr.write("%s %s\n" % (self.address_string(), fmt % args))

    return Handler


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the listen backlog (socketserver's default, 5, resets bursts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", default="127.0.0.1:8080")
    ap.add_argument("--dsn", default="", help="PostgreSQL connection string (empty: the PG* variables)")
    ap.add_argument("--max-conns", type=int, default=20)
    ap.add_argument("--replay-200", action="store_true", help="the seed's rule: a replayed 2xx is answered 200")
    ap.add_argument("--charge-lease", type=float, default=30, help="lease of POST /api/charges' claims, seconds")
    ap.add_argument("--fault-injection", action="store_true",
                    help="honour the X-Fault request header (tests only): die-after-charge")
    ap.add_argument("--replay-cache", action="store_true",
                    default=os.environ.get("IDEM_REPLAY_CACHE") == "1",
                    help="answer replays of completed answers from the process (also IDEM_REPLAY_CACHE=1)")
    args = ap.parse_args()
    # pg_idempotency logs a replay, a 409 and a 422 with both traceparents
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    pool = ConnectionPool(args.dsn, min_size=2, max_size=args.max_conns, open=True)
    pool.wait()
    shop = Shop(pool, faults=args.fault_injection)
    idem = Idempotency(pool, replay_ok=args.replay_200, replay_cache=args.replay_cache, log_duplicates="all")
    host, port = args.listen.rsplit(":", 1)
    server = Server((host, int(port)), make_handler(shop, idem, args.charge_lease))
    print("listening on %s%s" % (args.listen, ", replay cache on" if args.replay_cache else ""), file=sys.stderr,
          flush=True)
    try:
        server.serve_forever()
    finally:
        pool.close()


if __name__ == "__main__":
    main()
