"""pg_idempotency._shards -- Shards: the calls of an idempotency_proxy
cluster sent by the application straight to the shard that owns each key,
so that no router backend spends its CPU on them (a PL/Proxy router costs
about what a shard does, whatever it routes).  The router stays, for
SQL-only clients and for the growth window, when only it knows where a
moved key's records are.  The port of the Go package's idempotency.Shards
(integrations/go/shards.go): the same routing, the same statements."""

import asyncio
import contextlib
import hashlib
import inspect
import json
import os
import re
import threading
import time
from datetime import timedelta

import psycopg

from . import _async
from ._core import IdempotencyError
from ._sync import _ConnSource, _give, _source, _take

# The statements, the text of the Go package's (shards.go) with its $n
# placeholders written %s for psycopg, which sends them as $1, $2...: the
# server gets the same text.  Each is prepared once a connection
# (prepare=True); complete and release are the same text on a shard and on
# the router.
_GO_SQL = {
    "shard_acquire": """SELECT outcome, response_status, response_body::text, attempt, expires_at,
       claim::text, retry_after, phase, state::text, response_headers::text, origin_trace
  FROM idempotency.shard_acquire($1::bigint, $2::text, $3::jsonb, $4::text, $5::interval, $6::interval, $7::text)""",
    "router_acquire": """SELECT outcome, response_status, response_body::text, attempt, expires_at,
       claim::text, retry_after, phase, state::text, response_headers::text, origin_trace
  FROM idempotency.idem_acquire($1::text, $2::jsonb, $3::text, $4::interval, $5::interval, false, $6::text)""",
    "complete": ("SELECT idempotency.idem_complete($1::text, $2::int, $3::jsonb, $4::text, NULL::int, $5::uuid, "
                 "$6::jsonb)"),
    "release": "SELECT idempotency.idem_release($1::text, $2::text, NULL::int, $3::uuid)",
    "layout": "SELECT s.version, s.active, s.map, s.previous_map IS NOT NULL FROM idempotency.shard_layout s",
    "cluster": "SELECT s.connstrs FROM idempotency.cluster_state s",
}


def _psycopg_text(sql):
    """sql with $1, $2... (each once, in order) written %s."""
    found = [int(n) for n in re.findall(r"\$(\d+)", sql)]
    assert found == list(range(1, len(found) + 1)), sql
    return re.sub(r"\$\d+", "%s", sql)


SHARD_ACQUIRE_SQL = _psycopg_text(_GO_SQL["shard_acquire"])
ROUTER_ACQUIRE_SQL = _psycopg_text(_GO_SQL["router_acquire"])
COMPLETE_SQL = _psycopg_text(_GO_SQL["complete"])
RELEASE_SQL = _psycopg_text(_GO_SQL["release"])
LAYOUT_SQL = _GO_SQL["layout"]
CLUSTER_SQL = _GO_SQL["cluster"]

MAX_AGE = 30.0  # seconds a layout is used before it is read again


def key_hash(scope, key):
    """idempotency.key_hash(scope, key): the first 32 bits of SHA-256 over
    scope, a zero byte and key (their UTF-8), as a signed integer.  The
    partition of a key is key_hash(scope, key) & (partitions - 1)."""
    digest = hashlib.sha256(scope.encode() + b"\0" + key.encode()).digest()
    return int.from_bytes(digest[:4], "big", signed=True)


class ShardAnswer:
    """idem_acquire's answer (the columns of idempotency 1.2's
    idem_acquire), through Shards: outcome ("acquired", "replay",
    "in_progress", "mismatch"...), response_status, response_body, attempt,
    expires_at (a datetime), claim (the uuid, as text: give it to complete
    or release), retry_after, phase, state, response_headers, origin_trace.
    JSON values are their text; None for NULL."""

    __slots__ = ("outcome", "response_status", "response_body", "attempt", "expires_at", "claim",
                 "retry_after", "phase", "state", "response_headers", "origin_trace")

    def __init__(self, row):
        (self.outcome, self.response_status, self.response_body, self.attempt, self.expires_at, self.claim,
         self.retry_after, self.phase, self.state, self.response_headers, self.origin_trace) = row

    def __repr__(self):
        return "ShardAnswer(%s)" % ", ".join("%s=%r" % (f, getattr(self, f)) for f in self.__slots__
                                             if getattr(self, f) is not None)


class ShardsLayout:
    """How Shards routes now: direct, or through the router (why says
    why), at layout version over partitions partitions."""

    __slots__ = ("version", "partitions", "direct", "why")

    def __init__(self, version, partitions, direct, why):
        self.version, self.partitions, self.direct, self.why = version, partitions, direct, why

    def __eq__(self, other):
        return isinstance(other, ShardsLayout) and all(getattr(self, f) == getattr(other, f)
                                                       for f in self.__slots__)

    def __repr__(self):
        return "ShardsLayout(version=%r, partitions=%r, direct=%r, why=%r)" % (
            self.version, self.partitions, self.direct, self.why)


class _Layout:
    """The layout as Shards last read it: partition i is servers[i]; direct
    false: every call goes through the router (why says why); read: its
    time.monotonic()."""

    __slots__ = ("version", "servers", "direct", "why", "read")

    def __init__(self, version=0, servers=(), direct=False, why="", read=None):
        self.version, self.servers, self.direct, self.why = version, list(servers), direct, why
        self.read = time.monotonic() if read is None else read


def _placement(lay, row):
    """The router's placement (CLUSTER_SQL's row) into lay."""
    lay.servers = list(row[0] or []) if row is not None else []
    n = len(lay.servers)
    if n == 0 or n & (n - 1):
        raise IdempotencyError("idempotency: the router has %d partitions; idempotency.cluster_create() "
                               "declares them" % n)


def _judge(lay, connstr, row, first):
    """The layout of the shard connstr (LAYOUT_SQL's row, None for none)
    against lay: lay.why set where the calls cannot go direct.  Whether the
    next shard is still the first read."""
    if row is None:
        lay.why = "the shard %r has no layout" % connstr
        return first
    version, active, servers, window = row
    if first:
        lay.version = version
    if version != lay.version:
        lay.why = "the shards have layouts %d and %d" % (lay.version, version)
    elif not active:
        lay.why = "layout %d is not in force on the shard %r" % (version, connstr)
    elif window:
        lay.why = "the window of the growth to layout %d is open" % version
    elif list(servers or []) != lay.servers:
        lay.why = "the shard %r has another placement than the router" % connstr
    return False


def default_config(connstr):
    """A shard's connections, from its connection string as the router's
    layout spells it: a psycopg_pool.ConnectionPool (1 to max(4, CPUs)
    connections, autocommit) where psycopg_pool is installed, else one
    psycopg connection (used by one call at a time)."""
    try:
        from psycopg_pool import ConnectionPool
    except ImportError:
        return psycopg.connect(connstr, autocommit=True)
    return ConnectionPool(connstr, min_size=1, max_size=max(4, os.cpu_count() or 1),
                          kwargs={"autocommit": True}, open=True)


def _interval(seconds):
    """A number of seconds (or a timedelta) as an interval parameter, as
    the Go package sends it: None (the default) for None or 0."""
    if isinstance(seconds, timedelta):
        seconds = seconds.total_seconds()
    if not seconds or seconds <= 0:
        return None
    return "%d microseconds" % round(seconds * 1e6)


def _json(value):
    """A JSON parameter: None (NULL), str or bytes as JSON text, any other
    value encoded."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode()
    return json.dumps(value)


def _own_statement(conn):
    """Raise unless conn is outside any transaction, before a statement and
    after it: a claim must commit when its statement ends.  Inside a
    transaction that is not ours (a BEGIN of the application's, or a
    connection whose autocommit another user of it turned off meanwhile)
    the claim would be rolled back when the connection is given back, and
    the key claimed twice; an error instead, with nothing left behind."""
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise IdempotencyError(
            "pg_idempotency: Shards needs a connection outside any transaction "
            "(its claims commit at once); give it a pool, or a connection that "
            "nothing else uses")


class _Conns:
    """Where a statement runs: a pool, or one connection used by one call at
    a time (a lock); each statement in autocommit, prepared once a
    connection."""

    def __init__(self, conn_or_pool, owned):
        self.target = conn_or_pool
        self.source = _source(conn_or_pool)
        self.owned = owned  # made by Shards: closed by Shards.close()
        self.lock = threading.Lock() if isinstance(self.source, _ConnSource) else contextlib.nullcontext()

    def row(self, sql, params=None):
        """The first row of sql (None: no row)."""
        with self.lock:
            conn, autocommit = _take(self.source)
            try:
                _own_statement(conn)
                row = conn.execute(sql, params, prepare=True).fetchone()
                _own_statement(conn)
                return row
            finally:
                _give(self.source, conn, autocommit)

    def close(self):
        if self.owned:
            self.target.close()


class Shards:
    """Sends idem_acquire, idem_complete and idem_release to the shard that
    owns the key under the cluster's layout, as the router's
    idempotency.idem_acquire would, without the router: it hashes (scope,
    key) as idempotency.key_hash() does (key_hash()), and calls the owning
    shard's idempotency.shard_acquire with the layout version.  A shard
    checks both (it refuses, with a row or with SQLSTATE 55R01, a key it
    does not own or a claim from a layout it has left behind), so a Shards,
    however stale its layout, never makes a key run on two shards: on a
    refusal it reads the layout again and sends the call through the
    router.  While a growth's window is open (the layout has a previous
    placement), or while the shards do not all agree on one layout in
    force, every call goes through the router, which looks at a moved key's
    previous shard first.

    router: the router's psycopg_pool.ConnectionPool, or one
    psycopg.Connection (used by one call at a time); Shards uses it but
    does not close it.  config(connstr): the connections of one shard, a
    ConnectionPool or a Connection, from its connection string as the
    router's layout spells it (idempotency.cluster_state.connstrs); Shards
    makes them on first use and closes them.  Default: default_config, so
    the user and the password come from the environment (PGUSER,
    PGPASSWORD, ~/.pgpass) where the string has none.  max_age: seconds a
    layout is used before it is read again (30): a shard refuses a call
    from a layout it has left behind, and Shards then reads the layout at
    once, so max_age only bounds how long it sends calls through the router
    after a growth's window has closed.

    Claims are lease claims, committed at once (each statement in
    autocommit, as through the router): acquire, do the work, then complete
    with the claim, or release it.  Safe for threads.  Reads the layout
    when made (raises IdempotencyError if it cannot)."""

    def __init__(self, router, config=None, max_age=MAX_AGE):
        if router is None:
            raise TypeError("Shards needs the router's pool or connection")
        self._router = _Conns(router, owned=False)
        self._config = config or default_config
        self.max_age = float(max_age) if max_age and max_age > 0 else MAX_AGE
        self._reload_lock = threading.Lock()  # one reading of the layout at a time
        self._lock = threading.Lock()  # guards _layout, _shards, _closed
        self._layout = None
        self._shards = {}
        self._closed = False
        try:
            self._read_layout(None)
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Close the shards' connections (not the router's)."""
        with self._lock:
            shards, self._shards, self._closed = self._shards, {}, True
        for conns in shards.values():
            with contextlib.suppress(Exception):
                conns.close()

    def layout(self):
        """How Shards routes now (without reading the layout again): a
        ShardsLayout."""
        with self._lock:
            lay = self._layout
        if lay is None:
            return ShardsLayout(0, 0, False, "no layout read")
        return ShardsLayout(lay.version, len(lay.servers), lay.direct, lay.why)

    def reload(self):
        """Read the layout again now (raises IdempotencyError if it cannot;
        the calls then go through the router until it can)."""
        self._read_layout(None)

    # -- the layout -------------------------------------------------------

    def _current(self):
        """The layout to route by, read again when older than max_age."""
        with self._lock:
            lay, closed = self._layout, self._closed
        if closed:
            raise IdempotencyError("idempotency: Shards is closed")
        if lay is not None and time.monotonic() - lay.read < self.max_age:
            return lay
        return self._read_layout(lay)

    def _read_layout(self, seen):
        """Read the layout from the router and the shards, unless another
        call has read it since seen was current.  Where it cannot be read,
        the calls go through the router until it can."""
        with self._reload_lock:
            with self._lock:
                lay = self._layout
            if seen is not None and lay is not seen and lay is not None \
                    and time.monotonic() - lay.read < self.max_age:
                return lay
            err = None
            try:
                lay = self._load()
            except IdempotencyError as e:
                err = e
                lay = _Layout(why=str(e))
            with self._lock:
                self._layout = lay
        if err is not None and seen is None:
            raise err  # made, reload(): the caller hears why
        return lay

    def _load(self):
        """Read the placement from the router, then each shard's layout:
        direct when every shard has one layout, in force, with no growth
        window open, over the router's placement."""
        lay = _Layout()
        try:
            row = self._router.row(CLUSTER_SQL)
        except psycopg.Error as err:
            raise IdempotencyError("idempotency: the router's placement: %s" % err) from err
        _placement(lay, row)
        first, read = True, set()
        for c in lay.servers:
            if c in read:
                continue
            read.add(c)
            try:
                row = self._shard(c).row(LAYOUT_SQL)
            except psycopg.Error as err:
                raise IdempotencyError("idempotency: the layout of the shard %r: %s" % (c, err)) from err
            first = _judge(lay, c, row, first)
            if lay.why:
                return lay
        lay.direct = True
        return lay

    def _shard(self, connstr):
        """The connections of the shard connstr, made on first use."""
        with self._lock:
            conns = self._shards.get(connstr)
            if conns is not None:
                return conns
            if self._closed:
                raise IdempotencyError("idempotency: Shards is closed")
        try:
            made = _Conns(self._config(connstr), owned=True)
        except Exception as err:
            raise IdempotencyError("idempotency: the shard %r: %s" % (connstr, err)) from err
        with self._lock:
            conns = self._shards.get(connstr)
            if conns is None and not self._closed:
                self._shards[connstr] = made
                return made
        made.close()
        if conns is None:
            raise IdempotencyError("idempotency: Shards is closed")
        return conns

    def _owner(self, lay, scope, key):
        """The connections of the shard that owns (scope, key) under lay."""
        return self._shard(lay.servers[key_hash(scope, key) & (len(lay.servers) - 1)])

    # -- the calls --------------------------------------------------------

    def acquire(self, key, request=None, scope="", ttl=None, lease=None, trace=None):
        """idempotency.idem_acquire(key, request, scope, ttl, lease, trace)
        of the cluster: a ShardAnswer.  request: the request as JSON text
        (or a value, encoded), None for no payload check; ttl and lease in
        seconds (or timedeltas), None for the defaults; trace: None for
        none.  On the owning shard when the layout allows, else through the
        router; a shard's refusal (it does not own the key under its newer
        layout) reads the layout again and sends the call through the
        router.  A database error is raised (psycopg.Error)."""
        lay = self._current()
        request, ttl, lease = _json(request), _interval(ttl), _interval(lease)
        if lay.direct:
            shard = self._owner(lay, scope, key)
            try:
                row = shard.row(SHARD_ACQUIRE_SQL, (lay.version, key, request, scope, ttl, lease, trace))
            except psycopg.Error as err:
                if err.sqlstate != "55R01":
                    raise
                row = None
            if row is not None and row[0] != "refused":
                return ShardAnswer(row)
            # refused: nothing of the call is left on the shard
            self._read_layout(lay)
        return ShardAnswer(self._router.row(ROUTER_ACQUIRE_SQL, (key, request, scope, ttl, lease, trace)))

    def complete(self, key, status, body=None, scope="", claim=None, headers=None):
        """idempotency.idem_complete(key, status, body, scope, claim =>
        claim, response_headers => headers) of the cluster: body and headers
        JSON text (or values, encoded), None for NULL; claim the answer's
        claim.  idem_complete's boolean."""
        if claim is None:
            raise TypeError("complete needs the claim that acquire answered")
        params = (key, int(status), _json(body), scope, str(claim), _json(headers))
        return self._on_owner(scope, key, COMPLETE_SQL, params)

    def release(self, key, scope="", claim=None):
        """idempotency.idem_release(key, scope, claim => claim) of the
        cluster: idem_release's boolean."""
        if claim is None:
            raise TypeError("release needs the claim that acquire answered")
        return self._on_owner(scope, key, RELEASE_SQL, (key, scope, str(claim)))

    def _on_owner(self, scope, key, sql, params):
        """sql's boolean, on the key's shard when the layout is direct, else
        on the router.  A claim made under a direct layout is on its owner
        under that layout: a growth that moves the key keeps its window open
        while the claim is live (cluster_growth_pending counts it), so the
        layout read meanwhile sends the call through the router, which
        finds it."""
        lay = self._current()
        if not lay.direct:
            return self._router.row(sql, params)[0]
        try:
            return self._owner(lay, scope, key).row(sql, params)[0]
        except psycopg.Error as err:
            if err.sqlstate != "P0002":
                raise
            # No live record there: the claim may have been made through
            # the router on the key's new shard, during a growth that this
            # layout has not heard of.  Read the layout again; where it has
            # changed, ask there.
            try:
                new = self._read_layout(lay)
            except IdempotencyError:
                raise err from None
            if new.direct and new.version == lay.version:
                raise
        if not new.direct:
            return self._router.row(sql, params)[0]
        return self._owner(new, scope, key).row(sql, params)[0]


# -- asyncio ----------------------------------------------------------------


async def default_config_async(connstr):
    """default_config for AsyncShards: a psycopg_pool.AsyncConnectionPool
    (opened), else one psycopg.AsyncConnection."""
    try:
        from psycopg_pool import AsyncConnectionPool
    except ImportError:
        return await psycopg.AsyncConnection.connect(connstr, autocommit=True)
    pool = AsyncConnectionPool(connstr, min_size=1, max_size=max(4, os.cpu_count() or 1),
                               kwargs={"autocommit": True}, open=False)
    await pool.open()
    return pool


class _AsyncConns:
    """_Conns over psycopg's asyncio API."""

    def __init__(self, conn_or_pool, owned):
        self.target = conn_or_pool
        self.source = _async._source(conn_or_pool)
        self.owned = owned
        self.lock = asyncio.Lock() if self.source.single else None

    async def row(self, sql, params=None):
        async with self.lock or _async_null():
            conn, autocommit = await _async._take(self.source)
            try:
                _own_statement(conn)
                cur = await conn.execute(sql, params, prepare=True)
                row = await cur.fetchone()
                _own_statement(conn)
                return row
            finally:
                await _async._give(self.source, conn, autocommit)

    async def close(self):
        if self.owned:
            await self.target.close()


@contextlib.asynccontextmanager
async def _async_null():
    yield


class AsyncShards:
    """Shards over psycopg's asyncio API, for one event loop:

        shards = await AsyncShards.create(router)   # or: async with await AsyncShards.create(router) as shards:
        a = await shards.acquire(key, request, scope, lease=60)

    router: the router's psycopg_pool.AsyncConnectionPool, or one
    psycopg.AsyncConnection; config(connstr): an AsyncConnectionPool or an
    AsyncConnection, or an awaitable of one (default: default_config_async);
    the rest as Shards, awaited."""

    def __init__(self, router, config=None, max_age=MAX_AGE):
        """Not read yet: use `await AsyncShards.create(...)`, or await
        reload() before the first call."""
        if router is None:
            raise TypeError("AsyncShards needs the router's pool or connection")
        self._router = _AsyncConns(router, owned=False)
        self._config = config or default_config_async
        self.max_age = float(max_age) if max_age and max_age > 0 else MAX_AGE
        self._reload_lock = asyncio.Lock()  # one reading of the layout at a time
        self._making = {}  # connstr: the task making its connections
        self._layout = None
        self._shards = {}
        self._closed = False

    @classmethod
    async def create(cls, router, config=None, max_age=MAX_AGE):
        """An AsyncShards with the layout read (raises IdempotencyError if
        it cannot be)."""
        self = cls(router, config, max_age)
        try:
            await self._read_layout(None)
        except BaseException:
            await self.close()
            raise
        return self

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self):
        """Close the shards' connections (not the router's)."""
        shards, self._shards, self._closed = self._shards, {}, True
        for conns in shards.values():
            with contextlib.suppress(Exception):
                await conns.close()

    def layout(self):
        """How AsyncShards routes now (not awaited; the layout is not read
        again): a ShardsLayout."""
        lay = self._layout
        if lay is None:
            return ShardsLayout(0, 0, False, "no layout read")
        return ShardsLayout(lay.version, len(lay.servers), lay.direct, lay.why)

    async def reload(self):
        await self._read_layout(None)

    async def _current(self):
        lay = self._layout
        if self._closed:
            raise IdempotencyError("idempotency: Shards is closed")
        if lay is not None and time.monotonic() - lay.read < self.max_age:
            return lay
        return await self._read_layout(lay)

    async def _read_layout(self, seen):
        async with self._reload_lock:
            lay = self._layout
            if seen is not None and lay is not seen and lay is not None \
                    and time.monotonic() - lay.read < self.max_age:
                return lay
            err = None
            try:
                lay = await self._load()
            except IdempotencyError as e:
                err = e
                lay = _Layout(why=str(e))
            self._layout = lay
        if err is not None and seen is None:
            raise err
        return lay

    async def _load(self):
        lay = _Layout()
        try:
            row = await self._router.row(CLUSTER_SQL)
        except psycopg.Error as err:
            raise IdempotencyError("idempotency: the router's placement: %s" % err) from err
        _placement(lay, row)
        first, read = True, set()
        for c in lay.servers:
            if c in read:
                continue
            read.add(c)
            try:
                row = await (await self._shard(c)).row(LAYOUT_SQL)
            except psycopg.Error as err:
                raise IdempotencyError("idempotency: the layout of the shard %r: %s" % (c, err)) from err
            first = _judge(lay, c, row, first)
            if lay.why:
                return lay
        lay.direct = True
        return lay

    async def _shard(self, connstr):
        """The connections of the shard connstr, made on first use (once:
        the calls that need them meanwhile wait for the same task)."""
        conns = self._shards.get(connstr)
        if conns is not None:
            return conns
        if self._closed:
            raise IdempotencyError("idempotency: Shards is closed")
        task = self._making.get(connstr)
        if task is None:
            task = self._making[connstr] = asyncio.ensure_future(self._make(connstr))
            task.add_done_callback(lambda _t: self._making.pop(connstr, None))
        return await asyncio.shield(task)

    async def _make(self, connstr):
        try:
            made = self._config(connstr)
            if inspect.isawaitable(made):
                made = await made
            made = _AsyncConns(made, owned=True)
        except Exception as err:
            raise IdempotencyError("idempotency: the shard %r: %s" % (connstr, err)) from err
        if self._closed:
            await made.close()
            raise IdempotencyError("idempotency: Shards is closed")
        self._shards[connstr] = made
        return made

    async def _owner(self, lay, scope, key):
        return await self._shard(lay.servers[key_hash(scope, key) & (len(lay.servers) - 1)])

    async def acquire(self, key, request=None, scope="", ttl=None, lease=None, trace=None):
        """Shards.acquire, awaited."""
        lay = await self._current()
        request, ttl, lease = _json(request), _interval(ttl), _interval(lease)
        if lay.direct:
            shard = await self._owner(lay, scope, key)
            try:
                row = await shard.row(SHARD_ACQUIRE_SQL, (lay.version, key, request, scope, ttl, lease, trace))
            except psycopg.Error as err:
                if err.sqlstate != "55R01":
                    raise
                row = None
            if row is not None and row[0] != "refused":
                return ShardAnswer(row)
            await self._read_layout(lay)
        return ShardAnswer(await self._router.row(ROUTER_ACQUIRE_SQL, (key, request, scope, ttl, lease, trace)))

    async def complete(self, key, status, body=None, scope="", claim=None, headers=None):
        """Shards.complete, awaited."""
        if claim is None:
            raise TypeError("complete needs the claim that acquire answered")
        params = (key, int(status), _json(body), scope, str(claim), _json(headers))
        return await self._on_owner(scope, key, COMPLETE_SQL, params)

    async def release(self, key, scope="", claim=None):
        """Shards.release, awaited."""
        if claim is None:
            raise TypeError("release needs the claim that acquire answered")
        return await self._on_owner(scope, key, RELEASE_SQL, (key, scope, str(claim)))

    async def _on_owner(self, scope, key, sql, params):
        lay = await self._current()
        if not lay.direct:
            return (await self._router.row(sql, params))[0]
        try:
            return (await (await self._owner(lay, scope, key)).row(sql, params))[0]
        except psycopg.Error as err:
            if err.sqlstate != "P0002":
                raise
            try:
                new = await self._read_layout(lay)
            except IdempotencyError:
                raise err from None
            if new.direct and new.version == lay.version:
                raise
        if not new.direct:
            return (await self._router.row(sql, params))[0]
        return (await (await self._owner(new, scope, key)).row(sql, params))[0]
