package router

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/mock/mockworker"
	"github.com/pdrouter/pdrouter/router/splice"
)

// h2cPD runs a PD router with --upstream-http2 over a prefill and a decode
// mockworker serving h2c.
func h2cPD(t *testing.T, prefill, decode mockworker.Config) (string, *Server, *mockworker.Server, *mockworker.Server) {
	t.Helper()
	return h2cPDWith(t, prefill, decode, nil)
}

// h2cPDWith is h2cPD with the router's configuration changed by set (nil:
// none).
func h2cPDWith(t *testing.T, prefill, decode mockworker.Config, set func(*Config)) (string, *Server, *mockworker.Server, *mockworker.Server) {
	t.Helper()
	prefill.Role, decode.Role = mockworker.RolePrefill, mockworker.RoleDecode
	prefill.HTTP2, decode.HTTP2 = true, true
	p, err := mockworker.Start(prefill)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	d, err := mockworker.Start(decode)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	cfg := DefaultConfig()
	cfg.PDDisaggregation = true
	cfg.Prefill = []PrefillSpec{{URL: p.URL(), BootstrapPort: 8998}}
	cfg.Decode = []string{d.URL()}
	cfg.Manager.UpstreamHTTP2 = true
	if set != nil {
		set(&cfg)
	}
	base, srv := serveInProcess(t, cfg)
	t.Cleanup(func() { srv.Shutdown(context.Background()) })
	return base, srv, p, d
}

// streamTokens posts a /generate stream for n tokens and returns its SSE
// data payloads.
func streamTokens(ctx context.Context, base string, n int) ([]string, error) {
	body := fmt.Sprintf(`{"text":"a b c","stream":true,"sampling_params":{"max_new_tokens":%d}}`, n)
	req, _ := http.NewRequestWithContext(ctx, "POST", base+"/generate", strings.NewReader(body))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		return nil, fmt.Errorf("status %d: %s", resp.StatusCode, b)
	}
	var events []string
	for _, line := range strings.Split(string(b), "\n") {
		if d, ok := strings.CutPrefix(line, "data: "); ok {
			events = append(events, d)
		}
	}
	return events, err
}

func TestH2CStreamsMultiplexOnFewConnections(t *testing.T) {
	defer goleak.VerifyNone(t,
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.updateServerDate.func1"),
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*workerPool).Start.func2"),
		goleak.IgnoreCurrent())
	base, srv, p, d := h2cPD(t, mockworker.Config{}, mockworker.Config{TokenDelay: 5 * time.Millisecond})
	for _, w := range srv.reg.Snapshot().All {
		if !w.HTTP2 {
			t.Fatalf("%s %s: enable_http2 in /server_info, yet not h2c", w.Type, w.URL)
		}
	}
	const streams, tokens = 40, 10
	var wg sync.WaitGroup
	errs := make(chan error, streams)
	for range streams {
		wg.Go(func() {
			events, err := streamTokens(context.Background(), base, tokens)
			if err == nil && (len(events) != tokens+1 || events[tokens] != "[DONE]") {
				err = fmt.Errorf("%d events, last %q", len(events), events[len(events)-1])
			}
			if err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for name, w := range map[string]*mockworker.Server{"prefill": p, "decode": d} {
		conns := map[string]bool{}
		for _, r := range w.Requests() {
			if r.Proto != "HTTP/2.0" {
				t.Errorf("%s got %s", name, r.Proto)
			}
			conns[r.Remote] = true
		}
		// Streams share connections; a few may open while the first dials.
		t.Logf("%s: %d requests over %d connections", name, len(w.Requests()), len(conns))
		if len(conns) > 4 {
			t.Errorf("%s: %d requests over %d connections", name, len(w.Requests()), len(conns))
		}
	}
	http.DefaultClient.CloseIdleConnections()
	srv.Shutdown(context.Background())
	p.Close()
	d.Close()
}

func TestH2COnlyWhereTheWorkerAndTheFlagSayIt(t *testing.T) {
	h2, err := mockworker.Start(mockworker.Config{HTTP2: true})
	if err != nil {
		t.Fatal(err)
	}
	defer h2.Close()
	h1, err := mockworker.Start(mockworker.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer h1.Close()
	for _, flag := range []bool{false, true} {
		cfg := DefaultConfig()
		cfg.WorkerURLs = []string{h2.URL(), h1.URL()}
		cfg.Manager.UpstreamHTTP2 = flag
		base, srv := serveInProcess(t, cfg)
		// Ready is the first worker registered; round robin needs both.
		waitFor(t, func() bool { return len(srv.reg.Snapshot().Available(balancer.Regular)) == 2 })
		h1.Reset()
		h2.Reset()
		for range 4 { // round robin: both get some
			if _, err := streamTokens(context.Background(), base, 2); err != nil {
				t.Fatal(err)
			}
		}
		srv.Shutdown(context.Background())
		want := map[*mockworker.Server]string{h1: "HTTP/1.1", h2: "HTTP/1.1"}
		if flag {
			want[h2] = "HTTP/2.0"
		}
		for w, proto := range want {
			rs := w.Requests()
			if len(rs) == 0 {
				t.Fatalf("--upstream-http2=%v: %s got %d requests", flag, w.URL(), len(rs))
			}
			for _, r := range rs {
				if r.Proto != proto {
					t.Errorf("--upstream-http2=%v: %s got %s, want %s", flag, w.URL(), r.Proto, proto)
				}
			}
		}
	}
}

func TestH2CCancelResetsThatStreamOnly(t *testing.T) {
	base, _, p, d := h2cPD(t, mockworker.Config{}, mockworker.Config{Tokens: 1000, TokenDelay: 10 * time.Millisecond})
	const others, tokens = 4, 30
	var wg sync.WaitGroup
	errs := make(chan error, others)
	for range others {
		wg.Go(func() {
			events, err := streamTokens(context.Background(), base, tokens)
			if err == nil && len(events) != tokens+1 {
				err = fmt.Errorf("%d events", len(events))
			}
			if err != nil {
				errs <- err
			}
		})
	}
	// The one cancelled leaves after its first event.
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", base+"/generate",
		strings.NewReader(`{"text":"x","stream":true,"sampling_params":{"max_new_tokens":1000}}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	cancel()
	resp.Body.Close()
	// The engine hears of it while the others still stream.
	waitFor(t, func() bool { return d.Stats().ClientGone == 1 })
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if st := d.Stats(); st.Completed != others || st.ClientGone != 1 {
		t.Errorf("decode: %+v; want %d completed, 1 client gone", st, others)
	}
	conns := map[string]bool{}
	for _, r := range d.Requests() {
		conns[r.Remote] = true
	}
	if len(conns) != 1 {
		t.Errorf("decode saw %d connections: a reset stream must leave its connection up", len(conns))
	}
	if st := p.Stats(); st.Errors != 0 {
		t.Errorf("prefill: %+v", st)
	}
}

// fatStreamWorker is an h2c engine whose /generate streams as many events
// of size bytes as its X-Correlation-Id says, pause apart, as fast as flow
// control lets it, noting what each stream wrote and whether its client
// went away. drop closes its TCP connections under it.
type fatStreamWorker struct {
	url     string
	mu      sync.Mutex
	remotes map[string]bool
	written []*atomic.Int64
	gone    atomic.Int32
	conns   []net.Conn
}

// trackingListener remembers the connections it accepts.
type trackingListener struct {
	net.Listener
	w *fatStreamWorker
}

func (l trackingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.w.mu.Lock()
		l.w.conns = append(l.w.conns, c)
		l.w.mu.Unlock()
	}
	return c, err
}

func (w *fatStreamWorker) drop() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, c := range w.conns {
		c.Close()
	}
}

func startFatStreamWorker(t *testing.T, size int, pause time.Duration) *fatStreamWorker {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	w := &fatStreamWorker{url: "http://" + ln.Addr().String(), remotes: map[string]bool{}}
	event := []byte("data: {\"text\":\"" + strings.Repeat("x", size) + "\"}\n\n")
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("GET /server_info", func(rw http.ResponseWriter, _ *http.Request) {
		io.WriteString(rw, `{"served_model_name":"m","enable_http2":true}`)
	})
	mux.HandleFunc("POST /generate", func(rw http.ResponseWriter, r *http.Request) {
		var n int
		fmt.Sscanf(r.Header.Get("X-Correlation-Id"), "%d", &n)
		written := new(atomic.Int64)
		w.mu.Lock()
		w.remotes[r.RemoteAddr] = true
		w.written = append(w.written, written)
		w.mu.Unlock()
		rw.Header().Set("Content-Type", "text/event-stream")
		for range n {
			if _, err := rw.Write(event); err != nil {
				w.gone.Add(1)
				return
			}
			rw.(http.Flusher).Flush()
			written.Add(int64(len(event)))
			time.Sleep(pause)
		}
		io.WriteString(rw, "data: [DONE]\n\n")
	})
	var p http.Protocols
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	srv := &http.Server{Handler: mux, Protocols: &p}
	go srv.Serve(trackingListener{ln, w})
	t.Cleanup(func() { srv.Close() })
	return w
}

// fatConfig routes to w: in regular mode alone, in PD mode as the decode
// worker beside an h2c mock prefill (PD streams are relayed on their
// hijacked client connections, streamconn.go).
func fatConfig(t *testing.T, w *fatStreamWorker, pd bool) Config {
	cfg := DefaultConfig()
	cfg.Manager.UpstreamHTTP2 = true
	if !pd {
		cfg.WorkerURLs = []string{w.url}
		return cfg
	}
	p, err := mockworker.Start(mockworker.Config{Role: mockworker.RolePrefill, HTTP2: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	cfg.PDDisaggregation = true
	cfg.Prefill = []PrefillSpec{{URL: p.URL(), BootstrapPort: 8998}}
	cfg.Decode = []string{w.url}
	return cfg
}

func TestH2CSlowClientDoesNotStallTheOthers(t *testing.T) {
	for _, pd := range []bool{false, true} {
		t.Run(map[bool]string{false: "regular", true: "pd"}[pd], func(t *testing.T) { testSlowClient(t, pd) })
	}
}

func testSlowClient(t *testing.T, pd bool) {
	w := startFatStreamWorker(t, 16<<10, 0)
	base, srv := serveInProcess(t, fatConfig(t, w, pd))
	defer srv.Shutdown(context.Background())

	// The slow client asks for 64 MiB and reads none of it.
	slow, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	slow.(*net.TCPConn).SetReadBuffer(4 << 10)
	body := `{"text":"x","stream":true}`
	fmt.Fprintf(slow, "POST /generate HTTP/1.1\r\nHost: r\r\nX-Correlation-Id: 4096\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	waitFor(t, func() bool { w.mu.Lock(); defer w.mu.Unlock(); return len(w.written) == 1 })

	// Fast clients on the same engine connection get 8 MiB each meanwhile.
	var wg sync.WaitGroup
	for range 3 {
		wg.Go(func() {
			req, _ := http.NewRequest("POST", base+"/generate", strings.NewReader(body))
			req.Header.Set("X-Correlation-Id", "512")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			defer resp.Body.Close()
			n, _ := io.Copy(io.Discard, resp.Body)
			if n < 512*(16<<10) {
				t.Errorf("fast client got %d bytes", n)
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("fast streams stalled behind a slow one")
	}
	w.mu.Lock()
	remotes, slowWritten := len(w.remotes), w.written[0].Load()
	w.mu.Unlock()
	if remotes != 1 {
		t.Errorf("%d engine connections; the test needs the streams on one", remotes)
	}
	// The slow stream was held back by flow control, not buffered whole.
	if slowWritten >= 64<<20 {
		t.Errorf("slow stream wrote %d bytes: no backpressure", slowWritten)
	}
	// Its client leaving resets its stream: the engine's write fails.
	slow.Close()
	waitFor(t, func() bool { return w.gone.Load() == 1 })
}

func TestH2CWorkerDroppingItsConnectionEndsEachStreamWithAnError(t *testing.T) {
	for _, pd := range []bool{false, true} {
		t.Run(map[bool]string{false: "regular", true: "pd"}[pd], func(t *testing.T) { testWorkerDrop(t, pd) })
	}
}

func testWorkerDrop(t *testing.T, pd bool) {
	w := startFatStreamWorker(t, 10, 10*time.Millisecond)
	base, srv := serveInProcess(t, fatConfig(t, w, pd))
	defer srv.Shutdown(context.Background())
	code := map[bool]string{false: "regular_stream_error", true: "decode_stream_error"}[pd]
	const streams = 3
	bodies := make([]string, streams)
	var wg, started sync.WaitGroup
	started.Add(streams)
	for i := range streams {
		wg.Go(func() {
			req, _ := http.NewRequest("POST", base+"/generate", strings.NewReader(`{"text":"x","stream":true}`))
			req.Header.Set("X-Correlation-Id", "100000")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				started.Done()
				t.Error(err)
				return
			}
			defer resp.Body.Close()
			br := bufio.NewReader(resp.Body)
			first, _ := br.ReadString('\n')
			started.Done()
			rest, err := io.ReadAll(br)
			if err != nil {
				t.Errorf("stream %d: the router cut the client's stream instead of ending it: %v", i, err)
			}
			bodies[i] = first + string(rest)
		})
	}
	started.Wait()
	w.drop()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("streams hang after their worker dropped the connection")
	}
	for i, b := range bodies {
		events := strings.Split(strings.TrimSpace(b), "\n\n")
		last := events[len(events)-1]
		if len(events) < 2 || !strings.HasPrefix(last, `data: {"error":`) || !strings.Contains(last, code) {
			t.Errorf("stream %d: want events then one %s event, got %d events, last %q", i, code, len(events), last)
		}
	}
	waitFor(t, func() bool {
		for _, wk := range srv.reg.Snapshot().All {
			if wk.Load() != 0 {
				return false
			}
		}
		return true
	})
}

func TestH2CIdleStreamEndsWithOneErrorEventAndResetsTheStream(t *testing.T) {
	w := startFatStreamWorker(t, 10, 2*time.Second)
	cfg := DefaultConfig()
	cfg.WorkerURLs = []string{w.url}
	cfg.Manager.UpstreamHTTP2 = true
	cfg.StreamIdleTimeout = 200 * time.Millisecond
	base, srv := serveInProcess(t, cfg)
	defer srv.Shutdown(context.Background())
	req, _ := http.NewRequest("POST", base+"/generate", strings.NewReader(`{"text":"x","stream":true}`))
	req.Header.Set("X-Correlation-Id", "5")
	start := time.Now()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	events := strings.Split(strings.TrimSpace(string(b)), "\n\n")
	if len(events) != 2 || !strings.Contains(events[1], `"code":"stream_idle_timeout"`) {
		t.Fatalf("want one event then stream_idle_timeout, got %q", b)
	}
	if d := time.Since(start); d > 1500*time.Millisecond {
		t.Errorf("idle stream ended after %v", d)
	}
	waitFor(t, func() bool { return w.gone.Load() == 1 }) // its stream was reset
}

// A body larger than HTTP/2's initial 64 KiB window is sent under flow
// control, whole, to both legs.
func TestH2CLargeBodyReachesBothLegs(t *testing.T) {
	base, _, p, d := h2cPD(t, mockworker.Config{}, mockworker.Config{})
	words := strings.Repeat("w ", 300<<10/2)
	resp, err := http.Post(base+"/generate", "application/json",
		strings.NewReader(`{"text":"`+words+`","sampling_params":{"max_new_tokens":2}}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	// The mock's decode does not wait for prefill, which may still be reading.
	waitFor(t, func() bool { return p.Stats().Completed == 1 })
	for name, w := range map[string]*mockworker.Server{"prefill": p, "decode": d} {
		rs := w.Requests()
		if len(rs) != 1 || rs[0].Proto != "HTTP/2.0" || !strings.Contains(rs[0].Body, words) {
			t.Errorf("%s: %d requests, proto %q, body of %d bytes", name, len(rs), rs[0].Proto, len(rs[0].Body))
		}
	}
}

// A burst of streams opened at once, before any connection is up, shares
// the few connections the engine's stream limit (Go's server: 250 each)
// needs, rather than dialing one each.
func TestH2CBurstOpensFewConnections(t *testing.T) {
	w := startFatStreamWorker(t, 10, 300*time.Millisecond)
	cfg := DefaultConfig()
	cfg.WorkerURLs = []string{w.url}
	cfg.Manager.UpstreamHTTP2 = true
	base, srv := serveInProcess(t, cfg)
	defer srv.Shutdown(context.Background())
	const streams = 600
	tr := &http.Transport{MaxIdleConnsPerHost: streams}
	defer tr.CloseIdleConnections()
	var wg sync.WaitGroup
	var failed atomic.Int32
	for range streams {
		wg.Go(func() {
			req, _ := http.NewRequest("POST", base+"/generate", strings.NewReader(`{"text":"x","stream":true}`))
			req.Header.Set("X-Correlation-Id", "2")
			resp, err := tr.RoundTrip(req)
			if err != nil {
				failed.Add(1)
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 || !strings.Contains(string(b), "[DONE]") {
				failed.Add(1)
			}
		})
	}
	wg.Wait()
	if n := failed.Load(); n > 0 {
		t.Fatalf("%d of %d streams failed", n, streams)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	// Counted as accepted, so a connection dialed for nothing counts too:
	// three carry the streams, one served /server_info, and a few more may
	// be dialed as the full ones turn requests away (one at a time). Dials
	// not held to one at a time opened 36 to 182 here.
	if len(w.written) != streams || len(w.conns) > 8 {
		t.Errorf("%d streams, %d engine connections opened; want at most 8", len(w.written), len(w.conns))
	}
}

// A failed h2c dial keeps its cause: leg.send reads it to tell the
// router's own shortage of descriptors (not the worker's fault) from a
// worker that is down.
func TestH2CDialErrorKeepsItsCause(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now
	u := newUpstream(time.Second)
	defer u.close()
	var sc scope
	var body splice.Body
	body.Reset([]byte(`{}`))
	_, err = u.postH2C(&sc, "http://"+addr, "/generate", &body, nil, nil, nil)
	if !errors.Is(err, syscall.ECONNREFUSED) || !errors.Is(err, errUpstreamClosed) {
		t.Fatalf("err %v: want ECONNREFUSED inside errUpstreamClosed", err)
	}
}
