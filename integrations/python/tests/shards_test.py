#!/usr/bin/env python3
"""integrations/python/tests/shards_test.py DSN PREFIX -- checks of Shards
against a real idempotency_proxy cluster, run with the virtualenv's python
(the installed wheel).  DSN names the server ("host=... port=... user=..."),
where integrations/python/test.sh has made (scripts/common.sh,
make_shard_dbs PREFIX) the router database PREFIX_router (idempotency_proxy)
and the shard databases PREFIX_shard0, 1 and 2 (idempotency), all empty.
The port of the Go package's TestShards (integrations/go/shards_db_test.go):
its steps in order, the cluster declared on the router with
cluster_create, grown half way through with cluster_grow.  Prints "ok - ..."
or "not ok - ..." per check (test.sh numbers them)."""

import asyncio
import os
import re
import sys
import threading
import traceback

import psycopg

import pg_idempotency
from psycopg_pool import AsyncConnectionPool

from pg_idempotency import AsyncShards, IdempotencyError, ShardAnswer, Shards, key_hash
from pg_idempotency import _shards

DSN, PREFIX = sys.argv[1], sys.argv[2]
SCOPE = "py"
failed = 0


def check(cond, what, detail=None):
    global failed
    print(("ok - " if cond else "not ok - ") + what, flush=True)
    if not cond:
        failed += 1
        if detail is not None:
            print("#   %r" % (detail,), flush=True)
    return cond


def step(what, fn):
    """Run a step; an exception it raises is a failed check."""
    try:
        fn()
    except Exception:  # noqa: BLE001 -- reported, the next step runs
        check(False, "%s: ran to its end" % what)
        for line in traceback.format_exc().splitlines():
            print("#   " + line, flush=True)


def connstr(db):
    return "%s dbname=%s" % (DSN, db)


router = psycopg.connect(connstr(PREFIX + "_router"), autocommit=True)
conn = [connstr("%s_shard%d" % (PREFIX, i)) for i in range(3)]
shards = [psycopg.connect(c, autocommit=True) for c in conn]


def on(scope, key):
    """Which of the shards hold a record of (scope, key): their indexes,
    comma-separated."""
    return ",".join(str(i) for i, db in enumerate(shards)
                    if db.execute("SELECT count(*) FROM idempotency.records WHERE scope = %s AND key = %s",
                                  (scope, key)).fetchone()[0] > 0)


def acquire(s, key, request, want):
    """s.acquire as the Go test calls it (an hour's TTL, a minute's lease);
    raises if the outcome is not want."""
    a = s.acquire(key, request, SCOPE, ttl=3600, lease=60)
    if a.outcome != want:
        raise AssertionError("acquire(%r) = %r, want %r" % (key, a.outcome, want))
    return a


def key_in(p, n, prefix):
    """The first key prefix-0, prefix-1... of SCOPE in partition p of n."""
    i = 0
    while True:
        k = "%s-%d" % (prefix, i)
        if key_hash(SCOPE, k) & (n - 1) == p:
            return k
        i += 1


check("/site-packages/" in pg_idempotency.__file__ and "/src/" not in pg_idempotency.__file__,
      "pg_idempotency is the installed wheel (%s)" % pg_idempotency.__file__)

# the statements: the Go package's text (integrations/go/shards.go)
go_sql = dict(re.findall(r"(\w+SQL)\s*=\s*`([^`]*)`",
                         open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "go",
                                           "shards.go")).read()))
for go_name, name in [("shardAcquireSQL", "shard_acquire"), ("routerAcquireSQL", "router_acquire"),
                      ("completeSQL", "complete"), ("releaseSQL", "release"), ("layoutSQL", "layout"),
                      ("clusterSQL", "cluster")]:
    check(go_sql.get(go_name) == _shards._GO_SQL[name], "the %s statement is the Go package's %s" % (name, go_name),
          (go_sql.get(go_name), _shards._GO_SQL[name]))

router.execute("SELECT count(*) FROM idempotency.cluster_create(ARRAY[%s, %s])", (conn[0], conn[1]))


def hashes():
    cases = [("", ""), (SCOPE, "k"), ("user-7:/payments", "ключ-ü-€-😀"), ("a\tb", "x" * 300),
             ("scope", "it's $$ \\ \"q\"")]
    for scope, key in cases:
        (on_shard,) = shards[0].execute("SELECT idempotency.shard_key_hash(%s, %s)", (scope, key)).fetchone()
        (on_router,) = router.execute("SELECT idempotency.key_hash(%s, %s)", (scope, key)).fetchone()
        got = key_hash(scope, key)
        check(got == on_shard == on_router and -2**31 <= got < 2**31,
              "key_hash(%r, %r) is the shard's shard_key_hash() and the router's key_hash()"
              % (scope, key[:20]), (got, on_shard, on_router))


step("key_hash", hashes)

s = Shards(router, max_age=3600)
# two more applications, whose layout the growth below leaves behind; one
# with a connection per shard (config), whose statements can be looked at
stale = Shards(router, max_age=3600)
stale_conns = {}


def one_connection(c):
    stale_conns[c] = psycopg.connect(c, autocommit=True)
    return stale_conns[c]


stale_complete = Shards(router, config=one_connection, max_age=3600)


def direct_v1():
    lay = s.layout()
    check(lay.direct and lay.version == 1 and lay.partitions == 2,
          "direct over layout 1, 2 partitions", lay)


step("layout 1", direct_v1)


def each_key():
    wrong = []
    for i in range(16):
        key = "k%d" % i
        a = acquire(s, key, '{"n": %d}' % i, "acquired")
        owner = str(key_hash(SCOPE, key) & 1)
        if on(SCOPE, key) != owner:
            wrong.append("%s on %r, owner %s" % (key, on(SCOPE, key), owner))
        done = s.complete(key, 201, '{"id": %d}' % i, SCOPE, claim=a.claim, headers={"Location": "/x"})
        if done is not True:
            wrong.append("complete(%s) = %r" % (key, done))
        r = acquire(s, key, '{"n": %d}' % i, "replay")
        if (r.response_status, r.response_body, r.response_headers) != (201, '{"id": %d}' % i, '{"location": "/x"}'):
            wrong.append("replay of %s: %r" % (key, r))
        acquire(s, key, '{"n": -1}', "mismatch")
        # the router finds the same record
        (outcome,) = router.execute("SELECT outcome FROM idempotency.idem_acquire(%s, %s::jsonb, %s)",
                                    (key, '{"n": %d}' % i, SCOPE)).fetchone()
        if outcome != "replay":
            wrong.append("through the router, %s: %s" % (key, outcome))
    check(not wrong, "16 keys: each acquired on its owner only, completed, replayed (status, body, headers) "
          "and mismatched there; the router replays them", wrong)
    counts = [db.execute("SELECT count(*) FROM idempotency.records WHERE scope = %s", (SCOPE,)).fetchone()[0]
              for db in shards]
    check(0 < counts[0] < 16 and counts[0] + counts[1] == 16 and counts[2] == 0,
          "the 16 records are spread over shards 0 and 1, none on 2", counts)


step("each key on its owner", each_key)


def held():
    a = acquire(s, "held", "{}", "acquired")
    acquire(s, "held", "{}", "in_progress")
    check(s.release("held", SCOPE, claim=a.claim) is True, "release of a claim: true")
    a = acquire(s, "held", "{}", "acquired")
    check(s.complete("held", 200, None, SCOPE, claim=a.claim) is True,
          "acquired again after the release, completed with no body")
    r = acquire(s, "held", "{}", "replay")
    check(r.response_status == 200 and r.response_body is None, "its replay: 200, no body", r)


step("in progress, released, acquired again", held)


def threads():
    errors = []

    def run(t):
        try:
            for i in range(10):
                key = "thread-%d-%d" % (t, i)
                a = s.acquire(key, "{}", SCOPE)
                s.complete(key, 200, '{"t": %d}' % t, SCOPE, claim=a.claim)
                if s.acquire(key, "{}", SCOPE).response_body != '{"t": %d}' % t:
                    errors.append(key)
        except Exception as err:  # noqa: BLE001
            errors.append(repr(err))

    ts = [threading.Thread(target=run, args=(t,)) for t in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    check(not errors, "8 threads on one Shards, 10 keys each: acquired, completed, replayed", errors[:5])


step("threads", threads)


def prepared():
    # stale_complete's own connection to shard 0: the statements prepared
    # there, once, with the Go package's text
    acquire(stale_complete, key_in(0, 2, "prep"), "{}", "acquired")
    for i in range(3):
        acquire(stale_complete, key_in(0, 2, "prep-%d" % i), "{}", "acquired")
    c = stale_conns[conn[0]]
    rows = c.execute("SELECT statement FROM pg_prepared_statements WHERE statement LIKE %s",
                     ("%shard_acquire%",)).fetchall()
    check(len(rows) == 1 and rows[0][0] == _shards._GO_SQL["shard_acquire"],
          "a shard's connection prepares shard_acquire once, the Go package's text", rows)
    (n,) = c.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
    check(n == 2, "... and the layout's statement: 2 prepared there in all", n)


step("prepared statements", prepared)


def skip_router_and_own_tx():
    # a Shards with a router connection of its own: what it prepared there
    # shows whether a call went through the router
    rconn = psycopg.connect(connstr(PREFIX + "_router"), autocommit=True)
    mine = {}

    def cfg(c):
        mine[c] = psycopg.connect(c, autocommit=True)
        return mine[c]

    d = Shards(rconn, config=cfg, max_age=3600)
    try:
        for i in range(4):
            key = key_in(i % 2, 2, "direct-%d" % i)
            a = acquire(d, key, "{}", "acquired")
            d.complete(key, 200, "{}", SCOPE, claim=a.claim)
            acquire(d, key, "{}", "replay")
        stmts = [r[0] for r in rconn.execute("SELECT statement FROM pg_prepared_statements").fetchall()]
        check(len(stmts) == 1 and "cluster_state" in stmts[0],
              "while direct no call goes through the router: its connection prepared the placement's "
              "statement only", stmts)
        # a shard's connection inside a transaction that is not Shards' own:
        # an error, and no claim left behind (rolled back with it)
        key = key_in(0, 2, "in-tx")
        c0 = mine[conn[0]]
        c0.execute("BEGIN")
        got = None
        try:
            d.acquire(key, "{}", SCOPE)
        except IdempotencyError as err:
            got = err
        status = c0.info.transaction_status
        if status != psycopg.pq.TransactionStatus.IDLE:
            c0.execute("ROLLBACK")
        check(isinstance(got, IdempotencyError) and on(SCOPE, key) == "",
              "a shard connection inside another transaction: IdempotencyError, no claim left", (got, on(SCOPE, key)))
        acquire(d, key, "{}", "acquired")
    finally:
        d.close()
        rconn.close()


step("no router while direct; a connection in a transaction", skip_router_and_own_tx)

# AsyncShards: on one event loop, for all its steps
loop = asyncio.new_event_loop()
arouter_pool = AsyncConnectionPool(connstr(PREFIX + "_router"), min_size=1, open=False)
loop.run_until_complete(arouter_pool.open())
arouter_conn = loop.run_until_complete(psycopg.AsyncConnection.connect(connstr(PREFIX + "_router")))
ash = ash2 = None


def async_direct():
    global ash, ash2

    async def run():
        global ash, ash2
        # two applications: ash over the router's pool, ash2 over one
        # connection (not in autocommit: it is switched for each call)
        ash = await AsyncShards.create(arouter_pool, max_age=3600)
        ash2 = await AsyncShards.create(arouter_conn, max_age=3600)
        lay = ash.layout()
        check(lay.direct and lay.version == 1 and lay.partitions == 2 and ash2.layout() == lay,
              "AsyncShards: direct over layout 1, 2 partitions", (lay, ash2.layout()))
        keys = ["async-k%d" % i for i in range(12)]
        first = await asyncio.gather(*(ash.acquire(k, {"n": i}, SCOPE, ttl=3600, lease=60)
                                       for i, k in enumerate(keys)))
        check([a.outcome for a in first] == ["acquired"] * 12, "AsyncShards: 12 keys acquired at once",
              [a.outcome for a in first])
        where = [on(SCOPE, k) == str(key_hash(SCOPE, k) & 1) for k in keys]
        check(all(where), "AsyncShards: each on its owner only", where)
        done = await asyncio.gather(*(ash2.complete(k, 201, {"id": i}, SCOPE, claim=a.claim,
                                                    headers='{"ETag": "e"}')
                                      for i, (k, a) in enumerate(zip(keys, first))))
        check(done == [True] * 12, "AsyncShards: completed by the other application, on the same shards", done)
        again = [await ash2.acquire(k, {"n": i}, SCOPE) for i, k in enumerate(keys)]
        check(all(r.outcome == "replay" and r.response_status == 201 and r.response_body == '{"id": %d}' % i
                  and r.response_headers == '{"etag": "e"}' for i, r in enumerate(again)),
              "AsyncShards: replayed (status, body, headers)", again[:2])
        m = await ash.acquire(keys[0], {"n": -1}, SCOPE)
        check(m.outcome == "mismatch", "AsyncShards: mismatch", m)
        a = await ash.acquire("async-held", None, SCOPE, lease=60)
        b = await ash2.acquire("async-held", None, SCOPE, lease=60)
        released = await ash2.release("async-held", SCOPE, claim=a.claim)
        c = await ash.acquire("async-held", None, SCOPE, lease=60)
        check((a.outcome, b.outcome, released, c.outcome) == ("acquired", "in_progress", True, "acquired"),
              "AsyncShards: in progress, released, acquired again", (a, b, released, c))
        await ash.release("async-held", SCOPE, claim=c.claim)

    loop.run_until_complete(run())


step("AsyncShards over layout 1", async_direct)

# Keys of partitions 2 and 3 of 4 move: 2 from shard 0 to 2, 3 from shard 1
# to 0.
moved = next((i for i in range(16) if key_hash(SCOPE, "k%d" % i) & 3 == 2), None)
if not check(moved is not None, "one of k0..k15 is in partition 2 of 4"):
    sys.exit(1)
done_moved = "k%d" % moved
check(on(SCOPE, done_moved) == "0", "%s is on shard 0 before the growth" % done_moved, on(SCOPE, done_moved))
router.execute("SELECT count(*) FROM idempotency.cluster_grow(ARRAY[%s, %s, %s], 4)", tuple(conn))


def growth():
    # a moved key's record, from layout 1: its previous shard refuses a
    # layout it has left behind; the router answers, from there
    r = acquire(stale, done_moved, '{"n": %d}' % moved, "replay")
    check(r.response_body == '{"id": %d}' % moved, "stale layout, a moved key: replayed through the router", r)
    lay = stale.layout()
    check(not lay.direct and lay.version == 2, "after a refusal, the stale layout is read again: through the "
          "router, version 2", lay)
    check(on(SCOPE, done_moved) == "0", "the moved key's record is still on shard 0 only", on(SCOPE, done_moved))
    # a key that stays: answered at layout 1, no refusal
    stays = key_in(0, 4, "stays")
    acquire(stale_complete, stays, "{}", "acquired")
    lay = stale_complete.layout()
    check(lay.direct and lay.version == 1, "stale layout, a key that stays: answered by its shard at layout 1, "
          "not refused", lay)
    # a new key that moves: refused by its old owner, then claimed through
    # the router on its new one
    fresh = key_in(2, 4, "fresh")
    a = acquire(s, fresh, "{}", "acquired")
    lay = s.layout()
    check(not lay.direct and lay.version == 2 and "window" in lay.why,
          "a new key that moves: refused, then through the router; the layout says the window is open", lay)
    check(on(SCOPE, fresh) == "2", "its claim is on its new shard, 2, only", on(SCOPE, fresh))
    # the stale application completes it: its layout's owner has no
    # record (P0002), so it reads the layout again and asks the router
    done = stale_complete.complete(fresh, 201, '{"ok": true}', SCOPE, claim=a.claim)
    check(done is True, "a claim made before the stale one heard of the growth is completed by it", done)
    check(not stale_complete.layout().direct, "... after reading the layout again (P0002)", stale_complete.layout())
    r1 = acquire(s, fresh, "{}", "replay")
    r2 = acquire(stale, fresh, "{}", "replay")
    check(r1.response_body == r2.response_body == '{"ok": true}', "both replay it", (r1, r2))


step("growth", growth)


def async_growth():
    async def run():
        # ash, still at layout 1: a moved key is refused by its old owner,
        # then replayed through the router
        r = await ash.acquire(done_moved, '{"n": %d}' % moved, SCOPE)
        check(r.outcome == "replay" and r.response_body == '{"id": %d}' % moved,
              "AsyncShards, stale layout, a moved key: replayed through the router", r)
        lay = ash.layout()
        check(not lay.direct and lay.version == 2, "AsyncShards: after a refusal, the layout read again", lay)
        # ash2, still at layout 1, completes a claim made through the router
        # on the key's new shard: P0002 on its old owner, then the router
        fresh = key_in(2, 4, "afresh")
        a = await ash.acquire(fresh, "{}", SCOPE, lease=60)
        check(a.outcome == "acquired" and on(SCOPE, fresh) == "2", "AsyncShards: a new moved key claimed "
              "through the router on its new shard", (a, on(SCOPE, fresh)))
        check(ash2.layout().direct, "AsyncShards: the other one still direct at layout 1", ash2.layout())
        done = await ash2.complete(fresh, 200, '"ok"', SCOPE, claim=a.claim)
        check(done is True and not ash2.layout().direct, "AsyncShards, stale layout: completed through the "
              "router after P0002, the layout read again", (done, ash2.layout()))
        r = await ash.acquire(fresh, "{}", SCOPE)
        check(r.outcome == "replay" and r.response_body == '"ok"', "AsyncShards: its replay", r)

    loop.run_until_complete(run())


step("AsyncShards, growth", async_growth)


def window_closed():
    router.execute("SELECT idempotency.cluster_growth_finish(force => true)")
    before = s.layout()
    check(not before.direct, "before reload(), still through the router (max_age is an hour)", before)
    s.reload()
    lay = s.layout()
    check(lay.direct and lay.version == 2 and lay.partitions == 4, "window closed: direct over layout 2, "
          "4 partitions", lay)
    for p, shard in enumerate(["0", "1", "2", "0"]):
        key = key_in(p, 4, "after")
        acquire(s, key, "{}", "acquired")
        check(on(SCOPE, key) == shard, "partition %d of 4: a new key on shard %s only" % (p, shard),
              on(SCOPE, key))


step("window closed", window_closed)


def closed():
    stale.close()
    try:
        stale.acquire("after-close", "{}", SCOPE)
        check(False, "a closed Shards refuses calls")
    except IdempotencyError:
        check(True, "a closed Shards refuses calls")
    with Shards(router) as t:
        a = t.acquire("with-block", "{}", SCOPE)
        check(isinstance(a, ShardAnswer) and a.outcome == "acquired" and t.layout().direct,
              "as a context manager: direct, acquires", a)
    check(t._closed, "the with block closes it")

    async def run():
        await ash.reload()
        check(ash.layout().direct and ash.layout().version == 2, "AsyncShards.reload(): direct over layout 2",
              ash.layout())
        async with ash2:
            pass
        try:
            await ash2.acquire("after-close", "{}", SCOPE)
            check(False, "a closed AsyncShards refuses calls")
        except IdempotencyError:
            check(True, "a closed AsyncShards refuses calls")
        await ash.close()
        await arouter_pool.close()
        await arouter_conn.close()

    loop.run_until_complete(run())


step("close", closed)

for x in (s, stale_complete):
    x.close()
print("# %d failed" % failed)
sys.exit(1 if failed else 0)
