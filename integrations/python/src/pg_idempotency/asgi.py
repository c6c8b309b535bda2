"""pg_idempotency.asgi -- exactly-once write endpoints for ASGI apps
(FastAPI, Starlette), over a psycopg_pool.AsyncConnectionPool.

    app.add_middleware(IdempotencyMiddleware, pool=pool, leases={"/api/charges": 30})

    @app.post("/api/payments")
    async def create_payment(request: Request):
        claim = get_claim(request)
        tx = await claim.tx          # the transaction that claimed the key
        await tx.execute("INSERT ...")
        return JSONResponse({...}, status_code=201)

Requests whose method is in methods (POST, PUT, PATCH, DELETE), except
skip_paths, go through AsyncIdempotency.handle: the app runs inside the
claim's transaction, its answer is held back, stored with idem_complete
and committed, then sent.  Its body must be JSON (or empty)."""

from ._async import AsyncIdempotency

__all__ = ["IdempotencyMiddleware", "get_claim"]


def get_claim(request):
    """The AsyncClaim of the request (a Starlette/FastAPI Request or an ASGI
    scope) that the middleware let through; None outside it."""
    scope = request if isinstance(request, dict) else request.scope
    return scope.get("idempotency")


def _default_user(scope):
    """The authenticated user of Starlette's AuthenticationMiddleware, if any."""
    user = scope.get("user")
    if user is not None and getattr(user, "is_authenticated", False):
        return str(getattr(user, "identity", None) or user.display_name)
    return None


class IdempotencyMiddleware:
    """ASGI middleware.  pool: an opened psycopg_pool.AsyncConnectionPool.
    leases: {path: seconds} (or a function of (method, path)) for lease
    mode.  user: a function of the ASGI scope giving the user the scope of
    a key holds (default: Starlette's scope["user"]).  replay_ok: a
    replayed 2xx is answered 200.  ttl: seconds records are kept.
    replay_cache: a ReplayCache (or True: one with the defaults) that
    answers replays of completed answers without the database.
    log_duplicates: "sampled" (at most a line a second), "all" or "off"."""

    def __init__(self, app, pool, leases=None, user=None, replay_ok=False, ttl=None,
                 methods=("POST", "PUT", "PATCH", "DELETE"), skip_paths=("/health", "/metrics"),
                 replay_cache=None, log_duplicates="sampled"):
        self.app = app
        self.engine = AsyncIdempotency(pool, replay_ok=replay_ok, ttl=ttl, replay_cache=replay_cache,
                                       log_duplicates=log_duplicates)
        self.leases = leases or {}
        self.user = user or _default_user
        self.methods = set(methods)
        self.skip_paths = set(skip_paths)

    async def forget(self, key, scope):
        """idem_forget, then the key evicted from this middleware's cache
        (scope: pg_idempotency.http_scope(user, method, path))."""
        return await self.engine.forget(key, scope)

    def _lease(self, method, path):
        if callable(self.leases):
            return self.leases(method, path)
        return self.leases.get(path)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in self.methods or scope["path"] in self.skip_paths:
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        body = b"".join(chunks)
        headers = {}
        for k, v in scope["headers"]:
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        method, path = scope["method"], scope["path"]
        first = {}

        async def handler(claim):
            inner = dict(scope, idempotency=claim)
            inner["state"] = dict(scope.get("state") or {}, idempotency=claim)
            given = [False]

            async def replay_receive():
                if not given[0]:
                    given[0] = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            out = []

            async def capture(msg):
                if msg["type"] == "http.response.start":
                    first["status"] = msg["status"]
                    first["headers"] = [(k.decode("latin-1"), v.decode("latin-1"))
                                        for k, v in msg.get("headers", [])]
                elif msg["type"] == "http.response.body":
                    out.append(msg.get("body", b""))

            await self.app(inner, replay_receive, capture)
            if "status" not in first:
                raise RuntimeError("the app sent no answer")
            first["body"] = b"".join(out)
            return _Answer(first["status"], first["body"], dict(first["headers"]))

        resp = await self.engine.handle(method, path, headers.get("idempotency-key"), body,
                                        self.user(scope), handler, lease=self._lease(method, path),
                                        trace=headers.get("traceparent"))
        if resp.outcome == "released":
            # sent as the app answered it
            await _send(send, first["status"], first["headers"], first["body"])
            return
        out_body, out_headers = resp.encoded()
        if resp.outcome == "acquired":
            # the app's other headers (Set-Cookie twice, say) go out with
            # the first answer only
            kept = [(k, v) for k, v in first["headers"]
                    if k.lower() not in ("content-type", "content-length")
                    and k.lower() not in {h.lower() for h in out_headers}]
            items = kept + list(out_headers.items())
        else:
            items = list(out_headers.items())
        await _send(send, resp.status, items, out_body)


class _Answer:
    """An app's answer as the engine sees it (a Response)."""

    def __init__(self, status, body, headers):
        self.status = status
        self.body = body
        self.headers = headers
        self.outcome = None


async def _send(send, status, items, body):
    body = body or b""
    headers = [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in items
               if k.lower() != "content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
