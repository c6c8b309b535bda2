package idempotency

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v4/pgxpool"
)

// Shards against a real idempotency_proxy cluster on the test cluster:
// IDEM_GO_SHARDS_DSN names its server ("host=... port=... user=..."), and
// integrations/go/test.sh makes there the router database idem_go_router
// (idempotency_proxy) and the shard databases idem_go_shard0, 1 and 2
// (idempotency), all empty. One test, its steps in order: the cluster
// grows half way through.

func shardsDSN(t *testing.T, db string) string {
	t.Helper()
	base := os.Getenv("IDEM_GO_SHARDS_DSN")
	if base == "" {
		t.Skip("IDEM_GO_SHARDS_DSN not set: no router and shard databases")
	}
	return base + " dbname=" + db
}

func connect(t *testing.T, dsn string) *pgxpool.Pool {
	t.Helper()
	p, err := pgxpool.Connect(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// on answers which of the shards hold a record of (scope, key): their
// indexes, comma-separated.
func on(t *testing.T, shards []*pgxpool.Pool, scope, key string) string {
	t.Helper()
	var at []string
	for i, p := range shards {
		if count(t, p, `SELECT count(*) FROM idempotency.records WHERE scope = $1 AND key = $2`, scope, key) > 0 {
			at = append(at, fmt.Sprint(i))
		}
	}
	return strings.Join(at, ",")
}

func str(s string) *string { return &s }

func mustAcquire(t *testing.T, s *Shards, key, request string, want string) ShardAnswer {
	t.Helper()
	a, err := s.Acquire(context.Background(), key, str(request), "go", time.Hour, time.Minute, nil)
	if err != nil {
		t.Fatalf("Acquire(%q): %v", key, err)
	}
	if a.Outcome != want {
		t.Fatalf("Acquire(%q) = %q, want %q", key, a.Outcome, want)
	}
	return a
}

// keyIn answers the first key prefix-0, prefix-1, ... of scope "go" in
// partition p of n.
func keyIn(p, n uint32, prefix string) string {
	for i := 0; ; i++ {
		k := fmt.Sprintf("%s-%d", prefix, i)
		if uint32(KeyHash("go", k))&(n-1) == p {
			return k
		}
	}
}

func TestShards(t *testing.T) {
	ctx := context.Background()
	router := connect(t, shardsDSN(t, "idem_go_router"))
	var conn [3]string
	shards := make([]*pgxpool.Pool, 3)
	for i := range conn {
		conn[i] = shardsDSN(t, fmt.Sprintf("idem_go_shard%d", i))
		shards[i] = connect(t, conn[i])
	}
	if _, err := router.Exec(ctx, `SELECT count(*) FROM idempotency.cluster_create(ARRAY[$1, $2])`,
		conn[0], conn[1]); err != nil {
		t.Fatal(err)
	}

	t.Run("KeyHash is key_hash()", func(t *testing.T) {
		for _, c := range [][2]string{{"", ""}, {"go", "k"}, {"user-7:/payments", "ключ-ü-€-😀"},
			{"a\tb", strings.Repeat("x", 300)}, {"scope", "it's $$ \\ \"q\""}} {
			var want int32
			if err := shards[0].QueryRow(ctx, `SELECT idempotency.shard_key_hash($1, $2)`, c[0], c[1]).Scan(&want); err != nil {
				t.Fatal(err)
			}
			if got := KeyHash(c[0], c[1]); got != want {
				t.Errorf("KeyHash(%q, %q) = %d, shard_key_hash = %d", c[0], c[1], got, want)
			}
		}
	})

	s, err := NewShards(ctx, router, ShardsOptions{MaxAge: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	// two more applications, whose layout the growth below leaves behind
	stale, err := NewShards(ctx, router, ShardsOptions{MaxAge: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer stale.Close()
	staleComplete, err := NewShards(ctx, router, ShardsOptions{MaxAge: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer staleComplete.Close()

	t.Run("direct over layout 1", func(t *testing.T) {
		if l := s.Layout(); !l.Direct || l.Version != 1 || l.Partitions != 2 {
			t.Fatalf("Layout() = %+v, want direct, version 1, 2 partitions", l)
		}
	})

	t.Run("each key on its owner, replayed and mismatched there", func(t *testing.T) {
		for i := 0; i < 16; i++ {
			key := fmt.Sprintf("k%d", i)
			a := mustAcquire(t, s, key, fmt.Sprintf(`{"n": %d}`, i), "acquired")
			owner := fmt.Sprint(uint32(KeyHash("go", key)) & 1)
			if got := on(t, shards, "go", key); got != owner {
				t.Fatalf("%s: a record on shard(s) %q, want only its owner %s", key, got, owner)
			}
			done, err := s.Complete(ctx, key, "go", 201, str(fmt.Sprintf(`{"id": %d}`, i)), *a.Claim, str(`{"Location": "/x"}`))
			if err != nil || !done {
				t.Fatalf("Complete(%s) = %v, %v", key, done, err)
			}
			r := mustAcquire(t, s, key, fmt.Sprintf(`{"n": %d}`, i), "replay")
			if *r.ResponseStatus != 201 || *r.ResponseBody != fmt.Sprintf(`{"id": %d}`, i) ||
				*r.ResponseHeaders != `{"location": "/x"}` {
				t.Fatalf("replay of %s: %d %s %s", key, *r.ResponseStatus, *r.ResponseBody, *r.ResponseHeaders)
			}
			mustAcquire(t, s, key, `{"n": -1}`, "mismatch")
			// the router finds the same record
			var outcome string
			if err := router.QueryRow(ctx, `SELECT outcome FROM idempotency.idem_acquire($1, $2::jsonb, 'go')`,
				key, fmt.Sprintf(`{"n": %d}`, i)).Scan(&outcome); err != nil || outcome != "replay" {
				t.Fatalf("through the router, %s: %q, %v", key, outcome, err)
			}
		}
		for i, p := range shards[:2] {
			if n := count(t, p, `SELECT count(*) FROM idempotency.records WHERE scope = 'go'`); n == 0 || n == 16 {
				t.Errorf("shard %d holds %d of the 16 records", i, n)
			}
		}
	})

	t.Run("in progress, released, acquired again", func(t *testing.T) {
		a := mustAcquire(t, s, "held", `{}`, "acquired")
		mustAcquire(t, s, "held", `{}`, "in_progress")
		if done, err := s.Release(ctx, "held", "go", *a.Claim); err != nil || !done {
			t.Fatalf("Release = %v, %v", done, err)
		}
		a = mustAcquire(t, s, "held", `{}`, "acquired")
		if done, err := s.Complete(ctx, "held", "go", 200, nil, *a.Claim, nil); err != nil || !done {
			t.Fatalf("Complete = %v, %v", done, err)
		}
	})

	// Keys of partitions 2 and 3 of 4 move: 2 from shard 0 to 2, 3 from
	// shard 1 to 0.
	moved := -1 // one of k0..k15, completed before the growth, that moves
	for i := 0; i < 16 && moved < 0; i++ {
		if uint32(KeyHash("go", fmt.Sprintf("k%d", i)))&3 == 2 {
			moved = i
		}
	}
	if moved < 0 {
		t.Fatal("none of k0..k15 is in partition 2 of 4")
	}
	doneMoved := fmt.Sprintf("k%d", moved)
	if got := on(t, shards, "go", doneMoved); got != "0" {
		t.Fatalf("%s: on shard(s) %q before the growth, want 0", doneMoved, got)
	}
	if _, err := router.Exec(ctx, `SELECT count(*) FROM idempotency.cluster_grow(ARRAY[$1, $2, $3], 4)`,
		conn[0], conn[1], conn[2]); err != nil {
		t.Fatal(err)
	}

	t.Run("growth: a stale layout is answered, or refused and routed", func(t *testing.T) {
		// a moved key's record, from layout 1: its previous shard refuses
		// a layout it has left behind; the router answers, from there
		r := mustAcquire(t, stale, doneMoved, fmt.Sprintf(`{"n": %d}`, moved), "replay")
		if *r.ResponseBody != fmt.Sprintf(`{"id": %d}`, moved) {
			t.Fatalf("replay of %s: %s", doneMoved, *r.ResponseBody)
		}
		if l := stale.Layout(); l.Direct || l.Version != 2 {
			t.Fatalf("after a refusal, the stale Layout() = %+v, want through the router, version 2", l)
		}
		if got := on(t, shards, "go", doneMoved); got != "0" {
			t.Fatalf("%s: on shard(s) %q after its replay, want 0 only", doneMoved, got)
		}
		// a key that stays: answered at layout 1, no refusal
		stays := keyIn(0, 4, "stays")
		mustAcquire(t, staleComplete, stays, `{}`, "acquired")
		if l := staleComplete.Layout(); !l.Direct || l.Version != 1 {
			t.Fatalf("a key that does not move was refused: Layout() = %+v", l)
		}
		// a new key that moves: refused by its old owner, then claimed
		// through the router on its new one
		fresh := keyIn(2, 4, "fresh")
		a := mustAcquire(t, s, fresh, `{}`, "acquired")
		if l := s.Layout(); l.Direct || l.Version != 2 || !strings.Contains(l.Why, "window") {
			t.Fatalf("after a refusal, Layout() = %+v, want through the router, version 2, the window open", l)
		}
		if got := on(t, shards, "go", fresh); got != "2" {
			t.Fatalf("%s: on shard(s) %q, want 2", fresh, got)
		}
		// the stale application completes it: its layout's owner has no
		// record, so it reads the layout again and asks the router
		done, err := staleComplete.Complete(ctx, fresh, "go", 201, str(`{"ok": true}`), *a.Claim, nil)
		if err != nil || !done {
			t.Fatalf("stale Complete = %v, %v", done, err)
		}
		if staleComplete.Layout().Direct {
			t.Fatalf("stale layout not read again after P0002: %+v", staleComplete.Layout())
		}
		mustAcquire(t, s, fresh, `{}`, "replay")
		mustAcquire(t, stale, fresh, `{}`, "replay")
	})

	t.Run("window closed: direct over layout 2", func(t *testing.T) {
		if _, err := router.Exec(ctx, `SELECT idempotency.cluster_growth_finish(force => true)`); err != nil {
			t.Fatal(err)
		}
		if err := s.Reload(ctx); err != nil {
			t.Fatal(err)
		}
		if l := s.Layout(); !l.Direct || l.Version != 2 || l.Partitions != 4 {
			t.Fatalf("Layout() = %+v, want direct, version 2, 4 partitions", l)
		}
		for p, shard := range []string{"0", "1", "2", "0"} {
			key := keyIn(uint32(p), 4, "after")
			mustAcquire(t, s, key, `{}`, "acquired")
			if got := on(t, shards, "go", key); got != shard {
				t.Errorf("%s (partition %d): on shard(s) %q, want %s", key, p, got, shard)
			}
		}
	})
}
