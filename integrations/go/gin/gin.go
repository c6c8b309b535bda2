// Package idemgin adapts the idempotency middleware
// (github.com/idempotency-pg/idempotency-go) to Gin.
//
//	import (
//		idempotency "github.com/idempotency-pg/idempotency-go"
//		idemgin "github.com/idempotency-pg/idempotency-go/gin"
//	)
//
//	r.Use(idemgin.Middleware(pool, idempotency.ReplayAsOK()))
//	r.POST("/api/payments", func(c *gin.Context) {
//		tx, err := idemgin.Tx(c)
//		...
//	})
//
// It runs the net/http middleware around the rest of Gin's chain: the
// options are the core package's, the route that Lease names is Gin's
// (c.FullPath(): "/users/:id/pay"), unrouted paths pass through, and the
// user is what the authentication middleware stored under UserKey. A
// handler that records an error with c.Error has its transaction rolled
// back and nothing stored (idempotency.Fail), and the functions below are
// the core's, on the request's context.
package idemgin

import (
	"context"
	"encoding/json"
	"net/http"

	"github.com/gin-gonic/gin"
	"github.com/jackc/pgx/v4"
	"github.com/jackc/pgx/v4/pgxpool"

	idempotency "github.com/idempotency-pg/idempotency-go"
)

// UserKey is the gin context key under which the authentication middleware
// is expected to have put the user's id (User changes that).
const UserKey = "user"

type ctxKey struct{}

// ginContext is the *gin.Context that Middleware put in r's context.
func ginContext(r *http.Request) *gin.Context {
	c, _ := r.Context().Value(ctxKey{}).(*gin.Context)
	return c
}

// User sets how the authenticated user is found (default: the string that
// the authentication middleware stored under UserKey).
func User(f func(*gin.Context) string) idempotency.Option {
	return idempotency.User(func(r *http.Request) string {
		if c := ginContext(r); c != nil {
			return f(c)
		}
		return ""
	})
}

// Middleware returns the idempotency middleware over pool, for Gin. opts
// are the core package's options (idempotency.Lease, idempotency.ReplayAsOK,
// ...) and User.
func Middleware(pool *pgxpool.Pool, opts ...idempotency.Option) gin.HandlerFunc {
	defaults := []idempotency.Option{
		idempotency.Route(func(r *http.Request) string {
			if c := ginContext(r); c != nil {
				return c.FullPath()
			}
			return ""
		}),
		User(func(c *gin.Context) string { return c.GetString(UserKey) }),
	}
	mw := idempotency.Middleware(pool, append(defaults, opts...)...)
	return func(c *gin.Context) {
		nextRan := false
		orig, origReq := c.Writer, c.Request
		h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			nextRan = true
			c.Request = r // its context carries the claim
			if idempotency.Key(r.Context()) != "" {
				// claimed: the answer is held back by the core's writer
				c.Writer = &heldWriter{ResponseWriter: orig, w: w, status: http.StatusOK}
			}
			defer func() { c.Writer = orig }()
			errs := len(c.Errors)
			c.Next()
			if len(c.Errors) > errs {
				idempotency.Fail(r.Context(), c.Errors.Last())
			}
		}))
		h.ServeHTTP(orig, c.Request.WithContext(context.WithValue(c.Request.Context(), ctxKey{}, c)))
		c.Request = origReq
		if !nextRan {
			// answered by the middleware (replay, 400, 409, 422)
			c.Abort()
		}
	}
}

// heldWriter is Gin's writer for a handler whose answer the middleware
// holds back: writes go to the core's writer, Gin's bookkeeping (Status,
// Size, Written) is kept here.
type heldWriter struct {
	gin.ResponseWriter
	w       http.ResponseWriter
	status  int
	size    int
	written bool
}

func (h *heldWriter) Header() http.Header { return h.w.Header() }

func (h *heldWriter) WriteHeader(code int) {
	if code > 0 {
		h.status = code
		h.w.WriteHeader(code)
	}
}

func (h *heldWriter) WriteHeaderNow() { h.written = true }

func (h *heldWriter) Write(b []byte) (int, error) {
	h.written = true
	n, err := h.w.Write(b)
	h.size += n
	return n, err
}

func (h *heldWriter) WriteString(s string) (int, error) { return h.Write([]byte(s)) }

func (h *heldWriter) Status() int   { return h.status }
func (h *heldWriter) Size() int     { return h.size }
func (h *heldWriter) Written() bool { return h.written }
func (h *heldWriter) Flush()        {}

// Tx is the request's transaction (idempotency.Tx): the handler's writes
// go in it and commit with the stored answer.
func Tx(c *gin.Context) (pgx.Tx, error) { return idempotency.Tx(c.Request.Context()) }

// Key is the request's Idempotency-Key (idempotency.Key).
func Key(c *gin.Context) string { return idempotency.Key(c.Request.Context()) }

// Release gives the claim up (idempotency.Release): nothing stored, the
// retry runs again.
func Release(c *gin.Context) error { return idempotency.Release(c.Request.Context()) }

// Checkpoint records the step done (idempotency.Checkpoint).
func Checkpoint(c *gin.Context, phase string, state interface{}) error {
	return idempotency.Checkpoint(c.Request.Context(), phase, state)
}

// Resumed is the checkpoint of the claim taken over (idempotency.Resumed).
func Resumed(c *gin.Context) (phase string, state json.RawMessage, ok bool) {
	return idempotency.Resumed(c.Request.Context())
}

// Extend pushes the lease out (idempotency.Extend).
func Extend(c *gin.Context) error { return idempotency.Extend(c.Request.Context()) }

// KeepAlive extends the lease every third of it until stop is called
// (idempotency.KeepAlive).
func KeepAlive(c *gin.Context) (stop func()) { return idempotency.KeepAlive(c.Request.Context()) }
