package idempotency

// Shards: the calls of an idempotency_proxy cluster sent by the
// application straight to the shard that owns each key, so that no router
// backend spends its CPU on them (issue 39: a PL/Proxy router costs about
// what a shard does, whatever it routes).  The router stays, for SQL-only
// clients and for the growth window, when only it knows where a moved
// key's records are.

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgconn"
	"github.com/jackc/pgx/v4"
	"github.com/jackc/pgx/v4/pgxpool"
)

// ShardsOptions configure NewShards; a zero field takes its default.
type ShardsOptions struct {
	// Config makes the pool of one shard from its connection string, as
	// the router's layout spells it (idempotency.cluster_state.connstrs).
	// Default: pgxpool.ParseConfig of the string, so the user and the
	// password come from the environment (PGUSER, PGPASSWORD, ~/.pgpass)
	// where the string has none. Use it where the application reaches the
	// shards by other addresses or credentials than the router.
	Config func(connstr string) (*pgxpool.Config, error)
	// MaxAge is how long a layout is used before it is read again (default
	// 30 s). A shard refuses a call from a layout it has left behind, and
	// Shards then reads the layout again at once, so MaxAge only bounds how
	// long Shards keeps sending calls through the router after a growth's
	// window has closed.
	MaxAge time.Duration
}

// Shards sends idem_acquire, idem_complete and idem_release to the shard
// that owns the key under the cluster's layout, as the router's
// idempotency.idem_acquire would, without the router: the application
// hashes (scope, key) as idempotency.key_hash() does, and calls the
// owning shard's idempotency.shard_acquire with the layout version. A
// shard checks both (it refuses, with a row or with SQLSTATE 55R01, a key
// it does not own or a claim from a layout it has left behind), so a
// Shards, however stale its layout, never makes a key run on two shards:
// on a refusal it reads the layout again and sends the call through the
// router. While a growth's window is open (the layout has a previous
// placement), or while the shards do not all agree on one layout in force,
// every call goes through the router, which looks at a moved key's
// previous shard first.
//
// Claims are lease claims, committed at once (across transactions, as
// through the router): acquire, do the work, then Complete with the claim,
// or Release it. Safe for concurrent use.
//
// The role it connects as needs on each shard what the router's role has
// (proxy/README.md, its grants on the shards), and on the router SELECT on
// idempotency.cluster_state and what the router's README grants.
type Shards struct {
	router *pgxpool.Pool
	opts   ShardsOptions

	reload sync.Mutex // one reading of the layout at a time

	mu     sync.RWMutex // guards layout and pools
	layout *shardLayout
	pools  map[string]*pgxpool.Pool
	closed bool
}

// shardLayout is the layout as Shards last read it.
type shardLayout struct {
	version int64
	servers []string // partition i is servers[i]
	direct  bool     // false: every call goes through the router
	why     string   // why not direct
	read    time.Time
}

// ShardAnswer is idem_acquire's answer (the columns of idempotency 1.2's
// idem_acquire), through Shards. JSON values are their text.
type ShardAnswer struct {
	Outcome         string
	ResponseStatus  *int32
	ResponseBody    *string
	Attempt         *int32
	ExpiresAt       *time.Time
	Claim           *string
	RetryAfter      *int32
	Phase           *string
	State           *string
	ResponseHeaders *string
	OriginTrace     *string
}

// ShardsLayout says how Shards routes now: Direct, or through the router
// (Why says why), at layout Version over Partitions partitions.
type ShardsLayout struct {
	Version    int64
	Partitions int
	Direct     bool
	Why        string
}

// NewShards reads the cluster's layout from the router (its pool, which
// Shards uses but does not close) and from every shard, and answers a
// Shards that routes by it.
func NewShards(ctx context.Context, router *pgxpool.Pool, opts ShardsOptions) (*Shards, error) {
	if router == nil {
		return nil, errors.New("idempotency: NewShards needs the router's pool")
	}
	if opts.Config == nil {
		opts.Config = pgxpool.ParseConfig
	}
	if opts.MaxAge <= 0 {
		opts.MaxAge = 30 * time.Second
	}
	s := &Shards{router: router, opts: opts, pools: map[string]*pgxpool.Pool{}}
	if _, err := s.readLayout(ctx, nil); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// Close closes the shards' pools (not the router's).
func (s *Shards) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range s.pools {
		p.Close()
	}
	s.pools = map[string]*pgxpool.Pool{}
	s.closed = true
}

// Layout answers how Shards routes now (without reading the layout again).
func (s *Shards) Layout() ShardsLayout {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.layout == nil {
		return ShardsLayout{Why: "no layout read"}
	}
	return ShardsLayout{Version: s.layout.version, Partitions: len(s.layout.servers),
		Direct: s.layout.direct, Why: s.layout.why}
}

// Reload reads the layout again now.
func (s *Shards) Reload(ctx context.Context) error {
	_, err := s.readLayout(ctx, nil)
	return err
}

// KeyHash is idempotency.key_hash(scope, key): the first 32 bits of
// SHA-256 over scope, a zero byte and key (their UTF-8), as a signed
// integer. The partition of a key is KeyHash & (partitions - 1).
func KeyHash(scope, key string) int32 {
	h := sha256.New()
	h.Write([]byte(scope))
	h.Write([]byte{0})
	h.Write([]byte(key))
	return int32(binary.BigEndian.Uint32(h.Sum(nil)[:4]))
}

// The statements, the same text on a shard and on the router where the
// call is the same (complete, release); pgx prepares each once a
// connection.
const (
	shardAcquireSQL = `SELECT outcome, response_status, response_body::text, attempt, expires_at,
       claim::text, retry_after, phase, state::text, response_headers::text, origin_trace
  FROM idempotency.shard_acquire($1::bigint, $2::text, $3::jsonb, $4::text, $5::interval, $6::interval, $7::text)`
	routerAcquireSQL = `SELECT outcome, response_status, response_body::text, attempt, expires_at,
       claim::text, retry_after, phase, state::text, response_headers::text, origin_trace
  FROM idempotency.idem_acquire($1::text, $2::jsonb, $3::text, $4::interval, $5::interval, false, $6::text)`
	completeSQL = `SELECT idempotency.idem_complete($1::text, $2::int, $3::jsonb, $4::text, NULL::int, $5::uuid, $6::jsonb)`
	releaseSQL  = `SELECT idempotency.idem_release($1::text, $2::text, NULL::int, $3::uuid)`
	layoutSQL   = `SELECT s.version, s.active, s.map, s.previous_map IS NOT NULL FROM idempotency.shard_layout s`
	clusterSQL  = `SELECT s.connstrs FROM idempotency.cluster_state s`
)

// sqlState is the SQLSTATE of a PostgreSQL error, or "".
func sqlState(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

// current answers the layout to route by, read again when older than
// MaxAge.
func (s *Shards) current(ctx context.Context) (*shardLayout, error) {
	s.mu.RLock()
	l := s.layout
	closed := s.closed
	s.mu.RUnlock()
	if closed {
		return nil, errors.New("idempotency: Shards is closed")
	}
	if l != nil && time.Since(l.read) < s.opts.MaxAge {
		return l, nil
	}
	return s.readLayout(ctx, l)
}

// readLayout reads the layout from the router and the shards, unless
// another call has read it since seen was current. Where it cannot be
// read, the calls go through the router until it can.
func (s *Shards) readLayout(ctx context.Context, seen *shardLayout) (*shardLayout, error) {
	s.reload.Lock()
	defer s.reload.Unlock()
	s.mu.RLock()
	l := s.layout
	s.mu.RUnlock()
	if seen != nil && l != seen && l != nil && time.Since(l.read) < s.opts.MaxAge {
		return l, nil
	}
	l, err := s.load(ctx)
	if err != nil {
		l = &shardLayout{why: err.Error(), read: time.Now()}
	}
	s.mu.Lock()
	s.layout = l
	s.mu.Unlock()
	if seen == nil {
		// NewShards, Reload: the caller hears why
		return l, err
	}
	return l, nil
}

// load reads the placement from the router, then each shard's layout:
// direct when every shard has one layout, in force, with no growth window
// open, over the router's placement.
func (s *Shards) load(ctx context.Context) (*shardLayout, error) {
	l := &shardLayout{read: time.Now()}
	if err := s.router.QueryRow(ctx, clusterSQL).Scan(&l.servers); err != nil {
		return nil, fmt.Errorf("idempotency: the router's placement: %w", err)
	}
	n := len(l.servers)
	if n == 0 || n&(n-1) != 0 {
		return nil, fmt.Errorf("idempotency: the router has %d partitions; idempotency.cluster_create() declares them", n)
	}
	first := true
	read := map[string]bool{}
	for _, c := range l.servers {
		if read[c] {
			continue
		}
		read[c] = true
		pool, err := s.pool(ctx, c)
		if err != nil {
			return nil, err
		}
		var version int64
		var active, window bool
		var m []string
		err = pool.QueryRow(ctx, layoutSQL).Scan(&version, &active, &m, &window)
		if err == nil && first {
			l.version, first = version, false
		}
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			l.why = fmt.Sprintf("the shard %q has no layout", c)
		case err != nil:
			return nil, fmt.Errorf("idempotency: the layout of the shard %q: %w", c, err)
		case version != l.version:
			l.why = fmt.Sprintf("the shards have layouts %d and %d", l.version, version)
		case !active:
			l.why = fmt.Sprintf("layout %d is not in force on the shard %q", version, c)
		case window:
			l.why = fmt.Sprintf("the window of the growth to layout %d is open", version)
		case !sameServers(m, l.servers):
			l.why = fmt.Sprintf("the shard %q has another placement than the router", c)
		}
		if l.why != "" {
			return l, nil
		}
	}
	l.direct = true
	return l, nil
}

func sameServers(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// pool answers the pool of the shard connstr, made on first use.
func (s *Shards) pool(ctx context.Context, connstr string) (*pgxpool.Pool, error) {
	s.mu.RLock()
	p, ok := s.pools[connstr]
	s.mu.RUnlock()
	if ok {
		return p, nil
	}
	cfg, err := s.opts.Config(connstr)
	if err != nil {
		return nil, fmt.Errorf("idempotency: the shard %q: %w", connstr, err)
	}
	p, err = pgxpool.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("idempotency: the shard %q: %w", connstr, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if q, ok := s.pools[connstr]; ok {
		p.Close()
		return q, nil
	}
	s.pools[connstr] = p
	return p, nil
}

// owner answers the pool of the shard that owns (scope, key) under l.
func (s *Shards) owner(ctx context.Context, l *shardLayout, scope, key string) (*pgxpool.Pool, error) {
	n := uint32(len(l.servers))
	return s.pool(ctx, l.servers[uint32(KeyHash(scope, key))&(n-1)])
}

// interval is a duration as an interval parameter: nil (the default) for
// zero.
func intervalParam(d time.Duration) interface{} {
	if d <= 0 {
		return nil
	}
	return fmt.Sprintf("%d microseconds", d.Microseconds())
}

// textParam is a *string as a parameter (nil: NULL).
func textParam(p *string) interface{} {
	if p == nil {
		return nil
	}
	return *p
}

func scanAnswer(row pgx.Row) (ShardAnswer, error) {
	var a ShardAnswer
	err := row.Scan(&a.Outcome, &a.ResponseStatus, &a.ResponseBody, &a.Attempt, &a.ExpiresAt,
		&a.Claim, &a.RetryAfter, &a.Phase, &a.State, &a.ResponseHeaders, &a.OriginTrace)
	return a, err
}

// Acquire is idempotency.idem_acquire(key, request, scope, ttl, lease,
// trace) of the cluster: request is the request's JSON text (nil: no
// payload check), ttl and lease zero for the defaults, trace nil for none.
// On the owning shard when the layout allows, else through the router; a
// shard's refusal (it does not own the key under its newer layout) reads
// the layout again and sends the call through the router.
func (s *Shards) Acquire(ctx context.Context, key string, request *string, scope string,
	ttl, lease time.Duration, trace *string) (ShardAnswer, error) {
	l, err := s.current(ctx)
	if err != nil {
		return ShardAnswer{}, err
	}
	if l.direct {
		pool, err := s.owner(ctx, l, scope, key)
		if err != nil {
			return ShardAnswer{}, err
		}
		a, err := scanAnswer(pool.QueryRow(ctx, shardAcquireSQL, l.version, key, textParam(request),
			scope, intervalParam(ttl), intervalParam(lease), textParam(trace)))
		if err == nil && a.Outcome != "refused" {
			return a, nil
		}
		if err != nil && sqlState(err) != "55R01" {
			return a, err
		}
		// refused: nothing of the call is left on the shard
		if _, err := s.readLayout(ctx, l); err != nil {
			return ShardAnswer{}, err
		}
	}
	return scanAnswer(s.router.QueryRow(ctx, routerAcquireSQL, key, textParam(request), scope,
		intervalParam(ttl), intervalParam(lease), textParam(trace)))
}

// Complete is idempotency.idem_complete(key, status, body, scope, claim =>
// claim, response_headers => headers) of the cluster: body and headers are
// JSON text (nil: NULL). It answers idem_complete's boolean.
func (s *Shards) Complete(ctx context.Context, key, scope string, status int32, body *string,
	claim string, headers *string) (bool, error) {
	var done bool
	err := s.onOwner(ctx, scope, key, func(q querier) error {
		return q.QueryRow(ctx, completeSQL, key, status, textParam(body), scope, claim,
			textParam(headers)).Scan(&done)
	})
	return done, err
}

// Release is idempotency.idem_release(key, scope, claim => claim) of the
// cluster.
func (s *Shards) Release(ctx context.Context, key, scope string, claim string) (bool, error) {
	var done bool
	err := s.onOwner(ctx, scope, key, func(q querier) error {
		return q.QueryRow(ctx, releaseSQL, key, scope, claim).Scan(&done)
	})
	return done, err
}

type querier interface {
	QueryRow(ctx context.Context, sql string, args ...interface{}) pgx.Row
}

// onOwner runs f on the key's shard when the layout is direct, else on the
// router. A claim made under a direct layout is on its owner under that
// layout: a growth that moves the key keeps its window open while the
// claim is live (cluster_growth_pending counts it), so the layout that
// Shards reads meanwhile sends f through the router, which finds it.
func (s *Shards) onOwner(ctx context.Context, scope, key string, f func(querier) error) error {
	l, err := s.current(ctx)
	if err != nil {
		return err
	}
	if !l.direct {
		return f(s.router)
	}
	pool, err := s.owner(ctx, l, scope, key)
	if err != nil {
		return err
	}
	err = f(pool)
	if sqlState(err) != "P0002" {
		return err
	}
	// No live record there: the claim may have been made through the
	// router on the key's new shard, during a growth that this layout has
	// not heard of. Read the layout again; where it has changed, ask there.
	n, rerr := s.readLayout(ctx, l)
	if rerr != nil || (n.direct && n.version == l.version) {
		return err
	}
	if !n.direct {
		return f(s.router)
	}
	if pool, err = s.owner(ctx, n, scope, key); err != nil {
		return err
	}
	return f(pool)
}
