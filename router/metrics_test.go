package router

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// The cached children are the very series the vectors export.
func TestMetricCachesFeedTheExportedSeries(t *testing.T) {
	m := newMetrics(prometheus.NewRegistry())
	k := routeKey{"pd", routeChat, "llama", true}
	if m.forRoute(k) != m.forRoute(k) {
		t.Fatal("route series resolved twice")
	}
	m.forRoute(k).requests.Inc()
	m.forRoute(k).requests.Inc()
	if got := counterValue(t, m.routerRequests.WithLabelValues("http", "pd", "http", "llama", routeChat.String(), "true")); got != 2 {
		t.Errorf("smg_router_requests_total = %v, want 2", got)
	}

	m.observeHTTP("POST", "/generate", 200, nil, 0.01)
	m.observeHTTP("POST", "/generate", 200, nil, 0.01)
	m.observeHTTP("POST", "/generate", 503, []byte("server_selection_failed"), 0.01)
	if got := counterValue(t, m.httpRequests.WithLabelValues("POST", "/generate")); got != 3 {
		t.Errorf("smg_http_requests_total POST = %v, want 3", got)
	}
	if got := counterValue(t, m.httpResponses.WithLabelValues("200", "")); got != 2 {
		t.Errorf("smg_http_responses_total 200 = %v, want 2", got)
	}
	if got := counterValue(t, m.httpResponses.WithLabelValues("503", "server_selection_failed")); got != 1 {
		t.Errorf("smg_http_responses_total 503 = %v, want 1", got)
	}
}

// BenchmarkRequestMetrics is what a regular request's metric updates cost:
// through the cached series, and (the baseline) through label lookups on
// the vectors as before the caches.
func BenchmarkRequestMetrics(b *testing.B) {
	m := newMetrics(prometheus.NewRegistry())
	b.Run("cached", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			m.admitted.Inc()
			rm := m.forRoute(routeKey{"regular", routeGenerate, "mock", false})
			rm.requests.Inc()
			rm.ttft.Observe(0.001)
			rm.duration.Observe(0.001)
			m.observeHTTP("POST", "/generate", 200, nil, 0.001)
		}
	})
	b.Run("label-lookups", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			m.rateLimit.WithLabelValues("allowed").Inc()
			m.routerRequests.WithLabelValues("http", "regular", "http", "mock", "generate", "false").Inc()
			m.ttft.WithLabelValues("regular", "generate").Observe(0.001)
			m.routerDuration.WithLabelValues("http", "regular", "http", "mock", "generate").Observe(0.001)
			m.httpRequests.WithLabelValues("POST", "/generate").Inc()
			m.httpDuration.WithLabelValues("POST", "/generate").Observe(0.001)
			m.httpResponses.WithLabelValues("200", "").Inc()
		}
	})
}
