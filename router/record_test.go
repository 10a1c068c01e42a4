package router

import (
	"math"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/balancer"
)

// histogram is what o has observed.
func histogram(t *testing.T, o prometheus.Observer) *dto.Histogram {
	t.Helper()
	var m dto.Metric
	if err := o.(prometheus.Metric).Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetHistogram()
}

func histogramCount(t *testing.T, o prometheus.Observer) uint64 {
	return histogram(t, o).GetSampleCount()
}

func histogramSum(t *testing.T, o prometheus.Observer) float64 { return histogram(t, o).GetSampleSum() }

// A record is emitted as the hooks it replaces observed: the duration of
// whole replies only, an error by its type, TTFT (route and PD) only once
// a byte went out, the admission decision, each selection, retry (with its
// backoff by attempt) and leg failure, and each PD attempt's prefill
// duration and KV transfer time.
func TestRecordEmitsOnce(t *testing.T) {
	cfg := DefaultConfig()
	cfg.PDDisaggregation = true
	reg := prometheus.NewRegistry()
	srv, err := New(cfg, zap.NewNop(), reg)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = srv.Shutdown(t.Context()) }()
	m := srv.metrics
	series := m.forRoute(routeKey{"pd", routeGenerate, "unknown", true})
	pd := srv.pdm.forModel("unknown")
	start := time.Now().Add(-time.Second)
	emit := func(r *request) {
		r.s, r.route, r.start, r.info.Stream = srv, routeGenerate, start, true
		r.emit()
	}
	pw := &balancer.Worker{Type: balancer.Prefill, ModelID: "m"}
	dw := &balancer.Worker{Type: balancer.Decode, ModelID: "m"}

	// A stream that sent its first byte and ended, after a retry whose
	// prefill failed: no duration, TTFTs.
	emit(&request{rec: record{admission: admitted, routed: true, model: "unknown", pdStart: start.Add(500 * time.Millisecond),
		firstByte: 700 * time.Millisecond, took: 900 * time.Millisecond,
		picked: []*balancer.Worker{pw, dw, pw, dw}, backoffs: []time.Duration{50 * time.Millisecond},
		pd: []pdReading{{prefill: -1, kvTransfer: 0.01}, {prefill: 0.2, kvTransfer: 0.02}}},
		failed: failedWorkers{legs: []legFailure{{pw, "status_500"}}}})
	// A request whose retries ran out before a byte went out.
	emit(&request{rec: record{admission: admitted, routed: true, model: "unknown", exhausted: true, outcome: outcomeFailed, errorType: "decode_unavailable",
		backoffs: []time.Duration{50 * time.Millisecond, 75 * time.Millisecond}},
		failed: failedWorkers{legs: []legFailure{{dw, "connect"}, {dw, "connect"}}}})
	// A whole reply.
	emit(&request{rec: record{admission: admitted, routed: true, model: "unknown", outcome: outcomeSucceeded, firstByte: time.Millisecond,
		took: 2 * time.Second}})
	// Refused at admission and a body PD could not take: never routed.
	emit(&request{rec: record{admission: rejected}})
	emit(&request{rec: record{badPDBody: true}})

	for name, c := range map[string]struct {
		got  float64
		want float64
	}{
		"requests":          {counterValue(t, series.requests), 3},
		"admitted":          {counterValue(t, m.admitted), 3},
		"rejected":          {counterValue(t, m.rateLimit.WithLabelValues("rejected")), 1},
		"errors":            {counterValue(t, m.routerErrors.WithLabelValues("http", "pd", "http", "unknown", "generate", "decode_unavailable")), 1},
		"bootstrap":         {counterValue(t, srv.pdm.bootstrapFailures), 1},
		"duration":          {float64(histogramCount(t, series.duration)), 1},
		"duration sum":      {histogramSum(t, series.duration), 2},
		"ttft":              {float64(histogramCount(t, series.ttft)), 2},
		"pd ttft":           {float64(histogramCount(t, pd.ttft)), 1},
		"pd prefill":        {float64(histogramCount(t, pd.prefill)), 1},
		"pd kv transfer":    {histogramSum(t, pd.kvTransfer), 0.03},
		"selected prefill":  {gathered(t, reg, "smg_worker_selection_total", "worker_type", "prefill", "policy", srv.policies[balancer.Prefill].Name()), 2},
		"selected decode":   {gathered(t, reg, "smg_worker_selection_total", "worker_type", "decode"), 2},
		"retries prefill":   {gathered(t, reg, "smg_worker_retries_total", "worker_type", "prefill", "endpoint", "generate"), 3},
		"retries decode":    {gathered(t, reg, "smg_worker_retries_total", "worker_type", "decode"), 3},
		"backoff attempt 1": {gathered(t, reg, "smg_worker_retry_backoff_seconds", "attempt", "1"), 4},
		"backoff attempt 2": {gathered(t, reg, "smg_worker_retry_backoff_seconds", "attempt", "2"), 2},
		"exhausted":         {gathered(t, reg, "smg_worker_retries_exhausted_total"), 2},
		"prefill 500s":      {gathered(t, reg, "smg_worker_errors_total", "worker_type", "prefill", "error_type", "status_500"), 1},
		"decode connects":   {gathered(t, reg, "smg_worker_errors_total", "worker_type", "decode", "error_type", "connect"), 2},
	} {
		if math.Abs(c.got-c.want) > 1e-9 {
			t.Errorf("%s: %v, want %v", name, c.got, c.want)
		}
	}
}

// A prefill that outlives the response is still the request's: the record
// is emitted when the last reference goes, not when the response ends.
func TestRecordEmittedAtLastRelease(t *testing.T) {
	cfg := DefaultConfig()
	cfg.PDDisaggregation = true
	srv, err := New(cfg, zap.NewNop(), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = srv.Shutdown(t.Context()) }()
	series := srv.metrics.forRoute(routeKey{"pd", routeGenerate, "unknown", false})
	pd := srv.pdm.forModel("unknown")
	r := &request{s: srv, route: routeGenerate, start: time.Now()}
	r.rec = record{admission: admitted, routed: true, model: "unknown", outcome: outcomeSucceeded}
	r.rec.startPD()
	srv.live.Add(1)
	r.refs.Store(1)
	r.hold() // the prefill leg's goroutine
	r.finish()
	if n := counterValue(t, series.requests); n != 0 {
		t.Fatalf("emitted at the response's end, prefill still running: %v requests", n)
	}
	r.rec.prefilled(300 * time.Millisecond)
	r.release()
	if n, p := counterValue(t, series.requests), histogramCount(t, pd.prefill); n != 1 || p != 1 {
		t.Fatalf("after the last release: %v requests, %v prefill durations, want 1 and 1", n, p)
	}
	if d := histogramSum(t, series.duration); d <= 0 || d > 1 {
		t.Errorf("duration %v: not the response's", d)
	}
}
