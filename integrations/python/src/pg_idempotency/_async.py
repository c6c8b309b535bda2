"""pg_idempotency._async -- the engine over psycopg 3's asyncio API:
AsyncClaim, AsyncIdempotency and idempotent_async(), the same as _sync's
with await."""

import asyncio
import contextlib
import json
import time

import psycopg

from . import _core
from ._core import Acquired, InProgress, Response
from ._sync import _result


class _PoolSource:
    single = False

    def __init__(self, pool):
        self.pool = pool

    async def getconn(self):
        return await self.pool.getconn()

    async def putconn(self, conn):
        await self.pool.putconn(conn)


class _ConnSource:
    single = True

    def __init__(self, conn):
        self.conn = conn

    async def getconn(self):
        return self.conn

    async def putconn(self, conn):
        pass


def _source(conn_or_pool):
    if isinstance(conn_or_pool, psycopg.AsyncConnection):
        return _ConnSource(conn_or_pool)
    return _PoolSource(conn_or_pool)


_IDLE = psycopg.pq.TransactionStatus.IDLE


async def _take(source):
    """A connection in autocommit and the autocommit to give back (see _sync._take)."""
    conn = await source.getconn()
    autocommit = conn.autocommit
    try:
        if not autocommit:
            await conn.set_autocommit(True)
    except BaseException:
        await source.putconn(conn)
        raise
    return conn, autocommit


async def _give(source, conn, autocommit):
    """Roll back what is open, give autocommit back, return the connection."""
    try:
        if conn.info.transaction_status != _IDLE:
            await conn.rollback()
        if conn.autocommit != autocommit:
            await conn.set_autocommit(autocommit)
    except psycopg.Error:
        pass  # a broken connection: the pool discards it
    finally:
        await source.putconn(conn)


_pending = set()  # the duplicates' ROLLBACKs under way (a reference keeps each task)


def _dismiss(source, conn, autocommit):
    """A duplicate's connection (its BEGIN open, nothing written): rolled
    back by a task of its own for a pool (the answer does not wait for it);
    for the caller's connection, the awaitable to await now."""
    if source.single:
        return _give(source, conn, autocommit)
    task = asyncio.ensure_future(_give(source, conn, autocommit))
    _pending.add(task)
    task.add_done_callback(_pending.discard)
    return None


@contextlib.asynccontextmanager
async def _own_transactions(conn):
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise psycopg.ProgrammingError("pg_idempotency needs an idle connection (commit or roll back first)")
    autocommit = conn.autocommit
    if autocommit:
        await conn.set_autocommit(False)
    try:
        yield
    finally:
        if autocommit:
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                await conn.rollback()
            await conn.set_autocommit(True)


class AsyncClaim:
    """What an acquired request's handler gets: `await claim.tx` (the
    connection whose transaction commits with the stored answer), resumed,
    checkpoint(), keep_alive(), extend(), release(), all awaited."""

    def __init__(self, source, key, scope, lease, conn=None, claim=None, resumed=None, autocommit=None):
        self._source = source
        self.key = key
        self.scope = scope
        self.lease = lease
        self.claim = claim
        self.released = False
        self.resumed = resumed
        self.checkpointed = False
        self._conn = conn  # the open transaction (BEGIN sent, autocommit on), if any
        self._autocommit = autocommit  # _conn's autocommit to give back
        self._lock = asyncio.Lock()

    @property
    def tx(self):
        """Awaitable: the connection whose transaction commits with the
        stored answer (in lease mode taken at first use: after the outside
        call, not before)."""
        return self._tx()

    async def _tx(self):
        async with self._lock:
            if self._conn is None:
                conn, autocommit = await _take(self._source)
                try:
                    await conn.execute("BEGIN")
                except BaseException:
                    await _give(self._source, conn, autocommit)
                    raise
                self._conn, self._autocommit = conn, autocommit
            return self._conn

    async def _apart(self, sql, args):
        async with self._lock:
            if self._conn is not None:
                await self._conn.execute(sql, args)
                return False
            conn, autocommit = await _take(self._source)
            try:
                await conn.execute(sql, args)
            finally:
                await _give(self._source, conn, autocommit)
            return True

    async def release(self):
        """idem_release: nothing is stored, the retry runs the handler again."""
        await self._apart(_core.RELEASE, (self.key, self.scope, self.claim))
        self.released = True

    async def checkpoint(self, phase, state=None):
        """idem_checkpoint (see Claim.checkpoint)."""
        args = (self.key, self.scope, self.claim, phase, None if state is None else json.dumps(state))
        if await self._apart(_core.CHECKPOINT, args):
            self.checkpointed = True

    async def extend(self):
        """idem_extend: push the lease out while a slow call runs."""
        if not self.lease or (self._source.single and self._conn is not None):
            return
        await self._apart(_core.EXTEND, (self.key, self.scope, self.claim, self.lease))

    @contextlib.asynccontextmanager
    async def keep_alive(self):
        """extend() every third of the lease while the block runs."""

        async def beat():
            while True:
                await asyncio.sleep(self.lease / 3)
                try:
                    await self.extend()
                except psycopg.Error:
                    return  # taken over or expired: the completion will be refused

        task = asyncio.ensure_future(beat()) if self.lease else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _end(self, commit):
        async with self._lock:
            conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if commit and conn.info.transaction_status != _IDLE:
                await conn.commit()
        finally:
            await _give(self._source, conn, self._autocommit)


class AsyncIdempotency:
    """Idempotency over a psycopg_pool.AsyncConnectionPool (or one
    psycopg.AsyncConnection): handlers are coroutines that get an
    AsyncClaim.  Options as Idempotency's (replay_cache, log_duplicates)."""

    def __init__(self, pool, replay_ok=False, ttl=None, replay_cache=None, log_duplicates="sampled"):
        self.pool = pool
        self._source = _source(pool)
        self.replay_ok = replay_ok
        self.ttl = ttl
        self.replay_cache = _core.replay_cache(replay_cache)
        self._dup_log = _core.duplicate_log(log_duplicates)

    async def handle(self, method, path, key, body, user, handler, lease=None, trace=None):
        """See Idempotency.handle; handler(claim) is awaited."""
        prob, request, trace = _core.check_http(key, body, trace)
        if prob is not None:
            prob.outcome = "refused"
            return prob
        return await self.run(key, request, _core.http_scope(user, method, path), handler,
                              lease=lease, trace=trace)

    async def run(self, key, request, scope, handler, lease=None, trace=None, raise_errors=False):
        """See Idempotency.run; handler(claim) is awaited."""
        cache = self.replay_cache
        if cache is not None:
            entry = cache.get(scope, key, request)
            if entry is not None:
                return _core.duplicate(entry, key, scope, trace, self.replay_ok, self._dup_log, cached=True)
        source = self._source
        conn, autocommit = await _take(source)
        try:
            sent_at = time.monotonic()
            cur = await conn.execute(_core.acquire_query(conn, key, request, scope, self.ttl, lease, trace,
                                                         begin=not lease), prepare=False)
            if not lease:
                cur.nextset()
            row = Acquired(await cur.fetchone(), sent_at)
        except psycopg.Error as err:
            await _give(source, conn, autocommit)
            if raise_errors:
                raise
            return _core.db_problem(err)
        except BaseException:
            await _give(source, conn, autocommit)
            raise
        if row.outcome != "acquired":
            pending = _dismiss(source, conn, autocommit)
            if pending is not None:
                await pending
            _core.cache_answer(cache, row, scope, key, request)
            return _core.duplicate(row, key, scope, trace, self.replay_ok, self._dup_log)
        if cache is not None:
            cache.drop(scope, key)
        if lease:
            await _give(source, conn, autocommit)
            conn = autocommit = None

        claim = AsyncClaim(source, key, scope, lease, conn=conn, claim=row.claim,
                           resumed=(row.phase, row.state) if row.phase is not None else None,
                           autocommit=autocommit)
        try:
            resp = await handler(claim)
        except Exception as err:  # noqa: BLE001 -- answered 500, nothing stored
            await self._failed(claim)
            if raise_errors:
                raise
            return _core.error_problem(err)
        except BaseException:
            await claim._end(commit=False)
            raise
        if not claim.released:
            try:
                body, headers = _core.completion(resp)
            except ValueError:
                await self._failed(claim)
                if raise_errors:
                    raise
                return _core.not_json()
        if claim.released:
            try:
                await claim._end(commit=True)
            except psycopg.Error as err:
                if raise_errors:
                    raise
                return _core.db_problem(err)
            resp.outcome = "released"
            return resp
        try:
            tx = await claim.tx
            cur = await tx.execute(_core.complete_query(tx, key, resp.status, body, scope, claim.claim, headers),
                                   prepare=False)
            _done, canonical = await cur.fetchone()
            await claim._end(commit=True)
        except psycopg.Error as err:
            await claim._end(commit=False)
            if err.sqlstate == "55000":
                if raise_errors:
                    raise InProgress(key, 1) from err
                return _core.claim_lost()
            if raise_errors:
                raise
            return _core.db_problem(err)
        _core.cache_completion(cache, row, scope, key, request, resp.status, canonical, headers, trace)
        return _core.first_answer(resp, canonical)

    async def forget(self, key, scope=""):
        """See Idempotency.forget."""
        conn, autocommit = await _take(self._source)
        try:
            cur = await conn.execute(_core.FORGET, (key, scope))
            (removed,) = await cur.fetchone()
        finally:
            await _give(self._source, conn, autocommit)
        if self.replay_cache is not None:
            self.replay_cache.forget(key, scope)
        return removed

    @staticmethod
    async def _failed(claim):
        await claim._end(commit=False)
        if claim.lease and not claim.released and not claim.checkpointed:
            with contextlib.suppress(psycopg.Error):
                await claim.release()


async def idempotent_async(conn_or_pool, key, request, fn, scope="", ttl=None, lease=None, trace=None,
                           replay_cache=None, log_duplicates="sampled"):
    """idempotent() for asyncio: fn(claim) is a coroutine function, claim an
    AsyncClaim (`await claim.tx`); conn_or_pool a psycopg.AsyncConnection or
    a psycopg_pool.AsyncConnectionPool."""
    _core.replay_cache(replay_cache, shared_only=True)
    text = _core.request_text(request)

    async def handler(claim):
        return Response(200, json.dumps(await fn(claim)))

    engine = AsyncIdempotency(conn_or_pool, ttl=ttl, replay_cache=replay_cache, log_duplicates=log_duplicates)
    if isinstance(conn_or_pool, psycopg.AsyncConnection):
        async with _own_transactions(conn_or_pool):
            resp = await engine.run(key, text, scope, handler, lease=lease, trace=trace, raise_errors=True)
    else:
        resp = await engine.run(key, text, scope, handler, lease=lease, trace=trace, raise_errors=True)
    return _result(resp, key)


async def forget_async(conn_or_pool, key, scope="", replay_cache=None):
    """forget() for asyncio: an idle AsyncConnection or an AsyncConnectionPool."""
    _core.replay_cache(replay_cache, shared_only=True)
    return await AsyncIdempotency(conn_or_pool, replay_cache=replay_cache).forget(key, scope)
