// Package idempotency makes write endpoints of a net/http server
// exactly-once over the idempotency PostgreSQL extension.
//
//	import idempotency "github.com/idempotency-pg/idempotency-go"
//
//	h := idempotency.Middleware(pool)(mux) // func(http.Handler) http.Handler
//
// (Gin: the subpackage github.com/idempotency-pg/idempotency-go/gin.)
//
// For every request that is not skipped (GET, HEAD, OPTIONS, /health,
// /metrics, SkipPaths, requests whose Route is "") it reads the
// Idempotency-Key header and the JSON body, and:
//
//   - opens one transaction and calls idempotency.idem_acquire(key, body,
//     scope) in it, the scope being the authenticated user and the path
//     (BEGIN and the call in one round trip: one simple query);
//   - acquired: runs the handler, which does its writes in the same
//     transaction (Tx(r.Context())), then stores the handler's status and
//     body with idempotency.idem_complete and commits: the claim, the
//     business writes and the stored response commit or roll back
//     together. The response is held back until the commit has succeeded;
//   - replay: answers the stored status, body and headers (those of
//     ReplayedHeaders that the first answer had), with Idempotent-Replayed:
//     true, without running the handler (with the ReplayCache option, a
//     byte-identical retry of a completed request is answered from memory);
//   - in_progress: 409 with Retry-After (retry_after);
//   - mismatch: 422.
//
// The request's W3C traceparent header goes with the claim (idem_acquire's
// trace). A replay, a 409 or a 422 logs a line (sampled by default:
// LogDuplicates) with its own traceparent and the first request's
// (origin_trace), and sends the first request's back in
// Idempotent-Origin-Trace: the client (the same user: the scope holds it)
// can then find the attempt that did the work in its traces.
//
// Routes declared with Lease claim across transactions instead, for handlers
// that call an outside service: the claim commits at once, the handler makes
// its call (KeepAlive or Extend push the lease out while it lasts), and its
// writes and the stored response commit in a second transaction, fenced by
// the claim (idem_complete(..., claim)).
//
// Handlers answer JSON. A response is stored, whatever its status (a 4xx or
// 5xx is replayed too), unless the handler calls Release (the claim is given
// up: the retry runs again) or Fail (the transaction is rolled back: nothing
// is stored, the retry runs again).
//
// A handler that calls out in several steps records each step done with
// Checkpoint; when its worker dies, the retry that takes the claim over
// finds the last checkpoint with Resumed and carries on from there instead
// of repeating the step.
//
// Every function that a handler calls takes the request's context
// (r.Context()), which carries the claim.
package idempotency

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgconn"
	"github.com/jackc/pgx/v4"
	"github.com/jackc/pgx/v4/pgxpool"
)

// HeaderKey is the request header that carries the client's key, and
// HeaderReplayed the response header that marks a replayed response.
const (
	HeaderKey      = "Idempotency-Key"
	HeaderReplayed = "Idempotent-Replayed"
)

// HeaderTrace is the request header passed on as the claim's trace (W3C
// Trace Context), and HeaderOriginTrace the response header of a duplicate
// (replay, 409 in progress, 422) that carries the first request's.
const (
	HeaderTrace       = "traceparent"
	HeaderOriginTrace = "Idempotent-Origin-Trace"
)

// ReplayedHeaders are the response headers stored with an answer
// (idem_complete's response_headers) and sent again with its replays, as
// spelled here. Others (Date, Retry-After, cookies) are not replayed.
var ReplayedHeaders = []string{"Location", "ETag", "Content-Type", "Content-Location"}

// ProblemTypeBase prefixes the "type" of the problem+json bodies (RFC 9457)
// that the middleware answers; point it at your own documentation.
var ProblemTypeBase = "https://example.com/problems/"

// dbTimeout bounds the middleware's own statements. They run on a context
// of their own, not the request's: a client that hangs up must not cut a
// completion short once the handler has done its work.
const dbTimeout = 30 * time.Second

type ctxKey int

const (
	stateKey ctxKey = iota // the claim of the request (*state)
	userKey                // the user that ContextWithUser set
)

// ContextWithUser returns ctx carrying the authenticated user's id: the
// authentication middleware, in front of this one, calls it (r =
// r.WithContext(idempotency.ContextWithUser(r.Context(), id))). The user
// goes into the scope, so that two users' equal keys never meet.
func ContextWithUser(ctx context.Context, user string) context.Context {
	return context.WithValue(ctx, userKey, user)
}

// UserFromContext is the user that ContextWithUser set, or "".
func UserFromContext(ctx context.Context) string {
	u, _ := ctx.Value(userKey).(string)
	return u
}

// Option changes a Middleware's defaults.
type Option func(*config)

type config struct {
	skip     map[string]bool
	user     func(*http.Request) string
	route    func(*http.Request) string
	replayOK bool
	ttl      time.Duration
	leases   map[string]time.Duration
	cache    *Cache
	logMode  LogMode
}

// SkipPaths adds paths that are passed through untouched (besides /health
// and /metrics).
func SkipPaths(paths ...string) Option {
	return func(cfg *config) {
		for _, p := range paths {
			cfg.skip[p] = true
		}
	}
}

// User sets how the authenticated user is found (default: the one that
// ContextWithUser put in the request's context; "anonymous" if none). It
// goes into the scope, so that two users' equal keys never meet.
func User(f func(*http.Request) string) Option {
	return func(cfg *config) { cfg.user = f }
}

// Route sets how a request's route is found, as Lease names it (default:
// the URL's path). A request whose route is "" (not routed: it would be
// answered 404) is passed through untouched. ServeMuxRoute is the route
// of a ServeMux; the Gin adapter uses Gin's route.
func Route(f func(*http.Request) string) Option {
	return func(cfg *config) { cfg.route = f }
}

// ServeMuxRoute is Route with the pattern that mux routes the request to
// ("/api/charges", "/api/payments/"), "" where mux has none.
func ServeMuxRoute(mux *http.ServeMux) Option {
	return Route(func(r *http.Request) string {
		_, pattern := mux.Handler(r)
		return pattern
	})
}

// ReplayAsOK is the seed article's rule: a replay of a stored 2xx response
// is answered 200 (the first answer stays 201), with the original body.
// Off by default: a replay then carries the stored status, as Stripe does.
func ReplayAsOK() Option {
	return func(cfg *config) { cfg.replayOK = true }
}

// TTL sets how long a key lives (default: the server's
// idempotency.default_ttl).
func TTL(ttl time.Duration) Option {
	return func(cfg *config) { cfg.ttl = ttl }
}

// Lease makes the route (as Route finds it: the path by default, the
// pattern with ServeMuxRoute, Gin's "/users/:id/pay" with the Gin adapter)
// claim across transactions, with this lease, for a handler that calls an
// outside service.
func Lease(method, route string, lease time.Duration) Option {
	return func(cfg *config) { cfg.leases[method+" "+route] = lease }
}

// state is what the middleware keeps for one acquired request.
type state struct {
	pool   *pgxpool.Pool
	ctx    context.Context
	cancel context.CancelFunc
	key    string
	scope  string
	lease  time.Duration // 0: one transaction
	claim  *string       // the claim idem_acquire returned (checkpoints need it)
	phase  *string       // after a takeover: the last checkpoint of the claim taken over
	pstate *string       // ... and its state (jsonb's text)

	cache   *Cache            // the ReplayCache option's, or nil
	request string            // idem_acquire's request, as sent (the body, or "null")
	trace   *string           // the request's traceparent (idem_acquire's trace)
	hash    [sha256.Size]byte // the request's SHA-256 (replay cache)
	epoch   uint64            // the replay cache's epoch before the claim
	sent    time.Time         // local clock before idem_acquire was sent
	left    time.Duration     // expires_at - the database's clock, as idem_acquire answered

	mu           sync.Mutex // serializes the handler and a KeepAlive goroutine
	tx           *claimTx
	released     bool
	failed       error // Fail's: roll back, store nothing
	checkpointed bool  // a checkpoint was committed: a failure leaves the claim to its lease
}

// Middleware returns the idempotency middleware over pool, for net/http:
// Middleware(pool, opts...)(handler) is handler made exactly-once.
func Middleware(pool *pgxpool.Pool, opts ...Option) func(http.Handler) http.Handler {
	cfg := &config{
		skip:   map[string]bool{"/health": true, "/metrics": true},
		user:   func(r *http.Request) string { return UserFromContext(r.Context()) },
		route:  func(r *http.Request) string { return r.URL.Path },
		leases: map[string]time.Duration{},
	}
	for _, o := range opts {
		o(cfg)
	}
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			switch r.Method {
			case http.MethodGet, http.MethodHead, http.MethodOptions:
				next.ServeHTTP(w, r)
				return
			}
			if cfg.skip[r.URL.Path] {
				next.ServeHTTP(w, r)
				return
			}
			route := cfg.route(r)
			if route == "" {
				next.ServeHTTP(w, r)
				return
			}
			cfg.handle(w, r, next, pool, route)
		})
	}
}

func (cfg *config) handle(w http.ResponseWriter, r *http.Request, next http.Handler, pool *pgxpool.Pool, route string) {
	key := r.Header.Get(HeaderKey)
	if key == "" {
		problem(w, http.StatusBadRequest, "idempotency-key-missing",
			"Idempotency-Key header missing",
			"This operation is idempotent: send an Idempotency-Key header (a UUID that you send again when you retry).")
		return
	}
	if len(key) > 255 {
		problem(w, http.StatusBadRequest, "idempotency-key-invalid",
			"Idempotency-Key header too long", "The key is at most 255 bytes long.")
		return
	}
	var body []byte
	if r.Body != nil {
		b, err := io.ReadAll(r.Body)
		if err != nil {
			problem(w, http.StatusBadRequest, "body-unreadable", "Request body unreadable", err.Error())
			return
		}
		body = b
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	request := "null" // an empty body: compared as JSON null
	if len(bytes.TrimSpace(body)) > 0 {
		if !json.Valid(body) {
			problem(w, http.StatusBadRequest, "body-not-json", "Request body is not JSON",
				"The request body is compared with the first request's as JSON.")
			return
		}
		request = string(body)
	}

	// The trace is for linking duplicates to the first request: one too
	// long to store (255 bytes) is not passed on rather than refused.
	var trace *string
	if tp := r.Header.Get(HeaderTrace); tp != "" && len(tp) <= 255 {
		trace = &tp
	}

	st := &state{pool: pool, cache: cfg.cache, key: key, scope: cfg.scope(r), request: request, trace: trace}
	if strings.IndexByte(key, 0) >= 0 || strings.IndexByte(st.scope, 0) >= 0 || (trace != nil && strings.IndexByte(*trace, 0) >= 0) {
		problem(w, http.StatusBadRequest, "bad-request", "Request refused",
			"The Idempotency-Key, the path or the traceparent holds a NUL byte.")
		return
	}
	st.lease = cfg.leases[r.Method+" "+route]

	// The replay cache: a completed answer to this very request.
	if cfg.cache != nil {
		st.hash = sha256.Sum256([]byte(request))
		if e := cfg.cache.get(st.scope, key, st.hash); e != nil {
			cfg.logDuplicate("replay (cached)", key, st.scope, trace, e.originTrace)
			cfg.replay(w, e.status, e.body, e.headers, e.originTrace)
			return
		}
		st.epoch = cfg.cache.snapshot()
	}

	st.ctx, st.cancel = context.WithTimeout(context.Background(), dbTimeout)
	defer st.cancel()

	a, conn, err := cfg.acquire(st)
	if err != nil {
		dbProblem(w, err)
		return
	}

	if a.outcome != "acquired" {
		// A duplicate wrote nothing: its transaction is rolled back after
		// the answer (rollbackLater), which does not wait for it.
		defer rollbackLater(conn)
		// Link it to the first request, in the log and for the client.
		cfg.logDuplicate(a.outcome, key, st.scope, trace, a.originTrace)
	}

	switch a.outcome {
	case "replay":
		if a.status == nil {
			dbProblem(w, errors.New("idem_acquire answered replay without a status"))
			return
		}
		if cfg.cache != nil {
			cfg.cache.put(&entry{k: cacheKey{st.scope, key}, request: st.hash, status: int(*a.status),
				body: a.body, headers: a.headers, originTrace: a.originTrace,
				deadline: st.sent.Add(a.left)}, st.epoch)
		}
		cfg.replay(w, int(*a.status), a.body, a.headers, a.originTrace)
		return
	case "mismatch":
		if a.originTrace != nil {
			w.Header().Set(HeaderOriginTrace, *a.originTrace)
		}
		problem(w, http.StatusUnprocessableEntity, "idempotency-key-reused",
			"Idempotency-Key already used for another request",
			"This key was sent before with a different request body; use a new key for a new request.")
		return
	case "in_progress":
		if a.originTrace != nil {
			w.Header().Set(HeaderOriginTrace, *a.originTrace)
		}
		wait := 1
		if a.retryAfter != nil && *a.retryAfter > 0 {
			wait = int(*a.retryAfter)
		}
		w.Header().Set("Retry-After", strconv.Itoa(wait))
		problem(w, http.StatusConflict, "request-in-progress",
			"A request with this Idempotency-Key is being processed",
			"Send the same request again after "+strconv.Itoa(wait)+" second(s).")
		return
	case "acquired":
	default:
		dbProblem(w, fmt.Errorf("idem_acquire answered the unknown outcome %q", a.outcome))
		return
	}

	// acquired
	st.claim, st.phase, st.pstate, st.left = a.claim, a.phase, a.pstate, a.left
	tx := &claimTx{conn: conn}
	if st.lease > 0 {
		// Commit the claim now: it is visible as processing, protected by
		// its lease, while the handler calls out.
		if err := tx.Commit(st.ctx); err != nil {
			dbProblem(w, err)
			return
		}
	} else {
		st.tx = tx
	}

	hw := &holdWriter{header: w.Header(), status: http.StatusOK}
	func() {
		defer func() {
			if p := recover(); p != nil {
				// Nothing stored; in lease mode the claim is left to its
				// lease (a retry takes it over once it runs out).
				st.rollback()
				panic(p)
			}
		}()
		next.ServeHTTP(hw, r.WithContext(context.WithValue(r.Context(), stateKey, st)))
	}()
	st.finish(w, hw)
}

// acquired is what idem_acquire answered.
type acquired struct {
	outcome              string
	status, retryAfter   *int32
	body, claim          *string
	phase, pstate        *string
	headers, originTrace *string
	left                 time.Duration // expires_at - clock_timestamp(); 0 when unknown
}

// acquire sends BEGIN and idem_acquire in one round trip (one simple
// query, the values as literals) on a connection of the pool, and answers
// what idem_acquire did; the transaction is open on conn then (err nil).
// It notes in st the local time before the query went, and idem_acquire's
// expires_at less the database's clock_timestamp() after the call.
func (cfg *config) acquire(st *state) (a acquired, conn *pgxpool.Conn, err error) {
	conn, err = st.pool.Acquire(st.ctx)
	if err != nil {
		return a, nil, err
	}
	pc := conn.Conn().PgConn()
	vals := []*string{&st.key, &st.request, &st.scope, st.trace}
	lits := make([]string, len(vals))
	for i, v := range vals {
		if lits[i], err = literal(pc, v); err != nil {
			conn.Release()
			return a, nil, err
		}
	}
	query := `BEGIN;
SELECT outcome, response_status, response_body::text, retry_after, claim::text, phase, state::text,
       response_headers::text, origin_trace,
       extract(epoch FROM expires_at - pg_catalog.clock_timestamp())::float8
  FROM idempotency.idem_acquire(key => ` + lits[0] + `::text, request => ` + lits[1] + `::jsonb,
                                scope => ` + lits[2] + `::text, ttl => ` + interval(seconds(cfg.ttl)) + `,
                                lease => ` + interval(seconds(st.lease)) + `, trace => ` + lits[3] + `::text)`
	st.sent = time.Now()
	res, err := pc.Exec(st.ctx, query).ReadAll()
	if err == nil && (len(res) != 2 || len(res[1].Rows) != 1 || len(res[1].Rows[0]) != 10) {
		err = errors.New("idempotency: unexpected answer to BEGIN and idem_acquire")
	}
	if err != nil {
		if !pc.IsClosed() && pc.TxStatus() != 'I' {
			rollbackLater(conn)
		} else {
			conn.Release()
		}
		return a, nil, err
	}
	row := res[1].Rows[0]
	text := func(i int) *string {
		if row[i] == nil {
			return nil
		}
		s := string(row[i])
		return &s
	}
	integer := func(i int) *int32 {
		if row[i] == nil {
			return nil
		}
		n, perr := strconv.ParseInt(string(row[i]), 10, 32)
		if perr != nil {
			err = perr
		}
		v := int32(n)
		return &v
	}
	a.outcome = string(row[0])
	a.status, a.body, a.retryAfter, a.claim = integer(1), text(2), integer(3), text(4)
	a.phase, a.pstate, a.headers, a.originTrace = text(5), text(6), text(7), text(8)
	if row[9] != nil {
		f, perr := strconv.ParseFloat(string(row[9]), 64)
		if perr != nil {
			err = perr
		} else if f > 0 {
			a.left = time.Duration(f * float64(time.Second))
		}
	}
	if err != nil {
		rollbackLater(conn)
		return a, nil, err
	}
	return a, conn, nil
}

// replay answers a stored answer: its status (200 for a 2xx with
// ReplayAsOK), body and headers, Idempotent-Replayed: true, and the first
// request's trace in Idempotent-Origin-Trace. From the database or the
// replay cache alike.
func (cfg *config) replay(w http.ResponseWriter, status int, body, headers, originTrace *string) {
	if originTrace != nil {
		w.Header().Set(HeaderOriginTrace, *originTrace)
	}
	code := status
	if cfg.replayOK && code >= 200 && code < 300 {
		code = http.StatusOK
	}
	ct := ""
	if headers != nil {
		var h map[string]string
		if err := json.Unmarshal([]byte(*headers), &h); err == nil {
			// stored in lower case: sent as ReplayedHeaders spell them
			for name, v := range h {
				if strings.EqualFold(name, "content-type") {
					ct = v
					continue
				}
				w.Header()[spelling(name)] = []string{v}
			}
		}
	}
	w.Header().Set(HeaderReplayed, "true")
	respond(w, code, body, ct)
}

// logDuplicate writes the line of a duplicate answer (LogDuplicates): the
// outcome, the key and scope, the request's traceparent and the first
// request's.
func (cfg *config) logDuplicate(outcome, key, scope string, trace, originTrace *string) {
	if cfg.logMode == LogOff {
		return
	}
	line := func() string {
		return fmt.Sprintf("idempotency: %s, key %q scope %q: traceparent %s, first request's %s",
			outcome, key, scope, orDash(trace), orDash(originTrace))
	}
	if cfg.logMode == LogAll {
		logPrint(line())
		return
	}
	dupSampler.log(line)
}

// finish stores the handler's response and commits, then sends it; or,
// after Release or Fail, sends it without storing it.
func (st *state) finish(w http.ResponseWriter, hw *holdWriter) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.failed != nil {
		st.rollbackLocked()
		if st.lease > 0 && !st.released && !st.checkpointed {
			// The outside call may have happened: give the claim up so
			// that a retry runs again at once (the outside service is
			// called with the same key and deduplicates it).
			_, _ = st.pool.Exec(st.ctx, `SELECT idempotency.idem_release(key => $1, scope => $2, claim => $3::uuid)`,
				st.key, st.scope, st.claim)
		}
		hw.flush(w)
		return
	}
	if st.released {
		if st.tx != nil {
			if err := st.tx.Commit(st.ctx); err != nil {
				st.tx = nil
				dropReplayed(w)
				dbProblem(w, err)
				return
			}
			st.tx = nil
		}
		hw.flush(w)
		return
	}

	var body *string
	ct := ""
	if hw.body.Len() > 0 {
		if !json.Valid(hw.body.Bytes()) {
			st.rollbackLocked()
			dropReplayed(w)
			problem(w, http.StatusInternalServerError, "response-not-json", "Handler answered non-JSON",
				"The idempotency middleware stores JSON responses only.")
			return
		}
		s := hw.body.String()
		body = &s
		ct = contentType(hw.status)
	}
	// The headers to replay: those of ReplayedHeaders that this answer has
	// (its Content-Type as it goes out).
	replayed := map[string]string{}
	for _, name := range ReplayedHeaders {
		if v := w.Header().Get(name); v != "" {
			replayed[name] = v
		}
	}
	delete(replayed, "Content-Type")
	if ct != "" {
		replayed["Content-Type"] = ct
	}
	var headers *string
	if len(replayed) > 0 {
		b, _ := json.Marshal(replayed)
		h := string(b)
		headers = &h
	}
	tx, err := st.txLocked()
	if err != nil {
		dropReplayed(w)
		dbProblem(w, err)
		return
	}
	// idem_complete and COMMIT in one round trip. The body goes out as the
	// database stores it (jsonb's text), so that the first answer and every
	// replay are the same bytes.
	var canonical *string
	query, err := completeQuery(tx, st, hw.status, body, headers)
	if err == nil {
		canonical, err = tx.completeAndCommit(st.ctx, query)
	} else {
		_ = tx.Rollback(st.ctx)
	}
	st.tx = nil
	if err != nil {
		dropReplayed(w) // not the answer they were set for
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55000" {
			// Lease mode: the lease ran out and another request took the
			// claim over; its answer is the one that counts.
			w.Header().Set("Retry-After", "1")
			problem(w, http.StatusConflict, "idempotency-claim-lost",
				"This request's claim was taken over",
				"It took longer than its lease; send the same request again to get the stored answer.")
			return
		}
		dbProblem(w, err)
		return
	}
	if st.cache != nil && st.left > 0 {
		// committed: this answer is the key's, until its expires_at
		st.cache.put(&entry{k: cacheKey{st.scope, st.key}, request: st.hash, status: hw.status,
			body: canonical, headers: headers, originTrace: st.trace, deadline: st.sent.Add(st.left)}, st.epoch)
	}
	respond(w, hw.status, canonical, ct)
}

// completeQuery is idem_complete, answering the stored body's text too,
// then COMMIT: one simple query, its values as literals.
func completeQuery(tx *claimTx, st *state, status int, body, headers *string) (string, error) {
	pc := tx.conn.Conn().PgConn()
	vals := []*string{&st.key, body, &st.scope, st.claim, headers}
	lits := make([]string, len(vals))
	for i, v := range vals {
		var err error
		if lits[i], err = literal(pc, v); err != nil {
			return "", err
		}
	}
	return `SELECT idempotency.idem_complete(key => ` + lits[0] + `::text, response_status => ` + strconv.Itoa(status) + `::int,
                                 response_body => b.j, scope => ` + lits[2] + `::text, claim => ` + lits[3] + `::uuid,
                                 response_headers => ` + lits[4] + `::jsonb),
       b.j::text
  FROM (SELECT ` + lits[1] + `::jsonb AS j) b;
COMMIT`, nil
}

// Resumed is the last checkpoint of the claim that this request took over
// (idem_acquire's phase and state after a takeover): ok is false for a new
// key, and when the worker before it recorded none.
func Resumed(ctx context.Context) (phase string, st json.RawMessage, ok bool) {
	s, err := get(ctx)
	if err != nil || s.phase == nil {
		return "", nil, false
	}
	if s.pstate != nil {
		st = json.RawMessage(*s.pstate)
	}
	return *s.phase, st, true
}

// Checkpoint records how far the handler got (idempotency.idem_checkpoint):
// phase names the step done, state (marshalled to JSON; nil for none) what
// the next attempt needs to carry on. In the request's transaction when
// one is open (it commits or rolls back with the handler's writes), else,
// in lease mode before Tx, committed at once. Once a checkpoint is
// committed, a handler that fails (Fail) leaves the claim to its lease
// instead of releasing it: the retry that takes it over resumes.
func Checkpoint(ctx context.Context, phase string, state interface{}) error {
	s, err := get(ctx)
	if err != nil {
		return err
	}
	var js *string
	if state != nil {
		b, err := json.Marshal(state)
		if err != nil {
			return err
		}
		v := string(b)
		js = &v
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	const q = `SELECT idempotency.idem_checkpoint(key => $1, scope => $2, claim => $3::uuid,
	                                              phase => $4, state => $5::jsonb)`
	if s.tx != nil {
		_, err = s.tx.Exec(s.ctx, q, s.key, s.scope, s.claim, phase, js)
		return err
	}
	if _, err = s.pool.Exec(s.ctx, q, s.key, s.scope, s.claim, phase, js); err != nil {
		return err
	}
	s.checkpointed = true
	return nil
}

// Tx is the request's transaction: the handler's writes go in it, and commit
// with the stored response. In lease mode it is begun at the first call:
// call it after the outside call, not before.
func Tx(ctx context.Context) (pgx.Tx, error) {
	st, err := get(ctx)
	if err != nil {
		return nil, err
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	tx, err := st.txLocked()
	if err != nil {
		return nil, err
	}
	return tx, nil
}

// Key is the request's Idempotency-Key (to pass on to an outside service
// that deduplicates, or to keep beside the business row); "" outside a
// claimed request.
func Key(ctx context.Context) string {
	if st, err := get(ctx); err == nil {
		return st.key
	}
	return ""
}

// Fail marks the request failed (err, not nil, says why): the transaction
// is rolled back and nothing is stored, the answer goes out as the handler
// makes it, and the retry runs the handler again. For database errors. In
// lease mode the claim is given up too, unless a checkpoint was committed
// (the claim is then left to its lease, for the retry to resume).
func Fail(ctx context.Context, err error) {
	if err == nil {
		err = errors.New("idempotency: Fail")
	}
	if st, e := get(ctx); e == nil {
		st.mu.Lock()
		st.failed = err
		st.mu.Unlock()
	}
}

// Release gives the claim up with idempotency.idem_release: the response is
// not stored, and the next request with this key runs the handler again.
// For a failure worth retrying (an outside service that is down). In
// one-transaction mode the release and the handler's writes commit together.
func Release(ctx context.Context) error {
	st, err := get(ctx)
	if err != nil {
		return err
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	var released bool
	const q = `SELECT idempotency.idem_release(key => $1, scope => $2, claim => $3::uuid)`
	if st.tx != nil {
		err = st.tx.QueryRow(st.ctx, q, st.key, st.scope, st.claim).Scan(&released)
	} else {
		err = st.pool.QueryRow(st.ctx, q, st.key, st.scope, st.claim).Scan(&released)
	}
	if err != nil {
		return err
	}
	st.released = true
	return nil
}

// Extend pushes the lease out (idempotency.idem_extend) to now + the route's
// lease, while a slow outside call runs; a no-op in one-transaction mode.
func Extend(ctx context.Context) error {
	st, err := get(ctx)
	if err != nil {
		return err
	}
	return st.extend()
}

// KeepAlive calls Extend every third of the lease until the returned
// function is called.
func KeepAlive(ctx context.Context) (stop func()) {
	st, err := get(ctx)
	if err != nil || st.lease == 0 {
		return func() {}
	}
	done := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		t := time.NewTicker(st.lease / 3)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				if err := st.extend(); err != nil {
					// Taken over or expired: the completion will be refused.
					return
				}
			}
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() {
			close(done)
			<-finished
		})
	}
}

func (st *state) extend() error {
	if st.lease == 0 {
		return nil
	}
	_, err := st.pool.Exec(st.ctx, `SELECT idempotency.idem_extend(key => $1, scope => $2, claim => $3::uuid,
	                                                                 lease => $4::float8 * interval '1 second')`,
		st.key, st.scope, st.claim, seconds(st.lease))
	return err
}

func (st *state) txLocked() (*claimTx, error) {
	if st.tx == nil {
		tx, err := beginTx(st.ctx, st.pool)
		if err != nil {
			return nil, err
		}
		st.tx = tx
	}
	return st.tx, nil
}

func (st *state) rollback() {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.rollbackLocked()
}

func (st *state) rollbackLocked() {
	if st.tx != nil {
		_ = st.tx.Rollback(st.ctx)
		st.tx = nil
	}
}

// errNoClaim is what the handler functions answer for a request that the
// middleware did not claim.
var errNoClaim = errors.New("idempotency: no claim for this request (route skipped by the middleware, or not the request's context?)")

func get(ctx context.Context) (*state, error) {
	if ctx == nil {
		return nil, errNoClaim
	}
	st, ok := ctx.Value(stateKey).(*state)
	if !ok {
		return nil, errNoClaim
	}
	return st, nil
}

// scope is the authenticated user and the request (method and path, so
// that /orders/7/pay and /orders/8/pay never share a key), hashed when it
// would be longer than the 255 bytes a scope may have.
func (cfg *config) scope(r *http.Request) string {
	return Scope(cfg.user(r), r.Method, r.URL.Path)
}

// seconds is d as a float for "$n::float8 * interval '1 second'", or NULL
// (the server's default) for 0.
func seconds(d time.Duration) *float64 {
	if d <= 0 {
		return nil
	}
	s := math.Ceil(d.Seconds()*1e6) / 1e6
	return &s
}

// contentType is what a JSON body is sent as, first time and replayed
// alike: errors as problem+json (RFC 9457), the rest as JSON.
func contentType(status int) string {
	if status >= 400 {
		return "application/problem+json"
	}
	return "application/json; charset=utf-8"
}

// respond sends status and body, as Content-Type ct (empty:
// contentType(status)).
func respond(w http.ResponseWriter, status int, body *string, ct string) {
	if body == nil {
		w.Header().Del("Content-Type")
		w.WriteHeader(status)
		return
	}
	if ct == "" {
		ct = contentType(status)
	}
	w.Header().Set("Content-Type", ct)
	w.WriteHeader(status)
	_, _ = io.WriteString(w, *body)
}

// spelling is a stored (lower-case) header name as ReplayedHeaders spell
// it, or in Go's canonical form.
func spelling(name string) string {
	for _, n := range ReplayedHeaders {
		if strings.EqualFold(n, name) {
			return n
		}
	}
	return http.CanonicalHeaderKey(name)
}

// dropReplayed removes the handler's replayable headers from an answer
// that is not the handler's (the middleware's own problem instead).
func dropReplayed(w http.ResponseWriter) {
	for _, name := range ReplayedHeaders {
		w.Header().Del(name)
	}
}

func orDash(s *string) string {
	if s == nil {
		return "-"
	}
	return *s
}

// problem answers an RFC 9457 problem+json body; such answers are never
// stored.
func problem(w http.ResponseWriter, status int, typ, title, detail string) {
	b, _ := json.Marshal(map[string]interface{}{
		"type":   ProblemTypeBase + typ,
		"title":  title,
		"status": status,
		"detail": detail,
	})
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// dbProblem answers a database error: 503 with Retry-After for the errors
// that a retry cures (serialization failure, deadlock, lock timeout, too
// many connections), 400 for data the database refused, else 500.
func dbProblem(w http.ResponseWriter, err error) {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch {
		case strings.HasPrefix(pgErr.Code, "40"), pgErr.Code == "55P03", pgErr.Code == "53300":
			w.Header().Set("Retry-After", "1")
			problem(w, http.StatusServiceUnavailable, "try-again", "Try again", pgErr.Message)
			return
		case strings.HasPrefix(pgErr.Code, "22"):
			problem(w, http.StatusBadRequest, "bad-request", "Request refused by the database", pgErr.Message)
			return
		}
	}
	problem(w, http.StatusInternalServerError, "database-error", "Database error", err.Error())
}

// holdWriter holds the handler's response back until it is stored and
// committed. Headers go straight to the real writer's header map.
type holdWriter struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func (w *holdWriter) Header() http.Header { return w.header }

func (w *holdWriter) WriteHeader(code int) {
	if code > 0 {
		w.status = code
	}
}

func (w *holdWriter) Write(b []byte) (int, error) { return w.body.Write(b) }

// flush sends the held response as the handler made it (not stored).
func (w *holdWriter) flush(rw http.ResponseWriter) {
	rw.WriteHeader(w.status)
	_, _ = rw.Write(w.body.Bytes())
}
