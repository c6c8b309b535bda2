#!/usr/bin/env python3
"""examples/python/server.py -- exactly-once HTTP endpoints over the
idempotency PostgreSQL extension, with the standard library's HTTP server,
psycopg 3 and psycopg_pool (Debian: python3-psycopg, python3-psycopg-pool).

    python3 server.py --listen 127.0.0.1:8080 --dsn 'dbname=shop'

The same endpoints and the same mapping as examples/gin (tables:
examples/schema.sql).  Idempotent.handle is the part to take away: for a
POST it reads the Idempotency-Key header and the JSON body, and

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
"""

import argparse
import contextlib
import hashlib
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psycopg
from psycopg_pool import ConnectionPool

PROBLEM_BASE = "https://example.com/problems/"
SKIP_PATHS = {"/health", "/metrics"}
# The response headers stored with an answer (idem_complete's
# response_headers) and sent again with its replays, as spelled here.
REPLAYED_HEADERS = ("Location", "ETag", "Content-Type", "Content-Location")
SPELLING = {h.lower(): h for h in REPLAYED_HEADERS}


class WorkerDied(BaseException):
    """Raised by a handler (--fault-injection) to play a worker that dies:
    nothing is answered, stored or released; the claim is left to its lease."""


class Response:
    def __init__(self, status, body=None, headers=None):
        self.status = status
        self.body = body  # a JSON value (None: no body), or bytes as they are
        self.headers = dict(headers or {})


def problem(status, typ, title, detail=None, headers=None):
    """An RFC 9457 problem+json answer."""
    body = {"type": PROBLEM_BASE + typ, "title": title, "status": status}
    if detail:
        body["detail"] = detail
    return Response(status, body, headers)


def content_type(status):
    """What a JSON body is sent as, first time and replayed alike."""
    return "application/problem+json" if status >= 400 else "application/json; charset=utf-8"


def db_problem(err):
    """A database error: 503 where a retry cures it, 400 for refused data."""
    code = getattr(err, "sqlstate", None) or ""
    if code[:2] == "40" or code in ("55P03", "53300"):
        return problem(503, "try-again", "Try again", str(err), {"Retry-After": "1"})
    if code[:2] == "22":
        return problem(400, "bad-request", "Request refused by the database", str(err))
    return problem(500, "database-error", "Database error", str(err))


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


class Claim:
    """What an acquired request's handler gets."""

    def __init__(self, pool, key, scope, lease, conn=None, claim=None, resumed=None):
        self.pool = pool
        self.key = key
        self.scope = scope
        self.lease = lease
        self.claim = claim  # the claim idem_acquire returned (checkpoints need it)
        self.released = False
        # after a takeover: (phase, state) of the last checkpoint of the
        # claim taken over, or None
        self.resumed = resumed
        self.checkpointed = False  # a checkpoint was committed
        self._conn = conn  # the open transaction, if any
        self._lock = threading.Lock()

    @property
    def tx(self):
        """The connection whose transaction commits with the stored answer.
        In lease mode it is taken at first use: use it after the outside
        call, not before."""
        with self._lock:
            if self._conn is None:
                self._conn = self.pool.getconn()
            return self._conn

    def release(self):
        """idem_release: nothing is stored, the retry runs the handler again."""
        sql = "SELECT idempotency.idem_release(key => %s, scope => %s, claim => %s::uuid)"
        args = (self.key, self.scope, self.claim)
        with self._lock:
            if self._conn is not None:
                self._conn.execute(sql, args)
            else:
                with self.pool.connection() as conn:
                    conn.execute(sql, args)
                    conn.commit()
        self.released = True

    def checkpoint(self, phase, state=None):
        """idem_checkpoint: record the step done (phase) and what the next
        attempt needs (state, a JSON value).  In the open transaction if
        there is one (committed with the handler's writes), else, in lease
        mode before tx, committed at once.  After a committed checkpoint, a
        handler that fails leaves the claim to its lease (not released):
        the retry that takes it over resumes."""
        sql = ("SELECT idempotency.idem_checkpoint(key => %s, scope => %s, claim => %s::uuid,"
               " phase => %s, state => %s::jsonb)")
        args = (self.key, self.scope, self.claim, phase, None if state is None else json.dumps(state))
        with self._lock:
            if self._conn is not None:
                self._conn.execute(sql, args)
                return
            with self.pool.connection() as conn:
                conn.execute(sql, args)
                conn.commit()
            self.checkpointed = True

    def extend(self):
        """idem_extend: push the lease out while a slow call runs."""
        if not self.lease:
            return
        with self.pool.connection() as conn:
            conn.execute("SELECT idempotency.idem_extend(key => %s, scope => %s, claim => %s::uuid,"
                         " lease => %s::float8 * interval '1 second')",
                         (self.key, self.scope, self.claim, self.lease))
            conn.commit()

    @contextlib.contextmanager
    def keep_alive(self):
        """extend() every third of the lease while the block runs."""
        stop = threading.Event()

        def beat():
            while not stop.wait(self.lease / 3):
                try:
                    self.extend()
                except psycopg.Error:
                    return  # taken over or expired: the completion will be refused

        thread = threading.Thread(target=beat, daemon=True)
        if self.lease:
            thread.start()
        try:
            yield
        finally:
            stop.set()
            if thread.is_alive():
                thread.join()

    def _end(self, commit):
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if commit:
                conn.commit()
            else:
                conn.rollback()
        finally:
            self.pool.putconn(conn)


class Idempotent:
    """The mapping from idem_acquire's outcomes to HTTP."""

    ACQUIRE = """
        SELECT outcome, response_status, response_body::text, retry_after, claim::text,
               phase, state, response_headers, origin_trace
          FROM idempotency.idem_acquire(key => %s::text, request => %s::jsonb, scope => %s::text,
                                        ttl => %s::float8 * interval '1 second',
                                        lease => %s::float8 * interval '1 second',
                                        trace => %s::text)"""
    COMPLETE = """
        SELECT idempotency.idem_complete(key => %(key)s::text, response_status => %(status)s::int,
                                         response_body => %(body)s::jsonb, scope => %(scope)s::text,
                                         claim => %(claim)s::uuid, response_headers => %(headers)s::jsonb),
               %(body)s::jsonb::text"""

    def __init__(self, pool, replay_ok=False, ttl=None):
        self.pool = pool
        self.replay_ok = replay_ok  # the seed's rule: a replayed 2xx is answered 200
        self.ttl = ttl  # seconds; None: idempotency.default_ttl

    def handle(self, req, handler, lease=None):
        key = req.headers.get("Idempotency-Key")
        if not key:
            return problem(400, "idempotency-key-missing", "Idempotency-Key header missing",
                           "This operation is idempotent: send an Idempotency-Key header "
                           "(a UUID that you send again when you retry).")
        if len(key.encode()) > 255:
            return problem(400, "idempotency-key-invalid", "Idempotency-Key header too long",
                           "The key is at most 255 bytes long.")
        request = "null"  # an empty body: compared as JSON null
        if req.body.strip():
            try:
                json.loads(req.body)
            except ValueError:
                return problem(400, "body-not-json", "Request body is not JSON",
                               "The request body is compared with the first request's as JSON.")
            request = req.body.decode()
        scope = "user:%s %s %s" % (req.user or "anonymous", req.method, req.path)
        if len(scope.encode()) > 255:
            scope = "sha256:" + hashlib.sha256(scope.encode()).hexdigest()
        # for linking duplicates to the first request: one too long to
        # store (255 bytes) is not passed on rather than refused
        trace = req.headers.get("traceparent")
        if trace is not None and len(trace.encode()) > 255:
            trace = None

        conn = self.pool.getconn()
        try:
            outcome, status, stored, retry_after, claim_id, phase, state, headers, origin_trace = conn.execute(
                self.ACQUIRE, (key, request, scope, self.ttl or None, lease or None, trace)).fetchone()
            if outcome != "acquired" or lease:
                conn.commit()  # lease mode: the claim is now visible, as processing
        except psycopg.Error as err:
            conn.rollback()
            self.pool.putconn(conn)
            return db_problem(err)
        if outcome != "acquired" or lease:
            self.pool.putconn(conn)
            conn = None

        dup = {}
        if outcome != "acquired":
            # a duplicate: link it to the first request, in the log and for the client
            sys.stderr.write("idempotency: %s, key %r scope %r: traceparent %s, first request's %s\n"
                             % (outcome, key, scope, trace or "-", origin_trace or "-"))
            if origin_trace is not None:
                dup["Idempotent-Origin-Trace"] = origin_trace
        if outcome == "replay":
            if self.replay_ok and 200 <= status < 300:
                status = 200
            # stored in lower case: sent as REPLAYED_HEADERS spell them
            replayed = {SPELLING.get(k, k): v for k, v in (headers or {}).items()}
            return self._stored(status, stored, dict(replayed, **dup, **{"Idempotent-Replayed": "true"}))
        if outcome == "mismatch":
            return problem(422, "idempotency-key-reused", "Idempotency-Key already used for another request",
                           "This key was sent before with a different request body; "
                           "use a new key for a new request.", dup)
        if outcome == "in_progress":
            wait = retry_after if retry_after and retry_after > 0 else 1
            return problem(409, "request-in-progress", "A request with this Idempotency-Key is being processed",
                           "Send the same request again after %d second(s)." % wait,
                           dict(dup, **{"Retry-After": str(wait)}))

        claim = Claim(self.pool, key, scope, lease, conn=conn, claim=claim_id,
                      resumed=(phase, state) if phase is not None else None)
        try:
            resp = handler(req, claim)
        except WorkerDied:
            # played by the handler: the worker is gone, its claim left to its lease
            claim._end(commit=False)
            raise
        except Exception as err:  # noqa: BLE001 -- answered 500, nothing stored
            claim._end(commit=False)
            if lease and not claim.released and not claim.checkpointed:
                # The outside call may have happened: give the claim up so
                # that a retry runs again (the provider deduplicates on the key).
                with contextlib.suppress(psycopg.Error):
                    claim.release()
            return db_problem(err) if isinstance(err, psycopg.Error) else \
                problem(500, "internal-error", "Internal error", str(err))
        if claim.released:
            try:
                claim._end(commit=True)
            except psycopg.Error as err:
                return db_problem(err)
            return resp

        body = None if resp.body is None else json.dumps(resp.body)
        # the headers to replay: those of REPLAYED_HEADERS that this answer
        # has (its Content-Type as it goes out)
        replayed = {k: v for k, v in resp.headers.items() if k.lower() in SPELLING and k.lower() != "content-type"}
        if body is not None:
            replayed["Content-Type"] = content_type(resp.status)
        try:
            done, canonical = claim.tx.execute(self.COMPLETE, {
                "key": key, "status": resp.status, "body": body, "scope": scope, "claim": claim.claim,
                "headers": json.dumps(replayed) if replayed else None,
            }).fetchone()
            claim._end(commit=True)
        except psycopg.Error as err:
            claim._end(commit=False)
            if err.sqlstate == "55000":
                # Lease mode: the lease ran out and another request took the
                # claim over; its answer is the one that counts.
                return problem(409, "idempotency-claim-lost", "This request's claim was taken over",
                               "It took longer than its lease; send the same request again.",
                               {"Retry-After": "1"})
            return db_problem(err)
        # The body goes out as the database stores it (jsonb's text), so
        # that the first answer and every replay are the same bytes.
        headers = {k: v for k, v in resp.headers.items() if k.lower() != "content-type"}
        return self._stored(resp.status, canonical, headers)

    @staticmethod
    def _stored(status, text, headers):
        """The answer of a stored body (jsonb's text); its Content-Type
        the one in headers (a replay's), else content_type(status)."""
        resp = Response(status, None if text is None else text.encode(), headers)
        if text is not None:
            resp.headers.setdefault("Content-Type", content_type(status))
        else:
            resp.headers.pop("Content-Type", None)
        return resp


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
                    resp = idem.handle(req, fn, lease)
                else:
                    resp = fn(req)
            except WorkerDied:
                # no answer: the connection is dropped, as when a worker dies
                sys.stderr.write("worker died (X-Fault) on %s %s\n" % (self.command, path))
                self.close_connection = True
                return
            self.send(resp)

        def send(self, resp):
            body = resp.body
            headers = dict(resp.headers)
            if body is not None and not isinstance(body, bytes):
                body = json.dumps(body).encode()
                headers.setdefault("Content-Type", content_type(resp.status))
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
    args = ap.parse_args()

    pool = ConnectionPool(args.dsn, min_size=2, max_size=args.max_conns, open=True)
    pool.wait()
    shop = Shop(pool, faults=args.fault_injection)
    idem = Idempotent(pool, replay_ok=args.replay_200)
    host, port = args.listen.rsplit(":", 1)
    server = Server((host, int(port)), make_handler(shop, idem, args.charge_lease))
    print("listening on %s" % args.listen, file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        pool.close()


if __name__ == "__main__":
    main()
