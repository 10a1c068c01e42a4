package router

import (
	"fmt"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/pdrouter/pdrouter/balancer"
	"github.com/pdrouter/pdrouter/internal/tlsconfig"
	"github.com/pdrouter/pdrouter/router/cpauth"
)

// PrefillSpec is one `--prefill URL [PORT|none]`.
type PrefillSpec struct {
	URL           string
	BootstrapPort int // balancer.NoBootstrapPort for none
}

// Config is everything the router needs; cmd/pdrouter fills it from flags
// that mirror sglang-router's launcher, starting from DefaultConfig.
type Config struct {
	Host string
	Port int

	PDDisaggregation bool
	WorkerURLs       []string
	Prefill          []PrefillSpec
	Decode           []string

	// VLLMPDDisaggregation serves vLLM's PD protocol (vllm.go) instead of
	// SGLang's; it needs PDDisaggregation too, which --vllm-pd-disaggregation sets.
	VLLMPDDisaggregation bool

	Policy        string
	PrefillPolicy string // PD only; "" = Policy
	DecodePolicy  string // PD only; "" = Policy
	PolicyOptions balancer.PolicyOptions

	MaxPayloadSize   int
	APIKey           string
	RequestIDHeaders []string
	RequestTimeout   time.Duration
	ShutdownGrace    time.Duration
	CORSOrigins      []string

	// Client connections: MaxConnections open at most (0: what the fd
	// limit holds, DefaultMaxConnections), heads up to MaxHeaderSize bytes
	// (431 beyond), read within HeaderReadTimeout, bodies within
	// BodyReadTimeout once the head is in, and a keep-alive connection
	// closed after IdleConnectionTimeout idle.
	MaxConnections        int
	MaxHeaderSize         int
	HeaderReadTimeout     time.Duration
	BodyReadTimeout       time.Duration
	IdleConnectionTimeout time.Duration

	// EventLoops serve regular mode's plain-HTTP requests on that many
	// event loops (evloop.go, Linux); 0: on fasthttp, as every other.
	EventLoops int

	// StreamIdleTimeout ends a stream whose worker sent no byte for that
	// long after its first (0: never): one SSE error event, both legs
	// cancelled and their engines told to abort.
	StreamIdleTimeout time.Duration
	// UpstreamIdleTimeout closes a pooled worker connection unused for that
	// long; below the engines' keep-alive (uvicorn's 5 s), so the router,
	// not the worker, closes it.
	UpstreamIdleTimeout time.Duration

	// AbortTimeout bounds each POST /abort_request the router sends to an
	// engine still holding a request whose client left or timed out; 0
	// sends none (abort.go).
	AbortTimeout time.Duration

	PrometheusHost string
	PrometheusPort int // 0 disables the metrics listener

	Retry     balancer.RetryConfig
	Admission balancer.AdmissionConfig
	Manager   balancer.ManagerConfig // PD and Logger are set by New

	// HTTPS front end (--tls-cert-path, --tls-key-path): both or neither;
	// the pair is reloaded when its files change.
	TLSCertPath, TLSKeyPath string
	// WorkerTLS is --ca-cert-paths and --client-cert-path/--client-key-path,
	// used on every connection to an https worker.
	WorkerTLS    tlsconfig.ClientOptions
	ControlPlane cpauth.Config

	Trace TraceConfig // OpenTelemetry traces (trace.go)
}

// DefaultConfig returns sglang-router 0.3.x defaults, except port 8000: the
// one place the router's and the CLI's defaults come from.
func DefaultConfig() Config {
	return Config{
		Host:             "0.0.0.0",
		Port:             8000,
		Policy:           "cache_aware",
		PolicyOptions:    balancer.DefaultPolicyOptions(),
		MaxPayloadSize:   512 << 20,
		RequestIDHeaders: []string{"x-request-id", "x-correlation-id", "x-trace-id", "request-id"}, // checked in order
		RequestTimeout:   1800 * time.Second,
		ShutdownGrace:    180 * time.Second,
		AbortTimeout:     2 * time.Second,
		PrometheusHost:   "0.0.0.0",
		PrometheusPort:   29000,
		Retry:            balancer.DefaultRetryConfig(),
		Admission:        balancer.AdmissionConfig{MaxConcurrent: -1, QueueSize: 100, QueueTimeout: 60 * time.Second},
		Manager:          balancer.DefaultManagerConfig(),
		Trace:            TraceConfig{Endpoint: DefaultOTLPTracesEndpoint},

		MaxHeaderSize:         64 << 10,
		HeaderReadTimeout:     30 * time.Second,
		BodyReadTimeout:       300 * time.Second,
		IdleConnectionTimeout: 60 * time.Second,
		EventLoops:            runtime.GOMAXPROCS(0),
		StreamIdleTimeout:     300 * time.Second,
		UpstreamIdleTimeout:   3 * time.Second,
	}
}

// ConfigError is the first rule a Config breaks. Its text is
// sglang-router's ("Configuration validation failed: ..."), which the CLI
// prints as it is.
type ConfigError struct{ Rule string }

func (e *ConfigError) Error() string { return "Configuration validation failed: " + e.Rule }

func invalid(format string, args ...any) error {
	return &ConfigError{Rule: fmt.Sprintf(format, args...)}
}

// Validate applies sglang-router's checks (src/config/validation.rs) and
// pdrouter's own; router.New calls it, so a Config built in Go is held to
// what the CLI accepts. It returns a *ConfigError.
func (c Config) Validate() error {
	for _, u := range c.workerURLs() {
		if err := validWorkerURL(u); err != nil {
			return err
		}
	}
	for _, p := range c.Prefill {
		if p.BootstrapPort != balancer.NoBootstrapPort && (p.BootstrapPort <= 0 || p.BootstrapPort > 65535) {
			return invalid("bootstrap port %d of %s must be in 1..65535", p.BootstrapPort, p.URL)
		}
	}
	if err := c.validPolicies(); err != nil {
		return err
	}
	if err := c.validSecurity(); err != nil {
		return err
	}
	if err := c.Trace.validTrace(); err != nil {
		return err
	}
	po, r, a, m := c.PolicyOptions, c.Retry, c.Admission, c.Manager
	for _, check := range []struct {
		bad  bool
		rule string
	}{
		{c.Port <= 0 || c.Port > 65535, "port must be in 1..65535"},
		{c.VLLMPDDisaggregation && !c.PDDisaggregation, "vllm_pd_disaggregation needs pd_disaggregation"},
		{c.PrometheusPort < 0 || c.PrometheusPort > 65535, "prometheus_port must be in 0..65535"},
		{po.CacheThreshold < 0 || po.CacheThreshold > 1, "cache_threshold must be in [0, 1]"},
		{po.BalanceRelThreshold < 1, "balance_rel_threshold must be >= 1.0"},
		{po.EvictionInterval <= 0, "eviction_interval must be > 0"},
		{po.MaxTreeSize <= 0, "max_tree_size must be > 0"},
		{!slices.Contains(balancer.AssignmentModes(), po.AssignmentMode),
			"assignment_mode must be one of " + strings.Join(balancer.AssignmentModes(), ", ")},
		{r.MaxRetries < 1, "retry max_retries must be >= 1"},
		{r.InitialBackoff <= 0, "retry initial_backoff_ms must be > 0"},
		{r.MaxBackoff < r.InitialBackoff, "retry max_backoff_ms must be >= initial_backoff_ms"},
		{r.Multiplier < 1, "retry backoff_multiplier must be >= 1"},
		{r.Jitter < 0 || r.Jitter > 1, "retry jitter_factor must be in [0, 1]"},
		{m.Breaker.FailureThreshold < 1 || m.Breaker.SuccessThreshold < 1, "circuit breaker thresholds must be >= 1"},
		{m.Breaker.OpenDuration <= 0, "circuit breaker durations must be > 0"},
		{m.Breaker.MaxEjectionPercent < 1 || m.Breaker.MaxEjectionPercent > 100, "outlier_max_ejection_percent must be in 1..100"},
		{m.Breaker.StallTimeout < 0 || m.Breaker.MaxOpenDuration < 0, "outlier durations must be >= 0"},
		{a.QueueSize > 0 && a.QueueTimeout <= 0, "queue_timeout_secs must be > 0 when queue_size > 0"},
		{a.QueueSize < 0, "queue_size must be >= 0"},
		{c.RequestTimeout <= 0, "request_timeout_secs must be > 0"},
		{c.AbortTimeout < 0, "abort_timeout_ms must be >= 0 (0 sends no engine aborts)"},
		{m.StartupTimeout <= 0 || m.StartupInterval <= 0, "worker startup timeout and check interval must be > 0"},
		{m.Health.FailureThreshold < 1 || m.Health.SuccessThreshold < 1, "health check thresholds must be >= 1"},
		{m.Health.Timeout <= 0 || m.Health.Interval <= 0, "health check timeout and interval must be > 0"},
		{c.MaxPayloadSize <= 0, "max_payload_size must be > 0"},
		{c.MaxConnections < 0, "max_connections must be >= 0"},
		{c.MaxHeaderSize < 4<<10, "max_header_size must be >= 4096"},
		{c.HeaderReadTimeout <= 0 || c.BodyReadTimeout <= 0 || c.IdleConnectionTimeout <= 0,
			"header_read_timeout_secs, body_read_timeout_secs and idle_connection_timeout_secs must be > 0"},
		{c.StreamIdleTimeout < 0, "stream_idle_timeout_secs must be >= 0 (0: no stream idle timeout)"},
		{c.UpstreamIdleTimeout <= 0, "upstream_pool_idle_timeout_secs must be > 0"},
		{c.EventLoops < 0 || c.EventLoops > 1024, "event_loops must be in 0..1024 (0: none)"},
	} {
		if check.bad {
			return invalid("%s", check.rule)
		}
	}
	return nil
}

// workerURLs lists every worker URL the config names, in either mode.
func (c Config) workerURLs() []string {
	urls := slices.Clone(c.WorkerURLs)
	for _, p := range c.Prefill {
		urls = append(urls, p.URL)
	}
	return append(urls, c.Decode...)
}

func validWorkerURL(u string) error {
	scheme, rest, ok := strings.Cut(u, "://")
	if !ok || (scheme != "http" && scheme != "https" && scheme != "grpc") || rest == "" || rest[0] == '/' || rest[0] == ':' {
		return invalid("invalid worker URL %q: must start with http://, https:// or grpc:// and have a host", u)
	}
	if scheme == "grpc" {
		return invalid("worker URL %q: gRPC workers are not supported by pdrouter", u)
	}
	return nil
}

// validPolicies checks every policy named against the policy table, and
// that power_of_two has two workers to compare on each side it serves.
func (c Config) validPolicies() error {
	for _, p := range []struct {
		role, name  string
		prefillSide bool
	}{{"policy", c.Policy, false}, {"prefill policy", c.PrefillPolicy, true}, {"decode policy", c.DecodePolicy, false}} {
		if p.name == "" && p.role != "policy" {
			continue // the side follows Policy
		}
		info, ok := balancer.LookupPolicy(p.name)
		if !ok {
			return invalid("unknown %s %q (choose from %s)", p.role, p.name, strings.Join(balancer.PolicyNames(p.prefillSide), ", "))
		}
		if info.PrefillOnly && !p.prefillSide {
			return invalid("%s is not allowed as the %s", p.name, p.role)
		}
	}
	// One worker alone is a mistake; none is fine, workers may join through
	// the API. As 0.3.x, --policy counts the workers of both PD sides
	// together (1 prefill + 1 decode passes); a side's own policy counts
	// that side.
	workers := len(c.WorkerURLs)
	if c.PDDisaggregation {
		workers = len(c.Prefill) + len(c.Decode)
	}
	if c.Policy == "power_of_two" && workers == 1 {
		return invalid("power_of_two policy requires at least 2 workers")
	}
	if !c.PDDisaggregation {
		return nil
	}
	if c.PrefillPolicy == "power_of_two" && len(c.Prefill) == 1 {
		return invalid("power_of_two policy requires at least 2 prefill workers")
	}
	if c.DecodePolicy == "power_of_two" && len(c.Decode) == 1 {
		return invalid("power_of_two policy requires at least 2 decode workers")
	}
	return nil
}
