package router

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// pdMetrics are smg's PD stage series (smg-project/smg's metrics module),
// with its names and labels, measured where the router sees them:
// smg_pd_prefill_duration_seconds from sending the prefill leg to reading
// its reply, smg_pd_ttft_seconds from sending it to decode's first byte
// reaching the client, and smg_pd_bootstrap_failures_total for PD bodies
// that could not take the bootstrap fields (not one JSON object).
type pdMetrics struct {
	prefill           *prometheus.HistogramVec
	ttft              *prometheus.HistogramVec
	bootstrapFailures prometheus.Counter
	byModel           sync.Map // model label -> *pdSeries
}

// pdSeries are one model's resolved children (no label hashing per request).
type pdSeries struct{ prefill, ttft prometheus.Observer }

func newPDMetrics(reg prometheus.Registerer) *pdMetrics {
	labels := []string{"backend_type", "model", "runtime"}
	m := &pdMetrics{
		prefill: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "smg_pd_prefill_duration_seconds",
			Help: "Prefill-leg duration by backend_type, model, runtime", Buckets: durationBuckets}, labels),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "smg_pd_ttft_seconds",
			Help: "End-to-end TTFT (prefill start to first decode byte) by backend_type, model, runtime", Buckets: durationBuckets}, labels),
		bootstrapFailures: prometheus.NewCounter(prometheus.CounterOpts{Name: "smg_pd_bootstrap_failures_total",
			Help: "PD bootstrap injection failures"}),
	}
	reg.MustRegister(m.prefill, m.ttft, m.bootstrapFailures)
	return m
}

func (m *pdMetrics) forModel(model string) *pdSeries {
	if v, ok := m.byModel.Load(model); ok {
		return v.(*pdSeries)
	}
	v, _ := m.byModel.LoadOrStore(model, &pdSeries{
		prefill: m.prefill.WithLabelValues("pd", model, "sglang"),
		ttft:    m.ttft.WithLabelValues("pd", model, "sglang"),
	})
	return v.(*pdSeries)
}

// observePDTTFT records the PD time to first byte of r's last attempt.
func (r *request) observePDTTFT() {
	if r.pd != nil {
		r.pd.ttft.Observe(time.Since(r.pdStart).Seconds())
	}
}
