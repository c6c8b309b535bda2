"""pg_idempotency.django -- exactly-once write views for Django, over a
psycopg 3 connection pool of the middleware's own.

    # settings.py
    MIDDLEWARE = [..., "pg_idempotency.django.IdempotencyMiddleware"]
    IDEMPOTENCY = {"DSN": "dbname=shop", "LEASES": {"/api/charges": 30}}

    # a view
    def create_payment(request):
        tx = request.idempotency.tx        # the transaction that claimed the key
        tx.execute("INSERT ...")
        return JsonResponse({...}, status=201)

IDEMPOTENCY's keys: DSN (a libpq connection string; or POOL, a
psycopg_pool.ConnectionPool), MAX_CONNS (20), LEASES ({path: seconds},
or a function of (method, path)), USER (a function of the request, or its
dotted path, giving the user a key's scope holds; default the
authenticated request.user's pk), REPLAY_200 (a replayed 2xx is answered
200), TTL (seconds), METHODS (POST, PUT, PATCH, DELETE), SKIP_PATHS
(/health, /metrics), REPLAY_CACHE (a pg_idempotency.ReplayCache, True for
one with the defaults, or a dict of its options), LOG_DUPLICATES
("sampled", the default: at most a line a second; "all"; "off").

The view's writes on request.idempotency.tx commit with its stored
answer.  Django's ORM uses Django's own connection, which is not that
transaction: write through tx what must commit with the answer."""

import threading

from django.conf import settings
from django.http import HttpResponse
from django.utils.module_loading import import_string

from ._core import ReplayCache
from ._sync import Idempotency

__all__ = ["IdempotencyMiddleware"]

_pools = {}
_pools_lock = threading.Lock()


def _pool(conf):
    if conf.get("POOL") is not None:
        return conf["POOL"]
    from psycopg_pool import ConnectionPool

    dsn, size = conf.get("DSN", ""), int(conf.get("MAX_CONNS", 20))
    with _pools_lock:
        if (dsn, size) not in _pools:
            pool = ConnectionPool(dsn, min_size=min(2, size), max_size=size, open=True)
            pool.wait()
            _pools[(dsn, size)] = pool
        return _pools[(dsn, size)]


def _default_user(request):
    user = getattr(request, "user", None)
    if user is not None and getattr(user, "is_authenticated", False):
        return str(user.pk)
    return None


class _Answer:
    def __init__(self, status, body, headers):
        self.status = status
        self.body = body
        self.headers = headers
        self.outcome = None


class IdempotencyMiddleware:
    def __init__(self, get_response):
        conf = getattr(settings, "IDEMPOTENCY", {})
        self.get_response = get_response
        cache = conf.get("REPLAY_CACHE")
        if isinstance(cache, dict):
            cache = ReplayCache(**{k.lower(): v for k, v in cache.items()})
        self.engine = Idempotency(_pool(conf), replay_ok=bool(conf.get("REPLAY_200")), ttl=conf.get("TTL"),
                                  replay_cache=cache, log_duplicates=conf.get("LOG_DUPLICATES") or "sampled")
        self.leases = conf.get("LEASES") or {}
        user = conf.get("USER") or _default_user
        self.user = import_string(user) if isinstance(user, str) else user
        self.methods = set(conf.get("METHODS") or ("POST", "PUT", "PATCH", "DELETE"))
        self.skip_paths = set(conf.get("SKIP_PATHS") or ("/health", "/metrics"))

    def forget(self, key, scope):
        """idem_forget, then the key evicted from this middleware's cache
        (scope: pg_idempotency.http_scope(user, method, path))."""
        return self.engine.forget(key, scope)

    def _lease(self, method, path):
        if callable(self.leases):
            return self.leases(method, path)
        return self.leases.get(path)

    def __call__(self, request):
        if request.method not in self.methods or request.path in self.skip_paths:
            return self.get_response(request)
        first = {}

        def handler(claim):
            request.idempotency = claim
            response = self.get_response(request)
            failure = getattr(request, "_idempotency_error", None)
            if failure is not None:
                raise failure  # the view raised: roll back, store nothing
            first["response"] = response
            return _Answer(response.status_code, response.content, dict(response.items()))

        resp = self.engine.handle(request.method, request.path, request.headers.get("Idempotency-Key"),
                                  request.body, self.user(request), handler,
                                  lease=self._lease(request.method, request.path),
                                  trace=request.headers.get("traceparent"))
        if resp.outcome == "released":
            return first["response"]
        body, headers = resp.encoded()
        out = HttpResponse(body or b"", status=resp.status)
        if not any(k.lower() == "content-type" for k in headers):
            del out["Content-Type"]
        if resp.outcome == "acquired":
            # the view's other headers and cookies go out with the first answer only
            view = first["response"]
            for k, v in view.items():
                if k.lower() not in ("content-type", "content-length"):
                    out[k] = v
            out.cookies = view.cookies
        for k, v in headers.items():
            out[k] = v
        return out

    def process_exception(self, request, exception):
        """A view that raised: noted, so that its transaction is rolled back
        (Django turns the exception into a 500 before it reaches __call__)."""
        if getattr(request, "idempotency", None) is not None:
            request._idempotency_error = exception
        return None
