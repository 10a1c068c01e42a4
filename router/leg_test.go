package router

import (
	"cmp"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdrouter/pdrouter/balancer"
)

// legEnv is an in-process router over httptest workers, with its metrics
// at hand, for checking what each leg left behind.
type legEnv struct {
	base   string
	srv    *Server
	prom   *prometheus.Registry
	client *http.Client
}

func startLegEnv(t *testing.T, cfg Config) *legEnv {
	t.Helper()
	e := &legEnv{prom: prometheus.NewRegistry(), client: &http.Client{Transport: &http.Transport{}}}
	e.base, e.srv = serveInProcessOn(t, cfg, e.prom)
	// Ready needs one worker of a kind; a test's round robin needs them all.
	want := len(cfg.WorkerURLs) + len(cfg.Prefill) + len(cfg.Decode)
	waitFor(t, func() bool { return healthyWorkers(e.srv) == want })
	t.Cleanup(func() { // before the workers close, which waits for their handlers
		e.client.CloseIdleConnections()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := e.srv.Shutdown(ctx); err != nil {
			t.Error(err)
		}
	})
	return e
}

func healthyWorkers(s *Server) int {
	n := 0
	for _, ws := range s.manager.Snapshot().ByType {
		for _, w := range ws {
			if w.Healthy() {
				n++
			}
		}
	}
	return n
}

// legWorker is a worker whose POST replies the test writes; the GETs of
// registration get an empty object.
func legWorker(t *testing.T, post http.HandlerFunc) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			io.WriteString(w, "{}")
			return
		}
		io.Copy(io.Discard, r.Body)
		post(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

func answer(status int) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		io.WriteString(w, `{"text":"ok","meta_info":{}}`)
	}
}

// after answers with h once d has passed (for prefill to have answered).
func after(d time.Duration, h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(d)
		h(w, r)
	}
}

// hang never answers: it waits for the router to give up on it.
func hang(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }

// post sends body to /generate; ctx may cut the request short.
func (e *legEnv) post(t *testing.T, ctx context.Context, body string) (int, string, error) {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, "POST", e.base+"/generate", strings.NewReader(body))
	resp, err := e.client.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// settle waits until every leg has given its load slot back and every
// request has ended, its record emitted.
func (e *legEnv) settle(t *testing.T) {
	t.Helper()
	waitFor(t, func() bool {
		if e.srv.live.Load() != 0 {
			return false
		}
		for _, w := range e.srv.reg.Snapshot().All {
			if w.Load() != 0 {
				return false
			}
		}
		return true
	})
}

// metric sums the samples of a counter family whose labels include the
// given name/value pairs.
func (e *legEnv) metric(t *testing.T, name string, labels ...string) float64 {
	t.Helper()
	return gathered(t, e.prom, name, labels...)
}

// gathered sums the samples of a counter family, or the observations of a
// histogram family, on reg whose labels include the given name/value pairs.
func gathered(t *testing.T, reg prometheus.Gatherer, name string, labels ...string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	samples:
		for _, m := range f.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for i := 0; i+1 < len(labels); i += 2 {
				if have[labels[i]] != labels[i+1] {
					continue samples
				}
			}
			if h := m.GetHistogram(); h != nil {
				sum += float64(h.GetSampleCount())
			} else {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}

// outcomes are what url's breaker has been told.
func (e *legEnv) outcomes(t *testing.T, url string) (ok, failed float64) {
	t.Helper()
	return e.metric(t, "smg_worker_cb_outcomes_total", "worker", url, "outcome", "success"),
		e.metric(t, "smg_worker_cb_outcomes_total", "worker", url, "outcome", "failure")
}

func (e *legEnv) workerErrors(t *testing.T, labels ...string) float64 {
	t.Helper()
	return e.metric(t, "smg_worker_errors_total", labels...)
}

// legWant is what one worker's legs must have left: breaker outcomes and
// worker errors of the given type ("" for none).
type legWant struct {
	ok, failed float64
	errorType  string
}

func (e *legEnv) check(t *testing.T, url string, typ balancer.WorkerType, want legWant) {
	t.Helper()
	if ok, failed := e.outcomes(t, url); ok != want.ok || failed != want.failed {
		t.Errorf("%s breaker heard %v successes and %v failures, want %v and %v", typ, ok, failed, want.ok, want.failed)
	}
	all := e.workerErrors(t, "worker_type", typ.String())
	switch {
	case want.errorType == "" && all != 0:
		t.Errorf("%s: %v worker errors, want none", typ, all)
	case want.errorType != "" && (all != want.failed || e.workerErrors(t, "worker_type", typ.String(), "error_type", want.errorType) != all):
		t.Errorf("%s: %v worker errors, want %v of type %s", typ, all, want.failed, want.errorType)
	}
}

func legRegularConfig(urls ...string) Config {
	cfg := DefaultConfig()
	cfg.WorkerURLs = urls
	cfg.Retry.MaxRetries = 1
	return cfg
}

func legPDConfig(prefill, decode string) Config {
	cfg := DefaultConfig()
	cfg.PDDisaggregation = true
	cfg.Prefill = []PrefillSpec{{URL: prefill, BootstrapPort: 8998}}
	cfg.Decode = []string{decode}
	cfg.Retry.MaxRetries = 1
	return cfg
}

// sseThenHang sends one event, then waits for the router to hang up.
func sseThenHang(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/event-stream")
	io.WriteString(w, "data: {\"text\":\"a\"}\n\n")
	w.(http.Flusher).Flush()
	<-r.Context().Done()
}

// rawThenClose writes raw on the connection, then closes it: a worker
// that breaks off mid-reply.
func rawThenClose(raw string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		c, buf, err := w.(http.Hijacker).Hijack()
		if err != nil {
			panic(err)
		}
		buf.WriteString(raw)
		buf.Flush()
		c.Close()
	}
}

const sseHead = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"

var (
	// cutBody answers 200 with a Content-Length it does not keep.
	cutBody = rawThenClose("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"text\":")
	// sseThenClose sends one event, then closes without ending the chunked body.
	sseThenClose = rawThenClose(sseHead + "13\r\ndata: {\"text\":\"a\"}\n\n\r\n")
	// headThenClose sends a 200 stream head, then closes before the first event.
	headThenClose = rawThenClose(sseHead)
	// sseUnframed is a stream with no HTTP framing, whose end is the
	// connection's close: that end is clean only after [DONE].
	sseUnframed     = rawThenClose("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: {\"text\":\"a\"}\n\n")
	sseUnframedDone = rawThenClose("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: {\"text\":\"a\"}\n\ndata: [DONE]\n\n")
)

// legRequest is how a test request ends: its body, whether the client
// leaves, the router's request timeout and the status the client gets.
type legRequest struct {
	body    string
	cut     bool // the client goes away
	timeout time.Duration
	status  int
}

// run starts a router on cfg, sends the request and waits until its legs
// have ended.
func (c legRequest) run(t *testing.T, cfg Config) *legEnv {
	t.Helper()
	if c.timeout > 0 {
		cfg.RequestTimeout = c.timeout
	}
	e := startLegEnv(t, cfg)
	ctx := context.Background()
	if c.cut {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
	}
	status, body, err := e.post(t, ctx, cmp.Or(c.body, `{"text":"x"}`))
	if c.cut != (err != nil) || !c.cut && status != c.status {
		t.Fatalf("status %d %s, err %v", status, body, err)
	}
	e.settle(t)
	return e
}

// Every way a regular request ends leaves the worker's load at zero and
// its breaker and worker-error count told exactly once, or not at all
// when the worker is not why it ended.
func TestLegAccountingRegular(t *testing.T) {
	stream := `{"text":"x","stream":true}`
	for _, c := range []struct {
		name   string
		worker http.HandlerFunc
		req    legRequest
		want   legWant
	}{
		{"success", answer(200), legRequest{status: 200}, legWant{ok: 1}},
		{"upstream error", answer(500), legRequest{status: 500}, legWant{failed: 1, errorType: "status_500"}},
		{"client gone", hang, legRequest{cut: true}, legWant{}},
		{"timeout", hang, legRequest{timeout: 300 * time.Millisecond, status: 504}, legWant{failed: 1, errorType: "connect"}},
		{"stream cut by the client", sseThenHang, legRequest{body: stream, cut: true}, legWant{ok: 1}},
		{"body cut by the worker", cutBody, legRequest{status: 502}, legWant{failed: 1, errorType: "body"}},
		{"stream cut by the worker", sseThenClose, legRequest{body: stream, status: 200}, legWant{failed: 1, errorType: "body"}},
		{"stream cut before its first event", headThenClose, legRequest{body: stream, status: 502}, legWant{failed: 1, errorType: "body"}},
		{"unframed stream closed before [DONE]", sseUnframed, legRequest{body: stream, status: 200}, legWant{failed: 1, errorType: "body"}},
		{"unframed stream closed after [DONE]", sseUnframedDone, legRequest{body: stream, status: 200}, legWant{ok: 1}},
	} {
		t.Run(c.name, func(t *testing.T) {
			url := legWorker(t, c.worker)
			e := c.req.run(t, legRegularConfig(url))
			e.check(t, url, balancer.Regular, c.want)
		})
	}
}

func TestLegAccountingRetry(t *testing.T) {
	var failingHits atomic.Int32
	failing := legWorker(t, func(w http.ResponseWriter, r *http.Request) {
		failingHits.Add(1)
		answer(503)(w, r)
	})
	healthy := legWorker(t, answer(200))
	cfg := legRegularConfig(failing, healthy)
	cfg.Policy = "round_robin" // cache_aware could send both to the healthy worker
	cfg.Retry.MaxRetries, cfg.Retry.InitialBackoff = 2, time.Millisecond
	e := startLegEnv(t, cfg)
	for range 2 { // round robin: one of them starts on the failing worker
		if status, body, err := e.post(t, context.Background(), `{"text":"x"}`); err != nil || status != 200 {
			t.Fatalf("status %d %s, err %v", status, body, err)
		}
	}
	e.settle(t)
	hits := float64(failingHits.Load())
	if hits == 0 {
		t.Fatal("no request reached the failing worker")
	}
	if ok, failed := e.outcomes(t, failing); ok != 0 || failed != hits {
		t.Errorf("failing worker: %v successes, %v failures for %v replies of 503", ok, failed, hits)
	}
	if n := e.workerErrors(t, "error_type", "status_503"); n != hits {
		t.Errorf("%v status_503 worker errors for %v replies", n, hits)
	}
	if ok, failed := e.outcomes(t, healthy); ok != 2 || failed != 0 {
		t.Errorf("healthy worker: %v successes, %v failures, want 2 and 0", ok, failed)
	}
}

// One client request's retries tell a worker's breaker of its failure
// once, and go to a worker the request has not failed on.
func TestRetriesChargeEachWorkerOnce(t *testing.T) {
	var hits atomic.Int32
	lone := legWorker(t, func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		answer(503)(w, r)
	})
	cfg := legRegularConfig(lone)
	cfg.Retry.MaxRetries, cfg.Retry.InitialBackoff, cfg.Retry.MaxBackoff = 5, time.Millisecond, time.Millisecond
	cfg.Manager.Breaker.FailureThreshold = 2
	e := startLegEnv(t, cfg)
	if status, body, _ := e.post(t, context.Background(), `{"text":"x"}`); status != 503 {
		t.Fatalf("status %d %s, want the worker's 503", status, body)
	}
	e.settle(t)
	if hits.Load() != 5 {
		t.Fatalf("lone worker saw %d attempts, want 5 (it is still retried)", hits.Load())
	}
	if _, failed := e.outcomes(t, lone); failed != 1 {
		t.Errorf("breaker heard %v failures from one client request, want 1", failed)
	}

	// Two workers, one failing: the retry never goes back to it.
	var failingHits atomic.Int32
	failing := legWorker(t, func(w http.ResponseWriter, r *http.Request) {
		failingHits.Add(1)
		answer(503)(w, r)
	})
	healthy := legWorker(t, answer(200))
	cfg = legRegularConfig(failing, healthy)
	cfg.Policy = "random"
	cfg.Retry.MaxRetries, cfg.Retry.InitialBackoff = 3, time.Millisecond
	e = startLegEnv(t, cfg)
	// Both in service first: while only one is, a retry has nowhere else to go.
	waitFor(t, func() bool { return len(e.srv.reg.Snapshot().Available(balancer.Regular)) == 2 })
	for range 20 {
		before := failingHits.Load()
		if status, body, err := e.post(t, context.Background(), `{"text":"x"}`); err != nil || status != 200 {
			t.Fatalf("status %d %s, err %v", status, body, err)
		}
		if n := failingHits.Load() - before; n > 1 {
			t.Fatalf("one request went to the failing worker %d times", n)
		}
	}
}

// In PD mode a leg cancelled because the other failed is not blamed.
func TestLegAccountingPD(t *testing.T) {
	for _, c := range []struct {
		name            string
		prefill, decode http.HandlerFunc
		req             legRequest
		wantP, wantD    legWant
	}{
		{"success", answer(200), answer(200), legRequest{status: 200}, legWant{ok: 1}, legWant{ok: 1}},
		{"stream success", answer(200), answer(200), legRequest{body: `{"text":"x","stream":true}`, status: 200},
			legWant{ok: 1}, legWant{ok: 1}},
		{"prefill error cancels decode", answer(500), hang, legRequest{status: 500},
			legWant{failed: 1, errorType: "status_500"}, legWant{}},
		{"decode error", answer(200), after(100*time.Millisecond, answer(503)), legRequest{status: 503},
			legWant{ok: 1}, legWant{failed: 1, errorType: "status_503"}},
		{"prefill body cut", cutBody, hang, legRequest{status: 502},
			legWant{failed: 1, errorType: "body"}, legWant{}},
		{"decode body cut", answer(200), after(100*time.Millisecond, cutBody), legRequest{status: 502},
			legWant{ok: 1}, legWant{failed: 1, errorType: "body"}},
		// Decode's failure ends the attempt: prefill is cancelled, not left
		// to run until the request timeout.
		{"decode stream cut before its first event", hang, headThenClose,
			legRequest{body: `{"text":"x","stream":true}`, status: 502}, legWant{}, legWant{failed: 1, errorType: "body"}},
		// Or later: a prefill that never answered (its head is waited for
		// prefillHeadGrace) is cancelled once decode's stream has broken.
		{"decode stream cut after its first event", hang, sseThenClose,
			legRequest{body: `{"text":"x","stream":true}`, status: 200}, legWant{}, legWant{failed: 1, errorType: "body"}},
		{"client gone", hang, hang, legRequest{cut: true}, legWant{}, legWant{}},
		{"timeout", hang, hang, legRequest{timeout: 300 * time.Millisecond, status: 504},
			legWant{failed: 1, errorType: "connect"}, legWant{failed: 1, errorType: "connect"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			p, d := legWorker(t, c.prefill), legWorker(t, c.decode)
			e := c.req.run(t, legPDConfig(p, d))
			e.check(t, p, balancer.Prefill, c.wantP)
			e.check(t, d, balancer.Decode, c.wantD)
		})
	}
}

func TestLegClosesOnce(t *testing.T) {
	url := legWorker(t, answer(200))
	bm, err := balancer.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	s := &Server{upstream: newUpstream(DefaultConfig().UpstreamIdleTimeout), bm: bm}
	defer s.upstream.close()
	w := balancer.NewWorker(url, balancer.Regular, balancer.NoBootstrapPort)

	var l leg
	l.open(&request{s: s}, w, engineRID{})
	sc := &scope{}
	sc.cancel(errRequestTimeout) // a timeout is the worker's failure
	if err := l.send(sc, "/generate", bodyOf(nil), nil); err == nil {
		t.Fatal("send on an ended scope succeeded")
	}
	l.close()
	l.close()
	if fails, _ := w.Breaker.Counts(); fails != 1 || w.Load() != 0 {
		t.Errorf("closed twice: %d breaker failures, load %d; want 1 and 0", fails, w.Load())
	}

	l.open(&request{s: s}, w, engineRID{})
	sc = &scope{}
	sc.cancel(errClientGone) // not the worker's
	l.send(sc, "/generate", bodyOf(nil), nil)
	l.close()
	if fails, _ := w.Breaker.Counts(); fails != 1 || w.Load() != 0 {
		t.Errorf("a client gone: %d breaker failures, load %d; want 1 and 0", fails, w.Load())
	}
}

// A worker removed from the registry keeps no connection from the router:
// the idle ones close at once, one busy at the time once its reply is in.
func TestRemovedWorkerConnectionsAreClosed(t *testing.T) {
	release := make(chan struct{})
	var mu sync.Mutex
	posts := map[string]bool{} // client addresses of the router's connections
	srv, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			io.WriteString(w, "{}")
			return
		}
		mu.Lock()
		posts[r.RemoteAddr] = true
		mu.Unlock()
		if r.Header.Get("X-Correlation-Id") == "slow" {
			<-release
		} else {
			time.Sleep(20 * time.Millisecond) // overlap, so that several connections open
		}
		answer(200)(w, r)
	})
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	e := startLegEnv(t, legRegularConfig(srv.URL))
	routerConns := func() (open int) {
		mu.Lock()
		defer mu.Unlock()
		conns.mu.Lock()
		defer conns.mu.Unlock()
		for addr := range posts {
			if conns.open[addr] {
				open++
			}
		}
		return open
	}
	send := func(slow bool) (int, error) {
		req, _ := http.NewRequest("POST", e.base+"/generate", strings.NewReader(`{"text":"x"}`))
		if slow {
			req.Header.Set("X-Correlation-Id", "slow") // a header the router forwards
		}
		resp, err := e.client.Do(req)
		if err != nil {
			return 0, err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	slow := make(chan int, 1)
	go func() { status, _ := send(true); slow <- status }()
	var wg sync.WaitGroup
	for range 3 {
		wg.Go(func() {
			if status, err := send(false); err != nil || status != 200 {
				t.Errorf("status %d, err %v", status, err)
			}
		})
	}
	wg.Wait()
	if n := routerConns(); n < 2 {
		t.Fatalf("%d router connections open, want the busy one and idle ones", n)
	}

	if _, ok := e.srv.manager.Remove(srv.URL); !ok {
		t.Fatal("worker not removed")
	}
	waitFor(t, func() bool { return routerConns() == 1 }) // the busy one stays until its reply
	close(release)
	if status := <-slow; status != 200 {
		t.Fatalf("the request in flight at removal: status %d", status)
	}
	waitFor(t, func() bool { return routerConns() == 0 })
}
