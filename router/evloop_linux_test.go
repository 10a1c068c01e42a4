//go:build linux

package router

import (
	"bufio"
	"bytes"
	"context"
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
		{"worker 503, retried", postRaw(`{"text":"case:busy"}`), 1, false},
		{"chunked reply", postRaw(`{"text":"case:chunked"}`), 1, true},
		{"large body split across reads", split, 1, true},
		{"keep-alive", postRaw(`{"text":"case:ok"}`) + "|" + postRaw(`{"text":"case:bad"}`) + "|" + postRaw(`{"text":"case:ok","x":1}`), 3, true},
		{"pipelined", postRaw(`{"text":"case:ok"}`) + postRaw(`{"text":"case:chunked"}`) + postRaw(`{"text":"case:ok","y":2}`), 3, true},
		{"request id", postRaw(`{"text":"case:ok"}`, "X-Request-Id: client-id-7"), 1, true},
		{"worker dies mid-reply", postRaw(`{"text":"case:die"}`), 1, false},
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
