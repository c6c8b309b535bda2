package idemgin

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/gin-gonic/gin"
)

// No database: these answers come before the middleware's transaction.

func TestGinAdapter(t *testing.T) {
	gin.SetMode(gin.ReleaseMode)
	ran := 0
	r := gin.New()
	r.Use(Middleware(nil))
	r.POST("/pay", func(c *gin.Context) { ran++; c.JSON(201, gin.H{}) })
	r.GET("/pay", func(c *gin.Context) {
		if Key(c) != "" {
			t.Errorf("a claim for a GET")
		}
		c.JSON(200, gin.H{"ok": true})
	})

	do := func(method, path, key string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(method, path, strings.NewReader(`{}`))
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		w := httptest.NewRecorder()
		r.ServeHTTP(w, req)
		return w
	}
	if w := do("POST", "/pay", ""); w.Code != 400 || w.Header().Get("Content-Type") != "application/problem+json" {
		t.Errorf("POST without a key: %d %q %s", w.Code, w.Header().Get("Content-Type"), w.Body)
	}
	if ran != 0 {
		t.Errorf("the handler ran without a key")
	}
	if w := do("GET", "/pay", ""); w.Code != 200 || w.Body.String() != `{"ok":true}` {
		t.Errorf("GET not passed through: %d %s", w.Code, w.Body)
	}
	// unrouted: Gin's own 404, not claimed (no key needed)
	if w := do("POST", "/nowhere", ""); w.Code != http.StatusNotFound {
		t.Errorf("unrouted POST: %d %s", w.Code, w.Body)
	}
}
