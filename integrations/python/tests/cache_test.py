#!/usr/bin/env python3
"""integrations/python/tests/cache_test.py DSN -- checks of the round trips,
the literal quoting, the replay cache (ReplayCache) and the duplicate log
lines (log_duplicates), against a database with the extension, run with the
virtualenv's python (the installed wheel).  Prints "ok - ..." or
"not ok - ..." per check (integrations/python/test.sh numbers them)."""

import asyncio
import json
import logging
import re
import sys
import threading
import time
import uuid

import psycopg
from psycopg_pool import AsyncConnectionPool, ConnectionPool

import pg_idempotency
from pg_idempotency import (AsyncIdempotency, Idempotency, ReplayCache, Response, forget, http_scope,
                            idempotent, idempotent_async)
from pg_idempotency import _core
from pg_idempotency.asgi import IdempotencyMiddleware

DSN = sys.argv[1]
failed = 0


def check(cond, what, detail=None):
    global failed
    print(("ok - " if cond else "not ok - ") + what, flush=True)
    if not cond:
        failed += 1
        if detail is not None:
            for line in repr(detail).splitlines():
                print("#   " + line, flush=True)


def wait_for(cond, what, timeout=20.0):
    """Poll cond() until it holds; False after timeout seconds."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            print("#   gave up waiting for %s" % what, flush=True)
            return False
        time.sleep(0.02)
    return True


# Every statement the engine sends is one execute() (a simple query or one
# statement), commit() or rollback() on its connection: one round trip each.
class Counting(psycopg.Connection):
    calls = []  # (connection id, what), in order, for every connection

    def execute(self, query, *args, **kwargs):
        Counting.calls.append((id(self), "execute"))
        return super().execute(query, *args, **kwargs)

    def commit(self):
        Counting.calls.append((id(self), "commit"))
        return super().commit()

    def rollback(self):
        Counting.calls.append((id(self), "rollback"))
        return super().rollback()


class AsyncCounting(psycopg.AsyncConnection):
    calls = []

    async def execute(self, query, *args, **kwargs):
        AsyncCounting.calls.append("execute")
        return await super().execute(query, *args, **kwargs)

    async def commit(self):
        AsyncCounting.calls.append("commit")
        return await super().commit()

    async def rollback(self):
        AsyncCounting.calls.append("rollback")
        return await super().rollback()


db = psycopg.connect(DSN, autocommit=True)
db.execute("CREATE TABLE IF NOT EXISTS cache_writes (key text, n int)")


def record(key, scope):
    return db.execute("SELECT status, response_body::text FROM idempotency.idem_lookup(%s, %s)",
                      (key, scope)).fetchone()


def writes(key):
    return db.execute("SELECT count(*) FROM cache_writes WHERE key = %s", (key,)).fetchone()[0]


check("/site-packages/" in pg_idempotency.__file__ and "/src/" not in pg_idempotency.__file__,
      "pg_idempotency is the installed wheel (%s)" % pg_idempotency.__file__)

pool = ConnectionPool(DSN, min_size=1, max_size=4, connection_class=Counting, open=True)
pool.wait()


def writer(key, status=201, body=None, headers=None):
    """A handler that writes a row and answers status, body (default a
    small object), headers."""
    def handler(claim):
        claim.tx.execute("INSERT INTO cache_writes VALUES (%s, 1)", (key,))
        return Response(status, {"key": key, "n": writes(key) + 1} if body is None else body, headers)
    return handler


def answer(resp):
    """What goes on the wire: status, body bytes, headers."""
    body, headers = resp.encoded()
    return resp.status, body, headers


# ---- round trips -------------------------------------------------------------

eng = Idempotency(pool, log_duplicates="off")
key = str(uuid.uuid4())
Counting.calls.clear()
first = eng.handle("POST", "/rt", key, b'{"a": 1}', "u1", writer(key))
mine = [c for c in Counting.calls]
conns = {c for c, _ in mine}
check(first.outcome == "acquired" and len(conns) == 1 and [w for _, w in mine] == ["execute"] * 3,
      "a new key: BEGIN with idem_acquire, the handler's one write, idem_complete with COMMIT: 3 round trips",
      mine)
Counting.calls.clear()
replay = eng.handle("POST", "/rt", key, b'{"a": 1}', "u1", writer(key))
before_answer = list(Counting.calls)
check(replay.outcome == "replay" and [w for _, w in before_answer[:1]] == ["execute"]
      and "execute" not in [w for _, w in before_answer[1:]],
      "a replay: one round trip (BEGIN with idem_acquire) before its answer", before_answer)
check(wait_for(lambda: [w for _, w in Counting.calls] == ["execute", "rollback"], "the replay's ROLLBACK"),
      "the replay's ROLLBACK goes after its answer, and its connection back to the pool", Counting.calls)
check(answer(replay)[1] == answer(first)[1] and replay.headers.get("Idempotent-Replayed") == "true",
      "the replay: the first answer's bytes, Idempotent-Replayed: true", (answer(first), answer(replay)))
Counting.calls.clear()
lkey = str(uuid.uuid4())
leased = eng.handle("POST", "/rt", lkey, b"{}", "u1", lambda claim: Response(200, {"leased": True}), lease=5)
check(leased.outcome == "acquired" and [w for _, w in Counting.calls] == ["execute"] * 3,
      "lease mode: the claim in one autocommitted statement, then BEGIN, then idem_complete with COMMIT",
      Counting.calls)
# a pool connection goes back with its autocommit as it was
with pool.connection() as conn:
    check(conn.autocommit is False, "the pool's connections are given back with autocommit off, as taken")

# ---- literals ----------------------------------------------------------------

AWKWARD = ["it's", "back\\slash", "\\'", "E'\\x41'", "$$ $q$ %s %(x)s {}", "uni\u00e9 \u4e2d \U0001F600",
           "'); SELECT pg_sleep(10); --", "tab\tnewline\n", " ", "?" * 200]


def quoting(label, target_pool):
    e = Idempotency(target_pool, log_duplicates="off")
    bad = []
    run = uuid.uuid4().hex[:8]
    for k in AWKWARD:
        k += run
        scope = "scope " + k[:200]
        request = json.dumps({"k": k, "q": "\\\"'"})
        trace = k[:255]
        r1 = e.run(k, request, scope, lambda claim: Response(201, {"echo": k}), trace=trace)
        r2 = e.run(k, request, scope, lambda claim: Response(500, {}), trace=trace)
        rec = record(k, scope)
        ok = (r1.outcome == "acquired" and r2.outcome == "replay" and rec is not None
              and json.loads(rec[1]) == {"echo": k} and r2.headers.get("Idempotent-Origin-Trace") == trace)
        if not ok:
            bad.append((k, r1.outcome, r2.outcome, rec))
    check(not bad, "%s: keys, scopes, requests and traces with quotes, backslashes, $, %%, unicode go in exact"
          % label, bad)


quoting("standard_conforming_strings on", pool)
off = ConnectionPool(DSN + " options='-c standard_conforming_strings=off'", min_size=1, max_size=2, open=True)
quoting("standard_conforming_strings off", off)
off.close()
Counting.calls.clear()
try:
    idempotent(pool, "nul\x00key", {"a": 1}, lambda claim: 1)
    check(False, "a key with NUL is refused before it is sent")
except psycopg.DataError as err:
    check(Counting.calls == [] and "NUL" in str(err), "a key with NUL is refused before it is sent (%s)" % err,
          Counting.calls)

# ---- the replay cache --------------------------------------------------------

cache = ReplayCache()
check(cache.max_entries == 10000 and cache.max_entry_bytes == 65536 and cache.max_age == 60,
      "ReplayCache's defaults: max_entries 10,000, max_entry_bytes 65,536, max_age 60 s")
ceng = Idempotency(pool, replay_cache=cache, log_duplicates="off")
plain = Idempotency(pool, log_duplicates="off")
key = str(uuid.uuid4())
scope = http_scope("u2", "POST", "/c")
hdrs = {"Location": "/c/1", "ETag": '"e1"', "X-Not-Replayed": "no"}
first = ceng.handle("POST", "/c", key, b'{"c": 1}', "u2", writer(key, 201, None, hdrs))
check(first.outcome == "acquired" and (scope, key) in cache, "cache on: the first answer is put in once committed")
db_replay = plain.handle("POST", "/c", key, b'{"c": 1}', "u2", writer(key))
Counting.calls.clear()
cached = [ceng.handle("POST", "/c", key, b'{"c": 1}', "u2", writer(key)) for _ in range(3)]
check(Counting.calls == [] and all(c.cached and c.outcome == "replay" for c in cached),
      "cache on: the duplicates are answered without a database call", Counting.calls)
check(all(answer(c) == answer(db_replay) for c in cached) and list(answer(cached[0])[2]) == list(answer(db_replay)[2]),
      "cache on: a cached replay is the database's replay: status, body bytes, headers (in order)",
      (answer(db_replay), answer(cached[0])))
check(answer(cached[0])[1] == answer(first)[1] and writes(key) == 1,
      "cache on: the same bytes as the first answer, the handler ran once")

# a replay the database answered is put in too
key2 = str(uuid.uuid4())
plain.handle("POST", "/c", key2, b'{"c": 2}', "u2", writer(key2))
r = ceng.handle("POST", "/c", key2, b'{"c": 2}', "u2", writer(key2))
Counting.calls.clear()
again = ceng.handle("POST", "/c", key2, b'{"c": 2}', "u2", writer(key2))
check(r.outcome == "replay" and not r.cached and again.cached and Counting.calls == []
      and answer(again) == answer(r), "cache on: a replay the database returned is put in and answers the next one")

# other request bytes: to the database, which says mismatch or replay
Counting.calls.clear()
mm = ceng.handle("POST", "/c", key, b'{"c": 9}', "u2", writer(key))
check(mm.status == 422 and mm.outcome == "mismatch" and not mm.cached and Counting.calls != [],
      "cache on: another request with a cached key goes to the database and gets 422", answer(mm))
check(ceng.handle("POST", "/c", key, b'{"c": 1}', "u2", writer(key)).cached,
      "cache on: the entry still answers its own request after a mismatch")
Counting.calls.clear()
same_json = ceng.handle("POST", "/c", key, b'{"c":1}', "u2", writer(key))
check(same_json.outcome == "replay" and not same_json.cached and Counting.calls != [],
      "cache on: the same JSON in other bytes is not served from the cache (the database replays it)")

# never put in: in_progress, mismatch, released, failed
key3 = str(uuid.uuid4())


def releasing(claim):
    claim.release()
    return Response(503, {"again": True})


def raising(claim):
    raise RuntimeError("boom")


ceng.handle("POST", "/c", key3, b"{}", "u2", releasing)
ceng.handle("POST", "/c", key3 + "x", b"{}", "u2", raising)
check((scope, key3) not in cache and (scope, key3 + "x") not in cache,
      "cache on: a released claim and a failed handler put nothing in")
slow_pool = ConnectionPool(DSN + " options='-c idempotency.wait_timeout=100ms'", min_size=1, max_size=2, open=True)
slow = Idempotency(slow_pool, replay_cache=cache, log_duplicates="off")
inside, leave = threading.Event(), threading.Event()
key4 = str(uuid.uuid4())


def held(claim):
    inside.set()
    leave.wait(30)
    return Response(201, {"held": True})


holder = threading.Thread(target=lambda: ceng.handle("POST", "/c", key4, b"{}", "u2", held, lease=30))
holder.start()
inside.wait(30)
busy = slow.handle("POST", "/c", key4, b"{}", "u2", held)
check(busy.status == 409 and (scope, key4) not in cache, "cache on: in_progress puts nothing in", answer(busy))
leave.set()
holder.join()
check((scope, key4) in cache, "cache on: the lease-mode completion is put in once committed")
slow_pool.close()

# expiry by the database's clock: a key with a 1 s ttl
tkey = str(uuid.uuid4())
teng = Idempotency(pool, replay_cache=cache, ttl=1, log_duplicates="off")
teng.handle("POST", "/c", tkey, b"{}", "u2", writer(tkey))
check(teng.handle("POST", "/c", tkey, b"{}", "u2", writer(tkey)).cached, "ttl 1 s: the replay is cached at first")
# (idem_lookup shows the live record only: no row once it has expired)
expired = wait_for(lambda: db.execute(
    "SELECT clock_timestamp() > expires_at FROM idempotency.idem_lookup(%s, %s)", (tkey, scope)).fetchone()
    in (None, (True,)), "the database's clock to pass expires_at")
Counting.calls.clear()
after = teng.handle("POST", "/c", tkey, b"{}", "u2", writer(tkey))
check(expired and not after.cached and after.outcome == "acquired" and Counting.calls != [] and writes(tkey) == 2,
      "ttl 1 s: once the database's clock passes expires_at, the cache does not serve it", after.outcome)

# max_entries 2: the least recently used goes
small = ReplayCache(max_entries=2)
seng = Idempotency(pool, replay_cache=small, log_duplicates="off")
ks = [str(uuid.uuid4()) for _ in range(3)]
seng.handle("POST", "/c", ks[0], b"{}", "u2", writer(ks[0]))
seng.handle("POST", "/c", ks[1], b"{}", "u2", writer(ks[1]))
touched = seng.handle("POST", "/c", ks[0], b"{}", "u2", writer(ks[0]))  # ks[0] used last: ks[1] is the LRU
seng.handle("POST", "/c", ks[2], b"{}", "u2", writer(ks[2]))
check(touched.cached and len(small) == 2 and (scope, ks[0]) in small and (scope, ks[1]) not in small
      and (scope, ks[2]) in small, "max_entries 2, three keys: the least recently used is evicted")
Counting.calls.clear()
check(not seng.handle("POST", "/c", ks[1], b"{}", "u2", writer(ks[1])).cached and Counting.calls != [],
      "max_entries 2: the evicted key goes to the database")

# max_entry_bytes
tiny = ReplayCache(max_entry_bytes=100)
beng = Idempotency(pool, replay_cache=tiny, log_duplicates="off")
kb, ks_ = str(uuid.uuid4()), str(uuid.uuid4())
beng.handle("POST", "/c", kb, b"{}", "u2", writer(kb, 201, {"pad": "x" * 200}))
beng.handle("POST", "/c", ks_, b"{}", "u2", writer(ks_, 201, {"pad": "x"}))
rb = beng.handle("POST", "/c", kb, b"{}", "u2", writer(kb))
check((scope, kb) not in tiny and not rb.cached and rb.outcome == "replay" and (scope, ks_) in tiny,
      "max_entry_bytes 100: a 200-byte answer is not cached (its replay comes from the database), a small one is")

# max_age
aged = ReplayCache(max_age=0.3)
aeng = Idempotency(pool, replay_cache=aged, log_duplicates="off")
ka = str(uuid.uuid4())
aeng.handle("POST", "/c", ka, b"{}", "u2", writer(ka))
check(aeng.handle("POST", "/c", ka, b"{}", "u2", writer(ka)).cached
      and wait_for(lambda: aged.get(scope, ka, "{}") is None, "max_age to pass", 10)
      and not aeng.handle("POST", "/c", ka, b"{}", "u2", writer(ka)).cached,
      "max_age 0.3 s: the entry is served, then dropped once max_age has passed")

# forget evicts
kf = str(uuid.uuid4())
ceng.handle("POST", "/c", kf, b"{}", "u2", writer(kf))
held_before = (scope, kf) in cache
removed = ceng.forget(kf, scope)
again = ceng.handle("POST", "/c", kf, b"{}", "u2", writer(kf))
check(held_before and removed is True and again.outcome == "acquired" and writes(kf) == 2,
      "forget: idem_forget runs and the key is evicted: the next request runs the handler again")
check(forget(pool, kf, scope, replay_cache=cache) is True and (scope, kf) not in cache
      and forget(pool, kf, scope, replay_cache=cache) is False,
      "pg_idempotency.forget(pool, key, scope, replay_cache=...): the same, False when there was no record")

# the wrapper
wcache = ReplayCache()
kw, runs = str(uuid.uuid4()), []
v1 = idempotent(pool, kw, {"w": 1}, lambda claim: runs.append(1) or {"n": len(runs)}, replay_cache=wcache)
Counting.calls.clear()
v2 = idempotent(pool, kw, {"w": 1}, lambda claim: runs.append(1) or {"n": len(runs)}, replay_cache=wcache)
check(v1 == v2 == {"n": 1} and Counting.calls == [], "idempotent(..., replay_cache=): the replay from the cache")
try:
    idempotent(pool, str(uuid.uuid4()), {"w": 1}, lambda claim: {}, replay_cache=True)
    refused = False
except TypeError:
    refused = True
check(refused, "idempotent(..., replay_cache=True) is refused: a cache made for one call would never answer")

# an entry keeps its request's digest, not its text: its size is the answer's
big = ReplayCache(max_entry_bytes=100)
big_request = json.dumps({"pad": "x" * 1_000_000})
check(big.put("s", "k", big_request, 200, "{}", {}, None, time.monotonic(), 60)
      and len(big._entries[("s", "k")].request) == 32
      and big.get("s", "k", big_request) is not None and big.get("s", "k", big_request + " ") is None,
      "a 1 MB request: the entry keeps 32 bytes of it, and still tells the same request from another")

# many threads share one cache
shared = ReplayCache(max_entries=3)
teng2 = Idempotency(pool, replay_cache=shared, log_duplicates="off")
tkeys = [str(uuid.uuid4()) for _ in range(5)]
for k in tkeys:
    teng2.handle("POST", "/t", k, b'{"t": 1}', "u3", lambda claim, k=k: Response(201, {"k": k}))
errors = []


def hammer():
    for i in range(40):
        k = tkeys[i % 5]
        r = teng2.handle("POST", "/t", k, b'{"t": 1}', "u3", lambda claim: Response(500, {}))
        if (r.status, r.body) != (201, json.dumps({"k": k}).encode()):
            errors.append((k, r.status, r.body))


threads = [threading.Thread(target=hammer) for _ in range(6)]
for t in threads:
    t.start()
for t in threads:
    t.join()
check(not errors and len(shared) <= 3, "6 threads, 240 replays over 5 keys, 3 entries: every answer right", errors[:3])

# ---- ASGI: cached replays are the database's, headers and all ----------------


async def asgi_checks():
    apool = AsyncConnectionPool(DSN, min_size=1, max_size=4, connection_class=AsyncCounting, open=False)
    await apool.open()

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 201,
                    "headers": [(b"content-type", b"application/json"), (b"location", b"/o/7"),
                                (b"set-cookie", b"a=1")]})
        await send({"type": "http.response.body", "body": b'{"order":  7}'})

    with_cache = IdempotencyMiddleware(app, pool=apool, replay_cache=True, log_duplicates="off",
                                       user=lambda s: "9")
    without = IdempotencyMiddleware(app, pool=apool, log_duplicates="off", user=lambda s: "9")

    async def call(mw, key, body=b'{"o": 7}'):
        scope = {"type": "http", "method": "POST", "path": "/o", "headers": [
            (b"idempotency-key", key.encode()), (b"traceparent", b"00-" + b"a" * 32 + b"-" + b"b" * 16 + b"-01")]}
        got = []

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(msg):
            got.append(msg)

        await mw(scope, receive, send)
        return got[0]["status"], got[0]["headers"], got[1]["body"]

    k = str(uuid.uuid4())
    first = await call(with_cache, k)
    db_rep = await call(without, k)
    AsyncCounting.calls.clear()
    hit = await call(with_cache, k)
    check(AsyncCounting.calls == [] and hit == db_rep and hit[2] == first[2],
          "ASGI, cache on: the replay without a database call, the same status, headers and bytes as the "
          "database's replay", (first, db_rep, hit))
    AsyncCounting.calls.clear()
    mism = await call(with_cache, k, b'{"o": 8}')
    check(mism[0] == 422 and AsyncCounting.calls != [], "ASGI, cache on: another body gets 422 from the database")
    check(await with_cache.forget(k, http_scope("9", "POST", "/o")) is True
          and (await call(with_cache, k))[0] == 201 and (await call(with_cache, k))[0] == 201,
          "ASGI: the middleware's forget() evicts, and the key is new again")

    # async engine, 50 concurrent replays of one key from the cache
    aeng = AsyncIdempotency(apool, replay_cache=ReplayCache(), log_duplicates="off")
    ak = str(uuid.uuid4())

    async def h(claim):
        tx = await claim.tx
        await tx.execute("INSERT INTO cache_writes VALUES (%s, 1)", (ak,))
        return Response(201, {"ak": ak})

    await aeng.handle("POST", "/a", ak, b"[1]", "u4", h)
    AsyncCounting.calls.clear()
    rs = await asyncio.gather(*[aeng.handle("POST", "/a", ak, b"[1]", "u4", h) for _ in range(50)])
    check(all(r.cached and r.body == ('{"ak": "%s"}' % ak).encode() for r in rs) and AsyncCounting.calls == []
          and writes(ak) == 1, "asyncio: 50 concurrent replays from the cache, no database call")
    ak2 = str(uuid.uuid4())
    v = await idempotent_async(apool, ak2, [2], lambda claim: asyncio.sleep(0, [ak2]), replay_cache=aeng.replay_cache)
    AsyncCounting.calls.clear()
    v2 = await idempotent_async(apool, ak2, [2], lambda claim: asyncio.sleep(0, ["again"]),
                                replay_cache=aeng.replay_cache)
    check(v == v2 == [ak2] and AsyncCounting.calls == [], "idempotent_async(..., replay_cache=): from the cache")
    AsyncCounting.calls.clear()
    ak3 = str(uuid.uuid4())
    await aeng.handle("POST", "/a", ak3, b"[3]", "u4", h)
    new_calls = list(AsyncCounting.calls)
    AsyncCounting.calls.clear()
    plain_a = AsyncIdempotency(apool, log_duplicates="off")
    await plain_a.handle("POST", "/a", ak3, b"[3]", "u4", h)
    check(new_calls == ["execute"] * 3 and AsyncCounting.calls[:1] == ["execute"],
          "asyncio: a new key takes 3 round trips with one write, a replay 1 before its answer",
          (new_calls, AsyncCounting.calls))
    await asyncio.sleep(0)
    await apool.close()


asyncio.run(asgi_checks())

# ---- duplicate log lines -------------------------------------------------------


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


lines = Lines()
logger = logging.getLogger("pg_idempotency")
logger.addHandler(lines)
logger.setLevel(logging.INFO)
now = [1000.0]
_core.SAMPLED.clock = lambda: now[0]  # the sampler's clock, moved by hand
lk = str(uuid.uuid4())
leng = Idempotency(pool, replay_cache=True)  # log_duplicates: the default, sampled
leng.handle("POST", "/l", lk, b"{}", "u5", lambda claim: Response(200, {}))
for _ in range(100):
    leng.handle("POST", "/l", lk, b"{}", "u5", lambda claim: Response(200, {}))
check(len(lines.lines) == 1 and lines.lines[0].startswith("idempotency: replay"),
      "sampled (the default): 100 replays within a second write 1 line", lines.lines[:3])
now[0] += 1.0
leng.handle("POST", "/l", lk, b"{}", "u5", lambda claim: Response(200, {}))
check(len(lines.lines) == 2 and re.search(r"\(and 99 more duplicate answers not logged since \d\d:\d\d:\d\d\)$",
                                          lines.lines[1]),
      "sampled: a second later, the next line says how many were left out", lines.lines[1:])
now[0] += 0.5
leng.handle("POST", "/l", lk, b"{}", "u5", lambda claim: Response(200, {}))
now[0] += 0.6
leng.handle("POST", "/l", lk, b"{}", "u5", lambda claim: Response(200, {}))
check(len(lines.lines) == 3 and lines.lines[2].endswith("(and 1 more duplicate answers not logged since %s)"
                                                          % re.search(r"since (\S+)\)$", lines.lines[2]).group(1)),
      "sampled: at most one line a second", lines.lines[2:])
del lines.lines[:]
aeng = Idempotency(pool, replay_cache=True, log_duplicates="all")
for _ in range(5):
    aeng.handle("POST", "/l", lk, b"{}", "u5", lambda claim: Response(200, {}))
check(len(lines.lines) == 5 and all("replay" in x for x in lines.lines), "log_duplicates='all': a line each",
      lines.lines)
del lines.lines[:]
oeng = Idempotency(pool, log_duplicates="off")
for _ in range(5):
    oeng.handle("POST", "/l", lk, b"{}", "u5", lambda claim: Response(200, {}))
oeng.handle("POST", "/l", lk, b'{"other": 1}', "u5", lambda claim: Response(200, {}))
check(lines.lines == [], "log_duplicates='off': none", lines.lines)
try:
    Idempotency(pool, log_duplicates="some")
    check(False, "log_duplicates must be sampled, all or off")
except ValueError:
    check(True, "log_duplicates must be sampled, all or off")

pool.close()
sys.exit(1 if failed else 0)
