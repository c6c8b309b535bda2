package idempotency

import (
	"context"
	"errors"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v4/pgxpool"
)

// Against a database with the extension: IDEM_GO_TEST_DSN names it
// (integrations/go/test.sh makes one on the test cluster). The paths that
// the conformance test (examples/http_test.py) does not take: a non-JSON
// answer, Fail, a panic, an answer without a body.

func testPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	dsn := os.Getenv("IDEM_GO_TEST_DSN")
	if dsn == "" {
		t.Skip("IDEM_GO_TEST_DSN not set: no test database")
	}
	pool, err := pgxpool.Connect(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS unit_rows (key text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func count(t *testing.T, pool *pgxpool.Pool, sql string, args ...interface{}) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// records is how many records the key has (any scope).
func records(t *testing.T, pool *pgxpool.Pool, key string) int {
	return count(t, pool, `SELECT count(*) FROM idempotency.records WHERE key = $1`, key)
}

func newKey(t *testing.T) string {
	return t.Name() + "-" + time.Now().Format("150405.000000000")
}

// insert writes a row for the key in the claim's transaction.
func insert(t *testing.T, r *http.Request) {
	tx, err := Tx(r.Context())
	if err != nil {
		t.Error(err)
		return
	}
	if _, err := tx.Exec(r.Context(), `INSERT INTO unit_rows VALUES ($1)`, Key(r.Context())); err != nil {
		t.Error(err)
	}
}

func TestNotJSONAnswerIsNotStored(t *testing.T) {
	pool := testPool(t)
	key := newKey(t)
	h := Middleware(pool)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		insert(t, r)
		w.Header().Set("Location", "/somewhere")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte("plain text"))
	}))
	w := serve(t, h, "POST", "/t", key, `{}`)
	isProblem(t, w, 500, "response-not-json")
	if w.Header().Get("Location") != "" {
		t.Errorf("the handler's Location went out with the middleware's problem")
	}
	if n := records(t, pool, key); n != 0 {
		t.Errorf("%d records", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM unit_rows WHERE key = $1`, key); n != 0 {
		t.Errorf("the handler's row committed")
	}
}

func TestFailRollsBackAndRunsAgain(t *testing.T) {
	pool := testPool(t)
	key := newKey(t)
	runs := 0
	h := Middleware(pool)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		insert(t, r)
		Fail(r.Context(), errors.New("boom"))
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = w.Write([]byte(`{"error": "boom"}`))
	}))
	for i := 0; i < 2; i++ {
		w := serve(t, h, "POST", "/t", key, `{}`)
		if w.Code != 500 || w.Body.String() != `{"error": "boom"}` || w.Header().Get(HeaderReplayed) != "" {
			t.Errorf("try %d: %d %q %s", i, w.Code, w.Header().Get(HeaderReplayed), w.Body)
		}
	}
	if runs != 2 {
		t.Errorf("the handler ran %d times, not 2", runs)
	}
	if n := records(t, pool, key); n != 0 {
		t.Errorf("%d records", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM unit_rows WHERE key = $1`, key); n != 0 {
		t.Errorf("the handler's rows committed")
	}
}

func TestFailInLeaseModeReleases(t *testing.T) {
	pool := testPool(t)
	key := newKey(t)
	runs := 0
	h := Middleware(pool, Lease("POST", "/lease", time.Minute))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		// the claim is committed already, visible as processing
		if n := count(t, pool, `SELECT count(*) FROM idempotency.records WHERE key = $1 AND status = 'processing'`, Key(r.Context())); n != 1 {
			t.Errorf("lease mode: %d processing records during the handler", n)
		}
		Fail(r.Context(), errors.New("provider down"))
		w.WriteHeader(http.StatusBadGateway)
	}))
	for i := 0; i < 2; i++ {
		if w := serve(t, h, "POST", "/lease", key, `{}`); w.Code != http.StatusBadGateway {
			t.Errorf("try %d: %d %s", i, w.Code, w.Body)
		}
	}
	if runs != 2 {
		t.Errorf("the handler ran %d times, not 2: the claim was not released", runs)
	}
	if n := records(t, pool, key); n != 0 {
		t.Errorf("%d records after a released claim", n)
	}
}

func TestPanicRollsBack(t *testing.T) {
	pool := testPool(t)
	key := newKey(t)
	h := Middleware(pool)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		insert(t, r)
		panic("worker died")
	}))
	func() {
		defer func() {
			if p := recover(); p != "worker died" {
				t.Errorf("the panic was not passed on: %v", p)
			}
		}()
		serve(t, h, "POST", "/t", key, `{}`)
	}()
	if n := records(t, pool, key) + count(t, pool, `SELECT count(*) FROM unit_rows WHERE key = $1`, key); n != 0 {
		t.Errorf("the claim or the handler's row committed after a panic")
	}
}

func TestNoBodyStoredAndReplayed(t *testing.T) {
	pool := testPool(t)
	key := newKey(t)
	runs := 0
	h := Middleware(pool)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		insert(t, r)
		tx1, _ := Tx(r.Context())
		tx2, _ := Tx(r.Context())
		if tx1 != tx2 {
			t.Errorf("Tx gave two transactions")
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	first := serve(t, h, "POST", "/t", key, ``)
	again := serve(t, h, "POST", "/t", key, ``)
	if first.Code != 204 || first.Body.Len() != 0 || first.Header().Get(HeaderReplayed) != "" {
		t.Errorf("first: %d %q", first.Code, first.Body)
	}
	if again.Code != 204 || again.Body.Len() != 0 || again.Header().Get(HeaderReplayed) != "true" {
		t.Errorf("replay: %d %q %v", again.Code, again.Body, again.Header())
	}
	if runs != 1 || count(t, pool, `SELECT count(*) FROM unit_rows WHERE key = $1`, key) != 1 {
		t.Errorf("the handler ran %d times", runs)
	}
	// an empty body is JSON null: a body now is another request
	if w := serve(t, h, "POST", "/t", key, `{"a": 1}`); !strings.HasPrefix(w.Header().Get("Content-Type"), "application/problem+json") || w.Code != 422 {
		t.Errorf("another body: %d %s", w.Code, w.Body)
	}
}
