package router

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/mock/mockworker"
)

// In vLLM mode each leg has its client span under the request's span, in
// order, and carries a traceparent naming it.
func TestVLLMTraces(t *testing.T) {
	col := startOTLPReceiver(t)
	defer col.srv.Stop()
	p, err := mockworker.Start(mockworker.Config{Role: mockworker.RoleVLLMPrefill})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	d, err := mockworker.Start(mockworker.Config{Role: mockworker.RoleVLLMDecode, Tokens: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	cfg := DefaultConfig()
	cfg.PDDisaggregation, cfg.VLLMPDDisaggregation = true, true
	cfg.Prefill = []PrefillSpec{{URL: p.URL(), BootstrapPort: balancer.NoBootstrapPort}}
	cfg.Decode = []string{d.URL()}
	cfg.Trace = TraceConfig{Enabled: true, Endpoint: col.addr}
	base, srv := serveInProcess(t, cfg)
	tr := &http.Transport{}
	resp, err := (&http.Client{Transport: tr}).Post(base+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"a b","stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	tr.CloseIdleConnections()
	waitFor(t, func() bool { return d.Stats().InFlight == 0 && p.Stats().InFlight == 0 })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(ctx); err != nil { // exports what is left
		t.Fatal(err)
	}
	tid, _ := traceparent(t, d.Requests()[0].Headers["traceparent"])
	spans := col.trace(tid)
	roots := named(spans, "POST /v1/completions")
	if len(roots) != 1 {
		t.Fatalf("%d request spans in %d spans", len(roots), len(spans))
	}
	var legs [2]*tracepb.Span
	for i, leg := range []struct {
		name string
		w    *mockworker.Server
	}{{"prefill", p}, {"decode", d}} {
		ls := named(spans, leg.name)
		if len(ls) != 1 || parentID(ls[0]) != spanID(roots[0]) || attr(ls[0], "pdrouter.worker") != leg.w.URL() {
			t.Fatalf("%s: want one span under the request's, got %v", leg.name, ls)
		}
		legs[i] = ls[0]
		if gotTID, parent := traceparent(t, leg.w.Requests()[0].Headers["traceparent"]); gotTID != tid || parent != spanID(ls[0]) {
			t.Errorf("%s leg's traceparent names %s/%s, want %s/%s", leg.name, gotTID, parent, tid, spanID(ls[0]))
		}
	}
	if legs[0].GetEndTimeUnixNano() > legs[1].GetStartTimeUnixNano() {
		t.Error("the decode span starts before the prefill span ends")
	}
}
