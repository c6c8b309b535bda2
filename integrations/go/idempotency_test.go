package idempotency

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// These need no database: every answer checked here is given before the
// middleware opens its transaction (the pool is nil). The database side
// is the conformance test's (examples/run_tests.sh nethttp).

func serve(t *testing.T, h http.Handler, method, path, key, body string) *httptest.ResponseRecorder {
	t.Helper()
	r := httptest.NewRequest(method, path, strings.NewReader(body))
	if key != "" {
		r.Header.Set(HeaderKey, key)
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

func isProblem(t *testing.T, w *httptest.ResponseRecorder, status int, typ string) {
	t.Helper()
	if w.Code != status || w.Header().Get("Content-Type") != "application/problem+json" {
		t.Fatalf("want %d problem+json, got %d %q %s", status, w.Code, w.Header().Get("Content-Type"), w.Body)
	}
	var p map[string]interface{}
	if err := json.Unmarshal(w.Body.Bytes(), &p); err != nil {
		t.Fatalf("body not JSON: %s", w.Body)
	}
	if p["status"] != float64(status) || p["type"] != ProblemTypeBase+typ {
		t.Fatalf("want status %d type %s, got %v", status, typ, p)
	}
}

func TestRefusedBeforeTheHandler(t *testing.T) {
	ran := 0
	h := Middleware(nil)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { ran++ }))
	isProblem(t, serve(t, h, "POST", "/pay", "", `{}`), 400, "idempotency-key-missing")
	isProblem(t, serve(t, h, "POST", "/pay", strings.Repeat("k", 256), `{}`), 400, "idempotency-key-invalid")
	isProblem(t, serve(t, h, "POST", "/pay", "k1", `{not json`), 400, "body-not-json")
	if ran != 0 {
		t.Fatalf("the handler ran %d times", ran)
	}
}

func TestPassedThrough(t *testing.T) {
	ran := 0
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ran++
		if Key(r.Context()) != "" {
			t.Errorf("a claim for a request passed through")
		}
		if _, err := Tx(r.Context()); err == nil {
			t.Errorf("Tx without a claim did not fail")
		}
		w.WriteHeader(http.StatusTeapot)
	})
	h := Middleware(nil, SkipPaths("/hook"),
		Route(func(r *http.Request) string {
			if r.URL.Path == "/nowhere" {
				return ""
			}
			return r.URL.Path
		}))(next)
	for _, c := range []struct{ method, path string }{
		{"GET", "/pay"}, {"HEAD", "/pay"}, {"OPTIONS", "/pay"},
		{"POST", "/health"}, {"POST", "/metrics"}, {"POST", "/hook"}, {"POST", "/nowhere"},
	} {
		if w := serve(t, h, c.method, c.path, "", ""); w.Code != http.StatusTeapot {
			t.Errorf("%s %s: %d, not passed through", c.method, c.path, w.Code)
		}
	}
	if ran != 7 {
		t.Fatalf("the handler ran %d times, not 7", ran)
	}
}

func TestServeMuxRoute(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("/api/", func(w http.ResponseWriter, r *http.Request) {})
	cfg := &config{}
	ServeMuxRoute(mux)(cfg)
	if got := cfg.route(httptest.NewRequest("POST", "/api/x", nil)); got != "/api/" {
		t.Errorf("route of /api/x: %q", got)
	}
	if got := cfg.route(httptest.NewRequest("POST", "/other", nil)); got != "" {
		t.Errorf("route of an unrouted path: %q", got)
	}
}

func TestScope(t *testing.T) {
	cfg := &config{user: func(r *http.Request) string { return UserFromContext(r.Context()) }}
	r := httptest.NewRequest("POST", "/orders/7/pay", nil)
	if s := cfg.scope(r); s != "user:anonymous POST /orders/7/pay" {
		t.Errorf("anonymous scope: %q", s)
	}
	r = r.WithContext(ContextWithUser(r.Context(), "42"))
	if s := cfg.scope(r); s != "user:42 POST /orders/7/pay" {
		t.Errorf("scope: %q", s)
	}
	r = httptest.NewRequest("POST", "/"+strings.Repeat("p", 300), nil)
	if s := cfg.scope(r); !strings.HasPrefix(s, "sha256:") || len(s) != 7+64 {
		t.Errorf("long scope not hashed: %q", s)
	}
}

func TestSeconds(t *testing.T) {
	if seconds(0) != nil {
		t.Error("0 is not NULL")
	}
	if s := seconds(1500 * 1e6); s == nil || *s != 1.5 {
		t.Errorf("1.5s: %v", s)
	}
}
