"""pg_idempotency._sync -- the engine over psycopg 3's blocking API: Claim,
Idempotency (the HTTP mapping of idem_acquire's outcomes) and idempotent(),
the plain wrapper for queue consumers and jobs."""

import contextlib
import json
import threading

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

    def __init__(self, source, key, scope, lease, conn=None, claim=None, resumed=None):
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
        self._conn = conn  # the open transaction, if any
        self._lock = threading.RLock()

    @property
    def tx(self):
        """The connection whose transaction commits with the stored answer.
        In lease mode it is taken at first use: use it after the outside
        call, not before."""
        with self._lock:
            if self._conn is None:
                self._conn = self._source.getconn()
            return self._conn

    def _apart(self, sql, args):
        """Run sql in the open transaction, else in one of its own, committed."""
        with self._lock:
            if self._conn is not None:
                self._conn.execute(sql, args)
                return False
            conn = self._source.getconn()
            try:
                conn.execute(sql, args)
                conn.commit()
            except BaseException:
                conn.rollback()
                raise
            finally:
                self._source.putconn(conn)
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
            self._source.putconn(conn)


class Idempotency:
    """The engine: claims a key, runs the handler in the claim's
    transaction (or, in lease mode, after the claim has committed), stores
    its answer and commits, and maps the other outcomes to HTTP answers.

    pool: a psycopg_pool.ConnectionPool (or one psycopg.Connection, used by
    one thread at a time).  replay_ok: a replayed 2xx is answered 200.
    ttl: seconds a record is kept (None: idempotency.default_ttl)."""

    def __init__(self, pool, replay_ok=False, ttl=None):
        self.pool = pool
        self._source = _source(pool)
        self.replay_ok = replay_ok
        self.ttl = ttl

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
        source = self._source
        conn = source.getconn()
        try:
            row = Acquired(conn.execute(_core.ACQUIRE, (key, request, scope, self.ttl or None,
                                                        lease or None, trace)).fetchone())
            if row.outcome != "acquired" or lease:
                conn.commit()  # lease mode: the claim is now visible, as processing
        except psycopg.Error as err:
            conn.rollback()
            source.putconn(conn)
            if raise_errors:
                raise
            return _core.db_problem(err)
        if row.outcome != "acquired" or lease:
            source.putconn(conn)
            conn = None
        if row.outcome != "acquired":
            return _core.duplicate(row, key, scope, trace, self.replay_ok)

        claim = Claim(source, key, scope, lease, conn=conn, claim=row.claim,
                      resumed=(row.phase, row.state) if row.phase is not None else None)
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
            _done, canonical = claim.tx.execute(_core.COMPLETE, {
                "key": key, "status": resp.status, "body": body, "scope": scope, "claim": claim.claim,
                "headers": headers}).fetchone()
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
        return _core.first_answer(resp, canonical)

    @staticmethod
    def _failed(claim):
        claim._end(commit=False)
        if claim.lease and not claim.released and not claim.checkpointed:
            # The outside call may have happened: give the claim up so that
            # a retry runs again (the provider deduplicates on the key).
            with contextlib.suppress(psycopg.Error):
                claim.release()


def idempotent(conn_or_pool, key, request, fn, scope="", ttl=None, lease=None, trace=None):
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
    claim.keep_alive and claim.checkpoint)."""
    text = _core.request_text(request)
    guard = _own_transactions(conn_or_pool) if isinstance(conn_or_pool, psycopg.Connection) \
        else contextlib.nullcontext()
    with guard:
        resp = Idempotency(conn_or_pool, ttl=ttl).run(
            key, text, scope, lambda claim: Response(200, json.dumps(fn(claim))), lease=lease, trace=trace,
            raise_errors=True)
    return _result(resp, key)


def _result(resp, key):
    if resp.outcome in ("acquired", "replay"):
        return None if resp.body is None else json.loads(resp.body)
    if resp.outcome == "mismatch":
        raise Mismatch(key, resp.headers.get("Idempotent-Origin-Trace"))
    if resp.outcome == "released":
        return None
    raise InProgress(key, int(resp.headers.get("Retry-After", "1")), resp.headers.get("Idempotent-Origin-Trace"))
