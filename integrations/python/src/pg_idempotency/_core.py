"""pg_idempotency._core -- what the sync and async engines share: the SQL,
the answers (RFC 9457 problems, the IETF draft-09 codes) and the checks of
a request before it is claimed.  No I/O here."""

import hashlib
import json
import logging

log = logging.getLogger("pg_idempotency")

PROBLEM_BASE = "https://example.com/problems/"
# The response headers stored with an answer (idem_complete's
# response_headers, which keeps them in lower case) and sent again with its
# replays, spelled as here.
REPLAYED_HEADERS = ("Location", "ETag", "Content-Type", "Content-Location")
SPELLING = {h.lower(): h for h in REPLAYED_HEADERS}

ACQUIRE = """
    SELECT outcome, response_status, response_body::text, retry_after, claim::text,
           phase, state, response_headers, origin_trace
      FROM idempotency.idem_acquire(key => %s::text, request => %s::jsonb, scope => %s::text,
                                    ttl => %s::float8 * interval '1 second',
                                    lease => %s::float8 * interval '1 second',
                                    trace => %s::text)"""
COMPLETE = """
    SELECT idempotency.idem_complete(key => %(key)s::text, response_status => %(status)s::int,
                                     response_body => %(body)s::jsonb, scope => %(scope)s::text,
                                     claim => %(claim)s::uuid, response_headers => %(headers)s::jsonb),
           %(body)s::jsonb::text"""
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
    """One row of idem_acquire."""

    def __init__(self, row):
        (self.outcome, self.status, self.body, self.retry_after, self.claim,
         self.phase, self.state, self.headers, self.origin_trace) = row


def duplicate(row, key, scope, trace, replay_ok):
    """The answer of an outcome other than acquired, logged with the
    request's traceparent and the first request's."""
    log.info("idempotency: %s, key %r scope %r: traceparent %s, first request's %s",
             row.outcome, key, scope, trace or "-", row.origin_trace or "-")
    dup = {}
    if row.origin_trace is not None:
        dup["Idempotent-Origin-Trace"] = row.origin_trace
    if row.outcome == "replay":
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
    resp.outcome = row.outcome
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
