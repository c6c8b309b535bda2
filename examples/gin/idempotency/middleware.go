// Package idempotency is a Gin middleware that makes write endpoints
// exactly-once over the idempotency PostgreSQL extension.
//
//	r.Use(idempotency.Middleware(pool))
//
// For every request that is not skipped (GET, HEAD, OPTIONS, /health,
// /metrics, unrouted paths) it reads the Idempotency-Key header and the JSON
// body, and:
//
//   - opens one transaction and calls idempotency.idem_acquire(key, body,
//     scope) in it, the scope being the authenticated user and the route;
//   - acquired: runs the handler, which does its writes in the same
//     transaction (Tx), then stores the handler's status and body with
//     idempotency.idem_complete and commits: the claim, the business writes
//     and the stored response commit or roll back together. The response is
//     held back until the commit has succeeded;
//   - replay: answers the stored status, body and headers (those of
//     ReplayedHeaders that the first answer had), with Idempotent-Replayed:
//     true, without running the handler;
//   - in_progress: 409 with Retry-After (retry_after);
//   - mismatch: 422.
//
// The request's W3C traceparent header goes with the claim (idem_acquire's
// trace). A replay, a 409 or a 422 logs a line with its own traceparent and
// the first request's (origin_trace), and sends the first request's back in
// Idempotent-Origin-Trace: the client (the same user: the scope holds it)
// can then find the attempt that did the work in its traces.
//
// Routes declared with Lease claim across transactions instead, for handlers
// that call an outside service: the claim commits at once, the handler makes
// its call (KeepAlive or Extend push the lease out while it lasts), and its
// writes and the stored response commit in a second transaction, fenced by
// the claim (idem_complete(..., claim)).
//
// Handlers answer with JSON (c.JSON). A response is stored, whatever its
// status (a 4xx or 5xx is replayed too), unless the handler calls Release
// (the claim is given up: the retry runs again) or records an error with
// c.Error (the transaction is rolled back: nothing is stored, the retry runs
// again).
//
// A handler that calls out in several steps records each step done with
// Checkpoint; when its worker dies, the retry that takes the claim over
// finds the last checkpoint with Resumed and carries on from there instead
// of repeating the step.
package idempotency

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"log"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/gin-gonic/gin"
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

// UserKey is the gin context key under which the authentication middleware
// is expected to have put the user's id (see User to read it elsewhere).
const UserKey = "user"

// ProblemTypeBase prefixes the "type" of the problem+json bodies (RFC 9457)
// that the middleware answers; point it at your own documentation.
var ProblemTypeBase = "https://example.com/problems/"

// dbTimeout bounds the middleware's own statements. They run on a context
// of their own, not the request's: a client that hangs up must not cut a
// completion short once the handler has done its work.
const dbTimeout = 30 * time.Second

const stateKey = "idempotency.state"

// Option changes a Middleware's defaults.
type Option func(*config)

type config struct {
	skip     map[string]bool
	user     func(*gin.Context) string
	replayOK bool
	ttl      time.Duration
	leases   map[string]time.Duration
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

// User sets how the authenticated user is found (default: the string that
// the authentication middleware stored under UserKey). It goes into the
// scope, so that two users' equal keys never meet.
func User(f func(*gin.Context) string) Option {
	return func(cfg *config) { cfg.user = f }
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

// Lease makes the route (as registered: "/api/charges", "/users/:id/pay")
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

	mu           sync.Mutex // serializes the handler and a KeepAlive goroutine
	tx           pgx.Tx
	released     bool
	checkpointed bool // a checkpoint was committed: a failure leaves the claim to its lease
}

// Middleware returns the idempotency middleware over pool.
func Middleware(pool *pgxpool.Pool, opts ...Option) gin.HandlerFunc {
	cfg := &config{
		skip:   map[string]bool{"/health": true, "/metrics": true},
		user:   func(c *gin.Context) string { return c.GetString(UserKey) },
		leases: map[string]time.Duration{},
	}
	for _, o := range opts {
		o(cfg)
	}
	return func(c *gin.Context) {
		switch c.Request.Method {
		case http.MethodGet, http.MethodHead, http.MethodOptions:
			c.Next()
			return
		}
		if cfg.skip[c.Request.URL.Path] || c.FullPath() == "" {
			c.Next()
			return
		}
		cfg.handle(c, pool)
	}
}

func (cfg *config) handle(c *gin.Context, pool *pgxpool.Pool) {
	key := c.GetHeader(HeaderKey)
	if key == "" {
		problem(c, http.StatusBadRequest, "idempotency-key-missing",
			"Idempotency-Key header missing",
			"This operation is idempotent: send an Idempotency-Key header (a UUID that you send again when you retry).")
		return
	}
	if len(key) > 255 {
		problem(c, http.StatusBadRequest, "idempotency-key-invalid",
			"Idempotency-Key header too long", "The key is at most 255 bytes long.")
		return
	}
	body, err := io.ReadAll(c.Request.Body)
	if err != nil {
		problem(c, http.StatusBadRequest, "body-unreadable", "Request body unreadable", err.Error())
		return
	}
	c.Request.Body = io.NopCloser(bytes.NewReader(body))
	request := "null" // an empty body: compared as JSON null
	if len(bytes.TrimSpace(body)) > 0 {
		if !json.Valid(body) {
			problem(c, http.StatusBadRequest, "body-not-json", "Request body is not JSON",
				"The request body is compared with the first request's as JSON.")
			return
		}
		request = string(body)
	}

	// The trace is for linking duplicates to the first request: one too
	// long to store (255 bytes) is not passed on rather than refused.
	var trace *string
	if tp := c.GetHeader(HeaderTrace); tp != "" && len(tp) <= 255 {
		trace = &tp
	}

	st := &state{pool: pool, key: key, scope: cfg.scope(c)}
	st.ctx, st.cancel = context.WithTimeout(context.Background(), dbTimeout)
	defer st.cancel()
	st.lease = cfg.leases[c.Request.Method+" "+c.FullPath()]

	tx, err := pool.Begin(st.ctx)
	if err != nil {
		dbProblem(c, err)
		return
	}
	var (
		outcome     string
		status      *int32
		stored      *string
		retryAfter  *int32
		claim       *string
		headers     *string
		originTrace *string
	)
	err = tx.QueryRow(st.ctx, `
		SELECT outcome, response_status, response_body::text, retry_after, claim::text,
		       phase, state::text, response_headers::text, origin_trace
		  FROM idempotency.idem_acquire(key => $1, request => $2::jsonb, scope => $3,
		                                ttl => $4::float8 * interval '1 second',
		                                lease => $5::float8 * interval '1 second',
		                                trace => $6)`,
		key, request, st.scope, seconds(cfg.ttl), seconds(st.lease), trace).
		Scan(&outcome, &status, &stored, &retryAfter, &claim, &st.phase, &st.pstate, &headers, &originTrace)
	if err != nil {
		_ = tx.Rollback(st.ctx)
		dbProblem(c, err)
		return
	}

	if outcome != "acquired" {
		// A duplicate: link it to the first request, in the log and for
		// the client.
		log.Printf("idempotency: %s, key %q scope %q: traceparent %s, first request's %s",
			outcome, key, st.scope, orDash(trace), orDash(originTrace))
		if originTrace != nil {
			c.Header(HeaderOriginTrace, *originTrace)
		}
	}

	switch outcome {
	case "replay":
		_ = tx.Rollback(st.ctx) // the lookup wrote nothing
		code := int(*status)
		if cfg.replayOK && code >= 200 && code < 300 {
			code = http.StatusOK
		}
		ct := ""
		if headers != nil {
			var h map[string]string
			if err := json.Unmarshal([]byte(*headers), &h); err == nil {
				// stored in lower case: sent as ReplayedHeaders spell them
				for name, v := range h {
					if name == "content-type" {
						ct = v
						continue
					}
					c.Writer.Header()[spelling(name)] = []string{v}
				}
			}
		}
		c.Header(HeaderReplayed, "true")
		respond(c, code, stored, ct)
		c.Abort()
		return
	case "mismatch":
		_ = tx.Rollback(st.ctx)
		problem(c, http.StatusUnprocessableEntity, "idempotency-key-reused",
			"Idempotency-Key already used for another request",
			"This key was sent before with a different request body; use a new key for a new request.")
		return
	case "in_progress":
		_ = tx.Rollback(st.ctx)
		wait := 1
		if retryAfter != nil && *retryAfter > 0 {
			wait = int(*retryAfter)
		}
		c.Header("Retry-After", strconv.Itoa(wait))
		problem(c, http.StatusConflict, "request-in-progress",
			"A request with this Idempotency-Key is being processed",
			"Send the same request again after "+strconv.Itoa(wait)+" second(s).")
		return
	}

	// acquired
	if st.lease > 0 {
		// Commit the claim now: it is visible as processing, protected by
		// its lease, while the handler calls out.
		if err := tx.Commit(st.ctx); err != nil {
			dbProblem(c, err)
			return
		}
	} else {
		st.tx = tx
	}
	st.claim = claim
	c.Set(stateKey, st)

	orig := c.Writer
	w := &holdWriter{ResponseWriter: orig, status: http.StatusOK}
	c.Writer = w
	func() {
		defer func() {
			if r := recover(); r != nil {
				// Nothing stored; in lease mode the claim is left to its
				// lease (a retry takes it over once it runs out).
				st.rollback()
				c.Writer = orig
				panic(r)
			}
		}()
		c.Next()
	}()
	c.Writer = orig
	st.finish(c, w)
}

// finish stores the handler's response and commits, then sends it; or,
// after Release or c.Error, sends it without storing it.
func (st *state) finish(c *gin.Context, w *holdWriter) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if len(c.Errors) > 0 {
		st.rollbackLocked()
		if st.lease > 0 && !st.released && !st.checkpointed {
			// The outside call may have happened: give the claim up so
			// that a retry runs again at once (the outside service is
			// called with the same key and deduplicates it).
			_, _ = st.pool.Exec(st.ctx, `SELECT idempotency.idem_release(key => $1, scope => $2, claim => $3::uuid)`,
				st.key, st.scope, st.claim)
		}
		w.flush(c)
		return
	}
	if st.released {
		if st.tx != nil {
			if err := st.tx.Commit(st.ctx); err != nil {
				st.tx = nil
				dbProblem(c, err)
				return
			}
			st.tx = nil
		}
		w.flush(c)
		return
	}

	var body *string
	ct := ""
	if w.body.Len() > 0 {
		if !json.Valid(w.body.Bytes()) {
			st.rollbackLocked()
			dropReplayed(c)
			problem(c, http.StatusInternalServerError, "response-not-json", "Handler answered non-JSON",
				"The idempotency middleware stores JSON responses only.")
			return
		}
		s := w.body.String()
		body = &s
		ct = contentType(w.status)
	}
	// The headers to replay: those of ReplayedHeaders that this answer has
	// (its Content-Type as it goes out).
	replayed := map[string]string{}
	for _, name := range ReplayedHeaders {
		if v := c.Writer.Header().Get(name); v != "" {
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
		dropReplayed(c)
		dbProblem(c, err)
		return
	}
	// The body goes out as the database stores it (jsonb's text), so that
	// the first answer and every replay are the same bytes.
	var done bool
	var canonical *string
	err = tx.QueryRow(st.ctx, `
		SELECT idempotency.idem_complete(key => $1, response_status => $2, response_body => $3::jsonb,
		                                 scope => $4, claim => $5::uuid, response_headers => $6::jsonb),
		       $3::jsonb::text`,
		st.key, w.status, body, st.scope, st.claim, headers).Scan(&done, &canonical)
	if err == nil {
		err = tx.Commit(st.ctx)
	} else {
		_ = tx.Rollback(st.ctx)
	}
	st.tx = nil
	if err != nil {
		dropReplayed(c) // not the answer they were set for
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55000" {
			// Lease mode: the lease ran out and another request took the
			// claim over; its answer is the one that counts.
			c.Header("Retry-After", "1")
			problem(c, http.StatusConflict, "idempotency-claim-lost",
				"This request's claim was taken over",
				"It took longer than its lease; send the same request again to get the stored answer.")
			return
		}
		dbProblem(c, err)
		return
	}
	respond(c, w.status, canonical, ct)
}

// Resumed is the last checkpoint of the claim that this request took over
// (idem_acquire's phase and state after a takeover): ok is false for a new
// key, and when the worker before it recorded none.
func Resumed(c *gin.Context) (phase string, st json.RawMessage, ok bool) {
	s, err := get(c)
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
// committed, a handler that fails (c.Error) leaves the claim to its lease
// instead of releasing it: the retry that takes it over resumes.
func Checkpoint(c *gin.Context, phase string, state interface{}) error {
	s, err := get(c)
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
func Tx(c *gin.Context) (pgx.Tx, error) {
	st, err := get(c)
	if err != nil {
		return nil, err
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.txLocked()
}

// Key is the request's Idempotency-Key (to pass on to an outside service
// that deduplicates, or to keep beside the business row).
func Key(c *gin.Context) string {
	if st, err := get(c); err == nil {
		return st.key
	}
	return ""
}

// Release gives the claim up with idempotency.idem_release: the response is
// not stored, and the next request with this key runs the handler again.
// For a failure worth retrying (an outside service that is down). In
// one-transaction mode the release and the handler's writes commit together.
func Release(c *gin.Context) error {
	st, err := get(c)
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
func Extend(c *gin.Context) error {
	st, err := get(c)
	if err != nil {
		return err
	}
	return st.extend()
}

// KeepAlive calls Extend every third of the lease until the returned
// function is called.
func KeepAlive(c *gin.Context) (stop func()) {
	st, err := get(c)
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

func (st *state) txLocked() (pgx.Tx, error) {
	if st.tx == nil {
		tx, err := st.pool.Begin(st.ctx)
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

func get(c *gin.Context) (*state, error) {
	v, ok := c.Get(stateKey)
	if !ok {
		return nil, errors.New("idempotency: no claim for this request (route skipped by the middleware?)")
	}
	return v.(*state), nil
}

// scope is the authenticated user and the route (method and path, so that
// /orders/7/pay and /orders/8/pay never share a key), hashed when it would
// be longer than the 255 bytes a scope may have.
func (cfg *config) scope(c *gin.Context) string {
	user := cfg.user(c)
	if user == "" {
		user = "anonymous"
	}
	s := "user:" + user + " " + c.Request.Method + " " + c.Request.URL.Path
	if len(s) > 255 {
		sum := sha256.Sum256([]byte(s))
		s = "sha256:" + hex.EncodeToString(sum[:])
	}
	return s
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
func respond(c *gin.Context, status int, body *string, ct string) {
	if body == nil {
		c.Writer.Header().Del("Content-Type")
		c.Status(status)
		c.Writer.WriteHeaderNow()
		return
	}
	if ct == "" {
		ct = contentType(status)
	}
	c.Header("Content-Type", ct)
	c.Status(status)
	_, _ = c.Writer.WriteString(*body)
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
func dropReplayed(c *gin.Context) {
	for _, name := range ReplayedHeaders {
		c.Writer.Header().Del(name)
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
func problem(c *gin.Context, status int, typ, title, detail string) {
	b, _ := json.Marshal(map[string]interface{}{
		"type":   ProblemTypeBase + typ,
		"title":  title,
		"status": status,
		"detail": detail,
	})
	c.Header("Content-Type", "application/problem+json")
	c.Status(status)
	_, _ = c.Writer.Write(b)
	c.Abort()
}

// dbProblem answers a database error: 503 with Retry-After for the errors
// that a retry cures (serialization failure, deadlock, lock timeout, too
// many connections), 400 for data the database refused, else 500.
func dbProblem(c *gin.Context, err error) {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch {
		case pgErr.Code[:2] == "40", pgErr.Code == "55P03", pgErr.Code == "53300":
			c.Header("Retry-After", "1")
			problem(c, http.StatusServiceUnavailable, "try-again", "Try again", pgErr.Message)
			return
		case pgErr.Code[:2] == "22":
			problem(c, http.StatusBadRequest, "bad-request", "Request refused by the database", pgErr.Message)
			return
		}
	}
	problem(c, http.StatusInternalServerError, "database-error", "Database error", err.Error())
}

// holdWriter holds the handler's response back until it is stored and
// committed. Headers go straight to the real writer's header map.
type holdWriter struct {
	gin.ResponseWriter
	status  int
	body    bytes.Buffer
	written bool
}

func (w *holdWriter) WriteHeader(code int) {
	if code > 0 {
		w.status = code
	}
}

func (w *holdWriter) WriteHeaderNow() { w.written = true }

func (w *holdWriter) Write(b []byte) (int, error) {
	w.written = true
	return w.body.Write(b)
}

func (w *holdWriter) WriteString(s string) (int, error) {
	w.written = true
	return w.body.WriteString(s)
}

func (w *holdWriter) Status() int   { return w.status }
func (w *holdWriter) Size() int     { return w.body.Len() }
func (w *holdWriter) Written() bool { return w.written }
func (w *holdWriter) Flush()        {}

// flush sends the held response as the handler made it (not stored).
func (w *holdWriter) flush(c *gin.Context) {
	c.Status(w.status)
	_, _ = c.Writer.Write(w.body.Bytes())
}
