#!/usr/bin/env python3
"""The conformance app of pg_idempotency.asgi: the endpoints, flags and log
lines of examples/python/server.py, on FastAPI or Starlette, run by uvicorn.

    asgi_shop.py --framework fastapi|starlette --dsn DSN --listen 127.0.0.1:PORT
                 [--charge-lease 2] [--replay-200] [--fault-injection]

Every duplicate answer is logged (log_duplicates="all": the HTTP test reads
the lines).  IDEM_REPLAY_CACHE=1 in the environment: with the replay cache
(ReplayCache's defaults).

Uses pg_idempotency as installed (the wheel), not the source tree."""

import argparse
import asyncio
import hashlib
import json
import logging
import os
import sys

import uvicorn
from psycopg_pool import AsyncConnectionPool
from starlette.responses import JSONResponse, Response

import pg_idempotency
from pg_idempotency.asgi import IdempotencyMiddleware, get_claim

SKIP_PATHS = {"/health", "/metrics"}


class WorkerDied(BaseException):
    """Raised (--fault-injection) to play a worker that dies: nothing is
    answered, stored or released; the claim is left to its lease."""


def problem(status, typ, title, detail=None, headers=None):
    body = {"type": "https://example.com/problems/" + typ, "title": title, "status": status}
    if detail:
        body["detail"] = detail
    return JSONResponse(body, status, headers, media_type="application/problem+json")


class Shop:
    def __init__(self, pool, faults):
        self.pool = pool
        self.faults = faults

    async def health(self, request):
        return JSONResponse({"status": "ok"})

    async def metrics(self, request):
        return Response(b"# no metrics in this example\n", media_type="text/plain")

    async def get_payment(self, request):
        async with self.pool.connection() as conn:
            cur = await conn.execute("SELECT order_id, amount, currency FROM shop.payments"
                                     " WHERE id = %s AND user_id = %s",
                                     (int(request.path_params["id"]), request.scope["user_id"]))
            row = await cur.fetchone()
        if row is None:
            return problem(404, "not-found", "no such payment")
        return JSONResponse({"order_id": row[0], "amount": row[1], "currency": row[2]})

    async def create_payment(self, request):
        claim = get_claim(request)
        user = request.scope["user_id"]
        p = json.loads(await request.body() or b"null")
        if not isinstance(p, dict) or not p.get("order_id") or not isinstance(p.get("amount"), int) \
                or p["amount"] < 1:
            return problem(400, "invalid-payment", "order_id and a positive amount are required")
        currency = p.get("currency") or "EUR"
        tx = await claim.tx
        await tx.execute("INSERT INTO shop.payment_attempts (idempotency_key, user_id, source) VALUES (%s, %s, %s)",
                         (claim.key, user, p.get("source")))
        if p.get("source") == "tok_fail":
            return problem(500, "processor-error", "the payment processor failed")
        if p.get("source") == "tok_retry":
            await claim.release()
            return problem(503, "processor-unavailable", "the payment processor is unavailable, try again",
                           headers={"Retry-After": "1"})
        cur = await tx.execute("INSERT INTO shop.payments (idempotency_key, user_id, order_id, amount, currency)"
                               " VALUES (%s, %s, %s, %s, %s) RETURNING id",
                               (claim.key, user, p["order_id"], p["amount"], currency))
        (pid,) = await cur.fetchone()
        return JSONResponse({"payment_id": pid, "order_id": p["order_id"], "amount": p["amount"],
                             "currency": currency, "status": "succeeded"}, 201,
                            {"Location": "/api/payments/%d" % pid, "ETag": '"payment-%d-1"' % pid})

    async def create_order(self, request):
        claim = get_claim(request)
        o = json.loads(await request.body() or b"null")
        if not isinstance(o, dict) or not o.get("sku") or not isinstance(o.get("quantity"), int) \
                or o["quantity"] < 1:
            return problem(400, "invalid-order", "sku and a positive quantity are required")
        tx = await claim.tx
        cur = await tx.execute("UPDATE shop.stock SET quantity = quantity - %s"
                               " WHERE sku = %s AND quantity >= %s RETURNING quantity",
                               (o["quantity"], o["sku"], o["quantity"]))
        row = await cur.fetchone()
        if row is None:
            return problem(409, "out-of-stock", "not enough stock of " + o["sku"])
        cur = await tx.execute("INSERT INTO shop.stock_moves (idempotency_key, user_id, sku, quantity)"
                               " VALUES (%s, %s, %s, %s) RETURNING id",
                               (claim.key, request.scope["user_id"], o["sku"], -o["quantity"]))
        (oid,) = await cur.fetchone()
        return JSONResponse({"order_id": oid, "sku": o["sku"], "quantity": o["quantity"], "stock_left": row[0]},
                            201)

    async def create_charge(self, request):
        """Lease mode: the claim is committed before the slow outside call,
        kept alive during it; the checkpoint "charged" lets a takeover
        resume without calling the provider again."""
        claim = get_claim(request)
        c = json.loads(await request.body() or b"null")
        if not isinstance(c, dict) or not c.get("order_id") or not isinstance(c.get("amount"), int) \
                or c["amount"] < 1:
            return problem(400, "invalid-charge", "order_id and a positive amount are required")
        if claim.resumed is not None and claim.resumed[0] == "charged":
            ref = claim.resumed[1]["charge_id"]
        else:
            async with claim.keep_alive():
                ref = await self.call_provider(claim.key, c["amount"], c.get("delay_ms", 0) / 1000)
            await claim.checkpoint("charged", {"charge_id": ref})
            if self.faults and request.headers.get("X-Fault") == "die-after-charge":
                sys.stderr.write("worker died (X-Fault) on POST %s\n" % request.url.path)
                raise WorkerDied()
        tx = await claim.tx
        cur = await tx.execute("INSERT INTO shop.charges (idempotency_key, user_id, order_id, amount,"
                               " provider_ref) VALUES (%s, %s, %s, %s, %s) RETURNING id",
                               (claim.key, request.scope["user_id"], c["order_id"], c["amount"], ref))
        (cid,) = await cur.fetchone()
        return JSONResponse({"charge_id": cid, "order_id": c["order_id"], "amount": c["amount"],
                             "provider_ref": ref}, 201)

    async def call_provider(self, key, amount, delay):
        """Stands in for the outside service (see examples/python/server.py)."""
        async with self.pool.connection() as conn:
            await conn.execute("INSERT INTO shop.provider_calls (idempotency_key, amount) VALUES (%s, %s)",
                               (key, amount))
        await asyncio.sleep(delay)
        return "ch_" + hashlib.sha256(key.encode()).hexdigest()[:16]


class RequireUser:
    """The stand-in for authentication: X-User-ID, a number (401 without)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            user = dict(scope["headers"]).get(b"x-user-id", b"").decode("latin-1")
            if scope["path"] not in SKIP_PATHS and not user.isdigit():
                await problem(401, "unauthenticated", "X-User-ID header missing or not a number")(
                    scope, receive, send)
                return
            scope = dict(scope, user_id=user or None)
        await self.app(scope, receive, send)


def build(framework, pool, args):
    shop = Shop(pool, args.fault_injection)
    routes = [
        ("GET", "/health", shop.health), ("GET", "/metrics", shop.metrics),
        ("GET", "/api/payments/{id:int}", shop.get_payment), ("POST", "/api/payments", shop.create_payment),
        ("POST", "/api/orders", shop.create_order), ("POST", "/api/charges", shop.create_charge),
    ]
    idem = dict(pool=pool, leases={"/api/charges": args.charge_lease}, replay_ok=args.replay_200,
                user=lambda scope: scope.get("user_id"), log_duplicates="all",
                replay_cache=os.environ.get("IDEM_REPLAY_CACHE") == "1")

    async def open_pool():
        await pool.open()
        await pool.wait()

    async def close_pool():
        await pool.close()

    if framework == "fastapi":
        from fastapi import FastAPI, Request

        app = FastAPI(on_startup=[open_pool], on_shutdown=[close_pool])
        def endpoint(fn):
            async def run(request: Request):
                return await fn(request)
            return run

        for method, path, fn in routes:
            app.add_api_route(path.replace(":int", ""), endpoint(fn), methods=[method])
        app.add_middleware(IdempotencyMiddleware, **idem)
        app.add_middleware(RequireUser)  # added last: runs first
        return app
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route

    return Starlette(routes=[Route(path, fn, methods=[method]) for method, path, fn in routes],
                     middleware=[Middleware(RequireUser), Middleware(IdempotencyMiddleware, **idem)],
                     on_startup=[open_pool], on_shutdown=[close_pool])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--framework", choices=("fastapi", "starlette"), default="fastapi")
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
    logging.info("pg_idempotency %s from %s%s", pg_idempotency.__version__, pg_idempotency.__file__,
                 ", replay cache on" if os.environ.get("IDEM_REPLAY_CACHE") == "1" else "")
    pool = AsyncConnectionPool(args.dsn, min_size=2, max_size=args.max_conns, open=False)
    host, port = args.listen.rsplit(":", 1)
    uvicorn.run(build(args.framework, pool, args), host=host, port=int(port), log_config=None,
                backlog=128, timeout_keep_alive=5)


if __name__ == "__main__":
    main()
