// Command app is the seed's payment endpoint (POST /api/payments) on
// net/http, one of four ways, for integrations/go/bench/seed.sh:
//
//	-mode cache    idempotency-go with its replay cache
//	-mode nocache  idempotency-go without it
//	-mode redis    the seed article's three layers, Redis first: a GET of
//	               the cached answer, SETNX of the key with a TTL (else
//	               polling for the answer, then 409), an INSERT into a
//	               records table with a unique index (processing), the
//	               payment, then the answer stored in the table and in Redis
//	-mode none     no idempotency (the ceiling for new keys)
//
// The payment is the same in every mode: one INSERT into shop.payments
// (examples/schema.sql), in the claim's transaction for idempotency-go.
// The user is X-User-ID. A replayed answer carries Idempotent-Replayed:
// true in every mode.
package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"strconv"
	"time"

	"github.com/gomodule/redigo/redis"
	"github.com/jackc/pgconn"
	"github.com/jackc/pgx/v4"
	"github.com/jackc/pgx/v4/pgxpool"

	idempotency "github.com/idempotency-pg/idempotency-go"
)

type payment struct {
	OrderID  string `json:"order_id"`
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
	Source   string `json:"source"`
}

// pay makes the payment (queryRow: the claim's transaction's, or the
// pool's) and answers 201 with it.
func pay(ctx context.Context, queryRow func(context.Context, string, ...interface{}) pgx.Row,
	key, user string, body []byte) (int, []byte, error) {
	var p payment
	if err := json.Unmarshal(body, &p); err != nil || p.Amount <= 0 || p.OrderID == "" {
		return http.StatusBadRequest, []byte(`{"error": "invalid payment"}`), nil
	}
	uid, _ := strconv.ParseInt(user, 10, 64)
	var id int64
	if err := queryRow(ctx, `INSERT INTO shop.payments (idempotency_key, user_id, order_id, amount, currency)
	                          VALUES ($1, $2, $3, $4, $5) RETURNING id`,
		key, uid, p.OrderID, p.Amount, p.Currency).Scan(&id); err != nil {
		return 0, nil, err
	}
	b, _ := json.Marshal(map[string]interface{}{"payment_id": id, "order_id": p.OrderID, "amount": p.Amount,
		"currency": p.Currency, "status": "succeeded"})
	return http.StatusCreated, b, nil
}

func main() {
	mode := flag.String("mode", "cache", "cache, nocache, redis or none")
	listen := flag.String("listen", "127.0.0.1:8080", "address to listen on")
	dsn := flag.String("dsn", "", "PostgreSQL connection string")
	redisAddr := flag.String("redis", "127.0.0.1:6379", "Redis address (mode redis)")
	maxConns := flag.Int("max-conns", 20, "connections in the PostgreSQL pool (and Redis's)")
	flag.Parse()

	cfg, err := pgxpool.ParseConfig(*dsn)
	if err != nil {
		log.Fatal(err)
	}
	cfg.MaxConns = int32(*maxConns)
	pool, err := pgxpool.ConnectConfig(context.Background(), cfg)
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") })

	var h http.Handler
	switch *mode {
	case "cache", "nocache":
		mux.HandleFunc("/api/payments", func(w http.ResponseWriter, r *http.Request) {
			ctx := r.Context()
			body, _ := io.ReadAll(r.Body)
			tx, err := idempotency.Tx(ctx)
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			status, b, err := pay(ctx, tx.QueryRow, idempotency.Key(ctx), idempotency.UserFromContext(ctx), body)
			if err != nil {
				idempotency.Fail(ctx, err)
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(status)
			_, _ = w.Write(b)
		})
		opts := []idempotency.Option{idempotency.ServeMuxRoute(mux)}
		if *mode == "cache" {
			opts = append(opts, idempotency.ReplayCache(idempotency.NewReplayCache(idempotency.CacheOptions{})))
		}
		inner := idempotency.Middleware(pool, opts...)(mux)
		h = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			inner.ServeHTTP(w, r.WithContext(idempotency.ContextWithUser(r.Context(), r.Header.Get("X-User-ID"))))
		})
	case "none":
		mux.HandleFunc("/api/payments", func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			status, b, err := pay(r.Context(), pool.QueryRow, r.Header.Get("Idempotency-Key"), r.Header.Get("X-User-ID"), body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(status)
			_, _ = w.Write(b)
		})
		h = mux
	case "redis":
		s := &seed{pool: pool, ttl: 24 * time.Hour, redis: &redis.Pool{
			MaxIdle: *maxConns, MaxActive: 0, IdleTimeout: time.Minute,
			Dial: func() (redis.Conn, error) { return redis.Dial("tcp", *redisAddr) },
		}}
		if _, err := pool.Exec(context.Background(), seedTable); err != nil {
			log.Fatal(err)
		}
		mux.HandleFunc("/api/payments", s.handle)
		h = mux
	default:
		log.Fatalf("unknown mode %q", *mode)
	}
	log.Printf("%s on %s", *mode, *listen)
	log.Fatal(http.ListenAndServe(*listen, h))
}

// The seed article's Layer 2: the records table, its key unique.
const seedTable = `
CREATE TABLE IF NOT EXISTS shop.idempotency_records (
    id              BIGSERIAL PRIMARY KEY,
    idempotency_key VARCHAR(300) NOT NULL,
    request_hash    VARCHAR(64) NOT NULL,
    response_status INT,
    response_body   JSONB,
    status          VARCHAR(20) NOT NULL DEFAULT 'processing',
    created_at      TIMESTAMPTZ NOT NULL DEFAULT NOW(),
    expires_at      TIMESTAMPTZ NOT NULL,
    CONSTRAINT uq_idempotency_key UNIQUE (idempotency_key)
);
CREATE INDEX IF NOT EXISTS idx_idem_expires ON shop.idempotency_records (expires_at);`

// seed is the article's middleware (Layer 1 Redis, Layer 2 the records
// table, Layer 3 the business table) around the payment.
type seed struct {
	pool  *pgxpool.Pool
	redis *redis.Pool
	ttl   time.Duration
}

type cachedAnswer struct {
	Hash   string          `json:"hash"`
	Status int             `json:"status"`
	Body   json.RawMessage `json:"body"`
}

func (s *seed) cached(rc redis.Conn, key string) (*cachedAnswer, error) {
	b, err := redis.Bytes(rc.Do("GET", "idem:resp:"+key))
	if errors.Is(err, redis.ErrNil) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var a cachedAnswer
	if err := json.Unmarshal(b, &a); err != nil {
		return nil, err
	}
	return &a, nil
}

func answer(w http.ResponseWriter, status int, body []byte, replayed bool) {
	w.Header().Set("Content-Type", "application/json")
	if replayed {
		w.Header().Set("Idempotent-Replayed", "true")
	}
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

func (s *seed) replayOr422(w http.ResponseWriter, a *cachedAnswer, hash string) {
	if a.Hash != hash {
		answer(w, http.StatusUnprocessableEntity, []byte(`{"error":"idempotency key reused with another request"}`), false)
		return
	}
	answer(w, a.Status, a.Body, true)
}

func (s *seed) handle(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	user := r.Header.Get("X-User-ID")
	key := r.Header.Get("Idempotency-Key")
	if key == "" {
		answer(w, http.StatusBadRequest, []byte(`{"error":"Idempotency-Key missing"}`), false)
		return
	}
	body, _ := io.ReadAll(r.Body)
	sum := sha256.Sum256(body)
	hash := hex.EncodeToString(sum[:])
	scoped := user + ":" + key // UNIQUE (user_id, idempotency_key), as Q8 advises

	rc := s.redis.Get()
	defer rc.Close()
	// Layer 1: the cached answer, then SETNX
	if a, err := s.cached(rc, scoped); err != nil {
		answer(w, http.StatusInternalServerError, []byte(`{"error":"idempotency check failed"}`), false)
		return
	} else if a != nil {
		s.replayOr422(w, a, hash)
		return
	}
	ok, err := redis.String(rc.Do("SET", "idem:"+scoped, "processing", "NX", "PX", s.ttl.Milliseconds()))
	if err != nil && !errors.Is(err, redis.ErrNil) {
		answer(w, http.StatusInternalServerError, []byte(`{"error":"idempotency check failed"}`), false)
		return
	}
	if ok != "OK" {
		// a duplicate: poll for the answer, 30 x 100 ms, then 409
		for i := 0; i < 30; i++ {
			time.Sleep(100 * time.Millisecond)
			if a, err := s.cached(rc, scoped); err == nil && a != nil {
				s.replayOr422(w, a, hash)
				return
			}
		}
		answer(w, http.StatusConflict, []byte(`{"error":"duplicate request in progress"}`), false)
		return
	}
	// Layer 2: the records table
	if _, err := s.pool.Exec(ctx, `INSERT INTO shop.idempotency_records (idempotency_key, request_hash, expires_at)
	                               VALUES ($1, $2, now() + $3::float8 * interval '1 second')`,
		scoped, hash, s.ttl.Seconds()); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "23505" {
			answer(w, http.StatusConflict, []byte(`{"error":"duplicate request"}`), false)
			return
		}
		answer(w, http.StatusInternalServerError, []byte(fmt.Sprintf(`{"error":%q}`, err.Error())), false)
		return
	}
	// the payment (Layer 3: the business table)
	status, b, err := pay(ctx, s.pool.QueryRow, key, user, body)
	if err != nil {
		_, _ = s.pool.Exec(ctx, `UPDATE shop.idempotency_records SET status = 'failed' WHERE idempotency_key = $1`, scoped)
		_, _ = rc.Do("DEL", "idem:"+scoped)
		answer(w, http.StatusInternalServerError, []byte(fmt.Sprintf(`{"error":%q}`, err.Error())), false)
		return
	}
	// saveResponse: the records table, then Redis
	if _, err := s.pool.Exec(ctx, `UPDATE shop.idempotency_records SET status = 'completed', response_status = $2,
	                                      response_body = $3::jsonb WHERE idempotency_key = $1`,
		scoped, status, string(b)); err != nil {
		answer(w, http.StatusInternalServerError, []byte(fmt.Sprintf(`{"error":%q}`, err.Error())), false)
		return
	}
	cb, _ := json.Marshal(cachedAnswer{Hash: hash, Status: status, Body: b})
	if _, err := rc.Do("SET", "idem:resp:"+scoped, cb, "PX", s.ttl.Milliseconds()); err != nil {
		log.Printf("redis: %v", err)
	}
	answer(w, status, b, false)
}
