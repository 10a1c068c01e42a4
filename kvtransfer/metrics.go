package kvtransfer

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the engine's Prometheus series, registered on a caller-owned
// registry (no globals).
type Metrics struct {
	roomsActive *prometheus.GaugeVec
	roomsDone   *prometheus.CounterVec
	bytes       *prometheus.CounterVec
	pages       *prometheus.CounterVec
	duration    *prometheus.HistogramVec
	peers       prometheus.Gauge
}

// NewMetrics creates the series and registers them on reg (nil: unregistered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		roomsActive: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvproxy_rooms_active", Help: "Rooms not yet finished.",
		}, []string{"role"}),
		roomsDone: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvproxy_rooms_total", Help: "Finished rooms by final state.",
		}, []string{"role", "state"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvproxy_bytes_total", Help: "KV bytes moved.",
		}, []string{"direction"}),
		pages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvproxy_pages_total", Help: "KV pages moved.",
		}, []string{"direction"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvproxy_transfer_duration_seconds",
			Help:    "Time spent moving a room's KV (post to flush, all chunks).",
			Buckets: prometheus.ExponentialBuckets(20e-6, 2.5, 16),
		}, []string{"role"}),
		peers: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvproxy_peers", Help: "Connected peer kvproxies.",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.roomsActive, m.roomsDone, m.bytes, m.pages, m.duration, m.peers)
	}
	return m
}
