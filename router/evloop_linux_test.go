//go:build linux

package router

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/valyala/fasthttp"
	"go.uber.org/goleak"

	"github.com/pdrouter/pdrouter/balancer"
)

// caseWorker answers by the word after "case:" in the request's body, so
// one worker serves every case of the differential test.
func caseWorker(t *testing.T) (string, func()) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if r.Method != "POST" {
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"model_path":"m"}`)
			return
		}
		word, _, _ := strings.Cut(strings.SplitN(string(body)+"case:ok", "case:", 2)[1], `"`)
		switch word {
		case "ok":
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("X-Worker", "yes")
			fmt.Fprintf(w, `{"text":"echo %d bytes","rid":%q}`, len(body), r.Header.Get("X-Request-Id"))
		case "chunked":
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"text":"first`)
			w.(http.Flusher).Flush()
			io.WriteString(w, ` second"}`)
		case "bad":
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(400)
			io.WriteString(w, `{"error":"bad input"}`)
		case "busy":
			w.WriteHeader(503)
			io.WriteString(w, "overloaded")
		case "die":
			c, bw, _ := w.(http.Hijacker).Hijack()
			bw.WriteString("HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"text\":")
			bw.Flush()
			c.Close()
		case "empty":
			w.WriteHeader(204)
		case "hint": // an interim head before the reply's own
			c, bw, _ := w.(http.Hijacker).Hijack()
			bw.WriteString("HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n")
			bw.WriteString("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n{\"text\":\"late\"}")
			bw.Flush()
			c.Close()
		case "slow":
			time.Sleep(300 * time.Millisecond)
			io.WriteString(w, `{"text":"slow"}`)
		}
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return "http://" + ln.Addr().String(), func() { srv.Close() }
}

// loopPair serves the same workers from two routers, event loops on and
// off, each with its own metrics.
type loopPair struct {
	on, off       string
	sOn, sOff     *Server
	regOn, regOff *prometheus.Registry
}

func startPair(t *testing.T, workers []string, tune func(*Config)) loopPair {
	t.Helper()
	var p loopPair
	for _, on := range []bool{true, false} {
		cfg := DefaultConfig()
		cfg.WorkerURLs = workers
		cfg.Retry.MaxRetries = 2
		cfg.Retry.InitialBackoff = time.Millisecond
		cfg.Retry.MaxBackoff = time.Millisecond
		cfg.EventLoops = 0
		if on {
			cfg.EventLoops = 2
		}
		if tune != nil {
			tune(&cfg)
		}
		reg := prometheus.NewRegistry()
		base, srv := serveInProcessOn(t, cfg, reg)
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			srv.Shutdown(ctx)
		})
		if on {
			p.on, p.sOn, p.regOn = base, srv, reg
		} else {
			p.off, p.sOff, p.regOff = base, srv, reg
		}
	}
	for _, base := range []string{p.on, p.off} { // the same on both: the metrics are compared
		exchange(t, base, "GET /health HTTP/1.1\r\nHost: r\r\n\r\n", 1)
	}
	p.sOn.loopsOnce.Do(func() {}) // Serve's, done (it accepted): its loops are set
	if p.sOn.loops == nil {
		t.Fatal("event loops did not start")
	}
	return p
}

// exchange writes raw on a new connection to base, in pieces where raw
// holds "|", and reads n responses.
func exchange(t *testing.T, base, raw string, n int) []*http.Response {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	go func() {
		for i, piece := range strings.Split(raw, "|") {
			if i > 0 {
				time.Sleep(20 * time.Millisecond)
			}
			c.Write([]byte(piece))
		}
	}()
	br := bufio.NewReader(c)
	var out []*http.Response
	for range n {
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("reading response %d of %q: %v", len(out)+1, raw, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body = io.NopCloser(bytes.NewReader(body))
		out = append(out, resp)
	}
	return out
}

func postRaw(body string, header ...string) string {
	h := ""
	for _, x := range header {
		h += x + "\r\n"
	}
	return fmt.Sprintf("POST /generate HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s", h, len(body), body)
}

// same fails unless a and b agree on status, headers but Date (and a
// generated request id's digits) and body.
func same(t *testing.T, what string, a, b *http.Response) {
	t.Helper()
	ab, _ := io.ReadAll(a.Body)
	bb, _ := io.ReadAll(b.Body)
	// The worker echoes the id, which differs where the router made it.
	if id := a.Header.Get("X-Request-Id"); generatedID(id) {
		ab = bytes.ReplaceAll(ab, []byte(id), []byte("ID"))
		bb = bytes.ReplaceAll(bb, []byte(b.Header.Get("X-Request-Id")), []byte("ID"))
	}
	strip := func(h http.Header) http.Header {
		h = h.Clone()
		h.Del("Date")
		if id := h.Get("X-Request-Id"); generatedID(id) {
			h.Set("X-Request-Id", id[:strings.IndexByte(id, '-')])
		}
		return h
	}
	if a.StatusCode != b.StatusCode || !equalHeaders(strip(a.Header), strip(b.Header)) || !bytes.Equal(ab, bb) {
		t.Errorf("%s: loops on and off differ:\non:  %d %v %q\noff: %d %v %q", what, a.StatusCode, a.Header, ab, b.StatusCode, b.Header, bb)
	}
}

// generatedID reports an id the router made (setRequestID): 24 random
// characters after a prefix.
func generatedID(id string) bool {
	prefix, rest, ok := strings.Cut(id, "-")
	return ok && len(rest) == 24 && slices.Contains([]string{"req", "gnt", "chatcmpl", "cmpl", "resp"}, prefix)
}

func equalHeaders(a, b http.Header) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if !slices.Equal(v, b[k]) {
			return false
		}
	}
	return true
}

func TestEventLoopsAnswerAsFasthttpDoes(t *testing.T) {
	worker, _ := caseWorker(t)
	p := startPair(t, []string{worker}, nil)
	big := `{"text":"case:ok","pad":"` + strings.Repeat("x", 200<<10) + `"}`
	split := postRaw(big)
	split = split[:100] + "|" + split[100:70<<10] + "|" + split[70<<10:]
	cases := []struct {
		name   string
		raw    string
		n      int
		inLoop bool // served by the loop to its end, not handed to fasthttp
	}{
		{"ok", postRaw(`{"text":"case:ok"}`), 1, true},
		{"worker 400", postRaw(`{"text":"case:bad"}`), 1, true},
		{"worker 503, retried", postRaw(`{"text":"case:busy"}`), 1, true},
		{"chunked reply", postRaw(`{"text":"case:chunked"}`), 1, true},
		{"large body split across reads", split, 1, true},
		{"keep-alive", postRaw(`{"text":"case:ok"}`) + "|" + postRaw(`{"text":"case:bad"}`) + "|" + postRaw(`{"text":"case:ok","x":1}`), 3, true},
		{"pipelined", postRaw(`{"text":"case:ok"}`) + postRaw(`{"text":"case:chunked"}`) + postRaw(`{"text":"case:ok","y":2}`), 3, true},
		{"request id", postRaw(`{"text":"case:ok"}`, "X-Request-Id: client-id-7"), 1, true},
		{"worker dies mid-reply, retried", postRaw(`{"text":"case:die"}`), 1, true},
		{"worker 204, no body", postRaw(`{"text":"case:empty"}`) + postRaw(`{"text":"case:ok"}`), 2, true},
		{"interim head", postRaw(`{"text":"case:hint"}`), 1, true},
		{"bad JSON", postRaw(`{"text":`), 1, false},
		{"stream", postRaw(`{"text":"case:ok","stream":true}`), 1, false},
		{"health then generate", "GET /health HTTP/1.1\r\nHost: r\r\n\r\n" + postRaw(`{"text":"case:ok"}`), 2, false},
		{"query string", strings.Replace(postRaw(`{"text":"case:ok"}`), "/generate", "/generate?x=1", 1), 1, false},
		{"chat", strings.Replace(postRaw(`{"messages":[{"role":"user","content":"case:ok"}]}`), "/generate", "/v1/chat/completions", 1), 1, true},
		{"HTTP/1.0", strings.Replace(postRaw(`{"text":"case:ok"}`), "HTTP/1.1", "HTTP/1.0", 1), 1, false},
		{"Expect", postRaw(`{"text":"case:ok"}`, "Expect: 100-continue"), 2, false},
		{"Connection: close", postRaw(`{"text":"case:ok"}`, "Connection: close"), 1, false},
		{"CORS", postRaw(`{"text":"case:ok"}`, "Origin: http://x"), 1, false},
	}
	for _, c := range cases {
		before := p.sOn.loops.handedOff.Load()
		on := exchange(t, p.on, c.raw, c.n)
		if handed := p.sOn.loops.handedOff.Load() > before; handed == c.inLoop {
			t.Errorf("%s: handed to fasthttp %v, want %v", c.name, handed, !c.inLoop)
		}
		off := exchange(t, p.off, c.raw, c.n)
		for i := range on {
			same(t, fmt.Sprintf("%s #%d", c.name, i+1), on[i], off[i])
		}
	}
	sameMetrics(t, p, "smg_http_requests_total", "smg_http_responses_total", "smg_router_requests_total",
		"smg_router_request_errors_total", "smg_http_rate_limit_total")
}

func TestEventLoopsRefusedWorker(t *testing.T) {
	worker, stop := caseWorker(t)
	p := startPair(t, []string{worker}, nil)
	raw := postRaw(`{"text":"case:ok"}`)
	same(t, "before", exchange(t, p.on, raw, 1)[0], exchange(t, p.off, raw, 1)[0])
	stop() // its pooled connections close, and new ones are refused
	same(t, "refused", exchange(t, p.on, raw, 1)[0], exchange(t, p.off, raw, 1)[0])
}

// sameMetrics fails unless both routers' families have the same samples.
func sameMetrics(t *testing.T, p loopPair, names ...string) {
	t.Helper()
	on, off := samples(t, p.regOn), samples(t, p.regOff)
	for _, name := range names {
		if on[name] != off[name] {
			t.Errorf("%s: loops on:\n%s\noff:\n%s", name, on[name], off[name])
		}
	}
}

func samples(t *testing.T, reg *prometheus.Registry) map[string]string {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, f := range fams {
		var b strings.Builder
		for _, m := range f.GetMetric() {
			fmt.Fprintf(&b, "%s %s\n", labels(m), value(m))
		}
		out[f.GetName()] = b.String()
	}
	return out
}

func labels(m *dto.Metric) string {
	var parts []string
	for _, l := range m.GetLabel() {
		parts = append(parts, l.GetName()+"="+l.GetValue())
	}
	return strings.Join(parts, ",")
}

func value(m *dto.Metric) string {
	switch {
	case m.Counter != nil:
		return fmt.Sprint(m.Counter.GetValue())
	case m.Gauge != nil:
		return fmt.Sprint(m.Gauge.GetValue())
	case m.Histogram != nil:
		return fmt.Sprint("count ", m.Histogram.GetSampleCount())
	}
	return "?"
}

func TestLoopLane(t *testing.T) {
	head := func(lines ...string) *fasthttp.RequestHeader {
		var h fasthttp.RequestHeader
		raw := strings.Join(lines, "\r\n") + "\r\n\r\n"
		if err := h.Read(bufio.NewReader(strings.NewReader(raw))); err != nil {
			t.Fatalf("%q: %v", raw, err)
		}
		return &h
	}
	post := func(extra ...string) *fasthttp.RequestHeader {
		return head(append([]string{"POST /generate HTTP/1.1", "Host: r", "Content-Length: 10"}, extra...)...)
	}
	cases := []struct {
		name string
		h    *fasthttp.RequestHeader
		tune func(*Server)
		want bool
	}{
		{"plain POST", post(), nil, true},
		{"chat", head("POST /v1/chat/completions HTTP/1.1", "Host: r", "Content-Length: 2"), nil, true},
		{"GET", head("GET /generate HTTP/1.1", "Host: r"), nil, false},
		{"not a generation route", head("POST /flush_cache HTTP/1.1", "Host: r", "Content-Length: 0"), nil, false},
		{"query string", head("POST /generate?a=1 HTTP/1.1", "Host: r", "Content-Length: 2"), nil, false},
		{"HTTP/1.0", head("POST /generate HTTP/1.0", "Host: r", "Content-Length: 2"), nil, false},
		{"Connection: close", post("Connection: close"), nil, false},
		{"chunked", head("POST /generate HTTP/1.1", "Host: r", "Transfer-Encoding: chunked"), nil, false},
		{"Expect", post("Expect: 100-continue"), nil, false},
		{"CORS", post("Origin: http://x"), nil, false},
		{"client's left-body header", post(leftBodyHeader + ": 5"), nil, false},
		{"body over the loops' limit", head("POST /generate HTTP/1.1", "Host: r", fmt.Sprintf("Content-Length: %d", maxLoopBody+1)), nil, false},
		{"body over --max-payload-size", post(), func(s *Server) { s.cfg.MaxPayloadSize = 5 }, false},
		{"API key", post(), func(s *Server) { s.cfg.APIKey = "k" }, false},
		{"tracing", post(), func(s *Server) { s.trace = &tracer{} }, false},
		{"admission limit", post(), func(s *Server) { s.admission = balancer.NewAdmission(balancer.AdmissionConfig{MaxConcurrent: 1}) }, false},
		{"PD", post(), func(s *Server) { s.cfg.PDDisaggregation = true }, false},
	}
	for _, c := range cases {
		s := &Server{cfg: DefaultConfig()}
		if c.tune != nil {
			c.tune(s)
		}
		if _, got := s.loopLane(c.h); got != c.want {
			t.Errorf("%s: loopLane = %v, want %v", c.name, got, c.want)
		}
	}
}

func TestLoopWorker(t *testing.T) {
	for _, c := range []struct {
		w    *balancer.Worker
		want bool
	}{
		{&balancer.Worker{BaseURL: "http://127.0.0.1:30000"}, true},
		{&balancer.Worker{BaseURL: "http://[::1]:30000"}, true},
		{&balancer.Worker{BaseURL: "https://127.0.0.1:30000"}, false},
		{&balancer.Worker{BaseURL: "http://engine:30000"}, false}, // a name would be resolved in the loop
		{&balancer.Worker{BaseURL: "http://127.0.0.1:30000", APIKey: "k"}, false},
		{&balancer.Worker{BaseURL: "http://127.0.0.1:30000", DPSize: 2}, false},
		{&balancer.Worker{BaseURL: "http://127.0.0.1:30000", HTTP2: true}, false},
	} {
		if _, _, ok := loopWorker(c.w); ok != c.want {
			t.Errorf("%s %+v: loopWorker = %v, want %v", c.w.BaseURL, c.w, ok, c.want)
		}
	}
}

// loopRouter serves worker with event loops on (and tune), shut down at
// the test's end unless the test does it.
func loopRouter(t *testing.T, worker string, tune func(*Config)) (string, *Server) {
	t.Helper()
	cfg := DefaultConfig()
	cfg.WorkerURLs = []string{worker}
	cfg.EventLoops = 2
	if tune != nil {
		tune(&cfg)
	}
	base, srv := serveInProcess(t, cfg)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
	})
	return base, srv
}

func TestEventLoopsShutdownWaitsForRequests(t *testing.T) {
	worker, _ := caseWorker(t)
	base, srv := loopRouter(t, worker, nil)
	idle, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close()
	// handed is a keep-alive connection the loops gave fasthttp, idle there.
	handed, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer handed.Close()
	handed.Write([]byte("GET /health HTTP/1.1\r\nHost: r\r\n\r\n"))
	handedReader := bufio.NewReader(handed)
	if resp, err := http.ReadResponse(handedReader, nil); err != nil {
		t.Fatal(err)
	} else {
		io.ReadAll(resp.Body)
	}
	got := make(chan *http.Response, 1)
	go func() { got <- exchange(t, base, postRaw(`{"text":"case:slow"}`), 1)[0] }()
	time.Sleep(100 * time.Millisecond) // the slow request is with the worker
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	start := time.Now()
	if err := srv.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	resp := <-got
	if body, _ := io.ReadAll(resp.Body); resp.StatusCode != 200 || !resp.Close || string(body) != `{"text":"slow"}` {
		t.Errorf("the request in flight at shutdown got %d close=%v %q, want its reply and Connection: close", resp.StatusCode, resp.Close, body)
	}
	if d := time.Since(start); d < 100*time.Millisecond {
		t.Errorf("Shutdown returned after %v, before the request in flight ended", d)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("Shutdown took %v: it waited for idle connections", d)
	}
	idle.SetReadDeadline(time.Now().Add(time.Second))
	if n, err := idle.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("idle connection at shutdown: read %d, %v; want it closed", n, err)
	}
	handed.SetReadDeadline(time.Now().Add(time.Second))
	if n, err := handedReader.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("idle connection handed to fasthttp, at shutdown: read %d, %v; want it closed", n, err)
	}
}

func TestEventLoopsTimeouts(t *testing.T) {
	worker, _ := caseWorker(t)
	p := startPair(t, []string{worker}, func(c *Config) {
		c.IdleConnectionTimeout = 300 * time.Millisecond
		c.HeaderReadTimeout = 300 * time.Millisecond
		c.BodyReadTimeout = 300 * time.Millisecond
	})
	for _, base := range []string{p.on, p.off} {
		c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		c.Write([]byte(postRaw(`{"text":"case:ok"}`)))
		if _, err := http.ReadResponse(bufio.NewReader(c), nil); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		c.SetReadDeadline(time.Now().Add(3 * time.Second))
		if n, err := c.Read(make([]byte, 1)); err != io.EOF {
			t.Errorf("%s: an idle connection read %d, %v; want it closed", base, n, err)
		} else if d := time.Since(start); d < 250*time.Millisecond {
			t.Errorf("%s: an idle connection closed after %v, before the idle timeout", base, d)
		}
		c.Close()
	}
	for _, partial := range []string{"POST /generate HTTP/1.1\r\nHost: r\r\n", postRaw(`{"text":"case:ok"}`)[:90]} {
		var got [2]*http.Response
		for i, base := range []string{p.on, p.off} {
			c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
			if err != nil {
				t.Fatal(err)
			}
			c.SetDeadline(time.Now().Add(3 * time.Second))
			c.Write([]byte(partial))
			if got[i], err = http.ReadResponse(bufio.NewReader(c), nil); err != nil {
				t.Fatalf("%s: %q: %v", base, partial, err)
			}
			c.Close()
		}
		same(t, fmt.Sprintf("partial %q", partial), got[0], got[1])
	}
}

func TestEventLoopsLeakNothing(t *testing.T) {
	defer goleak.VerifyNone(t,
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.updateServerDate.func1"),
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*workerPool).Start.func2"))
	fds := openFDs(t)
	worker, stopWorker := caseWorker(t)
	base, srv := loopRouter(t, worker, nil)
	// Served, handed off, a worker dying mid-reply, and a client leaving
	// before its reply.
	exchange(t, base, postRaw(`{"text":"case:ok"}`)+postRaw(`{"text":"case:bad"}`), 2)
	exchange(t, base, postRaw(`{"text":"case:ok","stream":true}`), 1)
	exchange(t, base, postRaw(`{"text":"case:die"}`), 1)
	c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	c.Write([]byte(postRaw(`{"text":"case:slow"}`)))
	time.Sleep(50 * time.Millisecond)
	c.Close()
	waitFor(t, func() bool { return srv.live.Load() == 0 })
	// Every client connection is closed: the loops' and those they handed off.
	waitFor(t, func() bool { return gaugeValue(t, srv.metrics.httpConnections) == 0 })
	for _, w := range srv.reg.Snapshot().All {
		if n := w.Load(); n != 0 {
			t.Errorf("worker %s keeps a load of %d", w.URL, n)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	stopWorker()
	waitFor(t, func() bool { return openFDs(t) <= fds })
}

func TestEventLoopsCountAgainstMaxConnections(t *testing.T) {
	worker, _ := caseWorker(t)
	base, _ := loopRouter(t, worker, func(c *Config) { c.MaxConnections = 2 })
	addr := strings.TrimPrefix(base, "http://")
	var held []net.Conn
	for range 2 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		c.Write([]byte(postRaw(`{"text":"case:ok"}`)))
		if resp, err := http.ReadResponse(bufio.NewReader(c), nil); err != nil || resp.StatusCode != 200 {
			t.Fatalf("connection %d: %v %v", len(held)+1, resp, err)
		}
		held = append(held, c)
	}
	if resp := exchange(t, base, postRaw(`{"text":"case:ok"}`), 1)[0]; resp.StatusCode != 503 {
		t.Fatalf("a third connection over --max-connections 2 got %d, want 503", resp.StatusCode)
	}
	held[0].Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if resp := exchange(t, base, postRaw(`{"text":"case:ok"}`), 1)[0]; resp.StatusCode == 200 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("a connection closed on a loop never freed its slot")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A connection that sends nothing gets fasthttp's 408 at the header read
// timeout, and is closed (a flood of silent connections must not hold the
// --max-connections slots for the idle timeout); one that has had a reply
// waits the idle timeout for its next request.
func TestEventLoopsCloseSilentConnectionsAtTheHeaderTimeout(t *testing.T) {
	worker, _ := caseWorker(t)
	p := startPair(t, []string{worker}, func(c *Config) {
		c.HeaderReadTimeout = 300 * time.Millisecond
		c.IdleConnectionTimeout = 10 * time.Second
	})
	var got [2]*http.Response
	for i, base := range []string{p.on, p.off} {
		silent, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		kept, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		kept.Write([]byte(postRaw(`{"text":"case:ok"}`)))
		if _, err := http.ReadResponse(bufio.NewReader(kept), nil); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		silent.SetReadDeadline(time.Now().Add(3 * time.Second))
		br := bufio.NewReader(silent)
		if got[i], err = http.ReadResponse(br, nil); err != nil {
			t.Fatalf("%s: a silent connection: %v; want fasthttp's 408", base, err)
		}
		body, _ := io.ReadAll(got[i].Body)
		got[i].Body = io.NopCloser(bytes.NewReader(body))
		if _, err := br.ReadByte(); err != io.EOF || time.Since(start) > 2*time.Second {
			t.Errorf("%s: a silent connection read %v after %v; want it closed at the header read timeout", base, err, time.Since(start))
		}
		kept.SetReadDeadline(time.Now().Add(time.Second))
		var ne net.Error
		if n, err := kept.Read(make([]byte, 1)); !errors.As(err, &ne) || !ne.Timeout() {
			t.Errorf("%s: a kept-alive connection read %d, %v within 1 s; want it open until the idle timeout", base, n, err)
		}
		silent.Close()
		kept.Close()
	}
	if got[0].StatusCode != 408 {
		t.Errorf("a silent connection got %d, want 408", got[0].StatusCode)
	}
	same(t, "silent connection", got[0], got[1])
}

// A loop reuses its ended requests, but not one a retry's backoff timer
// still holds: a request timed out during its backoff, and the next one
// on its connection in flight when the timer fires, each get their own
// answer.
func TestEventLoopsReuseNoRequestARetryTimerHolds(t *testing.T) {
	worker, _ := caseWorker(t)
	base, _ := loopRouter(t, worker, func(c *Config) {
		c.RequestTimeout = 400 * time.Millisecond
		c.Retry = balancer.RetryConfig{MaxRetries: 2, InitialBackoff: 600 * time.Millisecond, MaxBackoff: 600 * time.Millisecond, Multiplier: 1}
	})
	got := exchange(t, base, postRaw(`{"text":"case:busy"}`)+postRaw(`{"text":"case:slow"}`)+postRaw(`{"text":"case:ok"}`), 3)
	want := []struct {
		status int
		body   string
	}{{504, `"code":"request_timeout"`}, {200, `"text":"slow"`}, {200, `"text":"echo`}}
	for i, w := range want {
		b, _ := io.ReadAll(got[i].Body)
		if got[i].StatusCode != w.status || !strings.Contains(string(b), w.body) {
			t.Errorf("response %d: %d %s; want %d with %s", i+1, got[i].StatusCode, b, w.status, w.body)
		}
	}
}
