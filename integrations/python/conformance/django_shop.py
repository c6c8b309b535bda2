#!/usr/bin/env python3
"""The conformance app of pg_idempotency.django: the endpoints, flags and
log lines of examples/python/server.py, as Django views behind
IdempotencyMiddleware, served by the standard library's WSGI server
(threaded).

    django_shop.py --dsn DSN --listen 127.0.0.1:PORT [--charge-lease 2]
                   [--replay-200] [--fault-injection]

Every duplicate answer is logged (LOG_DUPLICATES "all": the HTTP test reads
the lines).  IDEM_REPLAY_CACHE=1 in the environment: with the replay cache
(ReplayCache's defaults).

Uses pg_idempotency as installed (the wheel), not the source tree."""

import argparse
import hashlib
import json
import logging
import os
import socketserver
import sys
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import django
from django.conf import settings
from django.http import HttpResponse, JsonResponse
from django.urls import path
from psycopg_pool import ConnectionPool

import pg_idempotency

SKIP_PATHS = {"/health", "/metrics"}
POOL = None
FAULTS = False


class WorkerDied(BaseException):
    """Raised (--fault-injection) to play a worker that dies: nothing is
    stored or released; the claim is left to its lease."""


def problem(status, typ, title, detail=None, headers=None):
    body = {"type": "https://example.com/problems/" + typ, "title": title, "status": status}
    if detail:
        body["detail"] = detail
    resp = JsonResponse(body, status=status, content_type="application/problem+json")
    for k, v in (headers or {}).items():
        resp[k] = v
    return resp


def require_user(get_response):
    """The stand-in for authentication: X-User-ID, a number (401 without)."""
    def middleware(request):
        user = request.headers.get("X-User-ID") or ""
        if request.path not in SKIP_PATHS and not user.isdigit():
            return problem(401, "unauthenticated", "X-User-ID header missing or not a number")
        request.user_id = user or None
        return get_response(request)
    return middleware


def health(request):
    return JsonResponse({"status": "ok"})


def metrics(request):
    return HttpResponse(b"# no metrics in this example\n", content_type="text/plain")


def payment(request, pid):
    if request.method == "GET":
        with POOL.connection() as conn:
            row = conn.execute("SELECT order_id, amount, currency FROM shop.payments"
                               " WHERE id = %s AND user_id = %s", (pid, request.user_id)).fetchone()
        if row is None:
            return problem(404, "not-found", "no such payment")
        return JsonResponse({"order_id": row[0], "amount": row[1], "currency": row[2]})
    return problem(405, "method-not-allowed", "method not allowed")


def create_payment(request):
    claim = request.idempotency
    p = json.loads(request.body or b"null")
    if not isinstance(p, dict) or not p.get("order_id") or not isinstance(p.get("amount"), int) \
            or p["amount"] < 1:
        return problem(400, "invalid-payment", "order_id and a positive amount are required")
    currency = p.get("currency") or "EUR"
    tx = claim.tx
    tx.execute("INSERT INTO shop.payment_attempts (idempotency_key, user_id, source) VALUES (%s, %s, %s)",
               (claim.key, request.user_id, p.get("source")))
    if p.get("source") == "tok_fail":
        return problem(500, "processor-error", "the payment processor failed")
    if p.get("source") == "tok_retry":
        claim.release()
        return problem(503, "processor-unavailable", "the payment processor is unavailable, try again",
                       headers={"Retry-After": "1"})
    (pid,) = tx.execute("INSERT INTO shop.payments (idempotency_key, user_id, order_id, amount, currency)"
                        " VALUES (%s, %s, %s, %s, %s) RETURNING id",
                        (claim.key, request.user_id, p["order_id"], p["amount"], currency)).fetchone()
    resp = JsonResponse({"payment_id": pid, "order_id": p["order_id"], "amount": p["amount"],
                         "currency": currency, "status": "succeeded"}, status=201)
    resp["Location"] = "/api/payments/%d" % pid
    resp["ETag"] = '"payment-%d-1"' % pid
    return resp


def create_order(request):
    claim = request.idempotency
    o = json.loads(request.body or b"null")
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
                        (claim.key, request.user_id, o["sku"], -o["quantity"])).fetchone()
    return JsonResponse({"order_id": oid, "sku": o["sku"], "quantity": o["quantity"], "stock_left": row[0]},
                        status=201)


def create_charge(request):
    """Lease mode, with the checkpoint "charged" (see asgi_shop.py)."""
    claim = request.idempotency
    c = json.loads(request.body or b"null")
    if not isinstance(c, dict) or not c.get("order_id") or not isinstance(c.get("amount"), int) \
            or c["amount"] < 1:
        return problem(400, "invalid-charge", "order_id and a positive amount are required")
    if claim.resumed is not None and claim.resumed[0] == "charged":
        ref = claim.resumed[1]["charge_id"]
    else:
        with claim.keep_alive():
            ref = call_provider(claim.key, c["amount"], c.get("delay_ms", 0) / 1000)
        claim.checkpoint("charged", {"charge_id": ref})
        if FAULTS and request.headers.get("X-Fault") == "die-after-charge":
            sys.stderr.write("worker died (X-Fault) on POST %s\n" % request.path)
            raise WorkerDied()
    (cid,) = claim.tx.execute("INSERT INTO shop.charges (idempotency_key, user_id, order_id, amount,"
                              " provider_ref) VALUES (%s, %s, %s, %s, %s) RETURNING id",
                              (claim.key, request.user_id, c["order_id"], c["amount"], ref)).fetchone()
    return JsonResponse({"charge_id": cid, "order_id": c["order_id"], "amount": c["amount"],
                         "provider_ref": ref}, status=201)


def call_provider(key, amount, delay):
    """Stands in for the outside service (see examples/python/server.py)."""
    with POOL.connection() as conn:
        conn.execute("INSERT INTO shop.provider_calls (idempotency_key, amount) VALUES (%s, %s)", (key, amount))
    threading.Event().wait(delay)
    return "ch_" + hashlib.sha256(key.encode()).hexdigest()[:16]


urlpatterns = [
    path("health", health), path("metrics", metrics), path("api/payments/<int:pid>", payment),
    path("api/payments", create_payment), path("api/orders", create_order), path("api/charges", create_charge),
]


class Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True
    request_queue_size = 128  # the listen backlog (socketserver's default, 5, resets bursts)


class Handler(WSGIRequestHandler):
    def log_message(self, fmt, *args):
        sys.stderr.write("%s %s\n" % (self.address_string(), fmt % args))


def main():
    global POOL, FAULTS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", default="127.0.0.1:8080")
    ap.add_argument("--dsn", default="")
    ap.add_argument("--max-conns", type=int, default=20)
    ap.add_argument("--replay-200", action="store_true")
    ap.add_argument("--charge-lease", type=float, default=30)
    ap.add_argument("--fault-injection", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if os.environ.get("IDEM_LOG_COPY"):  # integrations/python/test.sh reads the duplicates' lines there
        logging.getLogger("pg_idempotency").addHandler(logging.FileHandler(os.environ["IDEM_LOG_COPY"]))
    cache = os.environ.get("IDEM_REPLAY_CACHE") == "1"
    logging.info("pg_idempotency %s from %s%s", pg_idempotency.__version__, pg_idempotency.__file__,
                 ", replay cache on" if cache else "")
    POOL = ConnectionPool(args.dsn, min_size=2, max_size=args.max_conns, open=True)
    POOL.wait()
    FAULTS = args.fault_injection
    settings.configure(
        DEBUG=False, SECRET_KEY="conformance-only", ALLOWED_HOSTS=["127.0.0.1", "localhost"],
        ROOT_URLCONF=__name__, INSTALLED_APPS=[], DATABASES={}, LOGGING_CONFIG=None, APPEND_SLASH=False,
        MIDDLEWARE=[__name__ + ".require_user", "pg_idempotency.django.IdempotencyMiddleware"],
        IDEMPOTENCY={"POOL": POOL, "LEASES": {"/api/charges": args.charge_lease},
                     "REPLAY_200": args.replay_200, "USER": lambda request: request.user_id,
                     "LOG_DUPLICATES": "all", "REPLAY_CACHE": cache},
    )
    django.setup()
    from django.core.wsgi import get_wsgi_application

    host, port = args.listen.rsplit(":", 1)
    server = make_server(host, int(port), get_wsgi_application(), server_class=Server, handler_class=Handler)
    logging.info("listening on %s", args.listen)
    try:
        server.serve_forever()
    finally:
        POOL.close()


if __name__ == "__main__":
    main()
