package router

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/pdrouter/pdrouter/mock/mockworker"
)

// Issue 13's router-side hardening: stream retries, stream idle timeout,
// a client that stops reading, secrets in logs, body copies, idle upstream
// sockets.

// leakCheck verifies no goroutine outlives the test but fasthttp's own.
func leakCheck(t *testing.T) {
	t.Helper()
	goleak.VerifyNone(t,
		goleak.IgnoreCurrent(),
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.updateServerDate.func1"),
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*workerPool).Start.func2"))
}

// startMock starts a mock worker the test closes.
func startMock(t *testing.T, cfg mockworker.Config) *mockworker.Server {
	t.Helper()
	w, err := mockworker.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	return w
}

// pdPair is a PD config over one prefill and one decode mock.
func pdPair(p, d *mockworker.Server) Config {
	cfg := DefaultConfig()
	cfg.PDDisaggregation = true
	cfg.Prefill = []PrefillSpec{{URL: p.URL(), BootstrapPort: 8998}}
	cfg.Decode = []string{d.URL()}
	return cfg
}

func shutdown(t *testing.T, srv *Server) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(ctx); err != nil {
		t.Error(err)
	}
}

func postStream(t *testing.T, url, body string) (int, string) {
	t.Helper()
	return postStreamVia(t, http.DefaultClient, url, body)
}

// postStreamVia posts body to url with c and reads the whole reply.
func postStreamVia(t *testing.T, c *http.Client, url, body string) (int, string) {
	t.Helper()
	resp, err := c.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// Row 10: decode streams at once (for 400 ms) while prefill fails 50 ms
// in with a retryable 500. Nothing may reach the client before prefill has
// answered, so the stream is retried as a non-stream would be, and the
// client sees one clean stream (before: a token, then prefill's error event).
func TestStreamRetriedWhenPrefillFailsAfterDecodeAnswered(t *testing.T) {
	defer leakCheck(t)
	p := startMock(t, mockworker.Config{Role: mockworker.RolePrefill, PrefillDelay: 50 * time.Millisecond, FailFirstN: 1})
	d := startMock(t, mockworker.Config{Role: mockworker.RoleDecode, Tokens: 20, TokenDelay: 20 * time.Millisecond})
	cfg := pdPair(p, d)
	cfg.Retry.MaxRetries = 3
	base, srv := serveInProcess(t, cfg)
	defer shutdown(t, srv)

	status, body := postStream(t, base+"/generate", `{"text":"a b","stream":true}`)
	if status != 200 || strings.Contains(body, `"error"`) || !strings.HasSuffix(strings.TrimSpace(body), "data: [DONE]") {
		t.Fatalf("status %d, body %q: want one clean stream", status, body)
	}
	if got := p.Stats().Requests; got != 2 {
		t.Fatalf("prefill saw %d requests, want 2 (the failure, then the retry)", got)
	}
	http.DefaultClient.CloseIdleConnections()
}

// Deliver 2: a stream whose decode goes silent after its first token ends
// at --stream-idle-timeout-secs with one SSE error event, not at the
// request timeout; the decode leg is closed, its engine told to abort, and
// the worker's breaker hears of it.
func TestStreamIdleTimeoutEndsASilentStream(t *testing.T) {
	defer leakCheck(t)
	p := startMock(t, mockworker.Config{Role: mockworker.RolePrefill})
	d := startMock(t, mockworker.Config{Role: mockworker.RoleDecode, Tokens: 3, TokenDelay: 10 * time.Second})
	cfg := pdPair(p, d)
	cfg.StreamIdleTimeout = 300 * time.Millisecond
	base, srv := serveInProcess(t, cfg)
	defer shutdown(t, srv)

	start := time.Now()
	status, body := postStream(t, base+"/generate", `{"text":"a b","stream":true}`)
	took := time.Since(start)
	events := sseEvents(body)
	if status != 200 || len(events) != 2 || !strings.Contains(events[0], `"text"`) ||
		!strings.Contains(events[1], `"code":"stream_idle_timeout"`) {
		t.Fatalf("status %d, events %q: want a token, then one stream_idle_timeout event", status, events)
	}
	if took < 300*time.Millisecond || took > 3*time.Second {
		t.Fatalf("stream ended after %v, want about the 300 ms idle timeout", took)
	}
	waitFor(t, func() bool { return d.Stats().InFlight == 0 && len(d.Aborts()) == 1 })
	var sent struct {
		RID string `json:"rid"`
	}
	if err := json.Unmarshal([]byte(d.Requests()[0].Body), &sent); err != nil || d.Aborts()[0].RID != sent.RID {
		t.Fatalf("abort of %q, want the request's rid %q (%v)", d.Aborts()[0].RID, sent.RID, err)
	}
	http.DefaultClient.CloseIdleConnections()
}

// sseEvents splits an SSE body into its events.
func sseEvents(body string) []string {
	var out []string
	for _, e := range strings.Split(strings.TrimSpace(body), "\n\n") {
		if e != "" {
			out = append(out, e)
		}
	}
	return out
}

// The idle timeout's read deadline does not outlive its stream: the
// connection goes back to the pool clean and serves the next request.
func TestStreamIdleDeadlineClearedForTheNextRequest(t *testing.T) {
	defer leakCheck(t)
	w := startMock(t, mockworker.Config{Tokens: 3, TokenDelay: 20 * time.Millisecond})
	cfg := DefaultConfig()
	cfg.WorkerURLs = []string{w.URL()}
	cfg.StreamIdleTimeout = 200 * time.Millisecond
	base, srv := serveInProcess(t, cfg)
	defer shutdown(t, srv)

	if status, body := postStream(t, base+"/generate", `{"text":"a","stream":true}`); status != 200 || strings.Contains(body, "error") {
		t.Fatalf("stream: %d %q", status, body)
	}
	time.Sleep(400 * time.Millisecond) // past the stream's deadline, within the pool's idle timeout
	if status, body := postStream(t, base+"/generate", `{"text":"a"}`); status != 200 {
		t.Fatalf("next request on the pooled connection: %d %q", status, body)
	}
	if n := w.Stats().Requests; n != 2 {
		t.Fatalf("worker saw %d requests, want 2", n)
	}
	http.DefaultClient.CloseIdleConnections()
}

// Row 6: a client that stops reading a stream holds it only until the
// write deadline (--request-timeout-secs + writeGrace): the
// router's blocked write fails, the stream is closed and its upstream leg
// with it, while the client still holds its socket open.
func TestClientThatStopsReadingReleasesItsStream(t *testing.T) {
	defer leakCheck(t)
	var active atomic.Int32
	chunk := "data: " + strings.Repeat("x", 64<<10) + "\n\n"
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		active.Add(1)
		defer active.Add(-1)
		w.Header().Set("Content-Type", "text/event-stream")
		for { // as fast as the router takes it, until it closes the connection
			if _, err := io.WriteString(w, chunk); err != nil {
				return
			}
			w.(http.Flusher).Flush()
		}
	}))
	defer upstream.Close()
	cfg := DefaultConfig()
	cfg.WorkerURLs = []string{upstream.URL}
	cfg.RequestTimeout = time.Second
	base, srv := serveInProcess(t, cfg)
	defer shutdown(t, srv)

	c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.(*net.TCPConn).SetReadBuffer(4 << 10); err != nil {
		t.Fatal(err)
	}
	body := `{"text":"x","stream":true}`
	start := time.Now() // before the request, which the timeout counts from
	if _, err := io.WriteString(c, "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "+
		strconv.Itoa(len(body))+"\r\n\r\n"+body); err != nil {
		t.Fatal(err)
	}
	// The client reads nothing from here on.
	waitFor(t, func() bool { return active.Load() == 1 })
	deadline := start.Add(cfg.RequestTimeout + writeGrace + 5*time.Second)
	for active.Load() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("upstream leg still open %v after the request started (request timeout %v)", time.Since(start), cfg.RequestTimeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if took := time.Since(start); took < cfg.RequestTimeout {
		t.Fatalf("upstream leg closed after %v, before the request timeout", took)
	}
	waitFor(t, func() bool {
		srv.inflight.mu.Lock()
		defer srv.inflight.mu.Unlock()
		return srv.inflight.emptyLocked()
	})
}
