package router

import (
	"bufio"
	"net/http"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/valyala/fasthttp"
)

// errorCode looks X-SMG-Error-Code up by the name fasthttp stores, not
// normalizing it per request: it finds what a Peek does however the header
// was set (by the router, or copied from a worker's reply under any case).
func TestErrorCodeFindsWhatPeekFinds(t *testing.T) {
	upstream := func(raw string) func(*fasthttp.RequestCtx) {
		return func(ctx *fasthttp.RequestCtx) {
			var h fasthttp.ResponseHeader
			if err := h.Read(bufio.NewReader(strings.NewReader(raw))); err != nil {
				t.Fatal(err)
			}
			copyHeaders(ctx, &upstreamResponse{Header: &h})
		}
	}
	for name, set := range map[string]func(*fasthttp.RequestCtx){
		"none": func(*fasthttp.RequestCtx) {},
		"writeError": func(ctx *fasthttp.RequestCtx) {
			writeError(ctx, &apiError{Status: 503, Code: "no_workers", Message: "m"})
		},
		"Set, lower": func(ctx *fasthttp.RequestCtx) { ctx.Response.Header.Set("x-smg-error-code", "a") },
		"Add, mixed": func(ctx *fasthttp.RequestCtx) { ctx.Response.Header.Add("X-sMg-ErRoR-cOdE", "b") },
		"AddBytesKV": func(ctx *fasthttp.RequestCtx) {
			ctx.Response.Header.AddBytesKV([]byte("x-smg-error-code"), []byte("c"))
		},
		"worker, 2xx":   upstream("HTTP/1.1 200 OK\r\nx-SMG-error-code: d\r\nContent-Length: 0\r\n\r\n"),
		"worker, twice": upstream("HTTP/1.1 200 OK\r\nX-Smg-Error-Code: e\r\nx-smg-error-code: f\r\nContent-Length: 0\r\n\r\n"),
	} {
		var ctx fasthttp.RequestCtx
		set(&ctx)
		want := ctx.Response.Header.Peek("X-SMG-Error-Code")
		if got := errorCode(&ctx); string(got) != string(want) {
			t.Errorf("%s: errorCode %q, Peek %q", name, got, want)
		}
		if name != "none" && len(want) == 0 {
			t.Errorf("%s: no error code set", name)
		}
	}
}

// generation reads the response's X-Request-Id by its stored name: it is
// what a Peek finds, for a client's id and a generated one.
func TestResponseRequestIDFindsWhatPeekFinds(t *testing.T) {
	s := &Server{requestIDNames: []string{"X-Request-Id", "X-Correlation-Id"}}
	for name, header := range map[string]string{
		"client's":  "x-correlation-id: mine-1\r\n",
		"generated": "",
	} {
		var ctx fasthttp.RequestCtx
		raw := "POST /generate HTTP/1.1\r\nHost: r\r\n" + header + "\r\n"
		if err := ctx.Request.Header.Read(bufio.NewReader(strings.NewReader(raw))); err != nil {
			t.Fatal(err)
		}
		s.setRequestID(&ctx)
		want := ctx.Response.Header.Peek("x-request-id")
		if got := responseRequestID(&ctx); len(want) == 0 || string(got) != string(want) {
			t.Errorf("%s: %q, Peek %q", name, got, want)
		}
	}
}

// copyHeaders sets a worker's Content-Type directly; the client gets the
// headers AddBytesKV of each gave it before.
func TestCopyHeadersAsAddedOneByOne(t *testing.T) {
	for _, raw := range []string{
		"HTTP/1.1 200 OK\r\nServer: w\r\nContent-Type: application/json\r\nX-A: 1\r\nx-a: 2\r\nContent-Length: 2\r\n\r\n",
		"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\nCache-Control: no-cache\r\nContent-Length: 0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nX-Only: y\r\nContent-Length: 0\r\n\r\n", // none: the upstream header's default
	} {
		var h fasthttp.ResponseHeader
		if err := h.Read(bufio.NewReader(strings.NewReader(raw))); err != nil {
			t.Fatal(err)
		}
		var got, want fasthttp.RequestCtx
		copyHeaders(&got, &upstreamResponse{Header: &h})
		for k, v := range h.All() {
			if !hopHeader(bstr(k)) {
				want.Response.Header.AddBytesKV(k, v)
			}
		}
		if g, w := got.Response.Header.String(), want.Response.Header.String(); g != w {
			t.Errorf("reply %q:\ngot  %q\nwant %q", raw, g, w)
		}
	}
}

// The last-resolved slot of a route never hands out another key's series:
// models, streaming and backends alternating, and equal model strings at
// other addresses, each count on their own series.
func TestRouteSeriesAlternatingKeys(t *testing.T) {
	m := newMetrics(prometheus.NewRegistry())
	keys := []routeKey{
		{"regular", routeGenerate, "a", false},
		{"regular", routeGenerate, "b", false},
		{"regular", routeGenerate, "a", true},
		{"pd", routeGenerate, "a", false},
		{"regular", routeChat, "a", false},
	}
	want := make([]int, len(keys))
	for i := range 10 { // rounds over the first 1, 2, ... keys, each key j counted j+1 times in a row
		for j, k := range keys[:1+i%len(keys)] {
			k.model = strings.Clone(k.model) // same label, another string
			for range j + 1 {
				m.forRoute(k).requests.Inc()
			}
			want[j] += j + 1
		}
	}
	for j, k := range keys {
		got := counterValue(t, m.routerRequests.WithLabelValues("http", k.backend, "http", k.model, k.route.String(), boolLabel(k.stream)))
		if got != float64(want[j]) {
			t.Errorf("%+v: %v requests, want %d", k, got, want[j])
		}
	}
}

// After N regular requests /metrics holds N of everything a request counts,
// and a whole reply's duration is its time to first byte (one clock read
// serves both: their sums are equal).
func TestRegularRequestEndMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	cfg := DefaultConfig()
	cfg.WorkerURLs = []string{cannedBackend(t, false)}
	base, srv := serveInProcessOn(t, cfg, reg)
	t.Cleanup(func() { shutdown(t, srv) })
	const n = 25
	for range n {
		resp, err := http.Post(base+"/generate", "application/json", strings.NewReader(`{"model":"mock","text":"count me"}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	resp, err := http.Post(base+"/generate", "application/json", strings.NewReader(`{"text":`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	http.DefaultClient.CloseIdleConnections()

	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	series := func(name string, labels map[string]string) *dto.Metric {
		for _, f := range families {
			if f.GetName() != name {
				continue
			}
		metrics:
			for _, m := range f.GetMetric() {
				for _, l := range m.GetLabel() {
					if v, ok := labels[l.GetName()]; ok && v != l.GetValue() {
						continue metrics
					}
				}
				return m
			}
		}
		t.Fatalf("no %s%v", name, labels)
		return nil
	}
	route := map[string]string{"backend_type": "regular", "model": "mock", "endpoint": "generate"}
	for _, c := range []struct {
		name   string
		labels map[string]string
		got    func(*dto.Metric) float64
		want   float64
	}{
		{"smg_http_requests_total", map[string]string{"method": "POST", "path": "/generate"}, counter, n + 1},
		{"smg_http_request_duration_seconds", map[string]string{"method": "POST", "path": "/generate"}, histCount, n + 1},
		{"smg_http_responses_total", map[string]string{"status_code": "200", "error_code": ""}, counter, n},
		{"smg_http_responses_total", map[string]string{"status_code": "400", "error_code": "json_parse_error"}, counter, 1},
		{"smg_http_rate_limit_total", map[string]string{"result": "allowed"}, counter, n},
		{"smg_router_requests_total", route, counter, n},
		{"smg_router_request_duration_seconds", route, histCount, n},
		{"pdrouter_time_to_first_byte_seconds", map[string]string{"backend_type": "regular", "endpoint": "generate"}, histCount, n},
	} {
		if got := c.got(series(c.name, c.labels)); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	took := series("smg_router_request_duration_seconds", route).GetHistogram().GetSampleSum()
	ttft := series("pdrouter_time_to_first_byte_seconds", nil).GetHistogram().GetSampleSum()
	if took <= 0 || took != ttft {
		t.Errorf("duration sum %v, time to first byte sum %v: want them equal", took, ttft)
	}
}

func counter(m *dto.Metric) float64   { return m.GetCounter().GetValue() }
func histCount(m *dto.Metric) float64 { return float64(m.GetHistogram().GetSampleCount()) }
