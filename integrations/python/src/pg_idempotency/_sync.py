"""pg_idempotency._sync -- the engine over psycopg 3's blocking API: Claim,
Idempotency (the HTTP mapping of idem_acquire's outcomes) and idempotent(),
the plain wrapper for queue consumers and jobs."""

import contextlib
import json
import queue
import threading
import time

import psycopg

from . import _core
from ._core import Acquired, InProgress, Mismatch, Response


class _PoolSource:
    """Connections from a psycopg_pool.ConnectionPool."""

    single = False

    def __init__(self, pool):
        self.pool = pool

    def getconn(self):
        return self.pool.getconn()

    def putconn(self, conn):
        self.pool.putconn(conn)


class _ConnSource:
    """One psycopg.Connection, used for everything (autocommit off while
    the engine has it)."""

    single = True

    def __init__(self, conn):
        self.conn = conn

    def getconn(self):
        return self.conn

    def putconn(self, conn):
        pass


def _source(conn_or_pool):
    if isinstance(conn_or_pool, psycopg.Connection):
        return _ConnSource(conn_or_pool)
    return _PoolSource(conn_or_pool)


_IDLE = psycopg.pq.TransactionStatus.IDLE


def _take(source):
    """A connection from source in autocommit (the engine sends BEGIN itself,
    with the statement after it: psycopg's own BEGIN would be a round trip
    of its own), and the autocommit to give it back with."""
    conn = source.getconn()
    autocommit = conn.autocommit
    try:
        if not autocommit:
            conn.autocommit = True
    except BaseException:
        source.putconn(conn)
        raise
    return conn, autocommit


def _give(source, conn, autocommit):
    """Roll back what is open, give autocommit back, return the connection."""
    try:
        if conn.info.transaction_status != _IDLE:
            conn.rollback()
        if conn.autocommit != autocommit:
            conn.autocommit = autocommit
    except psycopg.Error:
        pass  # a broken connection: the pool discards it
    finally:
        source.putconn(conn)


class _Rollbacks:
    """A duplicate's ROLLBACK after its answer has gone: a pool's connection
    is rolled back and returned by this thread (started at first use)."""

    def __init__(self):
        self._queue = queue.SimpleQueue()
        self._thread = None
        self._lock = threading.Lock()

    def put(self, source, conn, autocommit):
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pg_idempotency rollbacks", daemon=True)
                self._thread.start()
        self._queue.put((source, conn, autocommit))

    def _run(self):
        while True:
            item = self._queue.get()
            try:
                _give(*item)
            except Exception:  # noqa: BLE001 -- a closed pool, say: the thread goes on
                _core.log.debug("pg_idempotency: a duplicate's connection could not be given back", exc_info=True)


_rollbacks = _Rollbacks()


def _dismiss(source, conn, autocommit):
    """A duplicate's connection (its BEGIN open, nothing written): rolled
    back later for a pool, now for the caller's connection."""
    if source.single:
        _give(source, conn, autocommit)
    else:
        _rollbacks.put(source, conn, autocommit)


@contextlib.contextmanager
def _own_transactions(conn):
    """A caller's connection, idle, with autocommit off for the block."""
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise psycopg.ProgrammingError("pg_idempotency needs an idle connection (commit or roll back first)")
    autocommit = conn.autocommit
    if autocommit:
        conn.autocommit = False
    try:
        yield
    finally:
        if autocommit:
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                conn.rollback()
            conn.autocommit = True


class Claim:
    """What an acquired request's handler gets: tx (the connection whose
    transaction commits with the stored answer), resumed, checkpoint(),
    keep_alive(), extend(), release()."""

    def __init__(self, source, key, scope, lease, conn=None, claim=None, resumed=None, autocommit=None):
        self._source = source
        self.key = key
        self.scope = scope
        self.lease = lease
        self.claim = claim  # the claim idem_acquire returned (a uuid, as text)
        self.released = False
        # after a takeover: (phase, state) of the last checkpoint of the
        # claim taken over, or None
        self.resumed = resumed
        self.checkpointed = False  # a checkpoint was committed on its own
        self._conn = conn  # the open transaction (BEGIN sent, autocommit on), if any
        self._autocommit = autocommit  # _conn's autocommit to give back
        self._lock = threading.RLock()

    @property
    def tx(self):
        """The connection whose transaction commits with the stored answer.
        In lease mode it is taken at first use: use it after the outside
        call, not before.  (Its autocommit is on, inside the engine's own
        BEGIN: do not commit it.)"""
        with self._lock:
            if self._conn is None:
                conn, autocommit = _take(self._source)
                try:
                    conn.execute("BEGIN")
                except BaseException:
                    _give(self._source, conn, autocommit)
                    raise
                self._conn, self._autocommit = conn, autocommit
            return self._conn

    def _apart(self, sql, args):
        """Run sql in the open transaction, else on its own (autocommit)."""
        with self._lock:
            if self._conn is not None:
                self._conn.execute(sql, args)
                return False
            conn, autocommit = _take(self._source)
            try:
                conn.execute(sql, args)
            finally:
                _give(self._source, conn, autocommit)
            return True

    def release(self):
        """idem_release: nothing is stored, the retry runs the handler again."""
        self._apart(_core.RELEASE, (self.key, self.scope, self.claim))
        self.released = True

    def checkpoint(self, phase, state=None):
        """idem_checkpoint: record the step done (phase) and what the next
        attempt needs (state, a JSON value).  In the open transaction if
        there is one (committed with the handler's writes), else committed
        at once.  After a committed checkpoint, a handler that fails leaves
        the claim to its lease (not released): the retry that takes it over
        resumes."""
        args = (self.key, self.scope, self.claim, phase, None if state is None else json.dumps(state))
        if self._apart(_core.CHECKPOINT, args):
            self.checkpointed = True

    def extend(self):
        """idem_extend: push the lease out while a slow call runs."""
        if not self.lease:
            return
        with self._lock:
            if self._source.single and self._conn is not None:
                return  # the one connection is in the handler's transaction
            self._apart(_core.EXTEND, (self.key, self.scope, self.claim, self.lease))

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
        """Commit or roll back the open transaction, if any, and give its
        connection back (also after COMPLETE_COMMIT, with nothing open)."""
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if commit and conn.info.transaction_status != _IDLE:
                conn.commit()
        finally:
            _give(self._source, conn, self._autocommit)


class Idempotency:
    """The engine: claims a key, runs the handler in the claim's
    transaction (or, in lease mode, after the claim has committed), stores
    its answer and commits, and maps the other outcomes to HTTP answers.

    pool: a psycopg_pool.ConnectionPool (or one psycopg.Connection, used by
    one thread at a time).  replay_ok: a replayed 2xx is answered 200.
    ttl: seconds a record is kept (None: idempotency.default_ttl).
    replay_cache: a ReplayCache (True: one with the defaults; None: none).
    log_duplicates: "sampled" (at most a line a second), "all" or "off".

    A new key takes two round trips to PostgreSQL besides the handler's own
    statements (BEGIN with idem_acquire, then idem_complete with COMMIT: one
    simple query each); a replay one before its answer (its ROLLBACK goes
    after it)."""

    def __init__(self, pool, replay_ok=False, ttl=None, replay_cache=None, log_duplicates="sampled"):
        self.pool = pool
        self._source = _source(pool)
        self.replay_ok = replay_ok
        self.ttl = ttl
        self.replay_cache = _core.replay_cache(replay_cache)
        self._dup_log = _core.duplicate_log(log_duplicates)

    def handle(self, method, path, key, body, user, handler, lease=None, trace=None):
        """An HTTP request: key (the Idempotency-Key header or None), body
        (bytes), user (for the scope), trace (the traceparent header).
        handler(claim) returns a Response.  Returns the Response to send."""
        prob, request, trace = _core.check_http(key, body, trace)
        if prob is not None:
            prob.outcome = "refused"
            return prob
        return self.run(key, request, _core.http_scope(user, method, path), handler, lease=lease, trace=trace)

    def run(self, key, request, scope, handler, lease=None, trace=None, raise_errors=False):
        """Claim (scope, key) for request (JSON text) and run handler(claim),
        which returns a Response.  Returns the Response to send, its outcome
        set.  raise_errors: a database error or the handler's exception is
        raised (after the rollback) instead of answered."""
        cache = self.replay_cache
        if cache is not None:
            entry = cache.get(scope, key, request)
            if entry is not None:
                return _core.duplicate(entry, key, scope, trace, self.replay_ok, self._dup_log, cached=True)
        source = self._source
        conn, autocommit = _take(source)
        try:
            sent_at = time.monotonic()
            # BEGIN and the claim in one round trip (lease mode: the claim
            # alone, in autocommit: it is committed, visible as processing)
            cur = conn.execute(_core.acquire_query(conn, key, request, scope, self.ttl, lease, trace,
                                                   begin=not lease), prepare=False)
            if not lease:
                cur.nextset()
            row = Acquired(cur.fetchone(), sent_at)
        except psycopg.Error as err:
            _give(source, conn, autocommit)
            if raise_errors:
                raise
            return _core.db_problem(err)
        except BaseException:
            _give(source, conn, autocommit)
            raise
        if row.outcome != "acquired":
            # nothing written: the answer goes out, the ROLLBACK after it
            _dismiss(source, conn, autocommit)
            _core.cache_answer(cache, row, scope, key, request)
            return _core.duplicate(row, key, scope, trace, self.replay_ok, self._dup_log)
        if cache is not None:
            cache.drop(scope, key)
        if lease:
            _give(source, conn, autocommit)
            conn = autocommit = None

        claim = Claim(source, key, scope, lease, conn=conn, claim=row.claim,
                      resumed=(row.phase, row.state) if row.phase is not None else None, autocommit=autocommit)
        try:
            resp = handler(claim)
        except Exception as err:  # noqa: BLE001 -- answered 500, nothing stored
            self._failed(claim)
            if raise_errors:
                raise
            return _core.error_problem(err)
        except BaseException:
            # a worker that dies (or is interrupted): nothing is stored or
            # released, the claim is left to its lease
            claim._end(commit=False)
            raise
        if not claim.released:
            try:
                body, headers = _core.completion(resp)
            except ValueError:
                self._failed(claim)
                if raise_errors:
                    raise
                return _core.not_json()
        if claim.released:
            try:
                claim._end(commit=True)
            except psycopg.Error as err:
                if raise_errors:
                    raise
                return _core.db_problem(err)
            resp.outcome = "released"
            return resp
        try:
            # idem_complete and COMMIT in one round trip
            tx = claim.tx
            _done, canonical = tx.execute(_core.complete_query(tx, key, resp.status, body, scope, claim.claim,
                                                               headers), prepare=False).fetchone()
            claim._end(commit=True)
        except psycopg.Error as err:
            claim._end(commit=False)
            if err.sqlstate == "55000":
                # Lease mode: the lease ran out and another request took the
                # claim over; its answer is the one that counts.
                if raise_errors:
                    raise InProgress(key, 1) from err
                return _core.claim_lost()
            if raise_errors:
                raise
            return _core.db_problem(err)
        _core.cache_completion(cache, row, scope, key, request, resp.status, canonical, headers, trace)
        return _core.first_answer(resp, canonical)

    def forget(self, key, scope=""):
        """idem_forget(key, scope), committed, then the key evicted from this
        engine's replay cache (other processes' caches may still answer it
        until their entries' max_age passes).  Whether a record was removed."""
        conn, autocommit = _take(self._source)
        try:
            (removed,) = conn.execute(_core.FORGET, (key, scope)).fetchone()
        finally:
            _give(self._source, conn, autocommit)
        if self.replay_cache is not None:
            self.replay_cache.forget(key, scope)
        return removed

    @staticmethod
    def _failed(claim):
        claim._end(commit=False)
        if claim.lease and not claim.released and not claim.checkpointed:
            # The outside call may have happened: give the claim up so that
            # a retry runs again (the provider deduplicates on the key).
            with contextlib.suppress(psycopg.Error):
                claim.release()


def idempotent(conn_or_pool, key, request, fn, scope="", ttl=None, lease=None, trace=None, replay_cache=None,
               log_duplicates="sampled"):
    """Run fn(claim) once for (scope, key) and request (a JSON value, or
    JSON text); returns what it returned (a JSON value), as stored: the
    first call and every later one with the same key and request get the
    same value, and fn runs once.

    fn's writes on claim.tx commit with the stored value.  Raises InProgress
    (another attempt holds the key: retry after .retry_after seconds),
    Mismatch (the key was used for another request), fn's exception (after
    rolling back its writes and the claim: a retry runs fn again) or a
    psycopg error.  lease (seconds): the claim commits first and fn runs
    outside a transaction until it takes claim.tx (for outside calls; see
    claim.keep_alive and claim.checkpoint).  replay_cache: a ReplayCache
    shared by the calls (a replay it holds is answered without the
    database); log_duplicates: see Idempotency."""
    _core.replay_cache(replay_cache, shared_only=True)
    text = _core.request_text(request)
    guard = _own_transactions(conn_or_pool) if isinstance(conn_or_pool, psycopg.Connection) \
        else contextlib.nullcontext()
    with guard:
        resp = Idempotency(conn_or_pool, ttl=ttl, replay_cache=replay_cache, log_duplicates=log_duplicates).run(
            key, text, scope, lambda claim: Response(200, json.dumps(fn(claim))), lease=lease, trace=trace,
            raise_errors=True)
    return _result(resp, key)


def forget(conn_or_pool, key, scope="", replay_cache=None):
    """idem_forget(key, scope) on conn_or_pool (an idle psycopg.Connection
    or a ConnectionPool), committed, then the key evicted from replay_cache.
    Whether a record was removed."""
    _core.replay_cache(replay_cache, shared_only=True)
    return Idempotency(conn_or_pool, replay_cache=replay_cache).forget(key, scope)


def _result(resp, key):
    if resp.outcome in ("acquired", "replay"):
        return None if resp.body is None else json.loads(resp.body)
    if resp.outcome == "mismatch":
        raise Mismatch(key, resp.headers.get("Idempotent-Origin-Trace"))
    if resp.outcome == "released":
        return None
    raise InProgress(key, int(resp.headers.get("Retry-After", "1")), resp.headers.get("Idempotent-Origin-Trace"))
