"""pg_idempotency._core -- what the sync and async engines share: the SQL,
the answers (RFC 9457 problems, the IETF draft-09 codes) and the checks of
a request before it is claimed.  No I/O here."""

import collections
import hashlib
import json
import logging
import math
import threading
import time

from psycopg.adapt import Transformer

log = logging.getLogger("pg_idempotency")

PROBLEM_BASE = "https://example.com/problems/"
# The response headers stored with an answer (idem_complete's
# response_headers, which keeps them in lower case) and sent again with its
# replays, spelled as here.
REPLAYED_HEADERS = ("Location", "ETag", "Content-Type", "Content-Location")
SPELLING = {h.lower(): h for h in REPLAYED_HEADERS}

# idem_acquire's columns, and how long the record has left by the database's
# clock (for the replay cache: read in the same statement as the answer)
ACQUIRE_COLUMNS = b"""
    SELECT outcome, response_status, response_body::text, retry_after, claim::text,
           phase, state, response_headers, origin_trace,
           extract(epoch FROM expires_at - pg_catalog.clock_timestamp())::float8
      FROM idempotency.idem_acquire(key => %s::text, request => %s::jsonb, scope => %s::text,
                                    ttl => %s, lease => %s, trace => %s::text)"""
COMPLETE_COMMIT = b"""
    SELECT idempotency.idem_complete(key => %s::text, response_status => %d::int, response_body => b.j,
                                     scope => %s::text, claim => %s::uuid, response_headers => %s::jsonb),
           b.j::text
      FROM (SELECT %s::jsonb AS j) b;
    COMMIT"""
FORGET = "SELECT idempotency.idem_forget(key => %s::text, scope => %s::text)"
RELEASE = "SELECT idempotency.idem_release(key => %s, scope => %s, claim => %s::uuid)"
CHECKPOINT = ("SELECT idempotency.idem_checkpoint(key => %s, scope => %s, claim => %s::uuid,"
              " phase => %s, state => %s::jsonb)")
EXTEND = ("SELECT idempotency.idem_extend(key => %s, scope => %s, claim => %s::uuid,"
          " lease => %s::float8 * interval '1 second')")


class IdempotencyError(Exception):
    """A request the wrapper could not run (idempotent, idempotent_async)."""


class InProgress(IdempotencyError):
    """The key is claimed by another attempt that has not finished (or this
    attempt's lease ran out and another took the claim over): try again
    after retry_after seconds."""

    def __init__(self, key, retry_after, origin_trace=None):
        super().__init__("idempotency key %r is in progress; retry after %d s" % (key, retry_after))
        self.key = key
        self.retry_after = retry_after
        self.origin_trace = origin_trace


class Mismatch(IdempotencyError):
    """The key was used before for another request."""

    def __init__(self, key, origin_trace=None):
        super().__init__("idempotency key %r was used for another request" % key)
        self.key = key
        self.origin_trace = origin_trace


class Response:
    """An answer: status, body (a JSON value, None for no body, or bytes
    sent as they are) and headers."""

    def __init__(self, status, body=None, headers=None):
        self.status = status
        self.body = body
        self.headers = dict(headers or {})
        self.outcome = None  # set by the engine: acquired, replay, in_progress, mismatch, ...
        self.cached = False  # a replay served from the replay cache

    def encoded(self):
        """(body bytes or None, headers): a JSON value encoded, with its
        Content-Type unless the headers have one."""
        body, headers = self.body, dict(self.headers)
        if body is not None and not isinstance(body, bytes):
            body = json.dumps(body).encode()
            if not any(k.lower() == "content-type" for k in headers):
                headers["Content-Type"] = content_type(self.status)
        return body, headers

    def __repr__(self):
        return "Response(%r, %r, %r)" % (self.status, self.body, self.headers)


def problem(status, typ, title, detail=None, headers=None):
    """An RFC 9457 problem+json answer, byte for byte what the Go and Node
    packages send: compact JSON, keys sorted, detail always there."""
    body = json.dumps({"detail": detail or "", "status": status, "title": title,
                       "type": PROBLEM_BASE + typ},
                      separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode()
    headers = dict(headers or {})
    headers["Content-Type"] = "application/problem+json"
    return Response(status, body, headers)


def content_type(status):
    """What a JSON body is sent as, first time and replayed alike."""
    return "application/problem+json" if status >= 400 else "application/json; charset=utf-8"


def db_problem(err):
    """A database error: 503 where a retry cures it, 400 for refused data."""
    code = getattr(err, "sqlstate", None) or ""
    if code[:2] == "40" or code in ("55P03", "53300"):
        return problem(503, "try-again", "Try again", str(err), {"Retry-After": "1"})
    if code[:2] == "22":
        return problem(400, "bad-request", "Request refused by the database", str(err))
    return problem(500, "database-error", "Database error", str(err))


def error_problem(err):
    """A handler's exception, answered (nothing stored)."""
    if getattr(err, "sqlstate", None) is not None:
        return db_problem(err)
    return problem(500, "internal-error", "Internal error", str(err))


def claim_lost():
    return problem(409, "idempotency-claim-lost", "This request's claim was taken over",
                   "It took longer than its lease; send the same request again.",
                   {"Retry-After": "1"})


def not_json():
    return problem(500, "response-not-json", "Handler answered non-JSON",
                   "The idempotency middleware stores JSON responses only.")


def http_scope(user, method, path):
    """The scope of an HTTP request: the user and the route (hashed when
    over idem_acquire's 255 bytes)."""
    scope = "user:%s %s %s" % (user or "anonymous", method, path)
    if len(scope.encode()) > 255:
        scope = "sha256:" + hashlib.sha256(scope.encode()).hexdigest()
    return scope


def check_http(key, body, trace):
    """The checks before a claim: (problem, None, None) or (None, the
    request as JSON text, the trace to store)."""
    if not key:
        return problem(400, "idempotency-key-missing", "Idempotency-Key header missing",
                       "This operation is idempotent: send an Idempotency-Key header "
                       "(a UUID that you send again when you retry)."), None, None
    if len(key.encode()) > 255:
        return problem(400, "idempotency-key-invalid", "Idempotency-Key header too long",
                       "The key is at most 255 bytes long."), None, None
    request = "null"  # an empty body: compared as JSON null
    if body.strip():
        try:
            json.loads(body)
        except ValueError:
            return problem(400, "body-not-json", "Request body is not JSON",
                           "The request body is compared with the first request's as JSON."), None, None
        request = body.decode() if isinstance(body, bytes) else body
    # for linking duplicates to the first request: one too long to store
    # (255 bytes) is not passed on rather than refused
    if trace is not None and len(trace.encode()) > 255:
        trace = None
    return None, request, trace


def request_text(request):
    """The wrapper's request as JSON text: str or bytes as they are (checked),
    any other value encoded."""
    if isinstance(request, (bytes, bytearray)):
        request = bytes(request).decode()
    if isinstance(request, str):
        json.loads(request)  # ValueError for text that is not JSON
        return request
    return json.dumps(request)


class Acquired:
    """One row of ACQUIRE_COLUMNS; sent_at: time.monotonic() before the
    query was sent."""

    def __init__(self, row, sent_at=None):
        (self.outcome, self.status, self.body, self.retry_after, self.claim,
         self.phase, self.state, self.headers, self.origin_trace, self.expires_in) = row
        self.sent_at = sent_at


# -- one round trip each: literals quoted by psycopg --------------------------
#
# A simple query (cursor.execute with no parameters: psycopg sends it with
# PQsendQuery) may hold several statements, and takes no parameters: the
# values go in as literals, quoted by psycopg's own sql.Literal (what
# Transformer.as_literal does), which follows the connection's encoding and
# standard_conforming_strings, and refuses text with NUL.  PostgreSQL runs
# nothing after a statement of it that fails.

def _literal(tx, value):
    return tx.as_literal(value)


def _seconds(value):
    """An interval literal of value seconds, NULL::interval for None or 0."""
    if not value:
        return b"NULL::interval"
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError("seconds must be a finite positive number, not %r" % value)
    return b"'%s'::float8 * interval '1 second'" % repr(value).encode()


def acquire_query(conn, key, request, scope, ttl, lease, trace, begin):
    """BEGIN (begin true) and idem_acquire as one simple query (bytes); with
    begin false, idem_acquire alone (in autocommit: lease mode commits the
    claim with the statement)."""
    tx = Transformer.from_context(conn)
    q = ACQUIRE_COLUMNS % (_literal(tx, key), _literal(tx, request), _literal(tx, scope), _seconds(ttl),
                           _seconds(lease), _literal(tx, trace))
    return b"BEGIN;" + q if begin else q


def complete_query(conn, key, status, body, scope, claim, headers):
    """idem_complete and COMMIT as one simple query (bytes); its one row:
    idem_complete's boolean, the stored body's text (jsonb's)."""
    tx = Transformer.from_context(conn)
    return COMPLETE_COMMIT % (_literal(tx, key), int(status), _literal(tx, scope), _literal(tx, claim),
                              _literal(tx, headers), _literal(tx, body))


# -- the replay cache ----------------------------------------------------------

def _digest(request):
    """What an entry keeps of its request: the SHA-256 of its text (so an
    entry's size does not grow with the request's), None for none."""
    if request is None:
        return None
    return hashlib.sha256(request.encode() if isinstance(request, str) else bytes(request)).digest()


class _Entry:
    __slots__ = ("request", "status", "body", "headers", "origin_trace", "deadline")

    def __init__(self, request, status, body, headers, origin_trace, deadline):
        self.request = request
        self.status = status
        self.body = body
        self.headers = headers
        self.origin_trace = origin_trace
        self.deadline = deadline


class ReplayCache:
    """An in-process cache of completed answers (off unless given to an
    engine or a middleware as replay_cache).

    Holds only completed answers: a replay that idem_acquire returned, and
    this process's own completions (put in once their COMMIT succeeded).
    An entry is keyed by (scope, key) and served only to a request whose
    JSON text is byte-identical to the stored one's (compared by SHA-256,
    so an entry's size is its answer's, whatever the request's; any other
    request goes
    to the database, which answers replay or mismatch); never after the
    record's expires_at by the database's clock (deadline: the monotonic
    time before the query was sent + expires_at - clock_timestamp(), read
    with the answer), nor longer than max_age seconds after it was put in.
    At most max_entries entries, the least recently used dropped first;
    answers bigger than max_entry_bytes (body and headers) are not kept.

    A replay served from here does not reach the database: idempotency.stats
    does not count it.  forget() (Idempotency.forget, pg_idempotency.forget)
    evicts the key from this cache only: other processes may answer it from
    theirs until their entries' max_age passes.  Safe for threads and
    asyncio tasks alike (a lock, never held across I/O)."""

    def __init__(self, max_entries=10000, max_entry_bytes=65536, max_age=60.0):
        if int(max_entries) < 1 or int(max_entry_bytes) < 0 or not float(max_age) > 0:
            raise ValueError("max_entries >= 1, max_entry_bytes >= 0 and max_age > 0 are needed")
        self.max_entries = int(max_entries)
        self.max_entry_bytes = int(max_entry_bytes)
        self.max_age = float(max_age)
        self._entries = collections.OrderedDict()
        self._lock = threading.Lock()
        # answers read before the last forget are not put in (one the
        # database gave before the forget committed may arrive after it)
        self._forgot_at = -math.inf
        self._clock = time.monotonic

    def __len__(self):
        with self._lock:
            return len(self._entries)

    def __contains__(self, scope_key):
        """(scope, key) in cache: whether an entry is held (expired or not)."""
        with self._lock:
            return tuple(scope_key) in self._entries

    def get(self, scope, key, request):
        """The entry of (scope, key) if it may answer request (its JSON
        text), else None; an expired entry is dropped."""
        now = self._clock()
        with self._lock:
            entry = self._entries.get((scope, key))
            if entry is None:
                return None
            if now >= entry.deadline:
                del self._entries[(scope, key)]
                return None
            if entry.request != _digest(request):
                return None
            self._entries.move_to_end((scope, key))
            return entry

    def put(self, scope, key, request, status, body, headers, origin_trace, sent_at, expires_in):
        """Keep a completed answer: status, body (jsonb's text or None),
        headers (as idem_acquire returns them: lower-case names), read by a
        query sent at sent_at (time.monotonic()) that said the record
        expires in expires_in seconds.  Whether it was kept."""
        if status is None or expires_in is None or sent_at is None:
            return False
        headers = dict(headers or {})
        size = len(body.encode()) if body is not None else 0
        size += sum(len(k.encode()) + len(str(v).encode()) for k, v in headers.items())
        now = self._clock()
        deadline = min(sent_at + expires_in, now + self.max_age)
        with self._lock:
            if size > self.max_entry_bytes or deadline <= now or sent_at <= self._forgot_at:
                self._entries.pop((scope, key), None)
                return False
            self._entries[(scope, key)] = _Entry(_digest(request), status, body, headers, origin_trace, deadline)
            self._entries.move_to_end((scope, key))
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return True

    def drop(self, scope, key):
        """Remove the entry of (scope, key), if any."""
        with self._lock:
            self._entries.pop((scope, key), None)

    def forget(self, key, scope=""):
        """Evict (scope, key) from this cache (after idem_forget has
        committed: see Idempotency.forget).  Whether an entry was held."""
        with self._lock:
            self._forgot_at = self._clock()
            return self._entries.pop((scope, key), None) is not None

    def clear(self):
        with self._lock:
            self._entries.clear()


def replay_cache(option, shared_only=False):
    """The ReplayCache of a replay_cache option: None or False (none), True
    (one with the defaults), or a ReplayCache.  shared_only: for a call
    that makes its engine anew (idempotent(), forget()), where a new cache
    would be thrown away with it: True is refused."""
    if option is None or option is False:
        return None
    if option is True and shared_only:
        raise TypeError("replay_cache=True would make a new cache for this call only: pass a ReplayCache shared by the calls")
    if option is True:
        return ReplayCache()
    if not isinstance(option, ReplayCache):
        raise TypeError("replay_cache must be a ReplayCache, True or None, not %r" % (option,))
    return option


def cache_answer(cache, row, scope, key, request):
    """Put in a replay idem_acquire returned (row: Acquired)."""
    if cache is not None and row.outcome == "replay":
        cache.put(scope, key, request, row.status, row.body, row.headers, row.origin_trace,
                  row.sent_at, row.expires_in)


def cache_completion(cache, acquired, scope, key, request, status, canonical, headers, trace):
    """Put in this process's own completion, committed: acquired is the
    claim's Acquired row (its expires_in, its sent_at); headers the JSON
    text given to idem_complete, kept as the database returns them (names in
    lower case, in jsonb's order)."""
    if cache is None:
        return
    stored_headers = None
    if headers is not None:
        given = {k.lower(): v for k, v in json.loads(headers).items()}
        stored_headers = {k: given[k] for k in sorted(given, key=lambda k: (len(k.encode()), k.encode()))}
    cache.put(scope, key, request, status, canonical, stored_headers, trace, acquired.sent_at,
              acquired.expires_in)


# -- duplicate log lines ---------------------------------------------------------

LOG_MODES = ("sampled", "all", "off")


class DuplicateLog:
    """Where the duplicate answers' lines go (the pg_idempotency logger,
    INFO): mode "all" writes each one, "off" none, "sampled" at most one a
    second (for the process: one DuplicateLog, SAMPLED, is shared), the next
    line written saying how many were left out since when."""

    def __init__(self, mode="sampled", interval=1.0):
        if mode not in LOG_MODES:
            raise ValueError("log_duplicates must be one of %s, not %r" % (", ".join(LOG_MODES), mode))
        self.mode = mode
        self.interval = interval
        self._lock = threading.Lock()
        self._last = None  # clock() of the last line written
        self._left_out = 0
        self._left_out_since = None  # time.time() of the first line left out
        self.clock = time.monotonic

    def write(self, fmt, *args):
        if self.mode == "off" or not log.isEnabledFor(logging.INFO):
            return
        if self.mode == "sampled":
            with self._lock:
                now = self.clock()
                if self._last is not None and now - self._last < self.interval:
                    if not self._left_out:
                        self._left_out_since = time.time()
                    self._left_out += 1
                    return
                self._last = now
                left_out, since, self._left_out = self._left_out, self._left_out_since, 0
            if left_out:
                fmt += " (and %d more duplicate answers not logged since %s)"
                args += (left_out, time.strftime("%H:%M:%S", time.localtime(since)))
        log.info(fmt, *args)


SAMPLED = DuplicateLog("sampled")


def duplicate_log(mode):
    """The DuplicateLog of log_duplicates=mode."""
    if mode == "sampled":
        return SAMPLED
    return DuplicateLog(mode)


def duplicate(row, key, scope, trace, replay_ok, dup_log=SAMPLED, cached=False):
    """The answer of an outcome other than acquired (row: an Acquired, or a
    cache entry for a replay served from the cache), logged with the
    request's traceparent and the first request's."""
    outcome = "replay" if cached else row.outcome
    dup_log.write("idempotency: %s, key %r scope %r: traceparent %s, first request's %s",
                  "replay (cached)" if cached else outcome, key, scope, trace or "-",
                  row.origin_trace or "-")
    dup = {}
    if row.origin_trace is not None:
        dup["Idempotent-Origin-Trace"] = row.origin_trace
    if outcome == "replay":
        status = row.status
        if replay_ok and 200 <= status < 300:
            status = 200
        replayed = {SPELLING.get(k, k): v for k, v in (row.headers or {}).items()}
        resp = stored(status, row.body, dict(replayed, **dup, **{"Idempotent-Replayed": "true"}))
    elif row.outcome == "mismatch":
        resp = problem(422, "idempotency-key-reused", "Idempotency-Key already used for another request",
                       "This key was sent before with a different request body; "
                       "use a new key for a new request.", dup)
    else:
        wait = retry_after(row)
        resp = problem(409, "request-in-progress", "A request with this Idempotency-Key is being processed",
                       "Send the same request again after %d second(s)." % wait,
                       dict(dup, **{"Retry-After": str(wait)}))
    resp.outcome = outcome
    resp.cached = cached
    return resp


def retry_after(row):
    return row.retry_after if row.retry_after and row.retry_after > 0 else 1


def stored(status, text, headers):
    """The answer of a stored body (jsonb's text); its Content-Type the one
    in headers (a replay's), else content_type(status)."""
    resp = Response(status, None if text is None else text.encode(), headers)
    if text is not None:
        if not any(k.lower() == "content-type" for k in resp.headers):
            resp.headers["Content-Type"] = content_type(status)
    else:
        resp.headers = {k: v for k, v in resp.headers.items() if k.lower() != "content-type"}
    return resp


def completion(resp):
    """(body as JSON text or None, the headers to store as JSON text or None)
    of a handler's Response; ValueError for a body that is not JSON."""
    body = resp.body
    if body is None:
        text = None
    elif isinstance(body, (bytes, bytearray, str)):
        text = bytes(body).decode() if not isinstance(body, str) else body
        if not text.strip():
            text = None
        else:
            json.loads(text)
    else:
        text = json.dumps(body)
    # the headers to replay: those of REPLAYED_HEADERS that this answer has
    # (its Content-Type as it goes out)
    replayed = {k: v for k, v in resp.headers.items() if k.lower() in SPELLING and k.lower() != "content-type"}
    if text is not None:
        replayed["Content-Type"] = content_type(resp.status)
    return text, (json.dumps(replayed) if replayed else None)


def first_answer(resp, canonical):
    """The first answer as it goes out: the body as the database stored it
    (jsonb's text), so that it and every replay are the same bytes."""
    headers = {k: v for k, v in resp.headers.items() if k.lower() not in ("content-type", "content-length")}
    out = stored(resp.status, canonical, headers)
    out.outcome = "acquired"
    return out
