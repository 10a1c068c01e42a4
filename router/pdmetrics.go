package router

import (
	"io"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdrouter/pdrouter/internal/readmap"
	"github.com/pdrouter/pdrouter/router/splice"
)

// pdMetrics are smg's PD stage series (smg-project/smg's metrics module),
// with its names and labels, measured where the router sees them:
// smg_pd_prefill_duration_seconds from sending the prefill leg to reading
// its reply, smg_pd_ttft_seconds from sending it to decode's first byte
// reaching the client, smg_pd_kv_transfer_duration_seconds the KV transfer
// time a reply reports (splice.KVScan), and smg_pd_bootstrap_failures_total for
// PD bodies that could not take the bootstrap fields (not one JSON object).
type pdMetrics struct {
	prefill           *prometheus.HistogramVec
	ttft              *prometheus.HistogramVec
	kvTransfer        *prometheus.HistogramVec
	bootstrapFailures prometheus.Counter
	byModel           readmap.Map[string, *pdSeries] // by model label
}

// pdSeries are one model's resolved children (no label hashing per request).
type pdSeries struct{ prefill, ttft, kvTransfer prometheus.Observer }

func newPDMetrics(reg prometheus.Registerer) *pdMetrics {
	labels := []string{"backend_type", "model", "runtime"}
	m := &pdMetrics{
		prefill: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "smg_pd_prefill_duration_seconds",
			Help: "Prefill-leg duration by backend_type, model, runtime", Buckets: durationBuckets}, labels),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "smg_pd_ttft_seconds",
			Help: "End-to-end TTFT (prefill start to first decode byte) by backend_type, model, runtime", Buckets: durationBuckets}, labels),
		kvTransfer: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "smg_pd_kv_transfer_duration_seconds",
			Help: "KV transfer time the engines report (meta_info.kv_transfer) by backend_type, model, runtime", Buckets: durationBuckets}, labels),
		bootstrapFailures: prometheus.NewCounter(prometheus.CounterOpts{Name: "smg_pd_bootstrap_failures_total",
			Help: "PD bootstrap injection failures"}),
	}
	reg.MustRegister(m.prefill, m.ttft, m.kvTransfer, m.bootstrapFailures)
	return m
}

func (m *pdMetrics) forModel(model string) *pdSeries {
	if v, ok := m.byModel.Load(model); ok {
		return v
	}
	return m.byModel.LoadOrStore(model, &pdSeries{
		prefill:    m.prefill.WithLabelValues("pd", model, "sglang"),
		ttft:       m.ttft.WithLabelValues("pd", model, "sglang"),
		kvTransfer: m.kvTransfer.WithLabelValues("pd", model, "sglang"),
	})
}

// kvReport is a PD attempt's KV transfer time: the first of its two replies
// to report one gives it (both may, for the same transfer: pdrouter's KV
// sidecar engines report it on decode, SGLang's own computes it on prefill,
// req_time_stats.py), and decode's reply is scanned as it streams.
type kvReport struct {
	seen   atomic.Bool
	decode splice.KVScan
}

// reported observes ms unless the attempt's other reply did.
func (a *attempt) reported(ms float64) {
	if a.kv.seen.CompareAndSwap(false, true) {
		a.pd.kvTransfer.Observe(ms / 1000)
	}
}

// scanDecode looks for the transfer time in the next piece of decode's
// reply; nil is regular mode.
func (a *attempt) scanDecode(p []byte) {
	if a == nil || a.kv.seen.Load() {
		return
	}
	if ms, ok := a.kv.decode.Feed(p); ok {
		a.reported(ms)
	}
}

// scanWhole looks for the transfer time in a whole reply; nil is regular
// mode.
func (a *attempt) scanWhole(body []byte) {
	if a == nil || a.kv.seen.Load() {
		return
	}
	if ms, ok := splice.KVTransferMS(body); ok {
		a.reported(ms)
	}
}

// drainPrefill reads prefill's reply to its end, looking for the transfer
// time in it.
func (a *attempt) drainPrefill(body io.Reader) error {
	bufp := chunkPool.Get().(*[]byte)
	defer chunkPool.Put(bufp)
	var scan splice.KVScan
	for {
		n, err := body.Read(*bufp)
		if n > 0 && !a.kv.seen.Load() {
			if ms, ok := scan.Feed((*bufp)[:n]); ok {
				a.reported(ms)
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}
