#!/usr/bin/env python3
"""integrations/python/tests/wrapper_test.py DSN -- checks of idempotent()
and idempotent_async() against a database with the extension, run with
the virtualenv's python (the installed wheel).  Prints "ok - ..." or
"not ok - ..." per check (integrations/python/test.sh numbers them)."""

import asyncio
import sys
import threading
import uuid

import psycopg
from psycopg_pool import AsyncConnectionPool, ConnectionPool

import pg_idempotency
from pg_idempotency import InProgress, Mismatch, idempotent, idempotent_async

DSN = sys.argv[1]
# a duplicate waits for the claim's holder this long before in_progress
SHORT_WAIT = DSN + " options='-c idempotency.wait_timeout=200ms'"
failed = 0


def check(cond, what, detail=None):
    global failed
    print(("ok - " if cond else "not ok - ") + what, flush=True)
    if not cond:
        failed += 1
        if detail is not None:
            print("#   %r" % (detail,), flush=True)


db = psycopg.connect(DSN, autocommit=True)
db.execute("CREATE TABLE IF NOT EXISTS wrapper_jobs (key text, n int)")


def rows(key):
    return db.execute("SELECT count(*) FROM wrapper_jobs WHERE key = %s", (key,)).fetchone()[0]


def record(key, scope):
    return db.execute("SELECT status FROM idempotency.idem_lookup(%s, %s)", (key, scope)).fetchone()


check("/site-packages/" in pg_idempotency.__file__ and "/src/" not in pg_idempotency.__file__,
      "pg_idempotency is the installed wheel (%s)" % pg_idempotency.__file__)


def sync_checks(label, target):
    key, runs = str(uuid.uuid4()), []

    def job(claim):
        runs.append(1)
        claim.tx.execute("INSERT INTO wrapper_jobs VALUES (%s, 1)", (key,))
        return {"done": key, "n": len(runs)}

    first = idempotent(target, key, {"a": 1}, job, scope="jobs")
    check(first == {"done": key, "n": 1} and rows(key) == 1 and record(key, "jobs") == ("completed",),
          "%s: acquired: fn runs, its write and the stored value commit together" % label, first)
    again = idempotent(target, key, '{ "a" : 1 }', job, scope="jobs")
    check(again == first and len(runs) == 1 and rows(key) == 1,
          "%s: replay: the stored value, fn not run again" % label, again)
    try:
        idempotent(target, key, {"a": 2}, job, scope="jobs")
        check(False, "%s: mismatch raises Mismatch" % label)
    except Mismatch:
        check(len(runs) == 1, "%s: mismatch raises Mismatch, fn not run" % label)

    # an error: the write and the claim roll back; the retry runs fn again
    key2, tries = str(uuid.uuid4()), []

    def flaky(claim):
        tries.append(1)
        claim.tx.execute("INSERT INTO wrapper_jobs VALUES (%s, %s)", (key2, len(tries)))
        if len(tries) == 1:
            raise RuntimeError("boom")
        return len(tries)

    try:
        idempotent(target, key2, None, flaky)
        raised = None
    except RuntimeError as e:
        raised = e
    check(raised is not None and rows(key2) == 0 and record(key2, "") is None,
          "%s: fn raises: the exception goes on, its write and the claim are rolled back" % label)
    check(idempotent(target, key2, None, flaky) == 2 and rows(key2) == 1,
          "%s: the retry after an error runs fn again and commits" % label)


with psycopg.connect(DSN) as conn:
    sync_checks("sync, a connection", conn)
with psycopg.connect(DSN, autocommit=True) as conn:
    sync_checks("sync, an autocommit connection", conn)
    check(conn.autocommit, "sync: the connection's autocommit is given back")
pool = ConnectionPool(DSN, min_size=1, max_size=4, open=True)
sync_checks("sync, a pool", pool)

# in_progress: a holder in fn (its transaction open) while a duplicate asks
key3 = str(uuid.uuid4())
inside, leave = threading.Event(), threading.Event()


def slow(claim):
    inside.set()
    leave.wait(30)
    return "slow"


holder = threading.Thread(target=lambda: idempotent(pool, key3, {"x": 1}, slow))
holder.start()
inside.wait(30)
with psycopg.connect(SHORT_WAIT) as other:
    try:
        idempotent(other, key3, {"x": 1}, slow)
        check(False, "sync: a duplicate while fn runs raises InProgress")
    except InProgress as e:
        check(e.retry_after >= 1, "sync: a duplicate while fn runs raises InProgress (retry after %d s)" % e.retry_after)
leave.set()
holder.join()
check(idempotent(pool, key3, {"x": 1}, slow) == "slow", "sync: once fn is done, the duplicate replays its value")

# lease mode: the claim is visible (processing) while fn runs outside a transaction
key4 = str(uuid.uuid4())


def leased(claim):
    seen = record(key4, "")
    with claim.keep_alive():
        pass
    claim.checkpoint("called", {"ref": "r1"})
    claim.tx.execute("INSERT INTO wrapper_jobs VALUES (%s, 1)", (key4,))
    return seen[0] if seen else None


check(idempotent(pool, key4, {"y": 1}, leased, lease=5) == "processing" and rows(key4) == 1
      and record(key4, "") == ("completed",),
      "sync, lease mode: the claim commits before fn, fn's write after it")
pool.close()


async def async_checks():
    apool = AsyncConnectionPool(DSN, min_size=1, max_size=4, open=False)
    await apool.open()
    for label, target in (("async, a pool", apool), ("async, a connection", await psycopg.AsyncConnection.connect(DSN))):
        key, runs = str(uuid.uuid4()), []

        async def job(claim):
            runs.append(1)
            tx = await claim.tx
            await tx.execute("INSERT INTO wrapper_jobs VALUES (%s, 1)", (key,))
            return [key, len(runs)]

        first = await idempotent_async(target, key, {"a": 1}, job)
        check(first == [key, 1] and rows(key) == 1 and record(key, "") == ("completed",),
              "%s: acquired: fn runs, its write and the stored value commit together" % label, first)
        again = await idempotent_async(target, key, {"a": 1}, job)
        check(again == first and len(runs) == 1, "%s: replay: the stored value, fn not run again" % label)
        try:
            await idempotent_async(target, key, {"a": 3}, job)
            check(False, "%s: mismatch raises Mismatch" % label)
        except Mismatch:
            check(len(runs) == 1, "%s: mismatch raises Mismatch, fn not run" % label)
        key2 = str(uuid.uuid4())

        async def failing(claim):
            tx = await claim.tx
            await tx.execute("INSERT INTO wrapper_jobs VALUES (%s, 1)", (key2,))
            raise ValueError("boom")

        try:
            await idempotent_async(target, key2, None, failing)
            raised = False
        except ValueError:
            raised = True
        check(raised and rows(key2) == 0 and record(key2, "") is None,
              "%s: fn raises: its write and the claim are rolled back" % label)

    key3 = str(uuid.uuid4())
    inside, leave = asyncio.Event(), asyncio.Event()

    async def slow(claim):
        inside.set()
        await leave.wait()
        return "slow"

    holder = asyncio.ensure_future(idempotent_async(apool, key3, {"x": 1}, slow))
    await inside.wait()
    other = await psycopg.AsyncConnection.connect(SHORT_WAIT)
    try:
        await idempotent_async(other, key3, {"x": 1}, slow)
        check(False, "async: a duplicate while fn runs raises InProgress")
    except InProgress as e:
        check(e.retry_after >= 1, "async: a duplicate while fn runs raises InProgress (retry after %d s)"
              % e.retry_after)
    leave.set()
    check(await holder == "slow" and await idempotent_async(other, key3, {"x": 1}, slow) == "slow",
          "async: once fn is done, the duplicate replays its value")
    await other.close()
    await apool.close()


asyncio.run(async_checks())
sys.exit(1 if failed else 0)
