package balancer

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"
)

func TestParseLoads(t *testing.T) {
	for _, c := range []struct {
		body string
		want int64
		ok   bool
	}{
		{`{"dp_rank_count":2,"loads":[{"dp_rank":0,"num_used_tokens":5,"num_total_tokens":7},{"dp_rank":1,"num_total_tokens":3}]}`, 10, true},
		{`{"loads":[{"dp_rank":0,"num_used_tokens":4}]}`, 4, true}, // before num_total_tokens
		{`{"loads":[]}`, 0, true},
		{`{"aggregate":{}}`, 0, false},
		{`[{"num_tokens":3}]`, 0, false},
		{`nope`, 0, false},
	} {
		got, err := parseLoads([]byte(c.body), -1)
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("parseLoads(%s) = %d, %v; want %d, ok %v", c.body, got, err, c.want, c.ok)
		}
	}
}

// An engine with /v1/loads is read there (include=core); one without it
// (404) falls back to /get_load, and is not asked /v1/loads again.
func TestFetchLoadPrefersV1Loads(t *testing.T) {
	var v1, legacy atomic.Int32
	engine := func(hasV1 bool) *httptest.Server {
		return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			switch r.URL.Path {
			case "/v1/loads":
				v1.Add(1)
				if !hasV1 {
					http.NotFound(w, r)
					return
				}
				if r.URL.Query().Get("include") != "core" {
					t.Errorf("include = %q", r.URL.Query().Get("include"))
				}
				w.Write([]byte(`{"loads":[{"dp_rank":0,"num_used_tokens":1,"num_total_tokens":11}]}`))
			case "/get_load":
				legacy.Add(1)
				w.Write([]byte(`[{"dp_rank":0,"num_reqs":1,"num_waiting_reqs":0,"num_tokens":22}]`))
			}
		}))
	}
	ctx := context.Background()
	newer, older := engine(true), engine(false)
	defer newer.Close()
	defer older.Close()

	w := NewWorker(newer.URL, Regular, NoBootstrapPort)
	if n, err := FetchLoad(ctx, newer.Client(), w, time.Second); err != nil || n != 11 {
		t.Fatalf("newer engine: %d, %v; want 11 from /v1/loads", n, err)
	}
	if legacy.Load() != 0 {
		t.Fatal("/get_load asked although /v1/loads answered")
	}
	v1.Store(0)
	w = NewWorker(older.URL, Regular, NoBootstrapPort)
	for range 3 {
		if n, err := FetchLoad(ctx, older.Client(), w, time.Second); err != nil || n != 22 {
			t.Fatalf("older engine: %d, %v; want 22 from /get_load", n, err)
		}
	}
	if v1.Load() != 1 || legacy.Load() != 3 {
		t.Fatalf("/v1/loads asked %d times, /get_load %d; want 1 and 3", v1.Load(), legacy.Load())
	}
}

func TestFetchLoadErrors(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "busy", http.StatusServiceUnavailable)
	}))
	defer srv.Close()
	w := NewWorker(srv.URL, Regular, NoBootstrapPort)
	if _, err := FetchLoad(context.Background(), srv.Client(), w, time.Second); err == nil {
		t.Fatal("a 503 from /v1/loads gave a load")
	}
	if w.st.legacyLoad.Load() {
		t.Fatal("a 503 was taken for an engine without /v1/loads")
	}
}
