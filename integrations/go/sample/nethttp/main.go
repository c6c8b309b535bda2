// Command nethttp is the Gin example's API (examples/gin/main.go: the seed
// article's payment and stock deduction, and a charge that calls an
// outside service) on plain net/http, made exactly-once by
// github.com/idempotency-pg/idempotency-go. The same endpoints, flags and
// log lines; tables: examples/schema.sql. The conformance test
// (examples/run_tests.sh nethttp) drives it.
//
//	nethttp -listen 127.0.0.1:8080 -dsn 'dbname=shop'
package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v4"
	"github.com/jackc/pgx/v4/pgxpool"

	idempotency "github.com/idempotency-pg/idempotency-go"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:8080", "address to listen on")
	dsn := flag.String("dsn", "", "PostgreSQL connection string (empty: the PG* environment variables)")
	maxConns := flag.Int("max-conns", 20, "connections in the pool")
	replay200 := flag.Bool("replay-200", false, "the seed's rule: a replayed 2xx is answered 200")
	chargeLease := flag.Duration("charge-lease", 30*time.Second, "lease of POST /api/charges' claims")
	faults := flag.Bool("fault-injection", false, "honour the X-Fault request header (tests only)")
	replayCache := flag.Bool("replay-cache", os.Getenv("IDEM_REPLAY_CACHE") == "1",
		"answer retries of completed requests from an in-process cache (default: on when IDEM_REPLAY_CACHE=1)")
	logDuplicates := flag.String("log-duplicates", envOr("IDEM_LOG_DUPLICATES", "all"),
		"which duplicate answers write a log line: sampled (one a second), all, off (default: IDEM_LOG_DUPLICATES, else all: the HTTP test reads each line)")
	flag.Parse()
	logMode, err := idempotency.ParseLogMode(*logDuplicates)
	if err != nil {
		log.Fatal(err)
	}

	cfg, err := pgxpool.ParseConfig(*dsn)
	if err != nil {
		log.Fatal(err)
	}
	cfg.MaxConns = int32(*maxConns)
	pool, err := pgxpool.ConnectConfig(context.Background(), cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	a := &app{pool: pool, faults: *faults}
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprint(w, "# no metrics in this example\n")
	})
	mux.HandleFunc("/api/payments", a.method(http.MethodPost, a.createPayment))
	mux.HandleFunc("/api/payments/", a.method(http.MethodGet, a.getPayment))
	mux.HandleFunc("/api/orders", a.method(http.MethodPost, a.createOrder))
	mux.HandleFunc("/api/charges", a.method(http.MethodPost, a.createCharge))

	opts := []idempotency.Option{
		idempotency.ServeMuxRoute(mux),
		idempotency.Lease(http.MethodPost, "/api/charges", *chargeLease),
	}
	if *replay200 {
		opts = append(opts, idempotency.ReplayAsOK())
	}
	opts = append(opts, idempotency.LogDuplicates(logMode))
	if *replayCache {
		opts = append(opts, idempotency.ReplayCache(idempotency.NewReplayCache(idempotency.CacheOptions{})))
	}
	handler := authenticate(idempotency.Middleware(pool, opts...)(mux))

	log.Printf("listening on %s", *listen)
	log.Fatal(http.ListenAndServe(*listen, handler))
}

// authenticate stands in for real authentication: the user is whatever
// X-User-ID says, put in the request's context for the middleware.
func authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if p := r.URL.Path; p == "/health" || p == "/metrics" {
			next.ServeHTTP(w, r)
			return
		}
		user := r.Header.Get("X-User-ID")
		if _, err := strconv.ParseInt(user, 10, 64); err != nil {
			fail(w, http.StatusUnauthorized, "unauthenticated", "X-User-ID header missing or not a number")
			return
		}
		next.ServeHTTP(w, r.WithContext(idempotency.ContextWithUser(r.Context(), user)))
	})
}

type app struct {
	pool   *pgxpool.Pool
	faults bool // -fault-injection
}

// method routes only method to h; other methods get 405.
func (a *app) method(method string, h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if r.Method != method {
			w.Header().Set("Allow", method)
			fail(w, http.StatusMethodNotAllowed, "method-not-allowed", r.Method+" is not allowed here")
			return
		}
		h(w, r)
	}
}

// errWorkerDied is the panic of a worker that X-Fault kills.
var errWorkerDied = errors.New("simulated worker death (X-Fault: die-after-charge)")

func writeJSON(w http.ResponseWriter, status int, v interface{}) {
	b, err := json.Marshal(v)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// fail answers a problem+json body (stored by the middleware like any
// other answer).
func fail(w http.ResponseWriter, status int, typ, title string) {
	writeJSON(w, status, map[string]interface{}{
		"type":   idempotency.ProblemTypeBase + typ,
		"title":  title,
		"status": status,
	})
}

// dbError marks the request failed with idempotency.Fail, so that the
// middleware rolls back and stores nothing (the retry runs again).
func dbError(w http.ResponseWriter, r *http.Request, err error) {
	idempotency.Fail(r.Context(), err)
	fail(w, http.StatusInternalServerError, "database-error", err.Error())
}

// decode reads the JSON body into v and checks it with valid; the error
// is the 400's title.
func decode(r *http.Request, v interface{ valid() error }) error {
	if err := json.NewDecoder(r.Body).Decode(v); err != nil {
		return err
	}
	return v.valid()
}

type paymentRequest struct {
	OrderID  string `json:"order_id"`
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
	Source   string `json:"source"`
}

func (p *paymentRequest) valid() error {
	switch {
	case p.OrderID == "":
		return errors.New("order_id is required")
	case p.Amount < 1:
		return errors.New("amount must be at least 1")
	}
	return nil
}

// createPayment is the seed's payment endpoint. The payment row, the
// claim and the stored answer commit together. Two test cards: tok_fail
// fails for good (500, stored: a retry replays it), tok_retry finds the
// processor unavailable (503, claim released: a retry runs again).
func (a *app) createPayment(w http.ResponseWriter, r *http.Request) {
	var req paymentRequest
	if err := decode(r, &req); err != nil {
		fail(w, http.StatusBadRequest, "invalid-payment", err.Error())
		return
	}
	if req.Currency == "" {
		req.Currency = "EUR"
	}
	ctx := r.Context()
	tx, err := idempotency.Tx(ctx)
	if err != nil {
		dbError(w, r, err)
		return
	}
	user := idempotency.UserFromContext(ctx)
	key := idempotency.Key(ctx)
	// Every run of the handler leaves an attempt (committed with the
	// answer), so that the tests can count runs.
	if _, err := tx.Exec(ctx, `INSERT INTO shop.payment_attempts (idempotency_key, user_id, source)
	                           VALUES ($1, $2, $3)`, key, user, req.Source); err != nil {
		dbError(w, r, err)
		return
	}
	switch req.Source {
	case "tok_fail":
		fail(w, http.StatusInternalServerError, "processor-error", "the payment processor failed")
		return
	case "tok_retry":
		if err := idempotency.Release(ctx); err != nil {
			dbError(w, r, err)
			return
		}
		w.Header().Set("Retry-After", "1")
		fail(w, http.StatusServiceUnavailable, "processor-unavailable", "the payment processor is unavailable, try again")
		return
	}
	var id int64
	err = tx.QueryRow(ctx, `INSERT INTO shop.payments (idempotency_key, user_id, order_id, amount, currency)
	                        VALUES ($1, $2, $3, $4, $5) RETURNING id`,
		key, user, req.OrderID, req.Amount, req.Currency).Scan(&id)
	if err != nil {
		dbError(w, r, err)
		return
	}
	// Stored with the answer and sent again with its replays (the
	// middleware's ReplayedHeaders).
	w.Header().Set("Location", fmt.Sprintf("/api/payments/%d", id))
	w.Header().Set("ETag", fmt.Sprintf(`"payment-%d-1"`, id))
	writeJSON(w, http.StatusCreated, map[string]interface{}{
		"payment_id": id, "order_id": req.OrderID, "amount": req.Amount,
		"currency": req.Currency, "status": "succeeded",
	})
}

// getPayment is GET /api/payments/ID: not idempotency-checked.
func (a *app) getPayment(w http.ResponseWriter, r *http.Request) {
	id := strings.TrimPrefix(r.URL.Path, "/api/payments/")
	if _, err := strconv.ParseInt(id, 10, 64); err != nil {
		fail(w, http.StatusNotFound, "not-found", "no such payment")
		return
	}
	var orderID, currency string
	var amount int64
	err := a.pool.QueryRow(r.Context(),
		`SELECT order_id, amount, currency FROM shop.payments WHERE id = $1 AND user_id = $2`,
		id, idempotency.UserFromContext(r.Context())).Scan(&orderID, &amount, &currency)
	if errors.Is(err, pgx.ErrNoRows) {
		fail(w, http.StatusNotFound, "not-found", "no such payment")
		return
	} else if err != nil {
		fail(w, http.StatusInternalServerError, "database-error", err.Error())
		return
	}
	writeJSON(w, http.StatusOK, map[string]interface{}{"order_id": orderID, "amount": amount, "currency": currency})
}

type orderRequest struct {
	SKU      string `json:"sku"`
	Quantity int    `json:"quantity"`
}

func (o *orderRequest) valid() error {
	switch {
	case o.SKU == "":
		return errors.New("sku is required")
	case o.Quantity < 1:
		return errors.New("quantity must be at least 1")
	}
	return nil
}

// createOrder is the seed's stock deduction: the guarded UPDATE keeps the
// stock from going below zero whatever the concurrency, the claim keeps a
// retried order from deducting twice. Too little stock is an answer too
// (409, stored).
func (a *app) createOrder(w http.ResponseWriter, r *http.Request) {
	var req orderRequest
	if err := decode(r, &req); err != nil {
		fail(w, http.StatusBadRequest, "invalid-order", err.Error())
		return
	}
	ctx := r.Context()
	tx, err := idempotency.Tx(ctx)
	if err != nil {
		dbError(w, r, err)
		return
	}
	var left int
	err = tx.QueryRow(ctx, `UPDATE shop.stock SET quantity = quantity - $1
	                         WHERE sku = $2 AND quantity >= $1 RETURNING quantity`,
		req.Quantity, req.SKU).Scan(&left)
	if errors.Is(err, pgx.ErrNoRows) {
		fail(w, http.StatusConflict, "out-of-stock", "not enough stock of "+req.SKU)
		return
	} else if err != nil {
		dbError(w, r, err)
		return
	}
	var id int64
	err = tx.QueryRow(ctx, `INSERT INTO shop.stock_moves (idempotency_key, user_id, sku, quantity)
	                        VALUES ($1, $2, $3, $4) RETURNING id`,
		idempotency.Key(ctx), idempotency.UserFromContext(ctx), req.SKU, -req.Quantity).Scan(&id)
	if err != nil {
		dbError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, map[string]interface{}{
		"order_id": id, "sku": req.SKU, "quantity": req.Quantity, "stock_left": left,
	})
}

type chargeRequest struct {
	OrderID string `json:"order_id"`
	Amount  int64  `json:"amount"`
	DelayMS int    `json:"delay_ms"`
}

func (c *chargeRequest) valid() error {
	switch {
	case c.OrderID == "":
		return errors.New("order_id is required")
	case c.Amount < 1:
		return errors.New("amount must be at least 1")
	}
	return nil
}

// chargeState is the checkpoint "charged": what the provider answered.
type chargeState struct {
	ChargeID string `json:"charge_id"`
}

// createCharge calls an outside payment provider, which may be slow: the
// route is declared with idempotency.Lease, so the claim is committed before
// the call, kept alive during it, and the charge row and the answer commit
// after it, fenced by the claim. Once the provider has charged, the charge
// id is recorded as the checkpoint "charged": if this worker dies before it
// completes, the retry that takes the claim over (after the lease) resumes
// at "charged" with that id, and the provider is not called again.
func (a *app) createCharge(w http.ResponseWriter, r *http.Request) {
	var req chargeRequest
	if err := decode(r, &req); err != nil {
		fail(w, http.StatusBadRequest, "invalid-charge", err.Error())
		return
	}
	ctx := r.Context()
	var ref string
	if phase, state, ok := idempotency.Resumed(ctx); ok && phase == "charged" {
		var cs chargeState
		if err := json.Unmarshal(state, &cs); err != nil || cs.ChargeID == "" {
			dbError(w, r, fmt.Errorf("checkpoint charged without a charge id: %s", state))
			return
		}
		ref = cs.ChargeID
	} else {
		stop := idempotency.KeepAlive(ctx)
		rf, err := a.callProvider(ctx, idempotency.Key(ctx), req.Amount, time.Duration(req.DelayMS)*time.Millisecond)
		stop()
		if err != nil {
			dbError(w, r, err)
			return
		}
		ref = rf
		if err := idempotency.Checkpoint(ctx, "charged", chargeState{ChargeID: ref}); err != nil {
			dbError(w, r, err)
			return
		}
		if a.faults && r.Header.Get("X-Fault") == "die-after-charge" {
			panic(errWorkerDied)
		}
	}
	tx, err := idempotency.Tx(ctx)
	if err != nil {
		dbError(w, r, err)
		return
	}
	var id int64
	err = tx.QueryRow(ctx, `INSERT INTO shop.charges (idempotency_key, user_id, order_id, amount, provider_ref)
	                        VALUES ($1, $2, $3, $4, $5) RETURNING id`,
		idempotency.Key(ctx), idempotency.UserFromContext(ctx), req.OrderID, req.Amount, ref).Scan(&id)
	if err != nil {
		dbError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, map[string]interface{}{
		"charge_id": id, "order_id": req.OrderID, "amount": req.Amount, "provider_ref": ref,
	})
}

// callProvider stands in for the outside service: it logs the call (in a
// table, standing for the provider's own records), takes its time, and
// answers a reference derived from the key, as a provider that deduplicates
// on the merchant's request id would.
func (a *app) callProvider(ctx context.Context, key string, amount int64, delay time.Duration) (string, error) {
	if _, err := a.pool.Exec(ctx, `INSERT INTO shop.provider_calls (idempotency_key, amount) VALUES ($1, $2)`,
		key, amount); err != nil {
		return "", err
	}
	select {
	case <-time.After(delay):
	case <-ctx.Done():
		return "", ctx.Err()
	}
	sum := sha256.Sum256([]byte(key))
	return "ch_" + hex.EncodeToString(sum[:8]), nil
}

// envOr is the environment variable name's value, or def when it is unset
// or empty.
func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
