package router

import (
	"strconv"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"

	"github.com/pdrouter/pdrouter/internal/readmap"
)

// durationBuckets are sglang-router's buckets for *_duration_seconds.
var durationBuckets = []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 30, 45, 60, 90, 120, 180, 240}

// metrics are the smg_http_* and smg_router_* families of sglang-router
// 0.3.x, plus pdrouter's own TTFT histogram (the Rust router has none over HTTP).
type metrics struct {
	httpRequests      *prometheus.CounterVec
	httpDuration      *prometheus.HistogramVec
	httpResponses     *prometheus.CounterVec
	httpConnections   prometheus.Gauge
	rateLimit         *prometheus.CounterVec
	routerRequests    *prometheus.CounterVec
	routerDuration    *prometheus.HistogramVec
	routerErrors      *prometheus.CounterVec
	upstreamResponses *prometheus.CounterVec
	ttft              *prometheus.HistogramVec

	// Resolved children of the series every request touches: a label
	// lookup hashes each value on every call, which cost about 8 % of a
	// request's CPU. Keys are bounded (routes, served models, standard
	// methods, statuses), so the caches are too.
	admitted prometheus.Counter
	routes   readmap.Map[routeKey, *routeMetrics]
	// lastRoute is the series each route and streaming flag was last
	// resolved to: with one model served, every request's. Comparing its
	// key costs ~4 ns (the labels are the same strings, so each compare
	// stops at their pointers); a lookup in routes hashes the key, ~37 ns.
	// Models taking turns cost a store in the slot per change.
	lastRoute [len(routeNames)][2]atomic.Pointer[routeMetrics]
	http      readmap.Map[httpKey, *httpMetrics]
	statuses  readmap.Map[int, prometheus.Counter] // smg_http_responses_total without an error code
}

type routeKey struct {
	backend string
	route   routeKind
	model   string
	stream  bool
}

// routeMetrics are one route's (and model's) smg_router_* series and TTFT.
type routeMetrics struct {
	key      routeKey
	requests prometheus.Counter
	duration prometheus.Observer
	ttft     prometheus.Observer
}

func (m *metrics) forRoute(k routeKey) *routeMetrics {
	last := &m.lastRoute[k.route][boolIndex(k.stream)]
	if v := last.Load(); v != nil && v.key == k {
		return v
	}
	v, ok := m.routes.Load(k)
	if !ok {
		endpoint := k.route.String()
		v = m.routes.LoadOrStore(k, &routeMetrics{
			key:      k,
			requests: m.routerRequests.WithLabelValues("http", k.backend, "http", k.model, endpoint, boolLabel(k.stream)),
			duration: m.routerDuration.WithLabelValues("http", k.backend, "http", k.model, endpoint),
			ttft:     m.ttft.WithLabelValues(k.backend, endpoint),
		})
	}
	last.Store(v)
	return v
}

func boolIndex(b bool) int {
	if b {
		return 1
	}
	return 0
}

type httpKey struct{ method, path string }

type httpMetrics struct {
	requests prometheus.Counter
	duration prometheus.Observer
}

// observeHTTP counts one request on the smg_http_* families.
func (m *metrics) observeHTTP(method, path string, status int, errorCode []byte, seconds float64) {
	k := httpKey{method, path}
	hm, ok := m.http.Load(k)
	if !ok {
		// handle passes known methods only (knownMethod), so the key set is bounded.
		hm = m.http.LoadOrStore(k, &httpMetrics{requests: m.httpRequests.WithLabelValues(method, path), duration: m.httpDuration.WithLabelValues(method, path)})
	}
	hm.requests.Inc()
	hm.duration.Observe(seconds)
	if len(errorCode) > 0 {
		m.httpResponses.WithLabelValues(statusLabel(status), string(errorCode)).Inc()
		return
	}
	c, ok := m.statuses.Load(status)
	if !ok {
		c = m.statuses.LoadOrStore(status, m.httpResponses.WithLabelValues(statusLabel(status), ""))
	}
	c.Inc()
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		httpRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "smg_http_requests_total", Help: "HTTP requests received.",
		}, []string{"method", "path"}),
		httpDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "smg_http_request_duration_seconds", Help: "HTTP request duration.", Buckets: durationBuckets,
		}, []string{"method", "path"}),
		httpResponses: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "smg_http_responses_total", Help: "HTTP responses sent.",
		}, []string{"status_code", "error_code"}),
		httpConnections: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "smg_http_connections_active", Help: "Open client connections.",
		}),
		rateLimit: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "smg_http_rate_limit_total", Help: "Admission decisions.",
		}, []string{"result"}),
		routerRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "smg_router_requests_total", Help: "Requests routed.",
		}, []string{"router_type", "backend_type", "connection_mode", "model", "endpoint", "streaming"}),
		routerDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "smg_router_request_duration_seconds", Help: "Duration of successful routed requests.", Buckets: durationBuckets,
		}, []string{"router_type", "backend_type", "connection_mode", "model", "endpoint"}),
		routerErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "smg_router_request_errors_total", Help: "Routed requests that failed.",
		}, []string{"router_type", "backend_type", "connection_mode", "model", "endpoint", "error_type"}),
		upstreamResponses: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "smg_router_upstream_responses_total", Help: "Upstream responses by status.",
		}, []string{"router_type", "status_code", "error_code"}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "pdrouter_time_to_first_byte_seconds", Help: "Time from request to the first response byte sent to the client.", Buckets: durationBuckets,
		}, []string{"backend_type", "endpoint"}),
	}
	m.admitted = m.rateLimit.WithLabelValues("allowed")
	reg.MustRegister(m.httpRequests, m.httpDuration, m.httpResponses, m.httpConnections, m.rateLimit,
		m.routerRequests, m.routerDuration, m.routerErrors, m.upstreamResponses, m.ttft)
	return m
}

// statusLabel avoids an allocation for the statuses that are nearly all traffic.
func statusLabel(code int) string {
	switch code {
	case 200:
		return "200"
	case 400:
		return "400"
	case 500:
		return "500"
	case 503:
		return "503"
	}
	return strconv.Itoa(code)
}

func since(t time.Time) float64 { return time.Since(t).Seconds() }

// headerErrorCode is X-SMG-Error-Code as fasthttp keeps it: it normalizes
// names as they are set or parsed (the server leaves normalizing on).
var headerErrorCode = []byte("X-Smg-Error-Code")

// errorCode is the response's X-SMG-Error-Code, smg_http_responses_total's
// label, found without normalizing the name again for every request.
func errorCode(ctx *fasthttp.RequestCtx) []byte {
	return ctx.Response.Header.PeekCanonical(headerErrorCode)
}

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
