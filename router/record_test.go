package router

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
)

func histogramCount(t *testing.T, o prometheus.Observer) uint64 {
	t.Helper()
	var m dto.Metric
	if err := o.(prometheus.Metric).Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetHistogram().GetSampleCount()
}

// A record is emitted as the hooks it replaces observed: the duration of
// whole replies only, an error by its type, TTFT (route and PD) only once
// a byte went out, and the admission decision.
func TestRecordEmitsOnce(t *testing.T) {
	cfg := DefaultConfig()
	cfg.PDDisaggregation = true
	srv, err := New(cfg, zap.NewNop(), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = srv.Shutdown(t.Context()) }()
	m := srv.metrics
	series := m.forRoute(routeKey{"pd", routeGenerate, "unknown", true})
	pd := srv.pdm.forModel("unknown")
	start := time.Now().Add(-time.Second)
	emit := func(rec record) {
		r := &request{s: srv, route: routeGenerate, start: start, rec: rec}
		r.emit()
	}

	// A stream that sent its first byte and ended: no duration, TTFTs.
	emit(record{admission: admitted, route: series, model: "unknown", pd: pd, pdStart: start.Add(500 * time.Millisecond),
		firstByte: start.Add(700 * time.Millisecond)})
	// A request whose retries ran out before a byte went out.
	emit(record{admission: admitted, route: series, model: "unknown", exhausted: true, outcome: outcomeFailed, errorType: "decode_unavailable"})
	// A whole reply.
	emit(record{admission: admitted, route: series, model: "unknown", outcome: outcomeSucceeded, firstByte: start})
	// Refused at admission and a body PD could not take: never routed.
	emit(record{admission: rejected})
	emit(record{badPDBody: true})

	for name, c := range map[string]struct {
		got  float64
		want float64
	}{
		"requests":   {counterValue(t, series.requests), 3},
		"admitted":   {counterValue(t, m.admitted), 3},
		"rejected":   {counterValue(t, m.rateLimit.WithLabelValues("rejected")), 1},
		"errors":     {counterValue(t, m.routerErrors.WithLabelValues("http", "pd", "http", "unknown", "generate", "decode_unavailable")), 1},
		"bootstrap":  {counterValue(t, srv.pdm.bootstrapFailures), 1},
		"duration":   {float64(histogramCount(t, series.duration)), 1},
		"ttft":       {float64(histogramCount(t, series.ttft)), 2},
		"pd ttft":    {float64(histogramCount(t, pd.ttft)), 1},
		"pd prefill": {float64(histogramCount(t, pd.prefill)), 0}, // the attempt's, not the record's
	} {
		if c.got != c.want {
			t.Errorf("%s: %v, want %v", name, c.got, c.want)
		}
	}
}
