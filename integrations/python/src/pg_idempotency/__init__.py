"""pg_idempotency -- exactly-once endpoints and jobs over the idempotency
PostgreSQL extension, with psycopg 3.

    from pg_idempotency import idempotent
    result = idempotent(pool, key, request, fn)        # a job, a queue message

    from pg_idempotency.asgi import IdempotencyMiddleware   # FastAPI, Starlette
    "pg_idempotency.django.IdempotencyMiddleware"          # Django's MIDDLEWARE

The handler (fn, the view) runs inside the transaction that claimed the key:
its writes commit with the stored answer, or roll back with the claim.  A
retry gets the stored answer; a retry while the first attempt runs gets
InProgress (HTTP 409 with Retry-After); the key with another request gets
Mismatch (HTTP 422).

replay_cache=ReplayCache(...) (or True) keeps completed answers in the
process and answers their replays without the database; log_duplicates=
"sampled" (the default: at most a line a second), "all" or "off" for the
duplicates' log lines; forget() runs idem_forget and evicts the key from
the cache given.

Behind a PL/Proxy router (idempotency_proxy): Shards(router_pool) sends
acquire, complete and release straight to the shard that owns the key, and
through the router only when it must (AsyncShards for asyncio);
key_hash(scope, key) is the cluster's idempotency.key_hash()."""

from ._async import AsyncClaim, AsyncIdempotency, forget_async, idempotent_async
from ._core import (REPLAYED_HEADERS, IdempotencyError, InProgress, Mismatch, ReplayCache, Response,
                    content_type, http_scope, problem)
from ._shards import AsyncShards, ShardAnswer, Shards, ShardsLayout, key_hash
from ._sync import Claim, Idempotency, forget, idempotent

__version__ = "0.1.0"

__all__ = ["AsyncClaim", "AsyncIdempotency", "AsyncShards", "Claim", "Idempotency", "IdempotencyError",
           "InProgress", "Mismatch", "REPLAYED_HEADERS", "ReplayCache", "Response", "ShardAnswer", "Shards",
           "ShardsLayout", "content_type", "forget", "forget_async", "http_scope", "idempotent", "idempotent_async",
           "key_hash", "problem"]
