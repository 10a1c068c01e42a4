package balancer

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdrouter/pdrouter/internal/readmap"
)

// Metrics holds the worker, breaker, retry and policy series of spec §6.1.
// Per-worker gauges are read from the registry at scrape time, so removed
// workers vanish without bookkeeping. All methods are no-ops on nil.
type Metrics struct {
	reg prometheus.Registerer

	healthChecks     *prometheus.CounterVec
	selection        *prometheus.CounterVec
	errors           *prometheus.CounterVec
	cbTransitions    *prometheus.CounterVec
	cbOutcomes       *prometheus.CounterVec
	ejections        *prometheus.CounterVec
	ejectOverflow    *prometheus.CounterVec
	retries          *prometheus.CounterVec
	retriesExhausted *prometheus.CounterVec
	retryBackoff     *prometheus.HistogramVec
	manualEntries    prometheus.Gauge
	branches         map[string]*prometheus.CounterVec // by policy name
	selected         readmap.Map[selectionKey, prometheus.Counter]
}

// selectionKey caches resolved selection counters: resolving four labels
// costs more than the rest of a round-robin pick.
type selectionKey struct {
	typ           WorkerType
	model, policy string
}

// NewMetrics registers the series on reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, labels)
	}
	m := &Metrics{
		reg:              reg,
		healthChecks:     counter("smg_worker_health_checks_total", "Health probes by outcome.", "worker_type", "result"),
		selection:        counter("smg_worker_selection_total", "Workers chosen by a policy.", "worker_type", "connection_mode", "model", "policy"),
		errors:           counter("smg_worker_errors_total", "Failed upstream attempts.", "worker_type", "connection_mode", "error_type"),
		cbTransitions:    counter("smg_worker_cb_transitions_total", "Circuit breaker state changes.", "worker", "from", "to"),
		cbOutcomes:       counter("smg_worker_cb_outcomes_total", "Outcomes fed to circuit breakers.", "worker", "outcome"),
		ejections:        counter("smg_worker_outlier_ejections_total", "Workers ejected (breaker opened), by reason: consecutive_failures or stall.", "worker_type", "reason"),
		ejectOverflow:    counter("smg_worker_outlier_ejections_overflow_total", "Ejections refused: --outlier-max-ejection-percent of the pool was unavailable.", "worker_type", "reason"),
		retries:          counter("smg_worker_retries_total", "Retried attempts.", "worker_type", "endpoint"),
		retriesExhausted: counter("smg_worker_retries_exhausted_total", "Requests that used every attempt.", "worker_type", "endpoint"),
		retryBackoff: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "smg_worker_retry_backoff_seconds", Help: "Backoff slept before a retry.",
			Buckets: []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30},
		}, []string{"attempt"}),
		manualEntries: prometheus.NewGauge(prometheus.GaugeOpts{Name: "smg_manual_policy_cache_entries", Help: "Routing keys held by the manual policy."}),
		branches: map[string]*prometheus.CounterVec{
			"manual":             counter("smg_manual_policy_branch_total", "Manual policy decisions.", "branch"),
			"consistent_hashing": counter("smg_consistent_hashing_policy_branch_total", "Consistent hashing decisions.", "branch"),
			"prefix_hash":        counter("smg_prefix_hash_policy_branch_total", "Prefix hash decisions.", "branch"),
			"cache_aware":        counter("smg_cache_aware_policy_branch_total", "Cache-aware decisions.", "branch"),
		},
	}
	cs := []prometheus.Collector{m.healthChecks, m.selection, m.errors, m.cbTransitions, m.cbOutcomes,
		m.ejections, m.ejectOverflow, m.retries, m.retriesExhausted, m.retryBackoff, m.manualEntries}
	for _, b := range m.branches {
		cs = append(cs, b)
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// Selected counts a worker chosen by the named policy.
func (m *Metrics) Selected(w *Worker, policy string) {
	if m == nil {
		return
	}
	// The worker's last counter first: a worker is nearly always chosen by
	// the same policy, and comparing strings that share their bytes costs
	// less than hashing them.
	k := selectionKey{w.Type, w.ModelID, policy}
	st := w.st // nil in a Worker not made by NewWorker: no cache
	if st != nil {
		if last := st.selected.Load(); last != nil && last.metrics == m && last.key == k {
			last.counter.Inc()
			return
		}
	}
	c, ok := m.selected.Load(k)
	if !ok {
		c = m.selected.LoadOrStore(k, m.selection.WithLabelValues(w.Type.String(), connectionMode, w.ModelID, policy))
	}
	if st != nil {
		st.selected.Store(&lastSelection{metrics: m, key: k, counter: c})
	}
	c.Inc()
}

// lastSelection is a worker's most recently used selection counter.
type lastSelection struct {
	metrics *Metrics
	key     selectionKey
	counter prometheus.Counter
}

// WorkerError counts a failed attempt on w (errorType e.g. "status_5xx", "connect").
func (m *Metrics) WorkerError(w *Worker, errorType string) {
	if m != nil {
		m.errors.WithLabelValues(w.Type.String(), connectionMode, errorType).Inc()
	}
}

// Retry counts a retry about to sleep backoff before attempt (1-based) runs again.
func (m *Metrics) Retry(t WorkerType, endpoint string, attempt int, backoff time.Duration) {
	if m != nil {
		m.retries.WithLabelValues(t.String(), endpoint).Inc()
		m.retryBackoff.WithLabelValues(strconv.Itoa(attempt)).Observe(backoff.Seconds())
	}
}

// RetriesExhausted counts a request that failed on its last attempt.
func (m *Metrics) RetriesExhausted(t WorkerType, endpoint string) {
	if m != nil {
		m.retriesExhausted.WithLabelValues(t.String(), endpoint).Inc()
	}
}

// branchCounters resolves a policy's decision counters once, so counting a
// decision is a map lookup and an atomic add. Nil (no metrics) counts nothing.
type branchCounters map[string]prometheus.Counter

func (m *Metrics) branchCounters(policy string, names ...string) branchCounters {
	if m == nil {
		return nil
	}
	bc := branchCounters{}
	for _, n := range names {
		bc[n] = m.branches[policy].WithLabelValues(n)
	}
	return bc
}

func (b branchCounters) inc(name string) {
	if c := b[name]; c != nil {
		c.Inc()
	}
}

func (m *Metrics) setManualEntries(n int) {
	if m != nil {
		m.manualEntries.Set(float64(n))
	}
}

func (m *Metrics) healthCheck(w *Worker, ok bool) {
	if m != nil {
		result := "failure"
		if ok {
			result = "success"
		}
		m.healthChecks.WithLabelValues(w.Type.String(), result).Inc()
	}
}

// instrument wires w's breaker to the breaker series; call before w is published.
func (m *Metrics) instrument(w *Worker) {
	if m == nil || w.Breaker == nil {
		return
	}
	ok, fail := m.cbOutcomes.WithLabelValues(w.URL, "success"), m.cbOutcomes.WithLabelValues(w.URL, "failure")
	w.Breaker.onOutcome = func(success bool) {
		if success {
			ok.Inc()
		} else {
			fail.Inc()
		}
	}
	w.Breaker.onTransition = func(from, to BreakerState) {
		m.cbTransitions.WithLabelValues(w.URL, from.String(), to.String()).Inc()
	}
	w.Breaker.onEject = func(reason string, enforced bool) {
		c := m.ejectOverflow
		if enforced {
			c = m.ejections
		}
		c.WithLabelValues(w.Type.String(), reason).Inc()
	}
}

// forget drops the per-worker series of a removed worker.
func (m *Metrics) forget(url string) {
	if m != nil {
		m.cbOutcomes.DeletePartialMatch(prometheus.Labels{"worker": url})
		m.cbTransitions.DeletePartialMatch(prometheus.Labels{"worker": url})
	}
}

// watch exports the per-worker gauges of reg at scrape time.
func (m *Metrics) watch(reg *Registry) error {
	if m == nil {
		return nil
	}
	return m.reg.Register(workerCollector{reg})
}

// connectionMode is fixed: the router speaks HTTP to workers.
const connectionMode = "http"

var (
	descPoolSize   = prometheus.NewDesc("smg_worker_pool_size", "Registered workers.", []string{"worker_type", "connection_mode", "model"}, nil)
	descActive     = prometheus.NewDesc("smg_worker_requests_active", "Router in-flight requests per worker.", []string{"worker"}, nil)
	descHealth     = prometheus.NewDesc("smg_worker_health", "1 when the worker passes health checks.", []string{"worker"}, nil)
	descCBState    = prometheus.NewDesc("smg_worker_cb_state", "Circuit breaker state: 0 closed, 1 open, 2 half_open.", []string{"worker"}, nil)
	descCBFailures = prometheus.NewDesc("smg_worker_cb_consecutive_failures", "Consecutive failures seen by the breaker.", []string{"worker"}, nil)
	descCBOKs      = prometheus.NewDesc("smg_worker_cb_consecutive_successes", "Consecutive successes seen by the breaker.", []string{"worker"}, nil)
	descSuspect    = prometheus.NewDesc("smg_worker_outlier_suspect", "1 while policies steer around the worker: requests unanswered and its health probe failing, or unanswered past --outlier-first-byte-timeout-secs.", []string{"worker"}, nil)
	descEjected    = prometheus.NewDesc("smg_worker_outlier_ejected", "Workers ejected now (breaker open).", []string{"worker_type"}, nil)
)

type workerCollector struct{ reg *Registry }

func (workerCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descPoolSize, descActive, descHealth, descCBState, descCBFailures, descCBOKs, descSuspect, descEjected} {
		ch <- d
	}
}

func (c workerCollector) Collect(ch chan<- prometheus.Metric) {
	type pool struct{ typ, model string }
	pools := map[pool]int{}
	var ejected [3]int
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	for _, w := range c.reg.Snapshot().All {
		pools[pool{w.Type.String(), w.ModelID}]++
		gauge(descActive, float64(w.Load()), w.URL)
		health := 0.0
		if w.Healthy() {
			health = 1
		}
		gauge(descHealth, health, w.URL)
		if w.Breaker != nil {
			f, s := w.Breaker.Counts()
			gauge(descCBState, float64(w.Breaker.State()), w.URL)
			gauge(descCBFailures, float64(f), w.URL)
			gauge(descCBOKs, float64(s), w.URL)
			if w.Breaker.State() == BreakerOpen {
				ejected[w.Type]++
			}
		}
		suspect := 0.0
		if w.Suspect() {
			suspect = 1
		}
		gauge(descSuspect, suspect, w.URL)
	}
	for p, n := range pools {
		gauge(descPoolSize, float64(n), p.typ, connectionMode, p.model)
	}
	for t, n := range ejected {
		gauge(descEjected, float64(n), WorkerType(t).String())
	}
}
