package idempotency

import (
	"bytes"
	"context"
	"fmt"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v4"
	"github.com/jackc/pgx/v4/pgxpool"
)

// Issue 39 against a database (IDEM_GO_TEST_DSN): the round trips, literal
// quoting, the replay cache and the duplicate lines.

// countConn counts the writes of a connection to the server: one per
// round trip (pgconn writes a query's messages at once).
type countConn struct {
	net.Conn
	writes *int64
}

func (c *countConn) Write(b []byte) (int, error) {
	atomic.AddInt64(c.writes, 1)
	return c.Conn.Write(b)
}

// countingPool is a pool of one connection whose writes *writes counts.
func countingPool(t *testing.T) (*pgxpool.Pool, *int64) {
	t.Helper()
	testPool(t) // the table, or skip
	cfg, err := pgxpool.ParseConfig(os.Getenv("IDEM_GO_TEST_DSN"))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	writes := new(int64)
	var d net.Dialer
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &countConn{Conn: c, writes: writes}, nil
	}
	pool, err := pgxpool.ConnectConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if _, err := pool.Exec(context.Background(), "SELECT 1"); err != nil {
		t.Fatal(err)
	}
	return pool, writes
}

// idle waits until every connection of pool is back (a duplicate's
// ROLLBACK runs after its answer).
func idle(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	for i := 0; pool.Stat().AcquiredConns() > 0; i++ {
		if i > 1000 {
			t.Fatal("a connection was never given back to the pool")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// headerWrites notes how many writes to the server had been made when the
// answer's status was written.
type headerWrites struct {
	*httptest.ResponseRecorder
	writes *int64
	at     int64
}

func (h *headerWrites) WriteHeader(code int) {
	h.at = atomic.LoadInt64(h.writes)
	h.ResponseRecorder.WriteHeader(code)
}

// created answers 201 with a JSON body and a Location, counting its runs.
func created(runs *int64, body string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		atomic.AddInt64(runs, 1)
		w.Header().Set("Location", "/things/1")
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(body))
	})
}

func request(h http.Handler, path, key, body, trace string) *httptest.ResponseRecorder {
	r := httptest.NewRequest("POST", path, strings.NewReader(body))
	r.Header.Set(HeaderKey, key)
	if trace != "" {
		r.Header.Set(HeaderTrace, trace)
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

// same fails unless b is a's answer replayed: status, body bytes,
// Location, Content-Type, and Idempotent-Replayed: true.
func same(t *testing.T, what string, a, b *httptest.ResponseRecorder) {
	t.Helper()
	if b.Code != a.Code || b.Body.String() != a.Body.String() ||
		b.Header().Get("Location") != a.Header().Get("Location") ||
		b.Header().Get("Content-Type") != a.Header().Get("Content-Type") ||
		b.Header().Get(HeaderReplayed) != "true" {
		t.Errorf("%s: %d %v %q, not the replay of %d %v %q", what, b.Code, b.Header(), b.Body, a.Code, a.Header(), a.Body)
	}
}

func TestOneRoundTripBeforeAReplay(t *testing.T) {
	pool, writes := countingPool(t)
	var runs int64
	h := Middleware(pool)(created(&runs, `{"id": 1}`))
	key := newKey(t)

	before := atomic.LoadInt64(writes)
	first := request(h, "/rt", key, `{"a": 1}`, "")
	idle(t, pool)
	if n := atomic.LoadInt64(writes) - before; first.Code != 201 || n != 2 {
		t.Errorf("a new key: %d, %d round trips, not 2 (BEGIN with idem_acquire, idem_complete with COMMIT)", first.Code, n)
	}

	before = atomic.LoadInt64(writes)
	w := &headerWrites{ResponseRecorder: httptest.NewRecorder(), writes: writes}
	r := httptest.NewRequest("POST", "/rt", strings.NewReader(`{"a": 1}`))
	r.Header.Set(HeaderKey, key)
	h.ServeHTTP(w, r)
	idle(t, pool)
	same(t, "replay", first, w.ResponseRecorder)
	if n := w.at - before; n != 1 {
		t.Errorf("a replay: %d round trips before its answer, not 1", n)
	}
	if n := atomic.LoadInt64(writes) - before; n != 2 {
		t.Errorf("a replay: %d round trips in all, not 2 (the ROLLBACK after the answer)", n)
	}
	if runs != 1 {
		t.Errorf("the handler ran %d times", runs)
	}
}

func TestAwkwardKeysAndBodies(t *testing.T) {
	pool := testPool(t)
	var runs int64
	h := Middleware(pool)(created(&runs, `{"note": "it's a \\ \"quoted\" ключ 🙂"}`))
	for i, k := range []string{
		"it's", `back\slash`, `\'`, `'; DROP TABLE unit_rows; --`, "$$dollar$$", `E'\x41'`,
		"ключ-ü-🙂", "tab\there", `"double"`, strings.Repeat("'", 255),
	} {
		key := fmt.Sprintf("%s-%d-%s", newKey(t), i, k)
		if len(key) > 255 {
			key = key[:60] + key[len(key)-195:] // the time in newKey's suffix kept
		}
		body := fmt.Sprintf(`{"k": %q, "s": "it's \\ \u00e9 \ud83d\ude42"}`, k)
		first := request(h, "/awk'ward\\path", key, body, "")
		again := request(h, "/awk'ward\\path", key, body, "")
		if first.Code != 201 {
			t.Errorf("key %q: %d %s", key, first.Code, first.Body)
			continue
		}
		same(t, "key "+key, first, again)
		if n := count(t, pool, `SELECT count(*) FROM idempotency.records WHERE key = $1 AND scope = $2 AND status = 'completed'`,
			key, Scope("", "POST", "/awk'ward\\path")); n != 1 {
			t.Errorf("key %q: %d completed records under it, spelled as sent", key, n)
		}
		if n := count(t, pool, `SELECT count(*) FROM idempotency.records WHERE key = $1
		                          AND request_hash = idempotency.idem_request_hash($2::jsonb)`, key, body); n != 1 {
			t.Errorf("key %q: the request was not stored as sent", key)
		}
		if w := request(h, "/awk'ward\\path", key, `{"other": 1}`, ""); w.Code != 422 {
			t.Errorf("key %q, another body: %d", key, w.Code)
		}
	}
	if runs != 10 {
		t.Errorf("the handler ran %d times for 10 keys", runs)
	}
	// NUL: refused before the database
	isProblem(t, request(h, "/nul%00path", newKey(t), `{}`, ""), 400, "bad-request")
	isProblem(t, request(h, "/x", "nul\x00key", `{}`, ""), 400, "bad-request")
	if runs != 10 {
		t.Errorf("the handler ran for a NUL")
	}
}

// replays is idempotency.stats' replayed count of this database.
func replays(t *testing.T, pool *pgxpool.Pool) int {
	return count(t, pool, `SELECT replayed::int FROM idempotency.stats WHERE datname = current_database()`)
}

func TestCacheAnswersWithoutTheDatabase(t *testing.T) {
	pool := testPool(t)
	var runs int64
	cache := NewReplayCache(CacheOptions{})
	h := Middleware(pool, ReplayCache(cache))(created(&runs, `{"id":   7}`))
	plain := Middleware(pool)(created(&runs, `{"id":   7}`))
	key := newKey(t)
	tp1 := "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	tp2 := "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01"

	first := request(h, "/c", key, `{"a": 1}`, tp1)
	if first.Code != 201 || first.Body.String() != `{"id": 7}` || cache.Len() != 1 {
		t.Fatalf("first: %d %q, %d cached", first.Code, first.Body, cache.Len())
	}
	stats := replays(t, pool)
	acquires := pool.Stat().AcquireCount()
	for i := 0; i < 3; i++ {
		w := request(h, "/c", key, `{"a": 1}`, tp2)
		same(t, "cached replay", first, w)
		if w.Header().Get(HeaderOriginTrace) != tp1 {
			t.Errorf("cached replay: origin trace %q", w.Header().Get(HeaderOriginTrace))
		}
	}
	if n := pool.Stat().AcquireCount() - acquires; n != 0 {
		t.Errorf("cached replays took %d connections", n)
	}
	if n := replays(t, pool); n != stats {
		t.Errorf("idempotency.stats counted %d cached replays", n-stats)
	}
	// the database's replay of it: the same answer, and counted (so the
	// count above could have moved)
	db := request(plain, "/c", key, `{"a": 1}`, tp2)
	same(t, "database replay", first, db)
	if db.Header().Get(HeaderOriginTrace) != tp1 {
		t.Errorf("database replay: origin trace %q", db.Header().Get(HeaderOriginTrace))
	}
	for i := 0; replays(t, pool) == stats; i++ {
		if i > 500 {
			t.Fatal("idempotency.stats never counted the database's replay")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if runs != 1 {
		t.Errorf("the handler ran %d times", runs)
	}

	// another body with the key cached: the database answers, 422
	acquires = pool.Stat().AcquireCount()
	isProblem(t, request(h, "/c", key, `{"a": 2}`, ""), 422, "idempotency-key-reused")
	if pool.Stat().AcquireCount() == acquires {
		t.Error("another body was answered without the database")
	}
	same(t, "cached replay after the mismatch", first, request(h, "/c", key, `{"a": 1}`, ""))
	// same bytes only: the same JSON spelled otherwise goes to the database
	acquires = pool.Stat().AcquireCount()
	same(t, "replay of the JSON respelled", first, request(h, "/c", key, `{"a":1}`, ""))
	if pool.Stat().AcquireCount() == acquires {
		t.Error("a request of other bytes was answered from the cache")
	}
}

func TestCacheTakesTheDatabasesReplays(t *testing.T) {
	pool := testPool(t)
	var runs int64
	cache := NewReplayCache(CacheOptions{})
	other := Middleware(pool)(created(&runs, `{"id": 8}`)) // another process, no cache
	h := Middleware(pool, ReplayCache(cache), ReplayAsOK())(created(&runs, `{"id": 8}`))
	key := newKey(t)
	first := request(other, "/c", key, `{}`, "")
	acquires := pool.Stat().AcquireCount()
	a := request(h, "/c", key, `{}`, "")
	b := request(h, "/c", key, `{}`, "")
	if n := pool.Stat().AcquireCount() - acquires; n != 1 || cache.Len() != 1 {
		t.Errorf("two replays: %d went to the database, not 1; %d cached", n, cache.Len())
	}
	for _, w := range []*httptest.ResponseRecorder{a, b} {
		if w.Code != 200 || w.Body.String() != first.Body.String() || w.Header().Get(HeaderReplayed) != "true" ||
			w.Header().Get("Location") != "/things/1" {
			t.Errorf("ReplayAsOK replay: %d %v %q", w.Code, w.Header(), w.Body)
		}
	}
}

func TestCacheHoldsCompletedAnswersOnly(t *testing.T) {
	testPool(t) // or skip
	// a 409 after a wait of 50 ms, not the default 3 s
	pool, err := pgxpool.Connect(context.Background(), os.Getenv("IDEM_GO_TEST_DSN")+" options=-cidempotency.wait_timeout=50ms")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	cache := NewReplayCache(CacheOptions{})
	ctx := context.Background()
	fail := Middleware(pool, ReplayCache(cache))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		Fail(r.Context(), fmt.Errorf("down"))
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	release := Middleware(pool, ReplayCache(cache))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := Release(r.Context()); err != nil {
			t.Error(err)
		}
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	var runs int64
	ok := Middleware(pool, ReplayCache(cache))(created(&runs, `{}`))
	k1, k2, k3 := newKey(t)+"-fail", newKey(t)+"-release", newKey(t)+"-busy"
	for i := 0; i < 2; i++ {
		if w := request(fail, "/c", k1, `{}`, ""); w.Code != 503 {
			t.Errorf("Fail: %d", w.Code)
		}
		if w := request(release, "/c", k2, `{}`, ""); w.Code != 503 {
			t.Errorf("Release: %d", w.Code)
		}
	}
	// a claim in progress (committed, its lease a minute): 409, not cached
	if _, err := pool.Exec(ctx, `SELECT idempotency.idem_acquire(key => $1, request => '{}', scope => $2, lease => interval '1 minute')`,
		k3, Scope("", "POST", "/c")); err != nil {
		t.Fatal(err)
	}
	if w := request(ok, "/c", k3, `{}`, ""); w.Code != 409 {
		t.Errorf("in progress: %d", w.Code)
	}
	if w := request(ok, "/c", k3, `{"other": 1}`, ""); w.Code != 422 && w.Code != 409 {
		t.Errorf("in progress, another body: %d", w.Code)
	}
	if n := cache.Len(); n != 0 || runs != 0 {
		t.Errorf("%d answers cached, handler ran %d times", n, runs)
	}
}

func TestCacheNeverPastExpiresAt(t *testing.T) {
	pool := testPool(t)
	var runs int64
	cache := NewReplayCache(CacheOptions{})
	h := Middleware(pool, ReplayCache(cache), TTL(time.Second))(created(&runs, `{"id": 9}`))
	key := newKey(t)
	scope := Scope("", "POST", "/c")
	first := request(h, "/c", key, `{}`, "")
	acquires := pool.Stat().AcquireCount()
	if w := request(h, "/c", key, `{}`, ""); w.Code != 201 || pool.Stat().AcquireCount() != acquires || cache.Len() != 1 {
		t.Fatalf("not answered from the cache while live: %d", w.Code)
	}
	// wait until the database's clock has passed the record's expires_at
	for i := 0; count(t, pool, `SELECT count(*) FROM idempotency.records WHERE key = $1 AND scope = $2
	                            AND expires_at > pg_catalog.clock_timestamp()`, key, scope) > 0; i++ {
		if i > 1000 {
			t.Fatal("the record never expired")
		}
		time.Sleep(10 * time.Millisecond)
	}
	acquires = pool.Stat().AcquireCount()
	w := request(h, "/c", key, `{}`, "")
	if pool.Stat().AcquireCount() == acquires || w.Header().Get(HeaderReplayed) != "" || runs != 2 {
		t.Errorf("after expires_at: %d %v, the handler ran %d times (answered from the cache?)", w.Code, w.Header(), runs)
	}
	_ = first
}

func TestCacheForgetEvicts(t *testing.T) {
	pool := testPool(t)
	var runs int64
	cache := NewReplayCache(CacheOptions{})
	h := Middleware(pool, ReplayCache(cache))(created(&runs, `{}`))
	key := newKey(t)
	request(h, "/c", key, `{}`, "")
	request(h, "/c", key, `{}`, "")
	if runs != 1 || cache.Len() != 1 {
		t.Fatalf("runs %d, %d cached", runs, cache.Len())
	}
	found, err := cache.Forget(context.Background(), pool, Scope("", "POST", "/c"), key)
	if err != nil || !found {
		t.Fatalf("Forget: %v %v", found, err)
	}
	if cache.Len() != 0 {
		t.Error("Forget left the entry")
	}
	if w := request(h, "/c", key, `{}`, ""); w.Code != 201 || w.Header().Get(HeaderReplayed) != "" || runs != 2 {
		t.Errorf("after Forget: %d %v, runs %d", w.Code, w.Header(), runs)
	}
	// a nil cache forgets in the database alone
	if found, err := (*Cache)(nil).Forget(context.Background(), pool, Scope("", "POST", "/c"), key); err != nil || !found {
		t.Errorf("Forget without a cache: %v %v", found, err)
	}
}

func TestCacheMaxEntryBytes(t *testing.T) {
	pool := testPool(t)
	var runs int64
	cache := NewReplayCache(CacheOptions{MaxEntryBytes: 100})
	small := Middleware(pool, ReplayCache(cache))(created(&runs, `{"s": "small"}`))
	big := Middleware(pool, ReplayCache(cache))(created(&runs, `{"s": "`+strings.Repeat("x", 100)+`"}`))
	request(small, "/small", newKey(t), `{}`, "")
	if cache.Len() != 1 {
		t.Fatalf("a small answer was not cached")
	}
	key := newKey(t)
	first := request(big, "/big", key, `{}`, "")
	acquires := pool.Stat().AcquireCount()
	same(t, "big replay", first, request(big, "/big", key, `{}`, ""))
	if cache.Len() != 1 || pool.Stat().AcquireCount() == acquires {
		t.Errorf("an answer over MaxEntryBytes was cached")
	}
}

func TestCacheConcurrentReplays(t *testing.T) {
	pool := testPool(t)
	var runs int64
	cache := NewReplayCache(CacheOptions{MaxEntries: 3})
	h := Middleware(pool, ReplayCache(cache))(created(&runs, `{"id": 1}`))
	keys := []string{newKey(t) + "-a", newKey(t) + "-b", newKey(t) + "-c", newKey(t) + "-d"}
	for _, k := range keys {
		request(h, "/c", k, `{}`, "")
	}
	var wg sync.WaitGroup
	var bad int64
	for g := 0; g < 20; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 25; i++ {
				w := request(h, "/c", keys[(g+i)%len(keys)], `{}`, "")
				if w.Code != 201 || w.Body.String() != `{"id": 1}` || w.Header().Get(HeaderReplayed) != "true" {
					atomic.AddInt64(&bad, 1)
				}
			}
		}(g)
	}
	wg.Wait()
	if bad != 0 || runs != 4 || cache.Len() != 3 {
		t.Errorf("%d bad answers, the handler ran %d times, %d cached (max 3)", bad, runs, cache.Len())
	}
}

// fakeClock is now() for the sampler: it moves when told.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *fakeClock) add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// captureDuplicates points the duplicate lines (sampled and all) at a
// buffer, the sampler at clock, until the test ends.
func captureDuplicates(t *testing.T, clock *fakeClock) *syncBuffer {
	buf := &syncBuffer{}
	dupSampler.mu.Lock()
	oldNow, oldPrintf := dupSampler.now, dupSampler.printf
	dupSampler.now, dupSampler.last, dupSampler.left = clock.now, time.Time{}, 0
	dupSampler.printf = func(f string, v ...interface{}) { fmt.Fprintf(buf, f+"\n", v...) }
	dupSampler.mu.Unlock()
	logPrint = func(v ...interface{}) { fmt.Fprintln(buf, v...) }
	t.Cleanup(func() {
		dupSampler.mu.Lock()
		dupSampler.now, dupSampler.printf, dupSampler.last, dupSampler.left = oldNow, oldPrintf, time.Time{}, 0
		dupSampler.mu.Unlock()
		logPrint = log.Print
	})
	return buf
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}
func (s *syncBuffer) lines() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return strings.Split(strings.TrimSuffix(s.b.String(), "\n"), "\n")
}

func TestDuplicateLinesSampled(t *testing.T) {
	pool := testPool(t)
	clock := &fakeClock{t: time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC)}
	buf := captureDuplicates(t, clock)
	var runs int64
	h := Middleware(pool, ReplayCache(NewReplayCache(CacheOptions{})))(created(&runs, `{}`))
	key := newKey(t)
	request(h, "/c", key, `{}`, "")
	for i := 0; i < 100; i++ { // 100 replays within 0.99 s
		request(h, "/c", key, `{}`, "")
		clock.add(9900 * time.Microsecond)
	}
	if l := buf.lines(); len(l) != 1 || !strings.Contains(l[0], "replay") {
		t.Fatalf("100 replays in a second: %d lines, not 1: %q", len(l), l)
	}
	clock.add(20 * time.Millisecond)
	request(h, "/c", key, `{}`, "")
	l := buf.lines()
	if len(l) != 2 || !strings.Contains(l[1], "and 99 more duplicate answers not logged since 12:00:00") {
		t.Fatalf("the next line does not say how many were left out: %q", l)
	}
}

func TestDuplicateLinesAllAndOff(t *testing.T) {
	pool := testPool(t)
	clock := &fakeClock{t: time.Now()}
	buf := captureDuplicates(t, clock)
	var runs int64
	all := Middleware(pool, LogDuplicates(LogAll))(created(&runs, `{}`))
	off := Middleware(pool, LogDuplicates(LogOff))(created(&runs, `{}`))
	key := newKey(t)
	request(all, "/c", key, `{}`, "")
	for i := 0; i < 5; i++ {
		request(all, "/c", key, `{}`, "")
		request(off, "/c", key, `{}`, "")
	}
	if l := buf.lines(); len(l) != 5 {
		t.Errorf("LogAll and LogOff, 5 replays each: %d lines, not 5: %q", len(l), l)
	}
	for _, c := range []struct {
		s string
		m LogMode
	}{{"sampled", LogSampled}, {"all", LogAll}, {"off", LogOff}} {
		if m, err := ParseLogMode(c.s); err != nil || m != c.m {
			t.Errorf("ParseLogMode(%q): %v %v", c.s, m, err)
		}
	}
	if _, err := ParseLogMode("some"); err == nil {
		t.Error("ParseLogMode took \"some\"")
	}
}

func TestSavepointsAndLargeObjectsInTheClaimsTransaction(t *testing.T) {
	pool := testPool(t)
	key := newKey(t)
	h := Middleware(pool)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		tx, err := Tx(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO unit_rows VALUES ($1)`, Key(ctx)+"-kept"); err != nil {
			t.Error(err)
		}
		if err := tx.BeginFunc(ctx, func(sp pgx.Tx) error {
			_, err := sp.Exec(ctx, `INSERT INTO unit_rows VALUES ($1)`, Key(ctx)+"-undone")
			if err != nil {
				return err
			}
			return fmt.Errorf("undo")
		}); err == nil || err.Error() != "undo" {
			t.Errorf("BeginFunc: %v", err)
		}
		sp, err := tx.Begin(ctx)
		if err == nil {
			_, err = sp.Exec(ctx, `INSERT INTO unit_rows VALUES ($1)`, Key(ctx)+"-released")
		}
		if err == nil {
			err = sp.Commit(ctx)
		}
		if err != nil {
			t.Error(err)
		}
		lo := tx.LargeObjects()
		oid, err := lo.Create(ctx, 0)
		if err != nil || oid == 0 {
			t.Errorf("LargeObjects: %v %v", oid, err)
		}
		w.WriteHeader(http.StatusCreated)
	}))
	if w := request(h, "/t", key, `{}`, ""); w.Code != 201 {
		t.Fatalf("%d %s", w.Code, w.Body)
	}
	if n := count(t, pool, `SELECT count(*) FROM unit_rows WHERE key IN ($1 || '-kept', $1 || '-released')`, key); n != 2 {
		t.Errorf("%d of the 2 rows kept", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM unit_rows WHERE key = $1 || '-undone'`, key); n != 0 {
		t.Errorf("the row of the rolled-back savepoint committed")
	}
}
