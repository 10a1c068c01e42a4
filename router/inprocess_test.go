package router

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/mock/mockworker"
)

// inProcess runs a PD router and its mock workers inside the test, so
// goroutine leaks can be checked after a mix of finished, failed and
// abandoned requests.
func inProcess(t *testing.T, prefill, decode mockworker.Config) (string, *Server, *mockworker.Server, *mockworker.Server) {
	t.Helper()
	prefill.Role, decode.Role = mockworker.RolePrefill, mockworker.RoleDecode
	p, err := mockworker.Start(prefill)
	if err != nil {
		t.Fatal(err)
	}
	d, err := mockworker.Start(decode)
	if err != nil {
		t.Fatal(err)
	}
	cfg := DefaultConfig()
	cfg.PDDisaggregation = true
	cfg.Prefill = []PrefillSpec{{URL: p.URL(), BootstrapPort: 8998}}
	cfg.Decode = []string{d.URL()}
	cfg.Retry.MaxRetries = 1
	base, srv := serveInProcess(t, cfg)
	return base, srv, p, d
}

// serveInProcess starts a router with cfg (round robin, no health checks)
// on a loopback port and waits until its workers are registered.
func serveInProcess(t testing.TB, cfg Config) (string, *Server) {
	t.Helper()
	return serveInProcessOn(t, cfg, prometheus.NewRegistry())
}

// serveInProcessOn is serveInProcess with the router's metrics on promReg.
func serveInProcessOn(t testing.TB, cfg Config, promReg prometheus.Registerer) (string, *Server) {
	t.Helper()
	return serveInProcessThrough(t, cfg, promReg, nil)
}

// serveInProcessThrough is serveInProcessOn serving its port through
// wrap(listener) (nil: the listener itself).
func serveInProcessThrough(t testing.TB, cfg Config, promReg prometheus.Registerer, wrap func(net.Listener) net.Listener) (string, *Server) {
	t.Helper()
	cfg.Policy = "round_robin"
	cfg.Manager.Health.Disabled = true
	srv, err := New(cfg, zap.NewNop(), promReg)
	if err != nil {
		t.Fatal(err)
	}
	base := serveOnLoopbackThrough(t, srv, wrap)
	waitFor(t, srv.manager.Ready)
	return base, srv
}

// serveOnLoopback starts srv on a free loopback port and returns its URL;
// the caller shuts it down.
func serveOnLoopback(t testing.TB, srv *Server) string {
	t.Helper()
	return serveOnLoopbackThrough(t, srv, nil)
}

func serveOnLoopbackThrough(t testing.TB, srv *Server, wrap func(net.Listener) net.Listener) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	served := ln
	if wrap != nil {
		served = wrap(ln)
	}
	go srv.Serve(served) //nolint:errcheck // ends at Shutdown
	return "http://" + ln.Addr().String()
}

func TestNoGoroutineLeaks(t *testing.T) {
	// fasthttp keeps a process-wide date updater, and its worker pool's
	// cleaner finishes its sleep after Shutdown: neither is ours.
	defer goleak.VerifyNone(t,
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.updateServerDate.func1"),
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*workerPool).Start.func2"))
	base, srv, p, d := inProcess(t, mockworker.Config{}, mockworker.Config{Tokens: 50, TokenDelay: 10 * time.Millisecond})
	tr := &http.Transport{}
	c := &http.Client{Transport: tr}
	do := func(ctx context.Context, path, body string) (*http.Response, error) {
		req, _ := http.NewRequestWithContext(ctx, "POST", base+path, strings.NewReader(body))
		return c.Do(req)
	}

	// A finished non-streaming request and a finished stream.
	for _, body := range []string{`{"text":"a b c","return_logprob":true}`, `{"text":"a","stream":true,"sampling_params":{"max_new_tokens":3}}`} {
		resp, err := do(context.Background(), "/generate", body)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, b)
		}
	}
	// A stream abandoned after its first chunk.
	resp, err := do(context.Background(), "/v1/completions", `{"model":"mock","prompt":"x","stream":true}`)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	// A request abandoned before the first byte.
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	if _, err := do(ctx, "/generate", `{"text":"slow","sampling_params":{"max_new_tokens":50}}`); err == nil {
		t.Error("request should have timed out")
	}
	cancel()
	// Bad input.
	if resp, err := do(context.Background(), "/generate", `{"text":`); err != nil || resp.StatusCode != 400 {
		t.Errorf("bad JSON: %v %v", err, resp)
	} else {
		resp.Body.Close()
	}
	waitFor(t, func() bool { return d.Stats().InFlight == 0 && p.Stats().InFlight == 0 })
	tr.CloseIdleConnections()
	shutdown, stop := context.WithTimeout(context.Background(), 10*time.Second)
	defer stop()
	if err := srv.Shutdown(shutdown); err != nil {
		t.Fatal(err)
	}
	for _, s := range srv.reg.Snapshot().All {
		if s.Load() != 0 {
			t.Errorf("%s %s: load %d after all requests ended", s.Type, s.URL, s.Load())
		}
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
}

func waitFor(t testing.TB, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// tcpPair connects a client to ln and returns both ends.
func tcpPair(t testing.TB, ln net.Listener) (client, server net.Conn) {
	t.Helper()
	client, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server, err = ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	return client, server
}

func TestRequestTimeoutEndsAStreamWithOneErrorEvent(t *testing.T) {
	p, err := mockworker.Start(mockworker.Config{Tokens: 100, TokenDelay: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	cfg := DefaultConfig()
	cfg.WorkerURLs = []string{p.URL()}
	cfg.RequestTimeout = 300 * time.Millisecond
	base, srv := serveInProcess(t, cfg)
	defer srv.Shutdown(context.Background())
	// 100 tokens at 20 ms outlast the 300 ms request timeout.
	resp, err := http.Post(base+"/generate", "application/json",
		strings.NewReader(`{"text":"x","stream":true,"sampling_params":{"max_new_tokens":100}}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	events := strings.Split(strings.TrimSpace(string(body)), "\n\n")
	last := events[len(events)-1]
	if len(events) < 3 || !strings.Contains(last, `"code":"request_timeout"`) || !strings.HasPrefix(last, "data: {") {
		t.Fatalf("want tokens then one request_timeout event, got %d events, last %q", len(events), last)
	}
	// The worker's stream was cut, not run to its end.
	waitFor(t, func() bool { st := p.Stats(); return st.InFlight == 0 && st.Completed == 0 })
}
