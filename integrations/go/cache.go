package idempotency

import (
	"container/list"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log"
	"sync"
	"time"

	"github.com/jackc/pgx/v4/pgxpool"
)

// CacheOptions bound a replay cache (NewReplayCache); a zero field takes
// its default.
type CacheOptions struct {
	// MaxEntries is how many answers the cache holds at most (default
	// 10,000); the least recently used goes first.
	MaxEntries int
	// MaxEntryBytes is the largest answer cached, its body and headers
	// (default 65,536): larger answers are not cached.
	MaxEntryBytes int
	// MaxAge is how long an answer stays at most (default 60 s), however
	// far its key's expires_at is.
	MaxAge time.Duration
}

// Cache is an in-process cache of completed answers, for the ReplayCache
// option: a retry of a completed request is answered from memory, without
// a database round trip. Safe for concurrent use (a mutex). It holds:
//
//   - completed answers only: a replay that idem_acquire returned, or this
//     process's own answer once its COMMIT has succeeded (never
//     in_progress, a mismatch, nor a released or failed claim);
//   - under (scope, key) as idem_acquire got them, with the SHA-256 of the
//     request that the database matched: only a byte-identical request is
//     answered from it, any other goes to the database (a replay or a 422
//     mismatch, as without the cache);
//   - until the key's expires_at by the database's clock (the time left
//     that the database gave with the answer, counted from a local clock
//     reading taken before the query was sent: never later than the real
//     expiry whatever the two clocks say), and MaxAge at most.
//
// A replay answered from it does not reach the database, so
// idempotency.stats does not count it. Forget removes a key from the
// database and from this cache; other processes' caches may answer it
// until their entries' MaxAge passes.
type Cache struct {
	opts CacheOptions
	now  func() time.Time

	mu    sync.Mutex
	lru   list.List // of *entry, most recently used first
	byKey map[cacheKey]*list.Element
	epoch uint64 // Remove's count: an answer fetched before one is not put in
}

type cacheKey struct{ scope, key string }

// entry is one cached answer.
type entry struct {
	k           cacheKey
	request     [sha256.Size]byte
	status      int
	body        *string // jsonb's text, as stored; nil: none
	headers     *string // response_headers' text (a JSON object); nil: none
	originTrace *string
	deadline    time.Time // local, monotonic
}

func (e *entry) size() int {
	n := 0
	if e.body != nil {
		n += len(*e.body)
	}
	if e.headers != nil {
		n += len(*e.headers)
	}
	return n
}

// NewReplayCache returns an empty cache bounded by o, for the ReplayCache
// option (one cache may serve several middlewares).
func NewReplayCache(o CacheOptions) *Cache {
	if o.MaxEntries <= 0 {
		o.MaxEntries = 10000
	}
	if o.MaxEntryBytes <= 0 {
		o.MaxEntryBytes = 65536
	}
	if o.MaxAge <= 0 {
		o.MaxAge = 60 * time.Second
	}
	return &Cache{opts: o, now: time.Now, byKey: map[cacheKey]*list.Element{}}
}

// ReplayCache answers the retries of completed requests from c, in
// process (off by default; see Cache for what it holds and when).
func ReplayCache(c *Cache) Option {
	return func(cfg *config) { cfg.cache = c }
}

// Len is how many answers the cache holds.
func (c *Cache) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lru.Len()
}

// get is the entry of (scope, key) for this request's hash, if it is live;
// nil otherwise (an expired one is dropped).
func (c *Cache) get(scope, key string, request [sha256.Size]byte) *entry {
	now := c.now()
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.byKey[cacheKey{scope, key}]
	if !ok {
		return nil
	}
	e := el.Value.(*entry)
	if !now.Before(e.deadline) {
		c.lru.Remove(el)
		delete(c.byKey, e.k)
		return nil
	}
	if e.request != request {
		return nil // another request: the database answers (mismatch)
	}
	c.lru.MoveToFront(el)
	return e
}

// snapshot is the epoch to pass to put for an answer about to be asked for.
func (c *Cache) snapshot() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.epoch
}

// put stores e, unless it is too big, or a Remove came since epoch (the
// answer may be of a forgotten record), or its deadline has passed;
// deadline is capped at MaxAge from now.
func (c *Cache) put(e *entry, epoch uint64) {
	if e.size() > c.opts.MaxEntryBytes {
		return
	}
	now := c.now()
	if limit := now.Add(c.opts.MaxAge); e.deadline.After(limit) {
		e.deadline = limit
	}
	if !now.Before(e.deadline) {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.epoch != epoch {
		return
	}
	if el, ok := c.byKey[e.k]; ok {
		el.Value = e
		c.lru.MoveToFront(el)
		return
	}
	c.byKey[e.k] = c.lru.PushFront(e)
	for c.lru.Len() > c.opts.MaxEntries {
		last := c.lru.Back()
		c.lru.Remove(last)
		delete(c.byKey, last.Value.(*entry).k)
	}
}

// Remove drops (scope, key) from this cache only (Forget also forgets it
// in the database).
func (c *Cache) Remove(scope, key string) {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.epoch++
	if el, ok := c.byKey[cacheKey{scope, key}]; ok {
		c.lru.Remove(el)
		delete(c.byKey, cacheKey{scope, key})
	}
}

// Forget removes the record of (scope, key) with idempotency.idem_forget
// (the next request with the key runs the handler again) and the key's
// entry from this cache; c may be nil (no cache). It answers whether there
// was a record. The role needs EXECUTE on idem_forget. Other processes'
// caches (other hosts') may still answer the key until their entries'
// MaxAge passes. The scope is Scope(user, method, path).
func (c *Cache) Forget(ctx context.Context, pool *pgxpool.Pool, scope, key string) (bool, error) {
	c.Remove(scope, key)
	var found bool
	err := pool.QueryRow(ctx, `SELECT idempotency.idem_forget(key => $1, scope => $2)`, key, scope).Scan(&found)
	// an answer fetched while the forget ran is not put in (the epoch), and
	// one put in meanwhile goes now
	c.Remove(scope, key)
	return found, err
}

// Scope is the scope that the middleware gives a request of this user
// (ContextWithUser's; "" is "anonymous"), method and path: "user:<user>
// <METHOD> <path>", hashed (sha256:...) when longer than 255 bytes. For
// Forget, and for looking a key up in SQL.
func Scope(user, method, path string) string {
	if user == "" {
		user = "anonymous"
	}
	s := "user:" + user + " " + method + " " + path
	if len(s) > 255 {
		sum := sha256.Sum256([]byte(s))
		s = "sha256:" + hex.EncodeToString(sum[:])
	}
	return s
}

// LogMode says which duplicate answers (replay, in_progress, mismatch)
// write a log line: LogDuplicates.
type LogMode int

const (
	// LogSampled (the default): at most one line a second in the process;
	// the next line written after some were left out says how many.
	LogSampled LogMode = iota
	// LogAll: a line for every duplicate answer.
	LogAll
	// LogOff: none.
	LogOff
)

// ParseLogMode is the LogMode named "sampled", "all" or "off" (a flag's
// or an environment variable's value).
func ParseLogMode(s string) (LogMode, error) {
	switch s {
	case "sampled":
		return LogSampled, nil
	case "all":
		return LogAll, nil
	case "off":
		return LogOff, nil
	}
	return LogSampled, fmt.Errorf("idempotency: log mode %q is not sampled, all or off", s)
}

// LogDuplicates sets which duplicate answers are logged (default
// LogSampled).
func LogDuplicates(m LogMode) Option {
	return func(cfg *config) { cfg.logMode = m }
}

// sampler rate-limits the duplicate lines of the whole process (every
// middleware with LogSampled) to one a second.
type sampler struct {
	now    func() time.Time
	printf func(format string, v ...interface{})

	mu    sync.Mutex
	last  time.Time // when the last line was written
	left  int       // lines left out since
	since time.Time // the first of those
}

var dupSampler = &sampler{now: time.Now, printf: log.Printf}

// logPrint writes LogAll's lines (the standard logger's Print).
var logPrint = log.Print

// log writes the line that line() builds, at most once a second (the
// first of each second); line is called only for a line written, so that
// the duplicates left out cost no formatting.
func (s *sampler) log(line func() string) {
	s.mu.Lock()
	now := s.now()
	if !s.last.IsZero() && now.Sub(s.last) < time.Second && now.Sub(s.last) >= 0 {
		if s.left == 0 {
			s.since = now
		}
		s.left++
		s.mu.Unlock()
		return
	}
	text := line()
	if s.left > 0 {
		text += fmt.Sprintf(" (and %d more duplicate answers not logged since %s)",
			s.left, s.since.Format("15:04:05"))
		s.left = 0
	}
	s.last = now
	printf := s.printf
	s.mu.Unlock()
	printf("%s", text)
}
