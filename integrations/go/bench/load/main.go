// Command load drives POST /api/payments of integrations/go/bench/app for
// integrations/go/bench/seed.sh: C keep-alive connections, each a
// goroutine sending one request after another for S seconds, and prints
// one JSON line (requests a second, p50 and p99 latency, answers by
// status, how many carried Idempotent-Replayed: true).
//
//	load -url URL -user U -phase new -prefix P     a new key every request
//	load -url URL -user U -phase replay -key K     K first made (not timed),
//	                                               then replayed
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"sort"
	"strings"
	"sync"
	"time"
)

func body(key string) string {
	return fmt.Sprintf(`{"order_id": "order-%s", "amount": 9900, "currency": "CNY", "source": "tok_visa"}`, key)
}

func main() {
	url := flag.String("url", "", "the app's base URL")
	user := flag.String("user", "1", "X-User-ID")
	phase := flag.String("phase", "new", "new or replay")
	prefix := flag.String("prefix", "k", "new: the keys' prefix")
	key := flag.String("key", "", "replay: the hot key")
	seconds := flag.Float64("seconds", 5, "how long")
	conns := flag.Int("conns", 10, "connections (one goroutine each)")
	flag.Parse()

	tr := &http.Transport{MaxIdleConns: *conns, MaxIdleConnsPerHost: *conns, MaxConnsPerHost: *conns,
		IdleConnTimeout: time.Minute}
	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	post := func(k string) (int, bool, error) {
		req, _ := http.NewRequest("POST", *url+"/api/payments", strings.NewReader(body(k)))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-User-ID", *user)
		req.Header.Set("Idempotency-Key", k)
		resp, err := client.Do(req)
		if err != nil {
			return 0, false, err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode, resp.Header.Get("Idempotent-Replayed") == "true", nil
	}
	if *phase == "replay" {
		if st, _, err := post(*key); err != nil || st != 201 {
			log.Fatalf("the hot key's first request: %d %v", st, err)
		}
	}

	type result struct {
		lat      []time.Duration
		statuses map[int]int
		replayed int
		errors   int
	}
	results := make([]result, *conns)
	deadline := time.Now().Add(time.Duration(*seconds * float64(time.Second)))
	start := time.Now()
	var wg sync.WaitGroup
	for g := 0; g < *conns; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			r := &results[g]
			r.statuses = map[int]int{}
			for i := 0; time.Now().Before(deadline); i++ {
				k := *key
				if *phase == "new" {
					k = fmt.Sprintf("%s-%d-%d", *prefix, g, i)
				}
				t0 := time.Now()
				st, replayed, err := post(k)
				if err != nil {
					r.errors++
					continue
				}
				r.lat = append(r.lat, time.Since(t0))
				r.statuses[st]++
				if replayed {
					r.replayed++
				}
			}
		}(g)
	}
	wg.Wait()
	elapsed := time.Since(start)

	var lat []time.Duration
	statuses := map[string]int{}
	replayed, errors := 0, 0
	for _, r := range results {
		lat = append(lat, r.lat...)
		for s, n := range r.statuses {
			statuses[fmt.Sprint(s)] += n
		}
		replayed += r.replayed
		errors += r.errors
	}
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	pct := func(p float64) float64 {
		if len(lat) == 0 {
			return 0
		}
		return float64(lat[int(p*float64(len(lat)-1))].Microseconds()) / 1000
	}
	out, _ := json.Marshal(map[string]interface{}{
		"phase": *phase, "requests": len(lat), "rps": float64(len(lat)) / elapsed.Seconds(),
		"p50_ms": pct(0.50), "p99_ms": pct(0.99), "statuses": statuses, "replayed": replayed, "errors": errors,
	})
	fmt.Println(string(out))
	if errors > 0 {
		os.Exit(1)
	}
}
