package idempotency

import (
	"crypto/sha256"
	"testing"
	"time"
)

// The replay cache's bounds, without a database.

func put(c *Cache, key string, left time.Duration) {
	c.put(&entry{k: cacheKey{"s", key}, request: sha256.Sum256([]byte("null")), status: 201,
		deadline: c.now().Add(left)}, c.snapshot())
}

func has(c *Cache, key string) bool {
	return c.get("s", key, sha256.Sum256([]byte("null"))) != nil
}

func TestCacheLeastRecentlyUsedGoesFirst(t *testing.T) {
	c := NewReplayCache(CacheOptions{MaxEntries: 2})
	put(c, "a", time.Hour)
	put(c, "b", time.Hour)
	if !has(c, "a") { // a is now the most recently used
		t.Fatal("a missing")
	}
	put(c, "c", time.Hour)
	if has(c, "b") || !has(c, "a") || !has(c, "c") || c.Len() != 2 {
		t.Errorf("maxEntries 2, three keys: b (the least recently used) should be the one gone; %d held", c.Len())
	}
	if c.get("s", "a", sha256.Sum256([]byte(`{}`))) != nil {
		t.Error("another request's bytes were answered")
	}
}

func TestCacheDeadlines(t *testing.T) {
	clock := &fakeClock{t: time.Now()}
	c := NewReplayCache(CacheOptions{MaxAge: time.Minute})
	c.now = clock.now
	put(c, "expires", 10*time.Second) // expires_at in 10 s
	put(c, "lives", time.Hour)        // capped at MaxAge
	put(c, "expired", 0)              // never put in
	if !has(c, "expires") || !has(c, "lives") || has(c, "expired") {
		t.Fatal("the live entries are not all there")
	}
	clock.add(10 * time.Second)
	if has(c, "expires") || !has(c, "lives") {
		t.Error("served past its expiry, or dropped before it")
	}
	clock.add(50 * time.Second)
	if has(c, "lives") || c.Len() != 0 {
		t.Error("served past MaxAge")
	}
	// an answer fetched before a Remove is not put in
	epoch := c.snapshot()
	c.Remove("s", "other")
	c.put(&entry{k: cacheKey{"s", "late"}, deadline: clock.now().Add(time.Hour)}, epoch)
	if c.Len() != 0 {
		t.Error("an answer fetched before a forget was cached")
	}
	if d := NewReplayCache(CacheOptions{}); d.opts.MaxEntries != 10000 || d.opts.MaxEntryBytes != 65536 || d.opts.MaxAge != time.Minute {
		t.Errorf("defaults: %+v", d.opts)
	}
}
