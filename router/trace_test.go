package router

import (
	"context"
	"encoding/hex"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"go.uber.org/goleak"
	"google.golang.org/grpc"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/mock/mockworker"
)

// otlpReceiver is an OTLP/gRPC trace collector inside the test.
type otlpReceiver struct {
	collectortrace.UnimplementedTraceServiceServer
	srv  *grpc.Server
	addr string

	mu       sync.Mutex
	spans    []*tracepb.Span
	services []string
}

func startOTLPReceiver(t *testing.T) *otlpReceiver {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	o := &otlpReceiver{srv: grpc.NewServer(), addr: ln.Addr().String()}
	collectortrace.RegisterTraceServiceServer(o.srv, o)
	go o.srv.Serve(ln) //nolint:errcheck // ends at Stop
	return o
}

func (o *otlpReceiver) Export(_ context.Context, req *collectortrace.ExportTraceServiceRequest) (*collectortrace.ExportTraceServiceResponse, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		for _, kv := range rs.GetResource().GetAttributes() {
			if kv.GetKey() == "service.name" {
				o.services = append(o.services, kv.GetValue().GetStringValue())
			}
		}
		for _, ss := range rs.GetScopeSpans() {
			o.spans = append(o.spans, ss.GetSpans()...)
		}
	}
	return &collectortrace.ExportTraceServiceResponse{}, nil
}

// trace is the spans received with trace id tid.
func (o *otlpReceiver) trace(tid string) []*tracepb.Span {
	o.mu.Lock()
	defer o.mu.Unlock()
	var out []*tracepb.Span
	for _, s := range o.spans {
		if hex.EncodeToString(s.GetTraceId()) == tid {
			out = append(out, s)
		}
	}
	return out
}

func spanID(s *tracepb.Span) string   { return hex.EncodeToString(s.GetSpanId()) }
func parentID(s *tracepb.Span) string { return hex.EncodeToString(s.GetParentSpanId()) }
func named(spans []*tracepb.Span, name string) []*tracepb.Span {
	var out []*tracepb.Span
	for _, s := range spans {
		if s.GetName() == name {
			out = append(out, s)
		}
	}
	return out
}

func attr(s *tracepb.Span, key string) string {
	for _, kv := range s.GetAttributes() {
		if kv.GetKey() == key {
			if v := kv.GetValue(); v.GetStringValue() != "" {
				return v.GetStringValue()
			} else {
				return strconv.FormatInt(v.GetIntValue(), 10)
			}
		}
	}
	return ""
}

// traceparent is the W3C header's trace id and parent id.
func traceparent(t *testing.T, h string) (tid, parent string) {
	t.Helper()
	parts := strings.Split(h, "-")
	if len(parts) != 4 || parts[0] != "00" || len(parts[1]) != 32 || len(parts[2]) != 16 {
		t.Fatalf("traceparent %q is not W3C version 00", h)
	}
	return parts[1], parts[2]
}

// TestTraces runs PD requests through a traced router and checks, at an
// in-process OTLP collector, the spans' parent/child structure, and at the
// mock workers, that each leg carried a traceparent naming its own span in
// the request's trace.
func TestTraces(t *testing.T) {
	defer goleak.VerifyNone(t,
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.updateServerDate.func1"),
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*workerPool).Start.func2"))
	col := startOTLPReceiver(t)
	defer col.srv.Stop()
	p, err := mockworker.Start(mockworker.Config{Role: mockworker.RolePrefill})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	d, err := mockworker.Start(mockworker.Config{Role: mockworker.RoleDecode, Tokens: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	cfg := DefaultConfig()
	cfg.PDDisaggregation = true
	cfg.Prefill = []PrefillSpec{{URL: p.URL(), BootstrapPort: 8998}}
	cfg.Decode = []string{d.URL()}
	cfg.Trace = TraceConfig{Enabled: true, Endpoint: col.addr}
	base, srv := serveInProcess(t, cfg)
	var once sync.Once
	var shutdownErr error
	shutdown := func() error {
		once.Do(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			shutdownErr = srv.Shutdown(ctx)
		})
		return shutdownErr
	}
	defer shutdown() //nolint:errcheck // checked below on the passing path
	tr := &http.Transport{}
	c := &http.Client{Transport: tr}
	do := func(body string, header ...string) {
		t.Helper()
		req, _ := http.NewRequest("POST", base+"/generate", strings.NewReader(body))
		for i := 0; i+1 < len(header); i += 2 {
			req.Header.Set(header[i], header[i+1])
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, b)
		}
	}
	// A client's trace is continued; a stream starts a trace of its own.
	const clientTrace, clientSpan = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	do(`{"text":"a b c"}`, "traceparent", "00-"+clientTrace+"-"+clientSpan+"-01", "tracestate", "vendor=x")
	// The n-th request's headers at w (prefill's leg may still be on its way
	// when decode has answered).
	legHeaders := func(w *mockworker.Server, n int) map[string]string {
		waitFor(t, func() bool { return len(w.Requests()) == n })
		return w.Requests()[n-1].Headers
	}
	pFirst, dFirst := legHeaders(p, 1), legHeaders(d, 1)
	do(`{"text":"a","stream":true}`)
	pStream, dStream := legHeaders(p, 2), legHeaders(d, 2)
	tr.CloseIdleConnections()
	waitFor(t, func() bool { return d.Stats().InFlight == 0 && p.Stats().InFlight == 0 })
	if err := shutdown(); err != nil { // exports what is left
		t.Fatal(err)
	}

	check := func(tid string, wantParent string, stream bool, prefillTP, decodeTP map[string]string) {
		t.Helper()
		spans := col.trace(tid)
		roots := named(spans, "POST /generate")
		if len(roots) != 1 {
			t.Fatalf("trace %s: %d request spans, want 1 (%d spans)", tid, len(roots), len(spans))
		}
		root := roots[0]
		if parentID(root) != wantParent || root.GetKind() != tracepb.Span_SPAN_KIND_SERVER || attr(root, "http.response.status_code") != "200" {
			t.Errorf("request span: parent %q kind %v status %q; want parent %q, server, 200", parentID(root), root.GetKind(), attr(root, "http.response.status_code"), wantParent)
		}
		sel := named(spans, "select")
		if len(sel) != 2 || parentID(sel[0]) != spanID(root) || parentID(sel[1]) != spanID(root) ||
			attr(sel[0], "pdrouter.worker_type") == attr(sel[1], "pdrouter.worker_type") {
			t.Errorf("want one select span per side under the request span, got %v", sel)
		}
		for _, leg := range []struct {
			name   string
			worker *mockworker.Server
			header map[string]string
		}{{"prefill", p, prefillTP}, {"decode", d, decodeTP}} {
			ls := named(spans, leg.name)
			if len(ls) != 1 || parentID(ls[0]) != spanID(root) || ls[0].GetKind() != tracepb.Span_SPAN_KIND_CLIENT || attr(ls[0], "pdrouter.worker") != leg.worker.URL() {
				t.Fatalf("%s: want one client span under the request span, got %v", leg.name, ls)
			}
			gotTID, gotParent := traceparent(t, leg.header["traceparent"])
			if gotTID != tid || gotParent != spanID(ls[0]) {
				t.Errorf("%s worker saw traceparent %q; want trace %s, parent %s (its leg's span)", leg.name, leg.header["traceparent"], tid, spanID(ls[0]))
			}
		}
		decode := named(spans, "decode")[0]
		fb := named(spans, "first_byte")
		if len(fb) != 1 || parentID(fb[0]) != spanID(decode) || fb[0].GetEndTimeUnixNano() > decode.GetEndTimeUnixNano() ||
			fb[0].GetStartTimeUnixNano() != decode.GetStartTimeUnixNano() {
			t.Errorf("first_byte: want one span under decode, from its start, got %v", fb)
		}
		st := named(spans, "stream")
		if stream != (len(st) == 1) || stream && (parentID(st[0]) != spanID(decode) || st[0].GetStartTimeUnixNano() != fb[0].GetEndTimeUnixNano()) {
			t.Errorf("stream (want one: %v): got %v", stream, st)
		}
	}
	check(clientTrace, clientSpan, false, pFirst, dFirst)
	if pFirst["tracestate"] != "vendor=x" || dFirst["tracestate"] != "vendor=x" {
		t.Errorf("tracestate not carried on: prefill %q decode %q", pFirst["tracestate"], dFirst["tracestate"])
	}
	streamTID, _ := traceparent(t, dStream["traceparent"])
	if streamTID == clientTrace {
		t.Fatal("a request without a traceparent joined another trace")
	}
	check(streamTID, "", true, pStream, dStream)
	col.mu.Lock()
	services := col.services
	col.mu.Unlock()
	if len(services) == 0 || services[0] != "pdrouter" {
		t.Errorf("service.name %v, want pdrouter", services)
	}
}

// TestTracingOffAllocatesNothing: with tracing off every hook the request
// path calls is a nil check.
func TestTracingOffAllocatesNothing(t *testing.T) {
	var tr *tracer
	w := &balancer.Worker{URL: "http://w", Type: balancer.Decode}
	header := []byte("X-Request-Id: 1\r\n")
	r := &request{}
	l := &leg{w: w}
	if n := testing.AllocsPerRun(100, func() {
		rt := tr.start(nil, r)
		start := rt.now()
		rt.selected(start, w, "round_robin")
		l.trace = rt.leg()
		if got := l.trace.start(l, "/generate", header); &got[0] != &header[0] {
			t.Fatal("header copied with tracing off")
		}
		l.trace.firstByte(true)
		l.trace.end(l)
		rt.end(r)
	}); n != 0 {
		t.Errorf("tracing off: %v allocations per request, want 0", n)
	}
}

func TestTraceConfigValidation(t *testing.T) {
	for _, c := range []struct {
		cfg TraceConfig
		ok  bool
	}{
		{TraceConfig{Enabled: false, Endpoint: "nonsense"}, true},
		{TraceConfig{Enabled: true, Endpoint: DefaultOTLPTracesEndpoint}, true},
		{TraceConfig{Enabled: true, Endpoint: "otel-collector:4317"}, true},
		{TraceConfig{Enabled: true, Endpoint: "https://collector.example:443"}, true},
		{TraceConfig{Enabled: true, Endpoint: "[::1]:4317"}, true},
		{TraceConfig{Enabled: true, Endpoint: "collector"}, false},
		{TraceConfig{Enabled: true, Endpoint: ":4317"}, false},
		{TraceConfig{Enabled: true, Endpoint: "collector:0"}, false},
		{TraceConfig{Enabled: true, Endpoint: "collector:70000"}, false},
		{TraceConfig{Enabled: true, Endpoint: "collector:grpc"}, false},
	} {
		cfg := DefaultConfig()
		cfg.Trace = c.cfg
		err := cfg.Validate()
		if (err == nil) != c.ok {
			t.Errorf("%+v: Validate() = %v, want ok=%v", c.cfg, err, c.ok)
		}
		if err != nil && !strings.Contains(err.Error(), "otlp_traces_endpoint") {
			t.Errorf("%+v: error %q does not name the flag", c.cfg, err)
		}
	}
}

func TestWithoutTraceContext(t *testing.T) {
	in := "Traceparent: 00-a-b-01\r\nX-Request-Id: 1\r\ntracestate: k=v\r\nAuthorization: Bearer x\r\n"
	if got := string(withoutTraceContext(nil, []byte(in))); got != "X-Request-Id: 1\r\nAuthorization: Bearer x\r\n" {
		t.Errorf("got %q", got)
	}
}

// Issue 26: an unreachable OTLP collector added up to 5 s to shutdown,
// spent waiting to export spans that could not go anywhere.
func TestUnreachableCollectorDoesNotDelayShutdown(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gone := ln.Addr().String()
	ln.Close() // nothing listens there now
	w := legWorker(t, answer(200))
	cfg := legRegularConfig(w)
	cfg.Trace = TraceConfig{Enabled: true, Endpoint: gone}
	base, srv := serveInProcess(t, cfg)
	for range 3 { // spans waiting for export
		resp, err := http.Post(base+"/generate", "application/json", strings.NewReader(`{"text":"x"}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	time.Sleep(time.Second) // a batch export has been tried
	http.DefaultClient.CloseIdleConnections()
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	srv.Shutdown(ctx) //nolint:errcheck
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("shutdown took %v with the collector unreachable", took)
	}
}
