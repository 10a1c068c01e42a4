package router

import (
	"bytes"
	"io"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdrouter/pdrouter/internal/readmap"
)

// pdMetrics are smg's PD stage series (smg-project/smg's metrics module),
// with its names and labels, measured where the router sees them:
// smg_pd_prefill_duration_seconds from sending the prefill leg to reading
// its reply, smg_pd_ttft_seconds from sending it to decode's first byte
// reaching the client, smg_pd_kv_transfer_duration_seconds the KV transfer
// time a reply reports (kvScan), and smg_pd_bootstrap_failures_total for
// PD bodies that could not take the bootstrap fields (not one JSON object).
type pdMetrics struct {
	prefill           *prometheus.HistogramVec
	ttft              *prometheus.HistogramVec
	kvTransfer        *prometheus.HistogramVec
	bootstrapFailures prometheus.Counter
	runtime           string                         // the engines' ("sglang", "vllm"), a label
	byModel           readmap.Map[string, *pdSeries] // by model label
}

// pdSeries are one model's resolved children (no label hashing per request).
type pdSeries struct{ prefill, ttft, kvTransfer prometheus.Observer }

func newPDMetrics(reg prometheus.Registerer) *pdMetrics {
	labels := []string{"backend_type", "model", "runtime"}
	m := &pdMetrics{
		runtime: "sglang",
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
		prefill:    m.prefill.WithLabelValues("pd", model, m.runtime),
		ttft:       m.ttft.WithLabelValues("pd", model, m.runtime),
		kvTransfer: m.kvTransfer.WithLabelValues("pd", model, m.runtime),
	})
}

// observePDTTFT records the PD time to first byte of r's last attempt.
func (r *request) observePDTTFT() {
	if r.pd != nil {
		r.pd.ttft.Observe(time.Since(r.pdStart).Seconds())
	}
}

// kvReport is a PD attempt's KV transfer time: the first of its two replies
// to report one gives it (both may, for the same transfer: pdrouter's KV
// sidecar engines report it on decode, SGLang's own computes it on prefill,
// req_time_stats.py), and decode's reply is scanned as it streams.
type kvReport struct {
	seen   atomic.Bool
	decode kvScan
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
	if ms, ok := a.kv.decode.feed(p); ok {
		a.reported(ms)
	}
}

// scanWhole looks for the transfer time in a whole reply; nil is regular
// mode.
func (a *attempt) scanWhole(body []byte) {
	if a == nil || a.kv.seen.Load() {
		return
	}
	if ms, ok := kvTransferMS(body); ok {
		a.reported(ms)
	}
}

// drainPrefill reads prefill's reply to its end, looking for the transfer
// time in it.
func (a *attempt) drainPrefill(body io.Reader) error {
	bufp := chunkPool.Get().(*[]byte)
	defer chunkPool.Put(bufp)
	var scan kvScan
	for {
		n, err := body.Read(*bufp)
		if n > 0 && !a.kv.seen.Load() {
			if ms, ok := scan.feed((*bufp)[:n]); ok {
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

// kvObjectMax is longer than any kv_transfer object the engines write.
const kvObjectMax = 512

// kvScan finds a reply's kv_transfer object when fed the reply in pieces.
// It keeps the last bytes of a piece, in case the next completes a key cut
// in two, and only while an object is cut in two (once in a reply that
// reports one, at most) a copy of it: scanning holds 40 bytes per attempt.
type kvScan struct {
	edge    [len(`"kv_transfer"`) - 1]byte
	n       int8
	pending []byte // from a "kv_transfer" on, while its object is incomplete
}

func (k *kvScan) feed(p []byte) (float64, bool) {
	if k.pending != nil {
		room := kvObjectMax - len(k.pending)
		k.pending = append(k.pending, p[:min(len(p), room)]...)
		if ms, ok := kvTransferMS(k.pending); ok {
			k.pending = nil
			return ms, true
		}
		key := bytes.Index(k.pending, kvTransferKey)
		if len(p) < room && (key < 0 || mayOpenObject(k.pending[key+len(kvTransferKey):])) {
			return 0, false // still incomplete
		}
		k.pending = nil // longer than any object, or none: not one of ours
	}
	// A key that began in the last piece?
	var joined [2 * len(kvScan{}.edge)]byte
	m := copy(joined[:], k.edge[:k.n])
	m += copy(joined[m:], p)
	if i := bytes.Index(joined[:m], kvTransferKey); i >= 0 && i < int(k.n) {
		k.pending = append(make([]byte, 0, kvObjectMax), joined[i:k.n]...)
		k.n = 0
		return k.feed(p)
	}
	if ms, ok := kvTransferMS(p); ok {
		return ms, true
	}
	// An object that the next piece may complete?
	if i := bytes.LastIndex(p, kvTransferKey); i >= 0 && len(p)-i < kvObjectMax {
		if rest := p[i+len(kvTransferKey):]; mayOpenObject(rest) && !objectComplete(rest) {
			k.pending = append(make([]byte, 0, kvObjectMax), p[i:]...)
			k.n = 0
			return 0, false
		}
	}
	window := p
	if len(p) < len(k.edge) {
		window = joined[:m]
	}
	k.n = int8(copy(k.edge[:], window[max(len(window)-len(k.edge), 0):]))
	return 0, false
}

var (
	kvTransferKey = []byte(`"kv_transfer"`)
	// transfer_ms is pdrouter's engines' (mockworker, enginesim), latency_ms
	// SGLang's (meta_info.kv_transfer.latency_ms).
	kvTimeKeys = [][]byte{[]byte(`"transfer_ms"`), []byte(`"latency_ms"`)}
)

// kvTransferMS is the transfer time in ms of the first complete kv_transfer
// object in b: meta_info.kv_transfer on /generate, the OpenAI routes'
// top-level kv_transfer, or the first element of an array of them.
func kvTransferMS(b []byte) (float64, bool) {
	for {
		i := bytes.Index(b, kvTransferKey)
		if i < 0 {
			return 0, false
		}
		b = b[i+len(kvTransferKey):]
		obj, ok := jsonObjectAfterColon(b)
		if !ok {
			continue
		}
		for _, key := range kvTimeKeys {
			if ms, ok := numberField(obj, key); ok {
				return ms, true
			}
		}
	}
}

// jsonObjectAfterColon is the flat object (or an array's first one) that
// b's `: {...}` holds, without its closing brace; false if b has not got
// all of it.
func jsonObjectAfterColon(b []byte) ([]byte, bool) {
	b = skipSpace(b)
	if len(b) == 0 || b[0] != ':' {
		return nil, false
	}
	b = skipSpace(b[1:])
	if len(b) > 0 && b[0] == '[' {
		b = skipSpace(b[1:])
	}
	if len(b) == 0 || b[0] != '{' {
		return nil, false
	}
	end := bytes.IndexByte(b, '}')
	if end < 0 {
		return nil, false
	}
	return b[1:end], true
}

// mayOpenObject reports whether b, what follows a key, is the start of
// `: {` or `: [{` (or empty: more may come).
func mayOpenObject(b []byte) bool {
	if b = skipSpace(b); len(b) == 0 {
		return true
	}
	if b[0] != ':' {
		return false
	}
	if b = skipSpace(b[1:]); len(b) > 0 && b[0] == '[' {
		b = skipSpace(b[1:])
	}
	return len(b) == 0 || b[0] == '{'
}

func objectComplete(b []byte) bool {
	_, ok := jsonObjectAfterColon(b)
	return ok
}

// numberField is the non-negative number that obj holds under key.
func numberField(obj, key []byte) (float64, bool) {
	i := bytes.Index(obj, key)
	if i < 0 {
		return 0, false
	}
	v := skipSpace(obj[i+len(key):])
	if len(v) == 0 || v[0] != ':' {
		return 0, false
	}
	v = skipSpace(v[1:])
	n := 0
	for n < len(v) && strings.IndexByte("0123456789.eE+-", v[n]) >= 0 {
		n++
	}
	ms, err := strconv.ParseFloat(bstr(v[:n]), 64)
	if err != nil || ms < 0 {
		return 0, false
	}
	return ms, true
}

func skipSpace(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t' || b[0] == '\n' || b[0] == '\r') {
		b = b[1:]
	}
	return b
}
