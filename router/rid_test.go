package router

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// engineLog records what engines were sent, in order.
type engineLog struct {
	mu     sync.Mutex
	events []string // "generate <rid>" or "abort <rid>"
}

func (e *engineLog) add(kind string, body []byte) {
	var v struct {
		RID string `json:"rid"`
	}
	json.Unmarshal(body, &v)
	e.mu.Lock()
	defer e.mu.Unlock()
	e.events = append(e.events, kind+" "+v.RID)
}

func (e *engineLog) snapshot() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.events...)
}

// Issue 26, "all attempts of a request reuse one rid": SGLang's scheduler
// aborts every request whose rid starts with the one named, so the abort of
// a failed attempt could reach its retry. Each attempt now has its own rid
// (the client's as its prefix), and a failed attempt that reached an engine
// is aborted there before the retry is sent.
func TestRetryHasItsOwnRIDAndAbortsTheFailedAttemptFirst(t *testing.T) {
	var log engineLog
	var failed sync.Once
	engine := func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		switch r.URL.Path {
		case "/generate":
			log.add("generate", body)
			fail := false
			failed.Do(func() { fail = true })
			if fail { // the engine has the request, then the connection breaks
				conn, _, _ := w.(http.Hijacker).Hijack()
				conn.Close()
				return
			}
			io.WriteString(w, `{"text":"ok"}`)
		case "/abort_request":
			log.add("abort", body)
		default:
			io.WriteString(w, `{}`)
		}
	}
	a, b := httptest.NewServer(http.HandlerFunc(engine)), httptest.NewServer(http.HandlerFunc(engine))
	defer a.Close()
	defer b.Close()
	cfg := DefaultConfig()
	cfg.WorkerURLs = []string{a.URL, b.URL}
	cfg.Retry.InitialBackoff = time.Millisecond
	base, srv := serveInProcess(t, cfg)
	defer shutdown(t, srv)

	resp, err := http.Post(base+"/generate", "application/json", strings.NewReader(`{"text":"hi","rid":"client-7"}`))
	if err != nil {
		t.Fatal(err)
	}
	reply, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, reply)
	}
	ev := log.snapshot()
	if len(ev) != 3 || ev[0] != "generate client-7" || ev[1] != "abort client-7" ||
		!strings.HasPrefix(ev[2], "generate client-7-") {
		t.Fatalf("engines saw %q; want the first attempt as client-7, its abort, then the retry under a rid of its own prefixed client-7-", ev)
	}
}
