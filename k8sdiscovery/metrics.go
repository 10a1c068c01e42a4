package k8sdiscovery

import "github.com/prometheus/client_golang/prometheus"

// Label values of sglang-router 0.3.x's discovery metrics (spec §6.1).
const (
	source = "kubernetes"

	ResultSuccess   = "success"
	ResultFailed    = "failed"
	ResultDuplicate = "duplicate" // the URL was already a worker

	ReasonPodDeleted = "pod_deleted"
	ReasonReconciled = "reconciled" // unready, relabelled, or its role or bootstrap port changed
)

// Metrics are the smg_discovery_* series. Methods are no-ops on nil.
type Metrics struct {
	registrations   *prometheus.CounterVec
	deregistrations *prometheus.CounterVec
	workers         *prometheus.GaugeVec
}

// NewMetrics registers the series on reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		registrations: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "smg_discovery_registrations_total",
			Help: "Workers discovery asked the router to register, by result."}, []string{"source", "result"}),
		deregistrations: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "smg_discovery_deregistrations_total",
			Help: "Discovered workers removed, by reason."}, []string{"source", "reason"}),
		workers: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "smg_discovery_workers_discovered",
			Help: "Pods that are selected, Running and Ready."}, []string{"source"}),
	}
	for _, c := range []prometheus.Collector{m.registrations, m.deregistrations, m.workers} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func (m *Metrics) registered(result string) {
	if m != nil {
		m.registrations.WithLabelValues(source, result).Inc()
	}
}

func (m *Metrics) deregistered(reason string) {
	if m != nil {
		m.deregistrations.WithLabelValues(source, reason).Inc()
	}
}

func (m *Metrics) discovered(n int) {
	if m != nil {
		m.workers.WithLabelValues(source).Set(float64(n))
	}
}
