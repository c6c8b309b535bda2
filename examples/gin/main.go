// Command idempotency-gin is the seed article's payment and stock-deduction
// API, made exactly-once by the idempotency middleware over the PostgreSQL
// extension (the package github.com/idempotency-pg/idempotency-go, in
// integrations/go of this repository, and its Gin adapter .../gin).
// Tables: ../schema.sql.
//
//	idempotency-gin -listen 127.0.0.1:8080 -dsn 'dbname=shop'
//
// Endpoints (all but /health and /metrics need X-User-ID, a stand-in for
// real authentication; every POST needs an Idempotency-Key):
//
//	POST /api/payments  {"order_id", "amount", "currency", "source"}  one transaction
//	POST /api/orders    {"sku", "quantity"}                           stock deduction, one transaction
//	POST /api/charges   {"order_id", "amount", "delay_ms"}            calls an outside service: lease mode,
//	                                                                  resumed after the provider charged
//	GET  /api/payments/:id, /health, /metrics                         not idempotency-checked
//
// With -fault-injection, a charge sent with "X-Fault: die-after-charge"
// has its worker die once the provider has charged (for the HTTP test).
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
	"time"

	"github.com/gin-gonic/gin"
	"github.com/jackc/pgx/v4"
	"github.com/jackc/pgx/v4/pgxpool"

	idempotency "github.com/idempotency-pg/idempotency-go"
	idemgin "github.com/idempotency-pg/idempotency-go/gin"
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

	opts := []idempotency.Option{
		idempotency.Lease(http.MethodPost, "/api/charges", *chargeLease),
	}
	if *replay200 {
		opts = append(opts, idempotency.ReplayAsOK())
	}
	opts = append(opts, idempotency.LogDuplicates(logMode))
	if *replayCache {
		opts = append(opts, idempotency.ReplayCache(idempotency.NewReplayCache(idempotency.CacheOptions{})))
	}

	gin.SetMode(gin.ReleaseMode)
	r := gin.New()
	r.Use(gin.Recovery(), authenticate)
	r.Use(idemgin.Middleware(pool, opts...))

	r.GET("/health", func(c *gin.Context) { c.JSON(http.StatusOK, gin.H{"status": "ok"}) })
	r.GET("/metrics", func(c *gin.Context) { c.String(http.StatusOK, "# no metrics in this example\n") })
	a := &app{pool: pool, faults: *faults}
	r.GET("/api/payments/:id", a.getPayment)
	r.POST("/api/payments", a.createPayment)
	r.POST("/api/orders", a.createOrder)
	r.POST("/api/charges", a.createCharge)

	log.Printf("listening on %s", *listen)
	if err := r.Run(*listen); err != nil {
		log.Fatal(err)
	}
}

// authenticate stands in for real authentication: the user is whatever
// X-User-ID says.
func authenticate(c *gin.Context) {
	if p := c.Request.URL.Path; p == "/health" || p == "/metrics" {
		return
	}
	user := c.GetHeader("X-User-ID")
	if _, err := strconv.ParseInt(user, 10, 64); err != nil {
		fail(c, http.StatusUnauthorized, "unauthenticated", "X-User-ID header missing or not a number")
		c.Abort()
		return
	}
	c.Set(idemgin.UserKey, user)
}

type app struct {
	pool   *pgxpool.Pool
	faults bool // -fault-injection
}

// errWorkerDied is the panic of a worker that X-Fault kills.
var errWorkerDied = errors.New("simulated worker death (X-Fault: die-after-charge)")

// fail answers a problem+json body (stored by the middleware like any
// other answer).
func fail(c *gin.Context, status int, typ, title string) {
	c.JSON(status, gin.H{
		"type":   idempotency.ProblemTypeBase + typ,
		"title":  title,
		"status": status,
	})
}

// dbError records a database error with c.Error, so that the middleware
// rolls back and stores nothing (the retry runs again).
func dbError(c *gin.Context, err error) {
	_ = c.Error(err)
	fail(c, http.StatusInternalServerError, "database-error", err.Error())
}

type paymentRequest struct {
	OrderID  string `json:"order_id" binding:"required"`
	Amount   int64  `json:"amount" binding:"required,min=1"`
	Currency string `json:"currency"`
	Source   string `json:"source"`
}

// createPayment is the seed's payment endpoint. The payment row, the
// claim and the stored answer commit together. Two test cards: tok_fail
// fails for good (500, stored: a retry replays it), tok_retry finds the
// processor unavailable (503, claim released: a retry runs again).
func (a *app) createPayment(c *gin.Context) {
	var req paymentRequest
	if err := c.ShouldBindJSON(&req); err != nil {
		fail(c, http.StatusBadRequest, "invalid-payment", err.Error())
		return
	}
	if req.Currency == "" {
		req.Currency = "EUR"
	}
	ctx := c.Request.Context()
	tx, err := idemgin.Tx(c)
	if err != nil {
		dbError(c, err)
		return
	}
	user := c.GetString(idemgin.UserKey)
	// Every run of the handler leaves an attempt (committed with the
	// answer), so that the tests can count runs.
	if _, err := tx.Exec(ctx, `INSERT INTO shop.payment_attempts (idempotency_key, user_id, source)
	                           VALUES ($1, $2, $3)`, idemgin.Key(c), user, req.Source); err != nil {
		dbError(c, err)
		return
	}
	switch req.Source {
	case "tok_fail":
		fail(c, http.StatusInternalServerError, "processor-error", "the payment processor failed")
		return
	case "tok_retry":
		if err := idemgin.Release(c); err != nil {
			dbError(c, err)
			return
		}
		c.Header("Retry-After", "1")
		fail(c, http.StatusServiceUnavailable, "processor-unavailable", "the payment processor is unavailable, try again")
		return
	}
	var id int64
	err = tx.QueryRow(ctx, `INSERT INTO shop.payments (idempotency_key, user_id, order_id, amount, currency)
	                        VALUES ($1, $2, $3, $4, $5) RETURNING id`,
		idemgin.Key(c), user, req.OrderID, req.Amount, req.Currency).Scan(&id)
	if err != nil {
		dbError(c, err)
		return
	}
	// Stored with the answer and sent again with its replays (the
	// middleware's ReplayedHeaders).
	c.Header("Location", fmt.Sprintf("/api/payments/%d", id))
	c.Header("ETag", fmt.Sprintf(`"payment-%d-1"`, id))
	c.JSON(http.StatusCreated, gin.H{
		"payment_id": id, "order_id": req.OrderID, "amount": req.Amount,
		"currency": req.Currency, "status": "succeeded",
	})
}

func (a *app) getPayment(c *gin.Context) {
	var orderID, currency string
	var amount int64
	err := a.pool.QueryRow(c.Request.Context(),
		`SELECT order_id, amount, currency FROM shop.payments WHERE id = $1 AND user_id = $2`,
		c.Param("id"), c.GetString(idemgin.UserKey)).Scan(&orderID, &amount, &currency)
	if errors.Is(err, pgx.ErrNoRows) {
		fail(c, http.StatusNotFound, "not-found", "no such payment")
		return
	} else if err != nil {
		fail(c, http.StatusInternalServerError, "database-error", err.Error())
		return
	}
	c.JSON(http.StatusOK, gin.H{"order_id": orderID, "amount": amount, "currency": currency})
}

type orderRequest struct {
	SKU      string `json:"sku" binding:"required"`
	Quantity int    `json:"quantity" binding:"required,min=1"`
}

// createOrder is the seed's stock deduction: the guarded UPDATE keeps the
// stock from going below zero whatever the concurrency, the claim keeps a
// retried order from deducting twice. Too little stock is an answer too
// (409, stored).
func (a *app) createOrder(c *gin.Context) {
	var req orderRequest
	if err := c.ShouldBindJSON(&req); err != nil {
		fail(c, http.StatusBadRequest, "invalid-order", err.Error())
		return
	}
	ctx := c.Request.Context()
	tx, err := idemgin.Tx(c)
	if err != nil {
		dbError(c, err)
		return
	}
	var left int
	err = tx.QueryRow(ctx, `UPDATE shop.stock SET quantity = quantity - $1
	                         WHERE sku = $2 AND quantity >= $1 RETURNING quantity`,
		req.Quantity, req.SKU).Scan(&left)
	if errors.Is(err, pgx.ErrNoRows) {
		fail(c, http.StatusConflict, "out-of-stock", "not enough stock of "+req.SKU)
		return
	} else if err != nil {
		dbError(c, err)
		return
	}
	var id int64
	err = tx.QueryRow(ctx, `INSERT INTO shop.stock_moves (idempotency_key, user_id, sku, quantity)
	                        VALUES ($1, $2, $3, $4) RETURNING id`,
		idemgin.Key(c), c.GetString(idemgin.UserKey), req.SKU, -req.Quantity).Scan(&id)
	if err != nil {
		dbError(c, err)
		return
	}
	c.JSON(http.StatusCreated, gin.H{"order_id": id, "sku": req.SKU, "quantity": req.Quantity, "stock_left": left})
}

type chargeRequest struct {
	OrderID string `json:"order_id" binding:"required"`
	Amount  int64  `json:"amount" binding:"required,min=1"`
	DelayMS int    `json:"delay_ms"`
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
func (a *app) createCharge(c *gin.Context) {
	var req chargeRequest
	if err := c.ShouldBindJSON(&req); err != nil {
		fail(c, http.StatusBadRequest, "invalid-charge", err.Error())
		return
	}
	var ref string
	if phase, state, ok := idemgin.Resumed(c); ok && phase == "charged" {
		var cs chargeState
		if err := json.Unmarshal(state, &cs); err != nil || cs.ChargeID == "" {
			dbError(c, fmt.Errorf("checkpoint charged without a charge id: %s", state))
			return
		}
		ref = cs.ChargeID
	} else {
		stop := idemgin.KeepAlive(c)
		r, err := a.callProvider(c.Request.Context(), idemgin.Key(c), req.Amount, time.Duration(req.DelayMS)*time.Millisecond)
		stop()
		if err != nil {
			dbError(c, err)
			return
		}
		ref = r
		if err := idemgin.Checkpoint(c, "charged", chargeState{ChargeID: ref}); err != nil {
			dbError(c, err)
			return
		}
		if a.faults && c.GetHeader("X-Fault") == "die-after-charge" {
			panic(errWorkerDied)
		}
	}
	ctx := c.Request.Context()
	tx, err := idemgin.Tx(c)
	if err != nil {
		dbError(c, err)
		return
	}
	var id int64
	err = tx.QueryRow(ctx, `INSERT INTO shop.charges (idempotency_key, user_id, order_id, amount, provider_ref)
	                        VALUES ($1, $2, $3, $4, $5) RETURNING id`,
		idemgin.Key(c), c.GetString(idemgin.UserKey), req.OrderID, req.Amount, ref).Scan(&id)
	if err != nil {
		dbError(c, err)
		return
	}
	c.JSON(http.StatusCreated, gin.H{"charge_id": id, "order_id": req.OrderID, "amount": req.Amount, "provider_ref": ref})
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
