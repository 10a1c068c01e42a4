package router

import (
	"time"

	"github.com/pdrouter/pdrouter/balancer"
)

// PrefillSpec is one `--prefill URL [PORT|none]`.
type PrefillSpec struct {
	URL           string
	BootstrapPort int // balancer.NoBootstrapPort for none
}

// Config is everything the router needs; cmd/pdrouter fills it from flags
// that mirror sglang-router's launcher.
type Config struct {
	Host string
	Port int

	PDDisaggregation bool
	WorkerURLs       []string
	Prefill          []PrefillSpec
	Decode           []string

	Policy        string
	PrefillPolicy string
	DecodePolicy  string
	PolicyOptions balancer.PolicyOptions

	MaxPayloadSize   int
	APIKey           string
	RequestIDHeaders []string
	RequestTimeout   time.Duration
	ShutdownGrace    time.Duration
	CORSOrigins      []string

	PrometheusHost string
	PrometheusPort int // 0 disables the metrics listener

	Retry     balancer.RetryConfig
	Admission balancer.AdmissionConfig
	Manager   balancer.ManagerConfig // PD and Logger are set by New
}

// DefaultRequestIDHeaders are checked in order for a client request id.
var DefaultRequestIDHeaders = []string{"x-request-id", "x-correlation-id", "x-trace-id", "request-id"}

// DefaultConfig returns sglang-router 0.3.x defaults, except port 8000.
func DefaultConfig() Config {
	return Config{
		Host:             "0.0.0.0",
		Port:             8000,
		Policy:           "cache_aware",
		MaxPayloadSize:   512 << 20,
		RequestIDHeaders: DefaultRequestIDHeaders,
		RequestTimeout:   1800 * time.Second,
		ShutdownGrace:    180 * time.Second,
		PrometheusHost:   "0.0.0.0",
		PrometheusPort:   29000,
		Retry:            balancer.DefaultRetryConfig(),
		Admission:        balancer.AdmissionConfig{QueueSize: 100, QueueTimeout: 60 * time.Second},
		Manager: balancer.ManagerConfig{
			StartupTimeout:  1800 * time.Second,
			StartupInterval: 30 * time.Second,
			Health:          balancer.DefaultHealthConfig(),
			Breaker:         balancer.DefaultBreakerConfig(),
		},
	}
}
